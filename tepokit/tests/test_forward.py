"""tepokit/core/forward.py: its fast twins equal the plain versions in value and gradient: the memory-bounded log-probs
(tepo.py's), and the forward that reads each prompt once (one forward of prompt + completion per row)."""

import pytest
import torch

import tepo
import tepokit.core.forward
import train_small as ts
from tepokit.core.forward import completion_logits, completion_logits_prompt_once, token_logprobs
from tepokit.core.step_settings import step_settings
from tepokit.setup.model import build_char_tokenizer
from tepokit.tests.helpers import F64, assert_close


def test_chunked_token_logprobs_equal_tepo_values_and_gradients(monkeypatch):
    """The memory-bounded log-probs (chunks of positions, softmax recomputed in the backward) give
    tepo.token_logprobs_from_logits' values and gradient, float64, several chunks, T != 1."""
    monkeypatch.setattr(tepokit.core.forward, "LOGITS_CHUNK_BYTES", 4 * 11 * 5)        # 5 positions of V = 11 per chunk
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 7, 11, dtype=F64)).requires_grad_(True)
    tokens = torch.randint(11, (3, 7))
    weights = torch.randn(3, 7, dtype=F64)
    ours = token_logprobs(logits, tokens, 0.7)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    ref = tepo.token_logprobs_from_logits(logits, tokens, 0.7)
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    assert_close(ours, ref, atol=1e-12, rtol=1e-12)
    assert_close(grad_ours, grad_ref, atol=1e-12, rtol=1e-12)
    # and by hand: log softmax(z / T) at the token
    z = logits.detach()[1, 2] / 0.7
    assert_close(ours[1, 2], z[tokens[1, 2]] - torch.logsumexp(z, 0), atol=1e-12)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_the_prompt_once_twin_gives_the_logits_and_gradient_of_one_forward_per_row(arch):
    """completion_logits_prompt_once (the fast twin) reads each distinct prompt once and lets every row's
    completion attend to a copy of its keys and values; the plain completion_logits (one forward of prompt +
    completion per row: --no-fast, or under gradient checkpointing) is the reference: float64, left-padded
    prompts shared by groups of 4, rows of different lengths, a micro-batch that splits a group. With --fast
    completion_logits hands over to the twin, except under gradient checkpointing."""
    from tepokit.setup.model import build_tiny_model
    from tepokit.tests.helpers import hand_batch
    tok = build_char_tokenizer(["abc 0123456789"])
    torch.manual_seed(0)
    model = build_tiny_model(ts.Args(arch=arch, n_layer=2, n_embd=32, n_head=2), tok).double().eval()
    batch = hand_batch(len(tok), rows=12, prompt=7, completion=6, seed=1)
    batch.prompt_ids = batch.prompt_ids[::4].repeat_interleave(4, 0)       # groups of 4 rows share a prompt
    batch.prompt_mask = batch.prompt_mask[::4].repeat_interleave(4, 0)
    assert (batch.prompt_mask == 0).any() and len(set(batch.completion_mask.sum(1).tolist())) > 1
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 9, 10])            # two whole groups and parts of two
    valid = batch.completion_mask[rows].bool()
    weights = torch.randn(len(rows), 6, len(tok), dtype=torch.float64)
    results = []
    for forward in (lambda: completion_logits(model, batch, rows, "fp32", prompt_once=False),
                    lambda: completion_logits_prompt_once(model, batch, rows, "fp32")):
        logits = forward()
        loss = (logits * weights * valid[..., None]).sum()
        results.append((logits.detach(), torch.autograd.grad(loss, list(model.parameters()))))
    (reference, reference_grad), (shared, shared_grad) = results
    with torch.no_grad():       # which one completion_logits runs: the twin with --fast, bit for bit
        for args, expected in ((ts.Args(), shared), (ts.Args(gradient_checkpointing=True), reference),
                               (ts.Args(fast=False), reference)):
            settings = step_settings(args, model.config)          # prompt_once, as the run resolves it
            assert torch.equal(completion_logits(model, batch, rows, settings.precision, settings.prompt_once),
                               expected)
    assert shared.shape == reference.shape == (8, 6, len(tok))
    assert (shared - reference).abs()[valid].max() < 1e-10
    scale = max(g.abs().max() for g in reference_grad)
    assert scale > 1e-3                                                          # the gradient is not trivially 0
    # GPT-2 agrees to float64 rounding; transformers' Qwen2 computes parts of its attention in float32 (its
    # rotary angles; its eager softmax), so there the gradients agree to float32's rounding
    tolerance = 1e-12 if arch == "gpt2" else 1e-6
    assert max((a - b).abs().max() for a, b in zip(shared_grad, reference_grad)) < tolerance * scale
