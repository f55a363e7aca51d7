"""What --help shows: each flag's text (the field comments of train_small's Args and of tepo.ObjectiveConfig),
the paper value of each objective setting, the groups the flags are shown in, and the examples."""

from __future__ import annotations

import functools
import inspect
import re

import tepo


@functools.cache      # reading the source is slow, and parse_args runs it for every command line
def field_comments(cls) -> dict[str, str]:
    """The one-line comment of each dataclass field, read from the source: the --help text."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
        if m:
            comments[m.group(1)] = m.group(2).strip()
    return comments


@functools.cache
def field_sections(cls) -> dict[str, str]:
    """The section of each dataclass field, from the `# --- name ---` comment lines above it in the source."""
    sections, current = {}, None
    for line in inspect.getsource(cls).splitlines():
        if m := re.match(r"\s+# --- (.+) ---", line):
            current = m.group(1)
        elif m := re.match(r"\s+(\w+)\s*:", line):
            sections[m.group(1)] = current
    return sections


# --help in five groups: first the flags most runs need (COMMON_FLAGS, in that order), then the sections of
# train_small's Args, each in a group, with a few flags moved to the group a reader looks in for them. Every
# objective setting (tepo.ObjectiveConfig) is in "objective". A topic group names the common flags of its topic.
HELP_GROUPS = {     # name: description (its line breaks are kept: the examples need a raw formatter)
    "common flags": "The flags most runs need; every other flag is in a group of its own topic below.",
    "task and model": "What is learned, and by which model: the task, the model, its supervised warm-up.",
    "objective": "The RL objective and how each step uses it: --regime, the rollout, the update, and the\n"
                 "objective settings (from --eps-low on), which default to the chosen objective's paper value\n"
                 "(tepo.py section 2); a setting the objective does not read is reported and has no effect.",
    "run control": "How the run runs: device, checkpoints, files, evaluation and measurement.",
    "experiments": "Several runs at once: objectives compared on the same seeds, or train_small.py's RL step\n"
                   "timed against TRL's.",
}
# What a newcomer sets: what to run (a preset, the objective, the task or a model and data set), how long and
# from which seed, where it goes and how to go on with it, a comparison, and how many cores it may use.
COMMON_FLAGS = ("demo", "objective", "task", "model", "dataset", "seed", "steps", "out", "resume", "compare",
                "threads")
GROUP_OF_SECTION = {"run": "run control", "model": "task and model", "task": "task and model",
                    "supervised warm-up": "task and model", "rollout": "objective", "update": "objective",
                    "measurement": "run control", "modes": "experiments"}
GROUP_OF_FIELD = {"objective": "objective", "regime": "objective", "target_accuracy": "experiments",
                  "resume": "run control", "stop_after": "run control"}

EXAMPLES = """examples:
  python train_small.py --demo                           # the two-minute classroom run
  python train_small.py                                  # the default run: TEPO (minutes on a CPU)
  python train_small.py --objective grpo --seed 2        # another objective, another seed
  python train_small.py --objective dapo --eps-high 0.3  # an objective setting of your own
  python train_small.py --compare grpo,tepo --seeds 3    # two objectives, paired on the same seeds
  python train_small.py --task hidden-type --objective grpo --beta 0
                                                         # entropy collapse, on a task made for it
  python -m tepokit.tools.plot runs/<run>                # a run's figures: runs/<run>/figures/*.png
  python train_small.py --resume runs/<run>              # continue a run where it stopped
  python train_small.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k \\
      --max-new-tokens 256                               # a real model and data set (needs the hub)"""


def topic_group(Args, name: str) -> str:
    """The topic group of field `name` of Args (GROUP_OF_FIELD, else its section's group)."""
    return GROUP_OF_FIELD.get(name) or GROUP_OF_SECTION[field_sections(Args)[name]]


def help_group(Args, name: str) -> str:
    """The --help group of field `name` of Args: "common flags" for COMMON_FLAGS, else its topic group."""
    return "common flags" if name in COMMON_FLAGS else topic_group(Args, name)


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


# Help texts that say how train_small.py uses a setting, in place of tepo.ObjectiveConfig's comment.
CLI_HELP = {"norm_constant": "C of seq-mean-token-sum-norm; none = --max-new-tokens (Dr. GRPO's max generation length)",
            "overlong_penalty": "DAPO: add the soft overlong punishment (a ramp over the last --overlong-cache "
                                "tokens) to the reward"}
