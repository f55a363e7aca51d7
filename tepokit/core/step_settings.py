"""The RL step's settings, resolved once: what the step's helpers in tepokit read, computed from the run's Args and
its model's config when the run starts (train_small.start_run), and by the memory plan the same way
(tepokit/tools/memory.py). A helper takes the values it uses, or this frozen record where it uses several of them;
none takes the whole Args."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tepokit.core.sampling import SAMPLER_LOGPROBS_ARE_OLD, decode_precision, uses_loop


# generate's log-probs need the logits of every step stacked, [B, T, V] float32: never more than this.
STACKED_LOGITS_MAX_BYTES = 2**30


def stacked_logits_bytes(rollout_rows: int, max_new_tokens: int, vocab_size: int, loop: bool) -> int:
    """Bytes of generate's stacked logits [B, T, V] float32 for one rollout of B rows; 0 with the loop (loop:
    uses_loop), which stacks none."""
    if loop:
        return 0
    return rollout_rows * max_new_tokens * vocab_size * 4


def recompute_old_logprobs(fast: bool, asked: bool | None, precision: str, loop: bool, decode: str = "fp32") -> bool:
    """Are the old log-probs recomputed by a forward pass after the rollout (the plain path), rather than the
    sampler's (their fast twin)? Always with --no-fast; else as asked (--recompute-old-logprobs); unset: yes in bf16
    (the sampler's and the training forward's log-probs then differ by bf16's rounding, as much as an update
    changes them), when generation is not fp32 (decode, sampling.decode_precision: TF32's and bf16's log-probs are
    not the trainer's fp32 ones) and with generate (its log-probs need the logits of every step, [B, T, V], which
    grow with the rollout); no with the loop (loop: uses_loop) decoding in fp32, whose log-probs cost nothing."""
    if not fast:
        return True
    if asked is not None:
        return asked
    return precision == "bf16" or decode not in SAMPLER_LOGPROBS_ARE_OLD or not loop


def sampler_logprobs_wanted(fast: bool, recompute: bool, check_sampling_logprobs: bool, stacked_bytes: int,
                            corrected: bool = False) -> bool:
    """Must the sampler give log-probs and entropies? When they are the old ones (not recompute); with
    --sampler-correction (corrected: each token weighs pi_old / pi_sampler, tepo.sampler_correction_weight), whatever
    they cost; or for the sampling check (--check-sampling-logprobs: sampled against recomputed) when they are cheap:
    when the logits it stacks for them (stacked_bytes, stacked_logits_bytes) are within STACKED_LOGITS_MAX_BYTES;
    never with --no-fast (the plain path's model.generate gives tokens only: the correction is refused there)."""
    return fast and (not recompute or corrected
                     or (check_sampling_logprobs and stacked_bytes <= STACKED_LOGITS_MAX_BYTES))


def rows_per_minibatch(prompts_per_step: int, mini_batches: int, group_size: int) -> int:
    """Rows of one (nominal) mini-batch: ceil(P / M) whole groups of G rows (mini-batches hold whole groups);
    no mini-batch exceeds it (fewer groups when DAPO's filter dropped some)."""
    return math.ceil(prompts_per_step / mini_batches) * group_size


def rows_per_forward(micro_batch_size: int, prompts_per_step: int, mini_batches: int, group_size: int) -> int:
    """Rows in one forward pass at most: --micro-batch-size, or a whole mini-batch when it is 0."""
    return micro_batch_size or rows_per_minibatch(prompts_per_step, mini_batches, group_size)


@dataclass(frozen=True)
class StepSettings:
    """The values an RL step's helpers read, fixed for the whole run."""
    objective: str                # the objective's name, a key of tepo.OBJECTIVES
    group_size: int               # G completions per prompt
    temperature: float            # the sampling temperature; every log-prob and entropy of the step is taken at it
    precision: str                # bf16: the forward passes run under autocast; fp32: none
    decode: str                   # how generation computes: fp32, tf32, bf16 or autocast (sampling.decode_precision)
    prompt_once: bool             # completion_logits reads each prompt once per group (--fast, no checkpointing)
    rows_per_forward: int         # rows in one forward pass at most (--micro-batch-size, or a whole mini-batch)
    recompute: bool               # the old log-probs come from a forward pass, not from the sampler
    sampler_logprobs: bool        # the sampler gives log-probs and entropies (the old ones, or for the check)


def step_settings(args, config, cfg=None, device_type: str = "cpu") -> StepSettings:
    """The run's StepSettings from its Args, its model's config (its type and vocabulary size), its objective's
    configuration (cfg, a tepo.ObjectiveConfig: does --sampler-correction need the sampler's log-probs?) and its
    device's type (--decode-precision auto)."""
    loop = uses_loop(config, args.fast, args.sampler)                  # the fast GPT-2 sampler, not generate
    rollout_rows = args.prompts_per_step * args.group_size
    decode = decode_precision(args.decode_precision, args.precision, device_type)
    recompute = recompute_old_logprobs(args.fast, args.recompute_old_logprobs, args.precision, loop, decode)
    stacked = stacked_logits_bytes(rollout_rows, args.max_new_tokens, config.vocab_size, loop)
    return StepSettings(
        objective=args.objective, group_size=args.group_size, temperature=args.temperature,
        precision=args.precision, decode=decode, prompt_once=args.fast and not args.gradient_checkpointing,
        rows_per_forward=rows_per_forward(args.micro_batch_size, args.prompts_per_step, args.mini_batches,
                                          args.group_size),
        recompute=recompute,
        sampler_logprobs=sampler_logprobs_wanted(args.fast, recompute, args.check_sampling_logprobs, stacked,
                                                 corrected=getattr(cfg, "sampler_correction", "none") != "none"))
