"""tepokit/tools/compare.py: --compare, its table and its paired differences."""
import contextlib
import glob
import io
import json
import math
import os

import pytest

import tepo
import train_small as ts
import tepokit.cli.validation
from tepokit.cli.flags import parse_args
from tepokit.tools.compare import paired_differences, paired_metrics, paired_table
from tepokit.tests.helpers import MICRO, run_main, strict_loads


def test_compare_writes_a_table_and_a_rerun_reuses_finished_runs(workdir):
    argv = [*MICRO, "--compare", "grpo,tepo", "--seeds", "2", "--steps", "2", "--out", "runs/cmp"]
    run_main(argv)
    result = strict_loads(open("runs/cmp/summary.json").read())        # strict JSON: no NaN in the file
    table = result["objectives"]
    assert set(table) == {"grpo", "tepo"} and result["seeds"] == [1, 2] and result["baseline"] == "grpo"
    runs = {(name, seed): json.load(open(f"runs/cmp/{name}__{seed}/summary.json"))
            for name in table for seed in (1, 2)}
    for name, entry in table.items():
        finals = [runs[name, seed]["final_accuracy"] for seed in (1, 2)]
        assert entry["final_accuracy_mean"] == pytest.approx(sum(finals) / 2)
        assert entry["final_accuracy_std"] == pytest.approx(abs(finals[0] - finals[1]) / math.sqrt(2))
        assert [r["seed"] for r in entry["runs"]] == [1, 2]
    # Paired: TEPO minus GRPO on the same seed; with 2 seeds the 95% interval is
    # mean +- t(0.975, 1) * std / sqrt(2) = mean +- 12.706 * |d1 - d2| / 2.
    assert set(result["paired"]) == {"tepo"}
    assert result["paired"]["tepo"]["final_entropy"]["std"] > 0     # micro runs: accuracies may all be 0
    for key, factor in (("gain_points", 1), ("accuracy_auc", 100), ("final_pass@2", 100), ("final_entropy", 1)):
        d = [factor * (runs["tepo", seed][key] - runs["grpo", seed][key]) for seed in (1, 2)]
        paired = result["paired"]["tepo"][key]
        assert paired["per_seed"] == pytest.approx(d) and paired["n"] == 2
        assert paired["mean"] == pytest.approx((d[0] + d[1]) / 2)
        assert paired["high"] - paired["mean"] == pytest.approx(12.7062 * abs(d[0] - d[1]) / 2, rel=1e-4, abs=1e-9)
        assert paired["mean"] - paired["low"] == pytest.approx(paired["high"] - paired["mean"])
    for seed in (1, 2):      # same seed, same warm-up model and start evaluation: the pairs share a start
        assert runs["tepo", seed]["start_accuracy"] == runs["grpo", seed]["start_accuracy"]
    md = open("runs/cmp/summary.md").read()
    assert md.count("\n| grpo |") == 1                              # the baseline: one row of the table
    assert md.count("\n| tepo |") == 1 + len(paired_metrics(2))  # one table row, one paired row per metric
    assert "| objective − grpo | metric | per seed (1, 2) |" in md
    stamp = os.path.getmtime("runs/cmp/grpo__2/metrics.jsonl")
    os.remove("runs/cmp/summary.json")
    run_main(argv)                                   # the same command again: nothing is retrained
    assert os.path.getmtime("runs/cmp/grpo__2/metrics.jsonl") == stamp
    assert json.load(open("runs/cmp/summary.json")) == result
    with pytest.raises(SystemExit) as e:             # an explicit baseline must be one of the compared
        ts.main([*argv, "--baseline", "dapo"])
    assert e.value.code == 2
    # the default baseline (grpo) when it is not compared: the table without a paired block
    run_main([*MICRO, "--compare", "tepo", "--seeds", "2", "--steps", "2", "--out", "runs/cmp"])
    assert json.load(open("runs/cmp/summary.json"))["paired"] == {}
    assert "No paired differences: the baseline 'grpo'" in open("runs/cmp/summary.md").read()
    assert os.path.getmtime("runs/cmp/grpo__2/metrics.jsonl") == stamp
    run_main([*MICRO, "--compare", "grpo", "--seeds", "2", "--steps", "2", "--out", "runs/cmp"])   # read back
    assert "No paired differences: nothing but the baseline was compared." in open("runs/cmp/summary.md").read()


def test_compare_stopped_on_purpose_says_how_to_go_on_and_writes_no_summary(workdir, capsys):
    argv = [*MICRO, "--compare", "grpo,tepo", "--seeds", "1", "--steps", "2", "--out", "runs/cmp_stopped"]
    run_main([*argv, "--stop-after", "1"])          # no run reached its final evaluation: no table, no traceback
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said.startswith("--compare stopped after step 1 of 2 in 2 runs") and "--stop-after" not in said.split(
        "go on with:")[1]
    assert not os.path.exists("runs/cmp_stopped/summary.json")
    assert [len(open(f"runs/cmp_stopped/{name}__1/metrics.jsonl").readlines()) for name in ("grpo", "tepo")] == [2, 2]
    run_main(argv)                                  # the command it names finishes both runs and the table
    assert set(json.load(open("runs/cmp_stopped/summary.json"))["objectives"]) == {"grpo", "tepo"}
    assert [len(open(f"runs/cmp_stopped/{name}__1/metrics.jsonl").readlines()) for name in ("grpo", "tepo")] == [3, 3]


def test_compare_entries_carry_their_own_objective_settings(workdir):
    """`tepo:beta=0` is TEPO with beta 0 in its own directory, paired like any objective; it may be the baseline."""
    run_main([*MICRO, "--compare", "tepo,tepo:beta=0:entropy_criterion=measured", "--baseline", "tepo", "--steps", "2",
              "--out", "runs/cmp_variants"])
    variant = json.load(open("runs/cmp_variants/tepo_beta=0_entropy_criterion=measured__1/config.json"))
    assert variant["args"]["objective"] == "tepo"
    assert variant["objective_config"]["beta"] == 0.0 and variant["objective_config"]["entropy_criterion"] == "measured"
    plain = json.load(open("runs/cmp_variants/tepo__1/config.json"))
    assert plain["objective_config"]["beta"] == tepo.PAPER_DEFAULTS["tepo"].beta
    result = json.load(open("runs/cmp_variants/summary.json"))
    assert set(result["paired"]) == {"tepo:beta=0:entropy_criterion=measured"}
    assert tepokit.cli.validation.variant("dapo:dynamic_sampling=off:eps_high=0.3") == (
        "dapo", {"dynamic_sampling": False, "eps_high": 0.3})
    for bad in ("tepo:bta=0", "tepo:beta=-1", "tepo:beta", "tepx", "grpo,grpo"):
        with pytest.raises(SystemExit) as e:
            parse_args(ts.Args, ["--compare", bad])
        assert e.value.code == 2


def test_paired_block_with_one_seed_has_no_interval_and_skips_unreached_targets():
    args = ts.Args(compare="grpo,tepo", pass_k=4)
    base = {"gain_points": 10.0, "accuracy_auc": 0.30, "final_sampled_accuracy": 0.20, "final_pass@4": 0.50,
            "steps_to_target": None, "final_entropy": 0.25}
    other = {"gain_points": 13.5, "accuracy_auc": 0.32, "final_sampled_accuracy": 0.25, "final_pass@4": 0.45,
             "steps_to_target": 75, "final_entropy": 0.20}
    paired = paired_differences({"grpo": [base], "tepo": [other]}, args)["tepo"]
    assert paired["gain_points"]["per_seed"] == [3.5] and paired["gain_points"]["mean"] == 3.5
    assert paired["gain_points"]["low"] is None and paired["gain_points"]["high"] is None
    assert paired["accuracy_auc"]["mean"] == pytest.approx(2.0)
    assert paired["final_pass@4"]["mean"] == pytest.approx(-5.0)
    assert paired["steps_to_target"] == {"label": "steps to target accuracy", "per_seed": [None], "n": 0,
                                         "mean": None, "std": None, "half_width": None, "low": None, "high": None}
    lines = paired_table({"tepo": paired}, args, [1])
    assert "| tepo | final held-out accuracy gain (points) | +3.5 | +3.5 | none (1 seed) | 1 |" in lines
    assert "| tepo | steps to target accuracy | not reached | - | none (0 seeds) | 0 |" in lines


def compare_refusal(argv) -> str:
    """The one line a --compare command is refused with (exit status 2)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as refused:
        ts.main(argv)
    lines = err.getvalue().strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("train_small.py: error: "), lines
    return lines[0]


def files(folder="runs/cmp_same") -> dict:
    """Every file below `folder` and its bytes."""
    return {p: open(p, "rb").read() for p in glob.glob(f"{folder}/**", recursive=True) if os.path.isfile(p)}


def test_a_rerun_into_the_same_out_reuses_only_runs_of_the_same_settings(workdir):
    """A changed --lr or --pass-k is refused in one line naming the run and the settings, before anything runs or
    changes; an interrupted run of other settings is not resumed either; a damaged sub-run is named in one line."""
    argv = [*MICRO, "--compare", "grpo", "--steps", "2", "--out", "runs/cmp_same"]
    run_main(argv)
    before = files()
    line = compare_refusal([*argv, "--lr", "2e-3"])
    assert "runs/cmp_same/grpo__1 holds a run of other settings (--lr 0.001 there, 0.002 now)" in line, line
    assert "--pass-k 2 there, 3 now" in compare_refusal([*argv, "--pass-k", "3"])
    assert "--beta 0.04 there, 0.1 now" in compare_refusal([*argv, "--beta", "0.1"])
    assert files() == before
    os.remove("runs/cmp_same/grpo__1/summary.json")          # as if interrupted after its last checkpoint
    before = files()
    assert "(--lr 0.001 there, 0.002 now)" in compare_refusal([*argv, "--lr", "2e-3"])
    assert files() == before
    run_main(argv)                                            # the same settings: resumed and finished
    open("runs/cmp_same/grpo__1/summary.json", "w").close()   # emptied
    line = compare_refusal(argv)
    assert "runs/cmp_same/grpo__1/summary.json is damaged (JSONDecodeError" in line, line
    json.dump({"wall_seconds": 1.0}, open("runs/cmp_same/grpo__1/summary.json", "w"))
    os.remove("runs/cmp_same/grpo__1/metrics.jsonl")
    assert "runs/cmp_same/grpo__1/metrics.jsonl is missing or holds no evaluation" in compare_refusal(argv)


def test_a_run_that_diverges_ends_the_comparison_in_one_line_that_says_what_to_do(workdir, monkeypatch):
    from tepokit.plumbing.non_finite import Diverged
    real_rl_step = ts.rl_step

    def rl_step(run, step, observe=None):
        record = real_rl_step(run, step, observe=observe)
        assert "loss" in record.losses                  # the loss's metrics, which the step's row carries
        record.losses = {**record.losses, "loss": math.nan}
        return record
    monkeypatch.setattr(ts, "rl_step", rl_step)
    with pytest.raises(Diverged) as diverged:
        ts.main([*MICRO, "--compare", "grpo", "--steps", "1", "--out", "runs/cmp_diverged"])
    assert diverged.value.message == ("runs/cmp_diverged/grpo__1: step 1: its loss is nan, at --lr 0.001; nothing of "
                                      "that step was saved; start the comparison again with a lower --lr and another "
                                      "--out")
