"""tepokit/plumbing/rundir.py: a run owns its directory, resume that cannot destroy, atomic writes in strict JSON,
--steps, kill -9, and the operating system's errors in one line."""
import io
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_small as ts
from tepokit.cli import flags as cli
from tepokit.cli import resume
from tepokit.plumbing import rundir
from tepokit.plumbing.rundir import read_log, truncate_log, write_atomically
from tepokit.diagnostics.summary import accuracy_with_interval, evaluation_line
from tepokit.tests.helpers import (MICRO, SCRIPT, assert_refused_in_one_line, assert_whole_rows_without_duplicates,
                                   fake_run, read_details, read_rows, rows_in, run_main, start_process,
                                   strict_loads, wait_until, without_timing)


def snapshot(folder):
    """Every file below `folder` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def edit_config(run_dir, change):
    config = json.load(open(os.path.join(run_dir, "config.json")))
    change(config)
    json.dump(config, open(os.path.join(run_dir, "config.json"), "w"))


def edit_log(run_dir, line, row):
    """Replace line `line` (0-based) of metrics.jsonl by `row`, or drop it and every later line ("drop")."""
    lines = open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()
    lines = lines[:line] if row == "drop" else [*lines[:line], json.dumps(row), *lines[line + 1:]]
    open(os.path.join(run_dir, "metrics.jsonl"), "w").write("".join(x + "\n" for x in lines))


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
        # config.json must hold every setting the run needs: no silent defaults
        "a setting missing": lambda d: edit_config(d, lambda c: c["args"].pop("lr")),
        "no identity": lambda d: edit_config(d, lambda c: c.pop("identity")),
        # a checkpoint from another run: another objective, another model size
        "another objective's checkpoint": lambda d: edit_config(d, lambda c: c["identity"].update(objective="grpo")),
        "another model's checkpoint": lambda d: edit_config(d, lambda c: c["identity"].update(model_shape="x")),
        # metrics.jsonl: each row an object with an integer step, steps contiguous up to the checkpoint
        "a hand-edited row": lambda d: edit_log(d, 1, {"foo": 1}),
        "a null row": lambda d: edit_log(d, 1, None),
        "a step as text": lambda d: edit_log(d, 1, {"step": "1"}),
        "a step twice": lambda d: edit_log(d, 2, {"step": 1}),
        "steps missing": lambda d: edit_log(d, 2, "drop"),
        "no metrics.jsonl": lambda d: os.remove(os.path.join(d, "metrics.jsonl")),
        "no details.jsonl (tepo)": lambda d: os.remove(os.path.join(d, "details.jsonl")),
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
    with pytest.raises(rundir.DamagedLog, match=r"metrics.jsonl, line 2: not a JSON row"):
        read_log(path)      # an exception, which a notebook can catch; the commands word it as one line


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


def writing_checkpoint(run_dir):
    return os.path.isdir(run_dir) and any(n.startswith(".checkpoint.pt-") for n in os.listdir(run_dir))


def test_kill_9_at_any_moment_loses_at_most_the_steps_since_the_checkpoint(four_steps):
    """SIGKILL during the first checkpoint, during a later checkpoint write (after its step's row was
    logged), and in the middle of a step; each time --resume (or a fresh start when there is no
    checkpoint yet) goes on, and the finished log equals an uninterrupted run's."""
    out, slow = "runs/killed", {"TEPO_TEST_CHECKPOINT_SLEEP": "1.0"}
    # 1. during checkpoint 0: nothing to resume, and --resume says so without touching the directory
    process = start_process([*KILL_ARGS, "--out", out], **slow)
    wait_until(lambda: writing_checkpoint(out), process)
    process.kill()
    process.wait()
    before = snapshot(out)
    assert_refused_in_one_line(["--resume", out], "no checkpoint.pt")
    assert snapshot(out) == before
    # 2. a fresh start in the same directory (--overwrite: it holds the killed run's first row), killed while
    # writing the checkpoint of step 2
    process = start_process([*KILL_ARGS, "--out", out, "--overwrite"], **slow)
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
    assert not [n for n in os.listdir(out) if n.startswith(".") and n != ".lock"]   # no temp file left


# ---- a run owns its directory --------------------------------------------------------------------------

def test_a_live_run_directory_is_refused_naming_its_process_and_a_killed_one_is_not(workdir):
    out = "runs/live"
    process = start_process([*MICRO, "--objective", "grpo", "--steps", "200", "--out", out])
    try:
        wait_until(lambda: rows_in(out) >= 2, process)
        process.send_signal(signal.SIGSTOP)        # paused (still holding the lock): its files stand still
        before = snapshot(out)
        assert_refused_in_one_line([*MICRO, "--out", out, "--overwrite"], f"in use by process {process.pid}")
        assert_refused_in_one_line(["--resume", out], f"in use by process {process.pid}")
        assert snapshot(out) == before              # the refused commands changed nothing
    finally:
        process.kill()
        process.wait()
    # the lock died with the process: the killed run resumes (one more step is enough to show it)
    done = rows_in(out) - 1
    run_main(["--resume", out, "--steps", str(done + 1)])
    assert_whole_rows_without_duplicates(out)


def test_a_finished_run_is_not_overwritten_unless_asked(workdir):
    out = "runs/finished"
    run_main([*MICRO, "--objective", "grpo", "--steps", "1", "--out", out])
    before = snapshot(out)
    assert_refused_in_one_line([*MICRO, "--objective", "grpo", "--steps", "1", "--out", out], "--overwrite")
    assert snapshot(out) == before
    run_main([*MICRO, "--objective", "dapo", "--steps", "2", "--out", out, "--overwrite"])
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2]
    assert json.load(open(Path(out, "config.json")))["args"]["objective"] == "dapo"
    assert not Path(out, "details.jsonl").exists()             # the old run's files are gone, not mixed in


def test_an_out_that_holds_a_model_is_refused_and_left_alone_even_with_overwrite(workdir, tmp_path):
    """A Hugging Face model directory (config.json, model.safetensors) is not a run: as --out it is refused in one
    line that says so, with or without --overwrite, and keeps its files; an empty directory is taken."""
    model_dir = tmp_path / "model"
    from tepokit.setup.model import build_char_tokenizer, build_tiny_model
    build_tiny_model(ts.Args(n_layer=1, n_embd=32, n_head=2), build_char_tokenizer(["1+2"])).save_pretrained(model_dir)
    before = snapshot(model_dir)
    for extra in ([], ["--overwrite"]):
        line = assert_refused_in_one_line([*MICRO, "--out", str(model_dir), *extra], "--out", "holds other files")
        assert "holds a run already" not in line
    with pytest.raises(SystemExit):       # the run directory's own check, for callers that skip the flags' one
        rundir.claim_run_dir(str(model_dir), resume=False, overwrite=True)
    assert snapshot(model_dir) == before
    (tmp_path / "empty").mkdir()
    run_main([*MICRO, "--objective", "grpo", "--steps", "1", "--out", str(tmp_path / "empty")])
    assert rundir.holds_a_run(str(tmp_path / "empty")) and not rundir.holds_a_run(str(model_dir))


def test_an_out_that_holds_a_comparison_is_not_taken_for_a_run(tmp_path):
    """--compare's directory (summary.json, summary.md, its runs below) is not a run: --overwrite would remove its
    summary.json and mix a run's files in; refused in one line, and left as it is."""
    (tmp_path / "cmp" / "grpo__1").mkdir(parents=True)
    (tmp_path / "cmp" / "summary.json").write_text(json.dumps({"seeds": [1], "objectives": {}}))
    (tmp_path / "cmp" / "summary.md").write_text("| objective |\n")
    before = snapshot(tmp_path / "cmp")
    for extra in ([], ["--overwrite"]):
        assert_refused_in_one_line([*MICRO, "--out", str(tmp_path / "cmp"), *extra], "--out", "holds other files")
    assert snapshot(tmp_path / "cmp") == before and not rundir.holds_a_run(str(tmp_path / "cmp"))


def test_resume_refuses_a_data_set_edited_since_the_run_started(workdir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    rows = [{"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"} for a in range(1, 8) for b in range(1, 4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = "runs/edited"
    run_main([*MICRO, "--objective", "grpo", "--dataset", str(data), "--n-test", "4", "--steps", "1", "--out", out])
    data.write_text("".join(json.dumps({**r, "answer": "#### 7"}) + "\n" for r in rows))
    before = snapshot(out)
    with pytest.raises(SystemExit) as refused:         # found after loading, before anything changes
        ts.main(["--resume", out, "--steps", "2"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert refused.value.code == 2 and "the data loaded now differ" in last and "Traceback" not in last, last
    assert snapshot(out) == before


# ---- strict JSON ---------------------------------------------------------------------------------------

def test_every_file_a_run_writes_is_strict_json(workdir, capsys):
    """A one-step run has too few entropy checks for r: its correlation is NaN, written as null with the
    reason beside it; every .json and .jsonl line parses with a parser that refuses NaN and Infinity."""
    out_dir = "runs/strict"
    run_main([*MICRO, "--objective", "tepo", "--steps", "1", "--out", out_dir])
    files = [p for p in Path(out_dir).iterdir() if p.suffix in (".json", ".jsonl")]
    assert {p.name for p in files} >= {"config.json", "metrics.jsonl", "details.jsonl", "summary.json"}
    for p in files:
        for line in ([p.read_text()] if p.suffix == ".json" else p.read_text().splitlines()):
            strict_loads(line)
    summary = strict_loads(Path(out_dir, "summary.json").read_text())
    assert summary["entropy_change_correlation"] is None and summary["entropy_change_correlation_missing"]
    out = capsys.readouterr().out.splitlines()
    entropy_line = next(line for line in out if "token entropy" in line)
    assert "first and last step); predicted vs measured change per step: too few steps for r" in entropy_line
    assert out[-1].strip() == ('jupyter lab notebooks/   # entropy_covariance.ipynb first (the derivation), then '
                               f'entropy_dynamics.ipynb with RUN_DIR = "{out_dir}"')   # the order of the README


def test_run_files_and_cache_entries_get_the_users_umask(tmp_path):
    """Under umask 027 every file of a run and of its warm-up cache entry is 0640 and every directory 0750 (group
    readable), as any file the user creates: not 0600 / 0700 as temporary files are made."""
    previous = os.umask(0o027)
    try:
        run_main([*MICRO, "--objective", "grpo", "--steps", "1", "--out", str(tmp_path / "run"),
                  "--cache-dir", str(tmp_path / "cache"), "--lr", "2e-3"])
    finally:
        os.umask(previous)
    entry = next((tmp_path / "cache").glob("warmup-*[!k]"))           # the entry, not its .lock
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for root in (tmp_path / "run", entry)
             for p in [root, *root.rglob("*")]}
    for name in ("run/config.json", "run/checkpoint.pt", "run/summary.json", "run/metrics.jsonl",
                 "run/policy/config.json", f"cache/{entry.name}/model.safetensors"):
        assert modes.pop(name) == 0o640, name
    for name in ("run/policy", f"cache/{entry.name}"):
        assert modes.pop(name) == 0o750, name
    assert set(modes.values()) <= {0o640, 0o750}, modes


# ---- the operating system's errors ----------------------------------------------------------------------

@pytest.mark.parametrize("where", ["below a regular file", "a name over 255 bytes"])
def test_an_out_that_cannot_be_created_is_one_line_and_creates_nothing(where, tmp_path):
    (tmp_path / "file").write_text("x")
    out = {"below a regular file": tmp_path / "file" / "run", "a name over 255 bytes": tmp_path / ("x" * 300)}[where]
    assert_refused_in_one_line([*MICRO, "--out", str(out)], "--out")
    assert sorted(os.listdir(tmp_path)) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_out_is_one_line(tmp_path):
    tmp_path.chmod(0o555)
    try:
        assert_refused_in_one_line([*MICRO, "--out", str(tmp_path / "run")], "--out")
    finally:
        tmp_path.chmod(0o755)


def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint_and_resume_works(workdir, monkeypatch, capsys):
    """The disk fills up while checkpoint 2 is written (torch reports it as a RuntimeError): one line that
    says what failed and how to go on; checkpoint 1 is whole, and --resume continues from it."""
    out = "runs/full_disk"
    real_save = torch.save
    saves = []

    def save(obj, f, *a, **k):
        saves.append(obj["step"])
        if obj["step"] == 2:
            f.write(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(OSError) as failure:
        run_main([*MICRO, "--objective", "grpo", "--steps", "3", "--out", out])
    monkeypatch.setattr(torch, "save", real_save)
    from tepokit.plumbing.errors import os_error_line
    line = os_error_line(failure.value)
    assert "checkpoint.pt" in line and f"--resume {out}" in line and "\n" not in line
    assert line.count("full?") == 1, line                       # the disk's question asked once
    assert torch.load(Path(out, "checkpoint.pt"), weights_only=True)["step"] == 1
    assert not [n for n in os.listdir(out) if n.startswith(".checkpoint.pt-")]   # no temp file left
    run_main(["--resume", out])
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2, 3]


def test_a_full_disk_during_a_log_append_names_the_log_and_the_resume_command(workdir, monkeypatch):
    """The disk fills while step 2's row is appended to metrics.jsonl: the one line names the log and the
    --resume command (the write on an open file raises without a file name), and --resume goes on."""
    out, real_open = "runs/full_log", open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            if '"step": 2' in text:
                raise OSError(28, "No space left on device")
            return self.f.write(text)

        def flush(self):
            self.f.flush()

    def full_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return FullDisk(f) if str(path).endswith("metrics.jsonl") and mode == "a" else f
    monkeypatch.setattr(rundir, "open", full_open, raising=False)
    with pytest.raises(OSError) as failure:
        run_main([*MICRO, "--objective", "grpo", "--steps", "3", "--out", out])
    monkeypatch.undo()
    from tepokit.plumbing.errors import os_error_line
    assert os_error_line(failure.value) == (f"could not write or read {out}/metrics.jsonl: No space left on device; "
                                            f"free some space on that disk; the last checkpoint is intact: continue "
                                            f"with python train_small.py --resume {out}")
    run_main(["--resume", out])
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2, 3]


def test_every_failed_write_names_its_file(tmp_path, monkeypatch):
    """Errors raised on an open file or descriptor (write, flush, fsync) name no file: the policy's save, an
    atomic write and a sync each give it theirs, for the one line that names it."""
    class FullModel:
        def save_pretrained(self, path):
            raise OSError(28, "No space left on device")
    with pytest.raises(OSError) as failure:
        rundir.save_pretrained_atomically(FullModel(), None, str(tmp_path / "policy"))
    assert failure.value.filename == str(tmp_path / "policy") and failure.value.errno == 28

    def full_fsync(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_fsync)
    with pytest.raises(OSError) as failure:
        write_atomically(str(tmp_path / "summary.json"), lambda f: f.write(b"{}"))
    assert failure.value.filename == str(tmp_path / "summary.json") and not os.listdir(tmp_path)


def test_a_file_size_limit_is_one_line_in_a_real_process(tmp_path):
    """RLIMIT_FSIZE below the size of a checkpoint: the write fails with EFBIG (Python ignores SIGXFSZ);
    the run ends with one line naming the file and what to do, no traceback."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
    result = subprocess.run([sys.executable, SCRIPT, *MICRO, "--steps", "1", "--out", str(tmp_path / "run"),
                             "--cache-dir", str(tmp_path / "cache")],
                            capture_output=True, text=True, preexec_fn=limit, cwd=tmp_path, timeout=300)
    last = result.stderr.strip().splitlines()[-1]          # above it: the progress bars of the warm-up
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert last.startswith("train_small.py: error: could not write") and "ulimit -f" in last, last


def test_a_run_saved_before_the_sampler_resumes_with_the_arithmetic_it_had(workdir):
    """config.json written before --sampler, --recompute-old-logprobs, --fast and --decode-precision existed: --resume
    fills them in with what that run did (generate, recomputed old log-probs, the prompt-once forward, fp32
    decoding, which a GPU's auto would no longer be) instead of refusing it."""
    out = "runs/before_sampler"
    run_main([*MICRO, "--steps", "2", "--stop-after", "1", "--out", out])
    path = os.path.join(out, "config.json")
    config = json.load(open(path))
    del config["args"]["sampler"], config["args"]["recompute_old_logprobs"], config["args"]["fast"]
    del config["args"]["decode_precision"]
    with open(path, "w") as f:
        json.dump(config, f)
    run_main(["--resume", out])
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2]
    resumed = resume.check_resumable(out, ts.Args, cli.RUN_ONLY_FIELDS)[0]["args"]
    assert resumed["sampler"] == "generate" and resumed["recompute_old_logprobs"] is True and resumed["fast"] is True
    assert resumed["decode_precision"] == "fp32"
    assert "logprobs/sampling_vs_recomputed_max_abs" in read_rows(out)[2]       # recomputed, and checked


class DiskWrites:
    """Records, in order, every os.fsync (by the path its descriptor was opened with) and every os.replace,
    to check what reaches the disk before a name points at it."""

    def __init__(self, monkeypatch):
        self.events = []
        fsync, replace = os.fsync, os.replace

        def recording_fsync(fd):
            self.events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
            fsync(fd)

        def recording_replace(src, dst):
            self.events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
            replace(src, dst)
        monkeypatch.setattr(os, "fsync", recording_fsync)
        monkeypatch.setattr(os, "replace", recording_replace)

    def synced(self, path: str, before: int | None = None) -> bool:
        return ("fsync", path) in self.events[:before]

    def durable(self, path: str) -> bool:
        """The file at `path` reached the disk under the name it was written with, before the rename that
        gave it (or a folder above it) its name, and that rename reached the disk after it; or, written in
        place, it was synced."""
        path = os.path.realpath(path)
        for i in range(len(self.events) - 1, -1, -1):
            kind, *where = self.events[i]
            if kind == "replace" and (path == where[1] or path.startswith(where[1] + os.sep)):
                written_as = where[0] + path[len(where[1]):]
                return (self.synced(written_as, before=i)
                        and ("fsync", os.path.dirname(where[1])) in self.events[i + 1:])
        return self.synced(path)


def test_every_file_a_run_and_the_warm_up_cache_write_reaches_the_disk_before_its_name(workdir, monkeypatch):
    """fsync before each rename and on the folder after it: a power loss or a kernel crash after a
    checkpoint finds the checkpoint whole, and the log rows up to it (synced before the checkpoint)."""
    writes = DiskWrites(monkeypatch)
    run_main([*MICRO, "--steps", "2", "--save-every", "2", "--warmup-steps", "3", "--cache-dir", "runs/cache_sync",
              "--out", "runs/synced"])
    written = [str(p) for folder in ("runs/synced", "runs/cache_sync") for p in Path(folder).rglob("*")
               if p.is_file() and not p.name.endswith(".lock")]
    assert any(p.endswith("checkpoint.pt") for p in written) and any("warmup-" in p for p in written)
    assert any(p.endswith("model.safetensors") for p in written) and len(written) > 10
    assert [p for p in written if not writes.durable(p)] == []
    checkpoint_write = next(i for i, e in enumerate(writes.events) if e[0] == "replace" and e[2].endswith(
        "checkpoint.pt"))      # checkpoint 0: step 0's row is on the disk before it
    assert writes.synced(os.path.realpath("runs/synced/metrics.jsonl"), before=checkpoint_write)


def test_a_killed_writers_temporary_directory_goes_when_its_directory_is_written_again(tmp_path):
    """save_pretrained_atomically runs under the lock of the directory it writes (the run's, the cache
    entry's): a .tmp-<name>-* beside it was left by a writer that was killed. Another name's is not ours."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from tepokit.setup.model import build_char_tokenizer
    for leftover in (".tmp-policy-killed", ".tmp-warmup-abc-killed"):
        os.makedirs(tmp_path / leftover)
        Path(tmp_path, leftover, "model.safetensors").write_bytes(b"half")
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    rundir.save_pretrained_atomically(model, build_char_tokenizer(["0123456789"]), str(tmp_path / "policy"))
    assert sorted(os.listdir(tmp_path)) == [".tmp-warmup-abc-killed", "policy"]
    assert os.path.isfile(tmp_path / "policy" / "model.safetensors")


# ---- TRL's checkpoints: the newest WHOLE checkpoint-N is resumed -------------------------------------------
def whole_trl_checkpoint(path):
    """A checkpoint-N directory with every file --resume needs, as the Trainer writes them (tiny contents)."""
    from safetensors.torch import save_file
    os.makedirs(path)
    save_file({"wte": torch.arange(12.0).view(4, 3), "wpe": torch.ones(2, 3)}, os.path.join(path, "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.arange(1000.0)}}}, os.path.join(path, "optimizer.pt"))
    torch.save({"last_epoch": 4}, os.path.join(path, "scheduler.pt"))
    torch.save({"cpu": torch.get_rng_state()}, os.path.join(path, "rng_state.pth"))
    Path(path, "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": []}))
    Path(path, "identity.json").write_text(json.dumps({"objective": "grpo"}))
    Path(path, "tokenizer.json").write_text("not needed to resume, so not checked")
    return str(path)


def cut(path, keep):
    """Keep the first `keep` bytes of a file (keep < 0: all but the last -keep), as a write killed midway."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:keep])


def flip_a_byte_of_the_tensor(path):
    """Change one byte inside the optimizer's tensor data, leaving the zip's structure intact."""
    data = bytearray(Path(path).read_bytes())
    start = bytes(data).find(torch.arange(1000.0).numpy().tobytes())
    assert start > 0
    data[start + 100] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def two_processes_rng_states(d):
    os.rename(os.path.join(d, "rng_state.pth"), os.path.join(d, "rng_state_0.pth"))
    torch.save({"cpu": torch.get_rng_state()}, os.path.join(d, "rng_state_2.pth"))     # rng_state_1.pth lost


def cut_scaler_state(d):
    """scaler.pt (mixed precision only: optional), present but cut short: still a damaged checkpoint."""
    torch.save({"scale": 1.0}, os.path.join(d, "scaler.pt"))
    cut(os.path.join(d, "scaler.pt"), 100)


TRL_CHECKPOINT_DAMAGE = {   # what happened: (how, the start of the phrase that names it)
    "model cut short": (lambda d: cut(os.path.join(d, "model.safetensors"), -7), "model.safetensors is damaged ("),
    "model cut inside its header": (lambda d: cut(os.path.join(d, "model.safetensors"), 20),
                                    "model.safetensors is cut short (20 bytes, shorter than its header)"),
    "model header garbled": (lambda d: Path(d, "model.safetensors").write_bytes(
        (10).to_bytes(8, "little") + b"{not json}" + b"\0" * 40), "model.safetensors is damaged (its header does not "
                                                                  "parse: JSONDecodeError)"),
    "model missing": (lambda d: os.remove(os.path.join(d, "model.safetensors")), "model.safetensors is missing"),
    "optimizer missing": (lambda d: os.remove(os.path.join(d, "optimizer.pt")), "optimizer.pt is missing"),
    "optimizer cut short": (lambda d: cut(os.path.join(d, "optimizer.pt"), 3000),
                            "optimizer.pt is damaged (BadZipFile: File is not a zip file)"),
    "optimizer's data changed": (lambda d: flip_a_byte_of_the_tensor(os.path.join(d, "optimizer.pt")),
                                 "optimizer.pt is damaged (checksum mismatch in "),
    "scheduler missing": (lambda d: os.remove(os.path.join(d, "scheduler.pt")), "scheduler.pt is missing"),
    "RNG state missing": (lambda d: os.remove(os.path.join(d, "rng_state.pth")), "rng_state.pth is missing"),
    "one process's RNG state missing": (two_processes_rng_states, "rng_state_1.pth is missing"),
    "trainer state cut short": (lambda d: cut(os.path.join(d, "trainer_state.json"), 10),
                                "trainer_state.json is damaged (JSONDecodeError: "),
    "identity missing": (lambda d: os.remove(os.path.join(d, "identity.json")), "identity.json is missing"),
    "an optional file cut short": (cut_scaler_state, "scaler.pt is damaged (BadZipFile"),
}


def test_a_whole_trl_checkpoint_passes_the_check(tmp_path):
    path = whole_trl_checkpoint(tmp_path / "checkpoint-4")
    assert resume.trl_checkpoint_problem(path) is None
    size = os.path.getsize(os.path.join(path, "model.safetensors"))
    cut(os.path.join(path, "model.safetensors"), -7)                       # the sizes are said as they are
    expected = f"model.safetensors is damaged ({size - 7} bytes where its header says {size})"
    assert resume.trl_checkpoint_problem(path) == expected
    two_processes = whole_trl_checkpoint(tmp_path / "checkpoint-8")       # rng_state_<process>.pth, all there
    os.rename(os.path.join(two_processes, "rng_state.pth"), os.path.join(two_processes, "rng_state_0.pth"))
    torch.save({"cpu": torch.get_rng_state()}, os.path.join(two_processes, "rng_state_1.pth"))
    assert resume.trl_checkpoint_problem(two_processes) is None


@pytest.mark.parametrize("damage", list(TRL_CHECKPOINT_DAMAGE))
def test_the_trl_checkpoint_check_names_the_missing_or_damaged_file(damage, tmp_path):
    how, phrase = TRL_CHECKPOINT_DAMAGE[damage]
    path = whole_trl_checkpoint(tmp_path / "checkpoint-4")
    how(path)
    problem = resume.trl_checkpoint_problem(path)
    assert problem is not None and problem.startswith(phrase), problem
    assert "\n" not in problem


def test_the_newest_whole_trl_checkpoint_is_chosen_by_step_and_set_aside_ones_are_invisible(tmp_path):
    """checkpoint-10 is newer than checkpoint-2 (numbers, not letters); incomplete ones are skipped with the
    reason, newest first; a renamed one (incomplete-checkpoint-N) and a file are not checkpoints, for
    transformers' search either."""
    from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints
    for step in (2, 4, 10, 12):
        whole_trl_checkpoint(tmp_path / f"checkpoint-{step}")
    os.remove(tmp_path / "checkpoint-12" / "identity.json")
    cut(tmp_path / "checkpoint-10" / "optimizer.pt", 50)
    Path(tmp_path, "checkpoint-20").write_text("a file, not a checkpoint")
    newest, skipped = resume.newest_whole_trl_checkpoint(str(tmp_path))
    assert newest == (str(tmp_path / "checkpoint-4"), 4)
    assert [(os.path.basename(p), why) for p, why in skipped] == [
        ("checkpoint-12", "identity.json is missing"),
        ("checkpoint-10", "optimizer.pt is damaged (BadZipFile: File is not a zip file)")]
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-12")     # what TRL alone would take
    set_aside = resume.set_aside_trl_checkpoints([p for p, _ in skipped])
    assert set_aside == [str(tmp_path / "incomplete-checkpoint-12"), str(tmp_path / "incomplete-checkpoint-10")]
    assert resume.newest_whole_trl_checkpoint(str(tmp_path)) == ((str(tmp_path / "checkpoint-4"), 4), [])
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")
    assert sorted(os.path.basename(p) for p in sort_checkpoints(str(tmp_path))) == ["checkpoint-2", "checkpoint-4"]
    # a later incomplete checkpoint-12 replaces the one set aside before (neither is whole)
    whole_trl_checkpoint(tmp_path / "checkpoint-12")
    resume.set_aside_trl_checkpoints([str(tmp_path / "checkpoint-12")])
    assert resume.trl_checkpoint_problem(str(tmp_path / "incomplete-checkpoint-12")) is None
    assert not os.path.exists(tmp_path / "checkpoint-12")


def test_the_evaluation_line_gives_95_percent_intervals_and_the_mean_entropy_since_the_last_line():
    args = ts.Args(n_test=500, pass_k=4, pass_k_problems=50)
    start = evaluation_line({"step": 0, "eval/accuracy": 0.296, "eval/pass@4": 0.6}, args, [])
    # 1.96 * sqrt(0.296 * 0.704 / 500) = 0.0400; 1.96 * sqrt(0.6 * 0.4 / 50) = 0.1358
    assert start == ("step    0: held-out accuracy 0.296 +- 0.040, pass@4 0.600 +- 0.136 (the start model; "
                     "+- : 95% intervals over 500 and 50 problems)")
    line = evaluation_line({"step": 40, "eval/accuracy": 0.5, "eval/pass@4": 0.5}, args, [0.2, 0.1, 0.15])
    assert line == ("step   40: held-out accuracy 0.500 +- 0.044, pass@4 0.500 +- 0.139, "
                    "entropy 0.150 (mean of steps 38-40)")
    assert evaluation_line({"step": 7, "eval/accuracy": 0.5, "eval/pass@4": 0.5}, args, [0.3]).endswith(
        "entropy 0.300 (mean of step 7)")
    # at 0 or 1 the Wald interval has no width: the exact one-sided 95% bound, 1 - 0.05^(1/n), about 3/n
    assert accuracy_with_interval(1.0, 100) == "1.000 (>= 0.970)"       # 0.05^(1/100) = 0.9705
    assert accuracy_with_interval(0.0, 500) == "0.000 (<= 0.006)"       # 1 - 0.05^(1/500) = 0.0060
    assert accuracy_with_interval(0.0, 2) == "0.000 (<= 0.776)"         # 1 - sqrt(0.05), not 3/2
