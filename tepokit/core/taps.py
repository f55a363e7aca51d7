"""The one place where measurement looks inside the RL step's update (train_small.py, update_policy): before each
optimizer step, its gradient accumulated and not yet clipped, the update calls observe(i, n, batch, micro_batches,
model) for optimizer step i of n. UpdateTaps is that observer. The measurements ask for what they need before the
step (tepokit/diagnostics/after_step.py, step_taps) and read it after it:
  logits_rows  logits_before [c, T, V]: the logits of the rollout's first c rows before the first optimizer step
               (the entropy check compares them with the logits after the update)
  parameters   kept_parameters, at: a copy of the parameters before the LAST optimizer step (the mechanisms'
               effects are taken there: its parameters, its mini-batch, its old log-probs)
  entropies    kept_entropies: each optimizer step's entropies [b, T] per micro-batch (TEPO's details.jsonl)
The update is the same with the taps or without: they run their own forwards without gradient, leave .grad as it
is, and draw no random number."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tepokit.core.forward import completion_logits, token_entropy


@dataclass
class UpdateTaps:
    settings: object                     # the run's StepSettings: its forward (precision, prompt_once, rows per
    #                                      forward) and temperature
    logits_rows: int = 0                 # keep the logits of this many of the rollout's first rows (0: none)
    parameters: bool = False             # keep the parameters before the last optimizer step
    entropies: bool = False              # keep each optimizer step's entropies
    logits_before: torch.Tensor | None = None             # [c, T, V]
    kept_parameters: list | None = None                   # the parameters' values, in model.parameters() order
    at: int | None = None                                 # the optimizer step they are from (0-based)
    kept_entropies: list = field(default_factory=list)     # per optimizer step, per micro-batch: [b, T]

    @torch.no_grad()
    def __call__(self, i: int, n: int, batch, micro_batches: list, model) -> None:
        precision, prompt_once = self.settings.precision, self.settings.prompt_once
        if i == 0 and self.logits_rows:      # as the entropy check's forward after the update will make them
            rows = torch.arange(min(self.logits_rows, batch.completion_ids.shape[0]))
            self.logits_before = torch.cat([completion_logits(model, batch, r, precision, prompt_once)
                                            for r in rows.split(self.settings.rows_per_forward)])
        if self.parameters and i == n - 1:
            self.kept_parameters, self.at = [p.detach().clone() for p in model.parameters()], i
        if self.entropies:
            self.kept_entropies.append([token_entropy(completion_logits(model, batch, micro, precision, prompt_once),
                                                      self.settings.temperature) for micro in micro_batches])
