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

from tepokit.core.forward import autocast, eos_ids_of
from tepokit.core.cuda_graph import warn_once
from tepokit.core.generate import sample_generate, sample_static_cache, static_cache_problem
from tepokit.core.shared_prefix import sample_gpt2


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
           precision: str, sampler: str, cuda_graphs: str, greedy: bool = False, want_logprobs: bool = False) -> dict:
    """The rollout's completions, the fast twin of generate_group's model.generate (train_small.py, --fast):
    sample_gpt2 when the model is GPT-2-shaped and --sampler is loop, else sample_generate, or with --cuda-graphs
    their static-cache forms, under the run's --precision. The result's tensors are sample_gpt2's."""
    device = prompt_ids.device
    settings = dict(group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature,
                    eos_ids=eos_ids_of(model), pad_id=model.generation_config.pad_token_id, greedy=greedy)
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
