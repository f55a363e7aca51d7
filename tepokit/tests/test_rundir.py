"""tepokit/rundir.py: resume that cannot destroy, atomic writes, --steps, Ctrl-C and kill -9."""
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tepokit.rundir import read_log, truncate_log, write_atomically
from tepokit.tests.helpers import SCRIPT, MICRO, run_main, read_rows, without_timing, read_details, assert_refused_in_one_line, fake_run


def snapshot(folder):
    return {name: Path(folder, name).read_bytes() for name in sorted(os.listdir(folder))}


def test_resume_refuses_damaged_or_incomplete_run_directories_and_changes_nothing(tmp_path):
    cases = {
        "no checkpoint": lambda d: os.remove(os.path.join(d, "checkpoint.pt")),
        "truncated checkpoint": lambda d: Path(d, "checkpoint.pt").write_bytes(
            Path(d, "checkpoint.pt").read_bytes()[:300]),
        "garbage checkpoint": lambda d: Path(d, "checkpoint.pt").write_bytes(b"not a checkpoint"),
        "damaged config.json": lambda d: Path(d, "config.json").write_text('{"args": {'),
        "config.json of something else": lambda d: Path(d, "config.json").write_text("[1, 2]"),
        "unknown setting": lambda d: Path(d, "config.json").write_text(
            json.dumps({"args": {"warp_drive": 1}, "objective_overrides": {}})),
        "no config.json": lambda d: os.remove(os.path.join(d, "config.json")),
    }
    for what, damage in cases.items():
        run_dir = fake_run(tmp_path / what.replace(" ", "_"))
        damage(run_dir)
        before = snapshot(run_dir)
        assert_refused_in_one_line(["--resume", run_dir], "--resume")
        assert snapshot(run_dir) == before, what
    # a flipped byte inside a tensor: the zip checksum catches what loading would not
    run_dir = fake_run(tmp_path / "flipped")
    data = bytearray(Path(run_dir, "checkpoint.pt").read_bytes())
    import zipfile
    member = next(i for i in zipfile.ZipFile(io.BytesIO(bytes(data))).infolist() if "/data/0" in i.filename)
    start = member.header_offset + 30 + int.from_bytes(data[member.header_offset + 26:member.header_offset + 28],
                                                       "little") \
        + int.from_bytes(data[member.header_offset + 28:member.header_offset + 30], "little")
    data[start] ^= 0xFF
    Path(run_dir, "checkpoint.pt").write_bytes(bytes(data))
    assert_refused_in_one_line(["--resume", run_dir], "damaged", "checksum")


def test_read_log_skips_a_cut_off_last_line_and_truncate_log_rewrites_atomically(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    Path(path).write_text('{"step": 0}\n{"step": 1, "x": 0.5}\n{"step": 2}\n{"step": 3, "x": 0.')
    assert read_log(path) == [{"step": 0}, {"step": 1, "x": 0.5}, {"step": 2}]
    truncate_log(path, 2)
    assert Path(path).read_text() == '{"step": 0}\n{"step": 1, "x": 0.5}\n'
    assert os.listdir(tmp_path) == ["metrics.jsonl"]                         # no temp file left
    Path(path).write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(SystemExit):
        read_log(path)


def test_write_atomically_keeps_the_old_file_when_the_write_fails(tmp_path):
    path = str(tmp_path / "config.json")
    Path(path).write_text("old")
    Path(tmp_path, ".config.json-stale").write_text("left by a killed write")

    def broken(f):
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, broken)
    assert Path(path).read_text() == "old" and os.listdir(tmp_path) == ["config.json"]
    write_atomically(path, lambda f: f.write(b"new"))
    assert Path(path).read_text() == "new"


KILL_ARGS = [*MICRO, "--objective", "tepo", "--steps", "4"]


@pytest.fixture(scope="module")
def four_steps(workdir):
    """The uninterrupted run that extended, interrupted and killed runs must reproduce."""
    run_main([*KILL_ARGS, "--out", "runs/four_steps"])
    return without_timing(read_rows("runs/four_steps"))


def test_steps_extends_a_finished_run_like_an_uninterrupted_one(four_steps):
    """3 steps, then --resume --steps 4, equals 4 steps at once. Step 3's final evaluation (off the
    --eval-every 2 schedule) stays in its row as an extra measurement and does not touch the RNG."""
    run_main([*KILL_ARGS, "--steps", "3", "--out", "runs/ext"])
    run_main(["--resume", "runs/ext", "--steps", "4"])
    extended = without_timing(read_rows("runs/ext"))
    assert [r["step"] for r in extended] == [0, 1, 2, 3, 4]
    assert "eval/accuracy" in extended[3] and "eval/accuracy" not in four_steps[3]
    assert {k: v for k, v in extended[3].items() if not k.startswith("eval/")} == four_steps[3]
    assert extended[:3] == four_steps[:3] and extended[4:] == four_steps[4:]
    assert json.load(open("runs/ext/config.json"))["args"]["steps"] == 3     # the saved settings are kept
    assert json.load(open("runs/ext/summary.json"))["final_accuracy"] == four_steps[4]["eval/accuracy"]
    assert read_details("runs/ext") == read_details("runs/four_steps")


def assert_whole_rows_without_duplicates(run_dir):
    text = Path(run_dir, "metrics.jsonl").read_text()
    assert text.endswith("\n")
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert steps == list(range(len(steps))), steps


def start_process(argv, **env):
    return subprocess.Popen([sys.executable, SCRIPT, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env})


def wait_until(condition, process, timeout=240):
    t0 = time.time()
    while not condition():
        assert process.poll() is None, f"the run ended before the awaited moment: {process.stderr.read()}"
        assert time.time() - t0 < timeout
        time.sleep(0.01)


def rows_in(run_dir):
    path = Path(run_dir, "metrics.jsonl")
    return path.read_text().count("\n") if path.exists() else 0


def writing_checkpoint(run_dir):
    return os.path.isdir(run_dir) and any(n.startswith(".checkpoint.pt-") for n in os.listdir(run_dir))


def test_ctrl_c_finishes_the_step_and_says_how_to_resume(workdir):
    out = "runs/ctrl_c"
    process = start_process([*MICRO, "--objective", "grpo", "--steps", "40", "--out", out])
    wait_until(lambda: rows_in(out) >= 2, process)
    process.send_signal(signal.SIGINT)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"interrupted at step (\d+); resume with: python train_small.py --resume runs/ctrl_c", last)
    assert m and "Traceback" not in stderr, stderr
    assert_whole_rows_without_duplicates(out)
    assert rows_in(out) == int(m[1]) + 1                                    # the step's row was flushed
    assert torch.load(Path(out, "checkpoint.pt"), weights_only=True)["step"] == int(m[1])


def test_kill_9_at_any_moment_loses_at_most_the_steps_since_the_checkpoint(four_steps):
    """SIGKILL during the first checkpoint, during a later checkpoint write (after its step's row was
    logged), and in the middle of a step; each time --resume (or a fresh start when there is no
    checkpoint yet) goes on, and the finished log equals an uninterrupted run's."""
    out, slow = "runs/killed", {"TEPO_TEST_CHECKPOINT_SLEEP": "1.5"}
    # 1. during checkpoint 0: nothing to resume, and --resume says so without touching the directory
    process = start_process([*KILL_ARGS, "--out", out], **slow)
    wait_until(lambda: writing_checkpoint(out), process)
    process.kill()
    process.wait()
    before = snapshot(out)
    assert_refused_in_one_line(["--resume", out], "no checkpoint.pt")
    assert snapshot(out) == before
    # 2. a fresh start in the same directory, killed while writing the checkpoint of step 2
    process = start_process([*KILL_ARGS, "--out", out], **slow)
    wait_until(lambda: rows_in(out) >= 3 and writing_checkpoint(out), process)
    process.kill()
    process.wait()
    assert torch.load(Path(out, "checkpoint.pt"), weights_only=True)["step"] == 1     # the previous one, whole
    # 3. resumed, and killed in the middle of the next step (after its checkpoint is in place)
    process = start_process(["--resume", out], **slow)
    wait_until(lambda: rows_in(out) >= 3 and writing_checkpoint(out), process)
    wait_until(lambda: not writing_checkpoint(out), process)
    process.kill()
    process.wait()
    # 4. resumed to the end: the same rows as an uninterrupted run, each step once, no cut-off line
    run_main(["--resume", out])
    assert_whole_rows_without_duplicates(out)
    assert without_timing(read_rows(out)) == four_steps
    assert read_details(out) == read_details("runs/four_steps")
    assert not [n for n in os.listdir(out) if n.startswith(".")]            # no temp file left behind
