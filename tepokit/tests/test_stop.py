"""tepokit/stop.py: Ctrl-C, SIGTERM and SIGHUP finish the step, checkpoint it, say how to resume, and exit
with 128 + the signal; --resume then goes on with every step logged exactly once."""
import re
import signal
from pathlib import Path

import pytest
import torch

from tepokit.tests.helpers import (MICRO, assert_whole_rows_without_duplicates, read_rows, rows_in, run_main,
                                   start_process, wait_until)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_finishes_the_step_and_resume_logs_every_step_once(sig, workdir):
    out = f"runs/{sig.name}"
    process = start_process([*MICRO, "--objective", "grpo", "--steps", "12", "--out", out])
    wait_until(lambda: rows_in(out) >= 2, process)
    process.send_signal(sig)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 128 + sig, stderr                  # 130, 143, 129: the shell's convention
    last = stderr.strip().splitlines()[-1]
    m = re.fullmatch(rf"{sig.name}: stopped after step (\d+); resume with: python train_small.py --resume {out}", last)
    assert m and "Traceback" not in stderr, stderr
    stopped = int(m[1])
    assert stopped < 12, "the run ended before the signal arrived: the test did not test anything"
    assert_whole_rows_without_duplicates(out)
    assert rows_in(out) == stopped + 1                                  # the step's row was flushed
    assert torch.load(Path(out, "checkpoint.pt"), weights_only=True)["step"] == stopped
    run_main(["--resume", out])
    assert [r["step"] for r in read_rows(out)] == list(range(13))      # every step once, in order
    assert Path(out, "summary.json").exists()
