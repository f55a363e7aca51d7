"""The command line: one flag per field of train_small's Args and of tepo.ObjectiveConfig, the table of
valid values and the rules between flags (checked before anything is created or loaded), --regime
presets, the rules of --resume, and the objective's configuration from the flags."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import shlex
import textwrap

import torch

import tepo
from tepokit.errors import fail, warn
from tepokit.forward import rows_per_minibatch
from tepokit.helptext import (CLI_HELP, COMMON_FLAGS, EXAMPLES, HELP_GROUPS, field_comments, help_group,
                              paper_values, topic_group)
from tepokit.report import TRACKERS, check_installed, valid_report_to
from tepokit.rundir import check_resumable, holds_a_run, lock_holder
from tepokit.task import arithmetic_task_size, hidden_type_task_size

# Fields of Args that only say how to run, not what is computed: they are not compared on resume.
RUN_ONLY_FIELDS = ("resume", "stop_after", "compare", "seeds", "baseline", "bench", "bench_steps", "bench_repeats",
                   "bench_shape", "out", "threads",
                   "cache_dir", "dry_run", "force", "overwrite", "report_to")


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


WRITABLE = ("a directory path you can create or write to (its nearest existing parent a writable directory, "
            "no part of it a regular file, no name in it over 255 bytes)")


def writable_location(p: str) -> bool:
    """Whether a run can create and write directory `p`: checked before anything is created, so that a
    path below a regular file, in a read-only place or with a name too long fails in one line, not later."""
    p = os.path.abspath(p)
    if any(len(part.encode()) > 255 for part in p.split(os.sep)):
        return False
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK)


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
    if OBJECTIVE_KINDS[field][0] == "bool":
        if text.lower() not in BOOLEAN_WORDS:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; choose on or off")
        return BOOLEAN_WORDS[text.lower()]
    return converter(OBJECTIVE_KINDS, field)(text)


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
    "regime": one_of(["standard", "collapse", "off-policy"]),
    "seed": at_least(0),
    "out": path(WRITABLE, writable_location),
    "device": one_of(["auto", "cpu", "cuda"]),
    "threads": (f"an integer in 1..{os.cpu_count()} (this machine's cores)",
                lambda v: 1 <= v <= (os.cpu_count() or 1), None),
    "steps": at_least(1),
    "save_every": at_least(1),
    "engine": one_of(["tepo", "trl"]),
    "cache_dir": path(WRITABLE, writable_location),
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
    "task": one_of(["arith", "hidden-type"]),
    "majority": fraction(),
    "cue": ("0 (no cue) or a number in [0.5, 1]: the share of problems whose type the item word tells",
            lambda v: v == 0 or 0.5 <= v <= 1, None),
    "difficulty": at_least(1),
    "ops": ("a non-empty string of distinct characters from + - *",
            lambda v: 0 < len(v) == len(set(v)) and set(v) <= set("+-*"), None),
    "sft_noise": fraction(),
    "n_train": at_least(1),
    "n_test": at_least(1),
    "task_seed": at_least(0),
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
    "sampler": one_of(["loop", "generate"]),
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
    "effect_check_every": at_least(0),
    "report_to": ("none, or a comma-separated list of: " + ", ".join(TRACKERS), valid_report_to, None),
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
    "bench_repeats": at_least(1),
    "bench_shape": one_of(["builtin", "gpt2-small"]),
    "stop_after": at_least(1),
    # --- objective settings: the choices, and two fractions tepo.check_config only requires >= 0 ---
    "kl_estimator": one_of(tepo.KL_ESTIMATORS), "aggregation": one_of(tepo.AGGREGATIONS),
    "advantage_scale": one_of(tepo.ADVANTAGE_SCALES), "ratio_mode": one_of(tepo.RATIO_MODES),
    "entropy_criterion": one_of(tepo.ENTROPY_CRITERIA), "kl_target": one_of(tepo.KL_TARGETS),
    "kl_mode": one_of(tepo.KL_MODES), "block_ratio": one_of(tepo.BLOCK_RATIOS),
    "block_agg": one_of(tepo.BLOCK_AGGREGATIONS),
    "clip_cov_ratio": fraction(), "kl_cov_ratio": fraction(),
}


def builtin_task_size(args) -> int:
    """How many problems the built-in task draws at most for this --task, --difficulty and --ops."""
    if args.task == "hidden-type":
        return hidden_type_task_size(args.difficulty)
    return arithmetic_task_size(args.difficulty, args.ops)


# Rules that relate flags: (field, what is valid, test of the whole Args). The text may name other
# flags' values as {field} and the derived sizes {rows_per_minibatch}, {builtin_task_size}.
RELATIONS = [
    ("cue", "0 unless --task hidden-type (without --dataset): the cue is that task's item word",
     lambda a: a.cue == 0 or (a.task == "hidden-type" and a.dataset is None)),
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
     or a.baseline == type(a).baseline),
    ("device", "auto or cpu: CUDA is not available here", lambda a: a.device != "cuda" or torch.cuda.is_available()),
    ("resume", "a run directory alone: --resume cannot be combined with --compare or --bench",
     lambda a: a.resume is None or not (a.compare or a.bench)),
    ("bench", "off with --compare (one mode at a time)", lambda a: not (a.bench and a.compare)),
    ("bench_shape", "builtin with --model (gpt2-small builds its own model), and only with --bench",
     lambda a: a.bench_shape == "builtin" or (a.bench and a.model is None)),
    ("out", "a directory that holds no run yet; continue the run in it with --resume {out}, or add --overwrite "
     "to replace it", lambda a: a.resume or a.compare or a.bench or a.out is None or a.overwrite
     or not holds_a_run(a.out)),
]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flag_and_value(name: str, value) -> list[str]:
    """The command-line form of one setting: --name value, or --name / --no-name for a switch."""
    if isinstance(value, bool):
        return [flag(name) if value else "--no-" + flag(name)[2:]]
    return [flag(name), str(value)]


def command_line(args, obj_overrides: dict, **changes) -> str:
    """The command that makes these settings, for a line that says how to go on: `python train_small.py` with
    a flag for each setting that differs from its default and for each objective setting, after `changes`
    (a change to None leaves the flag out). Quoted for a POSIX shell."""
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if getattr(args, f.name) != f.default}
    settings = {**settings, **obj_overrides, **changes}
    flags = [part for name, value in settings.items() if value is not None for part in flag_and_value(name, value)]
    return shlex.join(["python", "train_small.py", *flags])


def field_kind(f: dataclasses.Field) -> tuple[str, bool]:
    """(bool | int | float | str, whether None is allowed) of a dataclass field."""
    text = str(f.type)
    kind = next((k for k in ("bool", "int", "float") if k in text), "str")
    return kind, "None" in text


OBJECTIVE_KINDS = {f.name: field_kind(f) for f in dataclasses.fields(tepo.ObjectiveConfig)}


@functools.cache
def field_kinds(Args) -> dict[str, tuple[str, bool]]:
    """The kind of every flag: the fields of train_small's Args and of tepo.ObjectiveConfig."""
    return {**{f.name: field_kind(f) for f in dataclasses.fields(Args)}, **OBJECTIVE_KINDS}


def invalid(kinds: dict, name: str, value) -> str | None:
    """None if `value` is a valid value of field `name` on its own, else what a valid value is."""
    kind, optional = kinds[name]
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


def converter(kinds: dict, name: str):
    """argparse type of field `name`: text -> value, refusing an invalid one with what is valid."""
    kind, optional = kinds[name]

    def convert(text: str):
        if optional and kind != "str" and text.lower() == "none":
            return None
        try:
            value = {"int": int, "float": float, "str": str}[kind](text)
        except ValueError:
            value = text
        problem = invalid(kinds, name, value)
        if problem:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; choose {problem}"
                                             + (" or none" if optional and kind != "str" else ""))
        return value
    return convert


METAVARS = {"int": "N", "float": "X", "str": "TEXT"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The descriptions keep their lines (the examples); a flag's text wraps at spaces only, so that a flag or
    value it names (--lr-warmup-steps, hidden-type) is never split at a hyphen."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def add_flag(container, kinds: dict, name: str, text: str) -> None:
    kind, _ = kinds[name]
    text = text.replace("%", "%%")     # argparse %-formats help texts
    if kind == "bool":
        container.add_argument(flag(name), action=argparse.BooleanOptionalAction, help=text)
    else:
        choices = VALID.get(name, (None, None, None))[2]
        container.add_argument(flag(name), type=converter(kinds, name), choices=choices, help=text,
                               metavar="{" + ",".join(choices) + "}" if choices else METAVARS[kind])


def build_parser(Args) -> argparse.ArgumentParser:
    """Flags for every field of Args and of tepo.ObjectiveConfig, generated from the dataclasses.
    No defaults are set here (argparse.SUPPRESS): parsing returns only the flags given, and the
    dataclasses' defaults fill in the rest, so the run knows which flags were given (--resume).
    --help shows the examples first, then the common flags, then the other flags by topic."""
    parser = argparse.ArgumentParser(
        prog="train_small.py", usage="python train_small.py [options]", argument_default=argparse.SUPPRESS,
        description="Group-relative RL (GRPO, DAPO, GSPO, TEPO, ...) on a tiny model in one file.\n\n" + EXAMPLES,
        formatter_class=HelpFormatter, add_help=False)
    parser.error = fail   # argparse's own errors (unknown flag, missing value) become one line too
    groups = {name: parser.add_argument_group(name, text + common_flags_of(Args, name))
              for name, text in HELP_GROUPS.items()}
    kinds = field_kinds(Args)
    helps = field_comments(Args)
    fields = {f.name: f for f in dataclasses.fields(Args)}       # the common flags first, in COMMON_FLAGS' order
    for f in [fields[name] for name in COMMON_FLAGS] + [f for name, f in fields.items() if name not in COMMON_FLAGS]:
        group = groups[help_group(Args, f.name)]
        if f.name == "stop_after":    # for the tests of --resume only
            group.add_argument(flag(f.name), type=converter(kinds, f.name), help=argparse.SUPPRESS)
            continue
        default = ("on" if f.default else "off") if isinstance(f.default, bool) else f.default
        shown = f.default is None or "(default" in helps[f.name]
        text = helps[f.name] + preset_help(f.name) + ("" if shown else f" (default: {default})")
        add_flag(group, kinds, f.name, text)
    groups["common flags"].add_argument("-h", "--help", action="help", help="show this help and exit")
    obj_helps = field_comments(tepo.ObjectiveConfig)
    for f in dataclasses.fields(tepo.ObjectiveConfig):
        text = CLI_HELP.get(f.name, re.sub(r"\bNone\b", "none", obj_helps[f.name]))
        add_flag(groups["objective"], kinds, f.name,
                 f"{text}. Default: the objective's paper value: {paper_values(f.name)}")
    return parser


def common_flags_of(Args, group: str) -> str:
    """'\nIn common flags, above: --task, --model.': said under a topic group whose flags are among the common
    flags, for a reader who looks for them there."""
    common = [flag(name) for name in COMMON_FLAGS if group != "common flags" and topic_group(Args, name) == group]
    return f"\nIn common flags, above: {', '.join(common)}." if common else ""


def as_flags(settings: dict) -> str:
    """{'steps': 80, 'lr': 3e-4} -> '--steps 80 --lr 0.0003': settings as the flags that give them."""
    return " ".join(" ".join(flag_and_value(name, value)) for name, value in settings.items())


def preset_help(name: str) -> str:
    """What the presets of flag `name` set (--demo, --regime, --task, --bench-shape), added to its --help text;
    written from the presets themselves, so that --help cannot drift from them. '' for other flags."""
    if name == "demo":
        said = [f"it sets {as_flags(DEMO)} (with --task hidden-type: that task's preset, then "
                f"{as_flags(DEMO_HIDDEN_TYPE)})"]
    else:
        presets = {"regime": REGIMES, "task": TASKS, "bench_shape": BENCH_SHAPES}.get(name, {})
        said = [f"{value} sets {as_flags(settings)}" for value, settings in presets.items() if settings]
    return "".join(f"; {text}" for text in said) + ("; flags given explicitly win" if said else "")


def check_values(args, obj_overrides: dict) -> None:
    """Every value on its own (VALID), the objective settings (tepo.check_config) and the relations
    between flags (RELATIONS); the first problem found ends the program in one line."""
    kinds = field_kinds(type(args))
    values = [(f.name, getattr(args, f.name)) for f in dataclasses.fields(args)] + list(obj_overrides.items())
    for name, value in values:
        problem = invalid(kinds, name, value)
        if problem:
            fail(f"argument {flag(name)}: invalid value {value!r}; choose {problem}")
    for objective, overrides in compare_entries(args) if args.compare else [(args.objective, {})]:
        try:
            tepo.config_for(objective, **{**obj_overrides, **overrides})
        except tepo.InvalidSetting as e:      # said with flags: e.name, and the settings named in e.valid
            if e.name not in kinds:           # not a setting of a flag (an unknown objective in --compare)
                fail(str(e))
            valid = re.sub(r"\b([a-z]+(?:_[a-z]+)+)(=(\S+))?",
                           lambda f: flag(f[1]) + (f" ({f[3]})" if f[2] else "") if f[1] in kinds else f[0], e.valid)
            fail(f"argument {flag(e.name)}: invalid value {e.value!r}; choose {valid}")
        except ValueError as e:
            fail(str(e))
    if args.engine == "trl" and obj_overrides.get("entropy_coef"):
        fail(f"argument --entropy-coef: invalid value {obj_overrides['entropy_coef']!r}; choose 0 with --engine trl "
             "(TRL's GRPOTrainer has no entropy bonus), or --engine tepo")
    sizes = {"rows_per_minibatch": rows_per_minibatch(args), "builtin_task_size": builtin_task_size(args)}
    for name, valid, test in RELATIONS:
        if not test(args):
            fail(f"argument {flag(name)}: invalid value {getattr(args, name)!r}; choose "
                 + valid.format(**dataclasses.asdict(args), **sizes))


def warn_ignored(args, obj_overrides: dict) -> None:
    """One warning line per objective setting given that no objective of this run reads (the run goes on)."""
    objectives = [name for name, _ in compare_entries(args)] if args.compare else [args.objective]
    for name in obj_overrides:
        if not any(name in tepo.FIELDS_READ[o] for o in objectives):
            readers = [o for o in tepo.OBJECTIVES if name in tepo.FIELDS_READ[o]]
            warn(f"{flag(name)} has no effect: {', '.join(objectives)} does not read it "
                 f"(read by: {', '.join(readers)})")


def compare_entries(args) -> list[tuple[str, dict]]:
    """--compare's entries as (objective, its own objective settings)."""
    return [variant(spec) for spec in args.compare.split(",")]


# Named presets (--regime): settings a flag given explicitly still overrides. Recorded in config.json
# like every other setting. `collapse` is a 3x larger learning rate, at which held-out pass@16 on the
# built-in task collapses, ending far below its start (docs/results.md, "Two regimes"). It is named for that, not
# for entropy: the mean token entropy does not fall in it. At 1e-3 the model breaks outright.
#
# `off-policy`: 8 mini-batches and 2 epochs, 16 optimizer steps per rollout (the papers' recipes take many), so that
# the policy drifts from the one that sampled and the clip, KL-Cov and TEPO's mask have something to act on. Its
# learning rate was chosen on the hidden-type task from GRPO (beta 0) runs alone, before any other objective ran in
# it: the largest of 1e-4, 3e-5 and 1e-5 at which GRPO stayed stable (docs/collapse.md, "An off-policy regime").
REGIMES = {"standard": {}, "collapse": {"lr": 3e-4}, "off-policy": {"mini_batches": 8, "epochs": 2, "lr": 1e-4}}

# --demo: the classroom run (README, "A two-minute demonstration"): from the committed start model (task seed 1),
# 80 RL steps with a 5-step learning-rate warm-up (the default's 20 would take a quarter of the run), evaluated at
# steps 0, 40 and 80, pass@k on 50 problems (the held-out set stays the task's 500, which fixes the start model).
DEMO = {"task_seed": 1, "steps": 80, "eval_every": 40, "pass_k_problems": 50, "lr_warmup_steps": 5}


# --task hidden-type: the task made for entropy collapse (tepokit/task.py, docs/collapse.md) and its preset, fixed
# from GRPO (beta 0) runs alone before any other objective was run on it. Operands 2..9 (so the arithmetic
# after the decision is near-deterministic), answers of at most 15 tokens, the committed start model (task seed 1),
# and the measurements that show a collapse: pass@k up to 16 on 100 held-out problems, by type.
TASKS = {"arith": {}, "hidden-type": {"task_seed": 1, "difficulty": 9, "max_new_tokens": 16, "steps": 150,
                                      "eval_every": 25, "pass_k": 16, "pass_k_problems": 100}}
# --demo --task hidden-type: the collapse in class, 60 steps (evaluated at 0, 30 and 60).
DEMO_HIDDEN_TYPE = {"steps": 60, "eval_every": 30, "lr_warmup_steps": 5}


# --bench --bench-shape gpt2-small: the shape of a one-GPU user's model (GPT-2 small, random weights, built by
# tepokit/bench.py) on a rollout that fits this CPU: 2 prompts x 8 samples, 128 new tokens, one timed step a repeat,
# and 16 held-out problems for the untimed evaluation at step 0 (the model is random: nothing to measure).
BENCH_SHAPES = {"builtin": {}, "gpt2-small": {"prompts_per_step": 2, "group_size": 8, "max_new_tokens": 128,
                                              "bench_steps": 1, "n_test": 16}}


def parse_args(Args, argv=None) -> tuple:
    """Parse and validate the command line. Returns (args, objective overrides from flags).
    With --resume: the run's saved settings, with the command line's run-only fields and --steps."""
    given = vars(build_parser(Args).parse_args(argv))            # only the flags on the command line
    args = Args(**{k: v for k, v in given.items() if k in Args.__dataclass_fields__})
    if not args.resume:
        demo = (DEMO_HIDDEN_TYPE if args.task == "hidden-type" else DEMO) if args.demo else {}
        shape = BENCH_SHAPES[args.bench_shape] if args.bench else {}
        preset = {**TASKS[args.task], **REGIMES[args.regime], **demo, **shape}
        args = dataclasses.replace(args, **{k: v for k, v in preset.items() if k not in given})
    obj_overrides = {k: v for k, v in given.items() if k not in Args.__dataclass_fields__}
    if args.resume:
        saved, checkpoint_step = check_resumable(args.resume, Args, RUN_ONLY_FIELDS)
        args, obj_overrides = saved_settings(args, obj_overrides, set(given), saved, checkpoint_step)
    check_values(args, obj_overrides)
    check_installed(args.report_to)
    for run_dir in {args.out, args.resume} - {None}:       # a live run's directory is refused at once
        holder = lock_holder(run_dir)
        if holder:
            fail(f"{run_dir} is in use by process {holder}, a run that is still going; wait for it to end, or "
                 "choose another --out")
    if not args.resume:
        warn_ignored(args, obj_overrides)
        warn_rounded_old_logprobs(args)
    return args, obj_overrides


def warn_rounded_old_logprobs(args) -> None:
    """bf16 and the sampler's old log-probs (--no-recompute-old-logprobs): allowed (a wide clip band, as
    GRPO's and DAPO's, does not see it), but said, because the narrow ones act on it."""
    if args.precision == "bf16" and args.recompute_old_logprobs is False and args.mini_batches * args.epochs > 1:
        warn("--precision bf16 with --no-recompute-old-logprobs: the optimizer steps after a rollout's first take "
             "the sampler's old log-probs, which differ from the training forward's by bf16 rounding (up to 0.04 "
             "per token on the built-in model, docs/results.md#precision), more than the (-3e-4, +4e-4) band in "
             "which GSPO and TEPO clip; leave the flag out to recompute them")


def objective_config(args, obj_overrides: dict) -> tepo.ObjectiveConfig:
    """The objective's paper defaults (tepo.PAPER_DEFAULTS), then the flags.

    Dr. GRPO's constant L (seq-mean-token-sum-norm) is the max generation length, as in the paper
    and TRL, unless --norm-constant is given; tepo's own fallback (the padded length of the batch)
    would change from mini-batch to mini-batch.
    """
    cfg = tepo.config_for(args.objective, **obj_overrides)
    if cfg.aggregation == "seq-mean-token-sum-norm" and cfg.norm_constant is None:
        cfg = dataclasses.replace(cfg, norm_constant=float(args.max_new_tokens))
    return cfg


def saved_settings(args, obj_overrides: dict, given: set[str], saved: dict,
                checkpoint_step: int) -> tuple:
    """The saved run's settings, with the command line's run-only fields (RUN_ONLY_FIELDS) and --steps.

    A flag that would change what is computed refuses the run in one line that lists every such flag
    (giving a setting its saved value is fine). --steps may extend a finished or interrupted run, or
    shorten an interrupted one down to its checkpoint's step."""
    run_dir = args.resume
    saved_args = type(args)(**saved["args"])
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
    if saved_args.engine == "trl" and steps == checkpoint_step:     # TRL's Trainer would train one step more
        fail(f"argument --resume: {run_dir} (--engine trl) is checkpointed at its last step, {steps}: nothing is "
             f"left to train; extend it with --resume {run_dir} --steps {steps + 1} or more (nothing was changed)")
    run_only = {k: getattr(args, k) for k in RUN_ONLY_FIELDS}
    return (dataclasses.replace(saved_args, **{**run_only, "steps": steps, "out": run_dir}),
            dict(saved["objective_overrides"]))


def run_settings(args, obj_overrides: dict) -> tuple:
    """The settings a run uses: args as they are, or with --resume the run's saved settings (saved_settings)
    with run-only fields and --steps from args. parse_args has already refused flags that would change the
    run; the run directory is read again because compare_objectives() resumes its runs without parse_args."""
    if not args.resume:
        return args, obj_overrides
    saved, checkpoint_step = check_resumable(args.resume, type(args), RUN_ONLY_FIELDS)
    return saved_settings(args, obj_overrides, {"steps"}, saved, checkpoint_step)
