"""The command line: one flag per field of train_small's Args and of tepo.ObjectiveConfig (their valid values
and the rules between flags are in tepokit/cli/validation.py), --help, the presets (--regime, --demo, --task,
--bench-shape), the rules of --resume, the objective's configuration from the flags, and the one line a command
ends with when a stop, a divergence or the file system ends it early (exit_in_one_line)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import sys
import textwrap

import tepo
from tepokit.plumbing.non_finite import Diverged
from tepokit.plumbing.errors import fail, os_error_line, warn
from tepokit.cli.helptext import (CLI_HELP, COMMON_FLAGS, EXAMPLES, HELP_GROUPS, field_comments, help_group,
                              paper_values, topic_group)
from tepokit.setup.model import check_model_dir
from tepokit.plumbing.report import check_installed
from tepokit.cli.resume import check_resumable
from tepokit.plumbing.rundir import DamagedLog, lock_holder
from tepokit.plumbing.signals import Stopped
from tepokit.cli.validation import VALID, check_values, converter, field_kinds, flag, warn_ignored

# Fields of Args that only say how to run, not what is computed: they are not compared on resume.
RUN_ONLY_FIELDS = ("resume", "stop_after", "compare", "seeds", "baseline", "bench", "bench_steps", "bench_repeats",
                   "bench_shape", "out", "threads",
                   "cache_dir", "dry_run", "force", "overwrite", "report_to", "check_memory_on_device", "cuda_graphs")
# Of those, what a resumed run takes from its config.json unless the flag is given again: where its warm-up
# model is cached (else a resumed run would warm up again into the default --cache-dir).
KEPT_ON_RESUME = ("cache_dir",)


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


# --task hidden-type: the task made for entropy collapse (tepokit/setup/task.py, docs/collapse.md) and its preset, fixed
# from GRPO (beta 0) runs alone before any other objective was run on it. Operands 2..9 (so the arithmetic
# after the decision is near-deterministic), answers of at most 15 tokens, the committed start model (task seed 1),
# and the measurements that show a collapse: pass@k up to 16 on 100 held-out problems, by type.
TASKS = {"arith": {}, "hidden-type": {"task_seed": 1, "difficulty": 9, "max_new_tokens": 16, "steps": 150,
                                      "eval_every": 25, "pass_k": 16, "pass_k_problems": 100}}
# --demo --task hidden-type: the collapse in class, 60 steps (evaluated at 0, 30 and 60).
DEMO_HIDDEN_TYPE = {"steps": 60, "eval_every": 30, "lr_warmup_steps": 5}


# --bench --bench-shape gpt2-small: the shape of a one-GPU user's model (GPT-2 small, random weights, built by
# tepokit/tools/bench.py) on a rollout that fits this CPU: 2 prompts x 8 samples, 128 new tokens, one timed step a
# repeat, and 16 held-out problems for the untimed evaluation at step 0 (the model is random: nothing to measure).
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
    check_values(args, obj_overrides, None if args.resume else set(given))
    if args.model is not None:
        check_model_dir(args)
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
    run_only = {k: getattr(args if k in given or k not in KEPT_ON_RESUME else saved_args, k) for k in RUN_ONLY_FIELDS}
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


def exit_in_one_line(main) -> None:
    """Run the command (main() -> its exit status) and exit. What ends it early says so in one line on stderr, not
    a traceback: a stop signal or a diverged step (what was kept, how to go on; their own exit statuses), the disk
    or the file system (what failed and what to do), a log --compare reads back, damaged by hand (exit status 2)."""
    try:
        sys.exit(main())
    except (Stopped, Diverged) as e:    # what was kept, and how to go on
        print(f"train_small.py: {e.name}: {e.message}", file=sys.stderr)
        sys.exit(e.exit_status)
    except OSError as e:          # the disk, the file system, the permissions: one line, and what to do
        fail(os_error_line(e))
    except DamagedLog as e:
        fail(str(e))
