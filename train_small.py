"""train_small.py: the whole group-relative RL loop for LLM reasoning in one readable file.

Run `python train_small.py` (no flags, no network, 2 CPU cores, under 10 minutes): it builds a tiny
GPT-2 with a character vocabulary, makes a synthetic arithmetic word-problem task whose answers end
in GSM8K's `#### <number>`, gives the model a short supervised warm-up (cached as an ordinary
Hugging Face model directory), then improves it with RL using any objective of tepo.py.
The warm-up corpus is deliberately imperfect: half of its worked answers misread the problem
(`--sft-noise`, e.g. "7+3=10" for "7 bags of 3"), so the warmed-up model knows the right and the
wrong reading and picks between them almost at random. Learning to read the problem right is a
behaviour that transfers across problems, so RL can learn it from a few thousand prompts (new
arithmetic facts it could not: each training prompt is seen about once). This is the regime RL
with verifiable rewards is known for: sharpening behaviours the starting model already has.
The same code path takes a real model and data set: `--model Qwen/Qwen2.5-0.5B-Instruct
--dataset openai/gsm8k` (the Hugging Face hub must be reachable, or pass local paths).

The loop (rl_step), one function per step:
  1. sample prompts          a fixed, seeded order over the training split             (prompts_for_step)
  2. generate G completions  model.generate with a KV cache, at temperature T          (generate_group)
  3. score them              strict `#### n` / lenient last-number parsing             (compute_rewards)
  4. advantages              tepo.group_advantages; DAPO's filter and length cost      (compute_advantages)
  5. old log-probs           before any update, with the update's own micro-batches    (rollout_statistics)
  6. update                  one optimizer step per mini-batch, tepo.OBJECTIVES        (update_policy)
  7. measure                 entropy change predicted vs measured                      (entropy_check)
then, around it (train): held-out evaluation every --eval-every steps, one metrics row per step
(flushed), a checkpoint every --save-every steps. The metrics are defined in the README ("Logged
metrics"); details.jsonl (TEPO's KL mask) in KLMaskDetails.

Memory (one GPU): every forward and backward sees at most --micro-batch-size rows, and the gradient
of a mini-batch is accumulated over its micro-batches exactly; log-probs and entropy go through the
logits in 16 MiB chunks. A memory plan by part is printed before anything large is loaded
(`--dry-run` prints it and exits). --precision fp32 (default) or bf16 (autocast; its log-prob noise
is logged as precision/logp_error_*, and is larger than GSPO's and TEPO's clip band).

Simplifications, said plainly:
  - One process, one device, no vLLM. Mini-batches hold whole groups (see minibatch_plan for why).
  - DAPO's dynamic sampling drops zero-std groups but does NOT sample more prompts to refill the
    batch: the step trains on fewer groups, and a step whose groups are all dropped makes no update
    (logged as `dynamic_sampling/skipped` = 1).
  - Prompts are the question followed by a newline; no chat template is applied.
  - The reference model (only loaded when tepo.needs_ref says so) is the model RL starts from.
  - pass@k: K = --pass-k samples per held-out problem, pass@k for k = 1, 2, 4, ... K from the same
    samples with the unbiased estimator of Chen et al. 2021 (pass_at_k).
  - With `--sft-noise 0` the warm-up model reads every problem right, and RL has little to add on
    this task (measured, 3 seeds: +2.6 points greedy for TEPO, +2.9 for GRPO over 200 steps):
    more supervised steps would then raise accuracy more cheaply than RL does.

Usage:
  python train_small.py                                   # built-in task and model, TEPO, seed 1
  python train_small.py --objective grpo --seed 2         # any key of tepo.OBJECTIVES
  python train_small.py --objective dapo --eps-high 0.3   # any field of tepo.ObjectiveConfig
  python train_small.py --compare grpo,dapo,tepo --seeds 3  # summary.md / summary.json table
  python train_small.py --compare grpo,tepo,tepo:beta=0 --regime collapse --seeds 5   # entries with own settings
  python train_small.py --bench                           # our step vs TRL's GRPOTrainer
  python train_small.py --resume runs/<name>              # continue an interrupted run
  python train_small.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --max-new-tokens 256

Not a library: import it only to call main(argv) or the small helpers in tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

# The CPU is shared: with busy-waiting OpenMP threads, two threads on a contended 2-core machine
# ran 2.3x slower than passive ones (measured). Must be set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import tepo  # noqa: E402


# =====================================================================================================
# 0. Configuration
# =====================================================================================================

@dataclass
class Args:
    # --- run ---
    objective: str = "tepo"             # the RL objective; it picks the paper values of the objective settings below
    regime: str = "standard"            # preset of the settings below: standard, or collapse (lr 3e-4); flags win
    seed: int = 1                       # seeds python, torch, the task split and generation
    out: str | None = None              # run directory (default: runs/<task>__<objective>__<seed>__<time>)
    device: str = "auto"                # auto: cuda if available, else cpu
    threads: int = 2                    # torch CPU threads (the machine is shared)
    steps: int = 200                    # RL steps (one rollout each)
    save_every: int = 50                # checkpoint every N steps (and at the end)
    engine: str = "tepo"                # tepo: this file's loop; trl: TRL's GRPOTrainer with a tepo objective
    cache_dir: str = "runs/cache"       # where the warmed-up built-in model is cached (relative: to the current dir)
    dry_run: bool = False               # print the memory plan and exit without loading the model
    force: bool = False                 # run even when the memory plan says it will not fit the device
    # --- model ---
    model: str | None = None            # causal LM: Hugging Face id or local dir (default: the built-in tiny model)
    trust_remote_code: bool = False     # allow custom model code from the hub
    arch: str = "gpt2"                  # built-in model: architecture
    n_layer: int = 4                    # built-in model: transformer layers
    n_embd: int = 128                   # built-in model: width
    n_head: int = 4                     # built-in model: attention heads
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    precision: str = "fp32"             # bf16 runs the forward passes under autocast
    # --- task ---
    dataset: str | None = None          # openai/gsm8k, a local dataset dir or .jsonl (default: built-in arithmetic)
    difficulty: int = 15                # built-in task: largest operand
    ops: str = "+-*"                    # built-in task: operations to draw from (any of + - *)
    sft_noise: float = 0.5              # built-in task: fraction of warm-up demonstrations that misread the problem
    n_train: int = 4000                 # built-in task: training problems
    n_test: int = 500                   # held-out problems used by evaluation
    # --- supervised warm-up ---
    warmup_steps: int = 1000            # supervised steps before RL (built-in model; cached); 0 = none
    warmup_lr: float = 2e-3             # warm-up learning rate
    warmup_batch: int = 32              # warm-up batch size (sequences)
    # --- rollout ---
    prompts_per_step: int = 16          # prompts per rollout
    group_size: int = 8                 # G completions per prompt
    temperature: float = 1.0            # sampling temperature (log-probs are computed at the same one)
    max_new_tokens: int = 24            # completion length limit (tokens)
    max_prompt_tokens: int = 256        # prompts longer than this are cut from the left
    reward: str = "strict"              # which parsing of the answer gives reward 1
    overlong_cache: int = 6             # DAPO soft overlong punishment: length of the penalty ramp
    # --- update ---
    lr: float = 1e-4                    # RL learning rate (Adam, beta2 0.999, no weight decay)
    lr_warmup_steps: int = 20           # RL steps of linear lr warm-up from 0 (Adam's first steps are sign-like)
    mini_batches: int = 2               # optimizer steps per rollout per epoch (>= 2 lets clipping act)
    epochs: int = 1                     # passes over each rollout
    micro_batch_size: int = 0           # rows per forward and backward (0: the whole mini-batch)
    max_grad_norm: float = 1.0          # gradient clipping
    # --- measurement ---
    eval_every: int = 25                # held-out evaluation every N steps (and at step 0 and the end)
    pass_k: int = 4                     # k of pass@k
    pass_k_problems: int = 200          # held-out problems used for pass@k and mean@k
    entropy_check_rows: int = 64        # completions used for the predicted-vs-measured entropy check
    entropy_check_every: int = 1        # run the entropy check every N steps (its extra forward is ~10% of a step)
    check_sampling_logprobs: bool = True  # compare generate's log-probs with the recomputed ones
    target_accuracy: float = 0.40       # --compare: steps needed to reach this held-out accuracy
    # --- modes ---
    resume: str | None = None           # continue the run in this directory from its checkpoint
    compare: str | None = None          # comma-separated objectives (or variants: tepo:beta=0) on the same seeds
    seeds: int = 1                      # --compare: number of seeds (seed, seed+1, ...)
    baseline: str = "grpo"              # --compare: the objective (or variant) the others are paired against
    bench: bool = False                 # time one RL step against TRL's GRPOTrainer and exit
    bench_steps: int = 3                # --bench: timed steps (after one untimed step)
    stop_after: int | None = None       # stop after this step as if interrupted (testing --resume)


# Fields of Args that only say how to run, not what is computed: they are not compared on resume.
RUN_ONLY_FIELDS = ("resume", "stop_after", "compare", "seeds", "baseline", "bench", "bench_steps", "out", "threads",
                   "cache_dir", "dry_run", "force")


@functools.cache      # reading the source is slow, and parse_args runs it for every command line
def field_comments(cls) -> dict[str, str]:
    """The one-line comment of each dataclass field, read from the source: the --help text."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
        if m:
            comments[m.group(1)] = m.group(2).strip()
    return comments


# ---- valid values of every flag --------------------------------------------------------------------
# One table, checked before anything is created or loaded: a bad value is one line on stderr naming
# the flag, the value and what is valid, exit status 2. On top of each row: numbers must be finite
# (nan and inf are refused for every float flag) and integers at most INT_LIMIT. The objective
# settings' ranges are tepo.check_config's (reused, not repeated here), plus the rows marked below.
INT_LIMIT = 2**31 - 1
HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")   # a Hugging Face id: name or org/name


def at_least(low: int) -> tuple:
    return f"an integer >= {low}", lambda v: v >= low, None


def positive() -> tuple:
    return "a number > 0", lambda v: v > 0, None


def fraction() -> tuple:
    return "a number in [0, 1]", lambda v: 0 <= v <= 1, None


def one_of(choices) -> tuple:
    return "one of: " + ", ".join(choices), lambda v: v in choices, list(choices)


def path(what: str, ok) -> tuple:
    return what, lambda v: v != "" and ok(os.path.expanduser(v)), None


def hub_id_or_local(v: str) -> bool:
    """A Hugging Face id, or a path (starting with . / ~, or naming a .json / .jsonl file) that exists."""
    if v.startswith((".", "/", "~")) or v.endswith((".json", ".jsonl")) or os.path.exists(v):
        return os.path.exists(v)
    return HUB_ID.fullmatch(v) is not None


def variant(spec: str) -> tuple[str, dict]:
    """--compare's entries: 'tepo:beta=0:entropy_criterion=measured' -> ('tepo', {'beta': 0.0,
    'entropy_criterion': 'measured'}): an objective and objective settings that only this entry gets."""
    name, *settings = spec.split(":")
    overrides = {}
    for setting in settings:
        field, _, text = setting.partition("=")
        overrides[field] = setting_value(field, text)
    return name, overrides


BOOLEAN_WORDS = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def setting_value(field: str, text: str):
    """The value of objective setting `field` written as text; argparse.ArgumentTypeError if invalid."""
    if FIELD_KINDS[field][0] == "bool":
        if text.lower() not in BOOLEAN_WORDS:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; choose on or off")
        return BOOLEAN_WORDS[text.lower()]
    return converter(field)(text)


def variant_problem(spec: str) -> str | None:
    """None if `spec` is a valid --compare entry, else what is wrong with it."""
    name, *settings = spec.split(":")
    if name not in tepo.OBJECTIVES:
        return f"{name!r} is not an objective"
    for setting in settings:
        field, equals, text = setting.partition("=")
        if field not in tepo.ObjectiveConfig.__dataclass_fields__ or not equals:
            return f"{setting!r} is not a setting=value of an objective setting"
        try:
            setting_value(field, text)
        except argparse.ArgumentTypeError as e:
            return f"{field}={text!r}: {e}"
    return None


def variant_list(v: str) -> bool:
    specs = v.split(",")
    return len(set(specs)) == len(specs) and all(variant_problem(s) is None for s in specs)


# field -> (what a valid value is, test of one value, choices shown by --help or None)
VALID: dict[str, tuple] = {
    # --- run ---
    "objective": one_of(sorted(tepo.OBJECTIVES)),
    "regime": one_of(["standard", "collapse"]),
    "seed": at_least(0),
    "out": path("a directory path (not an existing file)", lambda p: not os.path.isfile(p)),
    "device": one_of(["auto", "cpu", "cuda"]),
    "threads": (f"an integer in 1..{os.cpu_count()} (this machine's cores)",
                lambda v: 1 <= v <= (os.cpu_count() or 1), None),
    "steps": at_least(1),
    "save_every": at_least(1),
    "engine": one_of(["tepo", "trl"]),
    "cache_dir": path("a directory path (not an existing file)", lambda p: not os.path.isfile(p)),
    # --- model ---
    "model": path("a Hugging Face id (name or org/name) or an existing local directory", hub_id_or_local),
    "arch": one_of(["gpt2", "qwen2"]),
    "n_layer": at_least(1),
    "n_embd": at_least(1),
    "n_head": at_least(1),
    "precision": one_of(["fp32", "bf16"]),
    # --- task ---
    "dataset": path("a Hugging Face id, or an existing local .jsonl / .json file or dataset directory",
                    hub_id_or_local),
    "difficulty": at_least(1),
    "ops": ("a non-empty string of distinct characters from + - *",
            lambda v: 0 < len(v) == len(set(v)) and set(v) <= set("+-*"), None),
    "sft_noise": fraction(),
    "n_train": at_least(1),
    "n_test": at_least(1),
    "warmup_steps": at_least(0),
    "warmup_lr": positive(),
    "warmup_batch": at_least(1),
    # --- rollout ---
    "prompts_per_step": at_least(1),
    "group_size": ("an integer >= 2 (a group needs a baseline)", lambda v: v >= 2, None),
    "temperature": positive(),
    "max_new_tokens": at_least(1),
    "max_prompt_tokens": at_least(1),
    "reward": one_of(["strict", "lenient"]),
    "overlong_cache": at_least(1),
    # --- update ---
    "lr": positive(),
    "lr_warmup_steps": at_least(0),
    "mini_batches": at_least(1),
    "epochs": at_least(1),
    "micro_batch_size": at_least(0),
    "max_grad_norm": positive(),
    # --- measurement ---
    "eval_every": at_least(1),
    "pass_k": at_least(1),
    "pass_k_problems": at_least(1),
    "entropy_check_rows": at_least(0),
    "entropy_check_every": at_least(1),
    "target_accuracy": fraction(),
    # --- modes ---
    "resume": path("an existing run directory", os.path.isdir),
    "compare": ("a comma-separated list of distinct objectives from: " + ", ".join(sorted(tepo.OBJECTIVES))
                + "; each may carry objective settings, e.g. tepo:beta=0:entropy_criterion=measured",
                variant_list, None),
    "seeds": at_least(1),
    "baseline": ("an objective of --compare, written as there (e.g. grpo or tepo:beta=0)",
                 lambda v: variant_problem(v) is None, None),
    "bench_steps": at_least(1),
    "stop_after": at_least(1),
    # --- objective settings: the choices, and two fractions tepo.check_config only requires >= 0 ---
    "kl_estimator": one_of(tepo.KL_ESTIMATORS), "aggregation": one_of(tepo.AGGREGATIONS),
    "advantage_scale": one_of(tepo.ADVANTAGE_SCALES), "ratio_mode": one_of(tepo.RATIO_MODES),
    "entropy_criterion": one_of(tepo.ENTROPY_CRITERIA), "kl_target": one_of(tepo.KL_TARGETS),
    "kl_mode": one_of(tepo.KL_MODES), "block_ratio": one_of(tepo.BLOCK_RATIOS),
    "block_agg": one_of(tepo.BLOCK_AGGREGATIONS),
    "clip_cov_ratio": fraction(), "kl_cov_ratio": fraction(),
}


def rows_per_forward(args: Args) -> int:
    """Rows in one forward pass: --micro-batch-size, or a whole (nominal) mini-batch when it is 0."""
    return args.micro_batch_size or math.ceil(args.prompts_per_step / args.mini_batches) * args.group_size


def rows_per_minibatch(args: Args) -> int:
    """Rows of one (nominal) mini-batch: mini-batches hold whole groups."""
    return rows_per_forward(dataclasses.replace(args, micro_batch_size=0))


def builtin_task_size(args: Args) -> int:
    """How many problems make_arithmetic_task draws at most for this --difficulty and --ops."""
    return arithmetic_task_size(args.difficulty, args.ops)


# Rules that relate flags: (field, what is valid, test of the whole Args). The text may name other
# flags' values as {field} and the derived sizes {rows_per_minibatch}, {builtin_task_size}.
RELATIONS = [
    ("overlong_cache", "an integer in 1..{max_new_tokens} (--max-new-tokens)",
     lambda a: a.overlong_cache <= a.max_new_tokens),
    ("n_embd", "a multiple of --n-head ({n_head})", lambda a: a.n_embd % a.n_head == 0),
    ("n_embd", "a multiple of 2 x --n-head ({n_head}) with --arch qwen2 (its rotary embedding needs an even "
     "head width)", lambda a: a.arch != "qwen2" or a.n_embd % (2 * a.n_head) == 0),
    ("mini_batches", "an integer in 1..{prompts_per_step} (--prompts-per-step): a mini-batch holds whole groups",
     lambda a: a.mini_batches <= a.prompts_per_step),
    ("micro_batch_size", "0 (the whole mini-batch) or an integer up to {rows_per_minibatch}, the rows of a "
     "mini-batch (ceil(prompts-per-step / mini-batches) x group-size)",
     lambda a: a.micro_batch_size <= rows_per_minibatch(a)),
    ("n_test", "an integer below {builtin_task_size}, the number of problems of the built-in task at this "
     "--difficulty and --ops", lambda a: a.dataset is not None or a.n_test < builtin_task_size(a)),
    ("seed", f"an integer with --seed + --seeds - 1 <= {INT_LIMIT}", lambda a: a.seed + a.seeds - 1 <= INT_LIMIT),
    ("baseline", "one of the objectives of --compare ({compare}); without --baseline, a comparison that leaves out "
     "grpo has no paired block", lambda a: a.compare is None or a.baseline in a.compare.split(",")
     or a.baseline == Args.baseline),
    ("device", "auto or cpu: CUDA is not available here", lambda a: a.device != "cuda" or torch.cuda.is_available()),
    ("resume", "a run directory alone: --resume cannot be combined with --compare or --bench",
     lambda a: a.resume is None or not (a.compare or a.bench)),
    ("bench", "off with --compare (one mode at a time)", lambda a: not (a.bench and a.compare)),
    ("out", "a directory that holds no run yet; continue the run in it with --resume {out}",
     lambda a: a.resume or a.compare or a.bench or a.out is None
     or not os.path.exists(os.path.join(a.out, "checkpoint.pt"))),
]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_kind(f: dataclasses.Field) -> tuple[str, bool]:
    """(bool | int | float | str, whether None is allowed) of a dataclass field."""
    text = str(f.type)
    kind = next((k for k in ("bool", "int", "float") if k in text), "str")
    return kind, "None" in text


FIELD_KINDS = {f.name: field_kind(f) for cls in (Args, tepo.ObjectiveConfig) for f in dataclasses.fields(cls)}


def invalid(name: str, value) -> str | None:
    """None if `value` is a valid value of field `name` on its own, else what a valid value is."""
    kind, optional = FIELD_KINDS[name]
    valid, test, _ = VALID.get(name, ({"bool": "on or off", "int": "an integer", "float": "a finite number",
                                       "str": "some text"}[kind], lambda v: True, None))
    if value is None:
        return None if optional else valid
    if kind == "bool":
        return None if isinstance(value, bool) else valid
    if kind == "int" and not (isinstance(value, int) and not isinstance(value, bool) and abs(value) <= INT_LIMIT):
        return f"{valid}, at most {INT_LIMIT}"
    if kind == "float" and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                and math.isfinite(value)):
        return valid if name not in VALID else f"{valid} (finite)"
    if kind == "str" and not isinstance(value, str):
        return valid
    return None if test(value) else valid


def converter(name: str):
    """argparse type of field `name`: text -> value, refusing an invalid one with what is valid."""
    kind, optional = FIELD_KINDS[name]

    def convert(text: str):
        if optional and kind != "str" and text.lower() == "none":
            return None
        try:
            value = {"int": int, "float": float, "str": str}[kind](text)
        except ValueError:
            value = text
        problem = invalid(name, value)
        if problem:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; choose {problem}"
                                             + (" or none" if optional and kind != "str" else ""))
        return value
    return convert


def paper_values(name: str) -> str:
    """'0.2 (ppo, grpo); 0.28 (dapo)': the paper value of objective setting `name` for each objective
    that reads it."""
    by_value: dict[str, list[str]] = {}
    for objective, fields in tepo.FIELDS_READ.items():
        if name in fields:
            v = getattr(tepo.PAPER_DEFAULTS[objective], name)
            text = ("on" if v else "off") if isinstance(v, bool) else "none" if v is None else \
                f"{v:g}" if isinstance(v, float) else str(v)
            by_value.setdefault(text, []).append(objective)
    if len(by_value) == 1 and len(next(iter(by_value.values()))) == len(tepo.OBJECTIVES):
        return f"{next(iter(by_value))} (every objective)"
    return "; ".join(f"{v} ({', '.join(objectives)})" for v, objectives in by_value.items())


# Help texts that say how this script uses a setting, in place of tepo.ObjectiveConfig's comment.
CLI_HELP = {"norm_constant": "C of seq-mean-token-sum-norm; none = --max-new-tokens (Dr. GRPO's max generation length)",
            "overlong_penalty": "DAPO: add the soft overlong punishment (a ramp over the last --overlong-cache "
                                "tokens) to the reward"}


METAVARS = {"int": "N", "float": "X", "str": "TEXT"}


def add_flag(container, name: str, text: str) -> None:
    kind, _ = FIELD_KINDS[name]
    text = text.replace("%", "%%")     # argparse %-formats help texts
    if kind == "bool":
        container.add_argument(flag(name), action=argparse.BooleanOptionalAction, help=text)
    else:
        choices = VALID.get(name, (None, None, None))[2]
        container.add_argument(flag(name), type=converter(name), choices=choices, help=text,
                               metavar="{" + ",".join(choices) + "}" if choices else METAVARS[kind])


def build_parser() -> argparse.ArgumentParser:
    """Flags for every field of Args and of tepo.ObjectiveConfig, generated from the dataclasses.
    No defaults are set here (argparse.SUPPRESS): parsing returns only the flags given, and the
    dataclasses' defaults fill in the rest, so the run knows which flags were given (--resume)."""
    parser = argparse.ArgumentParser(
        prog="train_small.py", usage="python train_small.py [options]", argument_default=argparse.SUPPRESS,
        description="Group-relative RL (GRPO, DAPO, GSPO, TEPO, ...) on a tiny model in one file.")
    parser.error = fail   # argparse's own errors (unknown flag, missing value) become one line too
    helps = field_comments(Args)
    for f in dataclasses.fields(Args):
        if f.name == "stop_after":    # for the tests of --resume only
            parser.add_argument(flag(f.name), type=converter(f.name), help=argparse.SUPPRESS)
            continue
        default = ("on" if f.default else "off") if isinstance(f.default, bool) else f.default
        shown = f.default is None or "(default" in helps[f.name]
        add_flag(parser, f.name, helps[f.name] + ("" if shown else f" (default: {default})"))
    group = parser.add_argument_group(
        "objective settings", "Each defaults to the chosen objective's paper value (tepo.py section 2); "
        "a setting the objective does not read is reported and has no effect.")
    obj_helps = field_comments(tepo.ObjectiveConfig)
    for f in dataclasses.fields(tepo.ObjectiveConfig):
        text = CLI_HELP.get(f.name, re.sub(r"\bNone\b", "none", obj_helps[f.name]))
        add_flag(group, f.name, f"{text}. Default: the objective's paper value: {paper_values(f.name)}")
    return parser


def fail(message: str) -> None:
    """A user mistake: one line on stderr, exit status 2, no traceback."""
    print(f"train_small.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def warn(message: str) -> None:
    print(f"train_small.py: warning: {message}", file=sys.stderr)


def check_values(args: Args, obj_overrides: dict) -> None:
    """Every value on its own (VALID), the objective settings (tepo.check_config) and the relations
    between flags (RELATIONS); the first problem found ends the program in one line."""
    values = [(f.name, getattr(args, f.name)) for f in dataclasses.fields(Args)] + list(obj_overrides.items())
    for name, value in values:
        problem = invalid(name, value)
        if problem:
            fail(f"argument {flag(name)}: invalid value {value!r}; choose {problem}")
    for objective, overrides in compare_entries(args) if args.compare else [(args.objective, {})]:
        try:
            tepo.config_for(objective, **{**obj_overrides, **overrides})
        except ValueError as e:       # "eps_low=-0.1 is not valid; choose a number >= 0"
            m = re.fullmatch(r"(\w+)=(.*) is not valid; choose (.*)", str(e))
            if not m:
                fail(str(e))
            valid = re.sub(r"\b([a-z]+(?:_[a-z]+)+)(=(\S+))?",       # field names and values as flags
                           lambda f: flag(f[1]) + (f" ({f[3]})" if f[2] else "") if f[1] in FIELD_KINDS else f[0], m[3])
            fail(f"argument {flag(m[1])}: invalid value {m[2]}; choose {valid}")
    sizes = {"rows_per_minibatch": rows_per_minibatch(args), "builtin_task_size": builtin_task_size(args)}
    for name, valid, test in RELATIONS:
        if not test(args):
            fail(f"argument {flag(name)}: invalid value {getattr(args, name)!r}; choose "
                 + valid.format(**dataclasses.asdict(args), **sizes))


def warn_ignored(args: Args, obj_overrides: dict) -> None:
    """One warning line per objective setting given that no objective of this run reads (the run goes on)."""
    objectives = [name for name, _ in compare_entries(args)] if args.compare else [args.objective]
    for name in obj_overrides:
        if not any(name in tepo.FIELDS_READ[o] for o in objectives):
            readers = [o for o in tepo.OBJECTIVES if name in tepo.FIELDS_READ[o]]
            warn(f"{flag(name)} has no effect: {', '.join(objectives)} does not read it "
                 f"(read by: {', '.join(readers)})")


def compare_entries(args: Args) -> list[tuple[str, dict]]:
    """--compare's entries as (objective, its own objective settings)."""
    return [variant(spec) for spec in args.compare.split(",")]


# Named presets (--regime): settings a flag given explicitly still overrides. Recorded in config.json
# like every other setting. `collapse` is a 3x larger learning rate, at which held-out pass@16 on the
# built-in task collapses, ending far below its start (README, "Two regimes"). It is named for that, not
# for entropy: the mean token entropy does not fall in it. At 1e-3 the model breaks outright.
REGIMES = {"standard": {}, "collapse": {"lr": 3e-4}}


def parse_args(argv=None) -> tuple[Args, dict]:
    """Parse and validate the command line. Returns (args, objective overrides from flags).
    With --resume: the run's saved settings, with the command line's run-only fields and --steps."""
    given = vars(build_parser().parse_args(argv))            # only the flags on the command line
    args = Args(**{k: v for k, v in given.items() if k in Args.__dataclass_fields__})
    if not args.resume:
        args = dataclasses.replace(args, **{k: v for k, v in REGIMES[args.regime].items() if k not in given})
    obj_overrides = {k: v for k, v in given.items() if k not in Args.__dataclass_fields__}
    if args.resume:
        saved, checkpoint_step = check_resumable(args.resume)
        args, obj_overrides = resume_args(args, obj_overrides, set(given), saved, checkpoint_step)
    check_values(args, obj_overrides)
    if not args.resume:
        warn_ignored(args, obj_overrides)
    return args, obj_overrides


def objective_config(args: Args, obj_overrides: dict) -> tepo.ObjectiveConfig:
    """The objective's paper defaults (tepo.PAPER_DEFAULTS), then the flags.

    Dr. GRPO's constant L (seq-mean-token-sum-norm) is the max generation length, as in the paper
    and TRL, unless --norm-constant is given; tepo's own fallback (the padded length of the batch)
    would change from mini-batch to mini-batch.
    """
    cfg = tepo.config_for(args.objective, **obj_overrides)
    if cfg.aggregation == "seq-mean-token-sum-norm" and cfg.norm_constant is None:
        cfg = dataclasses.replace(cfg, norm_constant=float(args.max_new_tokens))
    return cfg


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)          # also seeds CUDA; generation samples from this generator


# =====================================================================================================
# 0b. Run safety: resume that cannot destroy, Ctrl-C that keeps the step, an unreachable hub found in seconds
# =====================================================================================================

def check_resumable(run_dir: str) -> tuple[dict, int]:
    """(saved config.json, step of checkpoint.pt) of a run directory that --resume can continue.
    Otherwise one line saying why not. Only reads: nothing on disk changes either way."""
    config_path, ckpt_path = os.path.join(run_dir, "config.json"), os.path.join(run_dir, "checkpoint.pt")
    if not os.path.isfile(config_path):
        fail(f"argument --resume: {run_dir!r} has no config.json; give a run directory of train_small.py")
    try:
        with open(config_path) as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"argument --resume: {config_path} is damaged ({type(e).__name__}: {first_line(e)}); "
             "the run cannot be resumed (nothing was changed)")
    if not (isinstance(saved, dict) and isinstance(saved.get("args"), dict)
            and isinstance(saved.get("objective_overrides"), dict)):
        fail(f"argument --resume: {config_path} is not a run configuration of train_small.py "
             "(it needs args and objective_overrides); the run cannot be resumed (nothing was changed)")
    unknown = sorted(set(saved["args"]) - set(Args.__dataclass_fields__)
                     | set(saved["objective_overrides"]) - set(tepo.ObjectiveConfig.__dataclass_fields__))
    if unknown:
        fail(f"argument --resume: {config_path} has settings this version of train_small.py does not know "
             f"({', '.join(unknown)}); the run cannot be resumed (nothing was changed)")
    if not os.path.isfile(ckpt_path):
        fail(f"argument --resume: {run_dir!r} has no checkpoint.pt: the run stopped before its first "
             "checkpoint; start it again without --resume (nothing was changed)")
    try:      # the zip checksums catch damaged tensor data; the load (memory-mapped) the rest
        with zipfile.ZipFile(ckpt_path) as z:
            damaged_member = z.testzip()
        if damaged_member is not None:
            raise ValueError(f"checksum mismatch in {damaged_member}")
        step = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)["step"]
    except Exception as e:  # noqa: BLE001 -- whatever is wrong with the file, the answer is one line
        fail(f"argument --resume: {ckpt_path} is damaged ({type(e).__name__}: {first_line(e)}); "
             "the run cannot be resumed (nothing was changed)")
    return saved, int(step)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:150]


def resume_args(args: Args, obj_overrides: dict, given: set[str], saved: dict,
                checkpoint_step: int) -> tuple[Args, dict]:
    """The saved run's settings, with the command line's run-only fields (RUN_ONLY_FIELDS) and --steps.

    A flag that would change what is computed refuses the run in one line that lists every such flag
    (giving a setting its saved value is fine). --steps may extend a finished or interrupted run, or
    shorten an interrupted one down to its checkpoint's step."""
    run_dir = args.resume
    saved_args = Args(**saved["args"])
    saved_cfg = dataclasses.asdict(objective_config(saved_args, saved["objective_overrides"]))
    changed = [name for name in sorted(given - set(RUN_ONLY_FIELDS) - {"steps"})
               if (obj_overrides[name] != saved_cfg[name] if name in obj_overrides
                   else getattr(args, name) != getattr(saved_args, name))]
    if "out" in given and os.path.normpath(args.out) != os.path.normpath(run_dir):
        changed.append("out")
    if changed:
        values = ", ".join(f"{flag(n)} {obj_overrides.get(n, getattr(args, n, None))!r}" for n in changed)
        fail(f"argument --resume: a resumed run keeps its saved settings, and these flags would change them: "
             f"{values}; drop them, or start a new run without --resume")
    steps = args.steps if "steps" in given else saved_args.steps
    if steps < checkpoint_step:
        fail(f"argument --steps: invalid value {steps}; choose an integer >= {checkpoint_step}, the step of "
             f"{run_dir}'s checkpoint")
    run_only = {k: getattr(args, k) for k in RUN_ONLY_FIELDS}
    return (dataclasses.replace(saved_args, **{**run_only, "steps": steps, "out": run_dir}),
            dict(saved["objective_overrides"]))


def ctrl_c_finishes_the_step(run_dir: str):
    """Make Ctrl-C (SIGINT) stop the RL loop cleanly. Returns (interrupted, restore): interrupted()
    says whether Ctrl-C was pressed; the loop then finishes the step, logs and checkpoints it, and
    exits with status 130. A second Ctrl-C aborts at once (the run resumes from its last checkpoint).
    restore() puts the previous handler back."""
    pressed = []

    def handler(signum, frame):
        if pressed:
            print(f"aborted; resume from the last checkpoint with: python train_small.py --resume {run_dir}",
                  file=sys.stderr)
            raise SystemExit(130)
        pressed.append(signum)

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:                 # not the main thread: Ctrl-C keeps its usual meaning
        return (lambda: False), (lambda: None)
    return (lambda: bool(pressed)), (lambda: signal.signal(signal.SIGINT, previous))


HUB_PROBE_SECONDS = 5


def cannot_load(what: str, name: str, e: Exception, offline_reason: str | None, instead: str) -> None:
    """One line for a model or dataset that could not be loaded: the unreachable hub when that is why."""
    why = f"{offline_reason}, and it is not in the local cache" if offline_reason else \
        f"{type(e).__name__}: {first_line(e)}"
    fail(f"could not load {what} {name!r}: {why}; {instead}")


def use_offline_hub_if_unreachable() -> str | None:
    """Probe the Hugging Face hub (at most HUB_PROBE_SECONDS). If it does not answer, switch the hub
    libraries to offline mode, so loading uses the local cache at once instead of retrying for a
    minute, and return why (for the error message); None if the hub answered. Once offline mode is on,
    no probe: the reason is returned if a probe turned it on (TEPO_HUB_UNREACHABLE), else None."""
    import urllib.error
    import urllib.request
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return os.environ.get("TEPO_HUB_UNREACHABLE")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(endpoint, timeout=HUB_PROBE_SECONDS).close()
        return None
    except urllib.error.HTTPError:      # it answered, even if with an error status
        return None
    except Exception as e:  # noqa: BLE001 -- no network, DNS, timeout, proxy: all mean "unreachable"
        reason = f"the Hugging Face hub ({endpoint}) is unreachable ({first_line(getattr(e, 'reason', e))})"
    os.environ["HF_HUB_OFFLINE"], os.environ["TEPO_HUB_UNREACHABLE"] = "1", reason
    for module in ("huggingface_hub.constants", "datasets.config"):     # read the variable when imported
        if module in sys.modules:
            sys.modules[module].HF_HUB_OFFLINE = True
    return reason


# =====================================================================================================
# 1. The task: built-in arithmetic word problems, or GSM8K-style data
# =====================================================================================================

NAMES = ["Ann", "Bob", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jon"]
ITEMS = ["apple", "pen", "cup", "book", "egg", "coin", "card", "shell"]


# How the sloppy solver of the warm-up corpus misreads each kind of problem: it adds when it should
# multiply or subtract, and subtracts when it should add. One systematic misreading per kind, as
# real students (and real pretraining corpora) have.
MISREAD = {"+": "-", "-": "+", "*": "+"}


def arithmetic_task_size(difficulty: int, ops: str) -> int:
    """How many problems make_arithmetic_task draws at most: half of the distinct questions, so
    that drawing without repeats stays fast."""
    return len(NAMES) * len(ITEMS) * len(ops) * difficulty * difficulty // 2


def make_arithmetic_task(difficulty: int, n_train: int, n_test: int, seed: int, ops: str = "+-*",
                         sft_noise: float = 0.0):
    """One-step word problems with GSM8K-style worked answers ending in `#### <number>`.

    difficulty = the largest operand. Questions are unique, and the test split never shares a
    question with the training split; both are fixed by the seed.
    Columns: question, answer (always right: rewards and evaluation use it), and demonstration
    (what the supervised warm-up imitates): the right worked answer, or, for a fraction
    `sft_noise` of the problems, a MISREADING of the problem worked out correctly, e.g. "7+3=10"
    for "7 bags of 3". The warm-up model thus knows both readings and picks between them almost
    at random; reading the problem right is a behaviour that transfers across problems, so RL
    can learn it within a few thousand prompts (it cannot memorise new arithmetic facts that fast).
    """
    import datasets
    rng = random.Random(f"arithmetic-{seed}-{difficulty}")
    noise_rng = random.Random(f"misread-{seed}")
    seen, rows = set(), []
    while len(rows) < min(n_train + n_test, arithmetic_task_size(difficulty, ops)):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, op = rng.randint(1, difficulty), rng.randint(1, difficulty), rng.choice(ops)
        if op == "+":
            q = f"{name} has {a} {item}s and gets {b} more. How many {item}s now?"
        elif op == "-":
            a, b = max(a, b), min(a, b)
            q = f"{name} has {a} {item}s and gives away {b}. How many are left?"
        else:
            q = f"{name} has {a} bags of {b} {item}s. How many {item}s in all?"
        if q not in seen:
            seen.add(q)
            shown = MISREAD[op] if noise_rng.random() < sft_noise else op
            rows.append({"question": q, "answer": worked_answer(a, op, b), "demonstration": worked_answer(a, shown, b)})
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[n_test:]),
                                 "test": datasets.Dataset.from_list(rows[:n_test])})


def worked_answer(a: int, op: str, b: int) -> str:
    c = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a}{op}{b}={c}\n#### {c}"


def load_task(args: Args):
    """A DatasetDict with train/test splits of question/answer records."""
    if args.dataset is None:
        return make_arithmetic_task(args.difficulty, args.n_train, args.n_test, args.seed, args.ops, args.sft_noise)
    import datasets
    path = os.path.expanduser(args.dataset)
    offline_reason = None if os.path.exists(path) else use_offline_hub_if_unreachable()
    try:
        if path.endswith(".jsonl"):
            data = datasets.Dataset.from_list(read_jsonl_task(path))
        elif path.endswith(".json"):
            data = datasets.load_dataset("json", data_files=path)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
            data = datasets.load_from_disk(path)
        elif os.path.isdir(path):
            data = datasets.load_dataset(path)
        else:
            data = datasets.load_dataset(args.dataset, "main" if args.dataset.endswith("gsm8k") else None)
    except Exception as e:  # noqa: BLE001 -- any loading failure is a user-facing one-liner
        cannot_load("dataset", args.dataset, e, offline_reason,
                    "give a local .jsonl file or dataset directory, or run without --dataset for the built-in task")
    if isinstance(data, datasets.Dataset):
        data = datasets.DatasetDict({"train": data})
    if not {"question", "answer"} <= set(data["train"].column_names):
        fail(f"dataset {args.dataset!r} has columns {data['train'].column_names}; need question and answer")
    if "test" not in data:   # a fixed, seeded held-out split
        if len(data["train"]) < 10:
            fail(f"dataset {args.dataset!r} has {len(data['train'])} rows and no test split; need at least 10 "
                 "rows (a fifth is held out)")
        data = data["train"].train_test_split(test_size=min(args.n_test, len(data["train"]) // 5), seed=args.seed)
    return data


def read_jsonl_task(path: str) -> list[dict]:
    """The question/answer rows of a local .jsonl file (one JSON object per line; blank lines skipped).
    A bad line is reported as such: file, line number and what is wrong."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"dataset {path}: cannot be read as UTF-8 text ({type(e).__name__}: {first_line(e)})")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"dataset {path}, line {number}: not valid JSON ({e.msg}, column {e.colno}); "
                 "each line must be one JSON object with text fields question and answer")
        if not (isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ("question", "answer"))):
            fail(f"dataset {path}, line {number}: needs a JSON object with text fields question and answer, "
                 f"got {line.strip()[:60]!r}")
        rows.append({"question": row["question"], "answer": row["answer"]})
    if not rows:
        fail(f"dataset {path}: no rows; each line must be one JSON object with text fields question and answer")
    return rows


def format_prompt(question: str) -> str:
    return question.strip() + "\n"


# ---- answer parsing: regular expressions only, never eval/exec -----------------------------------
# A number: optional minus, digits with optional thousands separators ("1,234"), optional decimals.
NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
STRICT_ANSWER = re.compile(r"####\s*(" + NUMBER + r")\s*$")
ANY_NUMBER = re.compile(NUMBER)


def to_number(text: str | None) -> Decimal | None:
    """'1,234' -> Decimal('1234'); '12.0' == '12'. None when there is no number."""
    if text is None:
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def parse_strict(text: str) -> Decimal | None:
    """The number after a final `#### ` (GSM8K's format), nothing else may follow."""
    m = STRICT_ANSWER.search(text)
    return to_number(m.group(1)) if m else None


def parse_lenient(text: str) -> Decimal | None:
    """The last number anywhere in the text."""
    last = None
    for last in ANY_NUMBER.finditer(text):
        pass
    return to_number(last.group(0)) if last else None


def gold_answer(answer_text: str) -> Decimal | None:
    strict = parse_strict(answer_text.strip())       # `is None`, not `or`: Decimal(0) is falsy
    return strict if strict is not None else parse_lenient(answer_text)


def score_completions(texts: list[str], golds: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(strict_correct[B], lenient_correct[B]) as float tensors of 0/1."""
    strict = [float(g is not None and parse_strict(t) == g) for t, g in zip(texts, golds)]
    lenient = [float(g is not None and parse_lenient(t) == g) for t, g in zip(texts, golds)]
    return torch.tensor(strict), torch.tensor(lenient)


# =====================================================================================================
# 2. The model: a tiny built-in one (warmed up and cached) or any causal LM
# =====================================================================================================

END = "<|endoftext|>"   # end of sequence AND padding, as in GPT-2: the end token must still be trained


def build_char_tokenizer(texts):
    """A character-level tokenizer made locally with `tokenizers`, wrapped for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = sorted(set("".join(texts)) | set("0123456789+-*/=#.,:?! \n"))
    vocab = {END: 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()                                                      # join without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END, pad_token=END, unk_token="<unk>",
                                   padding_side="left", clean_up_tokenization_spaces=False)


def tiny_model_config(args: Args, tokenizer):
    """The built-in model's transformers config: GPT-2 or Qwen2 of the --n-layer/--n-embd/--n-head size."""
    from transformers import GPT2Config, Qwen2Config
    eos = tokenizer.eos_token_id
    common = dict(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    if args.arch == "gpt2":
        return GPT2Config(n_positions=args.max_prompt_tokens + args.max_new_tokens + 8, n_embd=args.n_embd,
                          n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, **common)
    return Qwen2Config(hidden_size=args.n_embd, intermediate_size=4 * args.n_embd,
                       num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                       num_key_value_heads=args.n_head, tie_word_embeddings=True,
                       max_position_embeddings=args.max_prompt_tokens + args.max_new_tokens + 8, **common)


def build_tiny_model(args: Args, tokenizer):
    """A small causal LM from a transformers config, dropout off (ratios must be 1 on-policy)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(tiny_model_config(args, tokenizer))


def builtin_tokenizer(task):
    """The built-in task's character tokenizer (the characters of its texts)."""
    return build_char_tokenizer(list(task["train"]["question"]) + list(task["train"]["answer"])
                                + list(task["test"]["question"]))


def warmup_cache_dir(args: Args) -> str:
    """<--cache-dir>/warmup-<hash of everything that determines the warmed-up weights>."""
    keys = ("arch", "n_layer", "n_embd", "n_head", "difficulty", "ops", "sft_noise", "n_train", "n_test",
            "warmup_steps", "warmup_lr", "warmup_batch", "max_prompt_tokens", "max_new_tokens", "seed")
    blob = json.dumps({k: getattr(args, k) for k in keys if k != "ops" or args.ops != "+-*"} | {"version": 1},
                      sort_keys=True)
    return os.path.join(args.cache_dir, "warmup-" + hashlib.sha1(blob.encode()).hexdigest()[:12])


def sft_batch(tokenizer, questions, answers, device):
    """Prompt + answer + end token, right-padded; labels only on answer and end tokens."""
    rows = []
    for q, a in zip(questions, answers):
        p = tokenizer(format_prompt(q)).input_ids
        c = tokenizer(a, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((p + c, [-100] * len(p) + c))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)], labels[i, :len(y)], attn[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids.to(device), attn.to(device), labels.to(device)


def supervised_warmup(model, tokenizer, train_split, args: Args, device):
    """A short supervised phase so the policy starts with partial accuracy (RL needs some reward)."""
    from tqdm.auto import tqdm
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.9 * s / max(1, args.warmup_steps))
    model.train()
    bar = tqdm(range(args.warmup_steps), desc="warm-up", dynamic_ncols=True)
    for _ in bar:
        idx = torch.randint(len(train_split), (args.warmup_batch,), generator=gen).tolist()
        rows = train_split.select(idx)
        demos = rows["demonstration"] if "demonstration" in rows.column_names else rows["answer"]
        ids, attn, labels = sft_batch(tokenizer, list(rows["question"]), list(demos), device)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


def save_pretrained_atomically(model, tokenizer, final_dir: str) -> None:
    """save_pretrained into a temporary directory, then os.replace: a crash never leaves half a model."""
    parent = os.path.dirname(final_dir) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.isdir(final_dir):       # someone else finished first, or an old copy: replace it
        shutil.rmtree(final_dir)
    os.replace(tmp, final_dir)


def prepare_start_model(args: Args, task, device) -> str:
    """The directory or id RL starts from: --model, or the warmed-up built-in model (cached)."""
    if args.model is not None:
        return args.model
    cache = warmup_cache_dir(args)
    if os.path.exists(os.path.join(cache, "config.json")):
        print(f"warm-up model: {cache} (cached)")
        return cache
    print(f"warm-up model: {args.warmup_steps} supervised steps, then cached in {cache}")
    tokenizer = builtin_tokenizer(task)
    torch.manual_seed(args.seed)
    model = build_tiny_model(args, tokenizer).to(device)
    if args.warmup_steps > 0:
        supervised_warmup(model, tokenizer, task["train"], args, device)
    save_pretrained_atomically(model.cpu(), tokenizer, cache)
    return cache


def load_policy(path: str, args: Args, device):
    """Model and tokenizer from an id or directory; one-line error if it cannot be had."""
    offline_reason = None if os.path.exists(path) else use_offline_hub_if_unreachable()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        # fp32 weights (Adam's master copy); with --precision bf16 the forward passes run under autocast
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=args.trust_remote_code,
                                                     dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 -- any loading failure is a user-facing one-liner
        cannot_load("model", path, e, offline_reason,
                    "give a local model directory, or run without --model for the built-in tiny model")
    tokenizer.padding_side, tokenizer.truncation_side = "left", "left"   # generation needs left padding
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Stop on every end token the model knows: Qwen2.5-Instruct's own generation config stops on
    # <|im_end|> and <|endoftext|>, its tokenizer names only one of them.
    own_eos = model.generation_config.eos_token_id
    eos_ids = sorted({i for i in as_list(own_eos) + as_list(model.config.eos_token_id) + [tokenizer.eos_token_id]
                      if i is not None})
    # Sampling must be plain softmax(z / T): a model's own generation defaults (top_k, top_p,
    # repetition penalty) would change the distribution and the log-probs would no longer describe it.
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids)
    switch_off_dropout(model)
    model.to(device).eval()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model, tokenizer


def as_list(ids) -> list:
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def switch_off_dropout(model) -> None:
    """Dropout off everywhere: on-policy ratios must be exactly 1, also in train() mode (which gradient
    checkpointing needs). nn.Dropout modules, and every float `*dropout*` / `*pdrop*` setting of the
    config and of the modules: Qwen2's attention reads `self.attention_dropout`, a float copied from
    the config, in train() mode."""
    for key, value in model.config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(model.config, key, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(module, key, 0.0)


# =====================================================================================================
# 3-5. Rollout: prompts, generation, rewards, advantages
# =====================================================================================================

def prompts_for_step(step: int, n_train: int, args: Args) -> list[int]:
    """Training-set indices of this step's prompts: a seeded permutation per pass over the data,
    a function of (seed, step) only, so a resumed run draws the same prompts."""
    per_epoch = max(1, n_train // args.prompts_per_step)
    epoch, slot = divmod(step - 1, per_epoch)
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed * 100_003 + epoch))
    return perm[slot * args.prompts_per_step:(slot + 1) * args.prompts_per_step].tolist()


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """1 up to and INCLUDING the first end token, 0 after it.                          [B, T] -> [B, T]

    Built from token positions, not from `id != pad_id`: when pad id == eos id (GPT-2) that test
    would drop the end token from the loss and the model would never learn to stop.
    """
    is_end = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    ends_before = is_end.long().cumsum(1) - is_end.long()      # end tokens strictly before position t
    return (ends_before == 0).long()


def eos_ids_of(model) -> list[int]:
    """Every end token of the model (load_policy puts them all in its generation config)."""
    return as_list(model.generation_config.eos_token_id)


def autocast(device, precision: str):
    """--precision bf16: the forward passes run under bf16 autocast (CUDA and CPU alike); fp32: none.
    Weights, gradients and Adam's state stay fp32 either way."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


# Stacking generate's logits for the sampling check costs B * T * V * 4 bytes: above this it is skipped.
SAMPLING_CHECK_MAX_BYTES = 2**30


def sampling_check_bytes(args: Args, vocab_size: int) -> int:
    """Bytes of generate's stacked logits [B, T, V] kept for the sampling check; 0 when it is off or
    would take more than SAMPLING_CHECK_MAX_BYTES."""
    nbytes = args.prompts_per_step * args.group_size * args.max_new_tokens * vocab_size * 4
    return nbytes if args.check_sampling_logprobs and nbytes < SAMPLING_CHECK_MAX_BYTES else 0


@torch.no_grad()
def generate_group(model, tokenizer, questions: list[str], group_size: int, args: Args, device,
                   greedy: bool = False, want_logprobs: bool = False) -> dict:
    """G completions per prompt with model.generate (KV cache). Groups are contiguous rows.

    Returns prompt_ids/prompt_mask [B, P] (left-padded), completion_ids/completion_mask [B, T],
    and, if asked, the log-probs of the sampled tokens as generate saw them, at temperature T.
    """
    enc = tokenizer([format_prompt(q) for q in questions], return_tensors="pt", padding=True,
                    truncation=True, max_length=args.max_prompt_tokens)
    prompt_ids = enc.input_ids.repeat_interleave(group_size, 0).to(device)         # [B, P]
    prompt_mask = enc.attention_mask.repeat_interleave(group_size, 0).to(device)   # [B, P]
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=args.temperature,
                                                         top_k=0, top_p=1.0)
    eos_ids = eos_ids_of(model)
    with autocast(device, args.precision):
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=args.max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids,
                             return_dict_in_generate=True, output_logits=want_logprobs, use_cache=True, **sampling)
    completion_ids = out.sequences[:, prompt_ids.shape[1]:]                         # [B, T]
    mask = completion_mask(completion_ids, eos_ids)
    ends_with_eos = torch.isin(completion_ids[:, -1], torch.tensor(eos_ids, device=device))
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                 completion_mask=mask, truncated=(mask.sum(1) == completion_ids.shape[1]) & ~ends_with_eos)
    if want_logprobs:
        logits = torch.stack(out.logits, 1)                                         # [B, T, V] raw
        batch["sampling_logp"] = tepo.token_logprobs_from_logits(logits, completion_ids, args.temperature)
    return batch


def compute_rewards(batch: dict, texts: list[str], golds: list, args: Args, cfg: tepo.ObjectiveConfig) -> dict:
    """Task reward (1 if right under --reward parsing, else 0) plus DAPO's soft length cost."""
    strict, lenient = score_completions(texts, golds)
    rewards = (strict if args.reward == "strict" else lenient).clone()
    if cfg.overlong_penalty:
        lengths = batch["completion_mask"].sum(1).float().cpu()
        rewards = rewards + tepo.soft_overlong_punishment(lengths, args.max_new_tokens, args.overlong_cache)
    return dict(rewards=rewards, strict=strict, lenient=lenient)


def compute_advantages(rewards: torch.Tensor, args: Args, cfg: tepo.ObjectiveConfig):
    """Group-relative advantages [B] and the rows to train on (DAPO's dynamic sampling filter)."""
    adv = tepo.group_advantages(rewards, args.group_size, cfg.advantage_scale, cfg.adv_eps)
    keep = (tepo.dynamic_sampling_mask(rewards, args.group_size) if cfg.dynamic_sampling
            else torch.ones_like(rewards, dtype=torch.bool))
    return adv, keep


# =====================================================================================================
# 5-6. Log-probs and the update
# =====================================================================================================

def minibatch_plan(keep: torch.Tensor, args: Args) -> list[list[torch.Tensor]]:
    """The rows of every optimizer step of this rollout, drawn before any forward pass: `epochs`
    passes of `mini_batches` mini-batches of shuffled WHOLE groups, each mini-batch a list of
    micro-batches of at most --micro-batch-size rows (row indices [b], CPU). Empty when DAPO's
    filter dropped every group.

    Mini-batches hold whole groups. A group's advantages sum to zero, so the tokens its samples
    share (here: copying the question's numbers) get zero net gradient. Split a group across
    mini-batches and those tokens get pure noise, which Adam scales up to full-size steps:
    measured, row-shuffled mini-batches taught the model to miscopy operands (62/300 held-out
    answers after 100 GRPO steps, none before) and held-out accuracy fell. Micro-batches may split
    a group: their gradients add up to the mini-batch's before the optimizer step.
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
            plan.append(list(rows.split(args.micro_batch_size or len(rows))))
    return plan


def completion_logits(model, batch: dict, rows, args: Args) -> torch.Tensor:
    """Logits at the completion positions only (prompt logits are never materialised).   [b, T, V]

    Left padding + absolute positions: position_ids = cumsum(attention_mask) - 1, exactly as
    generate did, otherwise every log-prob is off (by up to 14 nats on GPT-2).
    """
    rows = rows.to(batch["prompt_ids"].device)
    ids = torch.cat([batch["prompt_ids"][rows], batch["completion_ids"][rows]], 1)       # [b, P+T]
    attn = torch.cat([batch["prompt_mask"][rows], batch["completion_mask"][rows]], 1)    # [b, P+T]
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)
    T = batch["completion_ids"].shape[1]
    with autocast(ids.device, args.precision):
        # logits_to_keep=T+1: the last T+1 positions; position P-1+t predicts completion token t.
        logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids,
                       logits_to_keep=T + 1, use_cache=False).logits
    return logits[:, :-1]


LOGITS_CHUNK_BYTES = 2**24   # log-probs and entropy go through the logits 16 MiB of float32 at a time


def positions_per_chunk(vocab_size: int) -> int:
    """Positions per chunk so that one chunk of float32 logits is at most LOGITS_CHUNK_BYTES."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


class ChunkedTokenLogprobs(torch.autograd.Function):
    """tepo.token_logprobs_from_logits, same values and gradient, in chunks of positions.

    Autograd's version keeps a float32 copy of the [b, T, V] logits and logsumexp's temporaries
    alive until the backward (with a 151,936-token vocabulary that is several copies of the
    largest tensor of the step). This one keeps only the logits (the model's output, alive anyway)
    and logsumexp per position [b, T], and recomputes softmax chunk by chunk in the backward:
        d log p(y) / d z_v = (1[v = y] - softmax(z / T)_v) / T
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature: float):
        V = logits.shape[-1]
        flat, flat_tokens = logits.reshape(-1, V), tokens.reshape(-1, 1)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)
        chunk = positions_per_chunk(V)
        for s in range(0, flat.shape[0], chunk):
            z = flat[s:s + chunk].to(dtype) / temperature
            lse[s:s + chunk] = torch.logsumexp(z, -1)
            out[s:s + chunk] = z.gather(-1, flat_tokens[s:s + chunk]).squeeze(-1) - lse[s:s + chunk]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        return out.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, tokens, lse = ctx.saved_tensors
        V, T = logits.shape[-1], ctx.temperature
        flat, flat_tokens, g = logits.reshape(-1, V), tokens.reshape(-1, 1), grad_out.reshape(-1, 1)
        grad = torch.empty_like(flat)
        chunk = positions_per_chunk(V)
        for s in range(0, flat.shape[0], chunk):
            z = flat[s:s + chunk].to(lse.dtype) / T
            d = -torch.exp(z - lse[s:s + chunk, None]) * g[s:s + chunk]                # -softmax * g
            d.scatter_add_(-1, flat_tokens[s:s + chunk], g[s:s + chunk])               # + onehot * g
            grad[s:s + chunk] = d / T
        return grad.view_as(logits), None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at the sampled tokens, memory-bounded.          [b, T, V], [b, T] -> [b, T]"""
    return ChunkedTokenLogprobs.apply(logits, tokens, temperature)


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Full-vocabulary entropy per position, one 64 MiB chunk at a time.                 [b, T, V] -> [b, T]"""
    return tepo.entropy_from_logits(logits.detach(), temperature, positions_per_chunk(logits.shape[-1]))


ENTROPY_CHECK_MAX_POSITIONS = 2048   # the default built-in run checks ~1,000 (64 rows x ~16 tokens)


class EntropyCheckPositions:
    """The logits before the update at the positions the entropy check uses (entropy_check).

    Positions: the valid completion tokens of the first --entropy-check-rows rows of the rollout,
    at most ENTROPY_CHECK_MAX_POSITIONS of them, kept in the model's dtype ([n, V]): with a
    151,936-token vocabulary each position costs 0.6 MB in float32, so the number must be bounded.
    """

    def __init__(self, batch: dict, args: Args):
        rows = min(args.entropy_check_rows, batch["completion_ids"].shape[0])
        valid = batch["completion_mask"][:rows].bool()                              # [c, T]
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
def rollout_statistics(run, batch: dict, adv: torch.Tensor, plan: list, checked: bool = True) -> dict:
    """Before any update: old and reference log-probs, entropy, Cov(log pi, A), and the logits the
    entropy check starts from.

    The old log-probs are computed with the SAME micro-batches as the update's first epoch (the
    rows its optimizer steps will see), so the first of them is exactly on-policy whatever the
    kernels: same rows, same shapes, same arithmetic. Rows no optimizer step sees (dropped by
    DAPO's filter) are still needed for the rollout's entropy and covariance.
    """
    args, B = run.args, batch["completion_ids"].shape[0]
    mask = batch["completion_mask"]
    first_epoch = [rows for minibatch in plan[:len(plan) // args.epochs] for rows in minibatch]
    seen = torch.zeros(B, dtype=torch.bool)
    for rows in first_epoch:
        seen[rows] = True
    unseen = torch.arange(B)[~seen]
    forwards = first_epoch + (list(unseen.split(rows_per_forward(args))) if len(unseen) else [])
    dtype = torch.promote_types(next(run.model.parameters()).dtype, torch.float32)  # float64 in the tests
    old_logp = torch.zeros(mask.shape, dtype=dtype, device=mask.device)             # [B, T]
    entropy = torch.zeros_like(old_logp)                                            # [B, T]
    ref_logp = torch.zeros_like(old_logp) if run.ref_model is not None else None    # [B, T]
    check = EntropyCheckPositions(batch, args if checked else dataclasses.replace(args, entropy_check_rows=0))
    for rows in forwards:
        logits = completion_logits(run.model, batch, rows, args)                   # [b, T, V]
        tokens = batch["completion_ids"][rows.to(mask.device)]
        old_logp[rows] = token_logprobs(logits, tokens, args.temperature).to(dtype)
        entropy[rows] = token_entropy(logits, args.temperature).to(dtype)
        check.capture(rows, logits)
        del logits                 # before the next forward allocates its own
        if run.ref_model is not None:
            ref_logp[rows] = token_logprobs(completion_logits(run.ref_model, batch, rows, args), tokens,
                                            args.temperature).to(dtype)
    return dict(old_logp=old_logp, entropy=entropy, ref_logp=ref_logp, check=check,
                entropy_mean=tepo.masked_mean(entropy, mask).item(),
                cov=tepo.masked_mean(tepo.token_covariance(old_logp, adv.to(mask.device), mask), mask).item(),
                **precision_noise_floor(run, batch, forwards[0], old_logp))


@torch.no_grad()
def precision_noise_floor(run, batch: dict, rows: torch.Tensor, logp: torch.Tensor) -> dict:
    """How far the run's precision puts the log-probs from float32's, on one micro-batch: max and mean
    |log pi(bf16 autocast) - log pi(fp32)| over its valid tokens (0 in fp32, not computed).

    Any ratio band or masked penalty that acts on smaller log-ratios than this acts on rounding
    noise: GSPO's and TEPO's band is (1 - 3e-4, 1 + 4e-4), i.e. |log s| < 4e-4.
    """
    if run.args.precision == "fp32":
        return {"precision/logp_error_max": 0.0, "precision/logp_error_mean": 0.0}
    fp32_args = dataclasses.replace(run.args, precision="fp32")
    exact = token_logprobs(completion_logits(run.model, batch, rows, fp32_args),
                           batch["completion_ids"][rows.to(logp.device)], run.args.temperature)
    valid = batch["completion_mask"][rows.to(logp.device)].bool()
    error = (logp[rows] - exact).abs()[valid]
    return {"precision/logp_error_max": error.max().item(), "precision/logp_error_mean": error.mean().item()}


class KLMaskDetails:
    """One row of details.jsonl: where TEPO's KL mask falls during one RL step.

    details.jsonl (TEPO only: --objective tepo, even with --beta 0, where the mask is computed but has
    no effect; one JSON row per RL step, truncated on --resume like metrics.jsonl). Where TEPO's KL
    mask (tepo.tepo_kl_mask) falls, under the configured entropy criterion and under both criteria
    side by side; logging only (detached tensors: metrics.jsonl is bit-identical without it):
      step                          RL step, as in metrics.jsonl
      kl_mask_frac_by_minibatch     one value per optimizer step, in order (epochs x mini_batches, fewer
                                    when DAPO's filter left fewer groups; empty on a skipped step):
                                    masked / valid completion tokens under the configured criterion;
                                    its mean is metrics.jsonl's kl_mask/frac
      kl_mask_frac_cov_by_minibatch, kl_mask_frac_measured_by_minibatch
                                    the same with entropy_criterion cov / measured. measured is 0 on a
                                    step's first mini-batch (CPU; ~0 under CUDA's bf16): nothing has
                                    moved since the rollout
      kl_mask_position_counts       [T] masked tokens (configured criterion) at each completion position,
                                    summed over the step's mini-batches (T = padded completion width)
      valid_position_counts         [T] valid tokens at each position, summed the same way (a token is
                                    counted once per epoch): divide to get the masked fraction by position
      sample                        one completion of the last micro-batch: its first row in rollout order
                                    with A > 0 (its first row if none); null on a skipped step. Fields:
                                    prompt (text), tokens (each valid token decoded, end token included),
                                    reward, advantage, and per valid token, at the last micro-batch:
                                    kl_mask, kl_mask_cov, kl_mask_measured (0/1), entropy (rollout),
                                    entropy_after (at that micro-batch's forward), cov (token_covariance
                                    of the ROLLOUT log-probs over the micro-batch; the cov criterion uses
                                    the current ones, so off-policy a sign can differ), log_ratio
                                    (log pi - log pi_old); floats rounded to 4, 5 and 6 decimals

    update_policy calls add() once per micro-batch and close() after each optimizer step; row() then
    builds the JSON row. Every mask is rebuilt here from detached tensors and nothing flows back into
    the loss or the optimizer, so a run's metrics.jsonl is the same with or without it.
    """

    def __init__(self, cfg: tepo.ObjectiveConfig, T: int, device):
        # Key suffix -> config: "" is the configured criterion, then each criterion forced.
        self.configs = {"": cfg, **{"_" + c: dataclasses.replace(cfg, entropy_criterion=c)
                                    for c in tepo.ENTROPY_CRITERIA}}
        self.masked = []                                                    # per mini-batch: [3] counts
        self.valid = []                                                     # per mini-batch: valid count
        self.open = None                                                    # counts of the current one
        self.masked_at = torch.zeros(T, dtype=torch.long, device=device)    # [T]
        self.valid_at = torch.zeros(T, dtype=torch.long, device=device)     # [T]
        self.last = None                                                    # the last mini-batch's tensors

    def add(self, rows, logp, old_logp, adv, mask, entropy, old_entropy) -> None:
        """One mini-batch: rows [b] (rollout indices), logp/old_logp/entropy/old_entropy/mask [b, T],
        adv [b]. Counts stay tensors until row(): no extra device syncs per optimizer step."""
        logp, entropy, valid = logp.detach(), entropy.detach(), mask.bool()
        masks = {key: tepo.tepo_kl_mask(logp, adv, mask, c, entropy, old_entropy)       # bool [b, T] each
                 for key, c in self.configs.items()}
        counts = (torch.stack([m.sum() for m in masks.values()]), valid.sum())
        self.open = counts if self.open is None else (self.open[0] + counts[0], self.open[1] + counts[1])
        self.masked_at += masks[""].sum(0)
        self.valid_at += valid.sum(0)
        self.last = dict(rows=rows, masks=masks, logp=logp, old_logp=old_logp, adv=adv, mask=valid,
                         entropy=entropy, old_entropy=old_entropy)

    def close(self) -> None:
        """The optimizer step is done: its mini-batch's counts become one entry of the lists."""
        self.masked.append(self.open[0])
        self.valid.append(self.open[1])
        self.open = None

    def row(self, step: int, batch: dict, rewards: torch.Tensor, tokenizer) -> dict:
        """The JSON row of this step; a skipped step (no add()) has empty lists and no sample."""
        row = {"step": step}
        masked = torch.stack(self.masked).tolist() if self.masked else []   # [n_minibatches, 3]
        valid = torch.stack(self.valid).tolist() if self.valid else []
        for i, key in enumerate(self.configs):
            row[f"kl_mask_frac{key}_by_minibatch"] = [m[i] / v for m, v in zip(masked, valid)]
        row["kl_mask_position_counts"] = self.masked_at.tolist()
        row["valid_position_counts"] = self.valid_at.tolist()
        row["sample"] = self.sample(batch, rewards, tokenizer) if self.last is not None else None
        return row

    def sample(self, batch: dict, rewards: torch.Tensor, tokenizer) -> dict:
        """The last micro-batch's first row in rollout order with A > 0 (its first row if none)."""
        last = self.last
        order = last["rows"].argsort()                       # mini-batch positions in rollout order
        positive = (last["adv"][order] > 0).nonzero()
        j = order[positive[0, 0] if len(positive) else 0]    # position of the sample in the mini-batch
        r = last["rows"][j].item()                           # its row in the rollout
        valid = last["mask"][j]                              # [T]
        # Per-token covariance of the rollout log-probs, centred over the whole mini-batch.
        cov = tepo.token_covariance(last["old_logp"], last["adv"], last["mask"])[j]       # [T]

        def tokens_of(x, digits=None):                       # [T] -> list over valid tokens
            values = x[valid].tolist()
            return values if digits is None else [round(v, digits) for v in values]

        return {"prompt": tokenizer.decode(batch["prompt_ids"][r][batch["prompt_mask"][r].bool()]),
                "tokens": [tokenizer.decode([i]) for i in tokens_of(batch["completion_ids"][r])],
                "reward": rewards[r].item(), "advantage": last["adv"][j].item(),
                **{f"kl_mask{key}": tokens_of(m[j].int()) for key, m in last["masks"].items()},
                "entropy": tokens_of(last["old_entropy"][j], 4), "entropy_after": tokens_of(last["entropy"][j], 4),
                "cov": tokens_of(cov, 5), "log_ratio": tokens_of(last["logp"][j] - last["old_logp"][j], 6)}


def update_policy(run, batch: dict, stats: dict, adv: torch.Tensor, plan: list, details=None) -> dict:
    """One optimizer step per mini-batch of the plan, its gradient accumulated over its micro-batches.

    The objective is told the mini-batch's token and sequence counts (num_tokens, num_seqs), so the
    micro-batch losses add up to the mini-batch's loss, gradient included (tepo.aggregate_loss).
    Exact for every objective whose loss is a sum over tokens or sequences; the ones that select
    tokens by statistics of the batch (Clip-Cov, KL-Cov, TEPO's `cov` criterion: the covariance's
    centring, the top-k and the random draw) compute those per micro-batch, as verl does.
    """
    model, args = run.model, run.args
    if args.gradient_checkpointing:
        model.train()   # transformers checkpoints only in train mode; dropout is off (switch_off_dropout)
    mask, adv = batch["completion_mask"], adv.to(batch["completion_mask"].device)
    steps, first = [], None
    for micro_batches in plan:
        rows = torch.cat(micro_batches)
        counts = dict(num_tokens=mask[rows].sum().item(), num_seqs=float(len(rows)))   # the whole mini-batch's
        run.optimizer.zero_grad(set_to_none=True)
        parts = []
        for micro in micro_batches:
            loss, metrics, log_ratio = micro_batch_loss(run, batch, stats, adv, micro, counts, details)
            loss.backward()
            parts.append((metrics, mask[micro].sum().item()))
            if first is None:   # before any optimizer step: the first micro-batch must be exactly on-policy
                first = log_ratio
        if details is not None:
            details.close()
        metrics = combine_micro_batches(parts)
        metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
        run.optimizer.step()
        steps.append(metrics)
    model.eval()
    out = {key: sum(m[key] for m in steps) / len(steps) for key in steps[0]}
    out["ratio/min"], out["ratio/max"] = min(m["ratio/min"] for m in steps), max(m["ratio/max"] for m in steps)
    out["logprobs/first_minibatch_max_abs_log_ratio"] = first.max().item() if len(first) else 0.0
    out["logprobs/first_minibatch_mean_abs_log_ratio"] = first.mean().item() if len(first) else 0.0
    return out


def micro_batch_loss(run, batch: dict, stats: dict, adv: torch.Tensor, rows: torch.Tensor, counts: dict,
                     details=None):
    """The objective on one micro-batch: (loss, metrics, |log pi - log pi_old| at its valid tokens)."""
    args, cfg = run.args, run.cfg
    idx = rows.to(adv.device)
    mask, tokens = batch["completion_mask"][idx], batch["completion_ids"][idx]
    logits = completion_logits(run.model, batch, rows, args)                       # [b, T, V]
    logp = token_logprobs(logits, tokens, args.temperature)                          # [b, T]
    # The current entropy: for the objective when its criterion needs it, and for the details log
    # (the measured criterion) even when it does not; the loss gets it only in the first case.
    needs_entropy = tepo.needs_entropy(args.objective, cfg)
    entropy = token_entropy(logits, args.temperature) if needs_entropy or details is not None else None
    old_logp, old_entropy = stats["old_logp"][idx], stats["entropy"][idx]
    ref = stats["ref_logp"][idx] if stats["ref_logp"] is not None else None
    loss, metrics = run.objective(logp, old_logp, adv[idx], mask, cfg, ref_logp=ref,
                                  entropy=entropy if needs_entropy else None,
                                  old_entropy=old_entropy if needs_entropy else None, **counts)
    if details is not None:
        details.add(idx, logp, old_logp, adv[idx], mask, entropy, old_entropy)
    log_ratio = (logp.detach() - old_logp).abs()[mask.bool()]
    return loss, metrics, log_ratio


def combine_micro_batches(parts: list[tuple[dict, int]]) -> dict:
    """One mini-batch's metrics from its micro-batches' (metrics, valid tokens): the loss and its parts
    add up (each micro-batch's loss is its share of the mini-batch's); ratio extremes are extremes;
    on_policy holds if it held everywhere; every other metric is a token-weighted mean."""
    total = sum(n for _, n in parts) or 1
    out = {}
    for key in parts[0][0]:
        values = [m[key] for m, _ in parts]
        if key in ("loss", "pg_loss", "kl_loss"):
            out[key] = sum(values)
        elif key in ("ratio/min", "on_policy"):
            out[key] = min(values)
        elif key == "ratio/max":
            out[key] = max(values)
        else:
            out[key] = sum(v * n for v, (_, n) in zip(values, parts)) / total
    return out


def pearson(x: list[float], y: list[float]) -> float:
    pairs = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 3:
        return float("nan")
    xs, ys = torch.tensor(pairs, dtype=torch.float64).T
    return torch.corrcoef(torch.stack([xs, ys]))[0, 1].item()


@torch.no_grad()
def entropy_check(run, batch: dict, stats: dict) -> tuple[float, float, float]:
    """Predicted vs measured entropy change of this step's updates, at the same completion positions
    (tepo.entropy_change_prediction: -Cov_p(log p, z_after - z_before) against H_after - H_before).
    Returns (predicted mean, measured mean, correlation across the positions).

    The prediction is first order: it is near exact where an update moves the logits a little and
    fails where it moves them by O(1). Measured on the default settings with the clean corpus
    (--sft-noise 0; seed 1, 8 steps, 15.6k positions): r = 0.997 on the 90% of positions with the
    smallest |dz|, r = 0.94 on all; 95% of the prediction error sits in the other 10%, and the top
    1% (|dz| > 2.2) carry 29% of the measured change. With the default misreading corpus, over 200
    steps of each objective (notebooks/logs): median per-step position correlation 0.97-0.99,
    correlation of the per-step MEANS 0.65-0.93.
    """
    check = stats["check"]
    if check.before is None:
        return float("nan"), float("nan"), float("nan")
    after = torch.empty_like(check.before)                                          # [n, V]
    for rows in torch.arange(check.rows).split(rows_per_forward(run.args)):
        check.copy_into(after, rows, completion_logits(run.model, batch, rows, run.args))
    predicted, measured = tepo.entropy_change_prediction(check.before, after, run.args.temperature,
                                                         positions_per_chunk(after.shape[-1]))
    return predicted.mean().item(), measured.mean().item(), pearson(predicted.tolist(), measured.tolist())


# =====================================================================================================
# 7. Evaluation, checkpoints, logs
# =====================================================================================================

@torch.no_grad()
def evaluate(model, tokenizer, test, args: Args, device) -> dict:
    """Held-out accuracy with greedy decoding (strict and lenient), and pass@k for k = 1, 2, 4, ... up
    to K = --pass-k from the same K samples per problem (unbiased estimator, pass_at_k).
    Generation goes one rollout's worth of rows at a time, so evaluation never needs more memory
    (KV cache) than a training step's rollout."""
    rollout_rows = args.prompts_per_step * args.group_size
    greedy = [score_completions(decode(tokenizer, generate_group(model, tokenizer, list(rows["question"]), 1, args,
                                                                 device, greedy=True)),
                                [gold_answer(a) for a in rows["answer"]])
              for rows in dataset_chunks(test, len(test), rollout_rows)]
    sampled = [score_completions(decode(tokenizer, generate_group(model, tokenizer, list(rows["question"]),
                                                                  args.pass_k, args, device)),
                                 [gold_answer(a) for a in rows["answer"] for _ in range(args.pass_k)])[0]
               for rows in dataset_chunks(test, args.pass_k_problems, max(1, rollout_rows // args.pass_k))]
    right = torch.cat(sampled).view(-1, args.pass_k)                                # [problems, K]
    n_right = right.sum(1).long().tolist()                                          # c of each problem
    return {"eval/accuracy": torch.cat([s for s, _ in greedy]).mean().item(),
            "eval/accuracy_lenient": torch.cat([l for _, l in greedy]).mean().item(),
            **{f"eval/pass@{k}": sum(pass_at_k(args.pass_k, c, k) for c in n_right) / len(n_right)
               for k in pass_k_values(args.pass_k)},
            f"eval/mean@{args.pass_k}": right.mean().item()}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem from n samples of which c are right (Chen et al. 2021,
    arXiv 2107.03374, eq. 1): 1 - C(n-c, k) / C(n, k), the chance that k samples drawn without
    replacement from the n include a right one. Averaging it over problems has less variance than
    drawing only k samples each; k = n gives "any of the n is right", k = 1 gives c / n (= mean@n)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_k_values(k_max: int) -> list[int]:
    """The k of the logged pass@k: every power of two up to k_max, and k_max itself."""
    return sorted({2 ** i for i in range(k_max.bit_length())} | {k_max})


def dataset_chunks(data, n: int, size: int):
    """The first n records of a dataset, `size` at a time."""
    n = min(n, len(data))
    return [data.select(range(start, min(n, start + size))) for start in range(0, n, size)]


def decode(tokenizer, batch: dict) -> list[str]:
    """Completion texts, with everything after the end token removed."""
    ids = torch.where(batch["completion_mask"].bool(), batch["completion_ids"], tokenizer.pad_token_id)
    return tokenizer.batch_decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_atomically(path: str, write) -> None:
    """write(f) into a temp file next to `path`, then os.replace it: a reader, a crash or a kill -9
    finds the old file or the new one, never half of one. Temp files of writes killed before (named
    .<name>-*) are removed first."""
    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    for stale in os.listdir(folder):
        if stale.startswith(f".{name}-"):
            os.remove(os.path.join(folder, stale))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:          # an exception or Ctrl-C: no temp file left behind
        os.remove(tmp)
        raise


def save_checkpoint(run_dir: str, model, optimizer, step: int) -> None:
    """model, optimizer, RNG states and step, in checkpoint.pt, written atomically (write_atomically).
    For the kill tests only: TEPO_TEST_CHECKPOINT_SLEEP=<seconds> sleeps after writing the temp file
    and before replacing checkpoint.pt, so that a test can kill the process in the middle of a write."""
    def write(f):
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state(),
                    "step": step}, f)
        time.sleep(float(os.environ.get("TEPO_TEST_CHECKPOINT_SLEEP", 0)))
    write_atomically(os.path.join(run_dir, "checkpoint.pt"), write)


def append_row(path: str, row: dict) -> None:
    """One JSON row at the end of a .jsonl log, flushed: an interrupted run keeps every finished step."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def read_log(path: str) -> list[dict]:
    """The rows of a .jsonl log (none if it does not exist yet). A last line without its newline is a
    row whose write was cut off (kill -9): it is left out. Any other bad line is reported in one line."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]        # the piece after the last newline is "" or a cut-off row
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            fail(f"{path}, line {number}: not a JSON row ({e.msg}, column {e.colno}); the log is damaged")
    return rows


def truncate_log(path: str, first_step: int) -> None:
    """On resume: keep a log's whole rows from before the checkpoint's next step (step < first_step),
    dropping later rows and a cut-off last line; rewritten atomically, so a resumed log never holds a
    half-written line or a step twice."""
    rows = [r for r in read_log(path) if r["step"] < first_step]
    write_atomically(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in rows).encode()))


def reset_peak_memory(device) -> None:
    """Start a run's peak-memory count afresh (--compare runs several in one process). On Linux,
    writing 5 to /proc/self/clear_refs resets the process's peak resident memory (VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_memory_mb(device) -> float:
    """Peak allocated CUDA memory, or the peak resident memory of the process on the CPU (since the
    last reset_peak_memory), in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return process_memory_mb("VmHWM")


def process_memory_mb(field: str = "VmRSS") -> float:
    """VmRSS (now) or VmHWM (peak) of this process from /proc/self/status, in MiB (getrusage elsewhere)."""
    if os.path.exists("/proc/self/status"):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024                 # kB
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, KiB on Linux


def run_name(args: Args) -> str:
    task = "arith" if args.dataset is None else os.path.basename(args.dataset.rstrip("/")).replace(".jsonl", "")
    return f"{task}__{args.objective}__{args.seed}__{time.strftime('%Y%m%d-%H%M%S')}"


# =====================================================================================================
# 8. Memory: the plan printed before a run
# =====================================================================================================
# An estimate, by part, of the peak memory of a run, made from the model's config before any weight
# is loaded. The parts that do not depend on the rollout size are the model's: weights, gradients
# and Adam's two moments in float32 (16 bytes per parameter), and a float32 reference model when the
# objective needs one. The rest is per forward pass (--micro-batch-size rows): the activations kept
# for the backward, and the logits [b, T, V], which dominate with a large vocabulary (151,936 for
# Qwen2.5: 0.6 MB per position in float32). Generation's KV cache grows with the rollout. On the CPU
# the plan counts what the run adds to the process, not the ~0.5 GB that torch and transformers take.

def model_config_for_plan(args: Args, task):
    """The config of the model the run will train (built-in: made here, nothing is trained yet)."""
    from transformers import AutoConfig
    if args.model is None:
        return tiny_model_config(args, builtin_tokenizer(task if task is not None else load_task(args)))
    offline_reason = None if os.path.exists(args.model) else use_offline_hub_if_unreachable()
    try:
        return AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 -- any loading failure is a user-facing one-liner
        cannot_load("the config of model", args.model, e, offline_reason,
                    "give a local model directory, or run without --model for the built-in tiny model")


def memory_plan(args: Args, config, needs_ref: bool) -> dict:
    """Estimated bytes by part, and the peak: the model's parts plus the larger of the two phases
    (generation, update), which never overlap."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):                            # shapes only: no memory, no weights
        meta_model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in meta_model.parameters())
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    kv_dim = getattr(config, "num_key_value_heads", None) or heads
    kv_dim = kv_dim * H // heads
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * H
    b = rows_per_forward(args)                            # rows per forward and backward
    rollout = args.prompts_per_step * args.group_size     # rows generated at once (evaluation too)
    S = args.max_prompt_tokens + args.max_new_tokens      # longest sequence
    T = args.max_new_tokens
    act = 2 if args.precision == "bf16" else 4            # bytes of an activation or a logit
    # Per token and layer, what a transformer layer keeps for its backward: norms, q/k/v, the
    # attention output and its weights, the residuals and the MLP's hidden layers.
    per_layer_token = (7 * H + 2 * kv_dim + heads * S + 4 * inner) * act
    layer_inputs = L * b * S * H * 4                      # what gradient checkpointing keeps
    one_layer = b * S * per_layer_token
    logits = b * (T + 1) * V * act                        # one forward's logits [b, T + 1, V]
    chunk = min(LOGITS_CHUNK_BYTES, b * (T + 1) * V * 4)  # one chunk of float32 softmax temporaries
    check = min(args.entropy_check_rows * T, ENTROPY_CHECK_MAX_POSITIONS) * V * act
    plan = {
        "weights (fp32)": 4 * n_params,
        "gradients (fp32)": 4 * n_params,
        "Adam moments (fp32)": 8 * n_params,
        "reference model (fp32)": 4 * n_params if needs_ref else 0,
        "activations, one micro-batch": layer_inputs + one_layer if args.gradient_checkpointing else L * one_layer,
        # the logits, their gradient, the gradient of the slice [:, :-1] taken of them, and
        # softmax temporaries chunk by chunk
        "logits, one micro-batch": 3 * logits + 4 * chunk,
        "entropy check (logits before)": check,
        "generation KV cache": 2 * L * rollout * S * kv_dim * act,
        "generation logits": rollout * V * 4 * 3 + sampling_check_bytes(args, V),
    }
    # The update's peak: its micro-batch (activations and logits) while the entropy check's "before"
    # logits wait; or the entropy check itself: before and after, one forward's logits, temporaries.
    update = max(plan["activations, one micro-batch"] + plan["logits, one micro-batch"] + check,
                 2 * check + logits + 6 * chunk)
    generation = plan["generation KV cache"] + plan["generation logits"]
    model = sum(plan[k] for k in ("weights (fp32)", "gradients (fp32)", "Adam moments (fp32)",
                                  "reference model (fp32)"))
    return {"parts": plan, "n_params": n_params, "peak": model + max(update, generation),
            "phase": "update" if update >= generation else "generation",
            "supports_gradient_checkpointing": meta_model.supports_gradient_checkpointing}


def device_memory(device) -> int:
    """Bytes the run may use: the GPU's total memory, or the memory the CPU machine has available."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    for line in open("/proc/meminfo") if os.path.exists("/proc/meminfo") else []:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def print_memory_plan(plan: dict, capacity: int, device) -> None:
    gib = 2**30
    print(f"memory plan (estimate; {plan['n_params'] / 1e6:.1f}M parameters):")
    for part, nbytes in plan["parts"].items():
        print(f"  {part:<32} {nbytes / gib:8.2f} GiB")
    print(f"  {'estimated peak (' + plan['phase'] + ')':<32} {plan['peak'] / gib:8.2f} GiB of {capacity / gib:.1f} GiB "
          f"{'on the GPU' if device.type == 'cuda' else 'available on this machine'}", flush=True)


def check_memory(args: Args, task, device, needs_ref: bool) -> dict:
    """Print the plan; refuse, in one line, a run that would not fit (unless --force)."""
    plan = memory_plan(args, model_config_for_plan(args, task), needs_ref)
    if args.gradient_checkpointing and not plan["supports_gradient_checkpointing"]:
        fail(f"argument --gradient-checkpointing: model {args.model!r} does not support gradient checkpointing; "
             f"run without --gradient-checkpointing")
    capacity = device_memory(device)
    print_memory_plan(plan, capacity, device)
    if plan["peak"] > capacity and not args.force and not args.dry_run:
        fail(f"the estimated peak memory {plan['peak'] / 2**30:.1f} GiB exceeds the {capacity / 2**30:.1f} GiB "
             f"of the device; lower --micro-batch-size, --max-new-tokens or --prompts-per-step, add "
             f"--gradient-checkpointing or --precision bf16, or pass --force to try anyway")
    return plan


# =====================================================================================================
# 9. The run: start or resume it, the loop, the summary
# =====================================================================================================

@dataclass
class Run:
    """What one RL run holds from step to step."""
    args: Args
    cfg: tepo.ObjectiveConfig
    objective: object                   # tepo.OBJECTIVES[args.objective]
    device: torch.device
    run_dir: str
    model: object
    ref_model: object                   # None unless the objective needs one (tepo.needs_ref)
    tokenizer: object
    optimizer: torch.optim.Optimizer
    train_set: object
    test_set: object
    first_step: int                     # 1, or the step after the checkpoint when resuming
    details_path: str | None            # details.jsonl, TEPO only


def train(args: Args, obj_overrides: dict) -> dict:
    """One RL run: start (or resume) it, then step, evaluate, log and checkpoint; the summary at the end."""
    from tqdm.auto import tqdm
    t_start = time.time()
    run = start_run(args, obj_overrides)
    args = run.args
    last_step = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    bar = tqdm(range(run.first_step, last_step + 1), desc=f"{args.objective} seed {args.seed}", dynamic_ncols=True)
    interrupted, restore_ctrl_c = ctrl_c_finishes_the_step(run.run_dir)
    for step in bar:
        t0 = time.time()
        row, details_row = rl_step(run, step)
        if step % args.eval_every == 0:
            row.update(evaluate(run.model, run.tokenizer, run.test_set, args, run.device))
        elif step == args.steps:   # the final evaluation, off the schedule, leaves the RNG as it found it,
            with torch.random.fork_rng():   # so a run extended later (--resume --steps) equals an uninterrupted one
                row.update(evaluate(run.model, run.tokenizer, run.test_set, args, run.device))
        row.update({"timing/eval": time.time() - t0 - row["step_time"], "step_time": time.time() - t0,
                    "perf/peak_memory_mb": peak_memory_mb(run.device)})
        append_row(os.path.join(run.run_dir, "metrics.jsonl"), row)
        if details_row is not None:
            append_row(run.details_path, details_row)
        bar.set_postfix({"reward": f"{row['reward']:.2f}", "H": f"{row['entropy']:.3f}",
                         **({"eval": f"{row['eval/accuracy']:.3f}"} if "eval/accuracy" in row else {})})
        if step % args.save_every == 0 or step == last_step or interrupted():
            save_checkpoint(run.run_dir, run.model, run.optimizer, step)
        if interrupted():
            restore_ctrl_c()
            bar.close()
            print(f"interrupted at step {step}; resume with: python train_small.py --resume {run.run_dir}",
                  file=sys.stderr)
            raise SystemExit(130)
    restore_ctrl_c()
    if last_step < args.steps:     # interrupted on purpose (--stop-after): no summary yet
        return {"run_dir": run.run_dir, "stopped_at": last_step}
    save_pretrained_atomically(run.model.cpu(), run.tokenizer, os.path.join(run.run_dir, "policy"))
    run.model.to(run.device)
    return write_summary(run.run_dir, read_log(os.path.join(run.run_dir, "metrics.jsonl")), args, time.time() - t_start)


def resumed_args(args: Args, obj_overrides: dict) -> tuple[Args, dict]:
    """With --resume: the saved settings, with run-only fields and --steps from args (parse_args has
    already refused flags that would change the run; compare_objectives() resumes its runs without flags)."""
    if not args.resume:
        return args, obj_overrides
    saved, checkpoint_step = check_resumable(args.resume)
    return resume_args(args, obj_overrides, {"steps"}, saved, checkpoint_step)


def pick_device(args: Args) -> torch.device:
    return torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                        else "cpu")


def dry_run(args: Args, obj_overrides: dict) -> None:
    """--dry-run: print the memory plan; nothing is trained, loaded or written (with --model, only its
    config is read, and the data set is not needed)."""
    args, obj_overrides = resumed_args(args, obj_overrides)
    cfg = objective_config(args, obj_overrides)
    check_memory(args, None, pick_device(args), tepo.needs_ref(args.objective, cfg))


def start_run(args: Args, obj_overrides: dict) -> Run:
    """Load the task and the models, then either resume from the run directory's checkpoint or start
    afresh: config.json, empty logs, the starting model's evaluation (step 0) and checkpoint 0."""
    torch.set_num_threads(args.threads)
    resume_dir = args.resume
    args, obj_overrides = resumed_args(args, obj_overrides)
    device = pick_device(args)
    cfg = objective_config(args, obj_overrides)
    seed_everything(args.seed)
    task = load_task(args)
    check_memory(args, task, device, tepo.needs_ref(args.objective, cfg))
    run_dir = args.out or os.path.join("runs", run_name(args))
    print(f"run directory: {run_dir}", flush=True)    # created once everything has loaded
    reset_peak_memory(device)
    memory_before_model = process_memory_mb()
    start_model = prepare_start_model(args, task, device)
    model, tokenizer = load_policy(start_model, args, device)
    ref_model = None
    if tepo.needs_ref(args.objective, cfg):
        ref_model = load_policy(start_model, args, device)[0].requires_grad_(False)
    run = Run(args=args, cfg=cfg, objective=tepo.OBJECTIVES[args.objective], device=device, run_dir=run_dir,
              model=model, ref_model=ref_model, tokenizer=tokenizer,
              optimizer=torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999)),
              train_set=task["train"], test_set=task["test"].select(range(min(args.n_test, len(task["test"])))),
              first_step=1, details_path=os.path.join(run_dir, "details.jsonl") if args.objective == "tepo" else None)
    logs = [p for p in (os.path.join(run_dir, "metrics.jsonl"), run.details_path) if p is not None]
    seed_everything(args.seed)
    if resume_dir:
        ckpt = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)
        model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
        set_rng_state(ckpt["rng"])
        run.first_step = ckpt["step"] + 1
        for path in logs:
            truncate_log(path, run.first_step)
    else:
        os.makedirs(run_dir, exist_ok=True)
        config = {"args": dataclasses.asdict(args), "objective_overrides": obj_overrides,
                  "objective_config": dataclasses.asdict(cfg),
                  "start_model": start_model, "needs_ref": ref_model is not None}
        write_atomically(os.path.join(run_dir, "config.json"), lambda f: f.write(json.dumps(config, indent=2).encode()))
        for path in logs:
            open(path, "w").close()
        append_row(logs[0], {"step": 0, **evaluate(model, tokenizer, run.test_set, args, device),
                             "memory/process_before_model_mb": memory_before_model})
        save_checkpoint(run_dir, model, run.optimizer, 0)
    return run


def rl_step(run: Run, step: int) -> tuple[dict, dict | None]:
    """One RL step, the seven steps of the module docstring. Returns its metrics row (and details row)."""
    args, t0 = run.args, time.time()
    records = run.train_set.select(prompts_for_step(step, len(run.train_set), args))            # 1. prompts
    batch = generate_group(run.model, run.tokenizer, list(records["question"]), args.group_size, args,   # 2. samples
                           run.device, want_logprobs=sampling_check_bytes(args, run.model.config.vocab_size) > 0)
    t1 = time.time()
    golds = [gold_answer(a) for a in records["answer"] for _ in range(args.group_size)]
    scored = compute_rewards(batch, decode(run.tokenizer, batch), golds, args, run.cfg)         # 3. rewards
    adv, keep = compute_advantages(scored["rewards"], args, run.cfg)                            # 4. advantages
    t2 = time.time()
    for group in run.optimizer.param_groups:   # linear learning-rate warm-up
        group["lr"] = args.lr * min(1.0, step / max(1, args.lr_warmup_steps))
    plan = minibatch_plan(keep, args)                  # the rows of each optimizer step (none: all dropped)
    checked = bool(plan) and step % args.entropy_check_every == 0
    stats = rollout_statistics(run, batch, adv, plan, checked)                                  # 5. old log-probs
    t3 = time.time()
    details = KLMaskDetails(run.cfg, batch["completion_ids"].shape[1], run.device) if run.details_path else None
    losses = update_policy(run, batch, stats, adv, plan, details) if plan else {}               # 6. update
    t4 = time.time()
    check = entropy_check(run, batch, stats) if checked else (0.0, 0.0, float("nan"))           # 7. measure
    t5 = time.time()
    row = {"step": step, **rollout_metrics(batch, scored, keep, stats, args), **losses,
           **({"entropy_change/predicted": check[0], "entropy_change/measured": check[1],
               "entropy_change/position_corr": check[2]} if checked or not plan else {}),
           "timing/generate": t1 - t0, "timing/reward": t2 - t1, "timing/old_logprobs": t3 - t2,
           "timing/update": t4 - t3, "timing/entropy_check": t5 - t4, "step_time": t5 - t0,
           "perf/tokens_per_second": batch["completion_mask"].sum().item() / (t5 - t0)}
    return row, details.row(step, batch, scored["rewards"], run.tokenizer) if details else None


def rollout_metrics(batch: dict, scored: dict, keep: torch.Tensor, stats: dict, args: Args) -> dict:
    """What the rollout looked like: rewards, accuracy, lengths, entropy, covariance, precision."""
    mask, rewards = batch["completion_mask"], scored["rewards"]
    row = {"reward": rewards.mean().item(), "reward_std": rewards.std().item(),
           "accuracy/strict": scored["strict"].mean().item(), "accuracy/lenient": scored["lenient"].mean().item(),
           "frac_reward_zero_std": 1 - tepo.dynamic_sampling_mask(rewards, args.group_size).float().mean().item(),
           "dynamic_sampling/kept_frac": keep.float().mean().item(),
           "dynamic_sampling/skipped": float(not keep.any()),
           "completions/mean_length": mask.sum(1).float().mean().item(),
           "completions/clipped_ratio": batch["truncated"].float().mean().item(),
           "entropy": stats["entropy_mean"], "cov/logp_adv": stats["cov"],
           **{k: v for k, v in stats.items() if k.startswith("precision/")}}
    if "sampling_logp" in batch:
        gap = (batch["sampling_logp"] - stats["old_logp"]).abs()
        row["logprobs/sampling_vs_recomputed_max_abs"] = gap[mask.bool()].max().item()
    return row


def write_summary(run_dir: str, rows: list[dict], args: Args, wall: float) -> dict:
    """summary.json: start and final held-out accuracy, its area under the curve, final pass@k,
    entropy-change correlation, wall time."""
    evals = [r for r in rows if "eval/accuracy" in r]
    # Steps that made an update (DAPO's filter can skip one: no update, no entropy change to predict).
    steps = [r for r in rows
             if r["step"] > 0 and "entropy_change/predicted" in r and not r.get("dynamic_sampling/skipped")]
    reached = [r["step"] for r in evals if r["eval/accuracy"] >= args.target_accuracy]
    position_corrs = sorted(c for r in steps if math.isfinite(c := r.get("entropy_change/position_corr", math.nan)))
    summary = {
        "run_dir": run_dir, "objective": args.objective, "seed": args.seed,
        "start_accuracy": evals[0]["eval/accuracy"], "final_accuracy": evals[-1]["eval/accuracy"],
        "gain_points": 100 * (evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"]),
        "accuracy_auc": accuracy_auc([r["step"] for r in evals], [r["eval/accuracy"] for r in evals]),
        "final_accuracy_lenient": evals[-1]["eval/accuracy_lenient"],
        **{"final_" + k[len("eval/"):]: v for k, v in evals[-1].items() if k.startswith("eval/pass@")},
        "start_sampled_accuracy": evals[0][f"eval/mean@{args.pass_k}"],
        "final_sampled_accuracy": evals[-1][f"eval/mean@{args.pass_k}"],
        "steps_to_target": reached[0] if reached else None, "target_accuracy": args.target_accuracy,
        "final_entropy": steps[-1]["entropy"] if steps else None,
        "entropy_change_correlation": pearson([r["entropy_change/predicted"] for r in steps],
                                              [r["entropy_change/measured"] for r in steps]),
        "entropy_change_position_corr_median": position_corrs[len(position_corrs) // 2] if position_corrs else None,
        "wall_seconds": wall,
    }
    json.dump(summary, open(os.path.join(run_dir, "summary.json"), "w"), indent=2)
    print(f"held-out accuracy {summary['start_accuracy']:.3f} -> {summary['final_accuracy']:.3f} "
          f"({summary['gain_points']:+.1f} points, {summary['accuracy_auc']:.3f} averaged over the run); "
          f"sampled (T={args.temperature}) {summary['start_sampled_accuracy']:.3f} -> "
          f"{summary['final_sampled_accuracy']:.3f}, pass@{args.pass_k} {summary[f'final_pass@{args.pass_k}']:.3f}; "
          f"entropy change predicted vs measured: r = {summary['entropy_change_correlation']:.3f}; {wall:.0f} s; "
          f"{run_dir}")
    return summary


def accuracy_auc(steps: list[int], accuracy: list[float]) -> float:
    """Area under the held-out accuracy curve divided by the run's length: the mean height of the curve
    that joins the evaluation points with straight lines (trapezoid rule, step 0 to the last step).
    It averages the noise of several evaluations, where the final accuracy has only one's."""
    if len(steps) == 1:
        return accuracy[0]
    area = sum((s1 - s0) * (a0 + a1) / 2 for s0, s1, a0, a1 in zip(steps, steps[1:], accuracy, accuracy[1:]))
    return area / (steps[-1] - steps[0])


# =====================================================================================================
# Modes: --compare and --bench
# =====================================================================================================

def compare_objectives(args: Args, obj_overrides: dict) -> None:
    """Several objectives x seeds on the same task, sequentially in-process. Writes <out>/summary.md
    and summary.json: per objective the mean and std over seeds, and, paired by seed, each objective
    minus --baseline with a 95% interval (paired_differences)."""
    out = args.out or os.path.join("runs", f"compare__{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    seeds = list(range(args.seed, args.seed + args.seeds))
    results = {}
    for seed in seeds:      # seed-major: early results cover every objective
        for name, (objective, overrides) in zip(args.compare.split(","), compare_entries(args)):
            run_dir = os.path.join(out, f"{name.replace(':', '_')}__{seed}")     # tepo:beta=0 -> tepo_beta=0__1
            run = dataclasses.replace(args, objective=objective, seed=seed, compare=None, out=run_dir)
            # Rerunning the same --compare command (same --out) goes on where it stopped: finished runs
            # are read back, an interrupted one resumes from its checkpoint. So a long comparison can
            # be split across processes (one --compare per subset) and then assembled by a last call.
            if os.path.exists(os.path.join(run_dir, "summary.json")):   # summarised again from its log
                wall = json.load(open(os.path.join(run_dir, "summary.json")))["wall_seconds"]
                summary = write_summary(run_dir, read_log(os.path.join(run_dir, "metrics.jsonl")), run, wall)
            elif os.path.exists(os.path.join(run_dir, "checkpoint.pt")):
                summary = train(dataclasses.replace(run, resume=run_dir), {**obj_overrides, **overrides})
            else:
                summary = train(run, {**obj_overrides, **overrides})
            results.setdefault(name, []).append(summary)
    table, paired = objective_means(results, args), paired_differences(results, args)
    json.dump({"seeds": seeds, "baseline": args.baseline, "target_accuracy": args.target_accuracy,
               "objectives": table, "paired": paired}, open(os.path.join(out, "summary.json"), "w"), indent=2)
    lines = [*objective_table(table, args), "", *paired_table(paired, args, seeds)]
    open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


def objective_means(results: dict, args: Args) -> dict:
    """Per objective: mean and std over seeds of the main results, and every run's summary."""
    table = {}
    for name, runs in results.items():
        columns = {key: [r[key] for r in runs] for key in ("final_accuracy", "gain_points", "accuracy_auc",
                                                            f"final_pass@{args.pass_k}")}
        columns["sampled_gain_points"] = [100 * (r["final_sampled_accuracy"] - r["start_sampled_accuracy"])
                                          for r in runs]
        table[name] = {}
        for key, values in columns.items():
            stats = t_interval(values)
            table[name] |= {key + "_mean": stats["mean"], key + "_std": stats["std"] or 0.0}   # std 0: 1 seed
        table[name] |= {"steps_to_target": [r["steps_to_target"] for r in runs],
                        "final_entropy_mean": sum(r["final_entropy"] for r in runs) / len(runs),
                        "entropy_change_correlation_mean":
                            sum(r["entropy_change_correlation"] for r in runs) / len(runs),
                        "wall_seconds_mean": sum(r["wall_seconds"] for r in runs) / len(runs), "runs": runs}
    return table


def objective_table(table: dict, args: Args) -> list[str]:
    """The markdown lines of the per-objective table of summary.md."""
    k = args.pass_k
    lines = [f"| objective | final held-out acc (mean ± std, {args.seeds} seeds) | gain (points) | "
             f"acc. averaged over the run | final pass@{k} | steps to {args.target_accuracy:.2f} | "
             f"sampled-accuracy gain (points) | final entropy | r(pred, meas) | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in table.items():
        lines.append(f"| {name} | {t['final_accuracy_mean']:.3f} ± {t['final_accuracy_std']:.3f} | "
                     f"{t['gain_points_mean']:+.1f} ± {t['gain_points_std']:.1f} | "
                     f"{t['accuracy_auc_mean']:.3f} ± {t['accuracy_auc_std']:.3f} | "
                     f"{t[f'final_pass@{k}_mean']:.3f} ± {t[f'final_pass@{k}_std']:.3f} | {t['steps_to_target']} | "
                     f"{t['sampled_gain_points_mean']:+.1f} ± {t['sampled_gain_points_std']:.1f} | "
                     f"{t['final_entropy_mean']:.3f} | {t['entropy_change_correlation_mean']:.2f} | "
                     f"{t['wall_seconds_mean']:.0f} |")
    return lines


def paired_metrics(pass_k: int) -> list[tuple]:
    """What --compare pairs by seed: (key of a run's summary.json, label, factor to the unit shown, format).
    Accuracies and their gains in points (x 100)."""
    return [("gain_points", "final held-out accuracy gain (points)", 1, "+.1f"),
            ("accuracy_auc", "held-out accuracy averaged over the run (points)", 100, "+.1f"),
            ("final_sampled_accuracy", "final sampled accuracy = pass@1 (points)", 100, "+.1f"),
            (f"final_pass@{pass_k}", f"final pass@{pass_k} (points)", 100, "+.1f"),
            ("steps_to_target", "steps to target accuracy", 1, "+.0f"),
            ("final_entropy", "final entropy (nats)", 1, "+.3f")]


def paired_differences(results: dict, args: Args) -> dict:
    """For each objective other than --baseline: per seed, objective minus baseline on the same seed
    (same task, warm-up model, prompt order and start evaluation, so what the seeds share cancels),
    then the mean with a 95% interval over seeds (t_interval). Steps to target: only seeds where
    both runs reached the target count. Empty when the baseline was not compared."""
    if args.baseline not in results:
        return {}
    base = results[args.baseline]
    paired = {}
    for name, runs in results.items():
        if name == args.baseline:
            continue
        paired[name] = {}
        for key, label, factor, _ in paired_metrics(args.pass_k):
            per_seed = [None if r[key] is None or b[key] is None else factor * (r[key] - b[key])
                        for r, b in zip(runs, base)]
            paired[name][key] = {"label": label, "per_seed": per_seed,
                                 **t_interval([d for d in per_seed if d is not None])}
    return paired


def paired_table(paired: dict, args: Args, seeds: list[int]) -> list[str]:
    """The markdown lines of the paired block of summary.md."""
    if not paired:
        return [f"No paired differences: the baseline {args.baseline!r} (--baseline) is not among the compared "
                f"objectives."]
    lines = [f"Paired by seed against {args.baseline} (objective minus {args.baseline} on the same seed), "
             f"mean and 95% interval (t over seeds: mean ± t(0.975, n-1) · std / sqrt(n)):", "",
             f"| objective − {args.baseline} | metric | per seed ({', '.join(map(str, seeds))}) | mean | "
             f"95% interval | seeds |", "|---|---|---|---|---|---|"]
    for name, metrics in paired.items():
        for key, label, _, fmt in paired_metrics(args.pass_k):
            m = metrics[key]
            per_seed = ", ".join("not reached" if d is None else format(d, fmt) for d in m["per_seed"])
            mean = "-" if m["mean"] is None else format(m["mean"], fmt)
            interval = (f"{m['low']:{fmt}} to {m['high']:{fmt}}" if m["low"] is not None
                        else f"none ({m['n']} seed{'s' * (m['n'] != 1)})")
            lines.append(f"| {name} | {label} | {per_seed} | {mean} | {interval} | {m['n']} |")
    return lines


def t_interval(values: list[float]) -> dict:
    """Mean of n values and its 95% interval, mean ± t(0.975, n-1) · std / sqrt(n), std with n-1
    (Student's t: the values are treated as independent draws, here one per seed). With fewer than
    two values there is no interval (low = high = None)."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "half_width": None, "low": None, "high": None}
    mean = sum(values) / n
    if n == 1:
        return {"n": 1, "mean": mean, "std": None, "half_width": None, "low": None, "high": None}
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "half_width": half, "low": mean - half, "high": mean + half}


def t_quantile_975(dof: int) -> float:
    """The 97.5% quantile of Student's t with `dof` degrees of freedom (12.706 for 1, 4.303 for 2,
    2.776 for 4, -> 1.960), by bisection on the exact distribution function student_t_central."""
    low, high = 0.0, 1.0
    while student_t_central(high, dof) < 0.95:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if student_t_central(mid, dof) < 0.95 else (low, mid)
    return (low + high) / 2


def student_t_central(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with an integer number of degrees of freedom, in closed form
    (Abramowitz & Stegun 26.7.3 for odd dof, 26.7.4 for even), with theta = atan(t / sqrt(dof)):
    odd:  2/pi (theta + sin theta (cos theta + 2/3 cos^3 theta + ... + 2*4..(dof-3) / 1*3..(dof-2) cos^(dof-2) theta))
    even: sin theta (1 + 1/2 cos^2 theta + ... + 1*3..(dof-3) / 2*4..(dof-2) cos^(dof-2) theta)."""
    theta = math.atan(t / math.sqrt(dof))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    series = 0.0
    if dof % 2 == 1:
        term = math.cos(theta)
        for j in range((dof - 1) // 2):
            series += term
            term *= (2 * j + 2) / (2 * j + 3) * cos2
        return 2 / math.pi * (theta + sin * series)
    term = 1.0
    for j in range(dof // 2):
        series += term
        term *= (2 * j + 1) / (2 * j + 2) * cos2
    return sin * series


def benchmark(args: Args, obj_overrides: dict) -> None:
    """Per-phase seconds, tokens/s and peak memory of our RL step, and of TRL's GRPOTrainer on the
    same model directory, batch, group size and lengths (two mini-batches per rollout for both)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        fail("--bench compares with TRL's GRPOTrainer, and trl is not installed; install it with: "
             "pip install -r requirements.txt")
    torch.set_num_threads(args.threads)
    out = args.out or os.path.join("runs", f"bench__{time.strftime('%Y%m%d-%H%M%S')}")
    n = args.bench_steps
    run = dataclasses.replace(args, bench=False, out=os.path.join(out, "ours"), steps=n + 1, eval_every=10**9,
                              save_every=10**9, pass_k=1, pass_k_problems=1, check_sampling_logprobs=False)
    train(run, obj_overrides)
    rows = read_log(os.path.join(out, "ours", "metrics.jsonl"))[2:]   # skip step 0 and step 1
    phases = ("timing/generate", "timing/reward", "timing/old_logprobs", "timing/update", "timing/entropy_check",
              "step_time", "perf/tokens_per_second")
    ours = {k: sum(r[k] for r in rows) / len(rows) for k in phases}
    ours["step_time"] -= sum(r["timing/eval"] for r in rows) / len(rows)
    ours["peak_memory_mb"] = max(r["perf/peak_memory_mb"] for r in rows)
    print(f"ours ({args.objective}): " + ", ".join(f"{k} {v:.3f}" for k, v in ours.items()))
    result = {"ours": ours, "setup": {"prompts": args.prompts_per_step, "group_size": args.group_size,
                                      "max_new_tokens": args.max_new_tokens, "mini_batches": args.mini_batches,
                                      "threads": args.threads, "steps_timed": n}}
    result["trl"] = bench_trl(args, out, n)
    print("trl GRPOTrainer: " + ", ".join(f"{k} {v:.3f}" for k, v in result["trl"].items()))
    result["speedup"] = result["trl"]["step_time"] / ours["step_time"]
    print(f"our step is {result['speedup']:.2f}x the speed of TRL's")
    json.dump(result, open(os.path.join(out, "bench.json"), "w"), indent=2)


def bench_trl(args: Args, out: str, n: int) -> dict:
    """TRL's GRPOTrainer, one rollout = `mini_batches` optimizer steps, timed per rollout."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    task = load_task(args)
    start_model = prepare_start_model(args, task, pick_device(args))
    golds = {format_prompt(q): gold_answer(a) for q, a in zip(task["train"]["question"], task["train"]["answer"])}

    def reward_fn(prompts, completions, **kw):
        return [float(parse_strict(c) == golds.get(p)) for p, c in zip(prompts, completions)]

    class Clock(TrainerCallback):
        times = []

        def on_step_end(self, *a, **k):
            self.times.append(time.time())

    rollout = args.prompts_per_step * args.group_size
    config = GRPOConfig(output_dir=os.path.join(out, "trl"), per_device_train_batch_size=rollout // args.mini_batches,
                        steps_per_generation=args.mini_batches, num_generations=args.group_size,
                        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_k=0, top_p=1.0,
                        learning_rate=args.lr, beta=0.0, loss_type="dapo", max_steps=(n + 1) * args.mini_batches,
                        gradient_checkpointing=args.gradient_checkpointing, use_cpu=pick_device(args).type == "cpu",
                        bf16=args.precision == "bf16", report_to="none", save_strategy="no",   # as tepo's run
                        logging_steps=1, seed=args.seed, dataloader_num_workers=0, disable_tqdm=True)
    prompts = datasets.Dataset.from_dict({"prompt": [format_prompt(q) for q in list(task["train"]["question"])]})
    clock = Clock()
    trainer = GRPOTrainer(model=start_model, reward_funcs=reward_fn, args=config, train_dataset=prompts,
                          callbacks=[clock])
    t0 = time.time()
    trainer.train()
    ends = [t0] + clock.times
    per_rollout = [ends[i + args.mini_batches] - ends[i]          # the first rollout (untimed) is skipped
                   for i in range(args.mini_batches, len(ends) - args.mini_batches, args.mini_batches)]
    step = sum(per_rollout) / max(1, len(per_rollout))
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_time": step, "perf/tokens_per_second": rollout * lengths[-1] / step,
            "peak_memory_mb (process-wide, includes ours)": peak_memory_mb(torch.device("cpu"))}


def main(argv=None) -> int:
    args, obj_overrides = parse_args(argv)
    if args.dry_run:
        dry_run(args, obj_overrides)
    elif args.bench:
        benchmark(args, obj_overrides)
    elif args.compare:
        compare_objectives(args, obj_overrides)
    elif args.engine == "trl":   # the same objective inside TRL's GRPOTrainer (tepo_trl.py; needs trl)
        try:
            import tepo_trl
        except ImportError as e:
            fail(f"argument --engine: 'trl' needs TRL ({e}); pip install 'trl>=1.16,<1.17' or choose --engine tepo")
        tepo_trl.train(args, obj_overrides)
    else:
        train(args, obj_overrides)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:      # Ctrl-C before the RL loop (the loop handles its own)
        print("train_small.py: interrupted before the first RL step", file=sys.stderr)
        sys.exit(130)
