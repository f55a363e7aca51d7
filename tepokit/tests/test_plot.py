"""tepokit/plot.py: `python -m tepokit.plot RUN_DIR`, the standard figures of a run, and its one-line refusals."""
import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tepokit import errors
from tepokit.plot import FIGURE_SIZES, FIGURES, TWO_PANELS, main
from tepokit.tests.helpers import MICRO, REPO, run_main


@pytest.fixture(scope="module")
def micro_tepo_run(workdir):
    """A real micro TEPO run (details.jsonl, entropy checks, clipping) and the summary block it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_main([*MICRO, "--steps", "6", "--out", "runs/plotted"])
    return workdir / "runs" / "plotted", printed.getvalue()


def test_the_command_the_summary_names_writes_every_figure_as_a_readable_png(micro_tepo_run, capsys):
    """The end-of-run summary names `python -m tepokit.plot <run dir>`; that command writes the five standard
    figures into <run dir>/figures/: PNG images of the drawn size (inches x 110 dpi), RGB, not blank, and the
    same bytes when drawn again from the same logs."""
    run_dir, summary = micro_tepo_run
    command = re.search(r"python -m tepokit\.plot (\S+)", summary)
    assert command and Path(command[1]) == Path("runs/plotted")
    assert main([command[1]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [Path(line.split(" (")[0]).name for line in lines] == list(FIGURES)       # each figure, in order
    sizes = {name: (round(110 * w), round(110 * h)) for name, (w, h) in
             ((name, FIGURE_SIZES.get(name, TWO_PANELS)) for name in FIGURES)}              # inches x 110 dpi
    first = {}
    for name in FIGURES:
        with Image.open(run_dir / "figures" / name) as image:
            assert image.format == "PNG" and image.mode == "RGB"
            assert image.size == sizes[name], (name, image.size)
            assert len(image.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 50, name    # drawn, not blank
        first[name] = (run_dir / "figures" / name).read_bytes()
    assert main([str(run_dir)]) == 0
    assert all((run_dir / "figures" / name).read_bytes() == data for name, data in first.items())


def test_a_run_without_details_gets_its_figures_and_a_note_for_the_kl_mask(micro_tepo_run, tmp_path, capsys):
    """Without details.jsonl (any objective but TEPO, or --engine trl) the KL-mask figure is skipped with a
    note that says why; the other figures are written."""
    run_dir = tmp_path / "grpo_like"
    run_dir.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(micro_tepo_run[0] / name, run_dir / name)
    assert main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "kl_mask.png: skipped, no details.jsonl (TEPO runs of the built-in engine write it)" in out
    assert sorted(p.name for p in (run_dir / "figures").iterdir()) == sorted(set(FIGURES) - {"kl_mask.png"})


@pytest.mark.parametrize("case, needle", [
    ("missing", "is not a run directory of train_small.py (it has no metrics.jsonl)"),
    ("no_metrics", "is not a run directory of train_small.py (it has no metrics.jsonl)"),
    ("empty_metrics", "metrics.jsonl is empty: the run has not logged its first evaluation yet"),
    ("damaged_metrics", "metrics.jsonl, line 2: not a JSON row"),
    ("rows_without_steps", "metrics.jsonl, line 2: not the row of a step (an object with an integer step)"),
    ("damaged_config", "config.json is damaged (JSONDecodeError: "),
])
def test_bad_input_is_refused_in_one_line_with_exit_status_2_and_nothing_written(tmp_path, capsys, case, needle):
    run_dir = tmp_path / "run"
    if case != "missing":
        run_dir.mkdir()
        (run_dir / "config.json").write_text("{}")
    if case == "empty_metrics":
        (run_dir / "metrics.jsonl").write_text("")
    if case == "rows_without_steps":
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n[1, 2]\n')
    if case == "damaged_config":
        (run_dir / "config.json").write_text('{"args": ')
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    if case == "damaged_metrics":
        (run_dir / "metrics.jsonl").write_text(f'{json.dumps({"step": 0})}\n{{not json\n{json.dumps({"step": 1})}\n')
    before = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else None
    with pytest.raises(SystemExit) as stop:
        main([str(run_dir)])
    lines = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("python -m tepokit.plot: error: ")
    assert needle in lines[0]
    assert (sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else None) == before      # nothing written
    assert errors.PROGRAM == "train_small.py"            # train_small.py's own error lines keep their name


def test_the_module_runs_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "tepokit.plot", "no/such/run"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("python -m tepokit.plot: error: no/such/run is not a run directory of train_small.py (it "
                           "has no metrics.jsonl); give a run's --out\n")
