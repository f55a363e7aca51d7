"""tepokit/tools/collapse_numbers.py: its numbers on tiny run directories made here, against hand computations,
and a few of docs/collapse.md's headline numbers recomputed from the committed logs."""
import json
import math
import os

import pytest

from tepokit.diagnostics.stats import fisher_exact_two_sided
from tepokit.tests.helpers import REPO
from tepokit.tools import collapse_numbers as cn

ARGS = {"pass_k": 16, "pass_k_problems": 100, "effect_check_every": 4}


def write_run(path, rows, args=ARGS, summary=None):
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"args": args}, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    if summary is not None:
        with open(os.path.join(path, "summary.json"), "w") as f:
            json.dump(summary, f)
    cn.read_run.cache_clear()


def evaluation(step, pass1, pass16, cue):
    return {"step": step, "eval/pass@1": pass1, "eval/pass@16": pass16, "eval/cue_share": cue,
            "eval/pass_k_problems": 100}


def run_rows(evaluations, steps=100, entropy=lambda step: 0.0):
    """One row per step (a rollout's forks/entropy), the evaluations' keys merged into their steps' rows."""
    rows = [{"step": s, **({"forks/entropy": entropy(s), "entropy": 0.01} if s else {})} for s in range(steps + 1)]
    for e in evaluations:
        rows[e["step"]].update(e)
    return rows


@pytest.fixture
def comparison(tmp_path):
    """A new entry and its control, seeds 1-3, evaluations at steps 0, 50 and 100 (pass@1, pass@16, cue share)."""
    new = {1: [(0.70, 0.90, 0.80), (0.80, 0.95, 0.95)], 2: [(0.65, 0.85, 0.78), (0.70, 0.90, 0.80)],
           3: [(0.72, 0.93, 0.84), (0.90, 0.97, 0.85)]}
    for seed, (middle, final) in new.items():
        write_run(tmp_path / f"tepo_beta=0_band=random__{seed}",
                  run_rows([evaluation(0, 0.5, 1.0, 0.5), evaluation(50, *middle), evaluation(100, *final)]))
        control = [evaluation(0, 0.5, 1.0, 0.5), evaluation(50, 0.6, 0.9, 0.7), evaluation(100, 0.7, 0.85, 0.76)]
        write_run(tmp_path / f"tepo_beta=0__{seed}", run_rows(control))
    return str(tmp_path)


def test_paired_differences_and_seed_counts_of_a_new_comparison(comparison):
    new, control = (cn.runs_by_seed(comparison, e) for e in ("tepo_beta=0_band=random", "tepo_beta=0"))
    assert list(new) == list(control) == [1, 2, 3]                        # `tepo_beta=0__1` is not the new entry's
    got = cn.paired_differences(new, control, "pass@1")
    assert got["per_seed"] == pytest.approx([10.0, 0.0, 20.0])             # points: 80-70, 70-70, 90-70
    # mean 10, std 10, t = 10 / (10 / sqrt 3) = sqrt 3 at 2 dof: P(|T| <= t) = t / sqrt(2 + t^2) = sqrt(3/5)
    assert got["mean"] == pytest.approx(10.0) and got["std"] == pytest.approx(10.0)
    assert got["half_width"] == pytest.approx(4.3027 * 10 / math.sqrt(3), rel=1e-4)
    assert got["p"] == pytest.approx(1 - math.sqrt(3 / 5), abs=1e-9)
    assert got["from_summary"] is None
    # matched pass@1: the new entry's evaluation nearest the control's final 0.70 (steps 50, 100, 50), its pass@16
    # against the control's final 0.85
    assert cn.paired_differences(new, control, "matched_pass@16")["per_seed"] == pytest.approx([5.0, 5.0, 8.0])
    learned = cn.learned_cue_counts(new)
    assert (learned["learned"], learned["n"]) == (2, 3)                     # 0.95 and 0.85 (the threshold) learned
    assert cn.learned_cue_counts(control)["learned"] == 0
    # Fisher, 2/3 against 0/3: tables x = 0, 1, 2 have 3, 9, 3 (/15); the observed and x = 0: 6/15
    assert fisher_exact_two_sided(2, 3, 0, 3) == pytest.approx(0.4)


def test_matched_pass1_takes_the_earliest_of_evaluations_that_tie_on_the_count_of_right_samples(tmp_path):
    # 0.7006 and 0.6994 are 1,121 and 1,119 right samples of 1,600 (4 digits kept): both 1 from the target's 1,120
    write_run(tmp_path / "a__1", run_rows([evaluation(0, 0.5, 1, 0.5), evaluation(50, 0.7006, 0.88, 0.7),
                                           evaluation(100, 0.6994, 0.80, 0.7)]))
    write_run(tmp_path / "b__1", run_rows([evaluation(0, 0.5, 1, 0.5), evaluation(100, 0.70, 0.75, 0.7)]))
    tied = cn.matched_evaluations(cn.read_run(str(tmp_path / "a__1")), cn.read_run(str(tmp_path / "b__1")))
    assert [r["step"] for r in tied] == [50, 100]
    got = cn.paired_differences(cn.runs_by_seed(str(tmp_path), "a"), cn.runs_by_seed(str(tmp_path), "b"),
                                "matched_pass@16")
    assert got["per_seed"] == pytest.approx([13.0])                        # 0.88 - 0.75


def test_a_thinned_log_gives_the_rows_left_in_the_last_10_steps_and_summary_json_the_full_mean(tmp_path):
    rows = run_rows([evaluation(0, 0.5, 1, 0.5), evaluation(100, 0.7, 0.8, 0.7)], entropy=lambda s: s / 100)
    write_run(tmp_path / "full__1", rows, summary={"decision_entropy_end": 0.955})
    write_run(tmp_path / "small__1", [r for r in rows if r["step"] % 4 == 0 or "eval/pass@1" in r],
              summary={"decision_entropy_end": 0.955})
    write_run(tmp_path / "flat__1", run_rows([evaluation(0, 0.5, 1, 0.5), evaluation(100, 0.7, 0.8, 0.7)]),
              summary={"decision_entropy_end": 0.0})
    full, small = cn.read_run(str(tmp_path / "full__1")), cn.read_run(str(tmp_path / "small__1"))
    assert not full.thinned and small.thinned
    assert cn.end_window(full, "forks/entropy") == (pytest.approx(0.955), 10, 10)     # steps 91-100
    assert cn.end_window(small, "forks/entropy") == (pytest.approx(0.96), 3, 10)      # rows 92, 96, 100
    by = {name: cn.runs_by_seed(str(tmp_path), name) for name in ("full", "small", "flat")}
    assert cn.paired_differences(by["full"], by["flat"], "decision_entropy")["from_summary"] is None
    got = cn.paired_differences(by["small"], by["flat"], "decision_entropy")
    assert got["per_seed"] == pytest.approx([0.96]) and got["thinned_rows"] == [(3, 10), (10, 10)]
    assert got["from_summary"]["per_seed"] == pytest.approx([0.955])


def effect_row(step, clip_low, clip_high):
    """A checked step's effect/ keys: each mechanism's (update_change, update_cosine, tokens)."""
    row = {"step": step, "dynamic_sampling/skipped": 0.0, "effect/tokens": 120.0}
    for name, (change, cosine, tokens) in (("clip_low", clip_low), ("clip_high", clip_high)):
        row |= {f"effect/{name}/update_change": change, f"effect/{name}/update_cosine": cosine,
                f"effect/{name}/tokens": tokens}
    return row


def test_mechanism_acts_over_the_pages_and_the_designs_denominators(tmp_path):
    rows = [{"step": s, "dynamic_sampling/skipped": 0.0} for s in range(17)]
    rows[4] = effect_row(4, (0.5, 0.8, 2.0), (0.01, 1.0, 1.0))       # a gradient: the lower clip acts, the upper not
    rows[8] = effect_row(8, (0.0, 0.0, 0.0), (0.0, 0.0, 0.0))        # no gradient at all (every advantage 0)
    rows[12] = effect_row(12, (0.0, 0.0, 3.0), (0.0, 0.0, 0.0))      # the lower clip took the whole gradient away
    rows[16] = {"step": 16, "dynamic_sampling/skipped": 1.0}        # no update: no check
    write_run(tmp_path / "grpo__1", rows)
    runs = cn.runs_by_seed(str(tmp_path), "grpo")
    low = cn.mechanism_acts(runs, "clip_low")
    assert (low["acts"], low["with_gradient"], low["checked"]) == (2, 2, 3)      # 2/2 (page's), 2/3 (design's)
    assert low["took_all"] == 1 and low["median_change"] == 0.5 and low["checked_without_effect"] == 0
    high = cn.mechanism_acts(runs, "clip_high")
    assert (high["acts"], high["with_gradient"], high["checked"]) == (0, 2, 3)


def test_page_interval_parsing_and_the_check():
    assert cn.parse_page_interval("-17.2 (-18.2 to -16.3)") == ((-17.2, -18.2, -16.3), 1)
    assert cn.parse_page_interval("+0.0005 (-0.0030 to +0.0040)")[1] == 4
    result = {"mean": -17.24, "low": -18.21, "high": -16.26}
    assert cn.page_check("-17.2 (-18.2 to -16.3)", result) == "="
    assert cn.page_check("-17.3 (-18.2 to -16.3)", result) == "~"
    assert "differs by 0.5" in cn.page_check("-16.7 (-18.2 to -16.3)", result)


LOGS = os.path.join(REPO, "notebooks", "logs")


@pytest.mark.skipif(not os.path.isdir(os.path.join(LOGS, cn.CUE400)), reason="the committed logs are not here")
def test_the_committed_logs_give_the_pages_headline_numbers():
    cue400 = os.path.join(LOGS, cn.CUE400)
    control = cn.runs_by_seed(cue400, cn.TEPO0)
    grpo_range = cn.paired_differences(cn.runs_by_seed(cue400, cn.ONE_AT_A_TIME[0]), control, "pass@1")
    assert cn.interval_text(grpo_range, 1) == "-17.2 (-18.2 to -16.3)"       # "GRPO's clip range" on the page
    counts = [cn.learned_cue_counts(cn.runs_by_seed(cue400, e))["learned"] for e in [cn.TEPO0, *cn.ONE_AT_A_TIME]]
    assert counts == [5, 0, 4, 5]
    grpo = cn.runs_by_seed(os.path.join(LOGS, cn.OFF_POLICY), cn.GRPO0)
    seed1 = cn.mechanism_acts({1: grpo[1]}, "clip_low")
    assert (seed1["acts"], seed1["with_gradient"], seed1["checked"]) == (10, 12, 37)   # the page's 10/12; 10/37
    upper = cn.mechanism_acts(grpo, "clip_high")                  # step 4's "17 of 64 checked steps", of 5 x 37
    assert (upper["acts"], upper["with_gradient"], upper["checked"]) == (17, 64, 185)
    comparisons = cn.page_comparisons(LOGS)
    assert len(comparisons) == 94
    report = cn.build_report(LOGS)
    assert "## a. The paired intervals: 94 found" in report and "differs by 0.5" in report
    step4 = [c for c in comparisons if c.metric == "decision_entropy" and "step 4" in c.section]
    thinned = cn.paired_differences(cn.runs_by_seed(step4[0].dir_a, step4[0].entry_a),
                                    cn.runs_by_seed(step4[0].dir_b, step4[0].entry_b), "decision_entropy")
    assert cn.interval_text(thinned["from_summary"], 3) == "-0.010 (-0.016 to -0.004)"   # only summary.json has it
    assert thinned["thinned_rows"] == [(3, 10), (10, 10)]
