"""tepokit/plumbing/signals.py: Ctrl-C, SIGTERM and SIGHUP finish the step, checkpoint it, say how to resume, and exit
with 128 + the signal; --resume then goes on with every step logged exactly once."""
import os
import re
import shlex
import signal
from pathlib import Path

import pytest
import torch

import train_small as ts
from tepokit.plumbing.signals import Stopped
from tepokit.tests.helpers import (MICRO, assert_whole_rows_without_duplicates, line_of, read_rows, rows_in, run_main,
                                   signal_at, start_process, wait_until)


def test_a_stop_signal_finishes_the_step_and_resume_logs_every_step_once(workdir):
    """SIGINT, SIGTERM and SIGHUP, each to a real run (the three run at once, to keep the suite short)."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    processes = {sig: start_process([*MICRO, "--objective", "grpo", "--steps", "12", "--threads", "1",
                                     "--out", f"runs/{sig.name}"]) for sig in signals}
    for sig, process in processes.items():
        wait_until(lambda: rows_in(f"runs/{sig.name}") >= 2, process)
        process.send_signal(sig)
    for sig, process in processes.items():
        out = f"runs/{sig.name}"
        stderr = process.communicate(timeout=120)[1]
        assert process.returncode == 128 + sig, stderr                  # 130, 143, 129: the shell's convention
        last = stderr.strip().splitlines()[-1]
        m = re.fullmatch(rf"train_small.py: {sig.name}: stopped after step (\d+), which is checkpointed; resume "
                         rf"with: python train_small.py --resume {out}", last)
        assert m and "Traceback" not in stderr, stderr
        stopped = int(m[1])
        assert stopped < 12, "the run ended before the signal arrived: the test did not test anything"
        assert_whole_rows_without_duplicates(out)
        assert rows_in(out) == stopped + 1                                  # the step's row was flushed
        assert torch.load(Path(out, "checkpoint.pt"), weights_only=True)["step"] == stopped
        run_main(["--resume", out])
        assert [r["step"] for r in read_rows(out)] == list(range(13))      # every step once, in order
        assert Path(out, "summary.json").exists()


# Where a signal can land at a run's end: (line of train_small.train, the step at which it is sent). Step 2 of 3
# is not a checkpoint step (--save-every 10): around the decision to save. Step 3: the last step's end, the
# final save and the summary.
SIGNAL_PLACES = [*[(text, 2) for text in ("stopping = stop.requested", "if step % args.save_every", "if stopping:")],
                 *[(text, 3) for text in ("if step % args.save_every", "if last_step == args.steps", "save_pretrained",
                                          "rows = rundir.read_log", "write_summary(", "if stop.requested:")]]


@pytest.mark.parametrize("text, step", SIGNAL_PLACES)
def test_a_signal_anywhere_at_a_runs_end_stops_it_and_names_its_newest_checkpoint(text, step, workdir):
    """SIGTERM at each place of SIGNAL_PLACES: the run always stops, with 143, and the step its message names
    is checkpoint.pt's, from which it resumes to the end; at the last step, after the policy and the summary
    are written. (A signal once fell between the decision to save and the stop, and named a step whose
    checkpoint was not written; one during the final save or summary was dropped.)"""
    out = f"runs/signal_at_{line_of(ts.train, text)}_{step}"
    with signal_at(ts.train, line_of(ts.train, text), step) as sent, pytest.raises(Stopped) as stop:
        ts.main([*MICRO, "--objective", "grpo", "--steps", "3", "--save-every", "10", "--out", out])
    assert sent and stop.value.exit_status == 143
    named = int(re.match(r"stopped after step (\d+)", stop.value.message)[1])
    assert named == torch.load(Path(out, "checkpoint.pt"), weights_only=True)["step"] == rows_in(out) - 1
    if named < 3:
        assert stop.value.message.endswith(f"resume with: python train_small.py --resume {out}")
        assert not Path(out, "summary.json").exists()
        run_main(["--resume", out])
        assert [r["step"] for r in read_rows(out)] == [0, 1, 2, 3]
    else:
        assert stop.value.message.endswith(f"the run is complete in {out}")
    assert Path(out, "summary.json").exists() and Path(out, "policy", "model.safetensors").exists()


def test_a_stop_during_a_comparison_stops_it_and_the_command_it_prints_goes_on(workdir):
    """SIGTERM during the first run's summary: that run is complete, the comparison's next run does not start,
    and the last line gives the command that goes on; it reads the finished run back and runs the rest."""
    out = "runs/cmp_stopped"
    argv = [*MICRO, "--compare", "grpo,tepo", "--steps", "2", "--out", out]
    with signal_at(ts.train, line_of(ts.train, "write_summary("), step=2), pytest.raises(Stopped) as stop:
        ts.main(argv)
    assert stop.value.exit_status == 143
    message = stop.value.message
    assert message.startswith(f"--compare stopped in {out}/grpo__1 with 1 of 2 runs finished; go on with: python "
                              "train_small.py "), message
    assert Path(out, "grpo__1", "summary.json").exists() and not Path(out, "tepo__1").exists()
    finished = Path(out, "grpo__1", "metrics.jsonl").read_text()
    command = shlex.split(message.split("go on with: ")[1])
    assert command[:2] == ["python", "train_small.py"] and command[command.index("--out") + 1] == out
    run_main(command[2:])
    assert Path(out, "grpo__1", "metrics.jsonl").read_text() == finished      # read back, not run again
    assert [r["step"] for r in read_rows(f"{out}/tepo__1")] == [0, 1, 2]
    assert Path(out, "summary.md").exists()


def test_a_stop_during_the_bench_stops_it_before_trls_run(workdir):
    """SIGTERM during the bench's first run of ours: TRL's run does not start, and the last line says how to
    run the bench again (a bench pairs runs made back to back: it starts over, in a new directory)."""
    pytest.importorskip("trl")
    out = "runs/bench_stopped"
    with signal_at(ts.train, line_of(ts.train, "stopping = stop.requested"), step=1), \
            pytest.raises(Stopped) as stop:
        ts.main([*MICRO, "--bench", "--bench-steps", "1", "--bench-repeats", "1", "--out", out])
    assert stop.value.exit_status == 143
    message = stop.value.message
    assert message.startswith(f"--bench stopped; what it measured so far is in {out}; run it again with: python "
                              "train_small.py "), message
    command = shlex.split(message.split("run it again with: ")[1])
    assert "--bench" in command and "--out" not in command and command[command.index("--bench-repeats") + 1] == "1"
    assert sorted(os.listdir(out)) == ["ours_1", "ours_1.log"]            # neither ours recomputed nor TRL ran
