"""--compare: several objectives x seeds on the same task, and the table of summary.md / summary.json
(means over seeds, and each objective minus the baseline paired by seed, with a 95% interval)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

from tepokit.cli.flags import RUN_ONLY_FIELDS, command_line, objective_config
from tepokit.plumbing.non_finite import Diverged
from tepokit.plumbing.errors import fail, first_line
from tepokit.cli.resume import DEFAULTS_OF_OLDER_CONFIGS
from tepokit.plumbing.rundir import read_log, write_atomically, write_json
from tepokit.diagnostics.stats import t_interval
from tepokit.plumbing.signals import Stopped
from tepokit.diagnostics.summary import write_summary
from tepokit.cli.validation import compare_entries, flag


def compare_objectives(args, obj_overrides: dict, train) -> None:
    """Several objectives x seeds on the same task, sequentially in-process. Writes <out>/summary.md
    and summary.json: per objective the mean and std over seeds, and, paired by seed, each objective
    minus --baseline with a 95% interval (paired_differences). `train` is train_small.py's run (passed
    in: the package does not import the script)."""
    out = args.out or os.path.join("runs", f"compare__{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    seeds = list(range(args.seed, args.seed + args.seeds))
    entries = list(zip(args.compare.split(","), compare_entries(args)))
    run_dirs = [run_dir_of(out, name, seed) for seed in seeds for name, _ in entries]
    for seed in seeds:      # before anything runs: the runs already in --out must be the ones asked for
        for name, (objective, overrides) in entries:
            check_same_settings(run_args(args, objective, seed, run_dir_of(out, name, seed)),
                                {**obj_overrides, **overrides})
    results = {}
    for seed in seeds:      # seed-major: early results cover every objective
        for name, (objective, overrides) in entries:
            try:
                results.setdefault(name, []).append(run_or_resume(args, objective, seed, run_dir_of(out, name, seed),
                                                                  train, {**obj_overrides, **overrides}))
            except Stopped as stop:     # the whole comparison stops; the same command goes on where it stopped
                finished = sum(os.path.exists(os.path.join(d, "summary.json")) for d in run_dirs)
                stop.message = (f"--compare stopped in {run_dir_of(out, name, seed)} with {finished} of "
                                f"{len(run_dirs)} runs finished; go on with: "
                                f"{command_line(args, obj_overrides, out=out)}")
                raise
            except Diverged as diverged:    # a lower --lr is another comparison, not this run's --overwrite
                diverged.message = (f"{run_dir_of(out, name, seed)}: {diverged.message.split(';')[0]}; nothing of "
                                    "that step was saved; start the comparison again with a lower --lr and another "
                                    "--out")
                raise
    if args.stop_after is not None and args.stop_after < args.steps:    # stopped on purpose: nothing to summarise yet
        print(f"--compare stopped after step {args.stop_after} of {args.steps} in {len(run_dirs)} runs, as "
              f"--stop-after asked; go on with: {command_line(args, obj_overrides, out=out, stop_after=None)}")
        return
    table, paired = objective_means(results, args), paired_differences(results, args)
    write_json(os.path.join(out, "summary.json"), {"seeds": seeds, "baseline": args.baseline,
                                                   "target_accuracy": args.target_accuracy, "objectives": table,
                                                   "paired": paired})
    lines = [*objective_table(table, args), "", *paired_table(paired, args, seeds)]
    write_atomically(os.path.join(out, "summary.md"), lambda f: f.write(("\n".join(lines) + "\n").encode()))
    print("\n".join(lines))


def run_dir_of(out: str, name: str, seed: int) -> str:
    """Where --compare puts the run of one entry and seed: tepo:beta=0, seed 1 -> <out>/tepo_beta=0__1."""
    return os.path.join(out, f"{name.replace(':', '_')}__{seed}")


def run_args(args, objective: str, seed: int, run_dir: str):
    """The settings of one run of the comparison: --compare's, for one objective and seed, in its run directory."""
    return dataclasses.replace(args, objective=objective, seed=seed, compare=None, out=run_dir)


def run_or_resume(args, objective: str, seed: int, run_dir: str, train, obj_overrides: dict) -> dict:
    """One run of the comparison, or what is left of it. Rerunning the same --compare command (same --out)
    goes on where it stopped: a finished run is read back (summarised again from its log), an interrupted
    one resumes from its checkpoint, and one stopped before its first checkpoint starts again. So a long
    comparison can also be split across processes (one --compare per subset), then assembled by a last call."""
    run = run_args(args, objective, seed, run_dir)
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        wall = read_part(os.path.join(run_dir, "summary.json"), "wall_seconds")
        rows = read_log(os.path.join(run_dir, "metrics.jsonl"))
        if not any("eval/accuracy" in r for r in rows):
            fail(f"--compare: {os.path.join(run_dir, 'metrics.jsonl')} is missing or holds no evaluation; move "
                 f"{run_dir} away and the same command runs it again (nothing was changed)")
        previous = read_part(os.path.join(run_dir, "summary.json"), None)
        before = {key: previous[key] for key in FINISHED if key in previous}
        return write_summary(run_dir, rows, run, wall, finished=before)
    if os.path.exists(os.path.join(run_dir, "checkpoint.pt")):
        return train(dataclasses.replace(run, resume=run_dir), obj_overrides)
    return train(dataclasses.replace(run, overwrite=True), obj_overrides)    # nothing to keep before checkpoint 0


FINISHED = ("finished_at", "code")        # what a summary says of the run's end: kept when it is read back


def read_part(path: str, key: str | None):
    """`key` of the JSON object in `path`, a file of a run --compare reads back; one line if it is damaged."""
    try:
        with open(path) as f:
            return json.load(f)[key] if key is not None else json.load(f)      # None: the whole object
    except (OSError, ValueError, KeyError, TypeError) as e:     # JSON errors are ValueErrors
        fail(f"--compare: {path} is damaged ({type(e).__name__}: {first_line(e) or 'empty'}); move "
             f"{os.path.dirname(path)} away and the same command runs it again (nothing was changed)")


def check_same_settings(run, obj_overrides: dict) -> None:
    """A run directory of --out that --compare would read back or resume holds a run of the settings asked for
    now: every setting but the run-only ones (RUN_ONLY_FIELDS), and the objective's configuration. Otherwise
    one line naming the run directory and the settings that differ. A directory without config.json (none, or a
    run stopped before writing it) is started afresh."""
    run_dir = run.out
    if not os.path.exists(os.path.join(run_dir, "config.json")):
        return
    saved = read_part(os.path.join(run_dir, "config.json"), "args")
    overrides = read_part(os.path.join(run_dir, "config.json"), "objective_overrides")
    try:
        saved = type(run)(**{**DEFAULTS_OF_OLDER_CONFIGS, **saved})
        saved_cfg, cfg = objective_config(saved, overrides), objective_config(run, obj_overrides)
    except (TypeError, ValueError) as e:       # settings this version does not know, or invalid ones
        fail(f"--compare: {run_dir}/config.json is not a run of this version's settings ({first_line(e)}); choose "
             "another --out (nothing was changed)")
    differ = [f"{flag(name)} {getattr(saved, name)!r} there, {getattr(run, name)!r} now"
              for name in run.__dataclass_fields__ if name not in RUN_ONLY_FIELDS
              and getattr(saved, name) != getattr(run, name)]
    differ += [f"{flag(name)} {getattr(saved_cfg, name)!r} there, {getattr(cfg, name)!r} now"
               for name in cfg.__dataclass_fields__ if getattr(saved_cfg, name) != getattr(cfg, name)]
    if differ:
        fail(f"argument --out: {run_dir} holds a run of other settings ({'; '.join(differ[:4])}"
             f"{'; ...' if len(differ) > 4 else ''}); --compare reuses only runs of the same settings: choose "
             "another --out, or give the settings of the runs there (nothing was changed)")


def objective_means(results: dict, args) -> dict:
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
        correlations = [r["entropy_change_correlation"] for r in runs if r["entropy_change_correlation"] is not None]
        table[name] |= {"steps_to_target": [r["steps_to_target"] for r in runs],
                        "final_entropy_mean": sum(r["final_entropy"] for r in runs) / len(runs),
                        "entropy_change_correlation_mean":   # none: too few steps with the check (short runs)
                            sum(correlations) / len(correlations) if correlations else float("nan"),
                        "wall_seconds_mean": sum(r["wall_seconds"] for r in runs) / len(runs), "runs": runs}
    return table


def objective_table(table: dict, args) -> list[str]:
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


def paired_metrics(pass_k: int, task: str = "arith") -> list[tuple]:
    """What --compare pairs by seed: (key of a run's summary.json, label, factor to the unit shown, format).
    Accuracies and their gains in points (x 100). The hidden-type task adds what tells a collapse: the
    entropy at the decision token and over all tokens at the end (means of the last tenth of the run, at
    most 10 steps) and the minority type's sampled accuracy and pass@k."""
    common = [("gain_points", "final held-out accuracy gain (points)", 1, "+.1f"),
              ("accuracy_auc", "held-out accuracy averaged over the run (points)", 100, "+.1f"),
              ("final_sampled_accuracy", "final sampled accuracy = pass@1 (points)", 100, "+.1f"),
              (f"final_pass@{pass_k}", f"final pass@{pass_k} (points)", 100, "+.1f"),
              ("steps_to_target", "steps to target accuracy", 1, "+.0f"),
              ("final_entropy", "final entropy (nats)", 1, "+.3f")]
    if task != "hidden-type":
        return common
    return common + [("decision_entropy_end", "decision-token entropy at the end (nats)", 1, "+.3f"),
                     ("entropy_end", "mean token entropy at the end (nats)", 1, "+.3f"),
                     (f"final_mean@{pass_k}/mul", "minority type's final sampled accuracy (points)", 100, "+.1f"),
                     (f"final_pass@{pass_k}/mul", f"minority type's final pass@{pass_k} (points)", 100, "+.1f")]


def paired_differences(results: dict, args) -> dict:
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
        for key, label, factor, _ in paired_metrics(args.pass_k, args.task):
            per_seed = [None if r[key] is None or b[key] is None else factor * (r[key] - b[key])
                        for r, b in zip(runs, base)]
            paired[name][key] = {"label": label, "per_seed": per_seed,
                                 **t_interval([d for d in per_seed if d is not None])}
    return paired


def paired_table(paired: dict, args, seeds: list[int]) -> list[str]:
    """The markdown lines of the paired block of summary.md."""
    if not paired:                  # the baseline was not compared, or nothing but the baseline was
        what = ("nothing but the baseline was compared" if args.baseline in args.compare.split(",")
                else f"the baseline {args.baseline!r} (--baseline) is not among the compared objectives")
        return [f"No paired differences: {what}."]
    lines = [f"Paired by seed against {args.baseline} (objective minus {args.baseline} on the same seed), "
             f"mean and 95% interval (t over seeds: mean ± t(0.975, n-1) · std / sqrt(n)):", "",
             f"| objective − {args.baseline} | metric | per seed ({', '.join(map(str, seeds))}) | mean | "
             f"95% interval | seeds |", "|---|---|---|---|---|---|"]
    for name, metrics in paired.items():
        for key, label, _, fmt in paired_metrics(args.pass_k, args.task):
            m = metrics[key]
            per_seed = ", ".join("not reached" if d is None else format(d, fmt) for d in m["per_seed"])
            mean = "-" if m["mean"] is None else format(m["mean"], fmt)
            interval = (f"{m['low']:{fmt}} to {m['high']:{fmt}}" if m["low"] is not None
                        else f"none ({m['n']} seed{'s' * (m['n'] != 1)})")
            lines.append(f"| {name} | {label} | {per_seed} | {mean} | {interval} | {m['n']} |")
    return lines
