"""What a run says about itself: summary.json and the block that ends a run, its progress bar (Progress) and the
evaluation line that stays on screen above it, each accuracy with its 95% interval over the problems actually
evaluated."""

from __future__ import annotations

import json
import math
import os

from tqdm.auto import tqdm

from tepokit.plumbing.rundir import code_version, utc_now, write_json
from tepokit.diagnostics.completions import show_completions
from tepokit.diagnostics.stats import MIN_STEPS_FOR_R, accuracy_auc, pearson, wald_half_width
from tepokit.setup.task import HIDDEN_TYPES


def write_summary(run_dir: str, rows: list[dict], args, wall: float, finished: dict | None = None) -> dict:
    """summary.json: start and final held-out accuracy, its area under the curve, final pass@k,
    entropy-change correlation, wall time; when the run started (config.json's started_at) and finished, and the
    code that finished it. finished: the finished_at and code of a summary written before (--compare reads a
    finished run back), else now and the code that runs."""
    evals = [r for r in rows if "eval/accuracy" in r]
    # Steps that made an update (DAPO's filter can skip one: no update, no entropy change to predict), and
    # those of them that ran the entropy check (every --entropy-check-every steps).
    updated = [r for r in rows if r["step"] > 0 and not r.get("dynamic_sampling/skipped")]
    steps = [r for r in updated if "entropy_change/predicted" in r]
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
        "final_entropy": updated[-1]["entropy"] if updated else None,
        "entropy_change_correlation": pearson([r["entropy_change/predicted"] for r in steps],
                                              [r["entropy_change/measured"] for r in steps], MIN_STEPS_FOR_R),
        "entropy_change_position_corr_median": position_corrs[len(position_corrs) // 2] if position_corrs else None,
        "wall_seconds": wall,
    }
    rollouts = [r for r in rows if r["step"] > 0]      # every rollout, also those DAPO's filter left without update
    summary["entropy_start"], summary["entropy_end"] = first_and_last_means(rollouts, "entropy")
    if any("forks/entropy" in r for r in rollouts):     # the hidden-type task (tepokit/diagnostics/forking_tokens.py)
        summary["decision_entropy_start"], summary["decision_entropy_end"] = first_and_last_means(rollouts,
                                                                                                  "forks/entropy")
        summary["strategies_per_group_start"], summary["strategies_per_group_end"] = first_and_last_means(
            rollouts, "forks/strategies_per_group")
        by_type = [k for k in evals[-1] if k.startswith("eval/") and "/" in k[len("eval/"):]]   # eval/pass@2/add
        summary |= {"start_" + k[len("eval/"):]: evals[0][k] for k in by_type if k in evals[0]}
        summary |= {"final_" + k[len("eval/"):]: evals[-1][k] for k in by_type}
        formats = [r["format/valid"] for r in rollouts]     # one rollout: 128 samples; one evaluation: 1,600
        summary |= {"format_eval_min": min(r["eval/format"] for r in evals), "format_rollout_min": min(formats),
                    "format_rollout_mean": sum(formats) / len(formats)}
    if not math.isfinite(summary["entropy_change_correlation"]):       # null in the file: say why
        summary["entropy_change_correlation_missing"] = (f"too few steps: fewer than {MIN_STEPS_FOR_R} with a "
                                                         f"finite entropy check (--entropy-check-every)")
    summary["started_at"] = started_at(run_dir)      # None: a run from before the stamps
    summary |= finished if finished is not None else {"finished_at": utc_now(), "code": code_version()}
    write_json(os.path.join(run_dir, "summary.json"), summary)
    print_summary(summary, rows, args, wall)
    return summary


def started_at(run_dir: str) -> str | None:
    """When the run started, as its config.json says (None if it does not: runs from before the stamps)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            return json.load(f).get("started_at")
    except (OSError, ValueError, AttributeError):
        return None


def first_and_last_means(rows: list[dict], key: str) -> tuple:
    """The means of `key` over the first and over the last tenth of the rows (at least 1, at most 10 rows
    each): one step's value is noisy. (None, None) when no row has it."""
    values = [r[key] for r in rows if math.isfinite(r.get(key, math.nan))]
    if not values:
        return None, None
    span = end_span(len(values))
    return sum(values[:span]) / span, sum(values[-span:]) / span


def end_span(n: int) -> int:
    """How many of n steps make the start or the end of a run: a tenth, at least 1 and at most 10."""
    return max(1, min(10, n // 10))


def accuracy_with_interval(p: float, n: int) -> str:
    """'0.296 +- 0.040': an accuracy over n problems and the half-width of its 95% (Wald) interval. At 0 or 1
    the Wald interval has no width, so the exact one-sided 95% bound is given, 1 - 0.05^(1/n) away (about 3/n,
    the rule of three): '1.000 (>= 0.970)'."""
    if not n:
        return f"{p:.3f}"
    if p in (0.0, 1.0):
        bound = 1 - 0.05 ** (1 / n)
        return f"{p:.3f} (>= {1 - bound:.3f})" if p == 1 else f"{p:.3f} (<= {bound:.3f})"
    return f"{p:.3f} +- {wald_half_width(p, n):.3f}"


def problem_counts(row: dict, args) -> tuple[int, int]:
    """(held-out problems, problems of pass@k) of an evaluation row: those it evaluated, as logged; a log
    written before the counts were logged gives the flags' numbers, which a small test split undercuts."""
    n = row.get("eval/problems", args.n_test)
    return n, row.get("eval/pass_k_problems", min(args.pass_k_problems, n))


def evaluation_line(row: dict, args, entropies: list[float]) -> str:
    """The line an evaluation leaves on screen above the progress bar: held-out accuracy and pass@k with their 95%
    intervals (for pass@k, a mean of per-problem values in [0, 1], the Wald half-width is an upper bound), and the
    token entropy as the mean of the rollouts since the previous line: one step's entropy is too noisy to show a
    trend in a few lines. At step 0 (the start model, no rollout yet) the line says what the intervals are."""
    step, k, (n, sampled) = row["step"], args.pass_k, problem_counts(row, args)
    text = (f"step {step:>4}: held-out accuracy {accuracy_with_interval(row['eval/accuracy'], n)}, "
            f"pass@{k} {accuracy_with_interval(row[f'eval/pass@{k}'], sampled)}")
    if not entropies:
        return text + f" (the start model; +- : 95% intervals over {n} and {sampled} problems)"
    first = step - len(entropies) + 1
    steps = f"step {step}" if first == step else f"steps {first}-{step}"
    return text + f", entropy {sum(entropies) / len(entropies):.3f} (mean of {steps})"


class Progress:
    """A run's progress bar over its steps (`for step in Progress(...)`), each step's reward and entropy on it, and
    at each evaluation a line that stays on screen above it (evaluation_line)."""

    def __init__(self, first_step: int, last_step: int, args):
        self.bar = tqdm(range(first_step, last_step + 1), initial=first_step - 1, total=last_step,
                        desc=f"{args.objective} seed {args.seed}", dynamic_ncols=True)
        self.args = args
        self.entropies = []            # of the rollouts since the last evaluation line: it shows their mean

    def __iter__(self):
        return iter(self.bar)

    def show(self, row: dict) -> None:
        """A step's metrics row: its reward and entropy on the bar; the evaluation line if it has an evaluation."""
        self.bar.set_postfix({"reward": f"{row['reward']:.2f}", "H": f"{row['entropy']:.3f}"})
        self.entropies.append(row["entropy"])
        if "eval/accuracy" in row:
            self.bar.write(evaluation_line(row, self.args, self.entropies))
            self.entropies = []

    def write(self, line: str) -> None:
        """A line that stays on screen above the bar (a warning: tepokit/diagnostics/completions.py)."""
        self.bar.write(line)

    def close(self) -> None:
        self.bar.close()


def print_summary(summary: dict, rows: list[dict], args, wall: float) -> None:
    """The block that ends a run, to stay on screen: what changed (with the uncertainty that the number of
    held-out problems leaves), where the files are, and what to try next."""
    run_dir, k = summary["run_dir"], args.pass_k
    n, sampled = problem_counts([r for r in rows if "eval/accuracy" in r][-1], args)
    masks = [r["kl_mask/frac"] for r in rows if math.isfinite(r.get("kl_mask/frac", math.nan))]
    minutes, seconds = divmod(round(wall), 60)
    rows_out = [("held-out accuracy", f"{accuracy_with_interval(summary['start_accuracy'], n)} -> "
                 f"{accuracy_with_interval(summary['final_accuracy'], n)}  ({summary['gain_points']:+.1f} points; "
                 f"greedy; 95% intervals over {n} problems)"),
                (f"sampled (T={args.temperature:g})", f"{summary['start_sampled_accuracy']:.3f} -> "
                 f"{summary['final_sampled_accuracy']:.3f};  final pass@{k} {summary[f'final_pass@{k}']:.3f}  "
                 f"({k} samples of each of {sampled} problems)")]
    measured = [r for r in rows if r["step"] > 0 and math.isfinite(r.get("entropy", math.nan))]
    if measured:       # means over the first and last tenth of the run: one step's entropy is noisy
        span = end_span(len(measured))
        first, last = summary["entropy_start"], summary["entropy_end"]
        rows_out.append(("token entropy", f"{first:.3f} -> {last:.3f} nats ({100 * (last / first - 1):+.0f}%; "
                         f"{'first and last step' if span == 1 else f'first and last {span} steps'}); "
                         "predicted vs measured change per step: "
                         + (f"r = {r:.2f}" if math.isfinite(r := summary["entropy_change_correlation"])
                            else f"too few steps for r (fewer than {MIN_STEPS_FOR_R} checked)")))
    if summary.get("decision_entropy_start") is not None:       # the hidden-type task
        first, last = summary["decision_entropy_start"], summary["decision_entropy_end"]
        rows_out.append(("decision token", f"entropy {first:.3f} -> {last:.3f} nats ({100 * (last / first - 1):+.0f}%)"
                         f"; strategies per group {summary['strategies_per_group_start']:.2f} -> "
                         f"{summary['strategies_per_group_end']:.2f}; valid format >= {summary['format_eval_min']:.3f} "
                         "(held-out samples)"))
        kinds = [kind for kind in HIDDEN_TYPES if f"final_pass@{k}/{kind}" in summary]   # types among the problems
        rows_out.append((f"pass@{k} by type", ", ".join(
            f"{kind} {summary[f'start_pass@{k}/{kind}']:.3f} -> {summary[f'final_pass@{k}/{kind}']:.3f}"
            for kind in kinds) + "  (start -> end; add is the majority's type)"))
    if masks:
        rows_out.append(("KL mask (TEPO)", f"{100 * sum(masks) / len(masks):.1f}% of tokens on average"))
    compare, notebook = "--compare grpo,tepo --seeds 3", "entropy_dynamics"
    if args.dataset is None and args.task == "hidden-type":
        compare = ("--task hidden-type --compare grpo:beta=0,clip_cov:clip_cov_ratio=0.01 --baseline grpo:beta=0 "
                   "--seeds 3")
        notebook = "entropy_collapse"
    warned = [f"{k[len('warning/'):]} at step {r['step']}" for r in rows for k in r if k.startswith("warning/")]
    if warned:         # the lines said during the run, which may have scrolled away
        rows_out.append(("warnings", ", ".join(warned) + " (docs/metrics.md: warning/*)"))
    rows_out += show_completions(run_dir)      # a few of the last completions logged, one line each
    rows_out += [("files", f"{run_dir}/ (metrics.jsonl, completions.jsonl, summary.json, checkpoint.pt, policy/)"),
                 ("next", f"python -m tepokit.tools.plot {run_dir}   # the run's figures, as PNG files in figures/"),
                 ("", f"python train_small.py {compare}   # two objectives, paired by seed"),
                 ("", f"jupyter lab notebooks/   # entropy_covariance.ipynb first (the derivation), then "
                      f"{notebook}.ipynb with RUN_DIR = \"{run_dir}\"")]
    took = f"{minutes} min {seconds} s" if minutes else f"{seconds} s"
    lines = [f"done: {args.objective}, seed {args.seed}, {rows[-1]['step']} RL steps in {took}"]
    lines += [f"  {label:<20} {text}" for label, text in rows_out]
    print("\n".join(lines), flush=True)
