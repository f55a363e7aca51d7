"""A run that diverges: at a learning rate too high for the model, the loss, the gradient or the weights turn
NaN or infinite within a step or two, and every step after that is noise. The loop checks each step's loss,
gradient norm and weights before the step is logged or checkpointed, and takes the errors that non-finite
numbers raise further on (tepo.py's check of its inputs, the sampler's probabilities) for what they are. So
nothing non-finite is ever saved: the run stops in one line that names the step and what to try, the last
checkpoint is kept (every checkpoint before the step passed the same check), and the exit status is 3."""

from __future__ import annotations

import contextlib
import math

import torch

from tepokit.plumbing.errors import first_line

# What the errors raised by non-finite numbers say: tepo.py's input check (a ValueError) and torch's sampler
# (a RuntimeError from torch.multinomial).
NON_FINITE_ERRORS = ("non-finite values where mask is 1", "probability tensor contains either")


class Diverged(Exception):
    """A run stopped at a step that diverged. As tepokit.plumbing.signals.Stopped, it has a name, a message (what was
    kept and what to try) and an exit status, which train_small.py prints and exits with alike."""
    name = "diverged"
    exit_status = 3

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def diverged(step: int, what: str, run) -> Diverged:
    lr = run.args.lr
    return Diverged(f"step {step}: {what}, at --lr {lr:g}; nothing of step {step} was saved, and "
                    f"{run.run_dir}/checkpoint.pt, the last checkpoint before it, is finite; start again with a "
                    f"lower --lr (--lr {lr / 10:g}, say) and --out {run.run_dir} --overwrite")


def check_finite(step: int, row: dict, run) -> None:
    """Diverged when the step's loss or gradient norm (its metrics row) or any weight of the model is NaN or
    infinite. A step that made no update (DAPO's filter skipped it) has no loss to check."""
    for key in ("loss", "grad_norm"):
        if key in row and not math.isfinite(row[key]):
            raise diverged(step, f"its {key} is {row[key]}", run)
    bad = non_finite_weights(run.model)
    if bad:
        raise diverged(step, f"{len(bad)} weight tensors hold NaN or infinity, {bad[0]} the first", run)


def non_finite_weights(model) -> list[str]:
    """The names of the model's weight tensors that hold a NaN or an infinity. Every step asks: one reduction over
    all of them (one device sync), and the names only when one is not finite."""
    named = list(model.named_parameters())
    if bool(torch.stack([p.isfinite().all() for _, p in named]).all()):
        return []
    return [name for name, p in named if not bool(p.isfinite().all())]


@contextlib.contextmanager
def stops_on_divergence(step: int, run):
    """Inside: an error that a non-finite number raised (NON_FINITE_ERRORS) becomes Diverged at `step`."""
    try:
        yield
    except (ValueError, RuntimeError) as e:
        if not any(text in str(e) for text in NON_FINITE_ERRORS):
            raise
        raise diverged(step, first_line(e)[:80], run) from None
