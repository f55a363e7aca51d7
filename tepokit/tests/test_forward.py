"""tepokit/forward.py: memory-bounded log-probs equal tepo.py's in value and gradient."""

import torch

import tepo
import tepokit.forward
from tepokit.forward import token_logprobs
from test_tepo import F64, assert_close


def test_chunked_token_logprobs_equal_tepo_values_and_gradients(monkeypatch):
    """The memory-bounded log-probs (chunks of positions, softmax recomputed in the backward) give
    tepo.token_logprobs_from_logits' values and gradient, float64, several chunks, T != 1."""
    monkeypatch.setattr(tepokit.forward, "LOGITS_CHUNK_BYTES", 4 * 11 * 5)        # 5 positions of V = 11 per chunk
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
