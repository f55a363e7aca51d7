"""The one place where measurement looks inside the RL step's update (train_small.py, update_policy).

Before each optimizer step, once its mini-batch's gradient is accumulated and before it is clipped, the update
calls its observer: observe(i, n, batch, micro_batches, model) for optimizer step i of n of the rollout `batch`. UpdateTaps is that observer.
What it keeps is asked for before the step by the measurements that need it (tepokit/diagnostics/after_step.py,
step_taps), and they read it after the step:

  logits_rows   the policy's logits over the rollout's first rows, before the first optimizer step: the entropy
                check compares them with the logits after the update                     logits_before [c, T, V]
  parameters    a copy of the parameters before the step's LAST optimizer step: the mechanisms' effects are
                taken there (its parameters, its mini-batch, its old log-probs)                  parameters, at
  entropies     each optimizer step's token entropies over its mini-batch, when the objective did not compute
                them (where TEPO's KL mask would fall under the `measured` criterion: details.jsonl)
                                                     entropies: per optimizer step, per micro-batch [b, T]

The update computes nothing for them: its forwards, losses and optimizer steps are the same with the taps or
without. The taps run their own forwards without gradient, leave the parameters' .grad as it is, and draw no
random number."""

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
