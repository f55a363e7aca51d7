"""Helpers shared by the notebooks in this folder, written once here instead of in each notebook.

- where things are: REPO (the repository root, put on sys.path so `import tepo` finds tepo.py), LOGS, FIGURES;
- the reference logs: the training commands of logs/COMMANDS.md (the one place they are written) and
  regenerate_logs(), load_run() for one run directory, series() for one metric;
- small statistics: smooth(), standard errors and 95% intervals, so that verdicts stay within the data;
- plotting: the shared style, LABELS and COLORS per objective, smoothed_band(), save_figure() for the README.

Log reading and the statistics are the project's own: tepokit.rundir.read_log() and tepokit.stats's pearson()
and t_interval(), the ones train_small.py and --compare use.
"""
from __future__ import annotations

import io
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

NB_DIR = Path(__file__).resolve().parent
REPO = NB_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import matplotlib.pyplot as plt  # noqa: E402

from tepokit.rundir import read_log  # noqa: E402,F401
from tepokit.stats import pearson, t_interval  # noqa: E402,F401

# The logs: notebooks/logs/ (committed), or the directory named by the TEPO_NOTEBOOK_LOGS environment variable
# (a relative path is taken from the repository root, where train_small.py writes runs/).
LOGS = (REPO / Path(os.environ["TEPO_NOTEBOOK_LOGS"]).expanduser()).resolve() if os.environ.get("TEPO_NOTEBOOK_LOGS") \
    else NB_DIR / "logs"
FIGURES = NB_DIR / "figures"
COMMANDS_FILE = NB_DIR / "logs" / "COMMANDS.md"
LOG_FILES = ("config.json", "metrics.jsonl", "summary.json", "details.jsonl")   # not checkpoints or weights

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
           "clip_cov_clip_cov_ratio=0.01": "Clip-Cov, ratio 0.01", "kl_cov_kl_cov_ratio=0.1": "KL-Cov, ratio 0.1"}
COLORS |= {"grpo_beta=0": plt.cm.tab20.colors[1], "tepo_entropy_criterion=measured": plt.cm.tab20.colors[9],
           "dapo_dynamic_sampling=off": plt.cm.tab20.colors[5],
           "clip_cov_clip_cov_ratio=0.01": COLORS["clip_cov"], "kl_cov_kl_cov_ratio=0.1": COLORS["kl_cov"]}

plt.rcParams.update({"figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3, "font.size": 10,
                     "axes.titlesize": 10, "legend.fontsize": 8})


def shown_path(path: Path) -> str:
    """A path as the notebooks print it: relative to the repository root, so no output shows a machine's
    directories (a logs directory outside the repository is shown by its name only)."""
    path = Path(path).resolve()
    return f"{path.relative_to(REPO)}/" if path.is_relative_to(REPO) else f"<TEPO_NOTEBOOK_LOGS: {path.name}>/"


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
    """{metrics, steps, config, summary, details, planned} of LOGS/<name>, or None when it has no metrics.jsonl."""
    d = LOGS / name
    if not (d / "metrics.jsonl").is_file():
        return None
    run = {"name": name, "metrics": read_log(str(d / "metrics.jsonl"))}
    for key in ("config", "summary"):
        run[key] = json.loads((d / f"{key}.json").read_text()) if (d / f"{key}.json").is_file() else None
    run["details"] = read_log(str(d / "details.jsonl")) if (d / "details.jsonl").is_file() else None
    run["steps"] = [r for r in run["metrics"] if r.get("step", 0) > 0 and "entropy" in r]   # RL steps (row 0: eval)
    run["planned"] = run["config"]["args"]["steps"] if run["config"] else None
    return run


def describe(run: dict) -> str:
    done, planned = len(run["steps"]), run["planned"]
    state = "finished" if run["summary"] else "UNFINISHED (no summary.json)"
    details = "" if run["details"] is None else f", details.jsonl {len(run['details'])} rows"
    return f"{done} of {planned if planned else '?'} steps, {state}{details}"


def series(run: dict, key: str, skip_skipped: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Steps and finite values of one metric (optionally without DAPO-filter steps that made no update)."""
    xs, ys = [], []
    for r in run["metrics"]:
        v = r.get(key)
        if skip_skipped and r.get("dynamic_sampling/skipped", 0) == 1:
            continue
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return np.array(xs), np.array(ys, dtype=float)


def load_regime(regime: str) -> dict[str, dict[int, dict]]:
    """The finished runs of one regime comparison, LOGS/<regime>/<entry>__<seed>: {entry: {seed: run}}."""
    runs: dict[str, dict[int, dict]] = {}
    for d in sorted((LOGS / regime).glob("*__*")) if (LOGS / regime).is_dir() else []:
        entry, seed = d.name.rsplit("__", 1)
        run = load_run(f"{regime}/{d.name}")
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

def smooth(y, window: int) -> np.ndarray:
    """Centred moving average over `window` points; the window shrinks at both ends."""
    y = np.asarray(y, dtype=float)
    if len(y) == 0:
        return y
    half = window // 2
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(len(y))
    lo, hi = np.maximum(0, i - half), np.minimum(len(y), i + half + 1)
    return (c[hi] - c[lo]) / (hi - lo)


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
    (tepokit.stats.t_interval, the one --compare uses). A value of None (e.g. a target never reached) drops that
    seed. Returns t_interval's dict plus `per_seed` and `seeds`."""
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
    with standard error 1/sqrt(n - 3))."""
    half = 1.96 / math.sqrt(n - 3)
    return math.tanh(math.atanh(r) - half), math.tanh(math.atanh(r) + half)


def clearly_nonzero(estimate: float, se: float) -> bool:
    """True when the 95% interval estimate +- 1.96 se leaves out zero."""
    return abs(estimate) > 1.96 * se


# ---- plotting ----------------------------------------------------------------------------------------------

def smoothed_band(ax, x, y, color, label, window: int) -> None:
    """Moving average (line) and the moving standard deviation of single steps around it (band)."""
    m = smooth(y, window)
    sd = np.sqrt(np.maximum(0.0, smooth(np.asarray(y, dtype=float) ** 2, window) - m ** 2))
    ax.fill_between(x, m - sd, m + sd, color=color, alpha=0.15, lw=0)
    ax.plot(x, m, color=color, lw=2, label=label)


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
    """Save a key figure for the README: notebooks/figures/, 110 dpi, RGB (no alpha channel, smaller file),
    no timestamp (the same logs give the same bytes)."""
    from PIL import Image
    try:
        FIGURES.mkdir(exist_ok=True)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        buf.seek(0)
        Image.open(buf).convert("RGB").save(FIGURES / filename, optimize=True)
        print(f"saved notebooks/figures/{filename} ({(FIGURES / filename).stat().st_size // 1024} KB)")
    except OSError as err:
        print(f"could not save {filename}: {err}")
