"""The rollout's fast sampler (--fast, the default): G completions per prompt, and each sampled token's log-prob
and entropy, the twin of the plain path's `model.generate` (train_small.py, generate_group): the same tokens for
the same random stream (tepokit/tests/test_sampling.py and test_sampling_static.py). `sample` picks one of:

  - sample_gpt2 (shared_prefix.py): a sampling loop written out for GPT-2-shaped models (the built-in model,
    GPT-2 itself), which reads each prompt once for its whole group;
  - sample_generate (generate.py): transformers' `generate`, for every other model; its log-probs need the
    logits of every step ([B, T, V]), so by default its old log-probs are recomputed;
  - with --cuda-graphs (cuda_graph.py; on a GPU by default), both over a static KV cache whose decode step a
    GPU replays as a CUDA graph: sample_gpt2(static=True), and sample_static_cache (generate.py) for Qwen2 and
    Llama models.

Why the log-probs matter: they are the behaviour policy's, computed from the very logits that chose each token,
so the RL step needs no extra forward pass for its old log-probs (train_small.py, old_policy; --no-fast or
--recompute-old-logprobs bring the pass back).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tepokit.core.forward import autocast, eos_ids_of
from tepokit.core.cuda_graph import warn_once
from tepokit.core.generate import sample_generate, sample_static_cache, static_cache_problem
from tepokit.core.shared_prefix import sample_gpt2


# --decode-precision of a fp32 run on a GPU when it says auto: TF32 and bf16 decoding are faster than fp32's, and
# TF32's log-prob gap stays inside every objective's clip band (docs/one-gpu.md, "Decoding precision", measures both).
AUTO_DECODE_ON_CUDA = "tf32"
# the decoding precisions whose log-probs serve as the old ones (the rest recompute them: step_settings.py)
SAMPLER_LOGPROBS_ARE_OLD = ("fp32",)


def decode_precision(asked: str, precision: str, device_type: str) -> str:
    """How generation computes (the rollout's and the evaluation's): "autocast" in a --precision bf16 run (its
    forward passes' bf16 autocast, which --decode-precision leaves alone); in a fp32 run --decode-precision, whose
    auto is AUTO_DECODE_ON_CUDA on a GPU and fp32 elsewhere (TF32 is a GPU's; bf16 matrix products on a CPU are
    slower than fp32's)."""
    if precision == "bf16":
        return "autocast"
    if asked == "auto":
        return AUTO_DECODE_ON_CUDA if device_type == "cuda" else "fp32"
    return asked


@contextmanager
def decoding(model, decode: str):
    """Generation in the precision `decode` (decode_precision), the model given back as it came.

      fp32, autocast  nothing changes here (autocast is sample's, under --precision bf16)
      tf32            CUDA's fp32 matrix products on TF32 tensor cores (inputs rounded to 10 mantissa bits,
                      fp32 sums): torch.backends.cuda.matmul's switch, put back afterwards. On a CPU it changes
                      nothing, said once.
      bf16            the model's floating-point parameters replaced by bf16 copies for the call (the fp32 ones
                      are kept and put back, whatever ends the call): the weights are cast once per call, not at
                      each step as autocast does, and every product, the KV cache and the activations are bf16.
                      Costs 2 bytes per parameter while it lasts (the memory plan counts it).

    The sampler's log-probs then differ from the fp32 ones the trainer computes (its old log-probs are recomputed,
    step_settings.recompute_old_logprobs), by what docs/one-gpu.md measures."""
    if decode == "tf32":
        if next(model.parameters()).device.type != "cuda":
            warn_once("--decode-precision tf32: TF32 is a CUDA GPU's; generation runs in fp32 here")
        matmul = torch.backends.cuda.matmul
        # torch 2.9 and later name the switch fp32_precision (and refuse a mix with the older allow_tf32)
        name, value = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
        before = getattr(matmul, name)
        setattr(matmul, name, value)
        try:
            yield
        finally:
            setattr(matmul, name, before)
        return
    kept = [(p, p.data) for p in model.parameters() if p.dtype == torch.float32] if decode == "bf16" else []
    try:
        for p, data in kept:
            p.data = data.to(torch.bfloat16)
        yield
    finally:
        for p, data in kept:
            p.data = data


def uses_loop(config, fast: bool, sampler: str) -> bool:
    """Does the run sample with sample_gpt2? --fast and --sampler loop (the defaults) and a plain GPT-2 config
    (what sample_gpt2 computes, layer by layer; AutoModelForCausalLM makes a GPT2LMHeadModel of it)."""
    return (fast and sampler == "loop" and config.model_type == "gpt2" and config.scale_attn_weights
            and not config.scale_attn_by_inverse_layer_idx and not config.reorder_and_upcast_attn
            and not config.add_cross_attention)


def static_generation(fast: bool, cuda_graphs: str, device_type: str) -> bool:
    """Does the run generate over a static KV cache (and capture its decode step on a GPU)? From --fast (never
    with --no-fast), --cuda-graphs (on, off, auto) and the run's device type (auto: on CUDA only)."""
    return fast and (cuda_graphs == "on" or (cuda_graphs == "auto" and device_type == "cuda"))


def sample(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, temperature: float,
           precision: str, sampler: str, cuda_graphs: str, greedy: bool = False, want_logprobs: bool = False,
           eos_ids: list | None = None) -> dict:
    """The rollout's completions, the fast twin of generate_group's model.generate (train_small.py, --fast):
    sample_gpt2 when the model is GPT-2-shaped and --sampler is loop, else sample_generate, or with --cuda-graphs
    their static-cache forms, under the run's --precision. eos_ids: the end tokens (None: the model's; [] for none,
    as a measurement of every row at full length wants). The result's tensors are sample_gpt2's."""
    device = prompt_ids.device
    settings = dict(group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature,
                    eos_ids=eos_ids_of(model) if eos_ids is None else eos_ids,
                    pad_id=model.generation_config.pad_token_id, greedy=greedy)
    static = static_generation(fast=True, cuda_graphs=cuda_graphs, device_type=device.type)   # sample: --fast
    with autocast(device, precision):
        if uses_loop(model.config, fast=True, sampler=sampler):
            return sample_gpt2(model, prompt_ids, prompt_mask, static=static, capture=static, **settings)
        problem = static_cache_problem(model) if static else None
        if static and problem is None:
            return sample_static_cache(model, prompt_ids, prompt_mask, capture=True, **settings)
        if problem:
            warn_once(f"--cuda-graphs: no static KV cache for {problem}; generation runs through generate")
        return sample_generate(model, prompt_ids, prompt_mask, want_logprobs=want_logprobs, **settings)
