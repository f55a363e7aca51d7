"""What an RL step did, measured after it from its record (train_small.py: rl_step returns a StepRecord; the loop
calls measure_step with it). One metrics.jsonl row's measurements, and for TEPO its details.jsonl row:

  - the rollout: rewards, accuracy, the groups DAPO's filter kept, the completions' lengths (rollout_metrics); its
    entropy and Cov(log pi, A); how far the sampler's and the bf16 forward's log-probs are from their references;
  - the entropy change of the update, predicted against measured (tepokit/diagnostics/entropy_check.py);
  - what each mechanism of the objective did at the step's last optimizer step (tepokit/diagnostics/mechanisms.py);
  - the rollout's forking tokens, and the hidden-type task's strategies (tepokit/diagnostics/forking_tokens.py),
    and which of its completions the clip took out of the update (tepokit/diagnostics/band.py);
  - for TEPO, where its KL mask fell in each mini-batch (tepokit/diagnostics/kl_mask_details.py), rebuilt from
    what the loss saw, so it is the mask the update used.

Three of them need what only the inside of the update holds: the logits before the first optimizer step, the
parameters of the optimizer step whose mechanisms are measured, and each optimizer step's entropies. step_taps
asks for them before the step (tepokit/core/taps.py: the update's one observer). Everything else runs after the
step with its own forwards. None draws a random number from the run's stream, so a run's training is the same
with any of them switched off."""

from __future__ import annotations

import dataclasses

import torch

import tepo
from tepokit.core.forward import completion_logits, token_logprobs
from tepokit.core.taps import UpdateTaps
from tepokit.diagnostics.entropy_check import NO_ENTROPY_CHANGE, checked_rows, entropy_check
from tepokit.diagnostics.band import band_clips
from tepokit.diagnostics.forking_tokens import decision_mask, rollout_fork_metrics, strategy_of
from tepokit.diagnostics.kl_mask_details import kl_mask_details
from tepokit.diagnostics.mechanisms import effect_check_interval, mechanism_effects, mechanisms


def step_taps(run, step: int) -> UpdateTaps:
    """What this step's measurements need from inside its update (tepokit/core/taps.py): the logits before the
    update on the entropy check's rows (every --entropy-check-every steps), the parameters of the last optimizer
    step (every --effect-check-every steps, if the objective has a mechanism), and each optimizer step's entropies
    (TEPO's details.jsonl, when its criterion did not make the loss compute them)."""
    args, rollout_rows = run.args, run.args.prompts_per_step * run.args.group_size
    every = effect_check_interval(args.effect_check_every, args.model)
    return UpdateTaps(
        settings=run.settings,
        logits_rows=(checked_rows(args.entropy_check_rows, rollout_rows, args.max_new_tokens)
                     if step % args.entropy_check_every == 0 else 0),
        parameters=bool(every) and step % every == 0 and bool(mechanisms(args.objective, run.cfg)),
        entropies=run.details_path is not None and not tepo.needs_entropy(args.objective, run.cfg))


def measure_step(run, step: int, record, taps: UpdateTaps) -> tuple[dict, dict | None]:
    """The step's measurements: one dict of floats for metrics.jsonl, and TEPO's details.jsonl row (else None).
    record: what rl_step did (train_small.StepRecord); taps: what step_taps kept from inside its update. From the
    run it reads its model, tokenizer, objective config and StepSettings (run.settings)."""
    settings, batch, plan, G = run.settings, record.batch, record.plan, run.args.group_size
    problems, seen = record.problems, record.seen
    if taps.kept_entropies and not settings.recompute:   # the fast twin: the first optimizer step's forward is the old
        entropy = seen.entropy.clone()                   # policy of its rows (update_policy), its entropies too, as the
        for (rows, _, _), first in zip(record.loss_saw[0], taps.kept_entropies[0]):   # loss takes them when it reads
            entropy[rows.to(entropy.device)] = first.to(entropy.dtype)              # them (TEPO's measured criterion)
        seen = dataclasses.replace(seen, entropy=entropy)

    def each_row(column):                  # a column of the problems, one value per completion [B]; or None
        return [v for v in problems[column] for _ in range(G)] if column in problems.column_names else None
    row = {**rollout_metrics(batch, record.scored, record.keep, G), **rollout_statistics(run.model, record, settings)}
    if taps.logits_before is not None:
        row |= entropy_check(run.model, batch, taps.logits_before, settings)
    elif not plan:         # a step without an update changed nothing; otherwise the check skipped this step
        row |= NO_ENTROPY_CHANGE
    types = each_row("type")
    one_token_per_character = run.args.model is None     # the built-in tokenizer: decisions are read from the text
    if taps.kept_parameters is not None:
        decisions = (decision_mask(record.texts, batch.completion_mask.shape, batch.completion_mask.device)
                     if types is not None and one_token_per_character else None)                    # [B, T]
        row |= mechanism_effects(run.model, taps.kept_parameters, batch, seen, record.adv, plan[taps.at],
                                 settings.objective, run.cfg, settings, step, decisions)
        row["effect/optimizer_step"], row["effect/optimizer_steps"] = float(taps.at + 1), float(len(plan))
    row |= rollout_fork_metrics(record.texts, types, seen.entropy, seen.logp, record.adv, batch.completion_mask,
                                record.scored["strict"], G, one_token_per_character, each_row("answer"),
                                each_row("cue"))
    if types is not None and one_token_per_character:     # which completions the clip took out (band.py)
        row |= band_clips(settings.objective, run.cfg, record.loss_saw, seen.logp, record.adv, batch.completion_mask,
                          [strategy_of(text) for text in record.texts], each_row("cue"))
    details = None
    if run.details_path:
        saw = [[(rows, logp, entropy if entropy is not None else taps.kept_entropies[i][j])
                for j, (rows, logp, entropy) in enumerate(micro_batches)]
               for i, micro_batches in enumerate(record.loss_saw)]
        details = kl_mask_details(run.cfg, step, saw, batch, seen, record.adv, record.scored["rewards"], run.tokenizer)
    return row, details


def rollout_metrics(batch, scored: dict, keep, group_size: int) -> dict:
    """What the rollout looked like: rewards (each of --reward apart), accuracy, groups kept, lengths. batch: the
    Rollout; scored: rewards, strict and lenient correctness [B], each reward's [B] (parts); keep [B]: the rows
    DAPO's filter kept; group_size: G."""
    mask, rewards = batch.completion_mask, scored["rewards"]
    return {"reward": rewards.mean().item(), "reward_std": rewards.std().item(),
            "accuracy/strict": scored["strict"].mean().item(), "accuracy/lenient": scored["lenient"].mean().item(),
            "frac_reward_zero_std": 1 - tepo.dynamic_sampling_mask(rewards, group_size).float().mean().item(),
            "dynamic_sampling/kept_frac": keep.float().mean().item(),
            "dynamic_sampling/skipped": float(not keep.any()),
            "completions/mean_length": mask.sum(1).float().mean().item(),
            "completions/clipped_ratio": batch.truncated.float().mean().item(),
            **{f"rewards/{name}/mean": values.mean().item() for name, values in scored.get("parts", {}).items()}}


def rollout_statistics(model, record, settings) -> dict:
    """The old policy's mean entropy and Cov(log pi_old, A) over the rollout; with the sampler's log-probs beside
    recomputed ones, how far apart they are; how far the first forward's log pi was from the old log-probs it was
    compared with (0 when they are its own forward's: exactly on-policy); and the bf16 noise floor."""
    batch, old, mask = record.batch, record.old, record.batch.completion_mask
    covariance = tepo.token_covariance(old.logp, record.adv.to(mask.device), mask)        # [B, T]
    first_rows = record.plan[0][0] if record.plan else torch.arange(mask.shape[0])[:settings.rows_per_forward]
    row = {"entropy": tepo.masked_mean(old.entropy, mask).item(),
           "cov/logp_adv": tepo.masked_mean(covariance, mask).item(),
           **precision_noise_floor(model, batch, first_rows, settings)}
    if settings.recompute and batch.sampling_logp is not None:    # how far the sampler's were from the recomputed
        gap = (batch.sampling_logp - old.logp).abs()[mask.bool()]
        row["logprobs/sampling_vs_recomputed_max_abs"] = gap.max().item()
    if record.loss_saw:            # the update's first forward against the old log-probs it was given
        rows, logp, _ = record.loss_saw[0][0]
        gap = (logp - old.logp[rows.to(mask.device)]).abs()[mask[rows.to(mask.device)].bool()]
        row["logprobs/first_minibatch_max_abs_log_ratio"] = gap.max().item() if len(gap) else 0.0
        row["logprobs/first_minibatch_mean_abs_log_ratio"] = gap.mean().item() if len(gap) else 0.0
    return row


@torch.no_grad()
def precision_noise_floor(model, batch, rows: torch.Tensor, settings) -> dict:
    """How far the run's precision puts the log-probs from float32's, on one micro-batch (the update's first) at
    the parameters after the step: max and mean |log pi(bf16 autocast) - log pi(fp32)| over its valid tokens (0 in
    fp32, not computed). settings: the run's StepSettings (its precision, prompt_once and temperature).

    Any ratio band or masked penalty that acts on smaller log-ratios than this acts on rounding
    noise: GSPO's and TEPO's band is (1 - 3e-4, 1 + 4e-4), i.e. |log s| < 4e-4.
    """
    if settings.precision == "fp32":
        return {"precision/logp_error_max": 0.0, "precision/logp_error_mean": 0.0}
    tokens, valid = batch.completion_ids[rows.to(batch.completion_ids.device)], batch.completion_mask[rows].bool()
    logp = {precision: token_logprobs(completion_logits(model, batch, rows, precision, settings.prompt_once), tokens,
                                      settings.temperature) for precision in (settings.precision, "fp32")}
    error = (logp[settings.precision] - logp["fp32"]).abs()[valid]
    return {"precision/logp_error_max": error.max().item(), "precision/logp_error_mean": error.mean().item()}
