"""The RL step's clock: the seconds of each of its phases (and, for --bench and --check-memory-on-device, their
FLOPs and peak memory)."""

from __future__ import annotations

import time

import torch

from tepokit.plumbing.peak_memory import peak_memory_mb, reset_peak_memory


def wait_for_the_gpu() -> None:
    """CUDA runs kernels asynchronously: a clock read while they run would charge their time to a later phase.
    Wait for them when this process uses CUDA (nothing to wait for on the CPU)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseClock:
    """Seconds of each phase of an RL step; its FLOPs when given the --bench's FlopCounterMode (flop_counter),
    and each phase's peak memory when given the device (peak_device, --check-memory-on-device: the count starts
    afresh at each lap). clock.lap(name) ends the phase `name`; clock.row() gives timing/<name> (flops/<name>,
    memory/peak_mb/<name>) and step_time. On a GPU each lap waits for the phase's kernels (wait_for_the_gpu).
    train_small.train makes one per step with the maker it is given (the plain PhaseClock by default)."""

    def __init__(self, flop_counter=None, peak_device=None):
        wait_for_the_gpu()
        self.flop_counter, self.peak_device = flop_counter, peak_device
        if peak_device is not None:       # what came before the step (an evaluation) is not its phases'
            reset_peak_memory(peak_device)
        self.start = self.last = time.time()
        self.flops = self.flops_total()
        self.seconds, self.counted, self.peaks = {}, {}, {}

    def flops_total(self) -> int:
        return self.flop_counter.get_total_flops() if self.flop_counter is not None else 0

    def lap(self, name: str) -> None:
        wait_for_the_gpu()
        now, flops = time.time(), self.flops_total()
        self.seconds[name], self.counted[name] = now - self.last, flops - self.flops
        self.last, self.flops = now, flops
        if self.peak_device is not None:
            self.peaks[name] = peak_memory_mb(self.peak_device)
            reset_peak_memory(self.peak_device)

    def total(self) -> float:
        return self.last - self.start

    def row(self) -> dict:
        flops = {f"flops/{k}": v for k, v in self.counted.items()} if self.flop_counter is not None else {}
        return {**{f"timing/{k}": v for k, v in self.seconds.items()}, "step_time": self.total(), **flops,
                **{f"memory/peak_mb/{k}": v for k, v in self.peaks.items()}}
