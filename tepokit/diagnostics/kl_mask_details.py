"""details.jsonl: where TEPO's KL mask falls in each RL step, rebuilt after the update from what its loss saw
(logging only; nothing flows back into the loss)."""

from __future__ import annotations

import dataclasses

import torch

import tepo

class KLMaskDetails:
    """One row of details.jsonl: where TEPO's KL mask falls during one RL step.

    details.jsonl (TEPO only: --objective tepo, even with --beta 0, where the mask is computed but has
    no effect; one JSON row per RL step, truncated on --resume like metrics.jsonl). Where TEPO's KL
    mask (tepo.tepo_kl_mask) falls, under the configured entropy criterion and under both criteria
    side by side; logging only (detached tensors: metrics.jsonl is bit-identical without it):
      step                          RL step, as in metrics.jsonl
      kl_mask_frac_by_minibatch     one value per optimizer step, in order (epochs x mini_batches, fewer
                                    when DAPO's filter left fewer groups; empty on a skipped step):
                                    masked / valid completion tokens under the configured criterion;
                                    its mean is metrics.jsonl's kl_mask/frac
      kl_mask_frac_cov_by_minibatch, kl_mask_frac_measured_by_minibatch
                                    the same with entropy_criterion cov / measured. measured is 0 on a
                                    step's first mini-batch (CPU; ~0 under CUDA's bf16): nothing has
                                    moved since the rollout
      kl_mask_position_counts       [T] masked tokens (configured criterion) at each completion position,
                                    summed over the step's mini-batches (T = padded completion width)
      valid_position_counts         [T] valid tokens at each position, summed the same way (a token is
                                    counted once per epoch): divide to get the masked fraction by position
      sample                        one completion of the last micro-batch: its first row in rollout order
                                    with A > 0 (its first row if none); null on a skipped step. Fields:
                                    prompt (text), tokens (each valid token decoded, end token included),
                                    reward, advantage, and per valid token, at the last micro-batch:
                                    kl_mask, kl_mask_cov, kl_mask_measured (0/1), entropy (rollout),
                                    entropy_after (at that micro-batch's forward), cov (token_covariance
                                    of the ROLLOUT log-probs over the micro-batch; the cov criterion uses
                                    the current ones, so off-policy a sign can differ), log_ratio
                                    (log pi - log pi_old); floats rounded to 4, 5 and 6 decimals

    kl_mask_details (below) calls add() once per micro-batch and close() after each optimizer step, from what
    update_policy returns that the loss saw; row() then builds the JSON row. Every mask is rebuilt here from
    detached tensors after the update, and nothing flows back into the loss or the optimizer.
    """

    def __init__(self, cfg: tepo.ObjectiveConfig, T: int, device):
        # Key suffix -> config: "" is the configured criterion, then each criterion forced.
        self.configs = {"": cfg, **{"_" + c: dataclasses.replace(cfg, entropy_criterion=c)
                                    for c in tepo.ENTROPY_CRITERIA}}
        self.masked = []                                                    # per mini-batch: [3] counts
        self.valid = []                                                     # per mini-batch: valid count
        self.open = None                                                    # counts of the current one
        self.masked_at = torch.zeros(T, dtype=torch.long, device=device)    # [T]
        self.valid_at = torch.zeros(T, dtype=torch.long, device=device)     # [T]
        self.last = None                                                    # the last mini-batch's tensors

    def add(self, rows, logp, old_logp, adv, mask, entropy, old_entropy) -> None:
        """One mini-batch: rows [b] (rollout indices), logp/old_logp/entropy/old_entropy/mask [b, T],
        adv [b]. Counts stay tensors until row(): no extra device syncs per optimizer step."""
        logp, entropy, valid = logp.detach(), entropy.detach(), mask.bool()
        masks = {key: tepo.tepo_kl_mask(logp, adv, mask, c, entropy, old_entropy)       # bool [b, T] each
                 for key, c in self.configs.items()}
        counts = (torch.stack([m.sum() for m in masks.values()]), valid.sum())
        self.open = counts if self.open is None else (self.open[0] + counts[0], self.open[1] + counts[1])
        self.masked_at += masks[""].sum(0)
        self.valid_at += valid.sum(0)
        self.last = dict(rows=rows, masks=masks, logp=logp, old_logp=old_logp, adv=adv, mask=valid,
                         entropy=entropy, old_entropy=old_entropy)

    def close(self) -> None:
        """The optimizer step is done: its mini-batch's counts become one entry of the lists."""
        self.masked.append(self.open[0])
        self.valid.append(self.open[1])
        self.open = None

    def row(self, step: int, batch, rewards: torch.Tensor, tokenizer) -> dict:
        """The JSON row of this step; a skipped step (no add()) has empty lists and no sample."""
        row = {"step": step}
        masked = torch.stack(self.masked).tolist() if self.masked else []   # [n_minibatches, 3]
        valid = torch.stack(self.valid).tolist() if self.valid else []
        for i, key in enumerate(self.configs):
            row[f"kl_mask_frac{key}_by_minibatch"] = [m[i] / v for m, v in zip(masked, valid)]
        row["kl_mask_position_counts"] = self.masked_at.tolist()
        row["valid_position_counts"] = self.valid_at.tolist()
        row["sample"] = self.sample(batch, rewards, tokenizer) if self.last is not None else None
        return row

    def sample(self, batch, rewards: torch.Tensor, tokenizer) -> dict:
        """The last micro-batch's first row in rollout order with A > 0 (its first row if none)."""
        last = self.last
        order = last["rows"].argsort()                       # mini-batch positions in rollout order
        positive = (last["adv"][order] > 0).nonzero()
        j = order[positive[0, 0] if len(positive) else 0]    # position of the sample in the mini-batch
        r = last["rows"][j].item()                           # its row in the rollout
        valid = last["mask"][j]                              # [T]
        # Per-token covariance of the rollout log-probs, centred over the whole mini-batch.
        cov = tepo.token_covariance(last["old_logp"], last["adv"], last["mask"])[j]       # [T]

        def tokens_of(x, digits=None):                       # [T] -> list over valid tokens
            values = x[valid].tolist()
            return values if digits is None else [round(v, digits) for v in values]

        return {"prompt": tokenizer.decode(batch.prompt_ids[r][batch.prompt_mask[r].bool()]),
                "tokens": [tokenizer.decode([i]) for i in tokens_of(batch.completion_ids[r])],
                "reward": rewards[r].item(), "advantage": last["adv"][j].item(),
                **{f"kl_mask{key}": tokens_of(m[j].int()) for key, m in last["masks"].items()},
                "entropy": tokens_of(last["old_entropy"][j], 4), "entropy_after": tokens_of(last["entropy"][j], 4),
                "cov": tokens_of(cov, 5), "log_ratio": tokens_of(last["logp"][j] - last["old_logp"][j], 6)}


def kl_mask_details(cfg: tepo.ObjectiveConfig, step: int, seen: list, batch, old, adv: torch.Tensor,
                    rewards: torch.Tensor, tokenizer) -> dict:
    """The details.jsonl row of one RL step. seen: what the loss saw, per optimizer step, per micro-batch:
    (rows [b], log pi [b, T], entropy [b, T]) (train_small.update_policy; the entropies from the update's taps where
    the loss read none); old: the OldPolicy the loss compared with (its first mini-batch's rows replaced before use)."""
    mask = batch.completion_mask
    adv = adv.to(mask.device)
    details = KLMaskDetails(cfg, batch.completion_ids.shape[1], mask.device)
    for micro_batches in seen:
        for rows, logp, entropy in micro_batches:
            details.add(rows, logp, old.logp[rows], adv[rows], mask[rows], entropy, old.entropy[rows])
        details.close()
    return details.row(step, batch, rewards, tokenizer)
