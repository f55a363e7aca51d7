"""tepokit/tools/band_numbers.py: the band section's numbers from run directories (fake ones, values by hand)."""
import json
import os

import pytest

from tepokit.tools import band_numbers


def fake_run(path, cue_share_final, band_rows, pass1=(0.5, 0.7)):
    """A finished run: evaluations at steps 0 and 2, two steps of band/ counts (band_rows: per step, {key: (rows,
    clipped)} with key = (item, strategy, sign))."""
    os.makedirs(path)
    rows = [{"step": 0, "eval/pass@1": pass1[0], "eval/cue_share": 0.5}]
    for step, counts in enumerate(band_rows, start=1):
        row = {"step": step}
        for (item, strategy, sign), (n, clipped) in counts.items():
            row[f"band/{item}_item/{strategy}/{sign}/rows"] = float(n)
            row[f"band/{item}_item/{strategy}/{sign}/clipped"] = float(clipped)
        rows.append(row)
    rows[-1].update({"eval/pass@1": pass1[1], "eval/cue_share": cue_share_final})
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"args": {"pass_k": 16, "pass_k_problems": 100}, "started_at": "2026-11-27T12:10:00Z",
                   "code": {"commit": "abc", "uncommitted_changes": False}}, f)
    with open(os.path.join(path, "summary.json"), "w") as f:
        json.dump({"finished_at": "2026-11-27T12:20:00Z"}, f)


def test_primary_comparisons_count_seeds_test_them_exactly_and_correct_for_five(tmp_path):
    d = tmp_path / band_numbers.BAND_DIR
    mul, add = ("mul", "mul", "pos"), ("add", "add", "pos")
    # band: 3 of 3 learn; clipped shares over steps 1-2: seed 1 mul 1/4 vs add 6/8 -> -0.5; seed 2: 0/2 vs 2/2 -> -1.0;
    # seed 3: 1/2 vs 1/2 -> 0.0
    steps = {1: [{mul: (2, 0), add: (4, 3)}, {mul: (2, 1), add: (4, 3)}],
             2: [{mul: (1, 0), add: (1, 1)}, {mul: (1, 0), add: (1, 1)}],
             3: [{mul: (1, 1), add: (1, 0)}, {mul: (1, 0), add: (1, 1)}]}
    for seed, band_rows in steps.items():
        fake_run(str(d / f"tepo_beta=0__{seed}"), 0.95, band_rows)
        fake_run(str(d / f"tepo_beta=0_clip_choice=random__{seed}"), 0.76, band_rows, pass1=(0.5, 0.73))
    assert [band_numbers.share_difference(str(d / f"tepo_beta=0__{s}")) for s in (1, 2, 3)] == [-0.5, -1.0, 0.0]
    lines = band_numbers.primary_rows(str(tmp_path))
    random_line = next(line for line in lines if "random drop" in line)
    # 3/3 against 0/3: Fisher two-sided p = 2 / C(6, 3) = 0.1; two tests, so Holm multiplies the smaller p by 2
    assert "3/3 against 0/3" in random_line and "| 0.1000 |" in random_line
    shares_line = next(line for line in lines if "share clipped" in line)
    assert "-0.500 (" in shares_line and "per seed -0.500, -1.000, +0.000" in shares_line
    outcome = band_numbers.outcome_rows(str(tmp_path))
    assert any("random drop" in line and "0 of 3" in line and "0.730-0.730" in line for line in outcome)
    assert any("the band (" in line and "3 of 3" in line for line in outcome)
    # steps 1-50, seeds pooled: rewarded + on adding items 12 rows, 9 clipped; rewarded * on multiplying items 8, 2
    window = next(line for line in band_numbers.band_windows(str(tmp_path), "band") if line.startswith("| 1-50 |"))
    assert window == "| 1-50 | 12, 0.75 | 0, - | 8, 0.25 | 0, - |"
    stamps = band_numbers.stamps(str(tmp_path))
    assert sum("2026-11-27T12:10:00Z | 2026-11-27T12:20:00Z | abc (False)" in line for line in stamps) == 6


@pytest.mark.parametrize("arm", ["random", "above", "below", "sgd"])
def test_every_primary_arm_has_a_label_and_a_directory(arm):
    label, directory, entry = band_numbers.ARMS[arm]
    assert label and directory.endswith("2026-11-27") and entry.startswith("tepo_beta=0")
