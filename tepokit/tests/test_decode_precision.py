"""--decode-precision (tepokit/core/sampling.py: decode_precision, decoding): generation of a fp32 run in fp32, TF32
or bf16. bf16 decodes over bf16 copies of the weights and gives the very fp32 tensors back, whatever ends the call;
TF32 switches CUDA's fp32 matrix products for the call only; the log-probs of bf16 decoding are the fp32 forward's
within bf16 rounding (and those of fp32 decoding within fp32's), for GPT-2's loop and transformers' static cache;
which old log-probs a run uses, and what the plan counts. TF32 itself needs a GPU: its speed and its gap are
measured by python -m tepokit.tools.gpu_check (docs/one-gpu.md)."""
import dataclasses
import io
from contextlib import redirect_stderr

import pytest
import torch
from transformers import GPT2Config

import train_small as ts
from tepokit.cli.flags import parse_args
from tepokit.core import cuda_graph
from tepokit.core.sampling import decode_precision, decoding
from tepokit.core.step_settings import step_settings
from tepokit.tests.helpers import assert_refused_in_one_line
from tepokit.tests.test_sampling import QUESTIONS, tiny, whole_sequence_logits
from tepokit.tests.test_sampling_static import hf_model
from tepokit.tools.memory import memory_plan


def test_bf16_decoding_runs_over_bf16_copies_and_gives_the_same_fp32_tensors_back_even_on_an_error():
    model, tok, enc, _ = tiny()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(input_ids=enc.input_ids).logits.sum().backward()
    optimizer.step()                                          # Adam's moments exist, keyed by the parameters
    before = [(p, p.data_ptr(), p.detach().clone()) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="stopped inside"):
        with decoding(model, "bf16"):
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
            assert model.lm_head.weight is model.transformer.wte.weight            # tied: one copy
            with torch.no_grad():
                assert model(input_ids=enc.input_ids).logits.dtype == torch.bfloat16
            raise RuntimeError("stopped inside")
    for (p, pointer, value), q in zip(before, model.parameters()):
        assert q is p and p.dtype == torch.float32 and p.data_ptr() == pointer and torch.equal(p.detach(), value)
    assert set(optimizer.state) == {p for p, _, _ in before}
    optimizer.step()                                          # and training goes on over the same tensors


def test_tf32_decoding_switches_cudas_fp32_matmuls_for_the_call_only():
    matmul = torch.backends.cuda.matmul
    first = matmul.fp32_precision
    model = tiny()[0]
    cuda_graph.WARNED.discard("--decode-precision tf32: TF32 is a CUDA GPU's; generation runs in fp32 here")
    with redirect_stderr(io.StringIO()) as err, pytest.raises(KeyError):
        with decoding(model, "tf32"):
            assert matmul.fp32_precision == "tf32"
            raise KeyError("stopped inside")
    assert matmul.fp32_precision == first
    assert "TF32 is a CUDA GPU's; generation runs in fp32 here" in err.getvalue()     # on this CPU, said once
    with decoding(model, "fp32"), decoding(model, "autocast"):
        assert matmul.fp32_precision == first and next(model.parameters()).dtype == torch.float32


# Measured on the 12 rows below (125 valid tokens; 2-core CPU, torch 2.13): bf16 decoding by GPT-2's loop max 0.0027,
# mean 0.00058; by the static cache max 0.0020, mean 0.00049 (random tiny models: flat distributions, small logits);
# fp32 decoding below 5e-7 in both.
@pytest.mark.parametrize("sampler", ["gpt2 loop", "qwen2 static cache"])
def test_the_log_probs_of_bf16_decoding_are_the_fp32_forwards_within_bf16_rounding(sampler):
    """The sampled tokens' log-probs, against a fp32 forward over the same sequences (the trainer's): bf16 decoding
    is off by bf16 rounding (and by more than fp32 rounding: the weights really were bf16), fp32 decoding is not."""
    model, tok, _, eos = tiny()
    args = ts.Args(temperature=0.7, max_new_tokens=12)
    if sampler == "qwen2 static cache":
        model = hf_model("qwen2", tok, eos).float()
        args = dataclasses.replace(args, cuda_graphs="on")     # the static cache, run eagerly on the CPU
    gaps = {}
    for decode in ("fp32", "bf16"):
        torch.manual_seed(4)
        with redirect_stderr(io.StringIO()):
            batch = ts.generate_group(model, tok, QUESTIONS, 4, dataclasses.replace(args, decode_precision=decode),
                                      torch.device("cpu"), want_logprobs=True)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        logits = whole_sequence_logits(model, batch, "fp32")                               # [B, T, V]
        trainer = torch.log_softmax(logits / args.temperature, -1).gather(-1, batch.completion_ids[..., None])[..., 0]
        valid = batch.completion_mask.bool()
        gaps[decode] = (batch.sampling_logp - trainer).abs()[valid]
    assert gaps["fp32"].max() < 1e-5
    assert 1e-4 < gaps["bf16"].max() < 0.1 and gaps["bf16"].mean() < 0.01, (gaps["bf16"].max(), gaps["bf16"].mean())


def test_how_a_run_resolves_its_decoding_and_its_old_log_probs():
    gpt2 = GPT2Config(vocab_size=57, n_embd=32, n_layer=1, n_head=2)
    args = ts.Args()
    assert decode_precision("auto", "fp32", "cpu") == "fp32" and decode_precision("auto", "fp32", "cuda") == "tf32"
    assert decode_precision("bf16", "fp32", "cpu") == "bf16" and decode_precision("auto", "bf16", "cuda") == "autocast"
    resolved = {(decode, device): step_settings(dataclasses.replace(args, decode_precision=decode), gpt2,
                                                device_type=device)
                for decode in ("auto", "fp32", "tf32", "bf16") for device in ("cpu", "cuda")}
    # the loop's log-probs are the old ones only when it decodes in fp32; TF32 and bf16 recompute them in fp32
    assert {key: s.recompute for key, s in resolved.items()} == {
        ("auto", "cpu"): False, ("auto", "cuda"): True, ("fp32", "cpu"): False, ("fp32", "cuda"): False,
        ("tf32", "cpu"): True, ("tf32", "cuda"): True, ("bf16", "cpu"): True, ("bf16", "cuda"): True}
    assert not step_settings(dataclasses.replace(args, decode_precision="bf16", recompute_old_logprobs=False),
                             gpt2).recompute                                     # the flag wins
    assert_refused_in_one_line(["--decode-precision", "fp16"], "--decode-precision", "fp16", "tf32")
    for bad in (["--decode-precision", "bf16", "--precision", "bf16"],
                ["--decode-precision", "tf32", "--engine", "trl"]):
        assert_refused_in_one_line(bad, "--decode-precision", "auto with --precision bf16", "--engine trl")


def test_the_plan_counts_bf16_decodings_weight_copies_and_halves_its_cache():
    config = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    plans = {decode: memory_plan(parse_args(ts.Args, ["--decode-precision", decode, "--max-new-tokens", "256"])[0],
                                 config, needs_ref=False, device_type="cuda") for decode in ("fp32", "bf16")}
    moment, parts = plans["bf16"]["phases"]["generation"]
    fp32_parts = plans["fp32"]["phases"]["generation"][1]
    assert parts["bf16 weights for decoding"] == 2 * plans["bf16"]["n_params"]
    assert "bf16 weights for decoding" not in fp32_parts
    assert parts["completions' keys and values"] * 2 == fp32_parts["completions' keys and values"]
