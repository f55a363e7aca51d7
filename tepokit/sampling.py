"""The rollout's sampler: G completions per prompt, and each sampled token's log-prob and entropy.

Two ways, the same distribution (plain softmax(z / T), no top-k, no top-p):
  - sample_gpt2: a sampling loop written out for GPT-2-shaped models (the built-in model, GPT-2 itself).
    Each prompt is read once for its whole group (its keys and values are then copied G times), the
    keys and values live in one preallocated buffer, and one fused step per token samples it and
    keeps its log-prob and entropy. With the same random stream it draws the same tokens as
    transformers' `generate` (tepokit/tests/test_sampling.py): it replaces generate's general machinery,
    not its sampling.
  - sample_generate: transformers' `generate`, for every other model. It gives log-probs and entropies
    only from the logits of every step ([B, T, V]), so by default its old log-probs are recomputed
    (recompute_old_logprobs).

Why the log-probs matter: they are the behaviour policy's, computed from the very logits that chose
each token, so the RL step needs no extra forward pass for its old log-probs (train_small.py,
rollout_statistics; --recompute-old-logprobs brings the pass back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tepokit.forward import autocast
from tepokit.model import eos_ids_of


# generate's log-probs need the logits of every step stacked, [B, T, V] float32: never more than this.
STACKED_LOGITS_MAX_BYTES = 2**30


def uses_loop(args, config) -> bool:
    """Does the run sample with sample_gpt2? --sampler loop (the default) and a plain GPT-2 config (what
    sample_gpt2 computes, layer by layer; AutoModelForCausalLM makes a GPT2LMHeadModel of it)."""
    return (args.sampler == "loop" and config.model_type == "gpt2" and config.scale_attn_weights
            and not config.scale_attn_by_inverse_layer_idx and not config.reorder_and_upcast_attn
            and not config.add_cross_attention)


def stacked_logits_bytes(args, config) -> int:
    """Bytes of generate's stacked logits [B, T, V] for one rollout (0 with the loop: it needs none)."""
    if uses_loop(args, config):
        return 0
    return args.prompts_per_step * args.group_size * args.max_new_tokens * config.vocab_size * 4


def recompute_old_logprobs(args, config) -> bool:
    """Are the old log-probs recomputed by a forward pass after the rollout? --recompute-old-logprobs;
    unset: yes in bf16 (the sampler's and the training forward's log-probs then differ by bf16's rounding,
    as much as an update changes them) and with generate (its log-probs need the logits of every step,
    [B, T, V], which grow with the rollout); no with the loop in fp32, whose log-probs cost nothing."""
    if args.recompute_old_logprobs is not None:
        return args.recompute_old_logprobs
    return args.precision == "bf16" or not uses_loop(args, config)


def sampler_logprobs_wanted(args, config) -> bool:
    """Must the sampler give log-probs and entropies? When they are the old ones, or for the sampling
    check (--check-sampling-logprobs: sampled against recomputed) when they are cheap."""
    return (not recompute_old_logprobs(args, config)
            or (args.check_sampling_logprobs and stacked_logits_bytes(args, config) <= STACKED_LOGITS_MAX_BYTES))


def logprob_and_entropy(logits: torch.Tensor, token: torch.Tensor, temperature: float) -> tuple:
    """log p(token) and the entropy of one position at temperature T, from its logits [B, V] and the
    token [B]: each [B], in the model's precision if finer than float32 (float64 in the tests).
    tepo.token_logprobs_from_logits and tepo.entropy_from_logits in one pass over the logits."""
    logp_all = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    return logp_all.gather(1, token[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)


def sample_step(logits: torch.Tensor, temperature: float, greedy: bool) -> tuple:
    """One token per row from the last position's logits [B, V]: (token, its log-prob, the entropy),
    each [B]. The probabilities it samples from are computed as generate computes them (float32
    softmax of z / T), so the same random stream draws the same tokens."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature   # [B, V]
    token = z.argmax(-1) if greedy else torch.multinomial(torch.softmax(z.float(), -1), 1).squeeze(1)   # [B]
    return token, *logprob_and_entropy(logits, token, temperature)


@torch.no_grad()
def sample_gpt2(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, temperature: float,
                eos_ids: list[int], pad_id: int, greedy: bool = False, keep_logits_rows: int = 0) -> dict:
    """G completions for each of U left-padded prompts (prompt_ids, prompt_mask [U, P]); rows
    u*G .. u*G+G-1 are prompt u's group. Returns completion_ids [B, T] (B = U*G; after its end
    token a row holds pad_id, as generate pads it), logp and entropy [B, T] at temperature T (0
    after the end), and the raw logits [keep_logits_rows, T, V] of the first rows if asked.
    T is the longest completion: the loop stops when every row has ended."""
    tr, cfg, G = model.transformer, model.config, group_size
    L, H, d = cfg.n_layer, cfg.n_head, cfg.n_embd
    U, P = prompt_ids.shape
    B, S, device = U * G, P + max_new_tokens, prompt_ids.device
    dtype = next(model.parameters()).dtype
    # Every position the loop reads is written first: the buffers need no zeroing.
    keys = torch.empty(L, B, H, S, d // H, dtype=dtype, device=device)             # [L, B, H, S, d/H]
    values = torch.empty_like(keys)
    key_valid = torch.zeros(B, S, dtype=torch.bool, device=device)                  # [B, S] not padding
    key_valid[:, :P] = prompt_mask.bool().repeat_interleave(G, 0)

    def layers(x, start: int):
        """The transformer on x [rows, n, d] at positions start .. start+n-1; the logits of the last."""
        rows, n = x.shape[:2]
        if n > 1:   # the prompts: causal, padding masked; a padded query sees itself (no empty softmax)
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            attend = (prompt_mask.bool()[:, None, None, :] & causal) | torch.eye(n, dtype=torch.bool, device=device)
        for layer, block in enumerate(tr.h):
            h = block.ln_1(x)
            q, k, v = block.attn.c_attn(h).view(rows, n, 3, H, d // H).permute(2, 0, 3, 1, 4)   # [rows, H, n, d/H]
            if n > 1:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
                keys[layer, :, :, :n], values[layer, :, :, :n] = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
            else:
                keys[layer, :, :, start], values[layer, :, :, start] = k[:, :, 0], v[:, :, 0]
                a = F.scaled_dot_product_attention(q, keys[layer, :, :, :start + 1], values[layer, :, :, :start + 1],
                                                   attn_mask=key_valid[:, None, None, :start + 1])
            x = x + block.attn.c_proj(a.transpose(1, 2).reshape(rows, n, d))
            x = x + block.mlp(block.ln_2(x))
        return model.lm_head(tr.ln_f(x[:, -1]))                                    # [rows, V]

    position = (prompt_mask.cumsum(1) - 1).clamp(min=0)                              # [U, P]
    logits = layers(tr.wte(prompt_ids) + tr.wpe(position), 0).repeat_interleave(G, 0)   # each prompt read once
    next_position = position[:, -1].repeat_interleave(G) + 1                        # [B]
    eos = torch.tensor(eos_ids, device=device)
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, logps, entropies, kept = [], [], [], []
    for t in range(max_new_tokens):
        if keep_logits_rows:
            kept.append(logits[:keep_logits_rows].clone())
        token, logp, entropy = sample_step(logits, temperature, greedy)            # the fused step
        token = torch.where(ended, pad_id, token)
        tokens.append(token)
        logps.append(logp.masked_fill(ended, 0.0))
        entropies.append(entropy.masked_fill(ended, 0.0))
        ended |= torch.isin(token, eos)
        if ended.all() or t == max_new_tokens - 1:
            break
        key_valid[:, P + t] = True
        x = tr.wte(token[:, None]) + tr.wpe((next_position + t)[:, None])          # [B, 1, d]
        logits = layers(x, P + t)
    out = dict(completion_ids=torch.stack(tokens, 1), logp=torch.stack(logps, 1), entropy=torch.stack(entropies, 1))
    if keep_logits_rows:
        out["logits"] = torch.stack(kept, 1)                                        # [rows, T, V]
    return out


@torch.no_grad()
def sample_generate(model, prompt_ids, prompt_mask, group_size: int, max_new_tokens: int, temperature: float,
                    eos_ids: list[int], pad_id: int, greedy: bool = False, keep_logits_rows: int = 0,
                    want_logprobs: bool = False) -> dict:
    """sample_gpt2's result from transformers' generate (every model). logp and entropy (and logits)
    only if want_logprobs or keep_logits_rows: they stack the logits of every step, [B, T, V]."""
    ids, mask = prompt_ids.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    stacked = want_logprobs or keep_logits_rows > 0
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                         eos_token_id=eos_ids, return_dict_in_generate=True, output_logits=stacked, use_cache=True,
                         **sampling)
    result = dict(completion_ids=out.sequences[:, ids.shape[1]:])                    # [B, T]
    if stacked:       # step by step: one step's temporaries [B, V] at a time beside generate's logits
        steps = [logprob_and_entropy(step_logits, result["completion_ids"][:, t], temperature)
                 for t, step_logits in enumerate(out.logits)]
        result["logp"] = torch.stack([logp for logp, _ in steps], 1)                  # [B, T]
        result["entropy"] = torch.stack([entropy for _, entropy in steps], 1)         # [B, T]
        if keep_logits_rows:
            result["logits"] = torch.stack([lt[:keep_logits_rows] for lt in out.logits], 1)  # [rows, T, V], a copy
    return result


def sample(model, prompt_ids, prompt_mask, group_size: int, args, device, greedy: bool = False,
           keep_logits_rows: int = 0, want_logprobs: bool = False) -> dict:
    """The rollout's completions (sample_gpt2 when the model is GPT-2-shaped, else sample_generate),
    under the run's precision. The result's tensors are those of sample_gpt2."""
    settings = dict(group_size=group_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    eos_ids=eos_ids_of(model), pad_id=model.generation_config.pad_token_id, greedy=greedy,
                    keep_logits_rows=keep_logits_rows)
    with autocast(device, args.precision):
        if uses_loop(args, model.config):
            return sample_gpt2(model, prompt_ids, prompt_mask, **settings)
        return sample_generate(model, prompt_ids, prompt_mask, want_logprobs=want_logprobs, **settings)
