"""The peak memory a run measures: allocated CUDA memory on a GPU, the process's resident memory on the CPU."""

from __future__ import annotations

import os

import torch


def reset_peak_memory(device) -> None:
    """Start a run's peak-memory count afresh (--compare runs several in one process). On Linux,
    writing 5 to /proc/self/clear_refs resets the process's peak resident memory (VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_memory_mb(device) -> float:
    """Peak allocated CUDA memory, or the peak resident memory of the process on the CPU (since the
    last reset_peak_memory), in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return process_memory_mb("VmHWM")


def process_memory_mb(field: str = "VmRSS") -> float:
    """VmRSS (now) or VmHWM (peak) of this process from /proc/self/status, in MiB (getrusage elsewhere)."""
    if os.path.exists("/proc/self/status"):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024                 # kB
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, KiB on Linux
