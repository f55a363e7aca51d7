"""The numbers of docs/collapse.md's section "Why the band explores: the mechanism tested", from the committed logs:

    python -m tepokit.tools.band_numbers [--logs notebooks/logs] [--out FILE.md]

prints (or writes) a markdown report of the runs that section designed before they ran:
  1. each arm's outcome: the seeds that learned the cue (final eval/cue_share >= 0.85), the final pass@1 and cue
     share, and whether it learned at all (pass@1 above the start's);
  2. the five primary comparisons and Holm's correction over them: the band's seed count against each of four
     arms (two-sided Fisher exact test), and in the band's runs the clipped share of the rewarded `*` answers on
     multiplying items minus that of the rewarded `+` answers on adding items over steps 1-150 (paired t over seeds);
  3. the secondary comparisons, without correction: each arm's final pass@1 and cue share minus the band's, paired
     by seed (95% t intervals), and GRPO's seed counts at three learning rates;
  4. what the band clipped, by item x strategy x sign of the advantage (band/ in metrics.jsonl, band.py), over
     steps 1-150 and per window of 50 steps for the four kinds of completion that push the operator;
  5. each run's start, end and commit (config.json, summary.json), to check them against the design's commit.
The run directories are read as tepokit/tools/collapse_numbers.py reads them (`<entry>__<seed>`)."""

from __future__ import annotations

import argparse
import json
import os

from tepokit.diagnostics.stats import fisher_exact_two_sided, holm, paired_t_p, t_interval
from tepokit.tools.collapse_numbers import (final_eval, learned_cue_counts, paired_differences, read_run,
                                            runs_by_seed)

BAND_DIR = "band_mechanism_2026-11-27"
# each arm: (label, comparison directory, entry as a directory name)
ARMS = {
    "band": ("the band (`tepo:beta=0`)", BAND_DIR, "tepo_beta=0"),
    "random": ("random drop, same rate", BAND_DIR, "tepo_beta=0_clip_choice=random"),
    "above": ("clip above only", BAND_DIR, "tepo_beta=0_eps_low=1"),
    "below": ("clip below only", BAND_DIR, "tepo_beta=0_eps_high=1e9"),
    "sgd": ("the band with SGD", "band_mechanism_sgd_2026-11-27", "tepo_beta=0"),
    "grpo_3e-5": ("GRPO, lr 3e-5", "grpo_lr3e-5_cue_400_2026-11-27", "grpo_beta=0"),
    "grpo_1e-4": ("GRPO, lr 1e-4 (earlier runs)", "hidden_type_cue_400_2026-11-26", "grpo_beta=0"),
    "grpo_3e-4": ("GRPO, lr 3e-4", "grpo_lr3e-4_cue_400_2026-11-27", "grpo_beta=0"),
    "band_before": ("the band, earlier runs", "hidden_type_cue_400_2026-11-26", "tepo_beta=0"),
}
PRIMARY_ARMS = ("random", "above", "below", "sgd")
DESIGN_STEPS = 150          # the primary clip-share comparison reads steps 1-150
ITEMS, STRATEGIES, SIGNS = ("add", "mul"), ("add", "mul", "none"), ("pos", "neg")


def arm_runs(logs: str, arm: str) -> dict[int, str]:
    _, directory, entry = ARMS[arm]
    return runs_by_seed(os.path.join(logs, directory), entry)


def finished(runs: dict[int, str]) -> dict[int, str]:
    """The runs that reached their last step (summary.json written)."""
    return {s: p for s, p in runs.items() if os.path.exists(os.path.join(p, "summary.json"))}


def band_totals(path: str, first: int, last: int) -> dict:
    """{(item, strategy, sign): [rows, clipped]} summed over steps first..last of one run's band/ counts."""
    totals = {(i, s, g): [0.0, 0.0] for i in ITEMS for s in STRATEGIES for g in SIGNS}
    for row in read_run(path).rows:
        if first <= row["step"] <= last:
            for (item, strategy, sign), total in totals.items():
                key = f"band/{item}_item/{strategy}/{sign}"
                total[0] += row.get(key + "/rows", 0.0)
                total[1] += row.get(key + "/clipped", 0.0)
    return totals


def clipped_share(totals: dict, key: tuple) -> float:
    rows, clipped = totals[key]
    return clipped / rows if rows else float("nan")


def share_difference(path: str) -> float:
    """Primary comparison 5 for one run: over steps 1-150, the clipped share of rewarded `*` answers on multiplying
    items minus the clipped share of rewarded `+` answers on adding items."""
    totals = band_totals(path, 1, DESIGN_STEPS)
    return clipped_share(totals, ("mul", "mul", "pos")) - clipped_share(totals, ("add", "add", "pos"))


def outcome_rows(logs: str) -> list[str]:
    lines = ["| arm | seeds | learned the cue | final pass@1 | final cue share | pass@1 above the start's |",
             "|---|---|---|---|---|---|"]
    for arm, (label, _, _) in ARMS.items():
        runs = finished(arm_runs(logs, arm))
        if not runs:
            lines.append(f"| {label} | none finished | | | | |")
            continue
        counts = learned_cue_counts(runs)
        pass1 = [final_eval(read_run(p), "eval/pass@1") for p in runs.values()]
        rose = sum(final_eval(read_run(p), "eval/pass@1") > read_run(p).evaluations[0]["eval/pass@1"]
                   for p in runs.values())
        shares = counts["final_shares"]
        lines.append(f"| {label} | {', '.join(map(str, runs))} | {counts['learned']} of {counts['n']} | "
                     f"{min(pass1):.3f}-{max(pass1):.3f} | {min(shares):.2f}-{max(shares):.2f} | "
                     f"{rose} of {len(runs)} |")
    return lines


def primary_rows(logs: str) -> list[str]:
    band = finished(arm_runs(logs, "band"))
    band_count = learned_cue_counts(band) if band else None
    pvalues, text = {}, {}
    for arm in PRIMARY_ARMS:
        runs = finished(arm_runs(logs, arm))
        if band_count is None or not runs:
            continue
        count = learned_cue_counts(runs)
        pvalues[arm] = fisher_exact_two_sided(band_count["learned"], band_count["n"], count["learned"], count["n"])
        text[arm] = (f"the band against {ARMS[arm][0]}",
                     f"{band_count['learned']}/{band_count['n']} against {count['learned']}/{count['n']}")
    if len(band) >= 2:
        per_seed = [share_difference(p) for p in band.values()]
        pvalues["shares"] = paired_t_p(per_seed)
        interval = t_interval(per_seed)
        text["shares"] = ("rewarded `*` on multiplying items minus rewarded `+` on adding items, share clipped, "
                          "steps 1-150 (the band's runs)",
                          f"{interval['mean']:+.3f} ({interval['low']:+.3f} to {interval['high']:+.3f}); per seed "
                          + ", ".join(f"{v:+.3f}" for v in per_seed))
    corrected = holm(pvalues) if pvalues else {}
    lines = ["| comparison | result | p | Holm-adjusted p | survives |", "|---|---|---|---|---|"]
    for name, result in corrected.items():
        label, value = text[name]
        lines.append(f"| {label} | {value} | {result['p']:.4f} | {result['adjusted_p']:.4f} | "
                     f"{'yes' if result['rejected'] else 'no'} |")
    return lines


def secondary_rows(logs: str) -> list[str]:
    band = finished(arm_runs(logs, "band"))
    lines = ["| arm minus the band, paired by seed (points) | final pass@1 | final cue share |", "|---|---|---|"]
    for arm in (*PRIMARY_ARMS, "band_before"):
        runs = finished(arm_runs(logs, arm))
        if not runs or not band:
            continue
        cells = []
        for metric in ("pass@1", "cue_share"):
            d = paired_differences(runs, band, metric)
            cells.append(f"{d['mean']:+.1f} ({d['low']:+.1f} to {d['high']:+.1f})" if d["n"] >= 2 else "")
        lines.append(f"| {ARMS[arm][0]} | {cells[0]} | {cells[1]} |")
    return lines


def band_table(logs: str, arm: str, first: int, last: int) -> list[str]:
    """Rows and share clipped by item x strategy x sign, seeds pooled, over steps first..last."""
    runs = finished(arm_runs(logs, arm))
    pooled = {(i, s, g): [0.0, 0.0] for i in ITEMS for s in STRATEGIES for g in SIGNS}
    for path in runs.values():
        for key, (rows, clipped) in band_totals(path, first, last).items():
            pooled[key][0] += rows
            pooled[key][1] += clipped
    lines = [f"{ARMS[arm][0]}, steps {first}-{last}, seeds pooled ({len(runs)} runs):", "",
             "| item points to | answer chose | advantage | rows | share clipped |", "|---|---|---|---|---|"]
    for (item, strategy, sign), (rows, clipped) in pooled.items():
        if rows:
            lines.append(f"| {item} | {strategy} | {sign} | {rows:.0f} | {clipped / rows:.2f} |")
    return lines


KEY_KINDS = {("add", "add", "pos"): "rewarded +, adding items", ("add", "mul", "neg"): "failed *, adding items",
             ("mul", "mul", "pos"): "rewarded *, multiplying items",
             ("mul", "add", "neg"): "failed +, multiplying items"}


def band_windows(logs: str, arm: str, window: int = 50, last: int = 400) -> list[str]:
    """For the four kinds of completion that push the operator one way or the other: how many the rollouts' second
    optimizer steps held and the share the band clipped, seeds pooled, per window of steps. How many there are
    says what the policy still samples; the share, what the band took out of them."""
    runs = finished(arm_runs(logs, arm))
    head = " | ".join(f"{label}: rows, clipped" for label in KEY_KINDS.values())
    note = " (clipped: what the band would have clipped; the control dropped as many at random)" if arm == "random" \
        else ""
    lines = [f"{ARMS[arm][0]}, seeds pooled ({len(runs)} runs){note}:", "", f"| steps | {head} |",
             "|---" * (1 + len(KEY_KINDS)) + "|"]
    for first in range(1, last + 1, window):
        pooled = {kind: [0.0, 0.0] for kind in KEY_KINDS}
        for path in runs.values():
            totals = band_totals(path, first, first + window - 1)
            for kind in KEY_KINDS:
                pooled[kind][0] += totals[kind][0]
                pooled[kind][1] += totals[kind][1]
        cells = [f"{rows:.0f}, {clipped / rows:.2f}" if rows else "0, -" for rows, clipped in pooled.values()]
        lines.append(f"| {first}-{first + window - 1} | " + " | ".join(cells) + " |")
    return lines


def stamps(logs: str) -> list[str]:
    lines = ["| run | started | finished | commit (uncommitted changes) |", "|---|---|---|---|"]
    for arm in ARMS:
        if arm in ("grpo_1e-4", "band_before"):
            continue
        for path in finished(arm_runs(logs, arm)).values():
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
            with open(os.path.join(path, "summary.json")) as f:
                summary = json.load(f)
            code = config.get("code") or {}
            lines.append(f"| {os.path.relpath(path, logs)} | {config.get('started_at')} | {summary.get('finished_at')}"
                         f" | {str(code.get('commit'))[:12]} ({code.get('uncommitted_changes')}) |")
    return lines


def build_report(logs: str) -> str:
    parts = ["## 1. Each arm", *outcome_rows(logs), "", "## 2. Primary comparisons (Holm over the five)",
             *primary_rows(logs), "", "## 3. Secondary comparisons (no correction)", *secondary_rows(logs), "",
             "## 4. What the band clipped", *band_table(logs, "band", 1, DESIGN_STEPS), "",
             *band_windows(logs, "band"), "", *band_windows(logs, "random"), "",
             "## 5. When each run ran", *stamps(logs)]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", default="notebooks/logs", help="the directory of the committed run logs")
    parser.add_argument("--out", default=None, help="write the report to this file instead of printing it")
    args = parser.parse_args(argv)
    report = build_report(args.logs)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    else:
        print(report, end="")


if __name__ == "__main__":
    main()
