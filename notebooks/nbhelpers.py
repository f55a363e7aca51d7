"""Helpers shared by the notebooks in this folder, written once here instead of in each notebook.

- where things are: REPO (the repository root, put on sys.path so `import tepo` finds tepo.py), and where the
  notebook reads runs and saves figures: read_runs_from(RUN_DIR), the parameter of each notebook's first code cell;
- the reference logs: the training commands of logs/COMMANDS.md (the one place they are written) and
  regenerate_logs(), load_run() for one run directory, series() for one metric;
- small statistics: smooth(), standard errors and 95% intervals, so that verdicts stay within the data;
- plotting: the shared style, LABELS and COLORS per objective, smoothed_band(), save_figure() for the README.

Reading a run directory, series(), smooth(), smoothed_band() and the PNG writing are tepokit.tools.plot's (the ones
`python -m tepokit.tools.plot RUN_DIR` draws with); log reading and the statistics are the project's own:
tepokit.plumbing.rundir.read_log() and tepokit.diagnostics.stats's pearson() and t_interval(), the ones train_small.py
and --compare use.
"""
from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

NB_DIR = Path(__file__).resolve().parent
REPO = NB_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import matplotlib.pyplot as plt  # noqa: E402

# tqdm (imported by the project's modules) asks for ipywidgets to draw progress bars in a notebook; no cell of the
# notebooks draws one, so the hint would only be noise above the first output.
warnings.filterwarnings("ignore", message="IProgress not found")

from tepokit.tools.plot import per_minibatch, read_run, save_png, series, smooth, smoothed_band  # noqa: E402,F401
from tepokit.plumbing.rundir import read_log  # noqa: E402,F401
from tepokit.diagnostics.stats import pearson, t_interval  # noqa: E402,F401

COMMANDS_FILE = NB_DIR / "logs" / "COMMANDS.md"
LOG_FILES = ("config.json", "metrics.jsonl", "summary.json", "details.jsonl")   # not checkpoints or weights

# Where the notebook reads runs (LOGS: a directory of run directories; ONE_RUN: a single run directory, or None)
# and saves its figures (FIGURES). read_runs_from() sets them; importing this module reads the committed logs.
LOGS, ONE_RUN, FIGURES = NB_DIR / "logs", None, NB_DIR / "figures"


def read_runs_from(run_dir: str | os.PathLike | None = None) -> None:
    """Point the notebook at its runs.

    None: the committed logs in notebooks/logs/, and the key figures are saved to notebooks/figures/ (the README
    shows them); the environment variable TEPO_NOTEBOOK_LOGS, when set, is taken as `run_dir` (the older way).
    Otherwise `run_dir` (relative: from the repository root, where train_small.py writes runs/) is
    - a run directory of train_small.py (its --out): it takes the place of the committed run of its objective,
      <objective>__1; sections about other runs say that they are skipped;
    - or a directory of run directories named as notebooks/logs/ names them (the --out of a --compare:
      <objective>__<seed>; comparisons below it, under their names in logs/COMMANDS.md or their plain names:
      standard/, collapse/, epochs4/, hidden_type/, off_policy/, cue/).
    The figures of your runs go to <run_dir>/figures/, never to notebooks/figures/."""
    global LOGS, ONE_RUN, FIGURES
    run_dir = run_dir or os.environ.get("TEPO_NOTEBOOK_LOGS") or None
    if run_dir is None:
        LOGS, ONE_RUN, FIGURES = NB_DIR / "logs", None, NB_DIR / "figures"
        return
    path = (REPO / Path(run_dir).expanduser()).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"RUN_DIR = {str(run_dir)!r} is not a directory (a relative path is read from the "
                                "repository root); give the --out of a run of train_small.py, or None")
    single = (path / "metrics.jsonl").is_file()
    if not single and not any(path.glob("*/metrics.jsonl")) and not any(path.glob("*/*/metrics.jsonl")):
        raise FileNotFoundError(f"RUN_DIR = {str(run_dir)!r} holds no run of train_small.py (no metrics.jsonl in it "
                                "or in its subdirectories); give the --out of a run, or None")
    LOGS, ONE_RUN, FIGURES = path, path if single else None, path / "figures"


def shown_path(path: Path) -> str:
    """A path as the notebooks print it: relative to the repository root, so no output shows a machine's
    directories (a directory outside the repository is shown by its name only)."""
    path = Path(path).resolve()
    if path.is_relative_to(REPO):
        return f"{path.relative_to(REPO)}/"
    inside = path.relative_to(LOGS).as_posix() + "/" if path.is_relative_to(LOGS) and path != LOGS else ""
    return f"<RUN_DIR: {(LOGS if path.is_relative_to(LOGS) else path).name}>/{inside}"


OBJECTIVES = ["grpo", "dr_grpo", "dapo", "gspo", "tepo", "mpo", "clip_cov", "kl_cov"]
LABELS = {"grpo": "GRPO", "dr_grpo": "Dr. GRPO", "dapo": "DAPO", "gspo": "GSPO", "tepo": "TEPO",
          "mpo": "MPO", "clip_cov": "Clip-Cov", "kl_cov": "KL-Cov", "tepo_beta0": "TEPO, beta = 0"}
COLORS = dict(zip(OBJECTIVES + ["tepo_beta0"],      # tab10 without its grey, which marks "the others" in plots
                  [c for k, c in enumerate(plt.cm.tab10.colors) if k != 7]))
# The regime comparisons name a --compare entry by its directory: `tepo:beta=0` is written tepo_beta=0. A variant
# that runs next to its objective gets the lighter shade of the objective's colour (tab20); Clip-Cov and KL-Cov
# run there only with their scaled ratios, so those keep the objective's colour.
LABELS["tepo_beta=0"], COLORS["tepo_beta=0"] = LABELS["tepo_beta0"], COLORS["tepo_beta0"]
LABELS |= {"grpo_beta=0": "GRPO, beta = 0",
           "tepo_entropy_criterion=measured": "TEPO, measured", "dapo_dynamic_sampling=off": "DAPO, no dyn. sampling",
           "clip_cov_clip_cov_ratio=0.01": "Clip-Cov, ratio 0.01", "kl_cov_kl_cov_ratio=0.1": "KL-Cov, ratio 0.1",
           # the hidden-type comparison (entropy_collapse.ipynb): its baseline is GRPO without a KL term
           "grpo_beta=0_eps_high=0.28": "clip-higher 0.28", "grpo_beta=0_entropy_coef=0.1": "entropy bonus 0.1",
           "grpo_beta=0_entropy_coef=1.0": "entropy bonus 1.0",
           # each remedy's control: its entry with the mechanism switched off (docs/collapse.md)
           "clip_cov_clip_cov_ratio=0": "Clip-Cov, ratio 0 (control)",
           "kl_cov_kl_cov_ratio=0.1_beta=0": "KL-Cov, beta = 0 (control)",
           "clip_cov_clip_cov_ratio=0.01_clip_cov_lb=0.02_clip_cov_ub=0.1": "Clip-Cov, bounds (0.02, 0.1)",
           # TEPO without its mask, one of its other settings put back to GRPO's (docs/collapse.md)
           "tepo_beta=0_eps_low=0.2_eps_high=0.2": "TEPO, beta = 0, GRPO's clip range",
           "tepo_beta=0_aggregation=seq-mean-token-mean": "TEPO, beta = 0, per-sequence mean",
           "tepo_beta=0_dynamic_sampling=off": "TEPO, beta = 0, every group trains",
           # why the band explores (docs/collapse.md): arms that change what the band clips
           "tepo_beta=0_clip_choice=random": "random drop, the band's rate", "tepo_beta=0_eps_low=1": "clip above only",
           "tepo_beta=0_eps_high=1e9": "clip below only"}
COLORS |= {"grpo_beta=0": plt.cm.tab20.colors[1], "tepo_entropy_criterion=measured": plt.cm.tab20.colors[9],
           "dapo_dynamic_sampling=off": plt.cm.tab20.colors[5],
           "clip_cov_clip_cov_ratio=0.01": COLORS["clip_cov"], "kl_cov_kl_cov_ratio=0.1": COLORS["kl_cov"]}

plt.rcParams.update({"figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3, "font.size": 10,
                     "axes.titlesize": 10, "legend.fontsize": 8})


# ---- the reference logs ------------------------------------------------------------------------------------

def training_commands() -> list[list[str]]:
    """The commands of logs/COMMANDS.md (its lines starting `python train_small.py`), each as an argv list
    to run from the repository root with this kernel's python."""
    lines = COMMANDS_FILE.read_text().splitlines()
    return [[sys.executable] + shlex.split(line)[1:] for line in lines if line.startswith("python train_small.py")]


def run_dirs_of(cmd: list[str]) -> list[tuple[Path, str]]:
    """The run directories a command writes, each with the name it gets under LOGS: a single run's --out keeps its
    name; each run of --compare is <out>/<entry>__<seed> (an entry `tepo:beta=0` is written `tepo_beta=0`), kept as
    <run> when the command compares one seed and as <out name>/<run> with --seeds (the regime comparisons)."""
    out = REPO / cmd[cmd.index("--out") + 1]
    if "--compare" not in cmd:
        return [(out, out.name)]
    first = int(cmd[cmd.index("--seed") + 1]) if "--seed" in cmd else 1
    seeds = range(first, first + (int(cmd[cmd.index("--seeds") + 1]) if "--seeds" in cmd else 1))
    entries = cmd[cmd.index("--compare") + 1].split(",")
    names = [f"{spec.replace(':', '_')}__{seed}" for seed in seeds for spec in entries]
    return [(out / name, f"{out.name}/{name}" if "--seeds" in cmd else name) for name in names]


def regenerate_logs() -> None:
    """Run the commands of logs/COMMANDS.md (hours on 2 CPU cores), then copy each run's small log files
    into LOGS/<run name>/."""
    for cmd in training_commands():
        print("running:", " ".join(["python"] + cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
        for src, name in run_dirs_of(cmd):
            (LOGS / name).mkdir(parents=True, exist_ok=True)
            for f in LOG_FILES:
                if (src / f).is_file():
                    shutil.copy2(src / f, LOGS / name / f)
    print("logs copied to", shown_path(LOGS))


def load_run(name: str) -> dict | None:
    """{metrics, steps, config, summary, details, planned} of LOGS/<name> (tepokit.tools.plot.read_run), or None when
    it has no metrics.jsonl. With a single run directory (read_runs_from), that run answers to
    <its objective>__1 and no other name."""
    if ONE_RUN is not None:
        config = read_run(ONE_RUN)["config"]
        return read_run(ONE_RUN, name) if config and name == f"{config['args']['objective']}__1" else None
    return read_run(LOGS / name, name)


def describe(run: dict) -> str:
    done, planned = len(run["steps"]), run["planned"]
    state = "finished" if run["summary"] else "UNFINISHED (no summary.json)"
    details = "" if run["details"] is None else f", details.jsonl {len(run['details'])} rows"
    return f"{done} of {planned if planned else '?'} steps, {state}{details}"


# The committed comparisons, each in a directory named for its command or preset and the date of the code that made
# it (the --out of its command in logs/COMMANDS.md). The notebooks ask for them by these plain names.
COMPARISONS = {"standard": "standard_regime_2026-11-24", "collapse": "collapse_regime_2026-11-24",
               "epochs4": "epochs4_2026-11-24", "hidden_type": "hidden_type_2026-11-25",
               "off_policy": "hidden_type_off_policy_2026-11-26", "cue": "hidden_type_cue_2026-11-26",
               "cue_400": "hidden_type_cue_400_2026-11-26", "band": "band_mechanism_2026-11-27",
               "band_sgd": "band_mechanism_sgd_2026-11-27", "grpo_lr3e-4": "grpo_lr3e-4_cue_400_2026-11-27",
               "grpo_lr3e-5": "grpo_lr3e-5_cue_400_2026-11-27", "new_objectives": "new_objectives_2026-11-27"}


def comparison_dir(name: str) -> Path:
    """The directory of a comparison under LOGS: its committed name (COMPARISONS), or else the plain name, as a
    RUN_DIR of your own may hold it (the --out you gave, e.g. runs/standard)."""
    committed = LOGS / COMPARISONS.get(name, name)
    return committed if committed.is_dir() or not (LOGS / name).is_dir() else LOGS / name


def load_regime(regime: str) -> dict[str, dict[int, dict]]:
    """The finished runs of one comparison, <comparison_dir(regime)>/<entry>__<seed>: {entry: {seed: run}}."""
    runs: dict[str, dict[int, dict]] = {}
    directory = comparison_dir(regime)
    for d in sorted(directory.glob("*__*")) if directory.is_dir() else []:
        entry, seed = d.name.rsplit("__", 1)
        run = load_run(f"{directory.relative_to(LOGS).as_posix()}/{d.name}")
        if run is not None and run["summary"] is not None:
            runs.setdefault(entry, {})[int(seed)] = run
    return runs


def at_step(run: dict, key: str, step: int) -> float:
    """The value of `key` in the row of `step` (nan when that row does not have it)."""
    return next((r[key] for r in run["metrics"] if r.get("step") == step and key in r), float("nan"))


def eval_size(run: dict) -> int:
    """How many held-out problems each evaluation of the run used."""
    return run["config"]["args"]["n_test"] if run["config"] else 500


# ---- statistics --------------------------------------------------------------------------------------------

def binomial_se(p: float, n: int) -> float:
    """Standard error of a fraction p measured on n independent trials."""
    return math.sqrt(p * (1 - p) / n)


def mean_se(x) -> float:
    """Standard error of the mean of x, treating its values as independent (for the steps of one run this is
    optimistic: the policy carries over from step to step)."""
    x = np.asarray(x, dtype=float)
    return float(x.std(ddof=1) / math.sqrt(len(x)))


def bootstrap_se(statistic, n: int, draws: int = 2000, seed: int = 0) -> float:
    """Standard error of statistic(rows) when the n units (e.g. logged samples) are redrawn with replacement.
    Redrawing whole samples keeps the tokens of one completion together: they are not independent."""
    rng = np.random.default_rng(seed)
    return float(np.std([statistic(rng.integers(0, n, n)) for _ in range(draws)], ddof=1))


def with_interval(estimate: float, se: float, scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    """'+9.0 points (standard error 3.6, 95% interval +1.9 to +16.1)': the normal-approximation interval."""
    e, s = scale * estimate, scale * se
    return (f"{e:+.{digits}f}{unit} (standard error {s:.{digits}f}, "
            f"95% interval {e - 1.96 * s:+.{digits}f} to {e + 1.96 * s:+.{digits}f})")


def paired_over_seeds(runs: dict[int, dict], base: dict[int, dict], value) -> dict:
    """Paired by seed: value(run) - value(baseline run) on every seed both have (runs that share a seed share the
    task, the warm-up model and the prompt order), then their mean with a 95% t interval over the seeds
    (tepokit.diagnostics.stats.t_interval, the one --compare uses). A value of None (e.g. a target never reached)
    drops that seed. Returns t_interval's dict plus `per_seed` and `seeds`."""
    seeds = [s for s in sorted(set(runs) & set(base))
             if value(runs[s]) is not None and value(base[s]) is not None]
    differences = [value(runs[s]) - value(base[s]) for s in seeds]
    return {**t_interval(differences), "per_seed": differences, "seeds": seeds}


def interval_text(stats: dict, digits: int = 1, unit: str = "") -> str:
    """'+2.3 (95% interval -1.0 to +5.6, 6 seeds)', or the single value when there is no interval."""
    if stats["n"] == 0:
        return "no seeds"
    if stats["low"] is None:
        return f"{stats['mean']:+.{digits}f}{unit} (1 seed, no interval)"
    return (f"{stats['mean']:+.{digits}f}{unit} (95% interval {stats['low']:+.{digits}f} to "
            f"{stats['high']:+.{digits}f}, {stats['n']} seeds)")


def verdict(stats: dict) -> str:
    """What an interval supports, and nothing more."""
    if stats["low"] is None:
        return "no interval"
    if stats["low"] > 0:
        return "higher (interval above 0)"
    if stats["high"] < 0:
        return "lower (interval below 0)"
    return "no difference shown (interval contains 0)"


def correlation_interval(r: float, n: int) -> tuple[float, float]:
    """95% interval of a Pearson r measured on n independent pairs (Fisher's z = atanh r is nearly normal,
    with standard error 1/sqrt(n - 3)); nan, nan when n <= 3 (a short run of your own: no interval)."""
    if n <= 3:
        return math.nan, math.nan
    half = 1.96 / math.sqrt(n - 3)
    return math.tanh(math.atanh(r) - half), math.tanh(math.atanh(r) + half)


def clearly_nonzero(estimate: float, se: float) -> bool:
    """True when the 95% interval estimate +- 1.96 se leaves out zero."""
    return abs(estimate) > 1.96 * se


# ---- plotting ----------------------------------------------------------------------------------------------

def seed_band(ax, runs: dict[int, dict], key: str, color, label: str, window: int = 1) -> None:
    """One metric over the steps of several seeds: the mean over seeds (line) and the range from the lowest to the
    highest seed (band), at the steps every seed logged; per-step metrics are first smoothed over `window` steps."""
    curves = [series(run, key) for run in runs.values()]
    steps = sorted(set.intersection(*(set(x.tolist()) for x, _ in curves))) if curves else []
    if not steps:
        return
    ys = np.array([smooth(y, window)[np.searchsorted(x, steps)] for x, y in curves])     # [seeds, steps]
    ax.fill_between(steps, ys.min(0), ys.max(0), color=color, alpha=0.15, lw=0)
    ax.plot(steps, ys.mean(0), color=color, lw=2, label=f"{label} ({len(curves)} seed{'s' * (len(curves) != 1)})")


def save_figure(fig, filename: str) -> None:
    """Save a key figure to FIGURES (tepokit.tools.plot.save_png: the same logs give the same bytes): notebooks/figures/
    for the committed logs (the README shows them), <RUN_DIR>/figures/ for your runs."""
    try:
        FIGURES.mkdir(exist_ok=True)
        size = save_png(fig, FIGURES / filename)
        print(f"saved {shown_path(FIGURES)}{filename} ({size // 1024} KB)")
    except OSError as err:
        print(f"could not save {filename}: {err}")
