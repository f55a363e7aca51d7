"""tepokit/plumbing/report.py: --report-to sends a run's rows to the trackers, live, read back with TensorBoard's own
reader; a missing tracker is refused before anything loads; a failing one does not stop the run."""
import glob
import importlib.util
import math
import os
import re
import threading

import pytest

from tepokit.plumbing import report
from tepokit.tests.helpers import MICRO, assert_refused_in_one_line, read_rows, run_main

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(log_dir: str) -> dict:
    """Every scalar of the event files below log_dir: tag -> [(step, value)]."""
    found = {}
    for events in sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True)):
        reader = event_accumulator.EventAccumulator(events, size_guidance={event_accumulator.SCALARS: 0})
        reader.Reload()
        for tag in reader.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in reader.Scalars(tag))
    return found


def test_every_row_of_metrics_jsonl_arrives_in_tensorboard_at_its_step(workdir):
    """A TEPO run with --report-to tensorboard: each metric of each row (training steps and evaluations) is a
    TensorBoard scalar at x = its step, with the row's value (to float32), and the run's settings are there."""
    out = "runs/report_tensorboard"
    run_main([*MICRO, "--objective", "tepo", "--steps", "3", "--report-to", "tensorboard", "--out", out])
    rows = read_rows(out)
    curves = scalars(os.path.join(out, "tensorboard"))
    for name in ("entropy", "eval/accuracy", "kl_mask/frac", "reward", "loss"):
        expected = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
        assert [s for s, _ in curves[name]] == [s for s, _ in expected], name
        for (_, got), (_, want) in zip(curves[name], expected):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-7) or (math.isnan(got) and math.isnan(want)), name
    assert [s for s, _ in curves["entropy"]] == [1, 2, 3] and [s for s, _ in curves["eval/accuracy"]] == [0, 2, 3]
    reader = event_accumulator.EventAccumulator(glob.glob(os.path.join(out, "tensorboard", "events.*"))[0])
    reader.Reload()
    assert "config/text_summary" in reader.Tags()["tensors"]          # the run's settings, once


def test_a_tracker_that_fails_mid_run_is_dropped_in_one_warning_and_the_run_goes_on(workdir, monkeypatch, capsys):
    """A full disk under the event file at step 2: one warning line naming the tracker and metrics.jsonl,
    every step still logged there, the run finishes."""
    def failing_at_step_2(writer, numbers, step):
        if step == 2:
            raise OSError(28, "No space left on device")
        writer.add_scalar("reward", numbers["reward"] if "reward" in numbers else 0.0, step)
    monkeypatch.setitem(report.LOG, "tensorboard", failing_at_step_2)
    out = "runs/report_failing"
    run_main([*MICRO, "--objective", "grpo", "--steps", "3", "--report-to", "tensorboard", "--out", out])
    warnings = [line for line in re.split(r"[\r\n]+", capsys.readouterr().err) if "warning" in line]
    assert warnings == [f"train_small.py: warning: --report-to tensorboard failed at step 2 (OSError: [Errno 28] No "
                        f"space left on device); its curves stop there, and {out}/metrics.jsonl keeps every row"]
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2, 3] and os.path.exists(os.path.join(out, "summary.json"))


def test_a_full_disk_under_tensorboards_writer_thread_is_one_warning_and_no_traceback(workdir, monkeypatch,
                                                                                         capsys):
    """TensorBoard writes its event file from a thread of its own: when the disk fills from step 2 on, the thread
    dies, the run says so in one warning line (no thread traceback), and finishes with every row."""
    from tensorboard.summary.writer import record_writer
    real_log, real_write, full = report.LOG["tensorboard"], record_writer.RecordWriter.write, []

    def log(writer, numbers, step):
        if step == 2:
            full.append(step)
        real_log(writer, numbers, step)

    def write(self, data):
        if full:
            raise OSError(28, "No space left on device")
        real_write(self, data)
    monkeypatch.setitem(report.LOG, "tensorboard", log)
    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    printed = []            # what reaches the process's hook for threads' errors, which prints their tracebacks

    def hook(hook_args):
        printed.append(hook_args.thread.name)
    monkeypatch.setattr(threading, "excepthook", hook)
    out = "runs/report_full_disk"
    run_main([*MICRO, "--objective", "grpo", "--steps", "3", "--report-to", "tensorboard", "--out", out])
    err = capsys.readouterr().err
    assert printed == [] and threading.excepthook is hook           # and the hook is the process's again
    warnings = [line for line in re.split(r"[\r\n]+", err) if "warning" in line]
    assert "Traceback" not in err and len(warnings) == 1, err
    assert warnings[0].startswith("train_small.py: warning: --report-to tensorboard failed at step 2 (OSError: "
                                  "[Errno 28] No space left on device)"), warnings
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2, 3] and os.path.exists(os.path.join(out, "summary.json"))


def test_a_tracker_that_is_not_installed_is_refused_before_anything_loads(workdir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert_refused_in_one_line([*MICRO, "--report-to", "tensorboard,wandb", "--out", "runs/report_missing"],
                               "--report-to", "wandb is not installed", "pip install wandb")
    assert not os.path.exists("runs/report_missing")
    assert_refused_in_one_line([*MICRO, "--report-to", "tensorboard,comet"], "--report-to",
                               "tensorboard, trackio, wandb")


def test_report_to_names():
    assert report.trackers_of("none") == [] and report.trackers_of("tensorboard,wandb") == ["tensorboard", "wandb"]
    assert report.valid_report_to("trackio") and not report.valid_report_to("tensorboard,tensorboard")
    assert not report.valid_report_to("") and not report.valid_report_to("all")


def test_engine_trl_reports_to_tensorboard_through_trl_and_survives_a_failing_tracker(workdir, monkeypatch, capsys):
    """--engine trl hands --report-to to GRPOConfig: TRL's TensorBoard callback writes the reward of each
    logged RL step (x = TRL's optimizer step, 2 per RL step here), equal to metrics.jsonl's. Then the same
    callback failing at its second log: one warning line, and the run finishes with every step logged."""
    pytest.importorskip("trl")
    from transformers.integrations import TensorBoardCallback
    out = "runs/report_trl"
    run_main([*MICRO, "--engine", "trl", "--objective", "grpo", "--steps", "2", "--report-to", "tensorboard",
              "--out", out])
    rows, curves = read_rows(out), scalars(out)
    assert [s for s, _ in curves["train/reward"]] == [2, 4]
    assert [v for _, v in curves["train/reward"]] == pytest.approx([r["reward"] for r in rows[1:]], rel=1e-6)
    logged = []

    def on_log_failing_the_second_time(self, *args, **kwargs):
        logged.append(1)
        if len(logged) == 2:
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(TensorBoardCallback, "on_log", on_log_failing_the_second_time)
    capsys.readouterr()
    run_main([*MICRO, "--engine", "trl", "--objective", "grpo", "--steps", "3", "--report-to", "tensorboard",
              "--out", "runs/report_trl_failing"])
    warnings = [line for line in re.split(r"[\r\n]+", capsys.readouterr().err) if "warning" in line]
    assert len(warnings) == 1 and "TensorBoard failed at on_log (OSError" in warnings[0], warnings
    assert len(logged) == 2 and [r["step"] for r in read_rows("runs/report_trl_failing")] == [0, 1, 2, 3]
