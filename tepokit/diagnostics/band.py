"""Which completions the clip takes out of the update, by what they are (docs/collapse.md, "Why the band explores").

On the hidden-type task a completion has three labels that matter for what the update teaches:
  - the item: the type its question's item word points to (`add` or `mul` with --cue; `any` without a cue);
  - the strategy: the type its first operator solves (`add`, `mul`, or `none` without an operator);
  - the sign of its advantage (`pos`: rewarded above its group's mean, `neg`: below; A = 0 gives no gradient and
    is not counted).
For every optimizer step after a rollout's first (the first is exactly on-policy: ratio 1, nothing clipped), each
row the step trained on is counted under its three labels, and so is whether the clip took it out: its ratio left
the band in the direction of its advantage (tepo.clipped_surrogate), for any of its tokens. With a sequence ratio
(GSPO, GSPO-token, TEPO) a completion is clipped whole; with a token ratio (GRPO, ...) a row counts as clipped when
any of its tokens is.

Logged per step as band/<item>_item/<strategy>/<sign>/rows and .../clipped, summed over the step's optimizer
steps after the first. With TEPO's clip_choice="random" (a control) these say what the band would have clipped;
clip_ratio/* say what the control dropped. Computed after the step from what the loss saw (the rows, log pi and the
old log-probs of each optimizer step), so it is the band the update used, and it draws no random number."""

from __future__ import annotations

import math

import torch

import tepo
from tepokit.diagnostics.mechanisms import CLIPPING

SEQUENCE_RATIO = ("gspo", "gspo_token")     # and tepo with ratio_mode="gspo_token"
STRATEGIES = ("add", "mul", "none")
SIGNS = ("pos", "neg")


def clipped_rows(objective_name: str, cfg: tepo.ObjectiveConfig, logp: torch.Tensor, old_logp: torch.Tensor,
                 adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[b] bool: the rows whose ratio the objective's clip binds at some token (logp, old_logp, mask [b, T];
    adv [b])."""
    valid = mask.bool()
    if objective_name in SEQUENCE_RATIO or (objective_name == "tepo" and cfg.ratio_mode == "gspo_token"):
        log_ratio = tepo.sequence_log_ratio(logp, old_logp, mask).unsqueeze(-1).expand_as(logp)     # [b, T]
    else:
        log_ratio = tepo.token_log_ratio(logp, old_logp, mask)                                        # [b, T]
    ratio = torch.exp(log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    eps_low, eps_high = cfg.eps_low, cfg.eps_high
    if objective_name == "gmpo" or (objective_name == "tepo" and cfg.ratio_mode == "gmpo"):   # a log-space band
        eps_low, eps_high = -math.expm1(-eps_low), math.expm1(eps_high)
    _, low, high = tepo.clipped_surrogate(ratio, adv.unsqueeze(-1).expand_as(logp), eps_low, eps_high)
    return ((low | high) & valid).any(-1)


def band_clips(objective_name: str, cfg: tepo.ObjectiveConfig, loss_saw: list, old_logp: torch.Tensor,
               adv: torch.Tensor, mask: torch.Tensor, strategies: list, items: list | None) -> dict:
    """The band/ counts of one RL step (module docstring). loss_saw: per optimizer step, per micro-batch, the loss's
    (rows [b], log pi [b, T], entropy); old_logp [B, T] the old policy as the loss saw it; adv [B]; mask [B, T];
    strategies [B]: each completion's strategy (None: no operator); items [B]: the type each row's item points to,
    or None without a cue. {} for an objective without a clip, and for CISPO, whose clip takes no token out."""
    if objective_name not in CLIPPING or objective_name == "cispo":
        return {}
    item_names = ("add", "mul") if items is not None else ("any",)
    counts = {f"band/{item}_item/{strategy}/{sign}/{what}": 0.0 for item in item_names for strategy in STRATEGIES
              for sign in SIGNS for what in ("rows", "clipped")}
    adv = adv.to(mask.device)
    for micro_batches in loss_saw[1:]:          # the first optimizer step is on-policy: nothing is clipped there
        for rows, logp, _ in micro_batches:
            idx = rows.to(mask.device)
            clipped = clipped_rows(objective_name, cfg, logp.to(old_logp.dtype), old_logp[idx], adv[idx], mask[idx])
            for row, was_clipped in zip(idx.tolist(), clipped.tolist()):
                if adv[row] == 0:
                    continue
                item = items[row] if items is not None else "any"
                key = f"band/{item}_item/{strategies[row] or 'none'}/{'pos' if adv[row] > 0 else 'neg'}"
                counts[key + "/rows"] += 1
                counts[key + "/clipped"] += float(was_clipped)
    return counts
