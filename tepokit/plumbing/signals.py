"""Stopping cleanly: Ctrl-C (SIGINT), SIGTERM (kill, timeout, Slurm, job schedulers) and SIGHUP (a closed
terminal or SSH connection) all finish the current RL step, checkpoint it and exit with 128 + the signal.

As PyTorch Lightning does, the handler only records the signal; the loop looks at it at its next safe
point (after a step is logged), so no file is written inside a signal handler. A signal during a run's
final save or summary is honoured once they are written. A second signal while the step finishes aborts
at once: the run then resumes from its last checkpoint. Every stop ends the whole command: --compare and
--bench do not start their next run, and say how to go on."""

from __future__ import annotations

import signal

STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class Stopped(BaseException):
    """A stop signal that ends the process, with exit status 128 + signum and `message` (what was kept and
    how to go on), which train_small.py prints as its last line. Raised at once outside the RL loop, or by
    a second signal inside it; by the loop at its safe point for the first. Nothing is left half-written:
    every file is written atomically. A BaseException, so that `except Exception` does not swallow it."""

    def __init__(self, signum: int, message: str = "stopped; nothing after the last checkpoint is kept"):
        super().__init__(signum, message)
        self.signum, self.message = signum, message
        self.name = signal.Signals(signum).name
        self.exit_status = 128 + signum      # the shell's convention: 130 SIGINT, 143 SIGTERM, 129 SIGHUP


def stopped_after(signum: int, step: int, steps: int, run_dir: str) -> Stopped:
    """The end of a run (of `steps` RL steps) stopped by a signal after `step`, which is checkpointed: what
    was kept, and how to go on. Both engines end this way."""
    if step < steps:
        return Stopped(signum, f"stopped after step {step}, which is checkpointed; resume with: python "
                               f"train_small.py --resume {run_dir}")
    return Stopped(signum, f"stopped after step {step}, the last: the run is complete in {run_dir}")


class StopSignals:
    """`with StopSignals(finish_step=...) as stop:` handles SIGINT, SIGTERM and SIGHUP while inside.

    finish_step=False (loading, the warm-up): a signal raises Stopped at once; there is no finished step
    to keep, and the warm-up cache is written atomically.
    finish_step=True (the RL loop): the first signal is only recorded (stop.requested); the loop finishes
    the step, checkpoints it and exits with stop.exit_status. A second signal raises Stopped.
    The previous handlers come back on leaving, so the loop's handlers nest inside the program's."""

    def __init__(self, finish_step: bool = False):
        self.finish_step = finish_step
        self.signum = None
        self.previous = {}

    def handler(self, signum, frame):
        if not self.finish_step or self.signum is not None:
            raise Stopped(signum)
        self.signum = signum           # the only thing done here: the loop acts on it at a safe point

    def __enter__(self):
        for s in STOP_SIGNALS:
            try:
                self.previous[s] = signal.signal(s, self.handler)
            except ValueError:         # not the main thread: the signals keep their usual meaning
                break
        return self

    def __exit__(self, *exc):
        for s, h in self.previous.items():
            signal.signal(s, h)
        return False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum
