"""tepokit/core/sampling.py: the KV-cache sampling loop against transformers' generate (same tokens under the
same random stream, same log-probs and entropies), its logits against a full forward, and when the old
log-probs are the sampler's."""
import contextlib
import dataclasses

import pytest
import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, Qwen2Config

import tepo
import train_small as ts
from tepokit.core import generate, shared_prefix
from tepokit.core.sampling import static_generation
from tepokit.core.forward import completion_logits
from tepokit.setup.model import (START_MODEL_DIR, build_char_tokenizer, build_tiny_model, load_policy,
                                  tiny_model_config, use_fused_gelu)
from tepokit.core.sampling import uses_loop
from tepokit.core.step_settings import (STACKED_LOGITS_MAX_BYTES, recompute_old_logprobs, sampler_logprobs_wanted,
                                        stacked_logits_bytes)
from tepokit.core.generate import sample_generate
from tepokit.core.shared_prefix import sample_gpt2
from tepokit.core.step_settings import step_settings
from tepokit.setup.task import make_arithmetic_task

QUESTIONS = ["Ann has 3 pens and 4 more. How many?", "a?", "Bob has 12345 pens and 6789 more. How many pens?"]


def tiny(eos_ids=None, seed=0, n_layer=2, **args):
    """A random built-in-shaped GPT-2 (width 32) with its character tokenizer; eos_ids: the end tokens."""
    torch.manual_seed(seed)
    tok = build_char_tokenizer(QUESTIONS + ["0123456789 #"])
    a = ts.Args(n_layer=n_layer, n_embd=32, n_head=2, **args)
    model = build_tiny_model(a, tok).eval()
    eos = eos_ids or [tok.eos_token_id]
    model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=eos)
    enc = tok(QUESTIONS, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()         # left-padded prompts of different lengths
    return model, tok, enc, eos


@contextlib.contextmanager
def logits_sampled_from(rows: int):
    """The logits [B, V] each sampling step read its log-probs and entropies from (logprob_and_entropy,
    which the loop's sample_step and generate's stacked logits both go through), of the first `rows` rows, copied:
    yields a list that holds them afterwards as [rows, steps, V] (steps: the loop may run a few past the end;
    kept_logits cuts them to the completions' length). The samplers no longer keep logits themselves (the
    entropy check's come from the update's taps, tepokit/core/taps.py)."""
    steps, out, own = [], [], shared_prefix.logprob_and_entropy

    def recording(logits, token, temperature):
        steps.append(logits[:rows].detach().clone())
        return own(logits, token, temperature)
    shared_prefix.logprob_and_entropy = generate.logprob_and_entropy = recording   # the loop's and generate's
    try:
        yield out
    finally:
        shared_prefix.logprob_and_entropy = generate.logprob_and_entropy = own
        out.append(torch.stack(steps, 1) if steps else None)


def kept_logits(recorded: list, result: dict) -> torch.Tensor:
    """The recorded logits over the completions' T positions: [rows, T, V]."""
    return recorded[0][:, :result["completion_ids"].shape[1]].contiguous()


def both(model, tok, enc, eos, group_size=4, max_new_tokens=12, temperature=0.7, greedy=False, seed=5, keep=0):
    """The loop's and generate's samples from the same seed; with keep > 0 each result also holds, as "logits",
    the logits [keep, T, V] of its first rows that it sampled from (logits_sampled_from)."""
    settings = dict(group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature, eos_ids=eos,
                    pad_id=tok.pad_token_id, greedy=greedy)
    out = []
    for function, extra in ((sample_gpt2, {}), (sample_generate, dict(want_logprobs=True))):
        torch.manual_seed(seed)
        with logits_sampled_from(keep) as recorded:
            result = function(model, enc.input_ids, enc.attention_mask, **extra, **settings)
        if keep:
            result["logits"] = kept_logits(recorded, result)
        out.append(result)
    return tuple(out)


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_loop_draws_generates_tokens_under_the_same_random_stream(greedy, temperature):
    model, tok, enc, eos = tiny()
    loop, gen = both(model, tok, enc, eos, temperature=temperature, greedy=greedy)
    assert loop["completion_ids"].shape == gen["completion_ids"].shape == (12, 12)
    assert torch.equal(loop["completion_ids"], gen["completion_ids"])
    mask = ts.completion_mask(loop["completion_ids"], eos).bool()
    assert (loop["logp"] - gen["logp"]).abs()[mask].max() < 1e-5
    assert (loop["entropy"] - gen["entropy"]).abs()[mask].max() < 1e-5
    assert (loop["logp"][~mask] == 0).all() and (loop["entropy"][~mask] == 0).all()


def test_rows_stop_at_their_end_token_and_the_loop_at_the_last_one():
    """Ten end tokens (a quarter of the vocabulary): rows end early, hold the pad token after their end,
    and the completions are as long as the longest row, as generate's."""
    model, tok, enc, _ = tiny()
    eos = list(range(10))
    loop, gen = both(model, tok, enc, eos, max_new_tokens=40, temperature=1.0)
    ids = loop["completion_ids"]
    assert torch.equal(ids, gen["completion_ids"])
    assert ids.shape[1] < 40                                        # every row ended before the limit
    ended = torch.isin(ids, torch.tensor(eos))
    first = ended.float().argmax(1)
    assert ended.any(1).all()
    for row, t in enumerate(first.tolist()):
        assert (ids[row, t + 1:] == tok.pad_token_id).all()
    assert first.min() < first.max() == ids.shape[1] - 1             # rows end at different steps


def test_the_kept_logits_are_a_full_forwards_at_the_completion_positions():
    model, tok, enc, eos = tiny()
    loop, _ = both(model, tok, enc, eos, keep=5)
    batch = ts.Rollout(prompt_ids=enc.input_ids.repeat_interleave(4, 0),
                       prompt_mask=enc.attention_mask.repeat_interleave(4, 0),
                       completion_ids=loop["completion_ids"],
                       completion_mask=ts.completion_mask(loop["completion_ids"], eos), truncated=None)
    full = completion_logits(model, batch, torch.arange(5), "fp32", prompt_once=True)     # [5, T, V]
    valid = batch.completion_mask[:5].bool()
    assert loop["logits"].shape == full.shape
    assert (loop["logits"] - full).abs()[valid].max() < 1e-4
    recomputed = tepo.token_logprobs_from_logits(full, loop["completion_ids"][:5], 0.7)
    assert (recomputed - loop["logp"][:5]).abs()[valid].max() < 1e-5


def test_float64_and_bf16():
    """float64 weights: the loop computes in float64 (the tests' exact arithmetic); bf16 autocast: it
    runs, and its log-probs are within bf16 rounding of float32's."""
    model, tok, enc, eos = tiny()
    model64 = build_tiny_model(ts.Args(n_layer=2, n_embd=32, n_head=2), tok).double().eval()
    model64.load_state_dict(model.state_dict())
    model64.generation_config = model.generation_config
    loop64, gen64 = both(model64, tok, enc, eos)
    assert loop64["logp"].dtype == torch.float64
    mask = ts.completion_mask(loop64["completion_ids"], eos).bool()
    assert torch.equal(loop64["completion_ids"], gen64["completion_ids"])
    batch = ts.Rollout(prompt_ids=enc.input_ids.repeat_interleave(4, 0),
                       prompt_mask=enc.attention_mask.repeat_interleave(4, 0),
                       completion_ids=loop64["completion_ids"], completion_mask=mask.long(), truncated=None)
    logits = completion_logits(model64, batch, torch.arange(12), "fp32", prompt_once=True)
    recomputed = tepo.token_logprobs_from_logits(logits, loop64["completion_ids"], 0.7)   # generate's are float32
    assert (loop64["logp"] - recomputed).abs()[mask].max() < 1e-10
    greedy32, _ = both(model, tok, enc, eos, greedy=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        greedy16, _ = both(model, tok, enc, eos, greedy=True)
    same = greedy32["completion_ids"] == greedy16["completion_ids"]
    assert same[:, 0].all()                          # the first token of every row (then bf16 may diverge)
    assert (greedy32["logp"][:, 0] - greedy16["logp"][:, 0]).abs().max() < 0.1


def whole_sequence_logits(model, batch, precision: str) -> torch.Tensor:
    """One forward pass over prompt + completion (no KV cache), under the run's autocast for `precision`: the
    float32 logits at the positions that predict each completion token, the one before it.          [B, T, V]"""
    attention = torch.cat([batch.prompt_mask, batch.completion_mask], 1)               # [B, P+T]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = model(input_ids=torch.cat([batch.prompt_ids, batch.completion_ids], 1),
                       attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
    return logits[:, batch.prompt_ids.shape[1] - 1:-1].float()                           # [B, T, V]


# bf16 keeps 8 significant bits: a logit between 8 and 16 is stored to a step of 2^-4 = 0.0625, and two
# computations of it (token by token with a KV cache, or the whole sequence at once) may round it to neighbouring
# steps, which moves the token's log-prob by up to about that step. Measured on the 16 rows below (234 valid
# tokens, torch 2.13, CPU), against the bf16 forward: largest gaps 0.033 (log-prob, at a sampled token whose
# logit is 10.7) and 0.0071 (entropy). The bounds are about 4 times the measured gaps, max and mean; against fp32
# looser still, since an fp32 forward also differs by the bf16 rounding of the weights, which a bf16 forward
# shares (its mean gaps are larger).
BF16_SAMPLING_BOUNDS = {      # (reference, quantity): (bound on the max gap, bound on the mean gap)
    ("bf16", "logp"): (0.15, 0.005),       # measured: max 0.0335, mean 0.00116
    ("bf16", "entropy"): (0.03, 0.002),    # measured: max 0.0071, mean 0.00039
    ("fp32", "logp"): (0.2, 0.008),        # measured: max 0.0258, mean 0.00167
    ("fp32", "entropy"): (0.05, 0.004),    # measured: max 0.0075, mean 0.00057
}


def test_bf16_sampling_is_a_whole_sequence_forward_at_every_position():
    """--precision bf16 (CPU autocast, as the runs sample): the log-prob and entropy the sampler keeps for every
    sampled token, at every valid completion position, against one forward pass over the whole sequence in bf16
    (within bf16 rounding) and in fp32 (looser). The committed start model: trained, its distributions are far
    from uniform, so a log-prob read one position off (from the logits at t instead of t - 1) is far outside
    the bounds, which the test checks too."""
    args = ts.Args(precision="bf16")                                # temperature 1, 24 new tokens
    model, tok = load_policy(START_MODEL_DIR, args, torch.device("cpu"))
    questions = list(make_arithmetic_task(15, n_train=40, n_test=4, seed=1)["test"]["question"])
    torch.manual_seed(0)
    batch = ts.generate_group(model, tok, questions, 4, args, torch.device("cpu"), want_logprobs=True)
    valid = batch.completion_mask.bool()                        # [B, T]
    assert (batch.prompt_mask == 0).any() and valid.sum(1).min() < valid.shape[1]   # left padding; rows end
    sampled = {"logp": batch.sampling_logp, "entropy": batch.sampling_entropy}
    for precision in ("bf16", "fp32"):
        logits = whole_sequence_logits(model, batch, precision)                             # [B, T, V]
        forward = {"logp": tepo.token_logprobs_from_logits(logits, batch.completion_ids, args.temperature),
                   "entropy": tepo.entropy_from_logits(logits, args.temperature)}
        for quantity in ("logp", "entropy"):
            gap = (sampled[quantity] - forward[quantity]).abs()[valid]
            largest, mean = gap.max().item(), gap.mean().item()
            max_bound, mean_bound = BF16_SAMPLING_BOUNDS[precision, quantity]
            assert largest < max_bound and mean < mean_bound, (precision, quantity, largest, mean)
    # one position off: token t's log-prob from the logits at t (which predict token t + 1)
    one_off = tepo.token_logprobs_from_logits(logits[:, 1:], batch.completion_ids[:, :-1], args.temperature)
    assert (sampled["logp"][:, :-1] - one_off).abs()[valid[:, :-1]].mean() > 1.0       # measured: 8.1 nats


@pytest.mark.parametrize("group_size, fused_gelu", [(1, False), (3, True)])
def test_each_prompt_read_once_per_group_is_a_full_forward_in_float64(group_size, fused_gelu):
    """The loop keeps each prompt's keys and values once per group and each row's own completion apart;
    its logits at every completion position are a full forward's of prompt + completion (float64, prompts
    of different lengths), for groups of one and of three, with GPT-2's gelu_new and with the fused gelu
    the runs load (tepokit.setup.model.use_fused_gelu)."""
    _, tok, enc, eos = tiny()
    config = tiny_model_config(ts.Args(n_layer=2, n_embd=32, n_head=2), tok)
    torch.manual_seed(1)
    model = GPT2LMHeadModel(config).double().eval()
    if fused_gelu:
        use_fused_gelu(model)
    B = len(QUESTIONS) * group_size
    torch.manual_seed(2)
    with logits_sampled_from(B) as recorded:
        loop = sample_gpt2(model, enc.input_ids, enc.attention_mask, group_size, 10, 1.0, eos, tok.pad_token_id)
    loop["logits"] = kept_logits(recorded, loop)
    prompt_mask = enc.attention_mask.repeat_interleave(group_size, 0)
    completion_mask = ts.completion_mask(loop["completion_ids"], eos)
    attn = torch.cat([prompt_mask, completion_mask], 1)
    full = model(input_ids=torch.cat([enc.input_ids.repeat_interleave(group_size, 0), loop["completion_ids"]], 1),
                 attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
    full = full[:, enc.input_ids.shape[1] - 1:-1]                  # the position before each completion token
    valid = completion_mask.bool()
    assert loop["logits"].dtype == torch.float64 and loop["logits"].shape == full.shape
    assert (loop["logits"] - full).abs()[valid].max() < 1e-10
    recomputed = tepo.token_logprobs_from_logits(full, loop["completion_ids"], 1.0)
    assert (recomputed - loop["logp"]).abs()[valid].max() < 1e-10


def test_which_models_the_loop_covers_and_when_the_old_logprobs_are_recomputed():
    args = ts.Args()
    gpt2 = GPT2Config(vocab_size=57, n_embd=32, n_layer=1, n_head=2)
    qwen = Qwen2Config(vocab_size=151_936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2)
    assert uses_loop(gpt2, args.fast, args.sampler) and not uses_loop(qwen, args.fast, args.sampler)
    assert not uses_loop(gpt2, args.fast, "generate")
    assert not uses_loop(GPT2Config(scale_attn_by_inverse_layer_idx=True), args.fast, args.sampler)

    def resolved(config, **flags):          # as the run resolves them from its flags and its model's config
        return step_settings(dataclasses.replace(args, **flags), config)
    # fp32 with the loop: the sampler's log-probs; bf16: recomputed; the flag wins either way
    assert not resolved(gpt2).recompute and resolved(gpt2).sampler_logprobs
    assert resolved(gpt2, precision="bf16").recompute
    assert resolved(gpt2, recompute_old_logprobs=True).recompute
    assert not resolved(gpt2, precision="bf16", recompute_old_logprobs=False).recompute
    # generate: recomputed (its log-probs need [B, T, V]); for the sampling check only when that is small
    assert resolved(qwen).recompute
    big = dict(max_new_tokens=256)
    assert 128 * 256 * 151_936 * 4 > STACKED_LOGITS_MAX_BYTES and not resolved(qwen, **big).sampler_logprobs
    assert stacked_logits_bytes(128, 256, 151_936, loop=False) == 128 * 256 * 151_936 * 4
    assert stacked_logits_bytes(128, 256, 151_936, loop=True) == 0
    small = dict(prompts_per_step=1, group_size=2, max_new_tokens=8)
    assert resolved(qwen, **small).sampler_logprobs
    assert not resolved(qwen, **small, check_sampling_logprobs=False).sampler_logprobs
    assert resolved(qwen, **big, recompute_old_logprobs=False).sampler_logprobs   # asked for
    # --no-fast: the plain path everywhere, whatever the finer switches say
    assert not uses_loop(gpt2, False, "loop") and resolved(gpt2, fast=False).recompute
    assert recompute_old_logprobs(False, False, "fp32", loop=True)
    assert not resolved(gpt2, fast=False).sampler_logprobs
    assert not resolved(qwen, **small, fast=False).sampler_logprobs
    assert not sampler_logprobs_wanted(False, recompute=False, check_sampling_logprobs=True, stacked_bytes=0)
    assert not static_generation(False, "on", "cuda")


def test_generate_group_plain_and_its_twins_give_the_same_rollout():
    """generate_group's plain path (--no-fast: model.generate, tokens only) and its fast twins (--sampler loop,
    the shared-prefix sampler; --sampler generate, generate with its stacked logits) draw the same rollout from
    the same seed; the two twins also give the same log-probs, entropies and the logits they sampled from
    (the first 4 rows'); the plain path reads no logits for log-probs at all."""
    model, tok, _, _ = tiny()
    args = ts.Args(temperature=0.8, max_new_tokens=10, check_sampling_logprobs=True)
    out, logits = {}, {}
    for name, settings in (("loop", dict(sampler="loop")), ("generate", dict(sampler="generate")),
                           ("plain", dict(fast=False))):
        torch.manual_seed(3)
        with logits_sampled_from(4) as recorded:
            out[name] = ts.generate_group(model, tok, QUESTIONS, 3, dataclasses.replace(args, **settings),
                                          torch.device("cpu"), want_logprobs=True)
        logits[name] = recorded[0]
    loop, generate, plain = out["loop"], out["generate"], out["plain"]
    assert plain.sampling_logp is None and plain.sampling_entropy is None     # the plain path: tokens only
    assert logits["plain"] is None                                            # and reads no logits for them
    assert len(set(loop.completion_mask.sum(1).tolist())) > 1                 # rows end at different lengths
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(loop, key), getattr(generate, key)), key
        assert torch.equal(getattr(loop, key), getattr(plain, key)), key
    mask = loop.completion_mask.bool()
    for key in ("sampling_logp", "sampling_entropy"):        # after a row's end: not used, and not compared
        assert (getattr(loop, key) - getattr(generate, key)).abs()[mask].max() < 1e-5, key
    T = loop.completion_ids.shape[1]
    assert logits["loop"][:, :T].shape == logits["generate"].shape == (4, T, len(tok))
    assert (logits["loop"][:, :T] - logits["generate"]).abs().max() < 1e-4
