"""`python -m tepokit.plot RUN_DIR`: the standard figures of one run of train_small.py, as PNG files in
RUN_DIR/figures/; and the reading and plotting pieces the notebooks share with it (read_run, series, smooth, ...)."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from tepokit.errors import fail, first_line, os_error_line
from tepokit.rundir import DamagedLog, read_log

PROGRAM = "python -m tepokit.plot"


# ---- reading a run directory ------------------------------------------------------------------------------

def read_run(run_dir, name: str | None = None) -> dict | None:
    """{name, metrics, steps, config, summary, details, planned} of a run directory, or None when it has no
    metrics.jsonl. `steps` are the rows of RL steps (row 0 is the start model's evaluation); `details` is
    details.jsonl (TEPO runs only) or None; `planned` the --steps of config.json. A damaged file raises
    ValueError with one line that names it (a damaged .jsonl line: read_log's DamagedLog)."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    run = {"name": name or run_dir.name, "metrics": read_log(str(run_dir / "metrics.jsonl"))}
    for key in ("config", "summary"):
        path = run_dir / f"{key}.json"
        try:
            run[key] = json.loads(path.read_text()) if path.is_file() else None
        except ValueError as e:           # not JSON, or not text
            raise ValueError(f"{path} is damaged ({type(e).__name__}: {first_line(e)})") from e
    run["details"] = read_log(str(run_dir / "details.jsonl")) if (run_dir / "details.jsonl").is_file() else None
    for log, rows in (("metrics.jsonl", run["metrics"]), ("details.jsonl", run["details"] or [])):
        bad = next((n for n, r in enumerate(rows, 1) if not (isinstance(r, dict) and type(r.get("step")) is int)), 0)
        if bad:
            raise ValueError(f"{run_dir / log}, line {bad}: not the row of a step (an object with an integer step)")
    run["steps"] = [r for r in run["metrics"] if r["step"] > 0 and "entropy" in r]
    run["planned"] = setting(run, "steps")
    return run


def setting(run: dict, name: str):
    """A setting of the run's train_small.py Args from its config.json, or None when that is missing."""
    config = run["config"] if isinstance(run["config"], dict) else {}
    return config.get("args", {}).get(name) if isinstance(config.get("args"), dict) else None


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


def per_minibatch(rows: list[dict], key: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values of mini-batch k of a per-mini-batch list of details.jsonl (steps without that mini-batch,
    e.g. all groups filtered, are left out)."""
    points = [(r["step"], r[key][k]) for r in rows if len(r.get(key) or []) > k]
    return np.array([p[0] for p in points]), np.array([p[1] for p in points], dtype=float)


# ---- plotting ---------------------------------------------------------------------------------------------

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


def smoothed_band(ax, x, y, color, label, window: int) -> None:
    """Moving average (line) and the moving standard deviation of single steps around it (band)."""
    m = smooth(y, window)
    sd = np.sqrt(np.maximum(0.0, smooth(np.asarray(y, dtype=float) ** 2, window) - m ** 2))
    ax.fill_between(x, m - sd, m + sd, color=color, alpha=0.15, lw=0)
    ax.plot(x, m, color=color, lw=2, label=label)


def save_png(fig, path) -> int:
    """A figure as a PNG at 110 dpi, RGB (no alpha channel: a smaller file) and without a timestamp, so the same
    logs give the same bytes. Returns the file's size in bytes."""
    from PIL import Image
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    buf.seek(0)
    Image.open(buf).convert("RGB").save(path, optimize=True)
    return os.path.getsize(path)


# ---- the standard figures of one run: each returns a figure, or the note that says why there is none ----------

def window_for(run: dict) -> int:
    """The moving-average window: about a tenth of the run, between 1 and 15 steps."""
    return max(1, min(15, len(run["steps"]) // 10))


def line(n_points: int) -> str:
    """Lines with markers while the points are few enough to see one by one (a single point has no line)."""
    return "o-" if n_points < 30 else "-"


def per_step(ax, run: dict, key: str, color, label: str) -> bool:
    """Single steps (thin) and their moving average with a band; False when the run has no such metric."""
    x, y = series(run, key, skip_skipped=True)
    if len(x):
        ax.plot(x, y, line(len(x)), ms=3, color=color, lw=0.7, alpha=0.35)
        smoothed_band(ax, x, y, color, f"{label} ({window_for(run)}-step mean)", window_for(run))
    return bool(len(x))


def accuracy_and_reward(plt, run: dict):
    x, accuracy = series(run, "eval/accuracy")
    if not len(x):
        return "no eval/accuracy in metrics.jsonl"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(x, accuracy, "o-", color="k", label="greedy (eval/accuracy)")
    k = setting(run, "pass_k")
    for key, style, label in ((f"eval/mean@{k}", "s--", f"one sample at temperature (eval/mean@{k})"),
                              (f"eval/pass@{k}", "^:", f"any of {k} samples (eval/pass@{k})")):
        xs, ys = series(run, key)
        if len(xs):
            left.plot(xs, ys, style, label=label)
    left.set(xlabel="RL step", ylabel="fraction of held-out problems right", title="Held-out accuracy")
    left.legend()
    shown = [per_step(right, run, key, color, label) for key, color, label in
             (("reward", "C0", "reward"), ("accuracy/strict", "C2", "rollout accuracy, strict"))]
    right.set(xlabel="RL step", ylabel="mean over the step's completions", title="Training reward")
    if any(shown):
        right.legend()
    fig.tight_layout()
    return fig


def entropy(plt, run: dict):
    if not len(series(run, "entropy")[0]):
        return "no entropy in metrics.jsonl"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    per_step(left, run, "entropy", "C1", "entropy")
    left.set(xlabel="RL step", ylabel="nats per token", title="Policy entropy of the rollout")
    left.legend()
    if per_step(right, run, "cov/logp_adv", "C3", "Cov(log pi, A)"):
        right.axhline(0, color="k", lw=0.8)
        right.legend()
    right.set(xlabel="RL step", ylabel="covariance", title="Cov(log pi, A): positive drives entropy down")
    fig.tight_layout()
    return fig


def kl_mask(plt, run: dict):
    if run["details"] is None:
        return "no details.jsonl (TEPO runs of the built-in engine write it)"
    rows = run["details"]
    n_minibatches = max((len(r.get("kl_mask_frac_by_minibatch") or []) for r in rows), default=0)
    if not n_minibatches:
        return "details.jsonl has no step with an update"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for k in range(n_minibatches):
        x, y = per_minibatch(rows, "kl_mask_frac_by_minibatch", k)
        left.plot(x, y, line(len(x)), ms=3, color=f"C{k}",
                  label=f"mini-batch {k + 1}" + (" (on-policy: no penalty)" if k == 0 else ""))
    left.set(xlabel="RL step", ylabel="masked / valid completion tokens", title="TEPO's KL mask: share of tokens")
    left.legend()
    x, penalty = series(run, "kl_mask/penalty", skip_skipped=True)
    right.plot(x, penalty, line(len(x)), ms=3, color="C4")
    right.set(xlabel="RL step", ylabel="mean M * |log pi - log pi_old| (nats)", title="kl_mask/penalty")
    fig.tight_layout()
    return fig


def clip_fractions(plt, run: dict):
    keys = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
    if not any(len(series(run, key)[0]) for key in keys):
        return "no clip_ratio/* in metrics.jsonl"
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, color in zip(keys, ("C0", "C3", "k")):
        per_step(ax, run, key, color, key)
    ax.set(xlabel="RL step", ylabel="fraction of completion tokens",
           title="Clipped tokens, mean over the step's mini-batches")
    ax.legend()
    fig.tight_layout()
    return fig


def entropy_change(plt, run: dict):
    x, predicted = series(run, "entropy_change/predicted", skip_skipped=True)
    x_measured, measured = series(run, "entropy_change/measured", skip_skipped=True)
    if not len(x) or list(x) != list(x_measured):
        return "no entropy_change/predicted and /measured in metrics.jsonl"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.scatter(predicted, measured, s=12, c=x, cmap="viridis")
    limit = 1.05 * max(np.abs(predicted).max(), np.abs(measured).max(), 1e-12)
    left.plot([-limit, limit], [-limit, limit], "k--", lw=1, label="measured = predicted")
    left.set(xlim=(-limit, limit), ylim=(-limit, limit), xlabel="predicted -Cov(log p, dz) (nats per token)",
             ylabel="measured H(after) - H(before)", title="Entropy change of each step (colour: RL step)")
    left.legend()
    right.plot(x, predicted, line(len(x)), ms=3, label="predicted")
    right.plot(x, measured, line(len(x)).replace("o", "s") + "-", ms=3, label="measured")
    right.axhline(0, color="k", lw=0.8)
    right.set(xlabel="RL step", ylabel="entropy change (nats per token)", title="Over the run")
    right.legend()
    fig.tight_layout()
    return fig


FIGURES = {"accuracy_reward.png": accuracy_and_reward, "entropy.png": entropy, "kl_mask.png": kl_mask,
           "clip_fractions.png": clip_fractions, "entropy_change.png": entropy_change}


def refuse(message: str) -> None:
    """A user mistake, in one line that names this command (tepokit.errors.fail)."""
    fail(message, program=PROGRAM)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROGRAM, description="Write the standard figures of a run of "
                                     "train_small.py as PNG files into RUN_DIR/figures/.")
    parser.error = refuse
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of train_small.py (its --out)")
    run_dir = Path(parser.parse_args(argv).run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        refuse(f"{run_dir} is not a run directory of train_small.py (it has no metrics.jsonl); give a run's --out")
    try:
        run = read_run(run_dir)
    except DamagedLog as e:
        refuse(str(e))
    except ValueError as e:
        refuse(f"{e}; the run's logs are damaged")
    if not run["metrics"]:
        refuse(f"{run_dir / 'metrics.jsonl'} is empty: the run has not logged its first evaluation yet")
    import matplotlib
    matplotlib.use("Agg")             # files only: no display needed, none opened
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    made = {name: draw(plt, run) for name, draw in FIGURES.items()}
    out = run_dir / "figures"
    try:
        out.mkdir(exist_ok=True)
        for name, figure in made.items():
            if isinstance(figure, str):
                print(f"{name}: skipped, {figure}")
                continue
            for ax in figure.axes:
                if ax.get_xlabel() == "RL step":            # steps are whole numbers, also in a short run
                    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            size = save_png(figure, out / name)
            plt.close(figure)
            print(f"{out / name} ({size // 1024} KB)")
    except OSError as e:
        refuse(os_error_line(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
