"""Memory: the plan printed before a run (and by --dry-run), the refusal of a run that would not fit,
and the peak memory a run measures."""

from __future__ import annotations

import math
import os

import torch

from tepokit.entropy_check import ENTROPY_CHECK_MAX_POSITIONS, checked_rows
from tepokit.errors import fail
from tepokit.forward import LOGITS_CHUNK_BYTES, rows_per_forward
from tepokit.hub import cannot_load, use_offline_hub_if_unreachable
from tepokit.model import builtin_tokenizer, tiny_model_config
from tepokit.sampling import sampler_logprobs_wanted, stacked_logits_bytes
from tepokit.task import load_task

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


# An estimate, by part, of the peak memory of a run, made from the model's config before any weight
# is loaded. The parts that do not depend on the rollout size are the model's: weights, gradients
# and Adam's two moments in float32 (16 bytes per parameter), and a float32 reference model when the
# objective needs one. The rest is per forward pass (--micro-batch-size rows): the activations kept
# for the backward, and the logits [b, T, V], which dominate with a large vocabulary (151,936 for
# Qwen2.5: 0.6 MB per position in float32). Generation's KV cache grows with the rollout. On the CPU
# the plan counts what the run adds to the process, not the ~0.5 GB that torch and transformers take.

def model_config_for_plan(args, task):
    """The config of the model the run will train (built-in: made here, nothing is trained yet)."""
    from transformers import AutoConfig
    if args.model is None:
        return tiny_model_config(args, builtin_tokenizer(task if task is not None else load_task(args)))
    offline_reason = None if os.path.exists(args.model) else use_offline_hub_if_unreachable()
    try:
        return AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 -- any loading failure is a user-facing one-liner
        cannot_load("the config of model", args.model, e, offline_reason,
                    "give a local model directory, or run without --model for the built-in tiny model")


def memory_plan(args, config, needs_ref: bool) -> dict:
    """Estimated bytes by part, and the peak: the model's parts plus the larger of the two phases
    (generation, update), which never overlap."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):                            # shapes only: no memory, no weights
        meta_model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in meta_model.parameters())
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    kv_dim = getattr(config, "num_key_value_heads", None) or heads
    kv_dim = kv_dim * H // heads
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * H
    b = rows_per_forward(args)                            # rows per forward and backward
    rollout = args.prompts_per_step * args.group_size     # rows generated at once (evaluation too)
    S = args.max_prompt_tokens + args.max_new_tokens      # longest sequence
    T = args.max_new_tokens
    act = 2 if args.precision == "bf16" else 4            # bytes of an activation or a logit
    # Per token and layer, what a transformer layer keeps for its backward: norms, q/k/v, the
    # attention output and its weights, the residuals and the MLP's hidden layers.
    per_layer_token = (7 * H + 2 * kv_dim + heads * S + 4 * inner) * act
    # Tokens of one forward: every row's prompt and completion under gradient checkpointing; otherwise
    # each distinct prompt once (forward.completion_logits; a micro-batch that splits groups meets one
    # more) and every row's completion.
    prompts = min(b, math.ceil(b / args.group_size) + (b % args.group_size != 0))
    tokens = b * S if args.gradient_checkpointing else prompts * args.max_prompt_tokens + b * T
    layer_inputs = L * tokens * H * 4                     # what gradient checkpointing keeps
    one_layer = tokens * per_layer_token
    logits = b * (T + 1) * V * act                        # one forward's logits [b, T + 1, V]
    chunk = min(LOGITS_CHUNK_BYTES, b * (T + 1) * V * 4)  # one chunk of float32 softmax temporaries
    check = min(checked_rows(args) * T, ENTROPY_CHECK_MAX_POSITIONS) * V * act   # the check's kept logits
    plan = {
        "weights (fp32)": 4 * n_params,
        "gradients (fp32)": 4 * n_params,
        "Adam moments (fp32)": 8 * n_params,
        "reference model (fp32)": 4 * n_params if needs_ref else 0,
        "activations, one micro-batch": layer_inputs + one_layer if args.gradient_checkpointing else L * one_layer,
        # the logits and their gradient, softmax temporaries chunk by chunk, and under gradient checkpointing
        # the gradient of the slice [:, :-1] taken of them (forward.completion_logits)
        "logits, one micro-batch": (3 if args.gradient_checkpointing else 2) * logits + 4 * chunk,
        "entropy check (logits before)": check,
        "generation KV cache": 2 * L * rollout * S * kv_dim * act,
        # the fused sample step's float32 temporaries [B, V]; generate's stacked logits [B, T, V] if the
        # log-probs are taken from it (tepokit/sampling.py)
        "generation logits": rollout * V * 4 * 3 + (stacked_logits_bytes(args, config)
                                                    if sampler_logprobs_wanted(args, config) else 0),
    }
    # The update's peak: its micro-batch (activations and logits) while the entropy check's "before"
    # logits wait; or the entropy check itself: before and after, one forward's logits, temporaries.
    update = max(plan["activations, one micro-batch"] + plan["logits, one micro-batch"] + check,
                 2 * check + logits + 6 * chunk)
    generation = plan["generation KV cache"] + plan["generation logits"]
    model = sum(plan[k] for k in ("weights (fp32)", "gradients (fp32)", "Adam moments (fp32)",
                                  "reference model (fp32)"))
    return {"parts": plan, "n_params": n_params, "peak": model + max(update, generation),
            "phase": "update" if update >= generation else "generation",
            "supports_gradient_checkpointing": meta_model.supports_gradient_checkpointing}


def device_memory(device) -> int:
    """Bytes the run may use: the GPU's total memory, or the memory the CPU machine has available."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    for line in open("/proc/meminfo") if os.path.exists("/proc/meminfo") else []:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def print_memory_plan(plan: dict, capacity: int, device, in_full: bool) -> None:
    """The plan part by part (in_full), or its peak in one line."""
    gib, where = 2**30, "on the GPU" if device.type == "cuda" else "available on this machine"
    if not in_full:
        print(f"memory plan: estimated peak {plan['peak'] / gib:.2f} GiB of {capacity / gib:.1f} GiB {where} "
              f"({plan['n_params'] / 1e6:.1f}M parameters; --dry-run shows each part)", flush=True)
        return
    print(f"memory plan (estimate; {plan['n_params'] / 1e6:.1f}M parameters):")
    for part, nbytes in plan["parts"].items():
        print(f"  {part:<32} {nbytes / gib:8.2f} GiB")
    print(f"  {'estimated peak (' + plan['phase'] + ')':<32} {plan['peak'] / gib:8.2f} GiB of {capacity / gib:.1f} GiB "
          f"{where}", flush=True)


def check_memory(args, task, device, needs_ref: bool) -> dict:
    """Print the plan; refuse, in one line, a run that would not fit (unless --force)."""
    plan = memory_plan(args, model_config_for_plan(args, task), needs_ref)
    if args.gradient_checkpointing and not plan["supports_gradient_checkpointing"]:
        fail(f"argument --gradient-checkpointing: model {args.model!r} does not support gradient checkpointing; "
             f"run without --gradient-checkpointing")
    capacity = device_memory(device)
    # In full when asked for (--dry-run) or when it matters: on a GPU, or when the run would not fit.
    print_memory_plan(plan, capacity, device, in_full=args.dry_run or device.type == "cuda" or plan["peak"] > capacity)
    if plan["peak"] > capacity and not args.force and not args.dry_run:
        fail(f"the estimated peak memory {plan['peak'] / 2**30:.1f} GiB exceeds the {capacity / 2**30:.1f} GiB "
             f"of the device; lower --micro-batch-size, --max-new-tokens or --prompts-per-step, add "
             f"--gradient-checkpointing or --precision bf16, or pass --force to try anyway")
    return plan
