"""What each mechanism of the objective did to the update: the tokens it touched and how much it changed the
gradient, measured at the RL step's last optimizer step, on its rows, with the mechanism on and switched off.

A mechanism is a part of an objective that exists to change the plain policy gradient: PPO's clip at each
bound, dual-clip, a KL term to the reference, Clip-Cov's detached tokens, KL-Cov's penalty, TEPO's KL mask.
Whether one acts depends on the regime, not only on the objective: the clip and every penalty against the
old policy are exactly inactive on an on-policy mini-batch (ratio 1), so with few optimizer steps per rollout
they have little or nothing to do. This module measures it, every --effect-check-every steps:

  effect/<mechanism>/tokens            valid tokens whose loss gradient the mechanism changed (a count)
  effect/<mechanism>/tokens_rewarded   of those, the tokens of rows with advantage > 0
  effect/<mechanism>/tokens_decision   of those, decision tokens (the hidden-type task's operator)
  effect/<mechanism>/update_change     |g_on - g_off| / |g_on|: how much the mechanism changed the gradient
  effect/<mechanism>/update_cosine     cos(g_on, g_off); both 0 when g_on = 0 (no gradient, or the mechanism
                                       took it all away: its token count tells which)
  effect/tokens                        valid tokens measured (the denominator of the counts)

g_on is the gradient of the objective with respect to every parameter on the rows of the step's LAST optimizer step
(aggregated as the update aggregates it), at that optimizer step's parameters and with the old log-probs its loss
compared with: the gradient that optimizer step applied, before clipping and Adam (tepokit/tests/test_mechanisms.py
checks it to 1e-9 in float64; Clip-Cov's random draw is the measurement's own, so there it is that gradient only
where the two draws agree). g_off is the same with the mechanism switched off (`mechanisms` says how), everything
else equal: a counterfactual of one real optimizer step. Which one is logged as effect/optimizer_step (1-based) of
effect/optimizer_steps: the last, the one after the most updates of the step (the first is on-policy: ratio 1);
the earlier ones are not measured. It costs a copy of the parameters (kept by the update's taps,
tepokit/core/taps.py), one forward over those rows and one backward for the objective and for each mechanism that
changed some token's gradient, after the step.

The update never knows it was measured: the copy is taken before its optimizer step and the measurement runs
after the RL step, with the parameters set to the copy for its duration (parameters_set_to), takes its gradients
with torch.autograd.grad (the parameters' .grad is untouched), and draws no random number from the run's stream
(Clip-Cov's random draw runs on a forked generator, the same draw for g_on and g_off).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

import tepo
from tepokit.core.forward import completion_logits, token_entropy, token_logprobs

OFF = float("inf")      # a clip range no ratio leaves

# The objectives that clip their ratio at 1 - eps_low and 1 + eps_high (GMPO in log space, at -eps_low and eps_high;
# CISPO clips a weight, not the update), and those whose beta weighs a KL term to the reference model (KL-Cov's beta
# weighs its own penalty, TEPO's its mask: see `mechanisms`). SAPO's smooth gate has no setting that switches it off
# (tau -> 0 is its limit, not a value): it has no mechanism here but its reference KL.
CLIPPING = ("ppo", "grpo", "dapo", "dr_grpo", "cispo", "clip_cov", "gspo", "gspo_token", "gmpo", "tepo", "mpo")
REFERENCE_KL = ("ppo", "grpo", "dapo", "dr_grpo", "cispo", "clip_cov", "gspo", "gspo_token", "gmpo", "sapo", "mpo")


def effect_check_interval(effect_check_every: int | None, model: str | None) -> int:
    """Every how many steps the effects are measured (0: never): --effect-check-every, or when unset 4 on the
    built-in model (no --model) and never with --model. On a real model the measurement is not free: besides its
    forward and backward passes it holds one gradient-sized buffer for the objective and one for each mechanism
    (4 x 2 GB for TEPO on Qwen2.5-0.5B in fp32), which the memory plan does not count; ask for it with the flag."""
    if effect_check_every is not None:
        return effect_check_every
    return 0 if model else 4


def mechanisms(objective: str, cfg: tepo.ObjectiveConfig) -> dict[str, tepo.ObjectiveConfig]:
    """Each mechanism of this objective and the config with it switched off (all else equal). Every mechanism
    the objective has is listed, also where its settings already switch it off (then it changes nothing).

      clip_low      the clip at 1 - eps_low (binds where A < 0)             off: eps_low = inf
      clip_high     the clip at 1 + eps_high (binds where A > 0); DAPO's clip-higher moves this bound, so it
                    can only change what clip_high does                      off: eps_high = inf
                    (CISPO's bounds cap its weight whatever the sign of A, and TRL's cap is eps_high itself)
      dual_clip     PPO's cap of the loss at -A c where A < 0                off: dual_clip_c = None
      kl_ref        beta x KL to the reference model (GRPO's k3)             off: beta = 0
      clip_cov      Clip-Cov's detached high-covariance tokens               off: clip_cov_ratio = 0
      kl_cov        KL-Cov's |log-ratio| penalty on the top-covariance tokens  off: beta = 0
      kl_mask       TEPO's masked KL (soft), or its dropped tokens (hard)    off: beta = 0 / kl_tau = inf
    """
    off = lambda **change: dataclasses.replace(cfg, **change)   # noqa: E731
    found = {}
    if objective in CLIPPING:
        found["clip_low"], found["clip_high"] = off(eps_low=OFF), off(eps_high=OFF)
    if objective in ("ppo", "grpo", "dapo", "dr_grpo"):
        found["dual_clip"] = off(dual_clip_c=None)
    if objective in REFERENCE_KL:
        found["kl_ref"] = off(beta=0.0)
    if objective == "clip_cov":
        found["clip_cov"] = off(clip_cov_ratio=0.0)
    if objective == "kl_cov":
        found["kl_cov"] = off(beta=0.0)
    if objective == "tepo":
        found["kl_mask"] = off(beta=0.0) if cfg.kl_mode == "soft" else off(kl_tau=OFF)
    return found


def token_gradients(objective, logp, old_logp, adv, mask, cfg, seed: int, **inputs) -> torch.Tensor:
    """d loss / d log pi at every token ([b, T]) of the objective on one micro-batch, its log-probs held fixed.
    The random draw of Clip-Cov (the only objective that draws) comes from a generator seeded with `seed`,
    forked from the run's: every call with the same seed makes the same draw, and the run's stream is left
    as it was."""
    x = logp.detach().requires_grad_(True)
    devices = [logp.device] if logp.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        torch.manual_seed(seed)
        loss, _ = objective(x, old_logp, adv, mask, cfg, **inputs)
        (grad,) = torch.autograd.grad(loss, x)
    return grad


@contextlib.contextmanager
def parameters_set_to(model, values: list):
    """The model's parameters hold `values` (tensors in model.parameters() order) for the block's duration, then
    their own values again, exactly: the tensors are swapped, not copied. Gradients taken inside are with respect to
    the model's own parameters, at those values."""
    params = list(model.parameters())
    own = [p.data for p in params]
    try:
        for p, value in zip(params, values):
            p.data = value
        yield
    finally:
        for p, value in zip(params, own):
            p.data = value


def mechanism_gradients(model, batch, old, adv: torch.Tensor, micro_batches: list, objective_name: str,
                        cfg: tepo.ObjectiveConfig, settings, seed: int, decisions: torch.Tensor | None = None):
    """The gradients g_on and each g_off (module docstring) over one mini-batch at the model's current parameters,
    and the tokens each mechanism touched: ({"on": [grad per parameter], <mechanism>: [...]}, counts, valid tokens).
    `batch` is the rollout, `old` the old policy as the loss saw it (train_small.OldPolicy), adv [B], micro_batches
    the mini-batch's rows [b] per micro-batch, settings the run's StepSettings (its forward's precision and
    prompt_once, and the temperature), decisions [B, T] 1 at the decision tokens (the hidden-type task) or None."""
    switches = mechanisms(objective_name, cfg)
    objective = tepo.OBJECTIVES[objective_name]
    params = [p for p in model.parameters() if p.requires_grad]
    names = ["on", *switches]
    total = {name: [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in params]
             for name in names}
    counts = {f"{m}/{kind}": 0 for m in switches for kind in ("tokens", "tokens_rewarded", "tokens_decision")}
    n_valid = 0
    adv = adv.to(batch.completion_mask.device)
    rows = torch.cat(micro_batches)
    mb_counts = dict(num_tokens=batch.completion_mask[rows].sum().item(), num_seqs=float(len(rows)))
    for micro in micro_batches:
        idx = micro.to(adv.device)
        mask, tokens = batch.completion_mask[idx], batch.completion_ids[idx]         # [b, T]
        with torch.enable_grad():
            logits = completion_logits(model, batch, micro, settings.precision, settings.prompt_once)  # [b, T, V]
            logp = token_logprobs(logits, tokens, settings.temperature)               # [b, T]
        entropy = token_entropy(logits.detach(), settings.temperature) if tepo.needs_entropy(objective_name, cfg) \
            else None
        # the two options of every objective read what the loss read (train_small.micro_batch_loss)
        sampler_logp = (None if cfg.sampler_correction == "none" else batch.sampling_logp[idx] if settings.recompute
                        else old.logp[idx])
        inputs = dict(ref_logp=old.ref_logp[idx] if old.ref_logp is not None else None, entropy=entropy,
                      old_entropy=old.entropy[idx] if entropy is not None or cfg.top_entropy_share < 1 else None,
                      sampler_logp=sampler_logp, **mb_counts)
        per_token = {"on": token_gradients(objective, logp, old.logp[idx], adv[idx], mask, cfg, seed, **inputs)}
        for name, cfg_off in switches.items():
            per_token[name] = token_gradients(objective, logp, old.logp[idx], adv[idx], mask, cfg_off, seed,
                                              **inputs)
        valid = mask.bool()
        n_valid += int(valid.sum())
        scale = per_token["on"].abs().max().clamp(min=torch.finfo(per_token["on"].dtype).tiny)
        for name in switches:
            touched = valid & ((per_token[name] - per_token["on"]).abs() > 1e-6 * scale)     # [b, T]
            counts[f"{name}/tokens"] += int(touched.sum())
            counts[f"{name}/tokens_rewarded"] += int((touched & (adv[idx] > 0).unsqueeze(1)).sum())
            if decisions is not None:
                counts[f"{name}/tokens_decision"] += int((touched & decisions[idx].bool()).sum())
        # the parameters' gradient, J^T (d loss / d log pi): one backward for the objective, and one for each
        # mechanism that changed some token's gradient (the others have the objective's, exactly)
        differ = ["on"] + [name for name in switches if not torch.equal(per_token[name], per_token["on"])]
        for i, name in enumerate(differ):
            grads = torch.autograd.grad(logp, params, grad_outputs=per_token[name].to(logp.dtype),
                                        retain_graph=i < len(differ) - 1, allow_unused=True)
            for name_added in [name] + ([n for n in names if n not in differ] if name == "on" else []):
                for acc, g in zip(total[name_added], grads):
                    if g is not None:
                        acc += g.to(acc.dtype)
        del logits, logp
    return total, counts, n_valid


def mechanism_effects(model, parameters: list, batch, old, adv: torch.Tensor, micro_batches: list,
                      objective_name: str, cfg: tepo.ObjectiveConfig, settings, seed: int,
                      decisions: torch.Tensor | None = None) -> dict:
    """The effect/ metrics (module docstring) of one optimizer step: its parameters (`parameters`, in
    model.parameters() order, as the update's taps kept them) and its mini-batch (micro_batches: rows [b] per
    micro-batch); the rest as mechanism_gradients. Nothing is measured for an objective without mechanisms."""
    switches = mechanisms(objective_name, cfg)
    if not switches:
        return {}
    with parameters_set_to(model, parameters):
        total, counts, n_valid = mechanism_gradients(model, batch, old, adv, micro_batches, objective_name, cfg,
                                                     settings, seed, decisions)
    g_on = torch.cat([g.flatten() for g in total["on"]]).double()        # float64: a cosine of 1 reads 1
    norm_on = g_on.norm()
    out = {"effect/tokens": float(n_valid)}
    for name in switches:
        g_off = torch.cat([g.flatten() for g in total[name]]).double()
        out[f"effect/{name}/update_change"] = ((g_on - g_off).norm() / norm_on).item() if norm_on > 0 else 0.0
        out[f"effect/{name}/update_cosine"] = torch.nn.functional.cosine_similarity(g_on, g_off, dim=0).item()
        out[f"effect/{name}/tokens"] = float(counts[f"{name}/tokens"])
        out[f"effect/{name}/tokens_rewarded"] = float(counts[f"{name}/tokens_rewarded"])
        if decisions is not None:
            out[f"effect/{name}/tokens_decision"] = float(counts[f"{name}/tokens_decision"])
    return out
