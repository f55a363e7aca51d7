"""The headline numbers of docs/collapse.md for the cue variant and the off-policy regime, recomputed from the
committed logs alone, with p-values and a correction for multiple comparisons:

    python -m tepokit.tools.collapse_numbers [--logs notebooks/logs] [--out FILE.md]

prints (or writes) a markdown report: (a) every paired-by-seed interval the page reports there, its two-sided paired
t p-value, Holm's correction over all of them and within each section, and the page's value beside it; (b) the seeds
that learned the cue, with Fisher's exact test against the entry the page pairs; (c) the "acts" shares of the
mechanism tables over two denominators; (d) what the logs committed small (every 4th step's rows and every
evaluation's) cannot give, such as a mean over the last 10 steps, which only summary.json still holds.

It reads metrics.jsonl and config.json of run directories named `<entry>__<seed>` (as `--compare` writes them), and
summary.json only where the report says so. The functions take run directories, so that comparisons added later can
be read the same way: `paired_differences(runs_by_seed(d, "tepo_beta=0_band=random"), runs_by_seed(d, "tepo_beta=0"),
"pass@1")`, `learned_cue_counts(runs_by_seed(d, entry))`, `mechanism_acts(runs_by_seed(d, entry), "clip_low")`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from typing import Callable

from tepokit.diagnostics.stats import fisher_exact_two_sided, holm, paired_t_p, t_interval
from tepokit.diagnostics.summary import end_span
from tepokit.plumbing.rundir import read_log

CUE_LEARNED = 0.85          # the page's threshold: a final eval/cue_share at or above it learned the cue
ACTS_AT = 0.05              # a mechanism acts when it changes the gradient by 5% of its norm or more
EFFECT_EVERY_DEFAULT = 4    # train_small.py's --effect-check-every when unset


# ---- one run --------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """A run directory: metrics.jsonl's rows, config.json's args; thinned: committed small (fewer rows than steps)."""
    path: str
    rows: list[dict]
    args: dict

    def __post_init__(self):
        self.last_step = self.rows[-1]["step"]
        self.evaluations = [r for r in self.rows if "eval/pass@1" in r]
        self.thinned = len(self.rows) < self.last_step + 1


@functools.lru_cache(maxsize=None)
def read_run(path: str) -> Run:
    with open(os.path.join(path, "config.json")) as f:
        args = json.load(f).get("args", {})
    return Run(path, read_log(os.path.join(path, "metrics.jsonl")), args)


def runs_by_seed(comparison_dir: str, entry: str) -> dict[int, str]:
    """{seed: run directory} of one entry of a comparison (`<entry>__<seed>`; the entry as a directory name:
    `tepo_beta=0`, `clip_cov_clip_cov_ratio=0.01`)."""
    pattern = re.compile(re.escape(entry) + r"__(\d+)")
    names = os.listdir(comparison_dir) if os.path.isdir(comparison_dir) else []
    found = {int(m.group(1)): os.path.join(comparison_dir, n) for n in names if (m := pattern.fullmatch(n))}
    return dict(sorted(found.items()))


def final_eval(run: Run, key: str) -> float:
    return run.evaluations[-1][key]


def end_window(run: Run, key: str) -> tuple[float, int, int]:
    """The mean of `key` over the run's last tenth of steps (at least 1, at most 10: as summary.json's `_end`),
    the rows it had there and the steps it should have had. On a full log the two counts agree."""
    span = end_span(run.last_step)
    values = [r[key] for r in run.rows if r["step"] > run.last_step - span and math.isfinite(r.get(key, math.nan))]
    return sum(values) / len(values), len(values), span


def right_samples(run: Run, row: dict) -> int:
    """pass@1 as the count it is, right samples of pass_k_problems x pass_k (thinned logs keep 4 digits only)."""
    problems = row.get("eval/pass_k_problems", run.args["pass_k_problems"])
    return round(row["eval/pass@1"] * problems * run.args["pass_k"])


def matched_evaluations(run: Run, target: Run) -> list[dict]:
    """The run's evaluations (after step 0) whose pass@1 is nearest the target run's final pass@1, earliest first:
    the page's "matched pass@1" takes one; which, on a tie, the thinned logs cannot say (see d)."""
    want = right_samples(target, target.evaluations[-1])
    candidates = [r for r in run.evaluations if r["step"] > 0]
    distance = {r["step"]: abs(right_samples(run, r) - want) for r in candidates}
    best = min(distance.values())
    return [r for r in candidates if distance[r["step"]] == best]


def summary_value(run: Run, key: str) -> float:
    """A number of the run's summary.json: for what the thinned metrics.jsonl cannot give."""
    with open(os.path.join(run.path, "summary.json")) as f:
        return json.load(f)[key]


# ---- paired differences -----------------------------------------------------------------------------------------
@dataclass
class Measure:
    label: str
    difference: Callable[[Run, Run], float]     # run a minus run b, in the unit (b is a itself for a change)
    end_window_key: str | None = None           # a mean over the last 10 steps of this metric
    summary_key: str | None = None              # the same number as summary.json has it


def final_difference(key: str, scale: float = 100.0) -> Callable[[Run, Run], float]:
    return lambda a, b: scale * (final_eval(a, key) - final_eval(b, key))


def end_window_difference(key: str) -> Callable[[Run, Run], float]:
    return lambda a, b: end_window(a, key)[0] - end_window(b, key)[0]


MEASURES = {
    "pass@1": Measure("final pass@1", final_difference("eval/pass@1")),
    "pass@16": Measure("final pass@16", final_difference("eval/pass@16")),
    "pass@16/mul": Measure("final pass@16, multiplying problems", final_difference("eval/pass@16/mul")),
    "cue_share": Measure("final cue share", final_difference("eval/cue_share")),
    "matched_pass@16": Measure("pass@16 at matched pass@1", lambda a, b: 100 * (
        matched_evaluations(a, b)[0]["eval/pass@16"] - final_eval(b, "eval/pass@16"))),
    "decision_entropy": Measure("decision-token entropy, last 10 steps", end_window_difference("forks/entropy"),
                                "forks/entropy", "decision_entropy_end"),
    "token_entropy": Measure("mean token entropy, last 10 steps", end_window_difference("entropy"),
                             "entropy", "entropy_end"),
    "cue_share_gain": Measure("cue share at the last step minus at step 150", lambda a, _: 100 * (
        final_eval(a, "eval/cue_share") - next(r["eval/cue_share"] for r in a.evaluations if r["step"] == 150))),
}


def paired_differences(dir_a_by_seed: dict[int, str], dir_b_by_seed: dict[int, str] | None, metric: str) -> dict:
    """Run a minus run b on every seed both have, for one of MEASURES (b None: a change within run a): the 95% t
    interval and the two-sided paired t p over the seeds. For a last-10-steps mean over thinned logs, `thinned_rows`
    gives the (rows, steps) of the windows and `from_summary` the same comparison from summary.json."""
    measure = MEASURES[metric]
    dir_b_by_seed = dir_b_by_seed if dir_b_by_seed is not None else dir_a_by_seed
    seeds = [s for s in dir_a_by_seed if s in dir_b_by_seed]
    pairs = [(read_run(dir_a_by_seed[s]), read_run(dir_b_by_seed[s])) for s in seeds]
    per_seed = [measure.difference(a, b) for a, b in pairs]
    out = {"metric": metric, "seeds": seeds, "per_seed": per_seed, **t_interval(per_seed),
           "p": paired_t_p(per_seed), "thinned_rows": None, "from_summary": None}
    if measure.end_window_key and any(run.thinned for pair in pairs for run in pair):
        out["thinned_rows"] = sorted({end_window(run, measure.end_window_key)[1:] for pair in pairs for run in pair})
        from_summary = [summary_value(a, measure.summary_key) - summary_value(b, measure.summary_key) for a, b in pairs]
        out["from_summary"] = {"per_seed": from_summary, **t_interval(from_summary), "p": paired_t_p(from_summary)}
    return out


# ---- the cue, and the mechanisms ----------------------------------------------------------------------------------
def learned_cue_counts(run_dirs: list[str] | dict[int, str], threshold: float = CUE_LEARNED) -> dict:
    """How many runs end with `eval/cue_share` >= threshold, out of the runs, with each run's final share."""
    paths = list(run_dirs.values()) if isinstance(run_dirs, dict) else list(run_dirs)
    shares = [final_eval(read_run(p), "eval/cue_share") for p in paths]
    return {"learned": sum(s >= threshold for s in shares), "n": len(shares), "final_shares": shares}


def gradient_is_zero(row: dict, mechanism: str) -> bool:
    """The gradient with the mechanism was 0: metrics.md says both update_change and update_cosine are logged 0."""
    return row[f"effect/{mechanism}/update_change"] == 0 and row[f"effect/{mechanism}/update_cosine"] == 0


def had_gradient(row: dict) -> bool:
    """The measured mini-batch had a gradient with or without the mechanisms: not (the gradient with them is 0 and
    no mechanism changed a token). Every advantage 0 (a mini-batch of groups that agree) logs exactly that."""
    mechanisms = [k.split("/")[1] for k in row if k.startswith("effect/") and k.endswith("/update_change")]
    return not all(gradient_is_zero(row, m) and row[f"effect/{m}/tokens"] == 0 for m in mechanisms)


def took_whole_gradient(row: dict, mechanism: str) -> bool:
    return gradient_is_zero(row, mechanism) and row[f"effect/{mechanism}/tokens"] > 0


def mechanism_acted(row: dict, mechanism: str) -> bool:
    """It changed the gradient by ACTS_AT of its norm or more, or took the whole gradient away."""
    return row[f"effect/{mechanism}/update_change"] >= ACTS_AT or took_whole_gradient(row, mechanism)


def checked_update_steps(run: Run) -> tuple[list[int], list[int]]:
    """The steps the design checks: every --effect-check-every-th step that made an update (not
    `dynamic_sampling/skipped`), and of them those whose row lacks the effect/ keys."""
    every = run.args.get("effect_check_every") or EFFECT_EVERY_DEFAULT
    by_step = {r["step"]: r for r in run.rows}
    checked = [s for s in range(every, run.last_step + 1, every)
               if s in by_step and not by_step[s].get("dynamic_sampling/skipped")]
    return checked, [s for s in checked if not any(k.startswith("effect/") for k in by_step[s])]


def mechanism_acts(run_dirs: list[str] | dict[int, str], mechanism: str) -> dict:
    """On how many checked steps the mechanism acted, pooled over runs, out of `with_gradient` (the page's: those
    whose measured mini-batch had a gradient) and out of `checked` (the design's: every checked step that made an
    update). The median change is the page's: over `with_gradient` but the `took_all` steps (unbounded)."""
    paths = list(run_dirs.values()) if isinstance(run_dirs, dict) else list(run_dirs)
    acts = with_gradient = checked = took_all = without_effect = 0
    changes = []
    for path in paths:
        run = read_run(path)
        steps, missing = checked_update_steps(run)
        checked += len(steps)
        without_effect += len(missing)
        for row in (r for r in run.rows if r["step"] in set(steps) - set(missing)):
            if had_gradient(row):
                with_gradient += 1
                acts += mechanism_acted(row, mechanism)
                took_all += took_whole_gradient(row, mechanism)
                changes += [] if took_whole_gradient(row, mechanism) else [row[f"effect/{mechanism}/update_change"]]
    return {"acts": acts, "with_gradient": with_gradient, "checked": checked, "checked_without_effect": without_effect,
            "took_all": took_all, "median_change": statistics.median(changes) if changes else math.nan}


# ---- what the page reports ----------------------------------------------------------------------------------------
CUE150, CUE400 = "hidden_type_cue_2026-11-26", "hidden_type_cue_400_2026-11-26"
ONE_UPDATE, OFF_POLICY = "hidden_type_cue_400_one_update_2026-11-26", "hidden_type_off_policy_2026-11-26"
CLIP_COV_CONTROL = "clip_cov_control_2026-11-26"
GRPO0, TEPO0 = "grpo_beta=0", "tepo_beta=0"
CLIP_COV, CLIP_COV0 = "clip_cov_clip_cov_ratio=0.01", "clip_cov_clip_cov_ratio=0"
KL_COV, KL_COV0, EPS_HIGH = "kl_cov_kl_cov_ratio=0.1", "kl_cov_kl_cov_ratio=0.1_beta=0", "grpo_beta=0_eps_high=0.28"
SCALED_BOUNDS = "clip_cov_clip_cov_ratio=0.01_clip_cov_lb=0.02_clip_cov_ub=0.1"
ONE_AT_A_TIME = ["tepo_beta=0_eps_low=0.2_eps_high=0.2", "tepo_beta=0_aggregation=seq-mean-token-mean",
                 "tepo_beta=0_dynamic_sampling=off"]
FOUR = ("pass@1", "pass@16", "cue_share", "matched_pass@16")

# (section, directory of a, directory of b, measures, [(entry a, entry b or None for a change within a,
# the page's "mean (low to high)" of each measure, separated by "|")]), as docs/collapse.md states them.
PAGE_TABLES = [
    ("A variant where exploring pays", CUE150, CUE150, FOUR, [
        (CLIP_COV, GRPO0, "+1.8 (-5.9 to +9.5)|+14.4 (+3.9 to +24.9)|+3.3 (-5.9 to +12.4)|+15.0 (+3.8 to +26.2)"),
        ("tepo", GRPO0, "+2.5 (-2.1 to +7.2)|+10.0 (+1.0 to +19.0)|+5.3 (-3.8 to +14.5)|+10.2 (+6.9 to +13.5)")]),
    ("400 steps, each remedy against its own control", CUE400, CUE400, FOUR, [
        (EPS_HIGH, GRPO0, "-0.0 (-0.1 to +0.1)|-0.2 (-0.8 to +0.4)|+0.0 (-0.0 to +0.1)|+0.0 (-1.5 to +1.5)"),
        (CLIP_COV, GRPO0, "+13.8 (+4.3 to +23.2)|+13.2 (+3.9 to +22.5)|+19.2 (+5.9 to +32.4)|+16.0 (+3.9 to +28.1)"),
        (CLIP_COV0, GRPO0, "-0.1 (-0.5 to +0.4)|-0.6 (-1.7 to +0.5)|+0.1 (+0.0 to +0.3)|-0.4 (-1.5 to +0.7)"),
        ("tepo", GRPO0, "+16.8 (+15.8 to +17.8)|+17.2 (+16.2 to +18.2)|+23.8 (+23.5 to +24.1)|+12.8 (+9.1 to +16.5)"),
        (TEPO0, GRPO0, "+17.2 (+16.4 to +18.0)|+17.6 (+15.7 to +19.5)|+23.5 (+23.1 to +24.0)|+6.4 (+1.4 to +11.4)"),
        (KL_COV, GRPO0, "+6.4 (-4.4 to +17.2)|+7.6 (-5.9 to +21.1)|+9.2 (-6.5 to +24.9)|+1.6 (-1.0 to +4.2)"),
        (KL_COV0, GRPO0, "+0.0 (-0.4 to +0.4)|-0.4 (-2.3 to +1.5)|+0.1 (-0.0 to +0.3)|-0.8 (-2.4 to +0.8)")]),
    ("400 steps, each remedy against its own control", CUE400, CUE400, FOUR[:3], [
        (CLIP_COV, CLIP_COV0, "+13.8 (+4.3 to +23.3)|+13.8 (+4.1 to +23.5)|+19.0 (+5.8 to +32.3)"),
        ("tepo", TEPO0, "-0.4 (-1.9 to +1.1)|-0.4 (-2.3 to +1.5)|+0.3 (-0.2 to +0.8)"),
        (KL_COV, KL_COV0, "+6.4 (-4.7 to +17.5)|+8.0 (-5.7 to +21.7)|+9.1 (-6.6 to +24.8)")]),
    ("400 steps, each remedy against its own control", CUE400, CUE400, ("cue_share_gain",), [
        (GRPO0, None, "+0.1 (-0.1 to +0.2)"), (EPS_HIGH, None, "+0.2 (-0.0 to +0.4)"),
        (CLIP_COV, None, "+16.0 (+1.9 to +30.0)"), (CLIP_COV0, None, "-0.0 (-0.2 to +0.2)"),
        ("tepo", None, "+18.6 (+9.7 to +27.4)"), (TEPO0, None, "+22.8 (+20.4 to +25.1)"),
        (KL_COV, None, "+9.2 (-6.6 to +25.0)"), (KL_COV0, None, "-0.0 (-0.3 to +0.3)")]),
    ("Clip-Cov with its bounds scaled to its ratio", CUE400, CUE400, FOUR[:3], [
        (SCALED_BOUNDS, CLIP_COV, "-12.9 (-22.1 to -3.8)|-11.4 (-21.5 to -1.3)|-17.4 (-30.4 to -4.5)"),
        (SCALED_BOUNDS, CLIP_COV0, "+0.9 (-1.4 to +3.2)|+2.4 (-3.8 to +8.6)|+1.6 (-2.8 to +6.0)")]),
    ("What in TEPO's entry explores: one setting at a time", CUE400, CUE400, ("pass@1", "cue_share"), [
        (ONE_AT_A_TIME[0], TEPO0, "-17.2 (-18.2 to -16.3)|-23.4 (-23.9 to -23.0)"),
        (ONE_AT_A_TIME[1], TEPO0, "-5.0 (-13.1 to +3.1)|-5.7 (-18.0 to +6.5)"),
        (ONE_AT_A_TIME[2], TEPO0, "-0.5 (-1.8 to +0.8)|+0.1 (-0.7 to +0.9)")]),
    ("Only a smaller update? (one optimizer step per rollout)", ONE_UPDATE, CUE400, ("pass@1", "cue_share"), [
        (GRPO0, GRPO0, "-0.2 (-0.8 to +0.4)|+0.0 (-0.2 to +0.2)"),
        (GRPO0, TEPO0, "-17.4 (-18.4 to -16.5)|-23.5 (-24.0 to -23.0)")]),
    ("The remedies against GRPO, five seeds (step 4)", OFF_POLICY, OFF_POLICY,
     ("pass@1", "pass@16", "matched_pass@16", "decision_entropy"), [
        (CLIP_COV, GRPO0, "+1.0 (-6.0 to +8.0)|+0.4 (-1.7 to +2.5)|+0.6 (-0.5 to +1.7)|-0.010 (-0.016 to -0.004)"),
        (KL_COV, GRPO0, "+0.3 (-3.2 to +3.7)|+0.0 (-1.5 to +1.5)|-0.0 (-2.0 to +2.0)|+0.004 (-0.029 to +0.037)"),
        ("tepo", GRPO0, "+1.8 (-3.0 to +6.5)|+0.6 (-4.9 to +6.1)|+3.2 (-6.9 to +13.3)|+0.020 (-0.010 to +0.051)"),
        (TEPO0, GRPO0, "+2.0 (-2.1 to +6.1)|+0.8 (-1.6 to +3.2)|+1.6 (-1.3 to +4.5)|+0.008 (+0.004 to +0.012)")]),
    ("TEPO's mask on against off (step 3)", OFF_POLICY, OFF_POLICY,
     ("decision_entropy", "token_entropy", "pass@1", "pass@16", "pass@16/mul"), [
        ("tepo", TEPO0, "+0.013 (-0.017 to +0.043)|+0.0005 (-0.0030 to +0.0040)|-0.2 (-3.3 to +2.8)|"
                        "-0.2 (-4.8 to +4.4)|+0.7 (-9.2 to +10.5)")]),
    ("Clip-Cov against its own control (standard preset; not in the brief's list)", CLIP_COV_CONTROL, CLIP_COV_CONTROL,
     ("decision_entropy", "pass@1", "pass@16", "pass@16/mul"), [
        (CLIP_COV, CLIP_COV0, "+0.348 (+0.059 to +0.637)|-5.9 (-10.4 to -1.4)|+16.6 (-0.2 to +33.4)|"
                              "+55.3 (-4.2 to +114.9)")]),
]

# The page's counts of seeds that learned the cue, where it states them (the pairs tested are those of PAGE_TABLES).
PAGE_CUE_COUNTS = {(CUE400, e): k for e, k in [(GRPO0, 0), (EPS_HIGH, 0), (CLIP_COV, 4), (CLIP_COV0, 0), ("tepo", 5),
                                                (TEPO0, 5), (KL_COV, 2), (KL_COV0, 0), (SCALED_BOUNDS, 0),
                                                (ONE_AT_A_TIME[0], 0), (ONE_AT_A_TIME[1], 4), (ONE_AT_A_TIME[2], 5)]}
PAGE_CUE_COUNTS[ONE_UPDATE, GRPO0] = 0

# The mechanism tables: (table, directory, entry, seeds or None for all, mechanism, the page's "acts on").
MECHANISM_ROWS = [
    *[("off-policy step 2", OFF_POLICY, entry, seeds, mechanism, page) for entry, seeds, mechanism, page in [
        ("tepo", (1,), "kl_mask", "31/36"), ("tepo", (2,), "kl_mask", "26/34"), ("tepo", (3,), "kl_mask", "31/36"),
        ("tepo", (4,), "kl_mask", "32/37"), ("tepo", (5,), "kl_mask", "30/35"), ("tepo", (1,), "clip_high", "22/36"),
        ("tepo", (1,), "clip_low", "25/36"), (KL_COV, (1,), "kl_cov", "37/37"), (CLIP_COV, (1,), "clip_cov", "11/32"),
        (EPS_HIGH, (1,), "clip_high", "1/9"), (GRPO0, (1,), "clip_high", "1/12"), (GRPO0, (1,), "clip_low", "10/12")]],
    ("off-policy step 4 (text)", OFF_POLICY, GRPO0, None, "clip_high", "17/64"),
    *[("cue, 400 steps", CUE400, entry, None, mechanism, page) for entry, mechanism, page in [
        (GRPO0, "clip_high", "15/249"), (GRPO0, "clip_low", "107/249"), (EPS_HIGH, "clip_high", "15/268"),
        (CLIP_COV, "clip_cov", "253/410"), ("tepo", "kl_mask", "357/454"), ("tepo", "clip_high", "258/454"),
        ("tepo", "clip_low", "433/454"), (TEPO0, "clip_high", "273/454"), (TEPO0, "clip_low", "418/454"),
        (KL_COV, "kl_cov", "355/391"), (SCALED_BOUNDS, "clip_cov", "10/331")]],
]


@dataclass
class Comparison:
    section: str
    dir_a: str
    entry_a: str
    dir_b: str
    entry_b: str | None
    metric: str
    page: str

    @property
    def name(self) -> str:
        against = f" minus {self.entry_b}" if self.entry_b else ""
        where = f" ({os.path.basename(self.dir_a)})" if self.dir_a != self.dir_b else ""
        return f"{self.entry_a}{where}{against}: {MEASURES[self.metric].label}"


def page_comparisons(logs: str) -> list[Comparison]:
    """Every interval of PAGE_TABLES, one Comparison each."""
    out = []
    for section, dir_a, dir_b, metrics, rows in PAGE_TABLES:
        for entry_a, entry_b, pages in rows:
            for metric, page in zip(metrics, pages.split("|"), strict=True):
                out.append(Comparison(section, os.path.join(logs, dir_a), entry_a, os.path.join(logs, dir_b),
                                      entry_b, metric, page))
    return out


# ---- the report -----------------------------------------------------------------------------------------------------
def parse_page_interval(page: str) -> tuple[tuple[float, ...], int]:
    """"+13.8 (+4.3 to +23.2)" -> ((13.8, 4.3, 23.2), 1 decimal)."""
    match = re.fullmatch(r"(\S+) \((\S+) to (\S+)\)", page.strip())
    return tuple(float(g) for g in match.groups()), len(match.group(1).partition(".")[2])


def interval_text(result: dict, decimals: int) -> str:
    mean, low, high = (f"{result[k]:+.{decimals}f}" for k in ("mean", "low", "high"))
    return f"{mean} ({low} to {high})"


def page_check(page: str, result: dict) -> str:
    """'=' when the recomputed interval rounds to the page's, '~' when one of mean, low and high is one off in the
    last digit (rounding), else by how much the farthest of them differs."""
    numbers, decimals = parse_page_interval(page)
    off = max(abs(round(result[k], decimals) - n) for k, n in zip(("mean", "low", "high"), numbers))
    unit = 10 ** -decimals
    return "=" if off < unit / 2 else "~" if off < 1.5 * unit else f"**differs by {off:.{decimals}f}**"


def p_text(p: float, bold: bool = False) -> str:
    text = "nan" if math.isnan(p) else f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"
    return f"**{text}**" if bold else text


def holm_tables(comparisons: list[Comparison], results: list[dict]) -> tuple:
    """Holm over the whole family and within each section, keyed `section | name`."""
    keys = [f"{c.section} | {c.name}" for c in comparisons]
    pvalues = {k: r["p"] for k, r in zip(keys, results)}
    within = {}
    for section in dict.fromkeys(c.section for c in comparisons):
        within |= holm({k: p for k, p in pvalues.items() if k.startswith(section + " | ")})
    return keys, holm(pvalues), within


def intervals_report(comparisons: list[Comparison], results: list[dict]) -> list[str]:
    # the page's statistic: summary.json's where a last-10-steps mean meets thinned logs (d), else metrics.jsonl's
    pages = [r["from_summary"] or r for r in results]
    keys, family, within = holm_tables(comparisons, pages)
    lines = [f"## a. The paired intervals: {len(comparisons)} found", "",
             "Per seed, mean and 95% t interval, two-sided paired t p, Holm's adjusted p over all intervals and within "
             "the section (**bold**: rejected at 0.05), the page's value and the check (=: equal after rounding; ~: "
             "one off in the last digit). Points, except the entropies (nats). Rows marked summary.json: see d.", ""]
    for section in dict.fromkeys(c.section for c in comparisons):
        members = [i for i, c in enumerate(comparisons) if c.section == section]
        lines += [f"### {section} ({len(members)} intervals)", "",
                  "| comparison | per seed | mean (95% interval) | p | Holm, all | Holm, section | page | check |",
                  "|---|---|---|---|---|---|---|---|"]
        for i in members:
            c, r, key = comparisons[i], pages[i], keys[i]
            decimals = parse_page_interval(c.page)[1]
            source = " (summary.json)" if results[i]["from_summary"] else ""
            lines.append(f"| {c.name}{source} | {', '.join(f'{v:+.{decimals}f}' for v in r['per_seed'])} | "
                         f"{interval_text(r, decimals)} | {p_text(r['p'])} | "
                         f"{p_text(family[key]['adjusted_p'], family[key]['rejected'])} | "
                         f"{p_text(within[key]['adjusted_p'], within[key]['rejected'])} | {c.page} | "
                         f"{page_check(c.page, r)} |")
        lines.append("")
    survivors = [k for k in keys if family[k]["rejected"]]
    metrics_only = holm_tables(comparisons, results)[1]
    lines += [f"**Holm over all {len(keys)} intervals at 0.05: {len(survivors)} survive** (uncorrected, "
              f"{sum(r['p'] < 0.05 for r in pages)} have p < 0.05):", ""]
    lines += [f"- {k}: adjusted p {p_text(family[k]['adjusted_p'])}" for k in survivors]
    lines += ["", f"With the every-4th-step rows in place of summary.json for the thinned means (d), "
              f"{sum(v['rejected'] for v in metrics_only.values())} survive: "
              + "; ".join(k for k, v in metrics_only.items() if v["rejected"] != family[k]["rejected"])
              + " changes.", ""]
    return lines


def cue_report(comparisons: list[Comparison]) -> list[str]:
    lines = ["## b. Seeds that learned the cue (final `eval/cue_share` >= 0.85)", "",
             "| directory | entry | learned | final cue shares | page |", "|---|---|---|---|---|"]
    # the pairs the page compares on the cue variant, in its order
    pairs = list(dict.fromkeys((c.dir_a, c.entry_a, c.dir_b, c.entry_b) for c in comparisons
                               if c.entry_b and "cue_share" in c.metric))
    counts = {}
    for directory, entry in dict.fromkeys([p[:2] for p in pairs] + [p[2:] for p in pairs]):
        got = counts[directory, entry] = learned_cue_counts(runs_by_seed(directory, entry))
        page = PAGE_CUE_COUNTS.get((os.path.basename(directory), entry))
        check = "" if page is None else f"{page} of 5 " + ("=" if page == got["learned"] else "**differs**")
        lines.append(f"| {os.path.basename(directory)} | {entry} | {got['learned']}/{got['n']} | "
                     f"{', '.join(f'{v:.2f}' for v in got['final_shares'])} | {check} |")
    lines += ["", "Fisher's exact test, two-sided, of the counts the page pairs:", "",
              "| entry | against | counts | p |", "|---|---|---|---|"]
    for dir_a, entry_a, dir_b, entry_b in pairs:
        a, b = counts[dir_a, entry_a], counts[dir_b, entry_b]
        p = fisher_exact_two_sided(a["learned"], a["n"], b["learned"], b["n"])
        lines.append(f"| {entry_a} ({os.path.basename(dir_a)}) | {entry_b} ({os.path.basename(dir_b)}) | "
                     f"{a['learned']}/{a['n']} vs {b['learned']}/{b['n']} | {p_text(p)} |")
    return lines + [""]


def mechanisms_report(logs: str) -> list[str]:
    lines = ["## c. Which mechanisms act: two denominators", "",
             "Acts: `effect/<mechanism>/update_change` >= 0.05, or it took the whole gradient away (change and "
             "cosine logged 0, its tokens > 0). (i) the page's denominator: checked steps whose mini-batch had a "
             "gradient (not every mechanism at change 0, cosine 0, tokens 0: all advantages 0). (ii) the design's: "
             "every checked step that made an update. Median change over (i) but the steps it took all of.", "",
             "| table | entry | seeds | mechanism | page | (i) | (ii) | median change | took it all |",
             "|---|---|---|---|---|---|---|---|---|"]
    for table, directory, entry, seeds, mechanism, page in MECHANISM_ROWS:
        dirs = {s: d for s, d in runs_by_seed(os.path.join(logs, directory), entry).items()
                if seeds is None or s in seeds}
        got = mechanism_acts(dirs, mechanism)
        share = {n: f"{got['acts']}/{got[n]} ({100 * got['acts'] / max(1, got[n]):.0f}%)"
                 for n in ("with_gradient", "checked")}
        check = "" if page == f"{got['acts']}/{got['with_gradient']}" else " **differs**"
        missing = f", {got['checked_without_effect']} without effect/" if got["checked_without_effect"] else ""
        lines.append(f"| {table} | {entry} | {','.join(map(str, dirs))} | {mechanism} | {page} | "
                     f"{share['with_gradient']}{check} | {share['checked']}{missing} | "
                     f"{100 * got['median_change']:,.0f}% | {got['took_all']} |")
    return lines + [""]


def unrecomputable_report(logs: str, comparisons: list[Comparison], results: list[dict]) -> list[str]:
    lines = ["## d. What metrics.jsonl cannot give", "", "Runs committed small (every 4th step's and every "
             "evaluation's rows, 4 significant digits):", ""]
    for directory in (CUE150, CUE400, ONE_UPDATE, OFF_POLICY, CLIP_COV_CONTROL):
        names = sorted(n for n in os.listdir(os.path.join(logs, directory)) if "__" in n)
        thinned = [n for n in names if read_run(os.path.join(logs, directory, n)).thinned]
        listed = "all" if len(thinned) == len(names) else ", ".join(thinned) or "none"
        lines.append(f"- {directory}: {len(thinned)} of {len(names)} runs ({listed})")
    lines += ["", "1. Means over the last 10 steps on thinned logs: the rows left in the window (rows of steps, per "
              "run) give another statistic; summary.json, written before thinning, is the only place the page's "
              "number still is (part a shows it). So do the step-4 table's entropy ranges of seeds 2-5.", "",
              "| comparison | rows in the window | every-4th-step rows | p | summary.json | p | page |",
              "|---|---|---|---|---|---|---|"]
    for c, r in zip(comparisons, results):
        if r["from_summary"]:
            decimals = parse_page_interval(c.page)[1]
            windows = ", ".join(f"{rows} of {steps}" for rows, steps in r["thinned_rows"])
            lines.append(f"| {c.name} | {windows} | {interval_text(r, decimals)} | {p_text(r['p'])} | "
                         f"{interval_text(r['from_summary'], decimals)} | {p_text(r['from_summary']['p'])} | "
                         f"{c.page} |")
    lines += ["", "2. Pass@16 at matched pass@1 when evaluations tie (pass@1 is a count of right samples out of "
              "1,600): the logs at full precision broke ties by floating-point noise, which the 4 digits kept do "
              "not hold; this tool takes the earliest. Ties (seed: the tied evaluations' pass@16, earliest first):", ""]
    for c in (c for c in comparisons if c.metric == "matched_pass@16"):
        a, b = runs_by_seed(c.dir_a, c.entry_a), runs_by_seed(c.dir_b, c.entry_b)
        ties = {s: matched_evaluations(read_run(a[s]), read_run(b[s])) for s in a if s in b}
        tied = {s: t for s, t in ties.items() if len(t) > 1}
        text = "; ".join(f"{s}: " + "/".join(f"{r['eval/pass@16']:.2f}" for r in t) for s, t in tied.items())
        lines += [f"- {c.section} | {c.name}: {text}"] if text else []
    return lines + [""]


def build_report(logs: str) -> str:
    comparisons = page_comparisons(logs)
    results = [paired_differences(runs_by_seed(c.dir_a, c.entry_a), c.entry_b and runs_by_seed(c.dir_b, c.entry_b),
                                  c.metric) for c in comparisons]
    lines = ["# docs/collapse.md recomputed from the committed logs", "", f"`python -m tepokit.tools.collapse_numbers "
             f"--logs {logs}`: metrics.jsonl and config.json of each run; summary.json only where part d says.", ""]
    lines += intervals_report(comparisons, results) + cue_report(comparisons) + mechanisms_report(logs)
    return "\n".join(lines + unrecomputable_report(logs, comparisons, results))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logs", default="notebooks/logs", help="the directory of the committed comparisons")
    parser.add_argument("--out", help="write the markdown report here (default: print it)")
    args = parser.parse_args(argv)
    report = build_report(args.logs)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    else:
        print(report)


if __name__ == "__main__":
    main()
