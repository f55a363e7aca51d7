"""--cuda-graphs (tepokit/core/cuda_graph.py): generation over a static KV cache, whose decode step a GPU replays as a
CUDA graph, against today's samplers on the CPU, where the same static-cache step runs eagerly. GPT-2's loop
(sample_gpt2, static=True: every step reads all T completion positions, the unwritten ones masked) against
itself as it was (reading t + 1 positions); sample_static_cache (transformers' StaticCache, our loop) against
transformers' generate. Same seed, float64: the same tokens, log-probs and entropies equal to rounding."""
import io
from contextlib import redirect_stderr

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, Qwen2Config

import train_small as ts
from tepokit.core import cuda_graph
from tepokit.core import shared_prefix
from tepokit.core.cuda_graph import static_decoder
from tepokit.core.sampling import static_generation
from tepokit.core.sampling import sample
from tepokit.core.generate import sample_generate, sample_static_cache, static_cache_problem
from tepokit.core.shared_prefix import sample_gpt2
from tepokit.tests.test_sampling import kept_logits, logits_sampled_from, tiny


def hf_model(kind: str, tok, eos, attention: str = "sdpa"):
    """A random float64 Qwen2 (grouped-query attention) or Llama over the tiny tokenizer; eos: the end tokens."""
    from transformers import AutoModelForCausalLM
    shape = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 pad_token_id=tok.pad_token_id, eos_token_id=eos[0])
    config = (Qwen2Config if kind == "qwen2" else LlamaConfig)(**shape)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).double().eval()
    model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=eos)
    return model


def settings(tok, eos, **changes) -> dict:
    return dict(group_size=4, max_new_tokens=12, temperature=0.7, eos_ids=eos, pad_id=tok.pad_token_id) | changes


def seeded(sampling_function, *args, seed=5, **kwargs) -> dict:
    torch.manual_seed(seed)
    return sampling_function(*args, **kwargs)


def assert_same_sampling(ours: dict, theirs: dict, eos, tolerance: float) -> None:
    """The same tokens (and lengths); log-probs and entropies within `tolerance` where the completion is valid."""
    assert ours["completion_ids"].shape == theirs["completion_ids"].shape
    assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
    valid = ts.completion_mask(ours["completion_ids"], eos).bool()
    assert valid.any(1).all()
    for quantity in ("logp", "entropy"):
        assert (ours[quantity] - theirs[quantity]).abs()[valid].max() < tolerance, quantity


@pytest.mark.parametrize("greedy, temperature, keep", [(False, 0.7, 0), (False, 1.0, 5), (True, 0.7, 0)])
def test_the_gpt2_loop_over_the_static_cache_is_todays_loop_in_float64(greedy, temperature, keep):
    model, tok, enc, eos = tiny()
    model = model.double()
    kwargs = settings(tok, eos, temperature=temperature, greedy=greedy)
    with logits_sampled_from(keep) as recorded_today:          # the logits each sampled from, first `keep` rows
        today = seeded(sample_gpt2, model, enc.input_ids, enc.attention_mask, **kwargs)
    with logits_sampled_from(keep) as recorded_static:
        static = seeded(sample_gpt2, model, enc.input_ids, enc.attention_mask, static=True, **kwargs)
    assert_same_sampling(static, today, eos, 1e-12)
    if keep:
        today["logits"], static["logits"] = kept_logits(recorded_today, today), kept_logits(recorded_static, static)
        assert static["logits"].shape == today["logits"].shape and static["logits"].shape[0] == keep
        assert (static["logits"] - today["logits"]).abs().max() < 1e-12


def test_the_static_cache_loops_stop_when_every_row_has_ended():
    """Ten end tokens: every row ends before the limit, at different steps; after its end a row holds the pad
    token; both loops stop at the last row's end, as today's sampler and generate do."""
    model, tok, enc, _ = tiny()
    eos = list(range(10))
    kwargs = settings(tok, eos, max_new_tokens=40, temperature=1.0)
    runs = {"gpt2 today": seeded(sample_gpt2, model.double(), enc.input_ids, enc.attention_mask, **kwargs),
            "gpt2 static": seeded(sample_gpt2, model, enc.input_ids, enc.attention_mask, static=True, **kwargs)}
    qwen = hf_model("qwen2", tok, eos)
    runs["generate"] = seeded(sample_generate, qwen, enc.input_ids, enc.attention_mask, want_logprobs=True, **kwargs)
    runs["static cache"] = seeded(sample_static_cache, qwen, enc.input_ids, enc.attention_mask, **kwargs)
    for name, run in runs.items():
        ids = run["completion_ids"]
        ended = torch.isin(ids, torch.tensor(eos))
        first = ended.float().argmax(1)
        assert ended.any(1).all() and ids.shape[1] < 40, name
        assert first.min() < first.max() == ids.shape[1] - 1, name
        assert all((ids[row, t + 1:] == tok.pad_token_id).all() for row, t in enumerate(first.tolist())), name
    assert_same_sampling(runs["gpt2 static"], runs["gpt2 today"], eos, 1e-12)
    assert_same_sampling(runs["static cache"], runs["generate"], eos, 1e-5)


@pytest.mark.parametrize("check_every", [3, 16])
def test_asking_whether_every_row_has_ended_only_every_few_tokens_gives_the_same_completions(check_every):
    """On a GPU the graph-replayed loop asks every 16 tokens (shared_prefix.end_check_every): the loop runs a few steps
    past the last end, and cuts them off. Same tokens, log-probs, entropies, logits sampled from (the first 3 rows')
    and length as asking at every token; only the random stream has moved further (more draws)."""
    model, tok, enc, _ = tiny()
    eos = list(range(10))
    kwargs = settings(tok, eos, max_new_tokens=40, temperature=1.0)
    outs, streams = [], []
    for every in (1, check_every):
        loop = shared_prefix.sampling_loop
        shared_prefix.sampling_loop = lambda *a, **k: loop(*a[:7], check_every=every)   # all but check_every
        try:
            with logits_sampled_from(3) as recorded:
                outs.append(seeded(sample_gpt2, model.double(), enc.input_ids, enc.attention_mask, **kwargs))
            outs[-1]["logits"] = kept_logits(recorded, outs[-1])
        finally:
            shared_prefix.sampling_loop = loop
        streams.append(torch.rand(1).item())
    assert outs[0]["completion_ids"].shape[1] < 40                                  # every row ended early
    assert_same_sampling(outs[1], outs[0], eos, 1e-15)
    assert torch.equal(outs[1]["logits"], outs[0]["logits"])
    assert streams[0] != streams[1]                                                 # the extra steps drew
    assert shared_prefix.end_check_every(True, torch.device("cuda")) == 16
    assert shared_prefix.end_check_every(True, torch.device("cpu")) == 1
    assert shared_prefix.end_check_every(False, torch.device("cuda")) == 1


@pytest.mark.parametrize("kind, attention", [("qwen2", "sdpa"), ("qwen2", "eager"), ("llama", "sdpa")])
@pytest.mark.parametrize("greedy", [False, True])
def test_the_static_cache_draws_generates_tokens_in_float64(kind, attention, greedy):
    """Left-padded prompts of different lengths, groups of 4. generate keeps float32 copies of its logits, so
    its log-probs are float32's: equal to about 1e-7. With eager attention (our mask added to the scores) against
    generate with SDPA on the same weights: generate's own eager path gives NaN at the padding in float64."""
    _, tok, enc, eos = tiny()
    kwargs = settings(tok, eos, greedy=greedy)
    theirs = seeded(sample_generate, hf_model(kind, tok, eos), enc.input_ids, enc.attention_mask, want_logprobs=True,
                    **kwargs)
    ours = seeded(sample_static_cache, hf_model(kind, tok, eos, attention), enc.input_ids, enc.attention_mask,
                  **kwargs)
    assert_same_sampling(ours, theirs, eos, 1e-5)


def test_a_cache_written_one_position_off_is_caught(monkeypatch):
    """The comparison can fail: a static cache that writes each key one position later than the mask expects
    samples other tokens than generate."""
    import transformers

    class OneOff(transformers.StaticCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for layer in self.layers:
                layer.cumulative_length = torch.tensor(1)
    _, tok, enc, eos = tiny()
    model = hf_model("qwen2", tok, eos)
    kwargs = settings(tok, eos)
    theirs = seeded(sample_generate, model, enc.input_ids, enc.attention_mask, want_logprobs=True, **kwargs)
    assert_same_sampling(seeded(sample_static_cache, model, enc.input_ids, enc.attention_mask, **kwargs), theirs,
                         eos, 1e-5)
    monkeypatch.setattr(transformers, "StaticCache", OneOff)
    ours = seeded(sample_static_cache, model, enc.input_ids, enc.attention_mask, **kwargs)
    with pytest.raises(AssertionError):
        assert_same_sampling(ours, theirs, eos, 1e-5)


def test_bf16_static_cache_loop_is_todays_loop_to_bf16_rounding():
    """Under bf16 autocast (CPU) the static step sums over more positions, each masked one exactly 0: greedy
    tokens equal today's, log-probs within bf16 rounding."""
    model, tok, enc, eos = tiny()
    kwargs = settings(tok, eos, greedy=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        today = seeded(sample_gpt2, model, enc.input_ids, enc.attention_mask, **kwargs)
        static = seeded(sample_gpt2, model, enc.input_ids, enc.attention_mask, static=True, **kwargs)
    assert torch.equal(static["completion_ids"], today["completion_ids"])
    valid = ts.completion_mask(today["completion_ids"], eos).bool()
    assert (static["logp"] - today["logp"]).abs()[valid].max() < 0.05


def test_the_switch_and_its_one_line_fallbacks():
    """auto: the static path on CUDA only; on: everywhere (on the CPU it says once, in one line, that the step
    runs eagerly); off: never. A model the static cache was not tested on goes through generate, said once."""
    assert [static_generation(True, v, d) for v in ("auto", "on", "off") for d in ("cuda", "cpu")] \
        == [True, False, True, True, False, False]
    model, tok, enc, eos = tiny()
    cuda_graph.WARNED.clear()
    common = dict(max_new_tokens=12, temperature=0.7, precision="fp32")
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        on = [seeded(sample, model, enc.input_ids, enc.attention_mask, 4, sampler="loop", cuda_graphs="on", **common)
              for _ in range(2)]
    assert stderr.getvalue().count("\n") == 1 and "CUDA graphs need a GPU" in stderr.getvalue()
    off = seeded(sample, model, enc.input_ids, enc.attention_mask, 4, sampler="loop", cuda_graphs="off", **common)
    assert torch.equal(on[0]["completion_ids"], off["completion_ids"])
    assert torch.equal(on[1]["completion_ids"], off["completion_ids"])
    # GPT-2 through generate (--sampler generate): no static cache for it, one line, generate's result
    assert "model type 'gpt2'" in static_cache_problem(model)
    assert static_cache_problem(hf_model("qwen2", tok, eos)) is None
    sliding = hf_model("qwen2", tok, eos)
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    assert static_cache_problem(sliding) == "sliding-window attention layers"
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        through_generate = seeded(sample, model, enc.input_ids, enc.attention_mask, 4, sampler="generate",
                                  cuda_graphs="on", **common)
    assert stderr.getvalue().count("\n") == 1 and "runs through generate" in stderr.getvalue()
    assert torch.equal(through_generate["completion_ids"], off["completion_ids"])     # test_sampling: the same


def test_the_static_decoder_feeds_its_own_inputs():
    """static_decoder's step reads tokens and position from tensors it owns (a graph replays fixed addresses):
    each call sees the values it was given, not the ones of the call before."""
    seen = []

    def decode(token_in, t_in):
        seen.append((token_in.clone(), t_in.item()))
        return token_in.double()[:, None]

    step = static_decoder(decode, 3, torch.device("cpu"), capture=False)
    for t, token in enumerate([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])]):
        assert torch.equal(step(token, t), token.double()[:, None])
    assert [(ids.tolist(), t) for ids, t in seen] == [([1, 2, 3], 0), ([4, 5, 6], 1)]


def test_args_and_command_line():
    from tepokit.cli.flags import parse_args
    args, _ = parse_args(ts.Args, ["--cuda-graphs", "off"])
    assert args.cuda_graphs == "off" and ts.Args().cuda_graphs == "auto"
    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit) as exit_:
        parse_args(ts.Args, ["--cuda-graphs", "yes"])
    assert exit_.value.code == 2 and "--cuda-graphs" in stderr.getvalue() and "'yes'" in stderr.getvalue()
    assert stderr.getvalue().count("\n") == 1
