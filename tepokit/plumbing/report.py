"""--report-to: a run's curves, live, in the trackers people already use. The names and their meaning are TRL's
(and the Hugging Face Trainer's `report_to`): none, tensorboard, trackio, wandb, or a comma-separated list.

The built-in engine sends every row it writes to metrics.jsonl (training steps and evaluations alike) under
the same metric names, with the RL step as the x-axis, and the run's settings once at the start.
`--engine trl` hands the choice to GRPOConfig.report_to: TRL then reports its own logs, against its
optimizer step. metrics.jsonl stays the record: a tracker that fails during a run (a full disk, a network
tracker offline) is dropped with one warning line saying what is lost, and training goes on.

Where the curves go:
  tensorboard  <run dir>/tensorboard/ (the built-in engine) or <run dir>/runs/ (TRL's default); watch them
               with `tensorboard --logdir runs/`, which finds every run below it
  trackio      the trackio project "tepo", locally; `trackio show --project tepo`
  wandb        the Weights & Biases project "tepo" (WANDB_MODE=offline keeps it on disk)
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import threading

from tepokit.plumbing.errors import fail, first_line, warn

TRACKERS = ("tensorboard", "trackio", "wandb")
PROJECT = "tepo"        # trackio's and Weights & Biases' project name for every run


def trackers_of(report_to: str) -> list[str]:
    """'none' -> []; 'tensorboard,wandb' -> ['tensorboard', 'wandb']."""
    return [] if report_to == "none" else [name.strip() for name in report_to.split(",")]


def valid_report_to(report_to: str) -> bool:
    names = trackers_of(report_to)
    return report_to == "none" or (len(names) == len(set(names)) and all(n in TRACKERS for n in names))


def check_installed(report_to: str) -> None:
    """Before anything is loaded: a tracker whose package is missing is refused in one line that says how to
    install it. (TensorBoard's writer is torch's, which needs the tensorboard package to write.)"""
    for name in trackers_of(report_to):
        if importlib.util.find_spec(name) is None:
            fail(f"argument --report-to: {name} is not installed; pip install {name}, or leave it out of --report-to")


class Trackers:
    """The trackers of one run of the built-in engine. `with Trackers(names, run_dir, config) as trackers:`
    then trackers.log(row) for each row written to metrics.jsonl. A tracker that raises is closed and
    dropped, in one warning line; the others, and the run, go on."""

    def __init__(self, names: list[str], run_dir: str, config: dict):
        self.run_dir, self.open = run_dir, {}
        self.thread_hook = threading.excepthook
        threading.excepthook = self.quiet_writer_thread
        for name in names:
            self.attempt(name, "start", lambda: self.open.__setitem__(name, START[name](run_dir, config)))

    def log(self, row: dict) -> None:
        """The row's numbers (metric name -> value), at x = its step."""
        numbers = {k: float(v) for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for name in list(self.open):
            self.attempt(name, f"step {row['step']}", lambda: LOG[name](self.open[name], numbers, row["step"]))

    def close(self) -> None:
        for name in list(self.open):
            self.attempt(name, "the end of the run", lambda: CLOSE[name](self.open[name]))
            self.open.pop(name, None)
        threading.excepthook = self.thread_hook

    def quiet_writer_thread(self, hook_args) -> None:
        """threading.excepthook while the trackers are open. TensorBoard writes its events from a thread of its
        own, which keeps its error (a full disk) for the run's next write, where attempt() says it in one
        warning line: the thread's own traceback, some 30 lines, is left out. Other threads print theirs."""
        if type(hook_args.thread).__name__ != "_AsyncWriterThread":
            self.thread_hook(hook_args)

    def attempt(self, name: str, when: str, action) -> None:
        try:
            action()
        except Exception as e:  # noqa: BLE001 -- any failure of a tracker: metrics.jsonl still has everything
            self.open.pop(name, None)
            warn_failed(name, when, e, self.run_dir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def warn_failed(name: str, when: str, error: Exception, run_dir: str) -> None:
    """The one line that says a tracker failed and is dropped (both engines)."""
    warn(f"--report-to {name} failed at {when} ({type(error).__name__}: {first_line(error)}); its curves stop "
         f"there, and {os.path.join(run_dir, 'metrics.jsonl')} keeps every row")


# ---- one start, log and close per tracker ----------------------------------------------------------------

def start_tensorboard(run_dir: str, config: dict):
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"), flush_secs=5)
    writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")
    return writer


def log_tensorboard(writer, numbers: dict, step: int) -> None:
    for key, value in numbers.items():
        writer.add_scalar(key, value, step)
    writer.flush()                     # live: the row is on disk before the next step starts


def start_trackio(run_dir: str, config: dict):
    import trackio
    return trackio.init(project=PROJECT, name=os.path.basename(os.path.normpath(run_dir)), config=config)


def start_wandb(run_dir: str, config: dict):
    import wandb
    return wandb.init(project=PROJECT, name=os.path.basename(os.path.normpath(run_dir)), dir=run_dir, config=config)


def log_run(run, numbers: dict, step: int) -> None:
    """trackio's and wandb's runs take the same call; NaN (a metric a step did not measure) is left out."""
    run.log({k: v for k, v in numbers.items() if math.isfinite(v)}, step=step)


START = {"tensorboard": start_tensorboard, "trackio": start_trackio, "wandb": start_wandb}
LOG = {"tensorboard": log_tensorboard, "trackio": log_run, "wandb": log_run}
CLOSE = {"tensorboard": lambda writer: writer.close(), "trackio": lambda run: run.finish(),
         "wandb": lambda run: run.finish()}


class KeepTrainingIfReportingFails:
    """One of the Trainer's reporting callbacks (--engine trl's --report-to: TensorBoard, trackio, wandb), wrapped so
    that its failure (a full disk, a tracker offline) is one warning line (warn_failed) and the end of its curves,
    not the end of training: metrics.jsonl, written from TRL's own log, stays the record."""

    def __init__(self, callback, run_dir: str):
        self.callback, self.run_dir = callback, run_dir

    def __getattr__(self, event: str):        # every event the Trainer calls: on_log, on_train_begin, ...
        if event.startswith("__") or "callback" not in self.__dict__:   # copy and pickle look for these
            raise AttributeError(event)
        if self.callback is None:              # failed before: its curves have stopped
            return lambda *args, **kwargs: None
        method = getattr(self.callback, event)
        if not callable(method):
            return method

        def guarded(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 -- whatever the tracker raised, training goes on
                name = type(self.callback).__name__.removesuffix("Callback")
                self.callback = None
                warn_failed(name, event, e, self.run_dir)
                return None
        return guarded
