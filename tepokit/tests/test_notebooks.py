"""notebooks/: every notebook runs headless; nbhelpers and the committed logs' commands."""
import math
import os
import re
import sys
from pathlib import Path

import pytest

import train_small as ts
from tepokit.cli import parse_args
from tepokit.tests.helpers import REPO


# Executes each notebook in a fresh python3 kernel on the CPU (cwd = notebooks/, 300 s per cell) and
# fails if any cell raises. The executed result is NOT written back to disk. New notebooks are picked
# up automatically by the glob. Skips cleanly if nbclient / nbformat / ipykernel are not installed.
NOTEBOOKS = sorted((Path(REPO) / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(notebook):
    reason = "notebook tests need nbclient, nbformat and ipykernel (pip install nbclient nbformat ipykernel)"
    nbformat = pytest.importorskip("nbformat", reason=reason)
    nbclient = pytest.importorskip("nbclient", reason=reason)
    pytest.importorskip("ipykernel", reason=reason)
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", record_timing=False,
        resources={"metadata": {"path": str(notebook.parent)}})   # kernel cwd = notebooks/
    try:
        client.execute()                                           # in memory only: nothing is saved
    except CellExecutionError as err:
        message = re.sub(r"\x1b\[[0-9;]*m", "", str(err))                # drop ANSI colours
        pytest.fail(f"{notebook.name}: a cell raised\n{message}", pytrace=False)


def test_notebook_helpers_pair_runs_by_seed_and_find_the_run_directories():
    """nbhelpers.paired_over_seeds pairs on the seeds both sides have, drops a seed whose value is None, and gives
    --compare's t interval; run_dirs_of names the directories of a multi-seed --compare with variant entries."""
    sys.path.insert(0, os.path.join(REPO, "notebooks"))
    import nbhelpers
    runs = {1: {"v": 3.0}, 2: {"v": 5.0}, 3: {"v": 4.0}, 4: {"v": None}}
    base = {1: {"v": 1.0}, 2: {"v": 1.0}, 3: {"v": 1.0}, 4: {"v": 0.0}, 5: {"v": 9.0}}
    d = nbhelpers.paired_over_seeds(runs, base, lambda r: r["v"])
    assert d["seeds"] == [1, 2, 3] and d["per_seed"] == [2.0, 4.0, 3.0] and d["n"] == 3
    # mean 3, std 1, 95% interval 3 +- t(0.975, 2) * 1 / sqrt(3) = 3 +- 4.3027 / 1.7321
    assert d["mean"] == pytest.approx(3.0) and d["high"] == pytest.approx(3 + 4.3027 / math.sqrt(3), abs=1e-4)
    assert nbhelpers.verdict(d) == "higher (interval above 0)"
    assert nbhelpers.verdict(nbhelpers.paired_over_seeds({1: 1.0, 2: -1.0}, {1: 0.0, 2: 0.0}, float)) \
        == "no difference shown (interval contains 0)"
    cmd = ["python", "train_small.py", "--compare", "grpo,tepo:beta=0", "--seed", "3", "--seeds", "2",
           "--out", "runs/collapse"]
    assert [name for _, name in nbhelpers.run_dirs_of(cmd)] == [
        "collapse/grpo__3", "collapse/tepo_beta=0__3", "collapse/grpo__4", "collapse/tepo_beta=0__4"]
    assert nbhelpers.run_dirs_of(["python", "train_small.py", "--compare", "gspo,mpo", "--seed", "1",
                                  "--out", "runs/compare_default"])[1][1] == "mpo__1"


def test_reference_log_commands_are_valid_and_name_the_committed_runs():
    """Every command of notebooks/logs/COMMANDS.md (what REGENERATE runs) is a valid command line, and every run
    directory it writes is one of the committed logs: a placeholder or a stale entry list would fail here."""
    sys.path.insert(0, os.path.join(REPO, "notebooks"))
    import nbhelpers
    commands = nbhelpers.training_commands()
    assert len(commands) >= 4
    for cmd in commands:
        parse_args(ts.Args, cmd[2:])                                         # exits (status 2) on a bad flag value
        for _, name in nbhelpers.run_dirs_of(cmd):
            assert (nbhelpers.NB_DIR / "logs" / name / "metrics.jsonl").is_file(), f"{name}: not committed"
