"""The shared-prefix sampler for GPT-2-shaped models (sample_gpt2), and the sampling loop every fast sampler runs
(sampling_loop). With the same random stream it draws the same tokens as transformers' `generate` (test_sampling.py):
it replaces generate's general machinery, not its sampling (plain softmax(z / T), no top-k, no top-p)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tepo
from tepokit.core.cuda_graph import static_decoder


def logprob_and_entropy(logits: torch.Tensor, token: torch.Tensor, temperature: float) -> tuple:
    """log p(token) and the entropy of one position at temperature T, from its logits [B, V] and the token [B]: each
    [B], in float32 or finer. The sampler's fused twin of tepo.token_logprobs_from_logits and entropy_from_logits."""
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
    """G completions for each of U left-padded prompts (prompt_ids, prompt_mask [U, P]); rows u*G .. u*G+G-1 are prompt
    u's group. Returns completion_ids [B, T] (B = U*G; after its end token a row holds pad_id, as generate pads it),
    logp and entropy [B, T] at temperature T (0 after the end). T is the longest completion: the loop stops when
    every row has ended.

    The method. The prompts go through the model once each (not once per row), and their keys and values are kept
    once per prompt: prompt_keys[layer] [U*H, P, d/H]. Each row's own keys and values, those of its completion so
    far, go into a preallocated buffer [L, 2, U, H, G, T, d/H]. A new token's query attends to both parts: its
    scores against its prompt's keys are computed for the whole group at once (the G queries of a group against the
    one copy of the prompt: a [G, d/H] x [d/H, P] product per prompt and head), its scores against its own
    completion's keys per row, and one softmax over the two parts together gives the same weights as one softmax
    over the row's whole sequence. Decoding is memory-bound (every new token reads the whole cache); reading each
    prompt's keys and values once per group instead of once per row reads about G times less of the prompt, and
    keeps G times less of it. Prompt padding is masked with -inf in a float mask made once; a row's completion
    positions up to the current one are all valid (a row that has ended keeps sampling, its tokens replaced by
    pad_id, as generate does), so they need no mask.

    static (--cuda-graphs, tepokit/core/cuda_graph.py): every step attends over all T positions of the buffer
    (zeroed, so that no position holds a NaN), the ones after the current one masked with -inf, so that the step's
    shapes never change and it can be captured as a CUDA graph (capture: on a GPU). The same softmax weights: the
    masked positions weigh exactly 0.
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
