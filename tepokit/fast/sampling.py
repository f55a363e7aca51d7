"""The rollout's fast sampler (--fast, the default): G completions per prompt, and each sampled token's log-prob
and entropy. It is the twin of the plain path's `model.generate` (train_small.py, generate_group): the same
tokens for the same random stream, tested in tepokit/tests/test_sampling.py and test_sampling_static.py.

Two ways, the same distribution (plain softmax(z / T), no top-k, no top-p):
  - sample_gpt2: a sampling loop written out for GPT-2-shaped models (the built-in model, GPT-2 itself).
    Each prompt is read once for its whole group, and its keys and values are kept once for the group
    (not copied G times): each new token's attention reads them once per group and each row's own
    completion apart (shared-prefix attention, see sample_gpt2). The completions' keys and values live
    in one preallocated buffer, and one fused step per token samples it and keeps its log-prob and
    entropy. With the same random stream it draws the same tokens as
    transformers' `generate` (tepokit/tests/test_sampling.py): it replaces generate's general machinery,
    not its sampling.
  - sample_generate: transformers' `generate`, for every other model. It gives log-probs and entropies
    only from the logits of every step ([B, T, V]), so by default its old log-probs are recomputed
    (recompute_old_logprobs).
  - --cuda-graphs (tepokit/fast/cuda_graph.py; on a GPU by default): both over a static KV cache, whose decode
    step a GPU replays as a CUDA graph: sample_gpt2(static=True), and for Qwen2 and Llama models
    sample_static_cache (transformers' StaticCache under this module's loop, sampling_loop) in generate's place.
    The same tokens for the same seed (tepokit/tests/test_sampling_static.py).

Why the log-probs matter: they are the behaviour policy's, computed from the very logits that chose
each token, so the RL step needs no extra forward pass for its old log-probs: the twin of the plain path's
no-grad forward (train_small.py, old_policy; --recompute-old-logprobs or --no-fast bring the pass back).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

import tepo

from tepokit.fast.cuda_graph import static_decoder, static_generation, warn_once
from tepokit.core.forward import autocast
from tepokit.core.forward import eos_ids_of


# generate's log-probs need the logits of every step stacked, [B, T, V] float32: never more than this.
STACKED_LOGITS_MAX_BYTES = 2**30


def uses_loop(config, fast: bool, sampler: str) -> bool:
    """Does the run sample with sample_gpt2? --fast and --sampler loop (the defaults) and a plain GPT-2 config
    (what sample_gpt2 computes, layer by layer; AutoModelForCausalLM makes a GPT2LMHeadModel of it)."""
    return (fast and sampler == "loop" and config.model_type == "gpt2" and config.scale_attn_weights
            and not config.scale_attn_by_inverse_layer_idx and not config.reorder_and_upcast_attn
            and not config.add_cross_attention)


def stacked_logits_bytes(rollout_rows: int, max_new_tokens: int, vocab_size: int, loop: bool) -> int:
    """Bytes of generate's stacked logits [B, T, V] float32 for one rollout of B rows; 0 with the loop (loop:
    uses_loop), which stacks none."""
    if loop:
        return 0
    return rollout_rows * max_new_tokens * vocab_size * 4


def recompute_old_logprobs(fast: bool, asked: bool | None, precision: str, loop: bool) -> bool:
    """Are the old log-probs recomputed by a forward pass after the rollout (the plain path), rather than the
    sampler's (their fast twin)? Always with --no-fast; else as asked (--recompute-old-logprobs); unset: yes in bf16
    (the sampler's and the training forward's log-probs then differ by bf16's rounding, as much as an update
    changes them) and with generate (its log-probs need the logits of every step, [B, T, V], which grow with the
    rollout); no with the loop (loop: uses_loop) in fp32, whose log-probs cost nothing."""
    if not fast:
        return True
    if asked is not None:
        return asked
    return precision == "bf16" or not loop


def sampler_logprobs_wanted(fast: bool, recompute: bool, check_sampling_logprobs: bool, stacked_bytes: int) -> bool:
    """Must the sampler give log-probs and entropies? When they are the old ones (not recompute), or for the
    sampling check (--check-sampling-logprobs: sampled against recomputed) when they are cheap: when the logits
    it stacks for them (stacked_bytes, stacked_logits_bytes) are within STACKED_LOGITS_MAX_BYTES; never with
    --no-fast (the plain path's model.generate gives tokens only)."""
    return fast and (not recompute or (check_sampling_logprobs and stacked_bytes <= STACKED_LOGITS_MAX_BYTES))


def logprob_and_entropy(logits: torch.Tensor, token: torch.Tensor, temperature: float) -> tuple:
    """log p(token) and the entropy of one position at temperature T, from its logits [B, V] and the
    token [B]: each [B], in the model's precision if finer than float32 (float64 in the tests).
    tepo.token_logprobs_from_logits and tepo.entropy_from_logits in one pass over the logits."""
    logp_all = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    return logp_all.gather(1, token[:, None]).squeeze(1), tepo.entropy_from_logprobs(logp_all)


def sample_step(logits: torch.Tensor, temperature: float, greedy: bool) -> tuple:
    """One token per row from the last position's logits [B, V]: (token, its log-prob, the entropy),
    each [B]. The probabilities it samples from are computed as generate computes them (float32
    softmax of z / T), so the same random stream draws the same tokens."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature   # [B, V]
    token = z.argmax(-1) if greedy else torch.multinomial(torch.softmax(z.float(), -1), 1).squeeze(1)   # [B]
    return token, *logprob_and_entropy(logits, token, temperature)


@torch.no_grad()
def sample_gpt2(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, temperature: float,
                eos_ids: list[int], pad_id: int, greedy: bool = False, static: bool = False,
                capture: bool = False) -> dict:
    """G completions for each of U left-padded prompts (prompt_ids, prompt_mask [U, P]); rows
    u*G .. u*G+G-1 are prompt u's group. Returns completion_ids [B, T] (B = U*G; after its end
    token a row holds pad_id, as generate pads it), logp and entropy [B, T] at temperature T (0
    after the end).
    T is the longest completion: the loop stops when every row has ended.

    The method. The prompts go through the model once each (not once per row), and their keys and
    values are kept once per prompt: prompt_keys[layer] [U*H, P, d/H]. Each row's own keys and values,
    those of its completion so far, go into a preallocated buffer [L, 2, U, H, G, T, d/H]. A new token's
    query attends to both parts: its scores against its prompt's keys are computed for the whole group
    at once (the G queries of a group against the one copy of the prompt: a [G, d/H] x [d/H, P] product
    per prompt and head), its scores against its own completion's keys per row, and one softmax over the
    two parts together gives the same weights as one softmax over the row's whole sequence. Decoding is
    memory-bound (every new token reads the whole cache); reading each prompt's keys and values once per
    group instead of once per row reads about G times less of the prompt, and keeps G times less of it.
    Prompt padding is masked with -inf in a float mask made once; a row's completion positions up to
    the current one are all valid (a row that has ended keeps sampling, its tokens replaced by pad_id,
    as generate does), so they need no mask.

    static (--cuda-graphs, tepokit/fast/cuda_graph.py): every step attends over all T positions of the buffer
    (zeroed, so that no position holds a NaN), the ones after the current one masked with -inf, so that the
    step's shapes never change and it can be captured as a CUDA graph (capture: on a GPU). The same
    softmax weights: the masked positions weigh exactly 0.
    """
    tr, cfg, G = model.transformer, model.config, group_size
    L, H, d = cfg.n_layer, cfg.n_head, cfg.n_embd
    dh = d // H
    U, P = prompt_ids.shape
    B, device = U * G, prompt_ids.device
    dtype = next(model.parameters()).dtype
    scale = dh ** -0.5                                                             # scaled dot product
    valid = prompt_mask.bool()                                                    # [U, P] not padding

    # The prompts: each once, causal, padding masked; a padded query sees itself (no empty softmax).
    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    attend = (valid[:, None, None, :] & causal) | torch.eye(P, dtype=torch.bool, device=device)   # [U, 1, P, P]
    prompt_keys, prompt_values = [], []                                           # L x [U*H, P, d/H]
    position = (prompt_mask.cumsum(1) - 1).clamp(min=0)                            # [U, P]
    x = tr.wte(prompt_ids) + tr.wpe(position)                                     # [U, P, d]
    for block in tr.h:
        q, k, v = block.attn.c_attn(block.ln_1(x)).view(U, P, 3, H, dh).permute(2, 0, 3, 1, 4)   # [U, H, P, d/H]
        prompt_keys.append(k.to(dtype).reshape(U * H, P, dh))                     # contiguous copies, once
        prompt_values.append(v.to(dtype).reshape(U * H, P, dh))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)             # [U, H, P, d/H]
        x = x + block.attn.c_proj(a.transpose(1, 2).reshape(U, P, d))
        x = x + block.mlp(block.ln_2(x))
    logits = model.lm_head(tr.ln_f(x[:, -1])).repeat_interleave(G, 0)             # [B, V] each prompt read once
    # The last layer's outputs ([U, P, 3d] under k and v, the attention's, the residual stream) and the mask would
    # stay alive while decoding: U * P * (5d * 4 + P) bytes, 0.48 GiB at an evaluation of GPT-2 small's shape.
    del x, q, k, v, a, attend

    # -inf at the prompts' padding, added to the group's scores [U*H, G, P] (baddbmm's input): made once.
    prompt_bias = torch.zeros(U, H, G, P, dtype=dtype, device=device)
    prompt_bias.masked_fill_(~valid[:, None, None, :], float("-inf"))
    prompt_bias = prompt_bias.view(U * H, G, P)
    # The completions' keys (own[layer, 0]) and values (own[layer, 1]): row u*G+g's at [:, u, :, g], written
    # with one copy per layer and token; every position read is written first (no zeroing).
    own = (torch.zeros if static else torch.empty)(L, 2, U, H, G, max_new_tokens, dh, dtype=dtype, device=device)
    q = torch.empty(U * H, G, dh, dtype=dtype, device=device)                      # a group's queries, scaled
    next_position = position[:, -1].repeat_interleave(G) + 1                      # [B]
    completion_positions = torch.arange(max_new_tokens, device=device)            # [T]

    def decode(token, t):
        """The transformer on one new token per row, token [B], at completion position t (an int; static: a
        tensor [] on the device); its logits [B, V]."""
        x = tr.wte(token) + tr.wpe(next_position + t)                             # [B, d]
        n = max_new_tokens if static else t + 1                                   # completion positions read
        for layer, block in enumerate(tr.h):
            qkv = block.attn.c_attn(block.ln_1(x)).view(U, G, 3, H, dh).permute(2, 0, 3, 1, 4)   # [3, U, H, G, d/H]
            if static:
                own[layer].index_copy_(4, t.view(1), qkv[1:].unsqueeze(4).to(dtype))   # at t, an index on the device
            else:
                own[layer, :, :, :, :, t] = qkv[1:]
            torch.mul(qkv[0], scale, out=q.view(U, H, G, dh))                      # [U*H, G, d/H] q / sqrt(d/H)
            k_own, v_own = own[layer, :, :, :, :, :n].reshape(2, U * H * G, n, dh)  # views: no copy
            # scores: the group's queries against its prompt once, each row's query against its own completion
            s_prompt = torch.baddbmm(prompt_bias, q, prompt_keys[layer].transpose(1, 2))       # [U*H, G, P]
            s_own = torch.bmm(q.view(U * H * G, 1, dh), k_own.transpose(1, 2))               # [U*H*G, 1, n]
            if static:                                                             # not yet written: weight 0
                s_own.masked_fill_(completion_positions > t, float("-inf"))
            w = torch.softmax(torch.cat([s_prompt, s_own.view(U * H, G, n)], -1), -1)   # [U*H, G, P+n]
            a = torch.bmm(w[:, :, P:].reshape(U * H * G, 1, n), v_own).view(U * H, G, dh)
            a = torch.baddbmm(a, w[:, :, :P], prompt_values[layer])               # [U*H, G, d/H] both sums
            x = x + block.attn.c_proj(a.view(U, H, G, dh).permute(0, 2, 1, 3).reshape(B, d))
            x = x + block.mlp(block.ln_2(x))
        return model.lm_head(tr.ln_f(x))                                          # [B, V]

    decode_next = static_decoder(decode, B, device, capture) if static else decode
    return sampling_loop(logits, decode_next, max_new_tokens, temperature, eos_ids, pad_id, greedy,
                         end_check_every(capture, device))


def end_check_every(capture: bool, device) -> int:
    """Every how many tokens the loop asks whether every row has ended. The question waits for the GPU; with the
    decode step replayed as a CUDA graph that wait is most of a bf16 step (measured in docs/one-gpu.md), so there it
    is asked every 16 tokens. Elsewhere every token: the same random draws as generate, step for step."""
    return 16 if capture and device.type == "cuda" else 1


def sampling_loop(logits, decode_next, max_new_tokens: int, temperature: float, eos_ids: list[int], pad_id: int,
                  greedy: bool, check_every: int = 1) -> dict:
    """The samplers' loop from the first new token's logits [B, V]: sample a token per row (sample_step), keep
    it with its log-prob and entropy, and get the next logits from decode_next(token [B], t) -> [B, V], until
    every row has ended or T = max_new_tokens. The result as sample_gpt2's. check_every > 1: whether every row
    has ended is read every check_every tokens; the steps drawn after that are cut off (the same result, but
    the random stream has moved further)."""
    B, V = logits.shape
    device = logits.device
    is_eos = torch.zeros(V, dtype=torch.bool, device=device)                      # [V] a lookup table, not isin
    is_eos[torch.tensor([e for e in eos_ids if 0 <= e < V], dtype=torch.long, device=device)] = True  # >= V: not drawn
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    all_ended = torch.zeros(max_new_tokens, dtype=torch.bool, device=device)     # [T] every row had ended at t
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)   # [B, T] written in place
    logps = torch.zeros(B, max_new_tokens, dtype=torch.promote_types(logits.dtype, torch.float32), device=device)
    entropies = torch.zeros_like(logps)
    for t in range(max_new_tokens):
        token, logp, entropy = sample_step(logits, temperature, greedy)          # the fused step
        tokens[:, t] = torch.where(ended, pad_id, token)
        logps[:, t], entropies[:, t] = logp.masked_fill(ended, 0.0), entropy.masked_fill(ended, 0.0)
        ended |= is_eos[token]
        all_ended[t] = ended.all()
        if t == max_new_tokens - 1 or ((t + 1) % check_every == 0 and all_ended[t]):
            break
        logits = decode_next(tokens[:, t], t)
    n = int(all_ended.int().argmax()) + 1 if all_ended.any() else t + 1     # the first step after which all ended
    out = dict(completion_ids=tokens[:, :n].contiguous(), logp=logps[:, :n].contiguous(),
               entropy=entropies[:, :n].contiguous())
    return out


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
    (--cuda-graphs, tepokit/fast/cuda_graph.py): keys and values [B, kv heads, P+T, d] allocated once, written in
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


def sample(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, temperature: float,
           precision: str, sampler: str, cuda_graphs: str, greedy: bool = False, want_logprobs: bool = False) -> dict:
    """The rollout's completions, the fast twin of generate_group's model.generate (train_small.py, --fast):
    sample_gpt2 when the model is GPT-2-shaped and --sampler is loop, else sample_generate, or with --cuda-graphs
    their static-cache forms, under the run's --precision. The result's tensors are sample_gpt2's."""
    device = prompt_ids.device
    settings = dict(group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature,
                    eos_ids=eos_ids_of(model), pad_id=model.generation_config.pad_token_id, greedy=greedy,
)
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
