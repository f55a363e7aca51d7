"""The entropy-change check run after each RL step: the change of the token entropy predicted by
tepo.entropy_change_prediction (-Cov(log p, z_after - z_before)) against the change measured, at the
same completion positions."""

from __future__ import annotations

import torch

import tepo
from tepokit.core.forward import completion_logits, positions_per_chunk
from tepokit.diagnostics.stats import pearson

ENTROPY_CHECK_MAX_POSITIONS = 2048   # the default built-in run checks ~1,000 (64 rows x ~16 tokens)
# A step without an update (DAPO's filter dropped every group): the entropy did not change.
NO_ENTROPY_CHANGE = {"entropy_change/predicted": 0.0, "entropy_change/measured": 0.0,
                     "entropy_change/position_corr": float("nan")}


def checked_rows(entropy_check_rows: int, rollout_rows: int, max_new_tokens: int) -> int:
    """Rows the entropy check uses: the first --entropy-check-rows of the rollout's rows, at most as many as
    fit ENTROPY_CHECK_MAX_POSITIONS positions at --max-new-tokens each (the update's taps keep their logits)."""
    return min(entropy_check_rows, rollout_rows, max(1, ENTROPY_CHECK_MAX_POSITIONS // max_new_tokens))


@torch.no_grad()
def entropy_check(model, batch, logits_before: torch.Tensor, settings) -> dict:
    """Predicted vs measured entropy change of this step's updates, at the same completion positions
    (tepo.entropy_change_prediction: -Cov_p(log p, z_after - z_before) against H_after - H_before):
    entropy_change/predicted and /measured (means over the positions) and /position_corr (their
    correlation across the positions). logits_before [c, T, V]: the policy's logits over the rollout's first c rows
    before the first optimizer step (tepokit/core/taps.py); the logits after are made the same way, by the run's
    forward (settings: its StepSettings: rows per forward, precision, prompt_once, temperature). The positions are
    the valid completion tokens of those rows, at most ENTROPY_CHECK_MAX_POSITIONS of them.

    The prediction is first order (a Taylor expansion in the logit change dz): near exact where an
    update moves the logits a little, wrong where it moves them by O(1), and a few such positions
    carry much of the measured change. So the correlation across positions within a step is high,
    and the correlation of the per-step means lower; docs/results.md has both, measured.
    """
    rows = torch.arange(logits_before.shape[0])
    valid = batch.completion_mask[rows].bool()                                      # [c, T]
    valid &= valid.flatten().cumsum(0).view_as(valid) <= ENTROPY_CHECK_MAX_POSITIONS
    after = torch.cat([completion_logits(model, batch, r, settings.precision, settings.prompt_once)
                       for r in rows.split(settings.rows_per_forward)])             # [c, T, V]
    before, after = logits_before[valid], after[valid]                              # [n, V] each
    if len(before) == 0:
        predicted = measured = corr = float("nan")
    else:
        change, measured_change = tepo.entropy_change_prediction(before, after, settings.temperature,
                                                                 positions_per_chunk(after.shape[-1]))
        predicted, measured = change.mean().item(), measured_change.mean().item()
        corr = pearson(change.tolist(), measured_change.tolist())
    return {"entropy_change/predicted": predicted, "entropy_change/measured": measured,
            "entropy_change/position_corr": corr}
