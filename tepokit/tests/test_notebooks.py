"""notebooks/: every notebook runs headless, also pointed at a run of one's own; nbhelpers and the committed logs'
commands."""
import hashlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import train_small as ts
from tepokit.cli.flags import parse_args
from tepokit.tests.helpers import MICRO, REPO, run_main


# Executes each notebook in a fresh python3 kernel on the CPU (cwd = notebooks/, 300 s per cell) and
# fails if any cell raises. The executed result is NOT written back to disk. New notebooks are picked
# up automatically by the glob. Skips cleanly if nbclient / nbformat / ipykernel are not installed.
# Each execution is a process of its own, so that several run at once: the suite waits for the slowest.
NOTEBOOKS = sorted((Path(REPO) / "notebooks").glob("*.ipynb"))
EXECUTE = """
import re, sys
import nbclient, nbformat
from nbclient.exceptions import CellExecutionError
notebook, run_dir = sys.argv[1], sys.argv[2] or None
nb = nbformat.read(notebook, as_version=4)
if run_dir is not None:
    first = next(cell for cell in nb.cells if cell.cell_type == "code")
    assert first.source.startswith("RUN_DIR = None"), "the parameter is the first code cell's first line"
    first.source = first.source.replace("RUN_DIR = None", f"RUN_DIR = {run_dir!r}", 1)
client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", record_timing=False,
                                 resources={"metadata": {"path": sys.argv[3]}})    # kernel cwd = notebooks/
try:
    client.execute()                                               # in memory only: nothing is saved
except CellExecutionError as err:
    sys.exit(re.sub(r"\\x1b\\[[0-9;]*m", "", str(err)))              # the cell's error, without ANSI colours
nbformat.write(nb, sys.stdout)
"""


def start_executing(notebook: Path, run_dir: str | None = None) -> subprocess.Popen:
    """Start executing the notebook (RUN_DIR of its first code cell set to `run_dir` if given); `executed`
    waits for it."""
    reason = "notebook tests need nbclient, nbformat and ipykernel (pip install nbclient nbformat ipykernel)"
    for module in ("nbformat", "nbclient", "ipykernel"):
        pytest.importorskip(module, reason=reason)
    return subprocess.Popen([sys.executable, "-c", EXECUTE, str(notebook), run_dir or "", str(notebook.parent)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def executed(notebook: Path, run_dir: str | None = None, process: subprocess.Popen | None = None):
    """The executed notebook (started by start_executing, or now); fails the test with the cell's error when a
    cell raises."""
    import nbformat
    process = process or start_executing(notebook, run_dir)
    stdout, stderr = process.communicate(timeout=900)
    if process.returncode != 0:
        pytest.fail(f"{notebook.name}: a cell raised\n{stderr}", pytrace=False)
    return nbformat.reads(stdout, as_version=4)


@pytest.fixture(scope="module")
def executions():
    """Every notebook, started at once."""
    return {notebook.name: start_executing(notebook) for notebook in NOTEBOOKS}


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(notebook, executions):
    executed(notebook, process=executions[notebook.name])


def printed(nb) -> str:
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)


def figures_state() -> dict:
    """notebooks/figures/: each file's content hash and modification time."""
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in (Path(REPO) / "notebooks" / "figures").iterdir()}


# The notebooks that read runs: their first code cell's first line is the RUN_DIR parameter.
TAKE_A_RUN = [p.stem for p in NOTEBOOKS if '"RUN_DIR = None' in p.read_text()]


@pytest.fixture(scope="module")
def micro_tepo_run(workdir):
    """A run as the default command and --demo make them: the entropy check on every 4th step (the default
    --entropy-check-every), held-out evaluations only at the start, the middle and the end."""
    run_main([*MICRO, "--steps", "8", "--entropy-check-every", "4", "--eval-every", "4", "--out", "own_run"])
    return str(workdir / "own_run")


@pytest.fixture(scope="module")
def pointed_at_a_run(micro_tepo_run):
    """notebooks/figures/ as it was, and every notebook that takes a run, pointed at micro_tepo_run and
    started at once."""
    before = figures_state()
    return before, {name: start_executing(Path(REPO) / "notebooks" / f"{name}.ipynb", micro_tepo_run)
                    for name in TAKE_A_RUN}


def test_the_notebooks_that_take_a_run_are_the_three_that_read_logs():
    assert sorted(TAKE_A_RUN) == ["entropy_collapse", "entropy_dynamics", "kl_mask_activation"]


@pytest.mark.parametrize("name", ["entropy_dynamics", "kl_mask_activation"])
def test_notebook_pointed_at_a_run_reads_it_and_saves_its_figures_there(micro_tepo_run, pointed_at_a_run, name):
    """RUN_DIR = a run directory of train_small.py made with the default entropy-check schedule: the notebook
    reads that run (in the place of the committed tepo__1), draws it alone, says what it did not measure, saves
    its figures into RUN_DIR/figures/ and leaves notebooks/figures/ as it was (same bytes, same modification
    times)."""
    before, processes = pointed_at_a_run
    text = printed(executed(Path(REPO) / "notebooks" / f"{name}.ipynb", process=processes[name]))
    assert figures_state() == before
    assert "reading the logs in <RUN_DIR: own_run>/" in text and "8 of 8 steps, finished" in text
    saved = re.findall(r"saved (.+?) \(\d+ KB\)", text)
    assert len(saved) >= 3 and all(path.startswith("<RUN_DIR: own_run>/figures/") for path in saved), saved
    from PIL import Image
    for path in saved:
        with Image.open(Path(micro_tepo_run) / "figures" / path.rsplit("/", 1)[1]) as image:
            assert image.format == "PNG" and image.width > 300
    if name == "entropy_dynamics":   # at most 2 checked steps (4 and 8); one panel, not the committed logs' eight
        assert re.search(r"too few checked steps for a mean change and r \([0-2]; --entropy-check-every 4\)", text)
        with Image.open(Path(micro_tepo_run) / "figures" / "entropy_dynamics.png") as one, \
                Image.open(Path(REPO) / "notebooks" / "figures" / "entropy_dynamics.png") as eight:
            assert one.width < 0.8 * eight.width


def test_entropy_collapse_notebook_pointed_at_a_run_of_the_other_task_says_it_needs_a_hidden_type_run(
        pointed_at_a_run):
    _, processes = pointed_at_a_run
    text = printed(executed(Path(REPO) / "notebooks" / "entropy_collapse.ipynb",
                            process=processes["entropy_collapse"]))
    assert "(not a --task hidden-type run: skipped)" in text
    assert "no run of --task hidden-type found: sections 1 to 5 need one" in text


def test_notebooks_read_the_run_directory_parameter_and_its_older_environment_variable(tmp_path, monkeypatch):
    """nbhelpers.read_runs_from: None reads the committed logs and saves to notebooks/figures/; TEPO_NOTEBOOK_LOGS
    still stands for RUN_DIR; a directory that holds no run is refused in one line."""
    sys.path.insert(0, os.path.join(REPO, "notebooks"))
    import nbhelpers
    (tmp_path / "grpo__1").mkdir()
    (tmp_path / "grpo__1" / "metrics.jsonl").write_text('{"step": 0}\n')
    try:
        monkeypatch.setenv("TEPO_NOTEBOOK_LOGS", str(tmp_path))
        nbhelpers.read_runs_from(None)
        assert (nbhelpers.LOGS, nbhelpers.ONE_RUN, nbhelpers.FIGURES) == (tmp_path, None, tmp_path / "figures")
        assert nbhelpers.load_run("grpo__1")["metrics"] == [{"step": 0}] and nbhelpers.load_run("tepo__1") is None
        monkeypatch.delenv("TEPO_NOTEBOOK_LOGS")
        (tmp_path / "empty").mkdir()
        with pytest.raises(FileNotFoundError, match="holds no run of train_small.py"):
            nbhelpers.read_runs_from(tmp_path / "empty")
        with pytest.raises(FileNotFoundError, match="is not a directory"):
            nbhelpers.read_runs_from(tmp_path / "missing")
    finally:
        nbhelpers.read_runs_from(None)
    assert nbhelpers.LOGS == nbhelpers.NB_DIR / "logs" and nbhelpers.FIGURES == nbhelpers.NB_DIR / "figures"


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
    """Every command of notebooks/logs/COMMANDS.md (what REGENERATE runs) is a valid command line, every run
    directory it writes is one of the committed logs, and every committed run is written by one of them: a
    placeholder, a stale entry list or a directory without its command would fail here. The comparisons the
    notebooks ask for by plain name (nbhelpers.COMPARISONS) are committed directories."""
    sys.path.insert(0, os.path.join(REPO, "notebooks"))
    import nbhelpers
    logs = nbhelpers.NB_DIR / "logs"
    commands = nbhelpers.training_commands()
    assert len(commands) >= 4
    written = set()
    for cmd in commands:
        parse_args(ts.Args, cmd[2:])                                         # exits (status 2) on a bad flag value
        for _, name in nbhelpers.run_dirs_of(cmd):
            assert (logs / name / "metrics.jsonl").is_file(), f"{name}: not committed"
            written.add(name)
    committed = {path.parent.relative_to(logs).as_posix() for path in logs.glob("**/metrics.jsonl")}
    assert committed - written == set(), "committed runs that no command of COMMANDS.md writes"
    assert all((logs / name).is_dir() for name in nbhelpers.COMPARISONS.values())


def test_entropy_collapse_notebook_reads_a_hidden_type_run_of_ones_own(workdir):
    """entropy_collapse.ipynb with RUN_DIR = a --task hidden-type run: that run is its baseline (sections 1 to 4
    draw it), the remedies' section says it needs more entries, and the figures go to RUN_DIR/figures/."""
    run_main([*MICRO, "--task", "hidden-type", "--difficulty", "3", "--objective", "grpo", "--beta", "0",
              "--steps", "6", "--eval-every", "3", "--out", "own_hidden_type"])
    before = figures_state()
    text = printed(executed(Path(REPO) / "notebooks" / "entropy_collapse.ipynb", str(workdir / "own_hidden_type")))
    assert figures_state() == before
    assert "reading the logs in <RUN_DIR: own_hidden_type>/" in text and "6 of 6 steps, finished" in text
    assert "ceiling -a + b" in text and "the remedies need the baseline and at least one other entry" in text
    saved = re.findall(r"saved (.+?) \(\d+ KB\)", text)
    assert saved and all(path.startswith("<RUN_DIR: own_hidden_type>/figures/") for path in saved), saved
