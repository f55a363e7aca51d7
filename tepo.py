"""tepo: the group-relative RL objectives used to train LLMs to reason, in one readable file.

Read it top to bottom, like a chapter:

  1. Building blocks   masked means, group-relative advantages, loss aggregation, KL estimators, token log-probs.
  2. Configuration     one dataclass with every switch, checked once when it is made; each paper's defaults.
  3. The GRPO family   one skeleton, `objective`, then the input checks and the metrics it wraps around every
                       objective's maths; then each objective, its maths alone, next to the pieces it alone needs,
                       in the order of the papers: PPO-clip (token ratio, clipped surrogate); GRPO, DAPO, Dr. GRPO
                       (PPO-clip's loss under each paper's settings; DAPO's data side); CISPO (a clipped weight);
                       GSPO, GSPO-token (sequence ratio); GMPO (geometric mean); SAPO (a smooth gate); MPO.
  4. Entropy mathematics  the entropy from logits, and why it falls: the entropy-covariance derivation
                       (Cui et al. 2505.22617; TEPO's appendix) step by step; the live check used by train_small.py.
  5. The remedies      the entropy bonus; Clip-Cov and KL-Cov, built on section 4's covariance; TEPO's KL mask.
  6. By name           OBJECTIVES, FIELDS_READ (the switches each objective reads), needs_ref, needs_entropy.

Every objective has the same signature
    fn(logp, old_logp, advantages, mask, cfg, *, ref_logp=None, entropy=None, old_entropy=None,
       sampler_logp=None, num_tokens=None, num_seqs=None) -> (loss, metrics)

Honest labels. PPO-clip, GRPO, DAPO, Dr. GRPO, CISPO, GSPO, GMPO, SAPO, Clip-Cov and KL-Cov follow their
papers and the verl (0.9.1) / TRL (1.16) implementations (where those differ, the docstring says which one
tepo follows). TEPO (arXiv 2510.09369, 2604.12736) and MPO (arXiv 2602.14386) have no public code and
only their abstracts are public: their objectives here are RECONSTRUCTIONS, and every ambiguous choice
is a switch in ObjectiveConfig (tepo_loss in section 5 and mpo_loss in section 3 say what is public and
what is ours; so does the README's "Honest labels").

Tensor layout (all objectives):
  B  sequences in the (mini-)batch = prompts x G, groups contiguous (rows g*G .. g*G+G-1 share a prompt)
  T  padded response length, V vocabulary size
  logp, old_logp, ref_logp   [B, T]  log-prob of each sampled token (only logp carries gradient)
  mask                       [B, T]  1 for response tokens that are trained, 0 for padding (bool or 0/1)
  advantages                 [B] or [B, T], always treated as constants
Every objective refuses (one-line ValueError naming the argument) a NaN or inf where mask is 1, a mask
that is not 0/1 and a shape mismatch; padding may hold anything. An empty batch gives a loss of 0.

Flags: `python train_small.py --objective <name>` trains with PAPER_DEFAULTS[<name>]; every field of
ObjectiveConfig is a flag there too (eps_low -> --eps-low, ...).

Importing this module needs torch only. A 20-second tour of every objective: python -m tepokit.tools.tour
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

__all__ = [
    # 1. building blocks
    "masked_sum", "masked_mean", "ADVANTAGE_SCALES", "group_advantages", "AGGREGATIONS", "aggregate_loss",
    "KL_ESTIMATORS", "kl_penalty", "sampler_correction_weight", "top_entropy_mask", "token_logprobs_from_logits",
    # 2. configuration
    "ObjectiveConfig", "RATIO_MODES", "ENTROPY_CRITERIA", "KL_TARGETS", "KL_MODES", "CLIP_CHOICES", "BLOCK_RATIOS",
    "BLOCK_AGGREGATIONS", "CISPO_WEIGHTS", "SAMPLER_CORRECTIONS", "check_config",
    "InvalidSetting", "PAPER_DEFAULTS", "config_for",
    # 3. the GRPO family: the skeleton, then each objective with the pieces it alone needs
    "ObjectiveInputs", "PolicyTerms", "objective", "token_log_ratio", "clipped_surrogate", "ppo_clip_loss",
    "grpo_loss", "dapo_loss", "dr_grpo_loss", "dynamic_sampling_mask", "soft_overlong_punishment", "cispo_loss",
    "sequence_log_ratio", "gspo_loss", "gspo_token_loss", "gmpo_loss", "sapo_loss", "block_index", "block_log_ratio",
    "mpo_loss",
    # 4. entropy mathematics
    "entropy_from_logprobs", "softmax_entropy", "entropy_from_logits", "softmax_log_jacobian",
    "entropy_grad_wrt_logits", "fisher_matrix", "policy_gradient_step", "natural_gradient_step",
    "first_order_entropy_change", "entropy_change_prediction",
    # 5. the remedies; 6. the objectives by name
    "entropy_bonus", "token_covariance", "clip_cov_loss", "kl_cov_loss", "tepo_kl_mask", "random_clip_like",
    "tepo_loss", "OBJECTIVES",
    "TRAINER_FIELDS", "FIELDS_READ", "OPTION_FIELDS", "needs_ref", "needs_entropy",
]


class InvalidSetting(ValueError):
    """A setting outside its valid values, in one line: `<name>=<value> is not valid; choose <valid>`.
    A ValueError, with the parts kept (name, value, valid) for a caller that says it in its own words
    (train_small.py names the flag)."""

    def __init__(self, name: str, value, valid: str):
        super().__init__(f"{name}={value!r} is not valid; choose {valid}")
        self.name, self.value, self.valid = name, value, valid


def _check_choice(name: str, value, choices) -> None:
    """InvalidSetting naming the argument, the bad value and the valid choices."""
    if value not in choices:
        raise InvalidSetting(name, value, "one of: " + ", ".join(map(str, choices)))


# =====================================================================================================
# 1. Building blocks
# =====================================================================================================

# ---- masked reductions ------------------------------------------------------------------------------
# torch.where, not x * mask: a NaN or inf sitting at a padded position would survive 0 * NaN = NaN
# and leak into the loss or the logged metrics (test_tepo.py, property 43).

def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of x over the positions where mask is 1 (all of them, or along `dim`)."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x over valid positions; 0 (not NaN) where nothing is valid."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def _per_position(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A row's value at every position of that row: [B] -> like's shape [B, T] (or [B, J] blocks).
    Values already [B, T] (per-token advantages) stay as they are."""
    return values.unsqueeze(-1).expand(like.shape) if values.dim() == 1 else values


# ---- group-relative advantages (GRPO, arXiv 2402.03300; Dr. GRPO, arXiv 2503.20783) ------------------

ADVANTAGE_SCALES = ("group", "batch", "none")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] -> [B / G, G], checking that the batch is a whole number of contiguous groups."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected shape [B], got {tuple(rewards.shape)}")
    if int(group_size) != group_size or group_size < 1:
        raise InvalidSetting("group_size", group_size, "an integer >= 1")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"rewards: a batch of {rewards.numel()} is not a whole number of groups of "
                         f"group_size={group_size}; choose a group_size that divides the batch")
    return rewards.view(-1, int(group_size))


@torch.no_grad()
def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean(group)) / (std + eps), one number per sequence.            [B] -> [B]

    scale="group": GRPO (std of the group; verl, TRL scale_rewards="group").
    scale="batch": mean per group, std over the whole batch (TRL scale_rewards="batch").
    scale="none":  Dr. GRPO, r_i - mean(group) (verl norm_adv_by_std_in_grpo=False, TRL "none").
    std is the unbiased (Bessel) sample std, as in verl and TRL. A group of one sample has no
    baseline: mean 0 and std 1, as in verl. A group whose rewards are all equal gets A = 0: it
    carries no learning signal, which is why DAPO filters such groups out.
    """
    _check_choice("advantage_scale", scale, ADVANTAGE_SCALES)
    r = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    grouped = _grouped(r, group_size)                                       # [n_groups, G]
    if group_size == 1:
        mean, std = torch.zeros_like(grouped), torch.ones_like(grouped)
    else:
        mean, std = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    if scale == "batch":
        std = r.std() if r.numel() > 1 else torch.ones((), dtype=r.dtype, device=r.device)
    centred = grouped - mean
    # exactly 0 for a group of equal rewards (the float mean of equal numbers can be off by an ulp)
    all_equal = (grouped.amax(1, keepdim=True) == grouped.amin(1, keepdim=True)) & (group_size > 1)
    centred = torch.where(all_equal, torch.zeros_like(centred), centred)
    adv = centred if scale == "none" else centred / (std + eps)
    return torch.nan_to_num(adv).view(-1)


# ---- loss aggregation (verl's names) ----------------------------------------------------------------

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *, num_tokens=None,
                   num_seqs=None, norm_constant=None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar. How it is reduced decides how much each token
    and each sequence weighs, and so how length biases the gradient.

      token-mean              sum_{i,t} l / sum_{i,t} m       every token weighs the same (DAPO)
      seq-mean-token-mean     (1/B') sum_i mean_t l           every sequence weighs the same, so a
                                                               token of a long answer weighs less (GRPO)
      seq-mean-token-sum      (1/B') sum_i sum_t l            long answers weigh more
      seq-mean-token-sum-norm sum_{i,t} l / (B * C)           a constant C (default T; Dr. GRPO's
                                                               max generation length): no length bias
    B' counts non-empty sequences. Gradient accumulation: pass num_tokens (token-mean) or num_seqs (the seq-*
    modes) counted over ALL micro-batches of one optimizer step, and the sum of the micro-batch losses equals the
    loss of the whole batch, gradient included (test_tepo.py, property 41). seq-mean-token-sum-norm divides by
    B * C as verl 0.9.1's agg_loss does (verl counts only non-empty sequences in B when it is given no global
    count; here B is every row). An empty batch (no valid token, or B = 0, or T = 0) gives exactly 0 with a zero
    gradient in every mode: a divisor of 0 (num_tokens=0 or num_seqs=0 for an empty step, B * C = 0) divides by 1,
    since the sum it divides is then a sum over no position. A count of 0 with valid tokens is refused.
    """
    _check_choice("aggregation", mode, AGGREGATIONS)
    valid = mask.bool()
    lengths = valid.sum(-1)                                                 # [B]
    if mode == "token-mean":
        denom = lengths.sum().clamp(min=1) if num_tokens is None else _global_count("num_tokens", num_tokens, valid)
        return masked_sum(loss_mat, valid) / denom
    if mode == "seq-mean-token-sum-norm":
        C = loss_mat.shape[-1] if norm_constant is None else norm_constant
        n = loss_mat.shape[0] if num_seqs is None else _global_count("num_seqs", num_seqs, valid)
        return masked_sum(loss_mat, valid) / _nonzero(n * C)
    per_seq = masked_sum(loss_mat, valid, dim=-1)                           # [B]
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / lengths.clamp(min=1)
    n = (lengths > 0).sum().clamp(min=1) if num_seqs is None else _global_count("num_seqs", num_seqs, valid)
    return per_seq.sum() / n


def _nonzero(divisor):
    """divisor, or 1 where it is 0 (a number or a tensor): dividing a sum over no position by it gives 0."""
    if torch.is_tensor(divisor):
        return torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    return divisor if divisor != 0 else 1


def _global_count(name: str, count, valid: torch.Tensor):
    """A caller's token or sequence count over all micro-batches, 0 replaced by 1 (an empty step).

    A count of 0 or less while this micro-batch has valid tokens can only give inf or a wrong sign:
    refused. Tensor counts are not inspected (that would cost a device sync on every call).
    """
    if not torch.is_tensor(count) and (count < 0 or (count == 0 and bool(valid.any()))):
        raise ValueError(f"{name}={count!r} is not valid for a micro-batch with {int(valid.sum())} valid tokens; "
                         f"pass the count over all micro-batches of the step (> 0)")
    return _nonzero(count)


# ---- KL estimators (Schulman's k1 / k2 / k3, "Approximating KL divergence", 2020) ------------------

KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "k1+", "k3+")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by pi_theta.       [B, T]

    With x = log pi_theta - log pi_ref at the sampled token:
      k1  = x                  unbiased in value, can be negative, noisy
      abs = |x|                KL-Cov's penalty; gradient sign(x), 0 at x = 0
      k2  = x^2 / 2            biased in value, but its gradient is the KL gradient direction
      k3  = exp(-x) + x - 1    unbiased and >= 0 (GRPO's choice). verl clamps -x to [-20, 20] and
                               the result to [-10, 10]; so do we (_metrics logs KL to pi_old unclamped).
      k1+, k3+                 straight-through: the value of k1 / k3 with the gradient of k2
    The penalty is not masked here: the aggregation masks it, exactly once (test_tepo.py, property 39).
    """
    _check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    x = logp - ref_logp
    if estimator == "k1":
        return x
    if estimator == "abs":
        return x.abs()
    k2 = 0.5 * x.square()
    if estimator == "k2":
        return k2
    k3 = (torch.exp((-x).clamp(-20, 20)) + x - 1).clamp(-10, 10)
    if estimator == "k3":
        return k3
    value = x if estimator == "k1+" else k3
    return k2 - k2.detach() + value.detach()


# ---- two options of every objective, which `objective` (section 3) applies to the policy-gradient loss -----
def sampler_correction_weight(log_ratio, mask, mode: str = "truncate", cap: float = 2.0) -> torch.Tensor:
    """The sampler's mismatch corrected: rho_t = exp(log_ratio) = pi_old / pi_sampler, pi_old as the trainer recomputes
    it (bf16, other kernels, CUDA graphs round otherwise). truncate: w_t = min(rho_t, cap) (truncated IS, Yao et al.
    2025; verl: no lower bound); mask: w_t = rho_t, 0 past the cap (TRL's token_mask; verl's IcePop adds a lower
    bound). Detached (no gradient); 1 at padding. Flags: --sampler-correction, --sampler-correction-cap.   [B, T]"""
    _check_choice("sampler_correction", mode, SAMPLER_CORRECTIONS[1:])
    rho = torch.exp(torch.where(mask.bool(), log_ratio.detach(), torch.zeros_like(log_ratio)))
    return rho.clamp(max=cap) if mode == "truncate" else torch.where(rho <= cap, rho, torch.zeros_like(rho))


def top_entropy_mask(entropy, mask, share: float) -> torch.Tensor:
    """The forking tokens (Wang et al., arXiv 2506.01939: the top 20 %), bool [B, T]: keep_t = valid_t and H_t >= q,
    q = torch.quantile(H of the valid tokens, 1 - share), linear as TRL's top_entropy_quantile: N distinct entropies
    keep N - ceil((1 - share)(N - 1)). TRL's H is the current policy's, ours the old one's. --top-entropy-share"""
    valid, h = mask.bool(), _at_least_float32(entropy.detach())
    return valid if share >= 1 or not valid.any() else valid & (h >= torch.quantile(h[valid], 1 - share))


# ---- log-probs from logits: where each objective's logp comes from ---------------------------------

def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 -> fp32 (exp and log-softmax need the mantissa); float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / temperature in float32 or finer, a new tensor: the logits the tokens were sampled from.   [..., V]"""
    return _at_least_float32(logits) / temperature


def token_logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor,
                               temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at the sampled tokens.         [B, T, V], [B, T] -> [B, T]

    The temperature must be the sampling temperature: a sample drawn at temperature 0.7 has its probability
    under softmax(z / 0.7), and a ratio against untempered log-probs is wrong (test_tepo.py, property 42).
    logsumexp avoids materialising a second [B, T, V] log-softmax tensor.
    """
    z = _tempered(logits, temperature) if temperature != 1.0 else _at_least_float32(logits)   # T = 1: no copy
    chosen = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(z, dim=-1)


# =====================================================================================================
# 2. Configuration: every switch of every objective, and each paper's defaults
# =====================================================================================================

@dataclass(frozen=True)
class ObjectiveConfig:
    """Every switch of every objective. An objective reads only the fields it documents.

    Checked once, when it is made (check_config; also by dataclasses.replace and config_for, which make
    a new one), and frozen: it cannot change after, so an objective trusts it on every call."""
    # clipping (PPO family, GSPO, TEPO, MPO, Clip-Cov)
    eps_low: float = 0.2             # ratio clipped below at 1 - eps_low
    eps_high: float = 0.2            # ratio clipped above at 1 + eps_high (DAPO's clip-higher: 0.28)
    dual_clip_c: float | None = None  # dual-clip bound c for negative advantages (verl: 3.0); None = off
    log_ratio_clamp: float = 20.0    # log-ratios clamped to +-this before exp, for finite values
    # KL term
    beta: float = 0.0                # coefficient of the objective's KL term (which KL: see each objective)
    kl_estimator: str = "k3"         # k1 | abs | k2 | k3 | k1+ | k3+
    # aggregation
    aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    norm_constant: float | None = None  # C of seq-mean-token-sum-norm; None = padded length T
    # advantages, data and the entropy bonus (read by the trainer, not by the losses)
    advantage_scale: str = "group"   # group | batch | none (Dr. GRPO)
    adv_eps: float = 1e-6            # epsilon in the advantage's std division (verl 1e-6, TRL 1e-4)
    dynamic_sampling: bool = False   # DAPO: drop groups whose rewards are all equal
    overlong_penalty: bool = False   # DAPO: add soft_overlong_punishment to the reward
    entropy_coef: float = 0.0        # entropy bonus: the trainer subtracts coef x the mean entropy from any loss
    # TEPO (our reconstruction; see tepo_loss and tepo_kl_mask, section 5.3)
    ratio_mode: str = "gspo_token"   # gspo_token (sequence ratio carried to tokens) | gmpo (log-space clip)
    entropy_criterion: str = "cov"   # "decreasing entropy" = cov (Cov_{i,t} > 0) | measured (H < H_old)
    kl_target: str = "old"           # masked KL against the rollout policy (old) or the reference (ref)
    kl_mode: str = "soft"            # soft: + beta * M * D | hard: drop masked tokens with D > kl_tau
    kl_tau: float = 0.0              # threshold of the hard mask
    clip_choice: str = "band"        # band: clip the sequences the band clips | random: as many, drawn at random
    # MPO (our reconstruction; see mpo_loss, section 3.7)
    block_size: int = 4              # K tokens per action block
    block_ratio: str = "joint"       # joint (product of K ratios) | geomean (their geometric mean)
    block_agg: str = "seq-mean-block-mean"  # seq-mean-block-mean | block-mean | token-weighted
    # CISPO and SAPO (sections 3.3, 3.6)
    cispo_weight: str = "clip"       # CISPO's w: clip(r, 1 - eps_low, 1 + eps_high) (verl) | cap: min(r, eps_high), TRL
    sapo_tau_pos: float = 1.0        # SAPO's gate temperature where the advantage is > 0
    sapo_tau_neg: float = 1.05       # SAPO's gate temperature where the advantage is <= 0
    # Clip-Cov / KL-Cov (Cui et al. 2505.22617)
    clip_cov_ratio: float = 2e-4     # fraction of valid tokens whose gradient Clip-Cov detaches
    clip_cov_lb: float = 1.0         # lower bound: Clip-Cov candidates have clip_cov_lb < Cov < clip_cov_ub
    clip_cov_ub: float = 5.0         # upper bound of the Clip-Cov candidates' covariance
    kl_cov_ratio: float = 2e-3       # fraction of valid tokens (top Cov) that KL-Cov penalises
    sampler_correction: str = "none"  # none | truncate (weight min(pi_old / pi_sampler, cap)) | mask (0 past the cap)
    sampler_correction_cap: float = 2.0  # the cap C on the weight pi_old / pi_sampler (2 as in verl)
    top_entropy_share: float = 1.0   # train only this share of tokens, those of highest old-policy entropy (1: all)

    def __post_init__(self):
        check_config(self)


# Valid values of switches whose functions come later: here because check_config reads them as a config is made.
RATIO_MODES = ("gspo_token", "gmpo")
ENTROPY_CRITERIA = ("cov", "measured")
KL_TARGETS = ("old", "ref")
KL_MODES = ("soft", "hard")
CLIP_CHOICES = ("band", "random")
BLOCK_RATIOS = ("joint", "geomean")
BLOCK_AGGREGATIONS = ("seq-mean-block-mean", "block-mean", "token-weighted")
CISPO_WEIGHTS = ("clip", "cap")
SAMPLER_CORRECTIONS = ("none", "truncate", "mask")


def check_config(cfg: ObjectiveConfig) -> None:
    """Raise a one-line ValueError for any invalid switch (called when an ObjectiveConfig is made)."""
    _check_choice("aggregation", cfg.aggregation, AGGREGATIONS)
    _check_choice("kl_estimator", cfg.kl_estimator, KL_ESTIMATORS)
    _check_choice("advantage_scale", cfg.advantage_scale, ADVANTAGE_SCALES)
    _check_choice("ratio_mode", cfg.ratio_mode, RATIO_MODES)
    _check_choice("entropy_criterion", cfg.entropy_criterion, ENTROPY_CRITERIA)
    _check_choice("kl_target", cfg.kl_target, KL_TARGETS)
    _check_choice("kl_mode", cfg.kl_mode, KL_MODES)
    _check_choice("block_ratio", cfg.block_ratio, BLOCK_RATIOS)
    _check_choice("block_agg", cfg.block_agg, BLOCK_AGGREGATIONS)
    _check_choice("clip_choice", cfg.clip_choice, CLIP_CHOICES)
    _check_choice("cispo_weight", cfg.cispo_weight, CISPO_WEIGHTS)
    _check_choice("sampler_correction", cfg.sampler_correction, SAMPLER_CORRECTIONS)
    if cfg.clip_choice == "random" and cfg.ratio_mode != "gspo_token":
        raise InvalidSetting("clip_choice", cfg.clip_choice, "band with ratio_mode='gmpo' (random is for gspo_token)")
    for name in ("eps_low", "eps_high", "beta", "kl_tau", "adv_eps", "clip_cov_ratio", "kl_cov_ratio", "entropy_coef"):
        if not getattr(cfg, name) >= 0:
            raise InvalidSetting(name, getattr(cfg, name), "a number >= 0")
    for name in ("log_ratio_clamp", "sapo_tau_pos", "sapo_tau_neg", "sampler_correction_cap"):  # inf: no clamp, ...
        if not 0 < getattr(cfg, name) < math.inf:
            raise InvalidSetting(name, getattr(cfg, name), "a finite number > 0")
    if cfg.dual_clip_c is not None and not cfg.dual_clip_c > 1:
        raise InvalidSetting("dual_clip_c", cfg.dual_clip_c, "a number > 1 or None")
    if cfg.norm_constant is not None and not cfg.norm_constant > 0:
        raise InvalidSetting("norm_constant", cfg.norm_constant, "a number > 0 or None")
    if int(cfg.block_size) != cfg.block_size or cfg.block_size < 1:
        raise InvalidSetting("block_size", cfg.block_size, "an integer K >= 1")
    if not cfg.clip_cov_lb < cfg.clip_cov_ub:
        raise InvalidSetting("clip_cov_lb", cfg.clip_cov_lb, f"clip_cov_lb < clip_cov_ub={cfg.clip_cov_ub!r}")
    if not 0 < cfg.top_entropy_share <= 1:
        raise InvalidSetting("top_entropy_share", cfg.top_entropy_share, "a share in (0, 1]; 1 trains every token")


# Each paper's settings ([P] paper, [I] verl/TRL, [INFERRED] this project's reconstruction).
PAPER_DEFAULTS: dict[str, ObjectiveConfig] = {
    # PPO as used in LLM RL: verl's `vanilla` loss with dual-clip c = 3 [I]
    "ppo": ObjectiveConfig(eps_low=0.2, eps_high=0.2, dual_clip_c=3.0, aggregation="token-mean"),
    # DeepSeekMath: eps 0.2 (conventional), beta 0.04, k3 KL to the reference, per-sequence mean [P/I]
    "grpo": ObjectiveConfig(eps_low=0.2, eps_high=0.2, beta=0.04, kl_estimator="k3",
                            aggregation="seq-mean-token-mean"),
    # DAPO: clip-higher 0.2 / 0.28, token-mean, no KL, dynamic sampling, soft overlong punishment [P]
    "dapo": ObjectiveConfig(eps_low=0.2, eps_high=0.28, aggregation="token-mean",
                            dynamic_sampling=True, overlong_penalty=True),
    # Dr. GRPO: no std in the advantage, sum over tokens / (B * L_max), no KL [P]
    "dr_grpo": ObjectiveConfig(eps_low=0.2, eps_high=0.2, aggregation="seq-mean-token-sum-norm",
                               advantage_scale="none"),
    # CISPO: token-mean, no lower bound on the weight [P]; eps_low 10, eps_high 0.2 from verl's CISPO example [I]
    "cispo": ObjectiveConfig(eps_low=10.0, eps_high=0.2, aggregation="token-mean", cispo_weight="clip"),
    # Entropy mechanism, official 7B scripts: clip range 1 (ratio in [0, 2]), r = 2e-4, (lb, ub) = (1, 5) [I]
    "clip_cov": ObjectiveConfig(eps_low=1.0, eps_high=1.0, aggregation="token-mean",
                                clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0,
                                dynamic_sampling=True),
    # KL-Cov, official 7B scripts: top 0.2 % of tokens by Cov, coefficient 1 [I]
    "kl_cov": ObjectiveConfig(beta=1.0, kl_estimator="abs", aggregation="token-mean",
                              kl_cov_ratio=2e-3, dynamic_sampling=True),
    # GSPO: sequence ratio, eps (3e-4, 4e-4), per-sequence mean, no KL [P]
    "gspo": ObjectiveConfig(eps_low=3e-4, eps_high=4e-4, aggregation="seq-mean-token-mean"),
    "gspo_token": ObjectiveConfig(eps_low=3e-4, eps_high=4e-4, aggregation="seq-mean-token-mean"),
    # GMPO: log-space clip range (e^-0.4, e^0.4), mean over sequences, no KL [P; TRL's GMPOConfig, verl's example]
    "gmpo": ObjectiveConfig(eps_low=0.4, eps_high=0.4, aggregation="seq-mean-token-mean"),
    # SAPO: gate temperatures 1 (A > 0) and 1.05 (A <= 0), per-sequence mean, no KL [P/I]
    "sapo": ObjectiveConfig(sapo_tau_pos=1.0, sapo_tau_neg=1.05, aggregation="seq-mean-token-mean"),
    # TEPO [INFERRED]: GSPO-token ratio, token-mean, KL mask with |delta| to the old policy, beta 1,
    # GSPO's clip range, dynamic sampling as in the entropy-mechanism recipe it likely reused
    "tepo": ObjectiveConfig(eps_low=3e-4, eps_high=4e-4, beta=1.0, kl_estimator="abs",
                            aggregation="token-mean", ratio_mode="gspo_token", entropy_criterion="cov",
                            kl_target="old", kl_mode="soft", dynamic_sampling=True),
    # MPO [INFERRED]: K = 4 joint block ratio, GRPO's clip range and per-sequence mean over blocks
    "mpo": ObjectiveConfig(eps_low=0.2, eps_high=0.2, block_size=4, block_ratio="joint",
                           block_agg="seq-mean-block-mean"),
}


def config_for(name: str, **overrides) -> ObjectiveConfig:
    """The paper defaults of objective `name`, with some fields overridden."""
    _check_choice("objective", name, tuple(PAPER_DEFAULTS))
    known = {f.name for f in dataclasses.fields(ObjectiveConfig)}
    for key in overrides:
        _check_choice("config field", key, tuple(sorted(known)))
    return dataclasses.replace(PAPER_DEFAULTS[name], **overrides)


# =====================================================================================================
# 3. The GRPO family: one skeleton, then each objective's own maths
# =====================================================================================================
# Every objective does four things: check its inputs, compute its per-token terms (the policy-gradient
# loss, the ratio it clips and where it clipped, its KL part), aggregate them into one loss, and report
# metrics. Only the second differs from one objective to another: `objective` does the other three, with
# its checks (_prepare) and metrics (_metrics) right after it, so each objective below is its maths alone.

@dataclass
class ObjectiveInputs:
    """An objective's inputs after the checks (_prepare, below): what its maths reads."""
    logp: torch.Tensor               # [B, T] log pi_theta, float32 or finer, with its gradient
    old_logp: torch.Tensor           # [B, T] log pi_old, detached
    adv: torch.Tensor                # [B, T] advantage of each token (a per-sequence A_i at each token), detached
    advantages: torch.Tensor         # [B] or [B, T] the advantages as given (per-sequence objectives read these)
    mask: torch.Tensor               # [B, T] bool, True where a token is trained
    ref_logp: torch.Tensor | None = None      # [B, T] log pi_ref, if the objective reads it and it is given
    entropy: torch.Tensor | None = None       # [B, T] entropy now, if read and given (TEPO's measured criterion)
    old_entropy: torch.Tensor | None = None   # [B, T] entropy at rollout time, if read and given
    sampler_logp: torch.Tensor | None = None  # [B, T] the sampler's log-probs, with --sampler-correction


@dataclass
class PolicyTerms:
    """What an objective computes from its inputs: `objective` aggregates it and reports it."""
    loss: torch.Tensor               # [B, T] policy-gradient loss of each token ([B, J] of each block: see units)
    ratio: torch.Tensor              # [B, T] the importance ratio the objective clips, at each token
    clipped_low: torch.Tensor        # [B, T] bool: clipped at 1 - eps_low (A < 0)
    clipped_high: torch.Tensor       # [B, T] bool: clipped at 1 + eps_high (A > 0)
    kl: torch.Tensor | None = None   # [B, T] KL part of each token, weighed by beta; None: no KL part
    extra: dict = dataclasses.field(default_factory=dict)   # more metrics: name -> 0-dim tensor
    aggregation: str | None = None   # how loss and kl are aggregated; None: cfg.aggregation (MPO sets it)
    units: torch.Tensor | None = None   # [B, J] bool when loss is per block: the non-empty blocks (MPO)


def objective(*, reads: tuple[str, ...]):
    """The one skeleton. Written above an objective's maths,

        @objective(reads=("ref_logp",))
        def name(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms: ...

    it makes the objective with the signature they all share (objective_fn, below), which, on each call:
      1. checks the inputs and gives them to the maths as ObjectiveInputs (_prepare, below). `reads`
         names the optional tensors the objective reads (of ref_logp, entropy, old_entropy; the options add
         sampler_logp, old_entropy): those are checked and passed on, the others are ignored;
      2. computes the objective's PolicyTerms, then applies the options to their loss, not their KL (_options);
      3. aggregates them: loss = pg_loss + beta * kl_loss, pg_loss and kl_loss aggregated alike
         (cfg.aggregation unless the terms name another) with the step's counts num_tokens / num_seqs
         (aggregate_loss: the micro-batch losses of one step then add up to the step's loss);
      4. gathers the metrics (_metrics, below): a dict of floats.
    The objective keeps the name and docstring of its maths, and the maths itself as .policy_terms.
    """
    def make(policy_terms):
        def objective_fn(logp, old_logp, advantages, mask, cfg, *, ref_logp=None, entropy=None, old_entropy=None,
                         sampler_logp=None, num_tokens=None, num_seqs=None):
            given = {"ref_logp": ref_logp, "entropy": entropy, "old_entropy": old_entropy, "sampler_logp": sampler_logp}
            options = () if not isinstance(cfg, ObjectiveConfig) else (     # the options' inputs (_prepare: a bad cfg)
                ("sampler_logp",) * (cfg.sampler_correction != "none") + ("old_entropy",) * (cfg.top_entropy_share < 1))
            x = _prepare(logp, old_logp, advantages, mask, cfg, **{name: given[name] for name in reads + options})
            terms = _options(policy_terms(x, cfg), x, cfg)
            mode = terms.aggregation or cfg.aggregation

            def aggregate(loss_mat, valid, n_tokens):
                return aggregate_loss(loss_mat, valid, mode, num_tokens=n_tokens, num_seqs=num_seqs,
                                      norm_constant=cfg.norm_constant)
            # a loss per block is aggregated over the blocks: num_tokens, a count of tokens, does not apply
            pg_loss = (aggregate(terms.loss, x.mask, num_tokens) if terms.units is None
                       else aggregate(terms.loss, terms.units, None))
            kl_loss = (aggregate(terms.kl, x.mask, num_tokens) if terms.kl is not None
                       else torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device))
            loss = pg_loss + cfg.beta * kl_loss
            return loss, _metrics(loss, pg_loss, kl_loss, terms, x)

        objective_fn.__name__ = objective_fn.__qualname__ = policy_terms.__name__
        objective_fn.__doc__ = policy_terms.__doc__
        objective_fn.policy_terms, objective_fn.reads = policy_terms, reads
        return objective_fn
    return make


def _options(terms: PolicyTerms, x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """Step 2's options (section 1): terms.loss times the sampler's weight and the forking-token mask, before the
    aggregation and not terms.kl (TRL, verl); a token weighed 0 stays in the count. Ours: a loss per block (MPO) takes
    its block's weight, built as its ratio (block_log_ratio), and is kept if one of its tokens is; a sequence's loss
    at its tokens (GSPO, TEPO's gmpo) gets their mean weight (verl's geo_mean: their geometric mean)."""
    for name, option in (("sampler_logp", "sampler_correction"), ("old_entropy", "top_entropy_share")):
        if getattr(x, name) is None and getattr(cfg, option) not in ("none", 1):
            raise ValueError(f"{name}: {option}={getattr(cfg, option)!r} reads it; pass {name} [B, T] or switch it off")
    blocks, units = terms.units is not None, x.mask if terms.units is None else terms.units     # [B, T] or [B, J]
    if cfg.sampler_correction != "none":
        s = x.sampler_logp.detach().to(x.old_logp.dtype)
        log_w = block_log_ratio(x.old_logp, s, x.mask, cfg.block_size, cfg.block_ratio)[0] if blocks else x.old_logp - s
        w = sampler_correction_weight(log_w, units, cfg.sampler_correction, cfg.sampler_correction_cap)
        terms.loss, v = terms.loss * w, (w[units] if bool(units.any()) else w.new_ones(1))
        capped = masked_mean((torch.exp(log_w) > cfg.sampler_correction_cap).to(w.dtype), units)   # or masked
        terms.extra.update({"sampler_correction/weight_mean": v.mean(), "sampler_correction/weight_min": v.amin(),
                            "sampler_correction/weight_max": v.amax(), "sampler_correction/capped_frac": capped})
    if cfg.top_entropy_share < 1:
        keep = top_entropy_mask(x.old_entropy, x.mask, cfg.top_entropy_share)                           # [B, T]
        terms.extra["top_entropy/kept_frac"] = masked_mean(keep.to(x.logp.dtype), x.mask)
        if blocks:                    # [B, J]: a block is kept if one of its tokens is
            keep = torch.zeros_like(units, dtype=int).scatter_add(1, block_index(x.mask, cfg.block_size), 1 * keep) > 0
        terms.loss = torch.where(keep, terms.loss, torch.zeros_like(terms.loss))
    return terms


# ---- step 1: the checks ----------------------------------------------------------------------------

def _prepare(logp, old_logp, advantages, mask, cfg, **optional) -> ObjectiveInputs:
    """Check shapes and values; return the inputs as ObjectiveInputs: float logp / old_logp, bool mask,
    advantages as [B, T] (and as given), and the optional tensors passed (ref_logp, entropy, old_entropy).

    Every objective starts here (step 1), so every objective refuses, with a one-line ValueError naming
    the argument, the inputs that can only give a garbage loss:
      - a shape other than logp's [B, T] (advantages: [B] or [B, T]);
      - a mask holding anything but 0 and 1 (bool, or integers / floats equal to 0 or 1);
      - NaN or +-inf in logp, old_logp, advantages or an optional tensor that is passed (ref_logp,
        entropy, old_entropy) at a position where mask is 1; a per-sequence advantage is checked
        on the rows with at least one valid token.
    Padding (mask 0) may hold anything: it reaches neither the loss, nor the gradient, nor a metric
    (test_tepo.py, property 43). Valid inputs pass unchanged. The checks cost one reduction per tensor (two
    for a float mask) when every value is finite; the masked count is made only to word the error. The
    switches are not checked here: an ObjectiveConfig was checked when it was made and cannot change since
    (section 2), so only its type is.
    """
    if not isinstance(cfg, ObjectiveConfig):
        raise TypeError(f"cfg: expected an ObjectiveConfig (config_for(name) or ObjectiveConfig(...)), "
                        f"got {type(cfg).__name__}")
    if logp.dim() != 2:
        raise ValueError(f"logp: expected shape [B, T], got {tuple(logp.shape)}")
    for name, tensor in (("old_logp", old_logp), ("mask", mask), *optional.items()):
        if tensor is not None and tuple(tensor.shape) != tuple(logp.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match logp {tuple(logp.shape)}")
    if tuple(advantages.shape) not in ((logp.shape[0],), tuple(logp.shape)):
        raise ValueError(f"advantages: shape {tuple(advantages.shape)} is not valid; choose "
                         f"[B]={[logp.shape[0]]} or [B, T]={list(logp.shape)}")
    valid = _checked_mask(mask)                                              # [B, T] bool
    for name, tensor in (("logp", logp), ("old_logp", old_logp), *optional.items()):
        if tensor is not None:
            _check_finite_where_valid(name, tensor, valid)
    # bf16 / fp16 inputs are computed in fp32: exp() of a ratio needs the mantissa. Gradients
    # flow back through the cast.
    dtype = torch.promote_types(logp.dtype, torch.float32)
    adv = advantages.detach().to(dtype)
    if not _check_finite_where_valid("advantages", advantages, valid):
        adv = _finite_or_zero(adv)
    return ObjectiveInputs(logp.to(dtype), old_logp.detach().to(dtype), _per_position(adv, logp), advantages, valid,
                           **optional)


def _checked_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool [B, T]; a value other than 0 / 1 (0.5, 2, NaN) raises a ValueError.

    mask.bool() would read 0.5 as 1 and train a token the caller meant to half-weigh. The test is
    two reductions rather than comparisons that allocate three [B, T] tensors: every value lies in
    [0, 1], and for floats sum m (1 - m) = 0, a sum of terms >= 0 that is 0 only when each m is 0 or 1.
    """
    if mask.dtype == torch.bool or mask.numel() == 0:
        return mask.bool()
    low, high = torch.aminmax(mask)                                         # NaN gives NaN: refused
    zero_one = bool(low >= 0) and bool(high <= 1)
    if zero_one and mask.is_floating_point():
        flat = mask.reshape(-1)
        zero_one = bool(torch.dot(flat, 1 - flat) == 0)
    if not zero_one:
        bad = ~((mask == 0) | (mask == 1))
        raise ValueError(f"mask: {int(bad.sum())} values other than 0 and 1 (e.g. {mask[bad][0].item()!r}); "
                         f"choose a bool mask or 0/1 values (1 = the token is trained)")
    return mask.bool()


def _check_finite_where_valid(name: str, tensor: torch.Tensor, valid: torch.Tensor) -> bool:
    """ValueError if `tensor` ([B, T], or [B] per sequence) holds NaN or inf where valid is True;
    returns whether every value is finite (False: some padding holds NaN or inf)."""
    values = tensor.detach()
    # The usual case in one fast reduction: a sum is finite only if every term is. A finite sum
    # too large for the dtype also lands in the exact test below, which is correct, only slower.
    if bool(torch.isfinite(values.sum(dtype=torch.promote_types(values.dtype, torch.float32)))):
        return True
    used = valid if values.dim() == 2 else valid.any(-1)                    # [B, T] or [B]
    bad = used & ~torch.isfinite(values)
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{name}: {int(bad.sum())} non-finite values where mask is 1 (e.g. "
                         f"{values[tuple(where)].item()} at {where}); pass finite values at every "
                         f"trained position (padding, mask 0, may hold anything)")
    return bool(torch.isfinite(values).all())


def _finite_or_zero(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages with NaN / inf replaced by 0. After _prepare such values can only sit where nothing
    is trained, but an advantage multiplies a ratio whose gradient there is 0, and 0 * NaN = NaN
    would reach logp's gradient (GSPO-token's ratio has no mask between the two)."""
    return torch.where(torch.isfinite(advantages), advantages, torch.zeros_like(advantages))


# ---- step 4: the metrics ---------------------------------------------------------------------------

def _metrics(loss, pg_loss, kl_loss, terms: PolicyTerms, x: ObjectiveInputs) -> dict[str, float]:
    """The metrics every objective reports, as floats (token statistics over valid tokens only):
      loss, pg_loss, kl_loss         the loss and its parts (loss = pg_loss + beta * kl_loss)
      clip_ratio/low_mean            fraction of tokens clipped at 1 - eps_low (A < 0)
      clip_ratio/high_mean           fraction clipped at 1 + eps_high (A > 0)
      clip_ratio/region_mean         either of the two
      ratio/mean, ratio/min, ratio/max   the importance ratio the objective clips
      kl_old/k1, kl_old/k3           KL(pi_old || pi_theta) from the rollout's tokens; k1 is verl's ppo_kl while
                                     every |log-ratio| <= 20 (verl averages the clamped log-ratio, tepo the raw
                                     one); k3 is kl_penalty's at x = -delta, as expm1(delta) - delta without verl's
                                     clamps: in float32 it keeps a KL of 1e-8 near ratio 1 (exp(delta) - 1 rounds
                                     it away), and a ratio that blew up shows, not a cap of 10 (test_tepo.py)
      kl_ref                         kl_penalty's k3 to the reference, when the objective reads ref_logp and it is given
      on_policy                      1.0 when every ratio is exactly 1: clipping, GSPO's clipping, TEPO's KL mask
                                     (target old) and KL-Cov's penalty cannot act on this step.
    and the objective's own (terms.extra). One transfer to the CPU for all of them.
    """
    mask = x.mask
    with torch.no_grad():
        delta = torch.where(mask, x.logp - x.old_logp, torch.zeros_like(x.logp)).detach()
        r = terms.ratio.detach()
        one = torch.ones((), dtype=r.dtype, device=r.device)
        low, high = terms.clipped_low, terms.clipped_high
        stats = {
            "loss": loss.detach(), "pg_loss": pg_loss.detach(), "kl_loss": kl_loss.detach(),
            "clip_ratio/low_mean": masked_mean(low.to(r.dtype), mask),
            "clip_ratio/high_mean": masked_mean(high.to(r.dtype), mask),
            "clip_ratio/region_mean": masked_mean((low | high).to(r.dtype), mask),
            "ratio/mean": masked_mean(r, mask),
            "ratio/min": torch.where(mask, r, one).amin() if r.numel() else one,
            "ratio/max": torch.where(mask, r, one).amax() if r.numel() else one,
            "kl_old/k1": masked_mean(-delta, mask),
            "kl_old/k3": masked_mean(torch.expm1(delta.clamp(max=20)) - delta, mask),
            "on_policy": (delta.abs().amax() == 0).to(r.dtype) if r.numel() else one,
        }
        if x.ref_logp is not None:
            stats["kl_ref"] = masked_mean(kl_penalty(x.logp.detach(), x.ref_logp.to(x.logp.dtype), "k3"), mask)
        stats.update(terms.extra)
        names = list(stats)
        values = torch.stack([v.to(torch.float64).reshape(()).cpu() for v in stats.values()]).tolist()
    return dict(zip(names, values))


# ---- 3.1 PPO-clip (Schulman et al. 2017, arXiv 1707.06347) -------------------------------------------

def token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                    clamp: float = 20.0) -> torch.Tensor:
    """delta_{i,t} = log pi_theta - log pi_old, clamped to [-clamp, clamp], 0 at padding.   [B, T]

    The clamp keeps exp(delta) finite when a ratio explodes; inside it the gradient is exactly
    d logp. verl 0.9.1 clamps at 20 in its `vanilla`, `cispo` and `sapo` losses; its `gspo` clamps the
    log-ratio at 10 from above, and `clip_cov`, `kl_cov` and `geo_mean` do not clamp.
    """
    delta = (logp - old_logp).clamp(-clamp, clamp)
    return torch.where(mask.bool(), delta, torch.zeros_like(delta))


def _token_ratio(x: ObjectiveInputs, cfg: ObjectiveConfig) -> torch.Tensor:
    """r_{i,t} = exp(delta_{i,t}) = pi_theta / pi_old at each token (1 at padding).              [B, T]"""
    return torch.exp(token_log_ratio(x.logp, x.old_logp, x.mask, cfg.log_ratio_clamp))


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
                      dual_clip_c: float | None = None):
    """PPO's pessimistic clipped loss, elementwise: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)).

    Returns (loss, clipped_low, clipped_high). A token is clipped, and gets zero gradient, when its ratio has
    left the band in the direction its advantage pushes: r > 1 + eps_high with A > 0, or r < 1 - eps_low with
    A < 0. At r = 1 nothing is clipped and the gradient is exactly -A * d log pi (d r = r d log pi, r = 1; no
    factor 2: test_tepo.py, property 38). Dual-clip: with A < 0 the loss is also capped at -A * c, so an
    exploded ratio on a negative-advantage token cannot blow the loss up.
    """
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    if dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip_c), loss)
    clipped_low = (ratio < 1 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1 + eps_high) & (adv > 0)
    return loss, clipped_low, clipped_high


def _reference_kl(x: ObjectiveInputs, cfg: ObjectiveConfig, name: str) -> torch.Tensor | None:
    """The GRPO-style KL part: KL(pi_theta || pi_ref) at each token, [B, T]; None when beta = 0."""
    if cfg.beta == 0:
        return None
    if x.ref_logp is None:
        raise ValueError(f"ref_logp: {name} with beta={cfg.beta} needs reference log-probs; "
                         f"pass ref_logp or choose beta=0")
    return kl_penalty(x.logp, x.ref_logp.detach().to(x.logp.dtype), cfg.kl_estimator)


def _ppo_clip_terms(x: ObjectiveInputs, cfg: ObjectiveConfig, name: str) -> PolicyTerms:
    """PPO-clip's per-token terms, for ppo_clip_loss and 3.2's three (`name` words a missing ref_logp's error)."""
    ratio = _token_ratio(x, cfg)                                                        # [B, T]
    loss, low, high = clipped_surrogate(ratio, x.adv, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c)
    return PolicyTerms(loss, ratio, low, high, kl=_reference_kl(x, cfg, name))


@objective(reads=("ref_logp",))
def ppo_clip_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """PPO's clipped surrogate at the token level, as LLM RL uses it.

        l_{i,t} = max(-A_{i,t} r_{i,t}, -A_{i,t} clip(r_{i,t}, 1 - eps_low, 1 + eps_high))
                  [+ dual clip: min(l, -A c) where A < 0]  + beta * KL_k(pi_theta || pi_ref)_{i,t}
        r_{i,t} = exp(log pi_theta - log pi_old)

    Paper: Schulman et al., arXiv 1707.06347 (the original uses GAE advantages from a critic; here the advantages
    are whatever you pass, usually group-relative). verl 0.9.1: policy_loss.loss_mode="vanilla"
    (clip_ratio_low/high; it always dual-clips, clip_ratio_c=3 by default). Defaults: PAPER_DEFAULTS["ppo"].
    Does nothing special when on-policy: every r = 1, no token is clipped, and the gradient is the plain policy
    gradient -A d log pi (aggregated).
    """
    return _ppo_clip_terms(x, cfg, "ppo")


# ---- 3.2 GRPO, DAPO and Dr. GRPO: PPO-clip's loss under each paper's settings --------------------------
# The three are PPO-clip's per-token loss, exactly; each one is its settings, PAPER_DEFAULTS[name] (and DAPO's
# data side, after dapo_loss). test_tepo.py checks the four agree in loss, gradient and metrics, settings alike.

@objective(reads=("ref_logp",))
def grpo_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """GRPO: PPO-clip with group-relative advantages, a per-sequence mean, and a k3 KL to the reference.

        J = E[ (1/G) sum_i (1/|o_i|) sum_t { min(r A_i, clip(r, 1-eps, 1+eps) A_i) - beta D_KL,i,t } ]
        A_i = (r_i - mean(r_group)) / std(r_group),  D_KL = pi_ref/pi - log(pi_ref/pi) - 1   (k3)

    GRPO is a choice of advantages (group_advantages, scale="group"), aggregation ("seq-mean-token-mean") and
    KL (beta=0.04, k3). Paper: arXiv 2402.03300 (DeepSeekMath, Shao et al. 2024). TRL 1.16:
    GRPOTrainer(loss_type="grpo", beta=0.04). verl 0.9.1: algorithm.adv_estimator=grpo, loss_agg_mode=
    seq-mean-token-mean, use_kl_loss=True, kl_loss_type=low_var_kl; verl's `vanilla` loss always dual-clips
    (c = 3), which tepo's GRPO, DAPO and Dr. GRPO defaults do not (dual_clip_c=3 to match). DeepSeekMath made one
    update per rollout, so r = 1 and the clip never acted (metrics: on_policy = 1); a group whose rewards are all
    equal has A = 0 and contributes only its KL gradient. Defaults: PAPER_DEFAULTS["grpo"].
    """
    return _ppo_clip_terms(x, cfg, "grpo")


@objective(reads=("ref_logp",))
def dapo_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """DAPO: PPO-clip with clip-higher and a token-level mean over the whole batch.

        J = E[ 1/(sum_i |o_i|) sum_i sum_t min(r_{i,t} A_i, clip(r_{i,t}, 1-eps_low, 1+eps_high) A_i) ]
        subject to 0 < #correct in the group < G

    Four techniques: clip-higher (eps_low 0.2, eps_high 0.28: low-probability tokens with positive advantage may
    grow, which slows entropy collapse); token-mean aggregation (every token weighs the same, so long answers are
    not down-weighted); dynamic sampling (dynamic_sampling_mask, data side); overlong reward shaping
    (soft_overlong_punishment, data side). No KL (beta = 0). Paper: arXiv 2503.14476 (Yu et al. 2025). TRL 1.16:
    loss_type="dapo", epsilon=0.2, epsilon_high=0.28. verl 0.9.1: clip_ratio_low=0.2, clip_ratio_high=0.28,
    loss_agg_mode=token-mean, algorithm.filter_groups. Defaults: PAPER_DEFAULTS["dapo"].
    On-policy the clip does nothing and DAPO is the token-mean policy gradient.
    """
    return _ppo_clip_terms(x, cfg, "dapo")


# DAPO's two data-side pieces: they shape the batch and the rewards (the trainer applies them), not the loss.
@torch.no_grad()
def dynamic_sampling_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Keep the rows whose group has rewards that differ (std > 0).                    [B] -> bool [B]

    A group that is all right or all wrong has advantage 0 for every sample: it adds no gradient
    but dilutes the batch. DAPO drops such groups and samples more prompts until the batch is full.
    """
    grouped = _grouped(rewards, group_size)                                 # [n_groups, G]
    keep = grouped.amax(1) > grouped.amin(1)
    return keep.repeat_interleave(group_size)


def soft_overlong_punishment(lengths: torch.Tensor, max_len: int, cache_len: int,
                             factor: float = 1.0) -> torch.Tensor:
    """DAPO's length penalty, added to the task reward.                                 [B] -> [B]

      0                                 if |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache   in between (falls linearly from 0 to -1)
      -1                                if |y| > L_max
    times `factor`. The paper uses L_max = 20480, L_cache = 4096.
    """
    if cache_len <= 0 or cache_len > max_len:
        raise InvalidSetting("cache_len", cache_len, f"0 < cache_len <= max_len={max_len}")
    lengths = lengths.to(torch.float64 if lengths.dtype == torch.float64 else torch.float32)
    expected = max_len - cache_len
    ramp = (expected - lengths) / cache_len
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths),
                          torch.where(lengths <= max_len, ramp, -torch.ones_like(lengths)))
    return factor * penalty


@objective(reads=("ref_logp",))
def dr_grpo_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """Dr. GRPO ("GRPO done right"): remove GRPO's two normalisations that bias it.

        J = E[ 1/(G L) sum_i sum_t min(r_{i,t} A~_i, clip(r_{i,t}, 1-eps, 1+eps) A~_i) ],
        A~_i = r_i - mean(r_group)

    1/|o_i| is gone (it under-penalises long wrong answers), replaced by a constant L (norm_constant; the max
    generation length); 1/std is gone from the advantage (advantage_scale="none"; it up-weights too easy and too
    hard questions). No KL. Defaults: PAPER_DEFAULTS["dr_grpo"]. Paper: arXiv 2503.20783 (Liu et al. 2025). TRL
    1.16: loss_type="dr_grpo", scale_rewards="none". verl 0.9.1: loss_agg_mode=seq-mean-token-sum-norm (it
    divides by B * C, as here), norm_adv_by_std_in_grpo=False.
    """
    return _ppo_clip_terms(x, cfg, "dr_grpo")


# ---- 3.3 CISPO (MiniMax 2025, MiniMax-M1, arXiv 2506.13585) ------------------------------------------

@objective(reads=("ref_logp",))
def cispo_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """CISPO: clip the importance weight, not the update: every token keeps a gradient, -w A d log pi.

        l_{i,t} = -sg[w_{i,t}] A_{i,t} log pi_theta(o_{i,t}),   w_{i,t} = clip(r_{i,t}, 1 - eps_low, 1 + eps_high)

    PPO's clip drops the tokens whose ratio left the band, often the rare ones that fork a chain of thought;
    CISPO keeps them with a bounded weight. At r = 1 it is the policy gradient; its loss value is not ratio-shaped.
    Paper: arXiv 2506.13585 section 3.1: token-mean, no lower bound (eps_low large). The peers differ on w
    (cispo_weight): clip, the default (verl 0.9.1 loss_mode="cispo"; its example: clip_ratio_low 10, high 0.2) |
    cap: min(r, eps_high), an absolute cap (TRL 1.16 loss_type="cispo"; ScaleRL, arXiv 2510.13786, uses 5: set
    eps_high). clip_ratio counts the weights the clip changed, any sign of A (verl; TRL counts A > 0 capped).
    """
    ratio = _token_ratio(x, cfg)                                                        # [B, T]
    low, high = (1 - cfg.eps_low, 1 + cfg.eps_high) if cfg.cispo_weight == "clip" else (0.0, cfg.eps_high)
    w = ratio.detach().clamp(low, high)                                                 # sg[w]: a weight, no gradient
    return PolicyTerms(-w * x.adv * x.logp, ratio, ratio < low, ratio > high, kl=_reference_kl(x, cfg, "cispo"))


# ---- 3.4 GSPO and GSPO-token (Zheng et al. 2025, Qwen team, arXiv 2507.18071) ------------------------

def _sequence_advantages(x: ObjectiveInputs, objective_name: str) -> torch.Tensor:
    """The per-sequence advantages [B] as constants in logp's dtype; non-finite ones (rows with nothing
    trained, after _prepare) as 0. Per-token advantages are refused, naming the objective."""
    if x.advantages.dim() != 1:
        raise ValueError(f"advantages: {objective_name} needs one advantage per sequence, shape [B], got "
                         f"{tuple(x.advantages.shape)}; choose gspo_token for per-token advantages")
    return _finite_or_zero(x.advantages).detach().to(x.logp.dtype)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = (1/|o_i|) sum_t delta_{i,t}: the log of GSPO's geometric-mean sequence ratio.  [B]

    s_i = (pi_theta(o_i|q) / pi_old(o_i|q)) ** (1/|o_i|). Without the 1/|o_i| the sequence ratio
    of a long answer would be a product of hundreds of token ratios and explode or vanish.
    """
    return masked_mean(logp - old_logp, mask, dim=-1)


@objective(reads=("ref_logp",))
def gspo_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """GSPO: one importance ratio per sequence, the geometric mean of its token ratios.

        J = E[ (1/G) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i) ]
        s_i = (pi_theta(o_i|q) / pi_old(o_i|q)) ** (1/|o_i|) = exp(mean_t delta_{i,t})

    The reward is given to a sequence, so the ratio is a sequence's too: a sequence is clipped as a unit (all its
    tokens get zero gradient), whatever its individual token ratios. Unclipped gradient: (1/G) sum_i s_i A_i
    (1/|o_i|) sum_t d log pi_{i,t}. Here the sequence loss is spread over the sequence's tokens so that the
    `aggregation` switch applies: "seq-mean-token-mean" (the paper) gives exactly the mean over sequences;
    "token-mean" would weigh sequences by length (TRL warns about this).
    Paper: arXiv 2507.18071, eps (3e-4, 4e-4), 4 mini-batches per rollout, no KL. TRL 1.16:
    importance_sampling_level="sequence", loss_type="grpo". verl 0.9.1: loss_mode="gspo" (it honours
    loss_agg_mode, default token-mean, and clamps the log-ratio at 10 from above).
    On-policy s_i = 1 and GSPO's gradient equals GRPO's (metrics: on_policy = 1).
    """
    seq_adv = _sequence_advantages(x, "gspo")                                          # [B]
    log_s = sequence_log_ratio(x.logp, x.old_logp, x.mask).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    s = torch.exp(log_s)                                                                  # [B]
    seq_loss, low, high = clipped_surrogate(s, seq_adv, cfg.eps_low, cfg.eps_high)      # [B] each
    at_tokens = lambda v: _per_position(v, x.logp)   # noqa: E731  ([B] -> [B, T]: a sequence's value at its tokens)
    return PolicyTerms(at_tokens(seq_loss), at_tokens(s), at_tokens(low), at_tokens(high),
                       kl=_reference_kl(x, cfg, "gspo"))


def _sequence_ratio_per_token(x: ObjectiveInputs, cfg: ObjectiveConfig) -> torch.Tensor:
    """GSPO-token's w_{i,t} = sg[s_i] * pi_{i,t} / sg[pi_{i,t}]: value s_i, gradient s_i d log pi_{i,t}.  [B, T]"""
    log_s = sequence_log_ratio(x.logp, x.old_logp, x.mask).detach()                    # [B]
    log_w = x.logp - x.logp.detach() + log_s.unsqueeze(-1)                               # [B, T]
    return torch.exp(log_w.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))


@objective(reads=("ref_logp",))
def gspo_token_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """GSPO-token: GSPO's sequence ratio carried to every token, so advantages may differ per token.

        w_{i,t} = sg[s_i] * pi_theta(o_{i,t}) / sg[pi_theta(o_{i,t})]     (value s_i, grad s_i d log pi)
        J = E[ (1/G) sum_i (1/|o_i|) sum_t min(w_{i,t} A_{i,t}, clip(w_{i,t}, 1-eps_low, 1+eps_high) A_{i,t}) ]

    With A_{i,t} = A_i it equals GSPO in value, clipping decisions and gradient, on- and off-policy. Paper: arXiv
    2507.18071 section 4.3. TRL 1.16 has no GSPO-token (its importance_sampling_level is "token" or "sequence").
    verl 0.9.1: loss_mode="gspo" is this form.
    """
    w = _sequence_ratio_per_token(x, cfg)                                               # [B, T]
    loss, low, high = clipped_surrogate(w, x.adv, cfg.eps_low, cfg.eps_high)
    return PolicyTerms(loss, w, low, high, kl=_reference_kl(x, cfg, "gspo_token"))


# ---- 3.5 GMPO (Zhao et al. 2025, arXiv 2507.20673) ----------------------------------------------------

def _gmpo_surrogate(x: ObjectiveInputs, cfg: ObjectiveConfig, name: str):
    """GMPO's loss -A_i R_i and ratio R_i at each token of row i, and where the clip binds: 4 tensors [B, T]."""
    seq_adv = _sequence_advantages(x, name)                                              # [B]
    sign = torch.sign(seq_adv).unsqueeze(-1)                                             # [B, 1]; 0 where A = 0
    delta = token_log_ratio(x.logp, x.old_logp, x.mask, cfg.log_ratio_clamp)             # [B, T]
    m = sign * torch.minimum(sign * delta, sign * delta.clamp(-cfg.eps_low, cfg.eps_high))    # A < 0: a max
    R = torch.exp(masked_mean(m, x.mask, dim=-1))                                        # [B]
    low, high = (delta < -cfg.eps_low) & (x.adv < 0), (delta > cfg.eps_high) & (x.adv > 0)
    return _per_position(-seq_adv * R, x.logp), _per_position(R, x.logp), low, high


@objective(reads=("ref_logp",))
def gmpo_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """GMPO: the geometric mean of the token ratios, each clipped first, in log space, in the direction of A.

        J = E[ (1/G) sum_i A_i R_i ],  R_i = exp(mean_t m_{i,t}),  m = min(l, clip(l, -eps_low, eps_high)) if A_i > 0,
        max(l, clip(l, -eps_low, eps_high)) if A_i < 0,  l_{i,t} = log r_{i,t}

    One outlier token ratio swings GRPO's arithmetic mean, not a geometric one: GMPO clips wider, (e^-0.4, e^0.4).
    A clipped token has zero gradient and adds its bound to the exponent; the others of row i share one gradient,
    -A_i R_i / (G |o_i|) d log pi (at ratio 1, GRPO's). Paper: arXiv 2507.20673, eps 0.4; verl 0.9.1 "geo_mean"
    and TRL 1.16 trl.experimental.gmpo agree (at A_i = 0, verl's R_i = 1, followed here). Both divide by every
    row, as seq-mean-token-mean with num_seqs (else the non-empty rows). Ours: the clamp of l (log_ratio_clamp).
    clip_ratio counts the binding clips, as TRL (verl counts every token outside the band, by the sign of A).
    """
    return PolicyTerms(*_gmpo_surrogate(x, cfg, "gmpo"), kl=_reference_kl(x, cfg, "gmpo"))   # loss, R_i, clips


# ---- 3.6 SAPO (Gao et al. 2025, Qwen team, arXiv 2511.20347) -------------------------------------------

@objective(reads=("ref_logp",))
def sapo_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """SAPO: a smooth gate in place of the hard clip: the gradient fades as the ratio leaves 1, never to 0.

        l_{i,t} = -f(r_{i,t}) A_{i,t},   f(r) = (4 / tau) sigmoid(tau (r - 1)),   tau = tau_pos if A > 0, else tau_neg
        gradient: -A w(r) d log pi,   w(r) = 4 r s (1 - s),   s = sigmoid(tau (r - 1))

    w(1) = 1 for any tau (at ratio 1, the policy gradient; the loss there is -2A/tau) and w > 0 for every r, falling
    on both sides of 1, faster for a larger tau: tau_neg > tau_pos damps A <= 0 more (its gradient raises every
    other token). Paper: arXiv 2511.20347, sapo_tau_pos 1, _neg 1.05, per-sequence mean, as verl loss_mode="sapo" (its
    clamp of l at +-20: log_ratio_clamp) and TRL loss_type="sapo" (no clamp). sapo/weight_mean: w's mean.
    """
    ratio = _token_ratio(x, cfg)                                                        # [B, T]
    tau = torch.where(x.adv > 0, x.adv.new_tensor(cfg.sapo_tau_pos), x.adv.new_tensor(cfg.sapo_tau_neg))
    s, no_clip = torch.sigmoid(tau * (ratio - 1)), torch.zeros_like(x.mask)             # [B, T] each
    return PolicyTerms(-(4 / tau) * s * x.adv, ratio, no_clip, no_clip, kl=_reference_kl(x, cfg, "sapo"),
                       extra={"sapo/weight_mean": masked_mean((4 * ratio * s * (1 - s)).detach(), x.mask)})


# ---- 3.7 MPO (Xu et al. 2026, arXiv 2602.14386) -- RECONSTRUCTION ----------------------------------

def block_index(mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which K-token block each position belongs to.                                      [B, T] long

    Blocks are counted over valid tokens from the first response token: the n-th valid token
    (n = 0, 1, ...) is in block n // K. For left-aligned responses this is simply t // K.
    """
    if int(block_size) != block_size or block_size < 1:
        raise InvalidSetting("block_size", block_size, "an integer K >= 1")
    n_before = mask.long().cumsum(-1) - 1                                   # valid tokens before t
    return n_before.clamp(min=0) // block_size


def block_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, block_size: int,
                    block_ratio: str = "joint") -> tuple[torch.Tensor, torch.Tensor]:
    """Log-ratio of each K-token block (MPO, reconstruction).         [B, T] -> ([B, J], [B, J])

    joint:   log rho_{i,j} = sum_{t in block} delta_{i,t}   (K tokens are ONE action: the ratio of the action's
             probability is the product of its token ratios)
    geomean: log rho_{i,j} = mean_{t in block} delta_{i,t}  (the geometric-mean reading; a partial last block is
             normalised by its own length)
    J = ceil(T / K). Returns the block log-ratios and the number of valid tokens in each block (0 marks an empty
    block). The last block of a response is partial when K does not divide its length.
    """
    _check_choice("block_ratio", block_ratio, BLOCK_RATIOS)
    blk = block_index(mask, block_size)                                     # [B, T]; checks K >= 1
    B, T = logp.shape
    J = math.ceil(T / block_size)
    valid = mask.bool()
    delta = torch.where(valid, logp - old_logp, torch.zeros_like(logp))
    delta_blk = delta.new_zeros(B, J).scatter_add(1, blk, delta)            # [B, J]
    n_blk = delta.new_zeros(B, J).scatter_add(1, blk, valid.to(delta.dtype))  # [B, J]
    if block_ratio == "geomean":
        delta_blk = delta_blk / n_blk.clamp(min=1)
    return delta_blk, n_blk


@objective(reads=("ref_logp",))
def mpo_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """MPO (Multi-token Policy Gradient Optimization) -- a RECONSTRUCTION from the abstract.

        J = E[ (1/G) sum_i (1/J_i) sum_j min(rho_{i,j} A_i, clip(rho_{i,j}, 1-eps_low, 1+eps_high) A_i) ]
        rho_{i,j} = prod_{t in block j} r_{i,t}          (block_ratio="joint")
                  = (prod_{t in block j} r_{i,t})^(1/|block|)   (block_ratio="geomean")
        blocks: K = block_size consecutive response tokens; J_i = ceil(|o_i| / K); the last block may be shorter.

    What is public (arXiv 2602.14386): one semantic decision spans several tokens, so MPO treats K consecutive
    tokens as one action and changes only the importance ratio. What is ours: the block construction, the ratio
    normalisation, the partial last block and the aggregation. A block is clipped as a unit. Aggregation reads
    `block_agg`, not `aggregation`, because the unit is a block:
      seq-mean-block-mean  mean over a sequence's blocks, then over sequences (GRPO-like; honours num_seqs)
      block-mean           every block in the batch weighs the same (DAPO-like)
      token-weighted       each block's loss given to each of its tokens, then token-mean (honours num_tokens)
    The KL part (beta > 0) is per token, aggregated like the blocks (token-mean, or seq-mean-token-mean for
    seq-mean-block-mean). K = 1 is the token-level clipped surrogate (GRPO / DAPO); K >= the longest answer with
    "geomean" is GSPO. A joint ratio drifts about K times faster than a token ratio: clip eps or the log-ratio
    clamp may need to shrink with K. On-policy every rho = 1 and nothing is clipped.
    """
    seq_adv = _sequence_advantages(x, "mpo")                                                  # [B]
    log_rho, n_blk = block_log_ratio(x.logp, x.old_logp, x.mask, cfg.block_size, cfg.block_ratio)  # [B, J] each
    rho = torch.exp(log_rho.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    blk_loss, blk_low, blk_high = clipped_surrogate(rho, _per_position(seq_adv, rho), cfg.eps_low, cfg.eps_high)
    blk = block_index(x.mask, cfg.block_size)                                                 # [B, T]
    at_tokens = lambda v: v.gather(1, blk)   # noqa: E731  ([B, J] -> [B, T]: a block's value at its tokens)
    if cfg.block_agg == "token-weighted":
        loss, units = at_tokens(blk_loss), None
    else:  # blocks play the part of tokens in aggregate_loss
        loss, units = blk_loss, n_blk > 0
    mode = "seq-mean-token-mean" if cfg.block_agg == "seq-mean-block-mean" else "token-mean"
    return PolicyTerms(loss, at_tokens(rho), at_tokens(blk_low), at_tokens(blk_high),
                       kl=_reference_kl(x, cfg, "mpo"), aggregation=mode, units=units)


# =====================================================================================================
# 4. Entropy mathematics: the policy's entropy, and why policy gradient lowers it, step by step
# =====================================================================================================
# Every objective above pushes up the log-probability of tokens with positive advantage and down that of
# tokens with negative advantage. What does that do to the policy's entropy? One state, a softmax policy
# over actions a (the vocabulary) with logits z:
#   p_a = exp(z_a) / sum_b exp(z_b),   H(z) = -sum_a p_a log p_a   (softmax_entropy, just below).

def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v from the log-probabilities of the whole vocabulary, with gradient.   [..., V] -> [...]

    The one place the entropy formula is written: every entropy in this module (and the sampler's,
    which has the log-softmax at hand) is this function.
    """
    return -(logp.exp() * logp).sum(-1)


def softmax_entropy(z: torch.Tensor) -> torch.Tensor:
    """H(softmax(z)), with gradient.                                               [..., V] -> [...]"""
    return entropy_from_logprobs(torch.log_softmax(z, dim=-1))


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0,
                        chunk_size: int = 1024) -> torch.Tensor:
    """Full-vocabulary entropy H = -sum_v p_v log p_v at every position.        [..., V] -> [...]

    This is the entropy of the policy, not the mean -log p of the sampled token (a one-sample estimate of it;
    test_tepo.py, property 37). Rows are processed `chunk_size` at a time, so a 150k vocabulary never needs a
    second full-size float tensor. No gradient: it is a diagnostic.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32),
                      device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        out[start:start + chunk_size] = softmax_entropy(_tempered(flat[start:start + chunk_size], temperature))
    return out.view(logits.shape[:-1])


# ---- why it falls ----------------------------------------------------------------------------------
# The result (Cui et al. 2505.22617; TEPO's appendix): a natural-policy-gradient step z <- z + eta A
# changes the entropy by  -eta Cov_{a~p}(log p_a, A_a)  to first order. Confident actions with
# positive advantage, and rare actions with negative advantage, lower entropy.
# The steps, in the order of the functions below:
#   1. the softmax Jacobian d log p_a / d z_b            softmax_log_jacobian
#   2. the entropy gradient dH/dz                         entropy_grad_wrt_logits
#   3. the Fisher matrix F = diag(p) - p p^T              fisher_matrix
#   4. the vanilla policy-gradient step, dJ/dz = F A      policy_gradient_step
#   5. the natural-gradient step, F^+ F A = A + const     natural_gradient_step
#   6. the first-order entropy change -Cov(log p, dz)     first_order_entropy_change
# All functions take z[..., V] and work on any leading batch shape. Section 5's remedies start from
# the result: they act on the tokens with the largest share of Cov(log p, A).

def _centred(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values_a - E_{a~p}[values], the centring each step below needs.         [..., V], [..., V] -> [..., V]"""
    return values - (p * values).sum(-1, keepdim=True)


def softmax_log_jacobian(z: torch.Tensor) -> torch.Tensor:
    """Step 1: d log p_a / d z_b = 1[a = b] - p_b.                                [..., V] -> [..., V, V]

    (Row a, column b.) Equivalently d p_a / d z_b = p_a (1[a = b] - p_b).
    """
    p = torch.softmax(z, dim=-1)
    eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
    return eye - p.unsqueeze(-2)


def entropy_grad_wrt_logits(z: torch.Tensor) -> torch.Tensor:
    """Step 2: dH/dz_b = -p_b (log p_b - E_p[log p]).                                [..., V] -> [..., V]

    Differentiate H: dH/dz_b = -sum_a (dp_a/dz_b)(log p_a + 1) = -sum_a (dp_a/dz_b) log p_a, since
    the probabilities sum to one (sum_a dp_a/dz_b = 0). Then substitute step 1's dp_a/dz_b.
    Raising the logit of an action more probable than "average" (log p_b > E log p) lowers entropy.
    """
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return -p * _centred(p, logp)


def fisher_matrix(z: torch.Tensor) -> torch.Tensor:
    """Step 3: the Fisher information of a softmax in logit space, F = diag(p) - p p^T. [..., V] -> [..., V, V]

    It is the covariance of the score d log p_a / dz, and singular along the all-ones direction
    (adding a constant to every logit changes nothing).
    """
    p = torch.softmax(z, dim=-1)
    return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)


def policy_gradient_step(z: torch.Tensor, A: torch.Tensor, eta: float) -> torch.Tensor:
    """Step 4: vanilla PG on J = E_p[A]: dJ/dz = p (A - E_p A) = F A, so z <- z + eta p (A - E_p A)."""
    p = torch.softmax(z, dim=-1)
    return z + eta * p * _centred(p, A)


def natural_gradient_step(z: torch.Tensor, A: torch.Tensor, eta: float) -> torch.Tensor:
    """Step 5: NPG, z <- z + eta F^+ dJ/dz. Since dJ/dz = F A, F^+ F A = A - c 1, and the step is
    z + eta A up to a constant that does not change p. Computed here with the pseudo-inverse so the
    claim can be checked, not assumed.                                           [..., V] -> [..., V]
    """
    F = fisher_matrix(z)
    grad = (F @ A.unsqueeze(-1)).squeeze(-1)                                # = p (A - E_p A)
    return z + eta * (torch.linalg.pinv(F) @ grad.unsqueeze(-1)).squeeze(-1)


def first_order_entropy_change(z: torch.Tensor, delta_z: torch.Tensor) -> torch.Tensor:
    """Step 6: H(z + dz) - H(z) ~= <dH/dz, dz> = -Cov_{a~p}(log p_a, dz_a).           [..., V] -> [...]

    Exact as a derivative: d/dt H(z + t u) at t = 0 is -Cov(log p, u). With dz = eta A (NPG) this
    is -eta Cov(log p, A); with dz = eta p (A - E_p A) (vanilla PG) it is
    -eta Cov(log p, p (A - E_p A)). Adding a constant to dz changes nothing (a covariance).
    """
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return -(p * _centred(p, logp) * _centred(p, delta_z)).sum(-1)


@torch.no_grad()
def entropy_change_prediction(logits_before: torch.Tensor, logits_after: torch.Tensor,
                              temperature: float = 1.0, chunk_size: int = 1024):
    """The derivation checked on real logits: predicted vs measured entropy change per position.

    Given the logits at the same positions before and after an update ([N, V] or [..., V]), returns
    (predicted, measured), each [...]:
      predicted = -Cov_{a~p_before}(log p_before, dz),  dz = (z_after - z_before) / temperature
      measured  = H(p_after) - H(p_before)
    at the sampling temperature. They agree to first order; their gap is the O(dz^2) term. Chunked over rows so
    a large vocabulary fits. bf16 logits are computed in float32, where changes below ~1e-6 nats are at the
    rounding level; float64 logits stay float64.
    """
    if logits_before.shape != logits_after.shape:
        raise ValueError(f"logits_after: shape {tuple(logits_after.shape)} does not match "
                         f"logits_before {tuple(logits_before.shape)}")
    V = logits_before.shape[-1]
    before, after = logits_before.reshape(-1, V), logits_after.reshape(-1, V)
    predicted = torch.empty(before.shape[0], dtype=torch.promote_types(before.dtype, torch.float32),
                            device=before.device)
    measured = torch.empty_like(predicted)
    for start in range(0, before.shape[0], chunk_size):
        z0 = _tempered(before[start:start + chunk_size], temperature)
        z1 = _tempered(after[start:start + chunk_size], temperature)
        predicted[start:start + chunk_size] = first_order_entropy_change(z0, z1 - z0)
        measured[start:start + chunk_size] = softmax_entropy(z1) - softmax_entropy(z0)
    shape = logits_before.shape[:-1]
    return predicted.view(shape), measured.view(shape)


# =====================================================================================================
# 5. The remedies: keeping entropy up
# =====================================================================================================
# Section 4 says which tokens lower the entropy: those with a large share of Cov(log p, A), confident
# tokens with positive advantage and rare ones with negative advantage. The classic remedy rewards
# entropy at every token (the entropy bonus); Clip-Cov and KL-Cov act on the high-covariance tokens
# alone; TEPO's KL mask holds back the tokens with positive advantage whose entropy is falling.

# ---- 5.1 the entropy bonus (Williams and Peng 1991; PPO's c2 S[pi], arXiv 1707.06347) --------------

def entropy_bonus(logits: torch.Tensor, mask: torch.Tensor, cfg: ObjectiveConfig, temperature: float = 1.0, *,
                  num_tokens=None, num_seqs=None) -> torch.Tensor:
    """The entropy bonus, a loss term: -entropy_coef * aggregate(H), H the full-vocabulary entropy at each
    token, WITH its gradient.                                                 [B, T, V], [B, T] -> scalar

    A classic remedy against entropy collapse (Williams and Peng 1991; PPO's c2 S[pi] term, arXiv 1707.06347
    eq. 9). Added by the trainer to any objective's loss, as verl's actor adds its entropy_coeff outside the
    policy losses, and aggregated like that objective's loss (cfg.aggregation, num_tokens / num_seqs as in
    aggregate_loss). Its gradient on the logits z of a position is -entropy_coef * w * dH/dz with
    dH/dz_v = -p_v (log p_v + H) (entropy_grad_wrt_logits, section 4), w the aggregation weight.
    Flag: --entropy-coef. Zero (no gradient, no cost) when entropy_coef = 0.
    """
    if cfg.entropy_coef == 0:
        return torch.zeros((), dtype=_at_least_float32(logits).dtype, device=logits.device)
    entropy = softmax_entropy(_tempered(logits, temperature))                   # [B, T], with gradient
    return -cfg.entropy_coef * aggregate_loss(entropy, mask, cfg.aggregation, num_tokens=num_tokens,
                                              num_seqs=num_seqs, norm_constant=cfg.norm_constant)


# ---- 5.2 Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
#          arXiv 2505.22617) ------------------------------------------------------------------------

@torch.no_grad()
def token_covariance(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cov_{i,t} = (log pi_{i,t} - mean log pi) * (A_{i,t} - mean A), means over valid tokens.  [B, T]

    Each token's contribution to Cov(log pi, A), the quantity that drives entropy down (section 4). High values
    mark confident tokens with positive advantage (or rare ones with negative advantage): the tokens that
    collapse entropy. Used by Clip-Cov, KL-Cov and TEPO's mask. 0 at padding.
    """
    logp = logp.detach()
    adv = _per_position(advantages.detach().to(logp.dtype), logp)
    cov = (logp - masked_mean(logp, mask)) * (adv - masked_mean(adv, mask))
    return torch.where(mask.bool(), cov, torch.zeros_like(cov))


@objective(reads=("ref_logp",))
def clip_cov_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """Clip-Cov: detach the gradient of a few random high-covariance tokens.

        l_{i,t} = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)) * (0 if (i,t) selected else 1)
        candidates: valid, not already clipped by PPO, clip_cov_lb < Cov_{i,t} < clip_cov_ub
        selected:   min(max(1, int(clip_cov_ratio * N_valid)), #candidates) drawn uniformly;
                    none at clip_cov_ratio = 0 (ours: the control that selects nothing)

    High Cov_{i,t} = (log pi - mean)(A - mean) marks the tokens that drive entropy down (section 4); freezing a
    few of them keeps entropy up. The draw uses torch's global RNG: seed it for reproducibility.
    Paper: arXiv 2505.22617. verl 0.9.1: policy_loss.loss_mode="clip_cov", clip_cov_ratio=2e-4, clip_cov_lb=1,
    clip_cov_ub=5; the official scripts set clip_ratio_low = clip_ratio_high = 1. Does something even on-policy
    (selection does not depend on the ratio), but selects nothing when no token's covariance falls in (lb, ub).
    beta > 0 adds a k3 KL to the reference.
    """
    ratio = _token_ratio(x, cfg)                                                        # [B, T]
    loss, low, high = clipped_surrogate(ratio, x.adv, cfg.eps_low, cfg.eps_high)
    with torch.no_grad():
        cov = token_covariance(x.logp, x.adv, x.mask)
        # candidates: valid tokens that PPO has not already clipped (low | high), lb < Cov < ub
        ranked = cov.masked_fill(~x.mask | low | high, float("-inf"))
        candidates = ((ranked > cfg.clip_cov_lb) & (ranked < cfg.clip_cov_ub)).flatten().nonzero().squeeze(-1)
        # verl's max(1, ...) selects a token at any ratio > 0; ratio 0 is Clip-Cov switched off (our addition)
        n_clip = min(max(1, int(cfg.clip_cov_ratio * x.mask.sum().item())) if cfg.clip_cov_ratio > 0 else 0,
                     candidates.numel())
        chosen = candidates[torch.randperm(candidates.numel(), device=candidates.device)[:n_clip]]
        keep = torch.ones(x.logp.numel(), dtype=torch.bool, device=x.logp.device)
        keep[chosen] = False
        keep = keep.view_as(x.logp)
    loss = torch.where(keep, loss, torch.zeros_like(loss))                  # selected: no value, no grad
    extra = {"cov/n_selected": torch.tensor(float(n_clip)), "cov/mean": masked_mean(cov, x.mask)}
    return PolicyTerms(loss, ratio, low, high, kl=_reference_kl(x, cfg, "clip_cov"), extra=extra)


@objective(reads=())
def kl_cov_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """KL-Cov: no clipping; a |log-ratio| penalty on the top-covariance tokens.

        l_{i,t} = -A r_{i,t} + beta |log pi_theta - log pi_old|_{i,t} * 1[(i,t) in top-k by Cov]
        k = max(1, int(kl_cov_ratio * N_valid))

    Every other token gets the unclipped policy-gradient loss -A r. beta is KL-Cov's coefficient (ppo_kl_coef),
    not a reference KL. Paper: arXiv 2505.22617. verl 0.9.1: policy_loss.loss_mode="kl_cov", kl_cov_ratio (2e-3
    for 7B, 2e-4 for 32B), ppo_kl_coef=1. Does nothing on-policy: |0| = 0 and torch's d|x|/dx at 0 is 0, so with
    one update per rollout KL-Cov is the plain unclipped policy gradient (metrics: on_policy = 1; property 44).
    """
    ratio = _token_ratio(x, cfg)                                                        # [B, T]
    loss = -x.adv * ratio                                                   # unclipped, every token
    n_valid = int(x.mask.sum().item())
    k = min(max(1, int(n_valid * cfg.kl_cov_ratio)), n_valid)
    with torch.no_grad():
        cov = token_covariance(x.logp, x.adv, x.mask)
        selected = torch.zeros(x.logp.numel(), dtype=torch.bool, device=x.logp.device)
        selected[torch.topk(cov.masked_fill(~x.mask, float("-inf")).flatten(), k).indices] = True
        selected = selected.view_as(x.logp)
    penalty = kl_penalty(x.logp, x.old_logp, cfg.kl_estimator)               # |delta| by default
    # verl adds beta * penalty inside the per-token loss; aggregation is linear, so keeping it as
    # the KL part (aggregated the same way) gives the same value and gradient and logs it apart.
    kl = torch.where(selected, penalty, torch.zeros_like(penalty))
    no_clip = torch.zeros_like(x.mask)
    extra = {"cov/n_selected": torch.tensor(float(k)), "cov/mean": masked_mean(cov, x.mask)}
    return PolicyTerms(loss, ratio, no_clip, no_clip, kl=kl, extra=extra)


# ---- 5.3 TEPO (Lin et al. 2025/2026, arXiv 2510.09369 v1, 2604.12736 v2, ACL 2026) -- RECONSTRUCTION

def tepo_kl_mask(logp, advantages, mask, cfg, entropy=None, old_entropy=None) -> torch.Tensor:
    """TEPO's KL mask M_{i,t} = 1[A_i > 0] * 1[entropy at (i,t) is decreasing] on valid tokens.  bool [B, T]

    "Decreasing entropy" is not defined in the public text; two readings (entropy_criterion):
      cov       Cov_{i,t} > 0: the token's share of Cov(log pi, A) is positive, which by the
                derivation (section 4) means a policy-gradient step lowers entropy there. With
                A > 0 this picks positive-advantage tokens more probable than the batch average.
      measured  H_theta(i,t) < H_old(i,t): the full-vocabulary entropy at that position has fallen
                since the rollout (needs both entropies).
    Built from detached tensors only: autograd never differentiates through the mask.
    """
    adv = _per_position(advantages.detach(), mask)
    if cfg.entropy_criterion == "cov":
        decreasing = token_covariance(logp, adv, mask) > 0
    else:
        if entropy is None or old_entropy is None:
            raise ValueError("entropy: entropy_criterion='measured' needs entropy and old_entropy "
                             "[B, T]; pass both or choose entropy_criterion='cov'")
        decreasing = entropy.detach() < old_entropy.detach()
    return (adv > 0) & decreasing & mask.bool()


def random_clip_like(unclipped: torch.Tensor, clipped: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor):
    """A control of ours, not from a paper: clip as many sequences as the band clipped, but drawn at random.

    unclipped [B, T]: the loss with no clip (-A w); clipped [B, T] bool: the band's clipped tokens. n = the
    sequences with a clipped token; n sequences are drawn uniformly, without replacement, from those the band could
    clip (a valid token, A != 0), and their tokens get the band's treatment: the loss's value, no gradient. Made
    for the sequence ratio (gspo_token), whose clip takes whole sequences. It tells which sequences the band
    clips from how many: both remove the same share of the batch. The draw uses torch's global RNG, as Clip-Cov's.
    Returns (loss, clipped_low, clipped_high) [B, T] each: what was dropped, by the sign of A."""
    valid = mask.bool()
    n = int((clipped & valid).any(-1).sum())
    candidates = ((adv != 0) & valid).any(-1).nonzero().squeeze(-1)                      # [n_candidates]
    chosen = candidates[torch.randperm(candidates.numel(), device=candidates.device)[:n]] if n else candidates[:0]
    dropped = torch.zeros(unclipped.shape[0], dtype=torch.bool, device=unclipped.device)
    dropped[chosen] = True
    dropped = dropped.unsqueeze(-1) & valid                                              # [B, T]
    loss = torch.where(dropped, unclipped.detach(), unclipped)
    return loss, dropped & (adv < 0), dropped & (adv > 0)


@objective(reads=("ref_logp", "entropy", "old_entropy"))
def tepo_loss(x: ObjectiveInputs, cfg: ObjectiveConfig) -> PolicyTerms:
    """TEPO (Token-level Policy Optimization) -- a RECONSTRUCTION from the abstracts.

        J = E[ 1/(sum_i |o_i|) sum_i sum_t ( min(w_{i,t} A_i, clip(w_{i,t}, 1-eps_low, 1+eps_high) A_i)
                                              - beta M_{i,t} D_{i,t} ) ]
        w_{i,t} = sg[s_i] pi_{i,t} / sg[pi_{i,t}],  s_i = geometric-mean sequence ratio (GSPO-token)
        M_{i,t} = 1[A_i > 0] * 1[entropy decreasing at (i,t)]   (tepo_kl_mask; no gradient)
        D_{i,t} = KL estimate of pi_theta against pi_old (kl_target="old") or pi_ref ("ref")

    What is public (arXiv 2510.09369 v1, 2604.12736 v2, ACL 2026): group rewards are linked to tokens through
    the sequence ("Markov") likelihood with token-level aggregation, and a token-level KL mask constrains tokens
    with positive advantage and decreasing entropy. What is ours: everything else. It is GSPO-token's ratio with
    DAPO's token-mean, plus the masked KL. The switches that cover the ambiguity:
      ratio_mode        gspo_token (above) | gmpo (GMPO's clipped geometric-mean ratio and loss, section 3.5)
      entropy_criterion cov | measured                 (see tepo_kl_mask)
      kl_target         old | ref;  kl_estimator abs | k3 | ...;  beta (default 1)
      kl_mode           soft (+ beta M D) | hard (drop the policy gradient of masked tokens whose D > kl_tau)
      aggregation       token-mean (default); seq-mean-token-mean gives GSPO + the mask (ablation)
      clip_choice       band (default) | random: a control of ours, not TEPO (random_clip_like)
    Defaults: PAPER_DEFAULTS["tepo"]; eps (3e-4, 4e-4) are GSPO's: a geometric-mean ratio hardly moves.
    Does nothing beyond DAPO when on-policy: with kl_target="old", D = 0 and dD = 0 at r = 1, so the mask only
    acts from the second mini-batch or epoch of a rollout on (metrics: on_policy = 1). Off-policy with an empty
    mask it weighs sequence i by |o_i| / mean|o| relative to GSPO (equal lengths: GSPO's gradient).
    Metrics add kl_mask/frac (masked / valid tokens) and kl_mask/penalty (mean of M * D).
    """
    if cfg.ratio_mode == "gspo_token":
        w = _sequence_ratio_per_token(x, cfg)                                           # [B, T]
        loss, low, high = clipped_surrogate(w, x.adv, cfg.eps_low, cfg.eps_high)
    else:
        loss, w, low, high = _gmpo_surrogate(x, cfg, "tepo with ratio_mode='gmpo'")
    if cfg.clip_choice == "random":     # a control (ours): the band's number of clipped sequences, drawn at random
        loss, low, high = random_clip_like(-x.adv * w, low | high, x.adv, x.mask)
    kl_mask = tepo_kl_mask(x.logp, x.adv, x.mask, cfg, x.entropy, x.old_entropy)        # [B, T]
    target = x.old_logp if cfg.kl_target == "old" else x.ref_logp
    if target is None:
        raise ValueError("ref_logp: tepo with kl_target='ref' needs reference log-probs; pass "
                         "ref_logp or choose kl_target='old'")
    D = kl_penalty(x.logp, target.detach().to(x.logp.dtype), cfg.kl_estimator)         # [B, T]
    masked_D = torch.where(kl_mask, D, torch.zeros_like(D))                              # M * D
    if cfg.kl_mode == "hard":   # no KL part: the masked tokens far from the target lose their gradient
        loss = torch.where(kl_mask & (D.detach() > cfg.kl_tau), torch.zeros_like(loss), loss)
    extra = {"kl_mask/frac": masked_mean(kl_mask.to(x.logp.dtype), x.mask),
             "kl_mask/penalty": masked_mean(masked_D.detach(), x.mask)}
    return PolicyTerms(loss, w, low, high, kl=masked_D if cfg.kl_mode == "soft" else None, extra=extra)


# =====================================================================================================
# 6. The objectives by name: each one's function, the switches it reads, the inputs it needs
# =====================================================================================================

OBJECTIVES = {"ppo": ppo_clip_loss, "grpo": grpo_loss, "dapo": dapo_loss, "dr_grpo": dr_grpo_loss, "cispo": cispo_loss,
              "clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss, "gspo": gspo_loss, "gspo_token": gspo_token_loss,
              "gmpo": gmpo_loss, "sapo": sapo_loss, "tepo": tepo_loss, "mpo": mpo_loss}

# Which ObjectiveConfig fields each objective reads; a field not listed changes nothing for that objective.
# Where each setting comes from:
#   eps_low, eps_high     PPO's clip (arXiv 1707.06347); eps_high > eps_low is DAPO's clip-higher (arXiv 2503.14476)
#   dual_clip_c           dual-clip PPO (Ye et al., arXiv 1912.09729), on by default in verl's `vanilla` loss
#   log_ratio_clamp, adv_eps   implementation guards (verl's clamp; the std division's epsilon), no paper
#   beta, kl_estimator    GRPO's k3 KL to the reference (arXiv 2402.03300); KL-Cov's and TEPO's penalty
#   aggregation, norm_constant, advantage_scale   GRPO, DAPO, Dr. GRPO (arXiv 2503.20783: "none", L_max)
#   dynamic_sampling, overlong_penalty   DAPO;   entropy_coef   the entropy bonus (PPO's c2), added by the trainer
#   clip_cov_*, kl_cov_ratio   Clip-Cov / KL-Cov (arXiv 2505.22617);   cispo_weight   CISPO;   sapo_tau_*   SAPO
#   ratio_mode, entropy_criterion, kl_target, kl_mode, kl_tau   TEPO (arXiv 2510.09369), our reconstruction;
#                         clip_choice: ours, an experiment's control for TEPO's band (docs/collapse.md)
#   block_size, block_ratio, block_agg   MPO (arXiv 2602.14386), our reconstruction
# TRAINER_FIELDS are read by train_small.py (advantages and data) for every objective, never by a loss.
# MPO reads block_agg instead of aggregation/norm_constant (its unit is a block). Some fields act only together
# with another: kl_estimator only when beta > 0 (or, for TEPO, kl_mode="hard"), norm_constant only with
# aggregation="seq-mean-token-sum-norm", dual_clip_c only when it is not None, kl_tau only with kl_mode="hard".
# test_tepo.py section 14 checks every entry both ways.
TRAINER_FIELDS = ("advantage_scale", "adv_eps", "dynamic_sampling", "overlong_penalty", "entropy_coef")
_CLIP = ("eps_low", "eps_high", "log_ratio_clamp")
_KL_AND_AGGREGATION = ("beta", "kl_estimator", "aggregation", "norm_constant")
FIELDS_READ: dict[str, tuple[str, ...]] = {
    "ppo": _CLIP + ("dual_clip_c",) + _KL_AND_AGGREGATION + TRAINER_FIELDS,
    "grpo": _CLIP + ("dual_clip_c",) + _KL_AND_AGGREGATION + TRAINER_FIELDS,
    "dapo": _CLIP + ("dual_clip_c",) + _KL_AND_AGGREGATION + TRAINER_FIELDS,
    "dr_grpo": _CLIP + ("dual_clip_c",) + _KL_AND_AGGREGATION + TRAINER_FIELDS,
    "cispo": _CLIP + _KL_AND_AGGREGATION + ("cispo_weight",) + TRAINER_FIELDS,
    "clip_cov": _CLIP + _KL_AND_AGGREGATION + ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub") + TRAINER_FIELDS,
    "kl_cov": ("log_ratio_clamp",) + _KL_AND_AGGREGATION + ("kl_cov_ratio",) + TRAINER_FIELDS,
    "gspo": _CLIP + _KL_AND_AGGREGATION + TRAINER_FIELDS,
    "gspo_token": _CLIP + _KL_AND_AGGREGATION + TRAINER_FIELDS,
    "gmpo": _CLIP + _KL_AND_AGGREGATION + TRAINER_FIELDS,
    "sapo": ("log_ratio_clamp",) + _KL_AND_AGGREGATION + ("sapo_tau_pos", "sapo_tau_neg") + TRAINER_FIELDS,
    "tepo": _CLIP + _KL_AND_AGGREGATION + ("ratio_mode", "entropy_criterion", "kl_target", "kl_mode", "kl_tau",
                                           "clip_choice") + TRAINER_FIELDS,
    "mpo": _CLIP + ("beta", "kl_estimator", "block_size", "block_ratio", "block_agg") + TRAINER_FIELDS,
}
# Section 1's two options are read by every objective: `objective` applies them to any maths' loss (_options).
OPTION_FIELDS = ("sampler_correction", "sampler_correction_cap", "top_entropy_share")
FIELDS_READ = {name: read + OPTION_FIELDS for name, read in FIELDS_READ.items()}


def needs_ref(name: str, cfg: ObjectiveConfig) -> bool:
    """Does this objective need log-probs from a frozen reference model?"""
    if name == "tepo":
        return cfg.kl_target == "ref" and (cfg.beta > 0 or cfg.kl_mode == "hard")
    if name == "kl_cov":          # KL-Cov's beta weighs |log pi - log pi_old|, not a reference KL
        return False
    return cfg.beta > 0


def needs_entropy(name: str, cfg: ObjectiveConfig) -> bool:
    """Does this objective need the entropy now and at rollout time (TEPO's measured criterion)?"""
    return name == "tepo" and cfg.entropy_criterion == "measured"

