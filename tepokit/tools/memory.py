"""Memory: the plan printed before a run (and by --dry-run), the refusal of a run that would not fit,
the peak memory a run measures, and --check-memory-on-device (the plan against worst-case steps)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import torch

import tepo
from tepokit.core import sampling
from tepokit.cli.flags import objective_config, run_settings
from tepokit.diagnostics.entropy_check import ENTROPY_CHECK_MAX_POSITIONS, checked_rows
from tepokit.core.clock import PhaseClock
from tepokit.plumbing.errors import fail, quiet
from tepokit.core.forward import LOGITS_CHUNK_BYTES
from tepokit.plumbing.hub import cannot_load, use_offline_hub_if_unreachable
from tepokit.setup.lora import adapter_parameter_count
from tepokit.setup.model import builtin_tokenizer, pick_device, tiny_model_config
from tepokit.plumbing.rundir import read_log, write_json
from tepokit.core.sampling import static_generation
from tepokit.core.sampling import uses_loop
from tepokit.core.generate import STATIC_CACHE_MODEL_TYPES
from tepokit.core.step_settings import step_settings
from tepokit.setup.task import load_task
from tepokit.core.reward import encode_prompts


# The memory plan: an upper bound, made from the model's config before any weight is loaded, of the bytes
# of live tensors at each phase of an RL step, counted as CUDA's caching allocator counts them
# (torch.cuda.max_memory_allocated). The model's state lives through every phase of a long run: fp32
# weights, their gradients (kept from one step's last optimizer step to the next step's first), Adam's two
# moments, a fp32 reference model when the objective needs one, and on a GPU cuBLAS's workspaces (CUBLAS_WORKSPACE).
# With LoRA (--lora-rank, tepokit/setup/lora.py): the frozen base (fp32, or bf16 with --lora-base-bf16) without
# gradients or moments, the adapters (r x (in + out) per adapted layer) with both, and no reference model (the base,
# adapters off).
# Each phase adds its own tensors:
#   generation     the rollout: the prompts' prefill (every prompt token through the MLP at once), then
#                  one token at a time over a growing KV cache, the sampler's [B, V] temporaries, and
#                  generate's stacked logits [B, T, V] when its log-probs are wanted
#   evaluation     greedy decoding of a rollout's worth of rows, one row per prompt
#   old log-probs  no-grad forwards of one micro-batch: the reference model's, the policy's (recomputed
#                  old log-probs)
#   update         one micro-batch's forward and backward (activations, logits, their gradient, the lm_head
#                  weight's gradient), the taps' no-grad forward (tepokit/core/taps.py: the entropy check's
#                  logits before the update, [c, T, V], held from the first optimizer step on; TEPO's entropies),
#                  then Adam's foreach step
#   entropy check  after the update: in bf16 the noise floor (one micro-batch's log-probs in bf16 and fp32), then
#                  the logits before and after the update on the checked rows, and one forward
# Under bf16 autocast every phase that runs a forward keeps bf16 copies of the weights (2 bytes per
# parameter) from the forward through its backward. On the CPU the plan counts what the run adds to the
# process, not the ~0.5 GB that torch and transformers take. tepokit/tests/test_memory_plan.py holds it
# against the live tensor bytes counted at each phase of real runs.

PHASES = ("generation", "evaluation", "old log-probs", "update", "entropy check")
# What the parts do not list, as a share of the rest: tensors of a few MB or less (the rollout's ids and
# masks, norms' statistics), kernels' workspaces (attention's) and the allocator's rounding. The parts
# alone came within 2% of the peak at the GPU measurement's four runs, once 1% below it.
UNLISTED = 0.05
# cuBLAS keeps a workspace for each handle and stream it has run on, from the caching allocator, for the process's
# life (PyTorch's aten/src/ATen/cuda/CublasHandlePool.cpp): 32 MiB on a Hopper GPU (8 MiB on older ones), and
# cuBLASLt's 1 MiB. A run holds two on its stream (the forward's thread and autograd's backward thread each have a
# handle) and, capturing the decode step (tepokit/core/cuda_graph.py), two more: its warm-up stream and capture stream.
CUBLAS_WORKSPACE = 33 * 2**20


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


def model_shape(config, args=None) -> dict:
    """The sizes the plan needs, from a transformers config (GPT-2's and Llama/Qwen2's names alike); with
    --lora-rank, the adapters' parameters too (refused in one line if a target module is not in the model)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):                            # shapes only: no memory, no weights
        meta_model = AutoModelForCausalLM.from_config(config)
    H, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    lora = args is not None and args.lora_rank > 0
    return {"n_params": sum(p.numel() for p in meta_model.parameters()), "H": H,
            "adapters": adapter_parameter_count(meta_model, args) if lora else 0, "L": config.num_hidden_layers,
            "V": config.vocab_size, "kv": kv_heads * (H // heads),            # width of the keys (and values)
            "I": getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * H,
            # a gated MLP (Llama, Qwen2: gate, up, their product) and RMSNorm, or GPT-2's (fc, gelu) and LayerNorm
            "gated": config.model_type != "gpt2",
            "tied": bool(getattr(config, "tie_word_embeddings", True)),
            "supports_gradient_checkpointing": meta_model.supports_gradient_checkpointing}


def memory_plan(args, config, needs_ref: bool, device_type: str = "cpu") -> dict:
    """Estimated bytes of the model's state (parts) and of each phase (PHASES) of an RL step, and the peak:
    the model's state plus the phase that adds the most. A phase is as large as its largest moment; phases
    gives, per phase, that moment's name and its parts (bytes), totals their sums. device_type: the run's
    (--cuda-graphs auto generates over a static KV cache on CUDA)."""
    m = model_shape(config, args)
    N, H, L, V, kv, inner = m["n_params"], m["H"], m["L"], m["V"], m["kv"], m["I"]
    # LoRA (tepokit/setup/lora.py): N frozen base weights (no gradient, no Adam moments, no reference model: the
    # reference is the base with the adapters off) and n_trained adapter parameters that train; without: all N train
    lora, n_trained = args.lora_rank > 0, m["adapters"] if args.lora_rank > 0 else N
    base_bf16 = lora and args.lora_base_bf16             # the whole base in bf16 (needs --precision bf16)
    a = 2 if args.precision == "bf16" else 4             # bytes of a linear layer's output (bf16 under autocast)
    k = 4 + a if not base_bf16 else 2 * a                 # a key and a value: RoPE's fp32 cos/sin keep keys fp32
    settings = step_settings(args, config, device_type=device_type)   # as the run resolves them
    b = settings.rows_per_forward                         # rows per forward and backward
    R = args.prompts_per_step * args.group_size          # rows of a rollout
    P, T = args.max_prompt_tokens, args.max_new_tokens
    S = P + T                                             # longest sequence
    ckpt = args.gradient_checkpointing
    whole_sequences = not settings.prompt_once    # completion_logits without its twin: a forward of each row's sequence
    loop = uses_loop(config, args.fast, args.sampler)
    static = static_generation(args.fast, args.cuda_graphs, device_type)   # the KV cache preallocated (cuda_graph.py)
    static_cache = static and not loop and config.model_type in STATIC_CACHE_MODEL_TYPES
    recompute = settings.recompute
    rows_checked = checked_rows(args.entropy_check_rows, R, T) if args.entropy_check_every <= args.steps else 0
    n_checked = min(rows_checked * T, ENTROPY_CHECK_MAX_POSITIONS)        # positions the entropy check compares
    # autocast keeps the bf16 copy of a weight that trains until the backward; a frozen fp32 weight (LoRA's base) it
    # casts at each use and, without gradients, lets go at once: the largest, lm_head's [V, H], beside the logits it
    # makes; a bf16 base needs no copy
    casts_frozen = lora and a == 2 and not base_bf16
    copies = {"bf16 weight copies (autocast)": 2 * n_trained if args.precision == "bf16" else 0}
    cast = {"lm_head's bf16 cast (autocast)": 2 * V * H if casts_frozen else 0}
    # ...but in a forward with gradients each frozen weight's cast is kept for the backward (the gradient of its input
    # needs it): every linear layer's and lm_head's (the embedding is looked up, not cast); one layer's at a time
    # under checkpointing
    layer_weights = (N - V * H * (1 if m["tied"] else 2)) // L
    update_copies = {**copies, "frozen weights' bf16 casts, kept for the backward":
                     2 * (V * H + (layer_weights if ckpt else L * layer_weights)) if casts_frozen else 0}
    # a no-grad MLP's live outputs, per token; with LoRA one more: peft's adapted layer returns
    # base(x) + B(A(x)) * scaling, holding the base's output, the adapter's scaled output and their sum at once
    mlp = ((3 if m["gated"] else 2) + lora) * inner * a
    # the logits the update's taps keep for the entropy check, before its first optimizer step ([c, T, V]), held
    # to the step's end (tepokit/core/taps.py)
    before = {"entropy check: logits before": rows_checked * T * V * a}

    def chunks(positions: int, n: int, nbytes: int = 4) -> int:
        """n float32 temporaries of one chunk of the logits (forward.LOGITS_CHUNK_BYTES) over `positions`."""
        return n * min(LOGITS_CHUNK_BYTES, positions * V * nbytes)

    # --decode-precision bf16 (sampling.decoding): bf16 copies of the fp32 parameters for the call, and every
    # product, activation and cache entry in bf16 (RoPE's cos and sin too); else generation computes as the run does
    bf16_decoding = settings.decode == "bf16"
    g = 2 if bf16_decoding else a                         # bytes of a linear layer's output while generating
    f = 2 if bf16_decoding else 4                         # bytes of what is fp32 otherwise (norms, residual stream)
    gk = 2 * g if bf16_decoding else k                    # a key and a value in the cache
    g_copies = ({"bf16 weights for decoding": 2 * (N + lora * n_trained)}
                if bf16_decoding else {**copies, **cast})
    g_mlp = mlp // a * g

    def rollout(prompts: int, group: int, stacked: bool) -> list:
        """The moments of generating `group` completions of `prompts` prompts (tepokit/core/sampling.py)."""
        rows = prompts * group
        if loop:     # sample_gpt2: fp32 keys and values of each prompt once, the completions' in one buffer
            prompt_cache = {"prompts' keys and values": 2 * L * prompts * P * H * f}
            # a layer's queries, keys and values, its MLP, the residual stream, a norm's and the attention's
            # outputs, and the prompts' causal mask
            return [("prefill", {**prompt_cache, **g_copies, "prefill: one layer": prompts * P * (3 * H * g + g_mlp
                                                                                             + 3 * H * f + P)}),
                    ("decoding", {**prompt_cache, **g_copies,
                                  "completions' keys and values": 2 * L * rows * T * H * f,
                                  "sampling step (float32 [B, V])": rows * V * (g + 7 * 4)})]
        cache = {"KV cache": L * rows * S * kv * gk}
        if static_cache:  # sample_static_cache: the whole cache from the prefill on; the attention reads all of it
            sampling_step = {"sampling step (float32 [B, V])": rows * V * (g + 7 * 4)}
            return [("prefill", {**cache, **g_copies, "prefill: one layer, its mask [B, 1, P, S]":
                                 rows * P * (g_mlp + 3 * H * f + P + S) + rows * V * g}),
                    ("decoding", {**cache, **g_copies, **sampling_step,
                                  "repeated keys and values (and their bf16 copies)": 2 * f * rows * S * H})]
        moments = [("prefill", {"KV cache": L * rows * P * kv * gk, **g_copies,
                                "prefill: one layer": rows * P * (g_mlp + 3 * H * f + P) + rows * V * g}),
                   # a layer's cache grows by a copy; its keys and values repeated for the attention (GQA)
                   ("decoding", {**cache, **g_copies, "one layer's cache copy, repeated keys and values":
                                 2 * rows * S * (kv * gk + H * g),
                                 "sampling step (float32 [B, V])": rows * V * (g + 3 * 4),
                                 "stacked logits": rows * T * V * 4 if stacked else 0})]
        if stacked:  # generate's result keeps its cache while the log-probs are read from the stacked logits
            moments.append(("log-probs of the stacked logits", {**cache, "stacked logits":
                            rows * T * V * 4, "log-softmax temporaries": 3 * rows * V * 4}))
        return moments

    def forward(rows: int, nbytes: int, entropy: bool = True) -> list:
        """The moments of a no-grad completion_logits on `rows` rows (each distinct prompt once, its keys and
        values copied to its rows, then the completions; under checkpointing or --no-fast each row's whole
        sequence), then its log-probs and entropy chunk by chunk. nbytes: of the logits and linear outputs.
        entropy=False: the log-probs alone (token_logprobs: a float32 chunk, one more for the temperature's
        division, half of one more from bf16 logits)."""
        logits = rows * (T + 1) * V * nbytes
        temporaries = (chunks(rows * T, 4) if entropy else
                       chunks(rows * T, 1 + (args.temperature != 1.0)) + (chunks(rows * T, 1) // 2 if nbytes < 4
                                                                         else 0))
        if whole_sequences:
            return [("forward", {**cast, "one layer": rows * S * (mlp * nbytes // a + 3 * H * 4) + rows * S * S,
                                 "logits": logits}),
                    ("log-probs", {"logits and a contiguous copy": 2 * logits, "chunk temporaries": temporaries})]
        cache = L * rows * S * kv * (4 + nbytes)
        return [("forward", {**cast, "KV cache": cache, "one layer": rows * T * (mlp * nbytes // a + 3 * H * 4)
                             + 2 * rows * S * (kv * (4 + nbytes) + H * nbytes) + rows * T * S}),
                ("logits", {**cast, "KV cache": cache, "logits (two pieces and their concatenation)": 2 * logits}),
                ("log-probs", {"logits": logits, "chunk temporaries": temporaries})]

    # What one layer keeps for the backward, per token: the residual stream and the norms (fp32), the
    # attention's queries, output and its copy, the MLP's outputs; per row, the (repeated) keys and values.
    per_token = (6 if m["gated"] else 4) * H * 4 + 4 * H * a + (4 if m["gated"] else 2) * inner * a

    def layer(tokens: int, rows: int) -> int:
        return tokens * per_token + 2 * rows * S * H * a

    def update() -> list:
        logits = b * (T + 1) * V * a
        lm_head_grad = 0 if lora else V * H * (4 + (2 if args.precision == "bf16" else 0))   # frozen with LoRA
        common = {**update_copies, **before}
        # the update's taps (tepokit/core/taps.py): a no-grad forward after a mini-batch's backward, over the entropy
        # check's rows or (TEPO's details) each micro-batch
        taps = ([(f"the taps' forward: {moment}", {**common, **parts}) for moment, parts in forward(b, a)]
                if rows_checked or args.objective == "tepo" else [])
        # each distinct prompt of the micro-batch once (a micro-batch that splits groups meets one more); with
        # --no-fast each row's own prompt
        prompts = min(b, math.ceil(b / args.group_size) + (b % args.group_size != 0)) if args.fast else b
        # the embedding's weight gradient [V, H]; with tied weights (lm_head is the embedding) also lm_head's,
        # held until the embedding's arrives, and their sum. Without checkpointing the prompts' forward came
        # first, so its backward comes last: its activations and the logits' gradient wait for it.
        embedding_backward = ("backward through the embedding", {
            **before, "embedding weight gradients": 0 if lora else V * H * 4 * (3 if m["tied"] else 1),
            "prompts' activations, gradient of the logits": 0 if ckpt else L * prompts * P * per_token + b * T * V * a})
        if ckpt:     # the layers' inputs; the logits [b, T+1, V] with a contiguous copy of [:, :-1]
            inputs = {"layer inputs (checkpoints)": L * b * S * H * 4}
            return taps + [("backward through the log-probs", {**common, **inputs, "logits, copy, gradient": 3 * logits,
                                                        "chunk temporaries": chunks(b * T, 3)}),
                    ("backward through lm_head", {**common, **inputs, "gradient of the logits and of their slice":
                                                  2 * logits, "lm_head weight gradient": lm_head_grad}),
                    ("backward through a layer", {**common, **inputs, "one layer recomputed, its gradients":
                                                  2 * layer(b * S, b)}),
                    embedding_backward, ("Adam's step", {**before, "foreach temporaries": 4 * n_trained})]
        acts = {"activations": L * layer(b * T, b) + L * prompts * P * per_token}
        return taps + [("forward", {**common, **acts, "KV cache": L * b * S * kv * k if args.fast else 0,
                             "logits": 2 * logits}),
                ("backward through the log-probs", {**common, **acts, "logits and their gradient": 2 * logits,
                                                    "chunk temporaries": chunks(b * T, 3)}),
                # the gradient of the slice [:, 1:] is copied to be contiguous for lm_head's backward
                ("backward through lm_head", {**common, **acts, "gradient of the logits and a copy": 2 * logits,
                                              "lm_head weight gradient": lm_head_grad}),
                embedding_backward, ("Adam's step", {**before, "foreach temporaries": 4 * n_trained})]

    def old_logprobs() -> list:
        # the reference model's forwards, then (only when recomputed) the policy's
        return [(f"{name}: {moment}", {**copies, **parts}) for name in ("reference model", "policy")
                if name == "policy" and recompute or name == "reference model" and needs_ref
                for moment, parts in forward(b, a)] or [("none: the sampler's", {})]

    def entropy_check() -> list:
        """After the step: the bf16 noise floor (the log-probs of one micro-batch in bf16, under autocast with its
        weight copies, then in fp32, without: autocast's cache is emptied when it ends), then the entropy check."""
        floor = ([(f"bf16 noise floor, {name}: {moment}", {**held, **before, **parts})
                  for name, nbytes, held in (("bf16", a, copies), ("fp32", 2 if base_bf16 else 4, {}))
                  for moment, parts in forward(b, nbytes, entropy=False)] if args.precision == "bf16" else [])
        if not rows_checked:
            return floor or [("not run", {})]
        rows = min(b, rows_checked)
        after = {"logits before and after, at every checked row": 2 * rows_checked * T * V * a}
        return (floor + [(f"its forward: {moment}", {**copies, **after, **parts}) for moment, parts in forward(rows, a)]
                + [("the checked positions", {**copies, **after,
                                              "their logits before and after": 2 * n_checked * V * a}),
                   ("predicted and measured change", {**after, "positions before and after": 2 * n_checked * V * a,
                                                      "chunk temporaries": 8 * min(LOGITS_CHUNK_BYTES,
                                                                                   n_checked * V * 4)})])

    eval_rows = min(args.n_test, R)
    pass_k_prompts = min(args.pass_k_problems, args.n_test, max(1, R // args.pass_k))
    moments = {"generation": rollout(args.prompts_per_step, args.group_size,
                                     stacked=not loop and not static_cache and settings.sampler_logprobs),
               "evaluation": rollout(eval_rows, 1, False) + rollout(pass_k_prompts, args.pass_k, False),
               "old log-probs": old_logprobs(), "update": update(), "entropy check": entropy_check()}
    phases = {phase: max(found, key=lambda moment: sum(moment[1].values())) for phase, found in moments.items()}
    phases = {phase: (moment, {part: n for part, n in parts.items() if n}) for phase, (moment, parts) in phases.items()}
    totals = {phase: sum(parts.values()) for phase, (_, parts) in phases.items()}
    parts = {"weights (fp32)": 4 * N, "gradients (fp32)": 4 * N, "Adam moments (fp32)": 8 * N,
             "reference model (fp32)": 4 * N if needs_ref else 0}
    if lora:
        parts = {f"base weights, frozen ({'bf16' if base_bf16 else 'fp32'})": (2 if base_bf16 else 4) * N,
                 "LoRA adapters: weights (fp32)": 4 * n_trained, "LoRA adapters: gradients (fp32)": 4 * n_trained,
                 "LoRA adapters: Adam moments (fp32)": 8 * n_trained}
    if device_type == "cuda":
        parts["cuBLAS workspaces"] = (4 if static and (loop or static_cache) else 2) * CUBLAS_WORKSPACE
    phase = max(totals, key=totals.get)
    listed = sum(parts.values()) + totals[phase]
    return {"parts": parts, "phases": phases, "totals": totals, "n_params": N, "n_adapters": m["adapters"],
            "unlisted": UNLISTED * listed,
            "peak": (1 + UNLISTED) * listed, "phase": phase,
            "supports_gradient_checkpointing": m["supports_gradient_checkpointing"]}


def device_memory(device) -> int:
    """Bytes the run may use: the GPU's total memory, or the memory the CPU machine has available."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    for line in open("/proc/meminfo") if os.path.exists("/proc/meminfo") else []:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def print_memory_plan(plan: dict, capacity: int, device, in_full: bool) -> None:
    """The plan: the model's state, each phase, the parts of the phase that peaks (in_full); or its peak in one line."""
    gib, where = 2**30, "on the GPU" if device.type == "cuda" else "available on this machine"
    if not in_full:
        print(f"memory plan: estimated peak {plan['peak'] / gib:.2f} GiB ({plan['phase']}) of {capacity / gib:.1f} GiB "
              f"{where} ({plan['n_params'] / 1e6:.1f}M parameters; --dry-run shows each part)", flush=True)
        return
    adapters = f", {plan['n_adapters'] / 1e6:.2f}M LoRA adapter parameters trained" if plan["n_adapters"] else ""
    print(f"memory plan (an upper bound; {plan['n_params'] / 1e6:.1f}M parameters{adapters}):")
    for part, nbytes in plan["parts"].items():
        print(f"  {part:<40} {nbytes / gib:8.2f} GiB")
    print("  each phase adds, at its largest moment:")
    for phase, total in plan["totals"].items():
        moment, parts = plan["phases"][phase]
        print(f"    {phase:<38} {total / gib:8.2f} GiB   {moment}")
        if phase == plan["phase"]:
            for part, nbytes in parts.items():
                print(f"      {part:<36} {nbytes / gib:8.2f} GiB")
    print(f"  {'unlisted: small tensors, workspaces (5%)':<40} {plan['unlisted'] / gib:8.2f} GiB")
    print(f"  {'estimated peak (' + plan['phase'] + ')':<40} {plan['peak'] / gib:8.2f} GiB of {capacity / gib:.1f} GiB "
          f"{where}", flush=True)


def check_memory(args, task, device, needs_ref: bool, in_full: bool = False) -> dict:
    """Print the plan (part by part if in_full); refuse, in one line, a run that would not fit (unless --force)."""
    plan = memory_plan(args, model_config_for_plan(args, task), needs_ref, device.type)
    if args.gradient_checkpointing and not plan["supports_gradient_checkpointing"]:
        fail(f"argument --gradient-checkpointing: model {args.model!r} does not support gradient checkpointing; "
             f"run without --gradient-checkpointing")
    capacity = device_memory(device)
    # In full when asked for (--dry-run) or when it matters: on a GPU, or when the run would not fit.
    print_memory_plan(plan, capacity, device,
                      in_full=in_full or args.dry_run or device.type == "cuda" or plan["peak"] > capacity)
    if plan["peak"] > capacity and not args.force and not args.dry_run:
        fail(f"the estimated peak memory {plan['peak'] / 2**30:.1f} GiB exceeds the {capacity / 2**30:.1f} GiB "
             f"of the device; lower --micro-batch-size, --max-new-tokens or --prompts-per-step, add "
             f"--gradient-checkpointing or --precision bf16, or pass --force to try anyway")
    return plan


# --check-memory-on-device: the plan of a run, then its worst case on the device, measured. Each phase's plan is
# the model's state plus the phase and the unlisted share, as the peak is.
LAP_PHASES = {"generation": ("generate", "reward"), "old log-probs": ("old_logprobs",), "update": ("update",),
              "entropy check": ("measure",)}      # the measurements after the update: the entropy check's peak


def dry_run(args, obj_overrides: dict) -> None:
    """--dry-run: print the memory plan; nothing is trained or written, only a --model's config is read."""
    args, obj_overrides = run_settings(args, obj_overrides)
    cfg = objective_config(args, obj_overrides)
    check_memory(args, None, pick_device(args), tepo.needs_ref(args.objective, cfg))


def check_memory_on_device(args, obj_overrides: dict, train) -> dict:
    """The plan, then two RL steps at the plan's worst case on this device: every prompt cut to
    --max-prompt-tokens (the run's training questions, repeated until they are that long), every completion
    --max-new-tokens long (the end tokens are switched off), every row trained (no dynamic sampling), the
    entropy check on both steps if the run makes it, and an evaluation of a rollout's worth of problems at the
    end; the second step runs with the gradients and Adam's moments of the first. Prints each phase's
    measured peak (torch.cuda.max_memory_allocated on a GPU; on the CPU resident memory above the process's
    start, which also holds freed blocks, and falls when the allocator gives pages back: a phase that adds
    little can measure at or below zero, and its plan/measured reads "-") beside its plan, and writes
    memory_check.json. `train` is train_small.py's run (passed in: the package does not import the script)."""
    if args.compare or args.resume or args.dry_run:
        fail("argument --check-memory-on-device: a mode of its own; run it without --compare, --resume and --dry-run")
    torch.set_num_threads(args.threads)
    device, task = pick_device(args), load_task(args)
    plan = check_memory(args, task, device, tepo.needs_ref(args.objective, objective_config(args, obj_overrides)),
                        in_full=True)
    out = args.out or os.path.join("runs", f"memory_check__{time.strftime('%Y%m%d-%H%M%S')}")
    rows = args.prompts_per_step * args.group_size
    runs_check = args.entropy_check_every <= args.steps
    # a rollout's worth of held-out problems (the built-in task keeps its own: they decide its warm-up)
    worst = dataclasses.replace(
        args, check_memory_on_device=False, out=os.path.join(out, "run"), steps=2, eval_every=2, save_every=10**9,
        n_test=rows if args.model else args.n_test, pass_k_problems=max(1, rows // args.pass_k), report_to="none",
        stop_after=None, entropy_check_every=1 if runs_check else 10**9,
        dataset=worst_case_dataset(args, task, rows, os.path.join(out, "data.jsonl")) if args.model else None)
    prompts = f"of {args.max_prompt_tokens} tokens" if args.model else "(the built-in task's)"
    print(f"--check-memory-on-device: 2 RL steps on {device.type}: {args.prompts_per_step} prompts {prompts} x "
          f"{args.group_size} completions of {args.max_new_tokens} tokens, every row trained; the run's console in "
          f"{out}/run.log", flush=True)
    # the sampler and the completion mask look the end tokens up by this name (train_small.py's from train's)
    patched = ((sampling.__dict__, "eos_ids_of", no_end_tokens), (train.__globals__, "eos_ids_of", no_end_tokens))
    saved = [namespace[name] for namespace, name, _ in patched]
    try:
        for namespace, name, value in patched:
            namespace[name] = value
        os.makedirs(out, exist_ok=True)
        with quiet(os.path.join(out, "run.log")):
            train(worst, {**obj_overrides, "dynamic_sampling": False},                # each phase's peak memory
                  clock=lambda: PhaseClock(peak_device=device))
    finally:
        for (namespace, name, _), value in zip(patched, saved):
            namespace[name] = value
    log = read_log(os.path.join(worst.out, "metrics.jsonl"))
    start = log[0]["memory/process_before_model_mb"] if device.type == "cpu" else 0.0
    measured = {phase: max(row[f"memory/peak_mb/{lap}"] for row in log[1:] for lap in laps) - start
                for phase, laps in LAP_PHASES.items()}
    measured["evaluation"] = log[-1]["perf/peak_memory_mb"] - start          # after the last lap: the evaluation
    result = print_check(plan, measured, device, log[1:], args)
    write_json(os.path.join(out, "memory_check.json"), result)
    print(f"written: {os.path.join(out, 'memory_check.json')}")
    return result


def no_end_tokens(model) -> list:
    """The worst case's end tokens: none, so every completion runs to --max-new-tokens."""
    return []


def worst_case_dataset(args, task, rows: int, path: str) -> str:
    """A JSONL of the run's training questions, each repeated until its prompt is at least --max-prompt-tokens
    long in the model's tokens (the run cuts it to that from the left), with their answers: 6 x rows records,
    so that the held-out split (a fifth, tepokit/setup/task.py) holds a rollout's worth of problems."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    train_split = task["train"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for i in range(6 * rows):
            record = train_split[i % len(train_split)]
            question = long_question = record["question"]
            while question.strip() and len(encode_prompts(tokenizer, [long_question], args).input_ids[0]) < \
                    args.max_prompt_tokens:                       # a chat template's tokens count (core/reward.py)
                long_question += " " + question
            f.write(json.dumps({"question": long_question, "answer": record["answer"]}) + "\n")
    return path


def print_check(plan: dict, measured: dict, device, steps: list, args) -> dict:
    """Each phase's plan beside its measured peak, and the lengths the steps reached; the result as a dict."""
    gib, mib = 2**30, 2**20
    planned = {phase: (1 + UNLISTED) * (sum(plan["parts"].values()) + plan["totals"][phase]) / mib
               for phase in PHASES}
    what = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "resident memory above the start"
    print(f"{'phase':<16}{'plan':>11}{'measured':>11}{'plan/measured':>15}   (measured: {what})")
    for phase in PHASES:   # on the CPU a phase that adds less than the allocator has given back measures <= 0
        ratio = f"{planned[phase] / measured[phase]:.2f}" if measured[phase] > 0 else "-"
        print(f"{phase:<16}{planned[phase] * mib / gib:>7.2f} GiB{measured[phase] * mib / gib:>7.2f} GiB{ratio:>15}")
    peak = max(measured, key=measured.get)
    print(f"peak: planned {plan['peak'] / gib:.2f} GiB ({plan['phase']}), measured {measured[peak] * mib / gib:.2f} "
          f"GiB ({peak}): plan/measured {plan['peak'] / mib / measured[peak]:.2f}")
    lengths = [row["completions/mean_length"] for row in steps]
    print(f"completions: mean length {min(lengths):.0f} of --max-new-tokens {args.max_new_tokens}; rows trained: "
          f"{min(row['dynamic_sampling/kept_frac'] for row in steps):.0%}")
    return {"device": str(device), "planned_mb": planned, "measured_mb": measured,
            "planned_peak_mb": plan["peak"] / mib, "planned_phase": plan["phase"], "measured_phase": peak,
            "measured_peak_mb": measured[peak], "completion_mean_length": lengths}
