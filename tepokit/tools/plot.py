"""`python -m tepokit.tools.plot RUN_DIR`: the standard figures of one run of train_small.py, as PNG files in
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

from tepokit.plumbing.errors import fail, first_line, os_error_line
from tepokit.plumbing.rundir import DamagedLog, read_log
from tepokit.diagnostics.stats import MIN_STEPS_FOR_R, pearson, wald_half_width

PROGRAM = "python -m tepokit.tools.plot"


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


def smoothed_band(ax, x, y, color, label, window: int, band: bool = True) -> None:
    """Moving average (line) and, as a band around it, +-1 standard deviation of the single steps in the same
    centred window (band=False: the line alone)."""
    m = smooth(y, window)
    if band:
        sd = np.sqrt(np.maximum(0.0, smooth(np.asarray(y, dtype=float) ** 2, window) - m ** 2))
        ax.fill_between(x, m - sd, m + sd, color=color, alpha=0.15, lw=0)
    ax.plot(x, m, color=color, lw=2.5, label=label)


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

# Sizes for a projector: text that reads from the back row of a lecture hall.
STYLE = {"font.size": 14, "axes.titlesize": 15, "axes.labelsize": 14, "xtick.labelsize": 13, "ytick.labelsize": 13,
         "legend.fontsize": 12, "figure.titlesize": 16}
FIGURE_SIZES = {"clip_fractions.png": (9, 6)}          # inches; the others have two panels side by side
TWO_PANELS = (13, 6)


def window_for(run: dict) -> int:
    """The moving-average window: about a tenth of the run, between 1 and 15 steps."""
    return max(1, min(15, len(run["steps"]) // 10))


def line(n_points: int) -> str:
    """Lines with markers while the points are few enough to see one by one (a single point has no line)."""
    return "o-" if n_points < 30 else "-"


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 < 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def run_title(run: dict) -> str:
    """The run's identity in one line: objective (and the settings changed from its defaults), regime when not
    the standard one, seed, steps (done of planned while it runs), task, data set and model when set."""
    config = run["config"] if isinstance(run["config"], dict) else {}
    objective = setting(run, "objective")
    overrides = config.get("objective_overrides") or {}
    if objective and isinstance(overrides, dict) and overrides:
        objective += " (" + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in overrides.items()) + ")"
    done, planned = (run["steps"][-1]["step"] if run["steps"] else 0), run["planned"]
    steps = (None if planned is None else f"{planned} steps" if done >= planned else f"{done} of {planned} steps")
    regime = setting(run, "regime")
    parts = [objective, f"{regime} regime" if regime not in (None, "standard") else None,
             None if setting(run, "seed") is None else f"seed {setting(run, 'seed')}", steps,
             None if setting(run, "task") is None else f"task {setting(run, 'task')}",
             None if setting(run, "dataset") is None else f"data set {setting(run, 'dataset')}",
             None if setting(run, "model") is None else f"model {setting(run, 'model')}"]
    return ", ".join(str(p) for p in parts if p) or run["name"]


def new_figure(plt, run: dict, size=TWO_PANELS, panels: int = 2):
    """A figure titled with the run's identity, and its panels: each its own sub-figure, so that each keeps its
    legend below it, outside the data."""
    fig = plt.figure(figsize=size, layout="constrained")
    title = fig.suptitle(run_title(run))
    renderer = fig.canvas.get_renderer()
    width = title.get_window_extent(renderer).width
    if width > 0.97 * fig.bbox.width:            # a long model or data-set name: a smaller font, still one line
        title.set_fontsize(title.get_fontsize() * 0.97 * fig.bbox.width / width)
    subs = list(fig.subfigures(1, panels)) if panels > 1 else [fig]
    return fig, [(sub, sub.subplots()) for sub in subs]


def legend_below(sub, ax, window: int | None = None, band: bool = False, extra=()) -> None:
    """The panel's legend, below it. With `window`, entries that say what the thick lines (moving averages), the
    faint ones (single steps) and the shaded bands are; `extra` adds (handle, label) pairs."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    handles, labels = ax.get_legend_handles_labels()
    for handle, label in extra:
        handles.append(handle)
        labels.append(label)
    if window and window > 1:
        handles += [Line2D([], [], color="0.4", lw=2.5),
                    Line2D([], [], color="0.4", lw=0.8, alpha=0.5, marker="o", ms=3)]
        labels += [f"thick: moving average over {window} steps", "faint: single steps"]
        if band:
            handles.append(Patch(color="0.4", alpha=0.2, lw=0))
            labels.append(f"shaded: \u00b11 s.d. of the single steps in each {window}-step window")
    if handles:
        sub.legend(handles, labels, loc="outside lower center")


def not_measured(ax, text: str) -> None:
    """An empty panel that says why it is empty."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", wrap=True, color="0.3")
    ax.set(xticks=[], yticks=[])


def smoothed(ax, x, y, color, label: str, window: int, band: bool = True, scale: float = 1.0) -> None:
    """Single steps (faint) and their moving average (with its band); a run too short to smooth gets the single
    steps alone."""
    y = np.asarray(y, dtype=float) * scale
    if window <= 1:
        ax.plot(x, y, line(len(x)), ms=4, color=color, lw=2, label=label)
        return
    ax.plot(x, y, line(len(x)), ms=3, color=color, lw=0.8, alpha=0.35)
    smoothed_band(ax, x, y, color, label, window, band=band)


def per_step(ax, run: dict, key: str, color, label: str, band: bool = True, scale: float = 1.0) -> bool:
    """One metric of each step that made an update, smoothed (`smoothed`); False when the run has no such metric."""
    x, y = series(run, key, skip_skipped=True)
    if len(x):
        smoothed(ax, x, y, color, label, window_for(run), band=band, scale=scale)
    return bool(len(x))


def power_of_ten(values) -> int:
    """The exponent that brings the largest |value| to between 1 and 10 (0 when that needs none)."""
    top = float(np.max(np.abs(values))) if len(values) else 0.0
    exponent = math.floor(math.log10(top)) if top > 0 else 0
    return exponent if not 0 <= exponent < 3 else 0


def accuracy_and_reward(plt, run: dict, notes: list):
    from matplotlib.lines import Line2D
    x, accuracy = series(run, "eval/accuracy")
    if not len(x):
        return "no eval/accuracy in metrics.jsonl"
    fig, [(held_sub, held), (train_sub, train)] = new_figure(plt, run)
    k, temperature = setting(run, "pass_k"), setting(run, "temperature")
    n_test, n_sampled = setting(run, "n_test"), setting(run, "pass_k_problems")
    n_sampled = min(n_sampled, n_test) if n_sampled and n_test else None
    last = [r for r in run["metrics"] if "eval/accuracy" in r][-1]      # the problems it evaluated, when logged
    n_test, n_sampled = last.get("eval/problems", n_test), last.get("eval/pass_k_problems", n_sampled)
    sampled = "one sample" + (f" at T={temperature:g}" if temperature is not None else "")
    bounded = False
    for key, n, style, color, label, bound in (
            ("eval/accuracy", n_test, "o-", "k", "greedy: one answer per problem", ""),
            (f"eval/mean@{k}", n_sampled, "s--", "C0", f"{sampled}, mean of {k}", "*"),
            (f"eval/pass@{k}", n_sampled, "^:", "C1", f"any of {k} samples right (pass@{k})", "*")):
        xs, ps = series(run, key)
        if not len(xs):
            notes.append(f"{key} (not in metrics.jsonl)")
            continue
        bars = [wald_half_width(p, n) for p in ps] if n else None
        held.errorbar(xs, ps, yerr=bars, fmt=style, color=color, ms=6, lw=2, capsize=5, elinewidth=1.5,
                      label=f"{label}, {n} problems{bound}" if n else f"{label} (number of problems unknown)")
        bounded = bounded or bool(bound and n)
    held.set(xlabel="RL step", ylabel="fraction of held-out problems right", title="Held-out accuracy")
    bar = Line2D([], [], color="0.3", marker="|", ms=16, ls="")
    bar_text = "bars: 95% interval (Wald)" + (";  *: an upper bound" if bounded else "")
    legend_below(held_sub, held, extra=[(bar, bar_text)])
    window = window_for(run)
    xr, reward = series(run, "reward", skip_skipped=True)
    xa, strict = series(run, "accuracy/strict", skip_skipped=True)
    same = len(xr) and list(xr) == list(xa) and np.allclose(reward, strict, rtol=0, atol=1e-9)
    lines = ([("reward (= strict accuracy here)", xr, reward, "C0")] if same else
             [(label, xs, ys, color) for label, xs, ys, color in (("reward", xr, reward, "C0"),
              ("rollout accuracy, strict", xa, strict, "C2")) if len(xs)])
    for label, xs, ys, color in lines:
        smoothed(train, xs, ys, color, label, window, band=len(lines) == 1)
    train.set(xlabel="RL step", ylabel="mean over the step's completions", title="Training reward")
    if lines:
        legend_below(train_sub, train, window, band=len(lines) == 1)
    else:
        not_measured(train, "no training step logged yet")
        notes.append("training reward (no step logged yet)")
    return fig


def entropy(plt, run: dict, notes: list):
    if not len(series(run, "entropy")[0]):
        return "no entropy in metrics.jsonl"
    fig, [(left_sub, left), (right_sub, right)] = new_figure(plt, run)
    window = window_for(run)
    per_step(left, run, "entropy", "C1", "entropy")
    left.set(xlabel="RL step", ylabel="nats per token, mean over\nthe rollout's completion tokens",
             title="Policy entropy of the rollout")
    legend_below(left_sub, left, window, band=True)
    right.set(title="Cov(log \u03c0, A): positive drives entropy down")
    if per_step(right, run, "cov/logp_adv", "C3", "Cov(log \u03c0, A)"):
        right.axhline(0, color="k", lw=0.8)
        right.set(xlabel="RL step", ylabel="covariance of log-probability and\nadvantage over completion tokens")
        legend_below(right_sub, right, window, band=True)
    else:
        not_measured(right, "not measured in this run")
        notes.append("cov/logp_adv (not in metrics.jsonl)")
    return fig


def kl_mask(plt, run: dict, notes: list):
    if run["details"] is None:
        return "no details.jsonl (TEPO runs of the built-in engine write it)"
    rows = run["details"]
    n_minibatches = max((len(r.get("kl_mask_frac_by_minibatch") or []) for r in rows), default=0)
    if not n_minibatches:
        return "details.jsonl has no step with an update"
    fig, [(left_sub, left), (right_sub, right)] = new_figure(plt, run)
    window = window_for(run)
    for k in range(n_minibatches):
        x, y = per_minibatch(rows, "kl_mask_frac_by_minibatch", k)
        label = (f"{ordinal(k + 1)} optimizer step of the rollout"
                 + ("\n(policy = old policy: mask cannot act)" if k == 0 else ""))
        smoothed(left, x, y, f"C{k}", label, window, band=False)
    left.set(xlabel="RL step", ylabel="masked tokens / completion tokens", title="TEPO's KL mask: share of tokens")
    legend_below(left_sub, left, window)
    x, penalty = series(run, "kl_mask/penalty", skip_skipped=True)
    right.set(title="KL penalty on the masked tokens")
    if len(x):
        exponent = power_of_ten(smooth(penalty, window))
        unit = "nats" if exponent == 0 else f"$10^{{{exponent}}}$ nats"      # 3e-5 nats reads as 3
        smoothed(right, x, penalty, "C4", r"penalty $M \cdot |\log\pi - \log\pi_{\rm old}|$ (M: the mask)", window,
                 scale=10.0 ** -exponent)
        right.set(xlabel="RL step", ylabel=f"{unit} per token, mean over\ntokens and optimizer steps")
        legend_below(right_sub, right, window, band=True)
    else:
        not_measured(right, "not measured in this run")
        notes.append("kl_mask/penalty (not in metrics.jsonl)")
    return fig


def clip_fractions(plt, run: dict, notes: list):
    keys = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
    if not any(len(series(run, key)[0]) for key in keys):
        return "no clip_ratio/* in metrics.jsonl"
    config = run["config"].get("objective_config") if isinstance(run["config"], dict) else None
    eps = config if isinstance(config, dict) else {}
    bound = {side: f" = {1 + sign * eps[f'eps_{side}']:g}" if isinstance(eps.get(f"eps_{side}"), (int, float)) else ""
             for side, sign in (("low", -1), ("high", 1))}
    labels = (f"ratio below 1 \u2212 \u03b5_low{bound['low']}, A < 0",
              f"ratio above 1 + \u03b5_high{bound['high']}, A > 0", "either (all clipped tokens)")
    fig, [(sub, ax)] = new_figure(plt, run, FIGURE_SIZES["clip_fractions.png"], panels=1)
    for key, color, label in zip(keys, ("C0", "C3", "k"), labels):
        if not per_step(ax, run, key, color, label, band=False, scale=100.0):
            notes.append(f"{key} (not in metrics.jsonl)")
    ax.set(xlabel="RL step", ylabel="% of completion tokens, mean\nover the step's optimizer steps",
           title="Clipped tokens: ratio outside the band, no gradient")
    legend_below(sub, ax, window_for(run))
    return fig


def entropy_change(plt, run: dict, notes: list):
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator
    x_predicted, predicted = series(run, "entropy_change/predicted", skip_skipped=True)
    x_measured, measured = series(run, "entropy_change/measured", skip_skipped=True)
    x = np.intersect1d(x_predicted, x_measured)            # the steps that ran the entropy check
    if not len(x):
        return "no entropy_change/predicted and /measured in metrics.jsonl"
    predicted, measured = predicted[np.isin(x_predicted, x)], measured[np.isin(x_measured, x)]
    fig, [(left_sub, left), (right_sub, right)] = new_figure(plt, run)
    r = pearson(list(predicted), list(measured), MIN_STEPS_FOR_R)
    exponent = power_of_ten(np.concatenate([predicted, measured]))
    unit = "nats per token" if exponent == 0 else f"$10^{{{exponent}}}$ nats per token"
    predicted, measured = predicted * 10.0 ** -exponent, measured * 10.0 ** -exponent      # short tick labels
    points = left.scatter(predicted, measured, s=30, c=x, cmap="viridis")
    bar = left_sub.colorbar(points, ax=left, label="RL step")
    bar.locator = MaxNLocator(integer=True)
    bar.update_ticks()
    limit = 1.05 * max(np.abs(predicted).max(), np.abs(measured).max(), 1e-12)
    left.plot([-limit, limit], [-limit, limit], "k--", lw=1, label="measured = predicted")
    left.set(xlim=(-limit, limit), ylim=(-limit, limit), xlabel=f"predicted: \u2212Cov(log p, \u0394z)\n({unit})",
             ylabel=f"measured: H(after) \u2212 H(before)\n({unit})",
             title=f"r = {r:.2f} over {len(x)} checked steps" if math.isfinite(r) else
             f"too few steps for r (fewer than {MIN_STEPS_FOR_R} checked)")
    dot = Line2D([], [], ls="", marker="o", color="C2")
    legend_below(left_sub, left, extra=[(dot, "one checked step (colour: RL step)")])
    every = setting(run, "entropy_check_every")
    right.plot(x, predicted, line(len(x)), ms=5, lw=1.5, label="predicted (first order)")
    right.plot(x, measured, line(len(x)).replace("o", "s") + "-", ms=5, lw=1.5, label="measured")
    right.axhline(0, color="k", lw=0.8)
    right.set(xlabel="RL step", ylabel=f"entropy change of the step\n({unit})",
              title="Each checked step" + (f" (every {ordinal(every)} step)" if every and every > 1 else ""))
    legend_below(right_sub, right)
    return fig


def mechanisms(plt, run: dict, notes: list):
    names = sorted({k.split("/")[1] for r in run["steps"] for k in r
                    if k.startswith("effect/") and k.endswith("/update_change")})
    if not names:
        return "no effect/* in metrics.jsonl (--effect-check-every 0, or a run made before it existed)"
    fig, [(left_sub, left), (right_sub, right)] = new_figure(plt, run)
    x_all, valid = series(run, "effect/tokens", skip_skipped=True)
    for i, name in enumerate(names):
        x, change = series(run, f"effect/{name}/update_change", skip_skipped=True)
        left.plot(x, 100 * change, line(len(x)), ms=4, lw=1.5, color=f"C{i}", label=name)
        x, touched = series(run, f"effect/{name}/tokens", skip_skipped=True)
        right.plot(x, 100 * touched / valid[np.isin(x_all, x)], line(len(x)), ms=4, lw=1.5, color=f"C{i}", label=name)
    left.axhline(5, color="k", lw=0.8, ls="--", label="5% of the gradient's norm")
    left.set_yscale("symlog", linthresh=1)        # from 0 to the hundreds of % a clip makes far off-policy
    left.set_ylim(bottom=0)
    every = int(np.diff(x_all).min()) if len(x_all) > 1 else 0      # the steps measured, read from the log
    checked = f" (every {ordinal(every)} step)" if every > 1 else ""
    left.set(xlabel="RL step", ylabel="|g with − g without| / |g with|, %",
             title="How much each mechanism changed the update" + checked)
    right.set(xlabel="RL step", ylabel="% of completion tokens", title="Tokens whose gradient it changed")
    legend_below(left_sub, left)
    legend_below(right_sub, right)
    return fig


FIGURES = {"accuracy_reward.png": accuracy_and_reward, "entropy.png": entropy, "kl_mask.png": kl_mask,
           "clip_fractions.png": clip_fractions, "entropy_change.png": entropy_change, "mechanisms.png": mechanisms}


def draw(plt, run: dict) -> dict:
    """{file name: (figure or the note why there is none, notes on what the figure leaves out)} of the standard
    figures, drawn in STYLE (plt.rc_context(STYLE) also around saving them keeps their sizes)."""
    from matplotlib.ticker import MaxNLocator
    made = {}
    with plt.rc_context(STYLE):
        for name, draw_figure in FIGURES.items():
            notes = []
            figure = draw_figure(plt, run, notes)
            if not isinstance(figure, str):
                for ax in figure.axes:
                    if ax.get_xlabel() == "RL step":            # steps are whole numbers, also in a short run
                        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            made[name] = (figure, notes)
    return made


def refuse(message: str) -> None:
    """A user mistake, in one line that names this command (tepokit.plumbing.errors.fail)."""
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
    made = draw(plt, run)
    out = run_dir / "figures"
    try:
        out.mkdir(exist_ok=True)
        with plt.rc_context(STYLE):
            for name, (figure, notes) in made.items():
                if isinstance(figure, str):
                    print(f"{name}: skipped, {figure}")
                    continue
                size = save_png(figure, out / name)
                plt.close(figure)
                print(f"{out / name} ({size // 1024} KB" + (f"; without {', '.join(notes)})" if notes else ")"))
    except OSError as e:
        refuse(os_error_line(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
