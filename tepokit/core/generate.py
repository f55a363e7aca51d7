"""The fast samplers for every model but GPT-2's shape: transformers' `generate` with each token's log-prob and
entropy read from its logits (sample_generate), and with --cuda-graphs its static-KV-cache twin for Qwen2 and Llama
models (sample_static_cache: transformers' StaticCache under the shared sampling loop)."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from tepokit.core.cuda_graph import static_decoder
from tepokit.core.shared_prefix import end_check_every, logprob_and_entropy, sampling_loop


@torch.no_grad()
def sample_generate(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, temperature: float,
                    eos_ids: list[int], pad_id: int, greedy: bool = False, want_logprobs: bool = False) -> dict:
    """sample_gpt2's result from transformers' generate (every model). logp and entropy (and logits)
    only if want_logprobs: they stack the logits of every step, [B, T, V]."""
    ids, mask = prompt_ids.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    stacked = want_logprobs
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                         eos_token_id=eos_ids, return_dict_in_generate=True, output_logits=stacked, use_cache=True,
                         **sampling)
    result = dict(completion_ids=out.sequences[:, ids.shape[1]:])                    # [B, T]
    if stacked:       # step by step: one step's temporaries [B, V] at a time beside generate's logits
        steps = [logprob_and_entropy(step_logits, result["completion_ids"][:, t], temperature)
                 for t, step_logits in enumerate(out.logits)]
        result["logp"] = torch.stack([logp for logp, _ in steps], 1)                  # [B, T]
        result["entropy"] = torch.stack([entropy for _, entropy in steps], 1)         # [B, T]
    return result


# The models sample_static_cache was tested on (tepokit/tests/test_sampling_static.py): they take position_ids and
# a prepared 4D mask, and their caches are transformers' StaticCache.
STATIC_CACHE_MODEL_TYPES = ("qwen2", "llama")


def static_cache_problem(model) -> str | None:
    """Why sample_static_cache cannot sample from this model (None: it can)."""
    cfg = model.config
    if cfg.model_type not in STATIC_CACHE_MODEL_TYPES:
        return f"model type {cfg.model_type!r} (tested: {', '.join(STATIC_CACHE_MODEL_TYPES)})"
    if set(getattr(cfg, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return "sliding-window attention layers"
    if cfg._attn_implementation not in ("sdpa", "eager"):
        return f"attention implementation {cfg._attn_implementation!r} (sdpa or eager only)"
    return None


@torch.no_grad()
def sample_static_cache(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, temperature: float,
                        eos_ids: list[int], pad_id: int, greedy: bool = False, capture: bool = False) -> dict:
    """sample_generate's completions, log-probs and entropies from sampling_loop over transformers' StaticCache
    (--cuda-graphs, tepokit/core/cuda_graph.py): keys and values [B, kv heads, P+T, d] allocated once, written in
    place; each decode step reads them all under a mask [B, 1, 1, P+T] of the prompt's tokens and the
    completion so far, so its shapes never change and it can be captured as a CUDA graph (capture: on a GPU).
    Positions as generate makes them (cumsum of the mask - 1); the same tokens under the same random stream.
    The log-probs come from the logits that chose each token, as the loop's: no stacked logits [B, T, V]."""
    from transformers import StaticCache
    ids, mask = prompt_ids.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0)   # [B, P]
    (B, P), device, S = ids.shape, ids.device, ids.shape[1] + max_new_tokens
    cache = StaticCache(config=model.config, max_cache_len=S)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"   # 5.24 / 5.23
    key = torch.arange(S, device=device)                                          # [S] cache positions
    prompt_keys = F.pad(mask.bool(), (0, max_new_tokens))                          # [B, S] the prompt's tokens
    completion_keys = key >= P                                                    # [S]
    position = mask.long().cumsum(1) - 1                                          # [B, P]
    position.masked_fill_(mask == 0, 1)                                           # as generate

    def forward(input_ids, attend, position_ids):
        """The model over the cache; attend [B, 1, q, S] (True: seen) as the attention implementation takes it."""
        if model.config._attn_implementation != "sdpa":    # eager: added to the scores
            dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
            attend = torch.zeros(attend.shape, dtype=dtype, device=device).masked_fill_(~attend, torch.finfo(dtype).min)
        return model(input_ids=input_ids, attention_mask=attend, position_ids=position_ids, use_cache=True,
                     logits_to_keep=1, **{cache_arg: cache}).logits[:, -1]                 # [B, V]

    # the prompt: causal over its own tokens; a padding query sees itself (no empty softmax, no NaN in the cache)
    query = torch.arange(P, device=device)[:, None]                               # [P, 1]
    attend = (prompt_keys[:, None, None, :] & (key <= query)) | (key == query)   # [B, 1, P, S]
    logits = forward(ids, attend, position)
    del attend
    next_position = position[:, -1] + 1                                           # [B]

    def decode(token, t):
        attend = prompt_keys | (completion_keys & (key <= P + t))                 # [B, S]
        return forward(token[:, None], attend[:, None, None, :], (next_position + t)[:, None])

    def reset():      # the capture's warm-up steps advanced each layer's write position past the prompt
        for layer in cache.layers:
            layer.cumulative_length.fill_(P)

    return sampling_loop(logits, static_decoder(decode, B, device, capture, reset), max_new_tokens, temperature,
                         eos_ids, pad_id, greedy, end_check_every(capture, device))
