"""What an RL step did, measured outside it (train_small.py, rl_step): what its rollout looked like (rewards,
accuracy, the groups DAPO's filter kept, the completions' lengths: rollout_metrics), and after its update (step 7):

  - the entropy change of the update, predicted against measured (tepokit/diagnostics/entropy_check.py);
  - what each mechanism of the objective did to the update (tepokit/diagnostics/mechanisms.py);
  - the rollout's forks: the decision tokens and strategies of the hidden-type task (tepokit/diagnostics/forking_tokens.py);
  - for TEPO, where its KL mask fell in each mini-batch (details.jsonl, tepokit/diagnostics/kl_mask_details.py), rebuilt from what
    the loss saw (update_policy returns it), so it is the mask the update used.

The update is not told that it is measured: each measurement makes its own forward (and backward) passes
after it, and draws no random number from the run's stream, so a run's training is the same with any of
them switched off."""

from __future__ import annotations

import tepo
from tepokit.diagnostics.entropy_check import NO_ENTROPY_CHANGE, entropy_check
from tepokit.diagnostics.forking_tokens import decision_mask, rollout_fork_metrics
from tepokit.diagnostics.kl_mask_details import kl_mask_details
from tepokit.diagnostics.mechanisms import mechanism_effects


def measure_step(run, step: int, batch, old, adv, plan: list, seen: list, texts: list[str], records, scored: dict,
                 check_entropy: bool) -> tuple[dict, dict | None]:
    """The step's measurements: one dict of floats for metrics.jsonl, and TEPO's details.jsonl row (else None).
    batch: the Rollout; old: the OldPolicy (its logits before the update, where the entropy check ran); adv [B];
    plan: the update's mini-batches ([] when there was no update); seen: what the loss saw (update_policy);
    texts [B]; records: the step's problems (a Dataset of B / G rows; the hidden-type task's have a type, and with
    a cue a cue); scored: rewards and strict correctness [B]; check_entropy: this step checks the entropy change.
    From the run it reads its model, tokenizer, objective config and StepSettings (run.settings)."""
    settings = run.settings

    def each_row(column):                  # a column of the problems, one value per completion [B]; or None
        if column not in records.column_names:
            return None
        return [v for v in records[column] for _ in range(settings.group_size)]
    types = each_row("type")
    if check_entropy:
        row = entropy_check(run.model, batch, old.entropy_check_positions, settings)
    else:                  # a step without an update changed nothing; otherwise the check skipped this step
        row = dict(NO_ENTROPY_CHANGE) if not plan else {}
    one_token_per_character = settings.builtin_tokenizer   # the built-in tokenizer: decisions are read from the text
    every = settings.effect_check_every
    if plan and every and step % every == 0:
        decisions = (decision_mask(texts, batch.completion_mask.shape, batch.completion_mask.device)
                     if types is not None and one_token_per_character else None)                    # [B, T]
        row |= mechanism_effects(run.model, batch, old, adv, plan, settings.objective, run.cfg, settings, step,
                                 decisions)
    row |= rollout_fork_metrics(texts, types, old.entropy, old.logp, adv, batch.completion_mask, scored["strict"],
                                settings.group_size, one_token_per_character, each_row("answer"), each_row("cue"))
    details = (kl_mask_details(run.cfg, step, seen, batch, old, adv, scored["rewards"], run.tokenizer)
               if run.details_path else None)
    return row, details


def rollout_metrics(batch, scored: dict, keep, group_size: int) -> dict:
    """What the rollout looked like: rewards, accuracy, groups kept, lengths. batch: the Rollout; scored: rewards,
    strict and lenient correctness [B]; keep [B]: the rows DAPO's filter kept; group_size: G."""
    mask, rewards = batch.completion_mask, scored["rewards"]
    return {"reward": rewards.mean().item(), "reward_std": rewards.std().item(),
            "accuracy/strict": scored["strict"].mean().item(), "accuracy/lenient": scored["lenient"].mean().item(),
            "frac_reward_zero_std": 1 - tepo.dynamic_sampling_mask(rewards, group_size).float().mean().item(),
            "dynamic_sampling/kept_frac": keep.float().mean().item(),
            "dynamic_sampling/skipped": float(not keep.any()),
            "completions/mean_length": mask.sum(1).float().mean().item(),
            "completions/clipped_ratio": batch.truncated.float().mean().item()}
