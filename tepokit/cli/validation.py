"""The valid values of every flag and the rules between flags, checked before anything is created or loaded:
one table (VALID), the relations (RELATIONS), and --compare's entries. A bad value ends the program in one
line naming the flag, the value and what is valid. The command line itself is built in tepokit/cli/flags.py."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re

import torch

import tepo
from tepokit.plumbing.errors import fail, warn
from tepokit.core.reward import REWARDS, reward_spec_problem
from tepokit.core.step_settings import rows_per_minibatch
from tepokit.plumbing.report import TRACKERS, valid_report_to
from tepokit.plumbing.rundir import holds_a_run, holds_other_files
from tepokit.setup.lora import INSTALL_PEFT, peft_installed
from tepokit.setup.task import arithmetic_task_size, hidden_type_task_size

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


def valid_target_modules(v: str) -> bool:
    """--lora-target-modules: auto, all-linear, or distinct module names (whether the model has them is checked
    with its config, tepokit/setup/lora.py adapted_layers)."""
    names = v.split(",")
    return v in ("auto", "all-linear") or (len(set(names)) == len(names)
                                          and all(re.fullmatch(r"[A-Za-z_][\w.]*", n) for n in names))


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
    "optimizer": one_of(["adam", "sgd"]),
    "cache_dir": path(WRITABLE, writable_location),
    # --- model ---
    "model": path("a Hugging Face id (name or org/name) or an existing local directory", hub_id_or_local),
    "arch": one_of(["gpt2", "qwen2"]),
    "n_layer": at_least(1),
    "n_embd": at_least(1),
    "n_head": at_least(1),
    "precision": one_of(["fp32", "bf16"]),
    "decode_precision": one_of(["auto", "fp32", "tf32", "bf16"]),
    "lora_rank": at_least(0),
    "lora_alpha": positive(),
    "lora_target_modules": ("auto, all-linear, or a comma-separated list of distinct module names, e.g. "
                            "q_proj,v_proj", valid_target_modules, None),
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
    "chat_template": one_of(["auto", "on", "off"]),
    "reward": ("a comma-separated list of rewards, each once, from " + ", ".join(REWARDS) + ", each with an optional "
               "finite weight (name:weight), e.g. strict,format:0.1", lambda v: reward_spec_problem(v) is None, None),
    "sampler": one_of(["loop", "generate"]),
    "cuda_graphs": one_of(["auto", "on", "off"]),
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
    "log_completions_every": at_least(0),
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
    "kl_mode": one_of(tepo.KL_MODES), "clip_choice": one_of(tepo.CLIP_CHOICES),
    "block_ratio": one_of(tepo.BLOCK_RATIOS), "block_agg": one_of(tepo.BLOCK_AGGREGATIONS),
    "cispo_weight": one_of(tepo.CISPO_WEIGHTS),
    "sampler_correction": one_of(tepo.SAMPLER_CORRECTIONS),
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
    # LoRA (tepokit/setup/lora.py): its settings need a rank, a bf16 base computes under bf16 autocast, peft installed
    ("lora_rank", f"0, or install peft, which LoRA needs ({INSTALL_PEFT})",
     lambda a: a.lora_rank == 0 or peft_installed()),
    ("lora_alpha", "none (unset) without --lora-rank: alpha scales LoRA's adapters",
     lambda a: a.lora_alpha is None or a.lora_rank > 0),
    ("lora_target_modules", "auto without --lora-rank: they name where LoRA's adapters go",
     lambda a: a.lora_target_modules == "auto" or a.lora_rank > 0),
    ("lora_base_bf16", "off unless --lora-rank > 0 and --precision bf16 (the bf16 base computes under bf16 "
     "autocast; a fp32 forward would meet bf16 weights), and off with --engine trl (TRL loads the base itself)",
     lambda a: not a.lora_base_bf16 or (a.lora_rank > 0 and a.precision == "bf16" and a.engine == "tepo")),
    ("mini_batches", "an integer in 1..{prompts_per_step} (--prompts-per-step): a mini-batch holds whole groups",
     lambda a: a.mini_batches <= a.prompts_per_step),
    ("micro_batch_size", "0 (the whole mini-batch) or an integer up to {rows_per_minibatch}, the rows of a "
     "mini-batch (ceil(prompts-per-step / mini-batches) x group-size)",
     lambda a: a.micro_batch_size <= rows_per_minibatch(a.prompts_per_step, a.mini_batches, a.group_size)),
    ("n_test", "an integer below {builtin_task_size}, the number of problems of the built-in task at this "
     "--difficulty and --ops", lambda a: a.dataset is not None or a.n_test < builtin_task_size(a)),
    ("seed", f"an integer with --seed + --seeds - 1 <= {INT_LIMIT}", lambda a: a.seed + a.seeds - 1 <= INT_LIMIT),
    ("baseline", "one of the objectives of --compare ({compare}); without --baseline, a comparison that leaves out "
     "grpo has no paired block", lambda a: a.compare is None or a.baseline in a.compare.split(",")
     or a.baseline == type(a).baseline),
    # --no-fast is the plain path: the switches of single fast twins may not ask for one (train_small.Args)
    ("decode_precision", "auto with --precision bf16 (its generation runs under its bf16 autocast) or with "
     "--engine trl (TRL generates on its own)", lambda a: a.decode_precision == "auto"
     or (a.precision == "fp32" and a.engine == "tepo")),
    ("cuda_graphs", "auto or off with --no-fast (the plain path samples with model.generate), or drop --no-fast",
     lambda a: a.fast or a.cuda_graphs != "on"),
    ("recompute_old_logprobs", "on (or leave it out) with --no-fast (the plain path's old log-probs come from a "
     "forward pass), or drop --no-fast", lambda a: a.fast or a.recompute_old_logprobs is not False),
    ("chat_template", "auto or off without --model: the built-in tokenizer has no chat template",
     lambda a: a.chat_template != "on" or a.model is not None),
    ("device", "auto or cpu: CUDA is not available here", lambda a: a.device != "cuda" or torch.cuda.is_available()),
    ("optimizer", "adam with --engine trl (TRL's GRPOTrainer makes its own optimizer), or --engine tepo",
     lambda a: a.optimizer == "adam" or a.engine == "tepo"),
    ("resume", "a run directory alone: --resume cannot be combined with --compare or --bench",
     lambda a: a.resume is None or not (a.compare or a.bench)),
    ("bench", "off with --compare (one mode at a time)", lambda a: not (a.bench and a.compare)),
    ("bench_shape", "builtin with --model (gpt2-small builds its own model), and only with --bench",
     lambda a: a.bench_shape == "builtin" or (a.bench and a.model is None)),
    ("out", "a directory that holds no run yet; continue the run in it with --resume {out}, or add --overwrite "
     "to replace it", lambda a: a.resume or a.compare or a.bench or a.out is None or a.overwrite
     or not holds_a_run(a.out)),
    ("out", "a new or empty directory, or one that holds a run of train_small.py: this one holds other files (a "
     "model directory?), and nothing in it is replaced, not even with --overwrite",
     lambda a: a.resume or a.compare or a.bench or a.out is None or not holds_other_files(a.out)),
]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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


def check_values(args, obj_overrides: dict, given: set[str] | None = None) -> None:
    """Every value on its own (VALID), the objective settings (tepo.check_config) and the relations
    between flags (RELATIONS); the first problem found ends the program in one line. `given`, the flags on the
    command line, lets a relation's refusal say when the value it names is a default (not_given)."""
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
    # the two options of every objective read what only train_small.py's own step passes: the sampler's log-probs
    # (its fast sampler's; --no-fast's model.generate gives tokens only) and the old policy's entropy
    for name, off in (("sampler_correction", "none"), ("top_entropy_share", 1.0)):
        lacks = args.engine == "trl" or (name == "sampler_correction" and not args.fast)
        if obj_overrides.get(name, off) != off and lacks:
            fail(f"argument {flag(name)}: invalid value {obj_overrides[name]!r}; choose {off} with "
                 + ("--engine trl, or --engine tepo" if args.engine == "trl" else "--no-fast, or drop --no-fast "
                    "(the plain path's model.generate gives no log-probs)"))
    if not args.fast and args.sampler == "loop" and given is not None and "sampler" in given:   # not the default
        fail("argument --sampler: invalid value 'loop'; choose generate with --no-fast (the plain path samples with "
             "model.generate), or drop --no-fast")
    sizes = {"rows_per_minibatch": rows_per_minibatch(args.prompts_per_step, args.mini_batches, args.group_size),
             "builtin_task_size": builtin_task_size(args)}
    for name, valid, test in RELATIONS:
        if not test(args):
            fail(f"argument {flag(name)}: invalid value {getattr(args, name)!r}{not_given(args, name, given)}; choose "
                 + valid.format(**dataclasses.asdict(args), **sizes))


def not_given(args, name: str, given: set[str] | None) -> str:
    """', its default (the flag was not given)' when a relation fails on a value the user did not write: said,
    so that a refusal that names --mini-batches after --prompts-per-step 1 does not read as a typo. '' when
    the flag was given, or when the caller does not know (given None)."""
    if given is None or name in given:
        return ""
    if getattr(args, name) == type(args).__dataclass_fields__[name].default:
        return ", its default (the flag was not given)"
    return ", set by a preset (--task, --regime, --demo or --bench-shape; the flag was not given)"


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
