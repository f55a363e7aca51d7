"""The RL step's settings, resolved once: what the step's helpers in tepokit read, computed from the run's Args and
its model's config when the run starts (train_small.start_run), and by the memory plan the same way
(tepokit/tools/memory.py). A helper takes the values it uses, or this frozen record where it uses several of them;
none takes the whole Args."""

from __future__ import annotations

from dataclasses import dataclass

from tepokit.core.forward import rows_per_forward
from tepokit.fast.sampling import recompute_old_logprobs, sampler_logprobs_wanted, stacked_logits_bytes, uses_loop


@dataclass(frozen=True)
class StepSettings:
    """The values an RL step's helpers read, fixed for the whole run."""
    objective: str                # the objective's name, a key of tepo.OBJECTIVES
    group_size: int               # G completions per prompt
    temperature: float            # the sampling temperature; every log-prob and entropy of the step is taken at it
    precision: str                # bf16: the forward passes run under autocast; fp32: none
    prompt_once: bool             # completion_logits reads each prompt once per group (--fast, no checkpointing)
    rows_per_forward: int         # rows in one forward pass at most (--micro-batch-size, or a whole mini-batch)
    recompute: bool               # the old log-probs come from a forward pass, not from the sampler
    sampler_logprobs: bool        # the sampler gives log-probs and entropies (the old ones, or for the check)


def step_settings(args, config) -> StepSettings:
    """The run's StepSettings from its Args and its model's config (its type and vocabulary size)."""
    loop = uses_loop(config, args.fast, args.sampler)                  # the fast GPT-2 sampler, not generate
    rollout_rows = args.prompts_per_step * args.group_size
    recompute = recompute_old_logprobs(args.fast, args.recompute_old_logprobs, args.precision, loop)
    stacked = stacked_logits_bytes(rollout_rows, args.max_new_tokens, config.vocab_size, loop)
    return StepSettings(
        objective=args.objective, group_size=args.group_size, temperature=args.temperature,
        precision=args.precision, prompt_once=args.fast and not args.gradient_checkpointing,
        rows_per_forward=rows_per_forward(args.micro_batch_size, args.prompts_per_step, args.mini_batches,
                                          args.group_size),
        recompute=recompute,
        sampler_logprobs=sampler_logprobs_wanted(args.fast, recompute, args.check_sampling_logprobs, stacked))
