"""tepokit/bench.py: --bench without TRL says how to install it; the cost of tepo's input checks."""
import os
import sys

import pytest

import tepo
import train_small as ts
from tepokit import bench
from tepokit.cli import parse_args
from tepokit.tests.helpers import MICRO


def test_bench_without_trl_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "trl", None)            # import trl raises ImportError
    with pytest.raises(SystemExit) as e:
        ts.main(["--bench"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "pip install" in err[0] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("objective", sorted(tepo.OBJECTIVES))
def test_input_check_cost_times_the_checks_and_the_objective_on_the_bench_mini_batch(objective):
    """The line --bench prints: both times measured (no claim about their ratio: timings vary) on a
    mini-batch of the run's shape, rows_per_minibatch x max_new_tokens."""
    args, overrides = parse_args(ts.Args, [*MICRO, "--objective", objective])
    cost = bench.input_check_cost(args, overrides, repeats=3)
    assert cost["batch"] == "[4, 12]"                  # ceil(2 prompts / 2 mini-batches) x 4 samples, 12 tokens
    assert cost["checks_s"] > 0 and cost["objective_s"] > 0
