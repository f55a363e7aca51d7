"""The policy's forward pass as the RL step uses it: rows per forward (micro-batches), the logits at the
completion positions (one forward per row, and its fast twin that reads each prompt once), memory-bounded
log-probs and entropy, and the bf16 noise floor."""

from __future__ import annotations

import torch

import tepo


def autocast(device, precision: str):
    """--precision bf16: the forward passes run under bf16 autocast (CUDA and CPU alike); fp32: none.
    Weights, gradients and Adam's state stay fp32 either way."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def completion_logits(model, batch, rows, precision: str, prompt_once: bool) -> torch.Tensor:
    """Logits at the completion positions: one forward of prompt + completion per row.               [b, T, V]
    `batch` is a rollout (train_small.Rollout: prompt and completion ids and masks), `rows` [b] its rows;
    precision: --precision (bf16: under autocast); prompt_once: hand over to the fast twin below (--fast, not
    with --gradient-checkpointing).

    Left padding + absolute positions: position_ids = cumsum(attention_mask) - 1, exactly as
    generate did, otherwise every log-prob is off (by up to 14 nats on GPT-2). Position P-1+t predicts
    completion token t, so the logits of the last T+1 positions are kept and the last one dropped.
    """
    if prompt_once:     # the fast twin: each prompt once per group
        return completion_logits_prompt_once(model, batch, rows, precision)
    rows = rows.to(batch.prompt_ids.device)
    attn = torch.cat([batch.prompt_mask[rows], batch.completion_mask[rows]], 1)                # [b, P+T]
    T = batch.completion_ids.shape[1]
    with autocast(attn.device, precision):
        logits = model(input_ids=torch.cat([batch.prompt_ids[rows], batch.completion_ids[rows]], 1),
                       attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0), logits_to_keep=T + 1,
                       use_cache=False).logits                                             # [b, T+1, V]
    return logits[:, :-1]


def completion_logits_prompt_once(model, batch, rows, precision: str) -> torch.Tensor:
    """completion_logits' twin (--fast): the same logits, reading each prompt once per group. [b, T, V]

    The G completions of a prompt share it: each distinct prompt of the rows goes through the model once, and every
    row's completion attends to its prompt's keys and values (a copy per row, through which the gradient flows back
    to the prompt's forward). The same logits and gradient as one forward of prompt + completion per row (to
    rounding, tested in float64: tepokit/tests/test_forward.py), for a fraction of the work: the built-in task's
    prompts are ~65 tokens, its completions ~16. Not with gradient checkpointing, under which transformers keeps no
    keys and values.
    """
    rows = rows.to(batch.prompt_ids.device)
    prompt_ids, prompt_mask = batch.prompt_ids[rows], batch.prompt_mask[rows]                  # [b, P]
    completion_ids, completion_mask = batch.completion_ids[rows], batch.completion_mask[rows]  # [b, T]
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    attn = torch.cat([prompt_mask, completion_mask], 1)                                  # [b, P+T]
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)
    with autocast(prompt_ids.device, precision):
        distinct, which = torch.unique(torch.cat([prompt_ids, prompt_mask], 1), dim=0, return_inverse=True)
        distinct_ids, distinct_mask = distinct[:, :P], distinct[:, P:]                  # [u, P] each prompt once
        prompts = model(input_ids=distinct_ids, attention_mask=distinct_mask,
                        position_ids=(distinct_mask.cumsum(1) - 1).clamp(min=0), logits_to_keep=1, use_cache=True)
        first = prompts.logits.index_select(0, which)                                   # [b, 1, V] token 0
        if T == 1:
            return first
        copy_rows(prompts.cache, which)                                                 # each row's copy
        rest = model(input_ids=completion_ids[:, :-1], attention_mask=attn[:, :-1],
                     position_ids=position_ids[:, P:-1], cache=prompts.cache, use_cache=True).logits  # [b, T-1, V]
    return torch.cat([first, rest], 1)


def copy_rows(cache, which: torch.Tensor) -> None:
    """cache.batch_select_indices(which), with a backward that repeats: row b gets its prompt's keys and values,
    which[b]. transformers selects with `keys[which]`, whose backward adds the rows' gradients into each prompt's
    with atomic additions on the CPU, in an order that depends on thread timing: two runs of one command then
    differed in the last bits of the gradient from the first step on. index_select's backward (index_add_) adds them
    in row order. Cache layers with more state than keys and values keep transformers' selection."""
    from transformers.cache_utils import DynamicLayer
    for layer in cache.layers:
        if type(layer).batch_select_indices is DynamicLayer.batch_select_indices and layer.keys is not None:
            layer.keys, layer.values = layer.keys.index_select(0, which), layer.values.index_select(0, which)
        else:
            layer.batch_select_indices(which)


LOGITS_CHUNK_BYTES = 2**24   # log-probs and entropy go through the logits 16 MiB of float32 at a time


def positions_per_chunk(vocab_size: int) -> int:
    """Positions per chunk so that one chunk of float32 logits is at most LOGITS_CHUNK_BYTES."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


class ChunkedTokenLogprobs(torch.autograd.Function):
    """tepo.token_logprobs_from_logits, same values and gradient, in chunks of positions.

    Autograd's version keeps a float32 copy of the [b, T, V] logits and logsumexp's temporaries
    alive until the backward (with a 151,936-token vocabulary that is several copies of the
    largest tensor of the step). This one keeps only the logits (the model's output, alive anyway): the forward
    is tepo.token_logprobs_from_logits chunk by chunk, and the backward recomputes each chunk's softmax:
        d log p(y) / d z_v = (1[v = y] - softmax(z / T)_v) / T
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature: float):
        V = logits.shape[-1]
        flat, flat_tokens = logits.reshape(-1, V), tokens.reshape(-1)
        out = torch.empty(flat.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
        chunk = positions_per_chunk(V)
        for s in range(0, flat.shape[0], chunk):
            out[s:s + chunk] = tepo.token_logprobs_from_logits(flat[s:s + chunk], flat_tokens[s:s + chunk], temperature)
        ctx.save_for_backward(logits, tokens)
        ctx.temperature = temperature
        return out.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, tokens = ctx.saved_tensors
        V, T = logits.shape[-1], ctx.temperature
        flat, flat_tokens, g = logits.reshape(-1, V), tokens.reshape(-1, 1), grad_out.reshape(-1, 1)
        grad = torch.empty_like(flat)
        chunk = positions_per_chunk(V)
        for s in range(0, flat.shape[0], chunk):
            z = flat[s:s + chunk].to(g.dtype) / T
            d = -torch.exp(z - torch.logsumexp(z, -1, keepdim=True)) * g[s:s + chunk]   # -softmax * g
            d.scatter_add_(-1, flat_tokens[s:s + chunk], g[s:s + chunk])               # + onehot * g
            grad[s:s + chunk] = d / T
        return grad.view_as(logits), None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at the sampled tokens, memory-bounded.          [b, T, V], [b, T] -> [b, T]"""
    return ChunkedTokenLogprobs.apply(logits, tokens, temperature)


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Full-vocabulary entropy per position, one 64 MiB chunk at a time.                 [b, T, V] -> [b, T]"""
    return tepo.entropy_from_logits(logits.detach(), temperature, positions_per_chunk(logits.shape[-1]))


def as_list(ids) -> list:
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def eos_ids_of(model) -> list[int]:
    """Every end token of the model (load_policy puts them all in its generation config)."""
    return as_list(model.generation_config.eos_token_id)
