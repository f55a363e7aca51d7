"""Generation's decode step over a static KV cache, replayed as a CUDA graph (--cuda-graphs auto|on|off).

Why: at a rollout's batch a decode step of a 0.5B model on a GPU is a few hundred small kernels, each
launched from Python; the GPU waits for the launches, not for its memory (docs/one-gpu.md: 21-29 ms per new
token for Qwen2.5-0.5B's shape, where reading the weights takes 0.4 ms). A CUDA graph records the step's
kernels once and replays them with one launch. Recording needs every shape and every address fixed: the KV cache is
preallocated to prompt + --max-new-tokens and written in place, each step attends over all of it with the
positions not yet written masked out, and the step reads its inputs (the new tokens [B], the position t)
from tensors it owns. The sampling itself (tepokit/core/shared_prefix.py: sample_step, temperature, multinomial,
greedy) runs outside the graph, unchanged.

  off   today's samplers (sample_gpt2's growing attention, transformers' generate)
  on    the static cache; its decode step captured as a CUDA graph on a GPU. Where capture cannot run (the
        CPU) or fails, one line on stderr and the same static-cache step runs eagerly
  auto  on when the run's device is CUDA, else off (the default)

The static-cache step is tested equal to today's on the CPU (tepokit/tests/test_sampling_static.py): the
same tokens for the same seed in float64, the same log-probs and entropies to rounding.
"""

from __future__ import annotations

import torch

from tepokit.plumbing.errors import first_line, warn

WARNED: set[str] = set()      # each fallback is said once per process, not once per rollout
# The side stream of every capture's warm-up, one per device: cuBLAS keeps a workspace (32 MiB on a Hopper GPU) for
# each stream it has run on, for the process's life, so a new stream per capture (each rollout and evaluation) would
# add one workspace per capture, up to the 32 streams of torch's pool (about 1 GiB).
WARM_UP_STREAMS: dict = {}


def warn_once(message: str) -> None:
    if message not in WARNED:
        WARNED.add(message)
        warn(message)


def static_decoder(decode, rows: int, device, capture: bool, reset=lambda: None):
    """decode(token_in [B] long, t_in [] long) -> logits [B, V]: one decode step whose shapes do not change from
    step to step. Returns decode_next(token [B], t: int) -> logits [B, V]: the step fed through tensors it
    owns, replayed as a CUDA graph when `capture` and capture works, else run eagerly. reset() undoes what
    the warm-up steps before capture changed beside their outputs (a cache's write position)."""
    token_in = torch.zeros(rows, dtype=torch.long, device=device)    # [B] the step's inputs, at fixed addresses
    t_in = torch.zeros((), dtype=torch.long, device=device)          # [] the completion position

    def feed(token, t: int) -> None:
        token_in.copy_(token)
        t_in.fill_(t)

    replay = None
    if capture and device.type != "cuda":
        warn_once(f"--cuda-graphs on: CUDA graphs need a GPU; the decode step runs eagerly over the static KV "
                  f"cache on {device.type}")
    elif capture:
        replay = captured(decode, token_in, t_in, reset)
    if replay is None:
        return lambda token, t: (feed(token, t), decode(token_in, t_in))[1]
    return lambda token, t: (feed(token, t), replay())[1]


def captured(decode, token_in, t_in, reset):
    """The step recorded as a CUDA graph: replay() -> its logits [B, V] (one tensor, rewritten by each replay);
    None, after one line on stderr, when capture fails (the caller then runs the step eagerly)."""
    if token_in.device not in WARM_UP_STREAMS:
        WARM_UP_STREAMS[token_in.device] = torch.cuda.Stream(token_in.device)
    side = WARM_UP_STREAMS[token_in.device]
    try:
        # Under bf16 autocast the casts of the weights must be recorded too: autocast's cache would hand the
        # graph casts made outside it (torch.cuda.make_graphed_callables refuses the cache for this reason).
        cast = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False,
                              enabled=torch.is_autocast_enabled("cuda"))
        side.wait_stream(torch.cuda.current_stream())
        with cast, torch.cuda.stream(side):
            for _ in range(2):       # warm-up off the main stream: cuBLAS handles, lazily made buffers
                decode(token_in, t_in)
        torch.cuda.current_stream().wait_stream(side)
        reset()
        graph = torch.cuda.CUDAGraph()
        with cast, torch.cuda.graph(graph):
            logits = decode(token_in, t_in)
    except Exception as e:  # noqa: BLE001 -- any capture failure falls back to the eager step, in one line
        torch.cuda.current_stream().wait_stream(side)
        reset()
        warn_once(f"--cuda-graphs: capturing the decode step failed ({type(e).__name__}: {first_line(e)}); "
                  f"it runs eagerly over the static KV cache")
        return None

    def replay():
        graph.replay()
        return logits
    return replay
