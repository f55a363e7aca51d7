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
    fit ENTROPY_CHECK_MAX_POSITIONS positions at --max-new-tokens each (the sampler keeps their logits)."""
    return min(entropy_check_rows, rollout_rows, max(1, ENTROPY_CHECK_MAX_POSITIONS // max_new_tokens))


class EntropyCheckPositions:
    """The logits before the update at the positions the entropy check uses (entropy_check).

    Positions: the valid completion tokens of the rollout's first `rows` rows (checked_rows; 0: the check does
    not run this step), at most ENTROPY_CHECK_MAX_POSITIONS of them, kept in the model's dtype ([n, V]): with a
    151,936-token vocabulary each position costs 0.6 MB in float32, so the number must be bounded.
    """

    def __init__(self, batch, rows: int):
        rows = min(rows, batch.completion_ids.shape[0])
        valid = batch.completion_mask[:rows].bool()                              # [c, T]
        valid &= valid.flatten().cumsum(0).view_as(valid) <= ENTROPY_CHECK_MAX_POSITIONS
        self.rows, self.valid = rows, valid
        self.slot = torch.full(valid.shape, -1, dtype=torch.long, device=valid.device)  # [c, T]
        self.slot[valid] = torch.arange(int(valid.sum()), device=valid.device)
        self.before = None                                                          # [n, V]

    def capture(self, rows: torch.Tensor, logits: torch.Tensor) -> None:
        """Keep the rollout-policy logits of this forward's checked positions."""
        if self.before is None and (rows < self.rows).any():
            self.before = logits.new_empty(int(self.valid.sum()), logits.shape[-1])
        self.copy_into(self.before, rows, logits)

    def copy_into(self, out: torch.Tensor, rows: torch.Tensor, logits: torch.Tensor) -> None:
        """out[slot] = the logits of this forward ([b, T, V], rows [b]) at its checked positions."""
        rows = rows.to(self.valid.device)
        here = rows < self.rows
        if here.any():
            valid = self.valid[rows[here]]                                          # [h, T]
            out[self.slot[rows[here]][valid]] = logits.detach()[here][valid]


@torch.no_grad()
def entropy_check(model, batch, positions: EntropyCheckPositions, settings) -> dict:
    """Predicted vs measured entropy change of this step's updates, at the same completion positions
    (tepo.entropy_change_prediction: -Cov_p(log p, z_after - z_before) against H_after - H_before):
    entropy_change/predicted and /measured (means over the positions) and /position_corr (their
    correlation across the positions). `positions` holds the logits from before the update; settings: the
    run's StepSettings (tepokit/fast/step_settings.py), whose forward it runs (rows per forward, precision,
    prompt_once) at its temperature.

    The prediction is first order (a Taylor expansion in the logit change dz): near exact where an
    update moves the logits a little, wrong where it moves them by O(1), and a few such positions
    carry much of the measured change. So the correlation across positions within a step is high,
    and the correlation of the per-step means lower; docs/results.md has both, measured.
    """
    if positions.before is None:
        predicted = measured = corr = float("nan")
    else:
        after = torch.empty_like(positions.before)                                  # [n, V]
        for rows in torch.arange(positions.rows).split(settings.rows_per_forward):
            positions.copy_into(after, rows, completion_logits(model, batch, rows, settings.precision,
                                                               settings.prompt_once))
        change, measured_change = tepo.entropy_change_prediction(positions.before, after, settings.temperature,
                                                                 positions_per_chunk(after.shape[-1]))
        predicted, measured = change.mean().item(), measured_change.mean().item()
        corr = pearson(change.tolist(), measured_change.tolist())
    return {"entropy_change/predicted": predicted, "entropy_change/measured": measured,
            "entropy_change/position_corr": corr}
