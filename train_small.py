"""train_small.py: group-relative RL for LLM reasoning, the whole loop in one readable script.

Run `python train_small.py` (no flags, no network, 2 CPU cores, minutes): a tiny GPT-2 with a character
vocabulary, a synthetic arithmetic word-problem task whose answers end in GSM8K's `#### <number>`, a short
supervised warm-up (its result for the default settings is committed in tepokit/start_model/), then RL with any
objective of tepo.py (TEPO by default). The warm-up corpus misreads half of the problems on purpose (`--sft-noise`,
e.g. "7+3=10" for "7 bags of 3"), so the warmed-up model knows the right and the wrong reading and picks between
them almost at random; RL learns to read the problem right: RL with verifiable rewards sharpening a behaviour the
starting model already has. The same code takes a real model and data set:
`--model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k` (the hub must be reachable, or give local paths).

Read it top to bottom:
  1. Args             every setting, one flag each (`python train_small.py --help`)
  2. compute_rewards  the task's rewards (--reward): 1 for a right `#### n` answer, ..., plus DAPO's length cost
  3. the rollout      prompts_for_step, generate_group (G completions per prompt), completion_mask
  4. the RL step      rl_step, as the list of its steps, and nothing but learning:
        1. sample prompts          a fixed, seeded order over the training split            (prompts_for_step)
        2. generate G completions  model.generate at temperature T                          (generate_group)
        3. score them              --reward: strict `#### n`, lenient, format; weighted     (compute_rewards)
        4. advantages              tepo.group_advantages; DAPO's filter                     (compute_advantages)
        5. old log-probs           one no-grad forward over prompt + completion per row     (old_policy)
        6. update                  one optimizer step per mini-batch, tepo.OBJECTIVES       (update_policy)
     It returns a StepRecord of what it did. Its only helpers outside tepo.py are tepokit/core/ (the forward pass
     and log-probs, the reward parser, the clock) and, on the fast path (--fast, the default), the fast twins in
     tepokit/core/ (the shared-prefix sampler, and the sampler's log-probs in step 5's place), each tested equal.
  5. evaluate         held-out accuracy (greedy) and pass@k
  6. the loop         train: start or resume a run, then step, measure, evaluate, log and checkpoint. The
     measurements (7.) run after the step, from its record (tepokit/diagnostics/after_step.py); the three that
     need the inside of the update take it through update_policy's one observer (tepokit/core/taps.py).
A second built-in task, `--task hidden-type`, is made for entropy collapse (tepokit/setup/task.py,
docs/collapse.md). What a reader can skip lives in tepokit/, in folders named for what they hold
(tepokit/__init__.py lists them); the logged metrics are defined in docs/metrics.md.

Simplifications, said plainly:
  - One process, one device, no vLLM. Mini-batches hold whole groups (minibatch_plan says why).
  - DAPO's dynamic sampling drops zero-std groups but does NOT sample more prompts to refill the batch: the
    step trains on fewer groups; with all dropped it makes no update (logged as `dynamic_sampling/skipped` = 1).
  - Prompts are the question and a newline, or with an instruct model's chat template a system prompt stating the
    answer format and the question (tepokit/core/reward.py); the built-in tasks have no template.
  - The reference model (loaded only when tepo.needs_ref says so) is the model RL starts from.


A script, not a library: nothing imports it (the tests call main(argv) and its functions).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from tepokit.cli import flags as cli     # first: tepokit/__init__.py sets OMP_WAIT_POLICY for torch
import torch

import tepo
from tepokit.cli import resume
from tepokit.core.clock import PhaseClock
from tepokit.core.forward import autocast, completion_logits, eos_ids_of, token_entropy, token_logprobs
from tepokit.core.metrics import combine_micro_batches
from tepokit.core.reward import encode_prompts, gold_answer, score_completions, weighted_rewards
from tepokit.diagnostics.after_step import measure_step, step_taps
from tepokit.diagnostics.completions import CannotLearnWatch, completion_rows
from tepokit.diagnostics.forking_tokens import eval_by_type
from tepokit.diagnostics.stats import mean_pass_at_k
from tepokit.diagnostics.summary import Progress, evaluation_line, write_summary
from tepokit.core.sampling import decode_precision, decoding, sample
from tepokit.core.step_settings import StepSettings, step_settings
from tepokit.plumbing import rundir
from tepokit.plumbing.errors import fail
from tepokit.plumbing.non_finite import check_finite, stops_on_divergence
from tepokit.plumbing.peak_memory import peak_memory_mb, process_memory_mb, reset_peak_memory
from tepokit.plumbing.report import Trackers, trackers_of
from tepokit.plumbing.signals import StopSignals, stopped_after
from tepokit.setup.lora import adapters_off, add_adapters, trainable_parameters, uses_adapters
from tepokit.setup.model import load_policy, pick_device, prepare_start_model
from tepokit.setup.task import dataset_chunks, load_task, task_fingerprint
from tepokit.tools import bench, compare
from tepokit.tools.memory import check_memory, check_memory_on_device, dry_run


# =====================================================================================================
# 1. Configuration: every flag is a field (tepokit/cli/flags.py makes the command line from it)
# =====================================================================================================

@dataclass
class Args:
    # --- run ---
    objective: str = "tepo"             # the RL objective; it picks the paper values of the objective settings below
    regime: str = "standard"            # standard; collapse (pass@k collapses); off-policy (16 updates per rollout)
    demo: bool = False                  # the two-minute classroom run (README)
    seed: int = 1                       # seeds python, torch and generation; the task too, unless --task-seed is set
    out: str | None = None              # run directory (default: runs/<task>__<objective>__<seed>__<time>)
    device: str = "auto"                # auto: cuda if available, else cpu
    threads: int = 2                    # torch CPU threads: set it to the cores this run may use
    fast: bool = True                   # the fast twins of sampling, forward, old log-probs (--no-fast: the plain path)
    steps: int = 200                    # RL steps (one rollout each)
    save_every: int = 50                # checkpoint every N steps (and at the end)
    engine: str = "tepo"                # tepo: train_small.py's own loop; trl: TRL's GRPOTrainer with a tepo objective
    cache_dir: str = "runs/cache"       # where the warmed-up built-in model is cached (relative: to the current dir)
    dry_run: bool = False               # print the memory plan and exit without loading the model
    force: bool = False                 # run even when the memory plan says it will not fit the device
    overwrite: bool = False             # replace the run in --out, if it holds one (default: refuse)
    # --- model ---
    model: str | None = None            # causal LM: Hugging Face id or local dir (default: the built-in tiny model)
    trust_remote_code: bool = False     # allow custom model code from the hub
    arch: str = "gpt2"                  # built-in model: architecture
    n_layer: int = 4                    # built-in model: transformer layers
    n_embd: int = 128                   # built-in model: width
    n_head: int = 4                     # built-in model: attention heads
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    precision: str = "fp32"             # bf16 runs the forward passes under autocast
    decode_precision: str = "auto"      # a fp32 run's generation: fp32, tf32, bf16 (auto: tf32 on a GPU, else fp32)
    lora_rank: int = 0                  # LoRA adapters of this rank, the base frozen (peft; 0: train every weight)
    lora_alpha: float | None = None     # LoRA's scale is alpha / rank (unset: 2 x --lora-rank)
    lora_target_modules: str = "auto"   # comma-separated module names (auto: attention and MLP of GPT-2/Qwen2/Llama)
    lora_base_bf16: bool = False        # keep LoRA's frozen base weights in bf16 (half their memory)
    # --- task ---
    dataset: str | None = None          # openai/gsm8k, a local dataset dir or .jsonl (default: a built-in task)
    task: str = "arith"                 # built-in task: arith, or hidden-type (made for entropy collapse)
    majority: float = 0.7               # hidden-type task: share of the problems whose right reading is the first
    cue: float = 0.0                    # hidden-type task: the item word tells the type on this share (0: never)
    difficulty: int = 15                # built-in task: largest operand
    ops: str = "+-*"                    # built-in task: operations to draw from (any of + - *)
    sft_noise: float = 0.5              # built-in task: fraction of warm-up demonstrations that misread the problem
    n_train: int = 4000                 # built-in task: training problems
    n_test: int = 500                   # held-out problems used by evaluation
    task_seed: int | None = None        # seeds the task and its warm-up (unset: --seed); 1 = the committed start model
    # --- supervised warm-up ---
    warmup_steps: int = 1000            # supervised steps before RL (built-in model; cached); 0 = none
    warmup_lr: float = 2e-3             # warm-up learning rate
    warmup_batch: int = 32              # warm-up batch size (sequences)
    # --- rollout ---
    prompts_per_step: int = 16          # prompts per rollout
    group_size: int = 8                 # G completions per prompt
    temperature: float = 1.0            # sampling temperature (log-probs are computed at the same one)
    max_new_tokens: int = 24            # completion length limit (tokens)
    sampler: str = "loop"               # loop (with --fast): the shared-prefix GPT-2 sampler; generate: model.generate
    cuda_graphs: str = "auto"           # static KV cache, CUDA-graph decode (with --fast): on, off, auto (CUDA)
    max_prompt_tokens: int = 256        # prompts longer than this are cut from the left
    chat_template: str = "auto"         # auto: the tokenizer's chat template if it has one; on; off (the bare question)
    system_prompt: str | None = None    # with a chat template (unset: tepokit/core/reward.py's, the answer format)
    reward: str = "strict"              # rewards (strict, lenient, format) with weights, e.g. strict,format:0.1
    mask_truncated: bool = False        # DAPO's overlong filtering: completions cut at --max-new-tokens get no loss
    overlong_cache: int = 6             # DAPO soft overlong punishment: length of the penalty ramp
    # --- update ---
    lr: float = 1e-4                    # RL learning rate (Adam, beta2 0.999, no weight decay)
    optimizer: str = "adam"             # adam | sgd (plain, no momentum: an experiment's control, docs/collapse.md)
    lr_warmup_steps: int = 20           # RL steps of linear lr warm-up from 0 (Adam's first steps are sign-like)
    mini_batches: int = 2               # optimizer steps per rollout per epoch (>= 2 lets clipping act)
    epochs: int = 1                     # passes over each rollout
    micro_batch_size: int = 0           # rows per forward and backward (0: the whole mini-batch)
    recompute_old_logprobs: bool | None = None  # old log-probs by a forward (unset: bf16, generate, --no-fast)
    max_grad_norm: float = 1.0          # gradient clipping
    # --- measurement ---
    eval_every: int = 25                # held-out evaluation every N steps (and at step 0 and the end)
    pass_k: int = 4                     # k of pass@k
    pass_k_problems: int = 200          # held-out problems used for pass@k and mean@k
    entropy_check_rows: int = 64        # completions used for the predicted-vs-measured entropy check
    entropy_check_every: int = 4        # run the entropy check every N steps (it costs one extra forward)
    effect_check_every: int | None = None  # mechanisms' effect on the update every N steps (unset: 4; 0 with --model)
    check_sampling_logprobs: bool = True  # with recomputed old log-probs: compare the sampler's with them
    log_completions_every: int = 10     # completions.jsonl: a few prompts' completions every N steps (0: never)
    report_to: str = "none"             # live curves: none, tensorboard, trackio, wandb, or a list (plumbing/report.py)
    target_accuracy: float = 0.40       # --compare: steps needed to reach this held-out accuracy
    # --- modes ---
    resume: str | None = None           # continue the run in this directory from its checkpoint
    compare: str | None = None          # comma-separated objectives (or variants: tepo:beta=0) on the same seeds
    seeds: int = 1                      # --compare: number of seeds (seed, seed+1, ...)
    baseline: str = "grpo"              # --compare: the objective (or variant) the others are paired against
    bench: bool = False                 # time one RL step against TRL's GRPOTrainer and exit
    bench_steps: int = 3                # --bench: timed steps per repeat (after one untimed step)
    bench_repeats: int = 3              # --bench: alternating repeats (tepo, TRL, tepo, TRL, ...); the median counts
    bench_shape: str = "builtin"        # --bench: builtin (the run's own model), or gpt2-small (random weights)
    check_memory_on_device: bool = False  # the memory plan, then 2 worst-case RL steps: each phase's measured peak
    stop_after: int | None = None       # stop after this step as if interrupted (testing --resume)


# =====================================================================================================
# 2. The task and its reward (the task itself: tepokit/setup/task.py)
# =====================================================================================================

def compute_rewards(texts: list[str], golds: list, lengths: torch.Tensor, args: Args,
                    cfg: tepo.ObjectiveConfig) -> dict:
    """The weighted sum of --reward's rewards (tepokit/core/reward.py REWARDS: strict = 1 for a right final
    `#### n`, lenient = 1 for a right last number, format = 1 for a final `#### <number>`) plus DAPO's soft length
    cost, from the completions' texts, gold answers and lengths in tokens [B]. Returns rewards (what the advantages
    see), strict, lenient (the accuracy, whatever the reward), and parts ({name: [B]}, unweighted): [B] float (CPU)."""
    strict, lenient = score_completions(texts, golds)
    rewards, parts = weighted_rewards(texts, golds, args.reward)
    if cfg.overlong_penalty:
        rewards = rewards + tepo.soft_overlong_punishment(lengths.float().cpu(), args.max_new_tokens,
                                                          args.overlong_cache)
    return dict(rewards=rewards, strict=strict, lenient=lenient, parts=parts)


# =====================================================================================================
# 3. The rollout: prompts, G completions each, their texts
# =====================================================================================================

def prompts_for_step(step: int, n_train: int, args: Args) -> list[int]:
    """Training-set indices of this step's prompts: a seeded permutation per pass over the data,
    a function of (seed, step) only, so a resumed run draws the same prompts."""
    per_epoch = max(1, n_train // args.prompts_per_step)
    epoch, slot = divmod(step - 1, per_epoch)
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed * 100_003 + epoch))
    return perm[slot * args.prompts_per_step:(slot + 1) * args.prompts_per_step].tolist()


@dataclass
class Rollout:
    """One step's completions: B = prompts x G rows, each prompt's G rows contiguous; P prompt positions
    (left-padded) and T completion positions. The sampler's fields are None when it was not asked for them."""
    prompt_ids: torch.Tensor                    # [B, P] each prompt's tokens, repeated G times
    prompt_mask: torch.Tensor                   # [B, P] 1 on prompt tokens, 0 on the left padding
    completion_ids: torch.Tensor                # [B, T] the sampled tokens
    completion_mask: torch.Tensor               # [B, T] 1 up to and including the end token (completion_mask)
    truncated: torch.Tensor                     # [B] bool: stopped by --max-new-tokens, without an end token
    sampling_logp: torch.Tensor | None = None   # [B, T] log-prob of each token, from the logits that chose it
    sampling_entropy: torch.Tensor | None = None  # [B, T] entropy of those logits


@torch.no_grad()
def generate_group(model, tokenizer, questions: list[str], group_size: int, args: Args, device,
                   greedy: bool = False, want_logprobs: bool = False) -> Rollout:
    """G completions per prompt by model.generate, sampled at temperature T from softmax(z / T) (no top-k, no
    top-p), or greedily. With --fast, its twin tepokit/core/sampling.py `sample`: the same tokens for the same seed,
    and each token's log-prob and entropy (if want_logprobs)."""
    enc = encode_prompts(tokenizer, questions, args, return_tensors="pt", padding=True,   # a chat template's, if
                         truncation=True, max_length=args.max_prompt_tokens)          # any (core/reward.py)
    prompt_ids, prompt_mask = enc.input_ids.to(device), enc.attention_mask.to(device)          # [U, P]
    group_ids, group_mask = prompt_ids.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0)
    eos_ids = eos_ids_of(model)
    with decoding(model, decode_precision(args.decode_precision, args.precision, device.type)):   # fp32, tf32, bf16
        if args.fast:    # the fast twin: each prompt read once per group, log-probs as it samples (core/sampling.py)
            out = sample(model, prompt_ids, prompt_mask, group_size, args.max_new_tokens, args.temperature,
                         args.precision, args.sampler, args.cuda_graphs, greedy, want_logprobs)
        else:
            sampling = (dict(do_sample=False) if greedy     # top-k and top-p off: a model's own config may set them
                        else dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0))
            with autocast(device, args.precision):
                sequences = model.generate(input_ids=group_ids, attention_mask=group_mask, eos_token_id=eos_ids,
                                           pad_token_id=model.generation_config.pad_token_id,
                                           max_new_tokens=args.max_new_tokens, **sampling)     # [B, P+T]
            out = {"completion_ids": sequences[:, group_ids.shape[1]:]}
    completion_ids = out["completion_ids"]                                          # [B, T]
    mask = completion_mask(completion_ids, eos_ids)
    ends_with_eos = torch.isin(completion_ids[:, -1], torch.tensor(eos_ids, device=device))
    return Rollout(prompt_ids=group_ids, prompt_mask=group_mask, completion_ids=completion_ids, completion_mask=mask,
                   truncated=(mask.sum(1) == completion_ids.shape[1]) & ~ends_with_eos,
                   sampling_logp=out.get("logp"), sampling_entropy=out.get("entropy"))


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """1 up to and INCLUDING the first end token, 0 after it.                          [B, T] -> [B, T]

    Built from token positions, not from `id != pad_id`: when pad id == eos id (GPT-2) that test
    would drop the end token from the loss and the model would never learn to stop.
    """
    is_end = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    ends_before = is_end.long().cumsum(1) - is_end.long()      # end tokens strictly before position t
    return (ends_before == 0).long()


def decode(tokenizer, batch: Rollout) -> list[str]:
    """Completion texts, with everything after the end token removed."""
    ids = torch.where(batch.completion_mask.bool(), batch.completion_ids, tokenizer.pad_token_id)
    return tokenizer.batch_decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# =====================================================================================================
# 4. The RL step
# =====================================================================================================

@dataclass
class Run:
    """What one RL run holds from step to step."""
    args: Args
    cfg: tepo.ObjectiveConfig
    objective: object                   # tepo.OBJECTIVES[args.objective]
    device: torch.device
    run_dir: str
    lock: object                        # the run directory's lock, held for the run's lifetime
    identity: dict                      # objective, model shape, tokenizer, data: checked on --resume
    model: object
    ref_model: object                   # None unless the objective needs one (tepo.needs_ref); with LoRA the policy
    tokenizer: object
    optimizer: torch.optim.Optimizer
    train_set: object
    test_set: object
    first_step: int                     # 1, or the step after the checkpoint when resuming
    details_path: str | None            # details.jsonl, TEPO only
    settings: StepSettings              # what the step reads, resolved once (tepokit/core/step_settings.py)
    trackers: Trackers                  # --report-to: every metrics.jsonl row also goes there, live
    clock: object = PhaseClock          # makes each step's clock (--bench and the memory check give their own)


@dataclass
class OldPolicy:
    """The rollout (old) policy's view of the rollout, which the update's ratios and KL terms compare with."""
    logp: torch.Tensor                  # [B, T] log pi_old of each sampled token
    entropy: torch.Tensor               # [B, T] entropy of pi_old at each position (TEPO's measured criterion)
    ref_logp: torch.Tensor | None       # [B, T] the reference model's log-probs, when the objective needs them


@dataclass
class StepRecord:
    """What one RL step did, for the measurements that run after it (tepokit/diagnostics/after_step.py)."""
    problems: object                    # the step's problems: a Dataset of B / G rows (question, answer, ...)
    batch: Rollout                      # the completions
    texts: list                         # [B] their texts
    scored: dict                        # rewards, strict, lenient: [B] each
    adv: torch.Tensor                   # [B] advantages
    keep: torch.Tensor                  # [B] bool: the rows DAPO's filter kept
    plan: list                          # the optimizer steps' micro-batches (minibatch_plan); [] = no update
    old: OldPolicy                      # the old policy, as computed before the update
    seen: OldPolicy                     # the old policy as the loss saw it (update_policy: the fast twin's first rows)
    loss_saw: list                      # per optimizer step, per micro-batch: the loss's (rows, log pi, entropy)
    losses: dict                        # the loss's metrics, averaged over the optimizer steps
    clock: object                       # the seconds of each phase


def rl_step(run: Run, step: int, observe=None) -> StepRecord:
    """One RL step, the six steps of the module docstring. B = --prompts-per-step x --group-size rows.
    observe: called before each optimizer step (update_policy), the one place measurement looks inside."""
    args, settings, clock = run.args, run.settings, run.clock()   # clock: seconds (and FLOPs, --bench) of each phase
    problems = run.train_set.select(prompts_for_step(step, len(run.train_set), args))   # 1. question, answer
    batch = generate_group(run.model, run.tokenizer, list(problems["question"]), args.group_size, args,  # 2.
                           run.device, want_logprobs=settings.sampler_logprobs)
    clock.lap("generate")
    texts = decode(run.tokenizer, batch)                                                # [B] str
    golds = [gold_answer(a) for a in problems["answer"] for _ in range(args.group_size)]  # [B] right numbers
    scored = compute_rewards(texts, golds, batch.completion_mask.sum(1), args, run.cfg)  # 3. rewards, strict, lenient
    adv, keep = compute_advantages(scored["rewards"], args, run.cfg)                    # 4. [B] float, [B] bool
    clock.lap("reward")
    for group in run.optimizer.param_groups:
        group["lr"] = learning_rate(step, args)
    plan = minibatch_plan(keep, args, settings.rows_per_forward)  # rows [b] per micro-batch per optimizer step
    old = old_policy(run, batch, plan)                                                  # 5. OldPolicy
    clock.lap("old_logprobs")
    losses, seen, loss_saw = update_policy(run, batch, old, adv, plan, observe) if plan else ({}, old, [])   # 6.
    clock.lap("update")
    return StepRecord(problems=problems, batch=batch, texts=texts, scored=scored, adv=adv, keep=keep, plan=plan,
                      old=old, seen=seen, loss_saw=loss_saw, losses=losses, clock=clock)


def learning_rate(step: int, args: Args) -> float:
    """--lr after a linear warm-up from 0 over --lr-warmup-steps RL steps (Adam's first steps are sign-like)."""
    return args.lr * min(1.0, step / max(1, args.lr_warmup_steps))


def compute_advantages(rewards: torch.Tensor, args: Args, cfg: tepo.ObjectiveConfig):
    """Group-relative advantages [B] and the rows to train on (DAPO's dynamic sampling filter)."""
    adv = tepo.group_advantages(rewards, args.group_size, cfg.advantage_scale, cfg.adv_eps)
    keep = (tepo.dynamic_sampling_mask(rewards, args.group_size) if cfg.dynamic_sampling
            else torch.ones_like(rewards, dtype=torch.bool))
    return adv, keep


def minibatch_plan(keep: torch.Tensor, args: Args, rows_per_forward: int) -> list[list[torch.Tensor]]:
    """The rows of every optimizer step of this rollout, drawn before any forward pass: `epochs`
    passes of `mini_batches` mini-batches of shuffled WHOLE groups, each mini-batch a list of
    micro-batches of at most rows_per_forward rows (row indices [b], CPU). Empty when DAPO's
    filter dropped every group.

    Mini-batches hold whole groups. A group's advantages sum to zero, so the tokens its samples
    share (here: copying the question's numbers) get zero net gradient. Split a group across
    mini-batches and those tokens get pure noise, which Adam scales up to full-size steps: row-shuffled
    mini-batches taught the model to miscopy operands and held-out accuracy fell (docs/results.md).
    Micro-batches may split a group: their gradients add up to the mini-batch's before the optimizer step.
    """
    G = args.group_size
    kept_groups = keep.view(-1, G).all(1).nonzero().squeeze(1)
    if len(kept_groups) == 0:
        return []
    plan = []
    for _ in range(args.epochs):
        groups = kept_groups[torch.randperm(len(kept_groups))]
        for chunk in groups.tensor_split(min(args.mini_batches, len(groups))):
            rows = (chunk.unsqueeze(1) * G + torch.arange(G)).reshape(-1)           # [b] whole groups
            plan.append(list(rows.split(rows_per_forward)))            # micro-batches of at most that many
    return plan


@torch.no_grad()
def old_policy(run: Run, batch: Rollout, plan: list) -> OldPolicy:
    """Before any update: the old policy's log-probs and entropies, and the reference model's log-probs.

    They come from a no-grad forward pass of the policy, with the SAME micro-batches as the update's first epoch
    (the rows its optimizer steps will see), so the first of them is exactly on-policy whatever the kernels: same
    rows, same shapes, same arithmetic. Rows no optimizer step sees (dropped by DAPO's filter) are still needed
    for the rollout's entropy. Their fast twin (--fast, in fp32 with the loop sampler; recompute_old_logprobs in
    tepokit/core/step_settings.py says when) takes the sampler's, computed from the logits that chose each token: no
    forward pass.
    """
    settings, B = run.settings, batch.completion_ids.shape[0]
    mask = batch.completion_mask                                                 # [B, T]
    first_epoch = [rows for minibatch in plan[:len(plan) // run.args.epochs] for rows in minibatch]
    seen = torch.zeros(B, dtype=torch.bool)
    for rows in first_epoch:
        seen[rows] = True
    unseen = torch.arange(B)[~seen]
    forwards = first_epoch + (list(unseen.split(settings.rows_per_forward)) if len(unseen) else [])
    dtype = torch.promote_types(next(run.model.parameters()).dtype, torch.float32)  # float64 in the tests

    def logprobs_and_entropy(model, with_entropy: bool):     # [B, T] each, one forward per micro-batch
        logp = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        entropy = torch.zeros_like(logp) if with_entropy else None
        for rows in forwards:
            logits = completion_logits(model, batch, rows, settings.precision, settings.prompt_once)   # [b, T, V]
            logp[rows] = token_logprobs(logits, batch.completion_ids[rows.to(mask.device)],
                                        settings.temperature).to(dtype)
            if with_entropy:
                entropy[rows] = token_entropy(logits, settings.temperature).to(dtype)
            del logits                 # before the next forward allocates its own
        return logp, entropy

    ref_logp = None
    if run.ref_model is not None:       # with LoRA: the policy with its adapters switched off (tepokit/setup/lora.py)
        with adapters_off(run.ref_model, run.model):
            ref_logp = logprobs_and_entropy(run.ref_model, False)[0]
    if settings.recompute:
        old_logp, entropy = logprobs_and_entropy(run.model, True)
    else:                              # the twin: the sampler's, at the same temperature (update_policy replaces
        old_logp = batch.sampling_logp.to(dtype)                 # the first mini-batch's with its own forward's)
        entropy = batch.sampling_entropy.to(dtype)                               # [B, T]
    return OldPolicy(logp=old_logp, entropy=entropy, ref_logp=ref_logp)


def update_policy(run: Run, batch: Rollout, old: OldPolicy, adv: torch.Tensor, plan: list, observe=None) -> tuple:
    """One optimizer step per mini-batch of the plan, its gradient accumulated over its micro-batches. Returns
    the losses' metrics (averaged over the optimizer steps), the old policy the loss compared with (a copy of
    `old`, below) and what the loss saw (per optimizer step, per micro-batch: rows [b], log pi [b, T], entropy
    [b, T] or None; detached), for the measurements after the step.

    With the sampler's old log-probs (the fast twin, old_policy), which differ from the policy's forward by
    rounding: before the first optimizer step the policy IS the old policy, so the first mini-batch's own forward
    becomes the old policy of its rows, the step is exactly on-policy, and later epochs read those values.

    The objective is told the mini-batch's token and sequence counts (num_tokens, num_seqs), so the micro-batch
    losses add up to the mini-batch's loss, gradient included (tepo.aggregate_loss): exact for every loss that is a
    sum over tokens or sequences; the ones that select tokens by statistics of the batch (Clip-Cov, KL-Cov, TEPO's
    `cov` criterion) compute those per micro-batch, as verl does.

    observe(i, n, batch, micro_batches, model), if given, is called before optimizer step i of n, its gradient
    accumulated and not yet clipped: the one place where measurement looks inside the update (tepokit/core/taps.py).
    """
    model, args = run.model, run.args
    if args.gradient_checkpointing:
        model.train()   # transformers checkpoints only in train mode; dropout is off (switch_off_dropout)
    mask, adv = loss_mask(batch, args), adv.to(batch.completion_mask.device)               # [B, T], [B]
    seen = OldPolicy(logp=old.logp.clone(), entropy=old.entropy.clone(), ref_logp=old.ref_logp)  # as the loss sees it
    steps, loss_saw = [], []
    for i, micro_batches in enumerate(plan):
        rows = torch.cat(micro_batches)
        counts = dict(num_tokens=mask[rows].sum().item(),                        # the whole mini-batch's; a row
                      num_seqs=float((mask[rows].sum(1) > 0).sum().item()))      # --mask-truncated left out: none
        run.optimizer.zero_grad(set_to_none=True)
        parts, saw = [], []
        for micro in micro_batches:
            on_policy = i == 0 and not run.settings.recompute   # the twin's: its own forward is the old policy
            loss, metrics, logp, entropy = micro_batch_loss(run, batch, seen, adv, micro, counts, on_policy)
            loss.backward()
            if on_policy:
                seen.logp[micro] = logp.to(seen.logp.dtype)
                if entropy is not None:
                    seen.entropy[micro] = entropy.to(seen.entropy.dtype)
            parts.append((metrics, mask[micro].sum().item()))
            saw.append((micro, logp, entropy))
        loss_saw.append(saw)
        metrics = combine_micro_batches(parts)
        if observe is not None:         # the measurements' one look inside the update (tepokit/core/taps.py)
            observe(i, len(plan), batch, micro_batches, model)
        metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
        run.optimizer.step()
        steps.append(metrics)
    model.eval()
    out = {key: sum(m[key] for m in steps) / len(steps) for key in steps[0]}
    out["ratio/min"], out["ratio/max"] = min(m["ratio/min"] for m in steps), max(m["ratio/max"] for m in steps)
    return out, seen, loss_saw


def loss_mask(batch: Rollout, args: Args) -> torch.Tensor:
    """The tokens the loss reads [B, T]: the completion's, and with --mask-truncated none of a completion cut at
    --max-new-tokens (DAPO's overlong filtering: a cut answer's reward says nothing of its reasoning). The cut rows
    still count in their group's mean and std (the advantages), as in DAPO."""
    if not args.mask_truncated:
        return batch.completion_mask
    return batch.completion_mask * ~batch.truncated.to(batch.completion_mask.device).unsqueeze(1)


def micro_batch_loss(run: Run, batch: Rollout, old: OldPolicy, adv: torch.Tensor, rows: torch.Tensor, counts: dict,
                     on_policy: bool = False):
    """The objective on one micro-batch: (loss [], metrics, log pi [b, T], the entropy [b, T] or None; detached).
    old: the old policy as the loss sees it; on_policy: this forward is the old policy of its rows (update_policy)."""
    settings, cfg = run.settings, run.cfg
    idx = rows.to(adv.device)
    mask, tokens = loss_mask(batch, run.args)[idx], batch.completion_ids[idx]     # [b, T]
    logits = completion_logits(run.model, batch, rows, settings.precision, settings.prompt_once)   # [b, T, V]
    logp = token_logprobs(logits, tokens, settings.temperature)                      # [b, T]
    # the current entropy, when the objective's criterion reads it (TEPO's `measured`)
    entropy = token_entropy(logits, settings.temperature) if tepo.needs_entropy(settings.objective, cfg) else None
    old_logp = logp.detach().to(old.logp.dtype) if on_policy else old.logp[idx]                  # [b, T]
    old_entropy = None
    if entropy is not None:
        old_entropy = entropy.detach().to(old.entropy.dtype) if on_policy else old.entropy[idx]    # [b, T]
    elif cfg.top_entropy_share < 1:    # the forking-token mask reads the old policy's entropy (tepo.top_entropy_mask)
        old_entropy = old.entropy[idx]
    # --sampler-correction: the sampler's log-probs; the twin's old log-probs are the sampler's (old_policy): weight 1
    sampler_logp = (None if cfg.sampler_correction == "none" else batch.sampling_logp[idx] if settings.recompute
                    else old_logp)
    ref = old.ref_logp[idx] if old.ref_logp is not None else None
    loss, metrics = run.objective(logp, old_logp, adv[idx], mask, cfg, ref_logp=ref, entropy=entropy,
                                  old_entropy=old_entropy, sampler_logp=sampler_logp, **counts)
    loss = loss + tepo.entropy_bonus(logits, mask, cfg, settings.temperature, **counts)   # 0 unless --entropy-coef
    return loss, metrics, logp.detach(), entropy.detach() if entropy is not None else None


# =====================================================================================================
# 5. Evaluation on held-out problems
# =====================================================================================================

@torch.no_grad()
def evaluate(model, tokenizer, test, args: Args, device) -> dict:
    """Held-out accuracy with greedy decoding (strict and lenient), and pass@k for k = 1, 2, 4, ... up
    to K = --pass-k from the same K samples per problem (unbiased estimator, tepokit.diagnostics.stats.pass_at_k).
    Generation goes one rollout's worth of rows at a time, so evaluation never needs more memory
    (KV cache) than a training step's rollout."""
    rollout_rows = args.prompts_per_step * args.group_size
    strict, lenient = [], []                          # greedy: right or not, per held-out problem
    for rows in dataset_chunks(test, len(test), rollout_rows):
        batch = generate_group(model, tokenizer, list(rows["question"]), 1, args, device, greedy=True)
        right = score_completions(decode(tokenizer, batch), [gold_answer(a) for a in rows["answer"]])
        strict.append(right[0])
        lenient.append(right[1])
    sampled_texts, golds = [], []                     # K samples of each of the first --pass-k-problems
    for rows in dataset_chunks(test, args.pass_k_problems, max(1, rollout_rows // args.pass_k)):
        batch = generate_group(model, tokenizer, list(rows["question"]), args.pass_k, args, device)
        sampled_texts += decode(tokenizer, batch)
        golds += [gold_answer(a) for a in rows["answer"] for _ in range(args.pass_k)]
    right = score_completions(sampled_texts, golds)[0].view(-1, args.pass_k)      # [problems, K]
    n_right = right.sum(1).long().tolist()                                          # c of each problem
    greedy_right = torch.cat(strict)                                                # [N]
    row = {"eval/accuracy": greedy_right.mean().item(), "eval/accuracy_lenient": torch.cat(lenient).mean().item(),
           **{f"eval/pass@{k}": value for k, value in mean_pass_at_k(n_right, args.pass_k).items()},
           f"eval/mean@{args.pass_k}": right.mean().item(),     # and how many problems each figure is over:
           "eval/problems": len(greedy_right), "eval/pass_k_problems": len(n_right)}
    if "type" in test.column_names:     # the hidden-type task: each type apart (tepokit/diagnostics/forking_tokens.py)
        row |= eval_by_type(greedy_right, right, sampled_texts, list(test["type"]), args.pass_k, list(test["answer"]),
                            list(test["cue"]) if "cue" in test.column_names else None)
    return row


# =====================================================================================================
# 6. The loop: start or resume a run, step, evaluate, log, checkpoint
# =====================================================================================================

def train(args: Args, obj_overrides: dict, clock=PhaseClock) -> dict:
    """One RL run: start (or resume) it, then step, evaluate, log and checkpoint; the summary at the end.
    A stop signal (Ctrl-C, SIGTERM, SIGHUP) finishes the step, checkpoints it and exits (plumbing/signals.py); a step
    that diverges ends the run before it is saved (tepokit/plumbing/non_finite.py)."""
    t_start = time.time()
    run = start_run(args, obj_overrides, clock)
    args = run.args                    # with --resume: the saved settings, which start_run read
    last_step = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    progress = Progress(run.first_step, last_step, args)   # the bar, and a line at each evaluation (summary.py)
    watch = CannotLearnWatch(args, progress.write, run.run_dir)    # warnings: tepokit/diagnostics/completions.py
    with run.lock, run.trackers, StopSignals(finish_step=True) as stop:
        for step in progress:
            t0 = time.time()
            with stops_on_divergence(step, run):      # a non-finite loss, gradient or weight ends the run here,
                taps = step_taps(run, step)           # before anything of the step is saved (plumbing/non_finite.py)
                record = rl_step(run, step, observe=taps)     # taps: what the measurements need from inside it
                measured, details_row = measure_step(run, step, record, taps)     # 7. measure, after the step
                completions = completion_rows(run, step, record)     # a few to read (diagnostics/completions.py)
                record.clock.lap("measure")
                row = {"step": step, **record.losses, **measured, **record.clock.row(),
                       "perf/tokens_per_second": record.batch.completion_mask.sum().item() / record.clock.total()}
                del record, taps          # the step's tensors (the taps' logits and parameters) before the evaluation
                check_finite(step, row, run)
                # An evaluation off the schedule leaves the RNG as found: --resume --steps then equals an unbroken run
                if step % args.eval_every == 0 or step == args.steps:
                    with torch.random.fork_rng(enabled=step % args.eval_every != 0):
                        row.update(evaluate(run.model, run.tokenizer, run.test_set, args, run.device))
            row.update({"timing/eval": time.time() - t0 - row["step_time"], "step_time": time.time() - t0,
                        "perf/peak_memory_mb": peak_memory_mb(run.device)})
            row |= watch.check(row)           # warning/<name> = 1 on the step a warning fires
            rundir.append_row(os.path.join(run.run_dir, "metrics.jsonl"), row)
            run.trackers.log(row)
            if details_row is not None:
                rundir.append_row(run.details_path, details_row)
            for completion in completions:
                rundir.append_row(os.path.join(run.run_dir, "completions.jsonl"), completion)
            progress.show(row)
            # Read once: the save and the stop agree on it. A signal after this line waits for the next step's
            # end; at the run's last step, it waits for the policy and the summary to be written.
            stopping = stop.requested and step < args.steps
            if step % args.save_every == 0 or step == last_step or stopping:
                rundir.save_checkpoint(run.run_dir, run.model, run.optimizer, step, run.identity)
            if stopping:               # the safe point: the step is logged and checkpointed
                progress.close()
                raise stopped_after(stop.signum, step, args.steps, run.run_dir)
        if last_step == args.steps:    # not stopped on purpose (--stop-after): the final policy and summary
            rundir.save_pretrained_atomically(run.model.cpu(), run.tokenizer, os.path.join(run.run_dir, "policy"))
            run.model.to(run.device)
            rows = rundir.read_log(os.path.join(run.run_dir, "metrics.jsonl"))
            summary = write_summary(run.run_dir, rows, args, time.time() - t_start)
        else:
            summary = {"run_dir": run.run_dir, "stopped_at": last_step}
        if stop.requested:             # it came during the last step, the final save or the summary
            raise stopped_after(stop.signum, last_step, args.steps, run.run_dir)
    return summary


def start_run(args: Args, obj_overrides: dict, clock=PhaseClock) -> Run:
    """Load the task and the models, then either resume from the run directory's checkpoint or start
    afresh: config.json, empty logs, the starting model's evaluation (step 0) and checkpoint 0.
    The run directory is locked (claimed) once everything has loaded and before anything in it changes:
    a failed load leaves nothing behind, and a run that resumes the same directory meanwhile is refused."""
    torch.set_num_threads(args.threads)
    resume_dir = args.resume
    args, obj_overrides = cli.run_settings(args, obj_overrides)     # with --resume: the run's saved settings
    device = pick_device(args)
    cfg = cli.objective_config(args, obj_overrides)
    rundir.seed_everything(args.seed)
    task = load_task(args)
    needs_ref = tepo.needs_ref(args.objective, cfg)
    check_memory(args, task, device, needs_ref)
    run_dir = args.out or os.path.join("runs", rundir.run_name(args))
    print(f"run directory: {run_dir}", flush=True)    # created once everything has loaded
    reset_peak_memory(device)
    memory_before_model = process_memory_mb()
    start_model = prepare_start_model(args, task, device)
    model, tokenizer = load_policy(start_model, args, device)
    model = add_adapters(model, args)  # --lora-rank: adapters beside the frozen base (tepokit/setup/lora.py)
    ref_model = None if not needs_ref else model if uses_adapters(model) else (
        load_policy(start_model, args, device)[0].requires_grad_(False))
    identity = rundir.run_identity(args.objective, model, tokenizer, task_fingerprint(task))
    if resume_dir:                     # still nothing changed: the run must be the one that was saved
        resume.check_same_run(resume_dir, identity)
    lock = rundir.claim_run_dir(run_dir, resume=bool(resume_dir), overwrite=args.overwrite)
    run = Run(args=args, cfg=cfg, objective=tepo.OBJECTIVES[args.objective], device=device, run_dir=run_dir,
              lock=lock, identity=identity, model=model, ref_model=ref_model, tokenizer=tokenizer,
              optimizer=(torch.optim.SGD(trainable_parameters(model), lr=args.lr) if args.optimizer == "sgd"
                         else torch.optim.Adam(trainable_parameters(model), lr=args.lr, betas=(0.9, 0.999))),
              train_set=task["train"], test_set=task["test"].select(range(min(args.n_test, len(task["test"])))),
              first_step=1, details_path=os.path.join(run_dir, "details.jsonl") if args.objective == "tepo" else None,
              settings=step_settings(args, model.config, cfg, device.type), clock=clock,
              trackers=Trackers(trackers_of(args.report_to), run_dir,
                                {**dataclasses.asdict(args), **dataclasses.asdict(cfg)}))
    logs = [p for p in (os.path.join(run_dir, "metrics.jsonl"), run.details_path,
                        os.path.join(run_dir, "completions.jsonl")) if p is not None]
    # Again: the task, a warm-up and the models' construction drew random numbers, and how many depends on
    # what was cached; from here the stream is the seed's, whatever was loaded (a resume then sets its own).
    rundir.seed_everything(args.seed)
    if resume_dir:                     # the checkpoint's states, and the logs cut back to its step
        run.first_step = rundir.resume_from_checkpoint(run_dir, model, run.optimizer, logs)
    else:                              # config.json and empty logs; step 0: the start model's evaluation
        rundir.start_logs(run_dir, {"args": dataclasses.asdict(args), "objective_overrides": obj_overrides,
                                    "objective_config": dataclasses.asdict(cfg), "identity": identity,
                                    "start_model": start_model, "needs_ref": ref_model is not None}, logs)
        start = {"step": 0, **evaluate(model, tokenizer, run.test_set, args, device)}
        rundir.append_row(logs[0], {**start, "memory/process_before_model_mb": memory_before_model})
        run.trackers.log(start)
        print(evaluation_line(start, args, entropies=[]), flush=True)
        rundir.save_checkpoint(run_dir, model, run.optimizer, 0, identity)
    return run


def main(argv=None) -> int:
    args, obj_overrides = cli.parse_args(Args, argv)
    with StopSignals():           # until the RL loop takes over: a stop signal ends the program at once
        if args.dry_run:          # the memory plan alone (tepokit/tools/memory.py)
            dry_run(args, obj_overrides)
        elif args.bench:          # our step against TRL's GRPOTrainer on the same work (tepokit/tools/bench.py)
            bench.benchmark(args, obj_overrides, train)
        elif args.check_memory_on_device:   # the plan beside each phase's measured peak (tepokit/tools/memory.py)
            check_memory_on_device(args, obj_overrides, train)
        elif args.compare:        # several objectives x seeds, paired by seed (tepokit/tools/compare.py)
            compare.compare_objectives(args, obj_overrides, train)
        elif args.engine == "trl":    # the same objective inside TRL's GRPOTrainer (tools/tepo_trl.py; needs trl)
            try:
                from tepokit.tools import tepo_trl
            except ImportError as e:
                fail(f"argument --engine: 'trl' needs TRL ({e}); pip install 'trl>=1.16,<1.17' or choose --engine tepo")
            tepo_trl.train(args, obj_overrides, evaluate)
        else:
            train(args, obj_overrides)
    return 0


if __name__ == "__main__":     # a stop, a divergence, a disk error: one line on stderr, not a traceback
    cli.exit_in_one_line(main)
