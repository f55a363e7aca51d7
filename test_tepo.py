"""Tests of tepo.py: every objective, building block and the entropy mathematics (the tests of
train_small.py, tepokit and the notebooks are in tepokit/tests/, one file per subject).

What the tests prove. Each numbered property below has at least one test, named after what it
proves; its docstring gives the number. "At ratio 1" means old_logp = logp.detach() (one update
per rollout); gradients are taken with autograd in float64 w.r.t. logp.

Building blocks (tepo.py section 1)
  1. Group advantages sum to 0 in each group, have unbiased std ~1, do not change when the rewards
     are mapped r -> a r + b (a > 0), are exactly 0 for a group of equal rewards, and Dr. GRPO's
     (no std) equal the normalised ones times the std.
  2. Aggregation: at equal lengths L, token-mean = seq-mean-token-mean and seq-mean-token-sum =
     L x token-mean; padded entries never change a value or a gradient (for every objective).
  3. KL estimators, summed exactly over a categorical: E[k1] = E[k3] = KL(pi || pi_ref); k3 >= 0, and
     k3 and its gradient are 0 at pi = pi_ref; k1+ / k3+ have k1's / k3's value and k2's gradient.
PPO-clip, GRPO, DAPO, Dr. GRPO (arXiv 1707.06347, 2402.03300, 2503.14476, 2503.20783)
  4. At ratio 1 the clipped surrogate's per-token gradient is -A times the aggregation weight, for
     any clip range.
  5. A token outside the band in the direction its advantage pushes (A > 0 and r > 1 + eps_high,
     or A < 0 and r < 1 - eps_low) has zero gradient; with dual-clip, A < 0 and r > c give the loss
     -A c and zero gradient.
  6. GRPO at ratio 1 (beta = 0): gradient -(1/G) A_i / |o_i| on every token of sequence i.
  7. DAPO at ratio 1: gradient -A_i / sum_i |o_i|; equal to GRPO when every length is equal.
  8. Dr. GRPO at ratio 1: gradient -A~_i / (G L) with L the constant C: no token's weight depends
     on its sequence's length; seq-mean-token-sum-norm divides the sum by B * C.
  9. DAPO's soft overlong punishment with L_max = 20480, L_cache = 4096: 0 at 16384, -0.5 at 18432,
     -1 at 20480 and beyond, never rising with length.
 10. Dynamic sampling drops exactly the groups whose rewards are all equal.
 11. GRPO's KL term at pi_theta = pi_ref: value 0, gradient 0.
GSPO, GSPO-token (arXiv 2507.18071)
 12. At ratio 1 every s_i = 1 and GSPO's gradient equals GRPO's (property 6).
 13. If every token ratio of a sequence is c, then s_i = c whatever its length.
 14. GSPO-token with A_{i,t} = A_i equals GSPO in value, gradient and clipping, off-policy too.
 15. A sequence is clipped as a unit: s_i > 1 + eps_high with A_i > 0 zeroes the gradient of every
     one of its tokens, even those whose own ratio is inside the band.
 16. The token form logp - sg(logp) + sg(log s_i) with seq-mean-token-mean gives exactly the
     gradient (1/B) sum_i s_i A_i (1/|o_i|) sum_t d log pi_{i,t} where nothing is clipped.
TEPO (arXiv 2510.09369; our reconstruction, tepo.py section 5.3)
 17. With an empty mask or beta = 0, TEPO is GSPO-token's ratio with token-mean; at ratio 1 its
     gradient is DAPO's (property 7).
 18. Putting s_i itself on every token (gradient through s_i) gives the same value and gradient
     under token-mean.
 19. The KL mask holds only valid tokens with A_i > 0, and is built from detached tensors only.
 20. With entropy_criterion="cov" and centred advantages, M_{i,t} = 1 exactly when A_i > 0 and
     log pi_{i,t} is above the batch mean of log pi.
 21. With kl_target="old" (abs or k3) the KL term has value 0 and gradient 0 at ratio 1, so TEPO's
     gradient is DAPO's; with the hard mask and tau > 0 no token is dropped there.
 22. Off-policy with the abs estimator, beta changes the gradient by beta M sign(delta) / N_tokens
     per masked token and nowhere else.
 23. At equal lengths TEPO (empty mask) and GSPO have the same gradient for any ratios; otherwise
     TEPO weighs sequence i by |o_i| / mean |o| relative to GSPO.
MPO (arXiv 2602.14386; our reconstruction, tepo.py section 3.7)
 24. K = 1 is the token-level clipped surrogate: GRPO with seq-mean-block-mean, DAPO with
     token-weighted, in value and gradient, on- and off-policy.
 25. K >= the longest answer: geomean with seq-mean-block-mean is GSPO exactly; joint is the full
     product of the token ratios.
 26. A response of L tokens has ceil(L / K) blocks, the last of L - (J - 1) K tokens in [1, K], and
     the block counts add up to L.
 27. joint: log rho = sum of the block's deltas, d rho / d logp_t = rho on each of its tokens, and
     permuting tokens inside a block changes nothing.
 28. At ratio 1 with joint and seq-mean-block-mean the gradient is -(1/G) A_i / J_i (about K times
     GRPO's per-token weight); geomean gives GRPO's exactly when K divides every length.
 29. A block outside the band (in the direction of A) has zero gradient on all its tokens and the
     other blocks are unaffected.
CISPO, GMPO, SAPO (arXiv 2506.13585, 2507.20673, 2511.20347; tepo.py sections 3.3, 3.5, 3.6), numbered
after the options' 47-49
 50. CISPO equals verl 0.9.1's `cispo` loss (clip) and TRL 1.16's (cap) to 1e-6 in value and gradient on
     random batches with padding, empty rows and a zero advantage.
 51. SAPO equals verl's `sapo` loss there, at the paper's temperatures and others.
 52. GMPO equals verl's `geo_mean` and TRL's GMPOTrainer loss there (both divide by every row: num_seqs = B).
 53. CISPO's gradient is -w A / N with w the clipped (or capped) weight: not 0 where PPO-clip's is; at
     ratio 1 it is DAPO's exactly.
 54. SAPO's gradient is -A 4 r s (1 - s) / (B' |o_i|), s = sigmoid(tau (r - 1)), tau by the sign of A; at
     ratio 1 it is -A / (B' |o_i|) for any tau and the loss is the mean of -2A/tau; the weight is > 0 for
     every r and falls as tau grows at any r != 1.
 55. GMPO at ratio 1 has GRPO's gradient (seq-mean-token-mean); a token clipped in A's direction has zero
     gradient and adds its bound to the exponent, and the other tokens of its row share one gradient.
Entropy mathematics (tepo.py section 4; Cui et al. arXiv 2505.22617)
 30. For any logits z and direction u, d/dt H(softmax(z + t u)) at t = 0 is exactly
     -Cov_{a~p}(log p_a, u_a).
 31. The natural-gradient step is z + eta A up to a constant, so its entropy change is
     -eta Cov(log p, A) to first order.
 32. The vanilla policy-gradient step's entropy change is -eta Cov(log p, p (A - E_p A)): the
     advantage must be centred.
 33. A rising with log p lowers entropy under the natural-gradient step; A = -log p raises it.
Clip-Cov, KL-Cov (Cui et al. arXiv 2505.22617)
 34. Clip-Cov zeroes the gradient of exactly min(max(1, int(ratio N)), #candidates) tokens drawn
     from the valid, not PPO-clipped tokens with lb < Cov < ub, leaves every other token as PPO-clip
     does, and draws the same tokens under the same seed.
 35. KL-Cov at ratio 1 is the unclipped policy gradient -A r; off-policy its top-k tokens by Cov
     (k = max(1, int(N ratio))) get beta sign(delta) more gradient.
 36. At ratio 1 and equal lengths, GRPO, GSPO, GSPO-token, DAPO, TEPO (empty mask), MPO (K = 1), CISPO,
     GMPO and SAPO share the gradient direction, up to known constants.
Pitfalls small RL projects have shipped, each ruled out by name
 37. Entropy is the full-vocabulary entropy -sum_v p_v log p_v, not the sampled token's -log p.
 38. At ratio 1 the clipped surrogate's gradient is A d log pi, with no factor 2.
 39. The KL term is masked once, and a logged KL averages over valid tokens only, never padding.
 40. When the pad id equals the end-of-sequence id, the end token stays in the loss
     (tepokit/tests/test_train_small.py).
 41. Gradient accumulation: micro-batches aggregated with the whole batch's token or sequence
     count add up to the whole batch's loss and gradient.
 42. Log-probs are taken at the sampling temperature, log_softmax(logits / T).
 43. NaN or inf at padded positions never reaches the loss, the gradient or a metric.
 44. When an objective cannot act (at ratio 1 clipping, GSPO's clip, TEPO's KL to the old policy
     and KL-Cov's penalty do nothing) the on_policy metric says so.
Configuration
 45. tepo.FIELDS_READ is exact: changing a field an objective does not declare leaves its loss and
     gradient bit-identical, and every field it declares changes them for some valid value.
The entropy bonus
 46. entropy_bonus is -coef x the aggregated full-vocabulary entropy; its gradient on the logits is
     -coef w p_v (log p_v + H) per position (w the aggregation weight), padding gets none, and
     coef = 0 gives exactly 0 with no gradient.
Two options of every objective (the sampler's mismatch, Yao et al. 2025; forking tokens, arXiv 2506.01939)
 47. The sampler's weight is min(pi_old / pi_sampler, cap) (truncate) or pi_old / pi_sampler up to the cap and 0
     past it (mask), with no lower bound (delta = -1 keeps 0.368 under cap 2), 1 at padding, without gradient; with
     the sampler's log-probs equal to the old ones every objective is bit-identical to the one without it.
 48. The weight multiplies each token's policy-gradient loss before aggregation (gradient w_t g_t, a token weighed
     0 still counted) and never the KL term; an MPO block takes the weight of its tokens as its ratio does.
 49. The forking-token mask keeps N - ceil((1 - share)(N - 1)) of N distinct valid entropies (10 at share 0.2 keep
     2, 11 keep 3), never a padded token, and zeroes the policy gradient of the others (not the KL, not the count);
     share 1, or equal entropies, leave loss and gradient bit-identical.
Besides these: one-line ValueErrors naming the bad argument and the valid choices (a NaN or inf
where mask is 1, a mask that is not 0/1, a shape mismatch: refused by every objective), fully masked
rows giving finite zeros, an empty batch giving exactly 0 with zero gradients, bf16 inputs staying
close to float64, and finite values at extreme ratios; and the structure of tepo.py: GRPO, DAPO and
Dr. GRPO are PPO-clip's loss exactly, every objective is a `def <name>_loss` of its own, a config is
checked once when it is made (not on every call), every entropy is the one formula of
entropy_from_logprobs, and the metrics' KL is kl_penalty's k3.

Rules followed throughout:
* float64, gradients by torch.autograd w.r.t. ``logp``;
* every expected value is computed independently (plain Python loops or a few
  lines of torch written here), never by calling back into tepo;
* CPU only, the whole file runs in well under two minutes on 2 cores.

Layout (sections with comment headers):
  1. helpers (independent references)
  2. building blocks: advantages, aggregation, KL estimators, log-ratios
  3. PPO-clip
  4. GRPO / DAPO / Dr. GRPO
  5. GSPO / GSPO-token
  6. TEPO
  7. MPO
 7b. CISPO / GMPO / SAPO against the peers' formulas (properties 50-55)
  8. entropy: logits helpers and the entropy mathematics
  9. Clip-Cov / KL-Cov
 10. cross-method sanity
 11. robustness: padding, empty rows, extreme ratios, bf16, metrics (properties 39, 43, 44)
 12. gradient accumulation (property 41)
 13. bad arguments (ValueError)
 14. configuration (property 45)
 15. the two options of every objective (properties 47-49, at the end of the file)
"""

import dataclasses
import math
import os
import re
import statistics
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tepo

F64 = torch.float64
HYP = settings(max_examples=25, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# =============================================================================
# 1. Helpers (independent references: plain Python / a few torch lines)
# =============================================================================

def assert_close(actual, expected, atol=1e-10, rtol=1e-9, msg=None):
    actual = actual.detach().to(F64) if torch.is_tensor(actual) else torch.tensor(actual, dtype=F64)
    expected = expected.detach().to(F64) if torch.is_tensor(expected) else torch.tensor(expected, dtype=F64)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=msg)


def lengths_mask(lengths, T, dtype=F64):
    L = torch.as_tensor(lengths)
    return (torch.arange(T)[None, :] < L[:, None]).to(dtype)


def make_inputs(B=6, T=7, lengths=None, seed=0, noise=0.0):
    """Random realistic inputs. ``noise`` is the std of logp - old_logp (0 = on-policy)."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    mask = lengths_mask(lengths, T)
    logp = -(torch.rand(B, T, generator=g, dtype=F64) * 2.0 + 0.05)
    old = logp + noise * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    adv = adv + 0.2 * torch.sign(adv)  # keep |A| away from 0
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    ent = torch.rand(B, T, generator=g, dtype=F64) * 3.0
    old_ent = torch.rand(B, T, generator=g, dtype=F64) * 3.0
    sampler = old + 0.6 * torch.randn(B, T, generator=g, dtype=F64)   # the sampler's log-probs (drawn last)
    return SimpleNamespace(B=B, T=T, lengths=list(lengths), mask=mask, logp=logp,
                           old=old, adv=adv, ref=ref, ent=ent, old_ent=old_ent, sampler=sampler)


def cfg(name, **overrides):
    return tepo.config_for(name, **overrides)


def run(name, logp, old, adv, mask, c, **kw):
    """Call objective ``name``; return (loss value, d loss / d logp, metrics)."""
    fn = tepo.OBJECTIVES[name] if isinstance(name, str) else name
    lp = logp.detach().clone().requires_grad_(True)
    loss, metrics = fn(lp, old, adv, mask, c, **kw)
    assert loss.dim() == 0
    grad = None
    if loss.requires_grad:
        grad = torch.autograd.grad(loss, lp, allow_unused=True)[0]
    if grad is None:
        grad = torch.zeros_like(lp)
    return loss.detach(), grad, metrics


def run_x(name, x, c, old=None, adv=None, **kw):
    """Run on a make_inputs namespace, passing every optional input."""
    kw.setdefault("ref_logp", x.ref)
    kw.setdefault("entropy", x.ent)
    kw.setdefault("old_entropy", x.old_ent)
    kw.setdefault("sampler_logp", x.sampler)
    return run(name, x.logp, x.old if old is None else old,
               x.adv if adv is None else adv, x.mask, c, **kw)


def valid_tokens(mask):
    B, T = mask.shape
    return [(i, t) for i in range(B) for t in range(T) if float(mask[i, t]) > 0]


def ref_group_adv(rewards, G, scale="group", eps=1e-6):
    r = [float(v) for v in rewards]
    all_std = statistics.stdev(r) if len(r) > 1 else 1.0
    out = []
    for g0 in range(0, len(r), G):
        grp = r[g0:g0 + G]
        if len(grp) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.fmean(grp), statistics.stdev(grp)
        for v in grp:
            if scale == "group":
                out.append((v - mean) / (std + eps))
            elif scale == "batch":
                out.append((v - mean) / (all_std + eps))
            else:
                out.append(v - mean)
    return torch.tensor(out, dtype=F64)


def ref_cov(logp, adv, mask):
    """Per-token covariance (tepo.token_covariance, section 5) by a plain loop (means over valid tokens)."""
    B, T = logp.shape
    A = adv if adv.dim() == 2 else adv[:, None].expand(B, T)
    vt = valid_tokens(mask)
    mlp = sum(float(logp[i, t]) for i, t in vt) / len(vt)
    mA = sum(float(A[i, t]) for i, t in vt) / len(vt)
    cov = torch.zeros(B, T, dtype=F64)
    for i, t in vt:
        cov[i, t] = (float(logp[i, t]) - mlp) * (float(A[i, t]) - mA)
    return cov


def py_entropy(z, T=1.0):
    """Entropy of softmax(z/T) for a 1-D sequence, plain Python."""
    zs = [float(v) / T for v in z]
    m = max(zs)
    lse = m + math.log(sum(math.exp(v - m) for v in zs))
    return -sum(math.exp(v - lse) * (v - lse) for v in zs)


def t_entropy(z):
    lp = torch.log_softmax(z, -1)
    return -(lp.exp() * lp).sum(-1)


def cov_p(p, x, y):
    return (p * x * y).sum() - (p * x).sum() * (p * y).sum()


def is_clipped(A, r, el, eh):
    return (A > 0 and r > 1 + eh) or (A < 0 and r < 1 - el)


def all_finite_metrics(metrics):
    for k, v in metrics.items():
        assert isinstance(v, float), f"metric {k} is {type(v)}, expected float"
        assert math.isfinite(v), f"metric {k} = {v}"


COMMON_METRICS = ["loss", "pg_loss", "kl_loss", "clip_ratio/low_mean", "clip_ratio/high_mean",
                  "clip_ratio/region_mean", "ratio/mean", "ratio/min", "ratio/max",
                  "kl_old/k1", "kl_old/k3", "on_policy"]

# One entry per objective/variant, used by the robustness sweeps.
SWEEP = [
    ("ppo", dict(aggregation="token-mean", dual_clip_c=None, beta=0.0)),
    ("ppo", dict(aggregation="seq-mean-token-sum", dual_clip_c=3.0, beta=0.1, kl_estimator="k3")),
    ("grpo", dict(beta=0.04, kl_estimator="k3")),
    ("dr_grpo", dict()),
    ("dapo", dict()),
    ("gspo", dict()),
    ("gspo_token", dict()),
    ("tepo", dict(beta=1.0, kl_estimator="abs")),
    ("tepo", dict(beta=1.0, kl_estimator="k3", entropy_criterion="measured")),
    ("tepo", dict(beta=0.5, kl_target="ref")),
    ("tepo", dict(beta=1.0, kl_estimator="abs", kl_mode="hard", kl_tau=0.05)),
    ("tepo", dict(ratio_mode="gmpo")),
    ("mpo", dict(block_size=3)),
    ("mpo", dict(block_size=2, block_ratio="geomean")),
    ("mpo", dict(block_size=3, block_agg="block-mean")),
    ("mpo", dict(block_size=2, block_agg="token-weighted")),
    ("clip_cov", dict(eps_low=0.2, eps_high=0.2, clip_cov_ratio=0.2, clip_cov_lb=-100.0,
                      clip_cov_ub=100.0)),
    ("kl_cov", dict(kl_cov_ratio=0.2, beta=1.0)),
    ("cispo", dict()),
    ("cispo", dict(cispo_weight="cap", eps_high=1.1, beta=0.1)),
    ("gmpo", dict()),
    ("sapo", dict()),
]
SWEEP_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for n, o in SWEEP]


# =============================================================================
# 2. Building blocks
# =============================================================================

# ---- 2a. group advantages (property 1) --------------------------------------

@HYP
@given(n_groups=st.integers(1, 4), G=st.integers(2, 6), seed=st.integers(0, 10_000),
       identical=st.booleans())
def test_group_advantages_zero_mean_unit_std_and_match_loop(n_groups, G, seed, identical):
    """Property 1: per group sum(A)=0, unbiased std(A) = s/(s+eps), equals the loop."""
    g = torch.Generator().manual_seed(seed)
    n = n_groups * G
    r = torch.randint(0, 3, (n,), generator=g).to(F64) + 0.5 * torch.rand(n, generator=g, dtype=F64)
    if identical:
        r[:G] = 1.0
    adv = tepo.group_advantages(r, G)
    assert adv.shape == r.shape
    assert_close(adv, ref_group_adv(r, G), atol=1e-9)
    for k in range(n_groups):
        a, rg = adv[k * G:(k + 1) * G], r[k * G:(k + 1) * G]
        assert abs(float(a.sum())) < 1e-9
        s = statistics.stdev(rg.tolist())
        assert abs(float(a.std()) - s / (s + 1e-6)) < 1e-9
    if identical:
        assert torch.all(adv[:G] == 0)


@HYP
@given(seed=st.integers(0, 10_000), a=st.floats(0.1, 10.0), b=st.floats(-5.0, 5.0))
def test_group_advantages_invariant_to_positive_affine_reward_map(seed, a, b):
    """Property 1: A(a*r+b) = A(r) for a>0 (exact with eps=0)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(12, generator=g, dtype=F64)
    assert_close(tepo.group_advantages(a * r + b, 4, eps=0.0), tepo.group_advantages(r, 4, eps=0.0),
                 atol=1e-8, rtol=1e-8)


def test_dr_grpo_advantages_equal_normalised_advantages_times_std():
    """Property 1: Dr. GRPO (scale='none') advantages = std-normalised ones * (std+eps)."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.9, 0.1, 0.2, 2.0, 2.0, 2.0, 2.0], dtype=F64)
    a_none = tepo.group_advantages(r, 4, scale="none")
    a_grp = tepo.group_advantages(r, 4, scale="group")
    assert_close(a_none, ref_group_adv(r, 4, scale="none"))
    for k in range(3):
        s = statistics.stdev(r[4 * k:4 * k + 4].tolist())
        assert_close(a_none[4 * k:4 * k + 4], a_grp[4 * k:4 * k + 4] * (s + 1e-6), atol=1e-9)


def test_group_advantages_batch_scale_uses_group_mean_and_batch_std():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.9, 0.1, 0.2], dtype=F64)
    assert_close(tepo.group_advantages(r, 4, scale="batch"), ref_group_adv(r, 4, scale="batch"))


def test_group_advantages_size_one_group_uses_mean_zero_std_one():
    r = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    assert_close(tepo.group_advantages(r, 1), r / (1 + 1e-6))


def test_identical_rewards_give_zero_advantage_even_with_inexact_float_mean():
    """Property 1: rewards [0.1,0.1,0.1] have a float mean != 0.1; advantage must still be ~0."""
    r = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.0], dtype=F64)
    adv = tepo.group_advantages(r, 3)
    assert torch.isfinite(adv).all()
    assert float(adv[:3].abs().max()) < 1e-9


# ---- 2b. masked reductions and aggregation (property 2) ---------------------

def test_masked_mean_and_sum_match_loops_and_empty_rows_are_finite_zero():
    x = make_inputs(B=4, T=5, lengths=[5, 2, 0, 3], seed=1)
    v = x.logp
    vt = valid_tokens(x.mask)
    assert_close(tepo.masked_sum(v, x.mask), sum(float(v[i, t]) for i, t in vt))
    assert_close(tepo.masked_mean(v, x.mask), sum(float(v[i, t]) for i, t in vt) / len(vt))
    rows_sum = tepo.masked_sum(v, x.mask, dim=-1)
    rows_mean = tepo.masked_mean(v, x.mask, dim=-1)
    for i, L in enumerate(x.lengths):
        s = sum(float(v[i, t]) for t in range(L))
        assert_close(rows_sum[i], s)
        assert_close(rows_mean[i], s / L if L else 0.0)
    assert torch.isfinite(rows_mean).all()


def ref_aggregate(l, mask, mode, num_tokens=None, num_seqs=None, C=None):
    B, T = l.shape
    rows = [[float(l[i, t]) for t in range(T) if mask[i, t] > 0] for i in range(B)]
    total = sum(sum(r) for r in rows)
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return total / (num_tokens if num_tokens is not None else sum(len(r) for r in rows))
    n = num_seqs if num_seqs is not None else len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / n
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / n
    if mode == "seq-mean-token-sum-norm":  # paper form: divide by B * C (C defaults to T)
        n = num_seqs if num_seqs is not None else B
        return total / (n * (C if C is not None else T))
    raise AssertionError(mode)


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES[:3])
def test_aggregate_loss_matches_loop_and_skips_empty_sequences(mode):
    """0.3: each mode equals its formula; empty rows excluded from B' for seq-mean modes."""
    x = make_inputs(B=5, T=6, lengths=[6, 1, 0, 4, 3], seed=2)
    l = torch.randn(5, 6, generator=torch.Generator().manual_seed(3), dtype=F64)
    assert_close(tepo.aggregate_loss(l, x.mask, mode), ref_aggregate(l, x.mask, mode))
    assert_close(tepo.aggregate_loss(l, x.mask, mode, num_tokens=40.0, num_seqs=9.0),
                 ref_aggregate(l, x.mask, mode, num_tokens=40.0, num_seqs=9.0))


def test_aggregate_loss_seq_mean_token_sum_norm_divides_by_num_seqs_times_constant():
    """Property 8: seq-mean-token-sum-norm = sum / (B * C), C = T by default."""
    x = make_inputs(B=4, T=6, lengths=[6, 1, 4, 3], seed=2)
    l = torch.randn(4, 6, generator=torch.Generator().manual_seed(3), dtype=F64)
    m = "seq-mean-token-sum-norm"
    assert_close(tepo.aggregate_loss(l, x.mask, m), ref_aggregate(l, x.mask, m))
    assert_close(tepo.aggregate_loss(l, x.mask, m, norm_constant=16.0),
                 ref_aggregate(l, x.mask, m, C=16.0))
    assert_close(tepo.aggregate_loss(l, x.mask, m, num_seqs=10.0, norm_constant=16.0),
                 ref_aggregate(l, x.mask, m, num_seqs=10.0, C=16.0))


@HYP
@given(B=st.integers(1, 6), T=st.integers(1, 8), data=st.data(), seed=st.integers(0, 10_000))
def test_aggregation_identities_at_equal_lengths(B, T, data, seed):
    """Property 2: equal lengths L -> token-mean = seq-mean-token-mean, token-sum = L*token-mean."""
    L = data.draw(st.integers(1, T))
    mask = lengths_mask([L] * B, T)
    l = torch.randn(B, T, generator=torch.Generator().manual_seed(seed), dtype=F64)
    tm = tepo.aggregate_loss(l, mask, "token-mean")
    assert_close(tepo.aggregate_loss(l, mask, "seq-mean-token-mean"), tm)
    assert_close(tepo.aggregate_loss(l, mask, "seq-mean-token-sum"), L * tm)


@HYP
@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000),
       mode=st.sampled_from(MODES))
def test_aggregate_loss_padding_changes_neither_value_nor_gradient(B, T, seed, mode):
    """Property 2: entries where mask=0 never affect value or gradient."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) < 0.6).to(F64)
    mask[0, 0] = 1.0
    l = torch.randn(B, T, generator=g, dtype=F64)
    pert = l + (1 - mask) * 1e4 * torch.randn(B, T, generator=g, dtype=F64)
    a = l.clone().requires_grad_(True)
    b = pert.clone().requires_grad_(True)
    va, vb = tepo.aggregate_loss(a, mask, mode), tepo.aggregate_loss(b, mask, mode)
    ga, = torch.autograd.grad(va, a)
    gb, = torch.autograd.grad(vb, b)
    assert_close(va, vb, atol=1e-12)
    assert_close(ga, gb, atol=1e-14)
    assert torch.all(ga[mask == 0] == 0)


# ---- 2c. KL estimators (property 3) ------------------------------------------

def test_kl_estimators_closed_forms():
    """0.4: k1 = x, abs = |x|, k2 = x^2/2, k3 = e^-x + x - 1 (x = logp - ref); k3 is clamped
    to [-10, 10] as in verl (documented), so x = -3 gives 10, not e^3 - 4 = 16.09."""
    x = torch.tensor([[-2.0, -0.5, 0.0, 0.7, 2.0, 30.0]], dtype=F64)
    ref = torch.zeros_like(x) - 1.0
    logp = ref + x
    assert_close(tepo.kl_penalty(logp, ref, "k1"), x)
    assert_close(tepo.kl_penalty(logp, ref, "abs"), x.abs())
    assert_close(tepo.kl_penalty(logp, ref, "k2"), 0.5 * x ** 2)
    exp_k3 = torch.tensor([[math.exp(-v) + v - 1 for v in x[0].tolist()]], dtype=F64).clamp(max=10.0)
    assert_close(tepo.kl_penalty(logp, ref, "k3"), exp_k3)
    assert_close(tepo.kl_penalty(ref - 3.0, ref, "k3"), torch.full_like(ref, 10.0))


def test_k1_and_k3_expectations_equal_exact_categorical_kl():
    """Property 3: E_pi[k1] = E_pi[k3] = KL(pi || pi_ref) summed exactly over the support."""
    g = torch.Generator().manual_seed(4)
    lp = torch.log_softmax(torch.randn(1, 9, generator=g, dtype=F64) * 0.8, -1)
    lr = torch.log_softmax(torch.randn(1, 9, generator=g, dtype=F64) * 0.8, -1)
    assert float((lp - lr).min()) > -2.3  # stay inside k3's documented clamp (k3 <= 10)
    p = lp.exp()
    kl = sum(float(p[0, a]) * (float(lp[0, a]) - float(lr[0, a])) for a in range(9))
    assert kl > 0.05
    assert_close((p * tepo.kl_penalty(lp, lr, "k1")).sum(), kl)
    assert_close((p * tepo.kl_penalty(lp, lr, "k3")).sum(), kl)


@HYP
@given(seed=st.integers(0, 10_000))
def test_k3_is_nonnegative_and_zero_with_zero_gradient_at_reference(seed):
    """Property 3: k3 >= 0; k3 = 0 and d k3/d logp = 0 where logp = ref_logp."""
    g = torch.Generator().manual_seed(seed)
    ref = -torch.rand(3, 5, generator=g, dtype=F64) * 4
    logp = ref + 3 * torch.randn(3, 5, generator=g, dtype=F64)
    assert (tepo.kl_penalty(logp, ref, "k3") >= 0).all()
    lp = ref.clone().requires_grad_(True)
    k = tepo.kl_penalty(lp, ref, "k3")
    gr, = torch.autograd.grad(k.sum(), lp)
    assert torch.all(k == 0) and torch.all(gr == 0)


@pytest.mark.parametrize("est,base", [("k1+", "k1"), ("k3+", "k3")])
def test_straight_through_kl_has_base_value_and_k2_gradient(est, base):
    """Property 3: k3+ (k1+) has the value of k3 (k1) and the gradient of k2 (= x)."""
    g = torch.Generator().manual_seed(5)
    ref = -torch.rand(2, 4, generator=g, dtype=F64)
    x = torch.randn(2, 4, generator=g, dtype=F64)
    lp = (ref + x).clone().requires_grad_(True)
    k = tepo.kl_penalty(lp, ref, est)
    base_val = x if base == "k1" else torch.exp(-x) + x - 1
    assert_close(k, base_val)
    gr, = torch.autograd.grad(k.sum(), lp)
    assert_close(gr, x)


# ---- 2d. log-ratios ------------------------------------------------------------

def test_token_log_ratio_zero_at_padding_and_clamped():
    mask = lengths_mask([3, 2], 4)
    old = torch.full((2, 4), -1.0, dtype=F64)
    logp = old + torch.tensor([[0.3, 50.0, -50.0, 7.0], [-0.2, 0.1, 9.0, 9.0]], dtype=F64)
    d = tepo.token_log_ratio(logp, old, mask, clamp=20.0)
    assert_close(d, torch.tensor([[0.3, 20.0, -20.0, 0.0], [-0.2, 0.1, 0.0, 0.0]], dtype=F64))


@HYP
@given(L=st.integers(1, 12), c=st.floats(0.2, 5.0), T_extra=st.integers(0, 3))
def test_sequence_ratio_equals_common_token_ratio_whatever_the_length(L, c, T_extra):
    """Property 13: every token ratio = c -> s_i = c for any length (product would be c**L)."""
    T = L + T_extra
    mask = lengths_mask([L], T)
    old = -torch.rand(1, T, generator=torch.Generator().manual_seed(L), dtype=F64)
    logp = old + math.log(c)
    s = tepo.sequence_log_ratio(logp, old, mask).exp()
    assert_close(s, torch.tensor([c], dtype=F64))


def test_sequence_log_ratio_is_masked_mean_and_zero_for_empty_rows():
    x = make_inputs(B=3, T=5, lengths=[5, 2, 0], seed=6, noise=0.4)
    got = tepo.sequence_log_ratio(x.logp, x.old, x.mask)
    exp = [sum(float(x.logp[i, t] - x.old[i, t]) for t in range(L)) / L if L else 0.0
           for i, L in enumerate(x.lengths)]
    assert_close(got, torch.tensor(exp, dtype=F64))


# ---- 2e. data-side DAPO helpers (properties 9, 10) ----------------------------

def test_soft_overlong_punishment_paper_values_and_monotone():
    """Property 9: R_len(16384)=0, R_len(18432)=-0.5, R_len(20480)=-1, R_len(20481)=-1, monotone."""
    lengths = torch.tensor([0, 16384, 17000, 18432, 20480, 20481, 30000])
    got = tepo.soft_overlong_punishment(lengths, 20480, 4096)
    exp = [0.0, 0.0, (16384 - 17000) / 4096, -0.5, -1.0, -1.0, -1.0]
    assert_close(got, torch.tensor(exp, dtype=F64), atol=1e-7)
    grid = tepo.soft_overlong_punishment(torch.arange(0, 21000, 7), 20480, 4096)
    assert torch.all(grid[1:] <= grid[:-1])


def test_dynamic_sampling_keeps_exactly_groups_with_nonzero_reward_std():
    """Property 10: rows of zero-std groups (all right / all wrong) are removed, others kept."""
    r = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.25, 0.5], dtype=F64)
    keep = tepo.dynamic_sampling_mask(r, 4)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 4


def test_dynamic_sampling_removes_identical_float_rewards_with_inexact_std():
    """Property 10: [0.1, 0.1, 0.1] is a zero-std group even though torch.std gives ~1.7e-17."""
    r = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.0], dtype=F64)
    assert tepo.dynamic_sampling_mask(r, 3).tolist() == [False] * 3 + [True] * 3


# =============================================================================
# 3. PPO-clip (properties 4, 5, 38)
# =============================================================================

@pytest.mark.parametrize("el,eh", [(0.0, 0.0), (0.1, 0.1), (0.2, 0.28), (1.0, 10.0)])
def test_ppo_gradient_at_ratio_one_is_minus_advantage_over_token_count_for_any_eps(el, eh):
    """Property 4: at ratio 1 the per-token gradient is -A / N (token-mean), for any eps."""
    x = make_inputs(B=5, T=6, seed=7)
    c = cfg("ppo", eps_low=el, eps_high=eh, dual_clip_c=3.0, beta=0.0, aggregation="token-mean")
    loss, g, _ = run("ppo", x.logp, x.logp.clone(), x.adv, x.mask, c)
    N = float(x.mask.sum())
    exp = torch.zeros(5, 6, dtype=F64)
    for i, t in valid_tokens(x.mask):
        exp[i, t] = -float(x.adv[i]) / N
    assert_close(g, exp)
    assert_close(loss, -sum(float(x.adv[i]) for i, t in valid_tokens(x.mask)) / N)


def test_ppo_on_policy_parameter_gradient_is_exactly_A_grad_logpi_without_factor_two():
    """Property 38: on-policy, d loss/d logits = -(A/N) (onehot - softmax), no factor 2."""
    g = torch.Generator().manual_seed(8)
    B, T, V = 3, 4, 5
    theta = torch.randn(B, T, V, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = lengths_mask([4, 2, 3], T)
    adv = torch.tensor([1.3, -0.7, 0.4], dtype=F64)
    logp = torch.log_softmax(theta, -1).gather(-1, tokens[..., None])[..., 0]
    c = cfg("ppo", eps_low=0.2, eps_high=0.2, beta=0.0, aggregation="token-mean")
    loss, _ = tepo.ppo_clip_loss(logp, logp.detach(), adv, mask, c)
    gth, = torch.autograd.grad(loss, theta)
    p = torch.softmax(theta.detach(), -1)
    N = float(mask.sum())
    exp = torch.zeros(B, T, V, dtype=F64)
    for i, t in valid_tokens(mask):
        for v in range(V):
            exp[i, t, v] = -float(adv[i]) / N * ((1.0 if v == tokens[i, t] else 0.0) - float(p[i, t, v]))
    assert_close(gth, exp)


def test_ppo_off_policy_gradient_is_zero_exactly_in_the_clipped_regions():
    """Property 5: A>0 & r>1+eh or A<0 & r<1-el -> zero gradient; elsewhere -A r / N."""
    x = make_inputs(B=6, T=8, seed=9, noise=0.35)
    el, eh = 0.2, 0.28
    c = cfg("ppo", eps_low=el, eps_high=eh, dual_clip_c=None, beta=0.0, aggregation="token-mean")
    _, g, _ = run("ppo", x.logp, x.old, x.adv, x.mask, c)
    N = float(x.mask.sum())
    exp = torch.zeros_like(g)
    n_clip = 0
    for i, t in valid_tokens(x.mask):
        A, r = float(x.adv[i]), math.exp(float(x.logp[i, t] - x.old[i, t]))
        if is_clipped(A, r, el, eh):
            n_clip += 1
        else:
            exp[i, t] = -A * r / N
    assert 0 < n_clip < len(valid_tokens(x.mask))
    assert_close(g, exp)


def test_ppo_dual_clip_bounds_negative_advantage_loss_by_c_with_zero_gradient():
    """Property 5: dual-clip, A<0 and r>c -> loss = -A c and zero gradient."""
    c = cfg("ppo", eps_low=0.2, eps_high=0.2, dual_clip_c=3.0, beta=0.0, aggregation="token-mean")
    mask = torch.ones(1, 1, dtype=F64)
    old = torch.full((1, 1), -2.0, dtype=F64)
    A = torch.tensor([-0.5], dtype=F64)
    loss, g, _ = run("ppo", old + 2.0, old, A, mask, c)  # r = e^2 = 7.39 > 3
    assert_close(loss, 0.5 * 3.0)
    assert float(g.abs().max()) == 0.0
    loss, g, _ = run("ppo", old + math.log(2.0), old, A, mask, c)  # 1.2 < r = 2 < 3: unclipped
    assert_close(loss, 0.5 * 2.0)
    assert_close(g, torch.tensor([[0.5 * 2.0]], dtype=F64))


def test_ppo_clip_ratio_and_ratio_metrics_count_valid_tokens_only():
    """TRL metric definitions: low = r<1-el & A<0, high = r>1+eh & A>0, region = either."""
    mask = lengths_mask([4, 4], 6)
    old = torch.full((2, 6), -1.0, dtype=F64)
    r = torch.tensor([[1.5, 0.5, 1.0, 1.1, 9.0, 0.01], [0.5, 1.5, 0.7, 1.0, 9.0, 0.01]], dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    c = cfg("ppo", eps_low=0.2, eps_high=0.2, dual_clip_c=None, beta=0.0, aggregation="token-mean")
    _, _, m = run("ppo", old + r.log(), old, adv, mask, c)
    # row0 (A>0): 1.5 high-clipped; row1 (A<0): 0.5 and 0.7 low-clipped
    assert_close(m["clip_ratio/high_mean"], 1 / 8)
    assert_close(m["clip_ratio/low_mean"], 2 / 8)
    assert_close(m["clip_ratio/region_mean"], 3 / 8)
    assert_close(m["ratio/max"], 1.5)
    assert_close(m["ratio/min"], 0.5)
    assert_close(m["ratio/mean"], (1.5 + 0.5 + 1.0 + 1.1 + 0.5 + 1.5 + 0.7 + 1.0) / 8)


# =============================================================================
# 4. GRPO / DAPO / Dr. GRPO (properties 6, 7, 8, 11)
# =============================================================================

def test_grpo_gradient_at_ratio_one_is_minus_advantage_over_group_size_and_length():
    """Property 6: grad = -(1/G) A_i / |o_i| for every valid token (beta=0)."""
    x = make_inputs(B=6, T=7, lengths=[7, 1, 3, 5, 2, 6], seed=10)
    c = cfg("grpo", aggregation="seq-mean-token-mean", beta=0.0, dual_clip_c=None)
    _, g, _ = run("grpo", x.logp, x.logp.clone(), x.adv, x.mask, c)
    exp = torch.zeros_like(g)
    for i, t in valid_tokens(x.mask):
        exp[i, t] = -float(x.adv[i]) / (6 * x.lengths[i])
    assert_close(g, exp)


def test_dapo_gradient_at_ratio_one_is_global_token_mean_and_equals_grpo_at_equal_lengths():
    """Property 7: grad = -A_i / sum|o|; equal lengths -> identical to GRPO."""
    x = make_inputs(B=6, T=7, lengths=[7, 1, 3, 5, 2, 6], seed=11)
    c = cfg("dapo", aggregation="token-mean", beta=0.0)
    _, g, _ = run("dapo", x.logp, x.logp.clone(), x.adv, x.mask, c)
    N = sum(x.lengths)
    exp = torch.zeros_like(g)
    for i, t in valid_tokens(x.mask):
        exp[i, t] = -float(x.adv[i]) / N
    assert_close(g, exp)
    y = make_inputs(B=4, T=6, lengths=[4] * 4, seed=12, noise=0.2)
    cg = cfg("grpo", aggregation="seq-mean-token-mean", beta=0.0, eps_low=0.2, eps_high=0.28,
             dual_clip_c=None)
    cd = cfg("dapo", aggregation="token-mean", beta=0.0, eps_low=0.2, eps_high=0.28, dual_clip_c=None)
    lg, gg, _ = run("grpo", y.logp, y.old, y.adv, y.mask, cg)
    ld, gd, _ = run("dapo", y.logp, y.old, y.adv, y.mask, cd)
    assert_close(ld, lg)
    assert_close(gd, gg)


@pytest.mark.parametrize("C", [None, 16.0])
def test_dr_grpo_gradient_at_ratio_one_is_length_independent(C):
    """Property 8: grad = -A~_i / (G L), L = norm_constant (default T), independent of |o_i|."""
    x = make_inputs(B=4, T=7, lengths=[7, 1, 3, 5], seed=13)
    c = cfg("dr_grpo", aggregation="seq-mean-token-sum-norm", norm_constant=C, beta=0.0)
    _, g, _ = run("dr_grpo", x.logp, x.logp.clone(), x.adv, x.mask, c)
    L = 7 if C is None else C
    exp = torch.zeros_like(g)
    for i, t in valid_tokens(x.mask):
        exp[i, t] = -float(x.adv[i]) / (4 * L)
    assert_close(g, exp)


def test_grpo_kl_term_has_zero_value_and_gradient_when_policy_equals_reference():
    """Property 11: beta>0, k3, pi_theta = pi_ref -> KL value 0, gradient unchanged."""
    x = make_inputs(B=4, T=6, seed=14, noise=0.2)
    c0 = cfg("grpo", aggregation="seq-mean-token-mean", beta=0.0, dual_clip_c=None)
    c1 = cfg("grpo", aggregation="seq-mean-token-mean", beta=0.04, kl_estimator="k3", dual_clip_c=None)
    l0, g0, _ = run("grpo", x.logp, x.old, x.adv, x.mask, c0)
    l1, g1, m1 = run("grpo", x.logp, x.old, x.adv, x.mask, c1, ref_logp=x.logp.clone())
    assert_close(l1, l0)
    assert_close(g1, g0)
    assert m1["kl_loss"] == 0.0


def test_grpo_k3_kl_term_gradient_and_metrics_match_closed_form():
    """GRPO loss = pg + beta * agg(k3): grad adds beta (1 - e^{-x}) / (G L), x = logp - ref."""
    x = make_inputs(B=4, T=6, lengths=[4] * 4, seed=15)
    beta = 0.3
    c = cfg("grpo", aggregation="seq-mean-token-mean", beta=beta, kl_estimator="k3", dual_clip_c=None)
    loss, g, m = run("grpo", x.logp, x.logp.clone(), x.adv, x.mask, c, ref_logp=x.ref)
    exp = torch.zeros_like(g)
    k3 = []
    for i, t in valid_tokens(x.mask):
        d = float(x.logp[i, t] - x.ref[i, t])
        exp[i, t] = (-float(x.adv[i]) + beta * (1 - math.exp(-d))) / (4 * 4)
        k3.append(math.exp(-d) + d - 1)
    assert_close(g, exp)
    assert_close(m["kl_ref"], sum(k3) / len(k3))
    assert_close(m["kl_loss"], sum(k3) / len(k3))  # logged raw: loss = pg_loss + beta * kl_loss
    pg = -sum(float(x.adv[i]) for i, t in valid_tokens(x.mask)) / 16
    assert_close(loss, pg + beta * sum(k3) / len(k3))


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("overrides", [{}, dict(beta=0.1, dual_clip_c=3.0), dict(aggregation="seq-mean-token-sum")])
def test_grpo_dapo_and_dr_grpo_are_presets_of_ppo_clip_loss(name, overrides):
    """Structure: the three are PPO-clip's loss under their own names; with the same settings each gives
    ppo_clip_loss's loss, gradient and metrics bit for bit, on- and off-policy (their own values are
    properties 6, 7, 8 and 11)."""
    fn = tepo.OBJECTIVES[name]
    assert fn.__name__ == f"{name}_loss" and "Paper: arXiv" in fn.__doc__
    for noise in (0.0, 0.4):
        x = make_inputs(B=8, T=6, seed=16, noise=noise)
        c = cfg(name, **overrides)
        loss, grad, metrics = run_x(name, x, c)
        ppo_loss, ppo_grad, ppo_metrics = run_x(tepo.ppo_clip_loss, x, c)
        assert torch.equal(loss, ppo_loss) and torch.equal(grad, ppo_grad) and metrics == ppo_metrics


# =============================================================================
# 5. GSPO / GSPO-token (properties 12-16)
# =============================================================================

def gspo_expected_grad(x, el, eh, adv=None):
    """Closed form: -(1/B) A_i s_i / |o_i| for unclipped sequences, 0 for clipped ones."""
    adv = x.adv if adv is None else adv
    B = x.B
    exp = torch.zeros(x.B, x.T, dtype=F64)
    clipped = []
    for i in range(B):
        L = x.lengths[i]
        s = math.exp(sum(float(x.logp[i, t] - x.old[i, t]) for t in range(L)) / L)
        A = float(adv[i])
        clipped.append(is_clipped(A, s, el, eh))
        if not clipped[-1]:
            for t in range(L):
                exp[i, t] = -A * s / (B * L)
    return exp, clipped


def test_gspo_gradient_equals_grpo_gradient_at_ratio_one():
    """Property 12: s_i = 1 and GSPO grad = GRPO grad = -(1/G) A_i/|o_i| at ratio 1."""
    x = make_inputs(B=6, T=7, lengths=[7, 1, 3, 5, 2, 6], seed=16)
    cs = cfg("gspo", aggregation="seq-mean-token-mean", beta=0.0)
    cg = cfg("grpo", aggregation="seq-mean-token-mean", beta=0.0, dual_clip_c=None)
    _, gs, ms = run("gspo", x.logp, x.logp.clone(), x.adv, x.mask, cs)
    _, gg, _ = run("grpo", x.logp, x.logp.clone(), x.adv, x.mask, cg)
    exp = torch.zeros_like(gs)
    for i, t in valid_tokens(x.mask):
        exp[i, t] = -float(x.adv[i]) / (6 * x.lengths[i])
    assert_close(gs, exp)
    assert_close(gs, gg)
    assert ms["ratio/mean"] == 1.0 and ms["ratio/min"] == 1.0 and ms["ratio/max"] == 1.0


@HYP
@given(B=st.integers(1, 6), T=st.integers(1, 8), seed=st.integers(0, 10_000),
       eps=st.sampled_from([(3e-4, 4e-4), (0.05, 0.05), (0.2, 0.28)]))
def test_gspo_token_equals_gspo_off_policy_value_and_gradient(B, T, seed, eps):
    """Property 14: GSPO-token with A_{i,t}=A_i equals sequence GSPO (value, grad) off-policy."""
    x = make_inputs(B=B, T=T, seed=seed, noise=0.15)
    kw = dict(eps_low=eps[0], eps_high=eps[1], beta=0.0, aggregation="seq-mean-token-mean")
    ls, gs, _ = run("gspo", x.logp, x.old, x.adv, x.mask, cfg("gspo", **kw))
    adv_t = x.adv[:, None] * x.mask
    lt, gt, _ = run("gspo_token", x.logp, x.old, adv_t, x.mask, cfg("gspo_token", **kw))
    assert_close(lt, ls)
    assert_close(gt, gs)
    exp, _ = gspo_expected_grad(x, *eps)
    assert_close(gs, exp)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "tepo"])
def test_sequence_clipping_zeroes_every_token_of_a_clipped_sequence(name):
    """Property 15: s_i > 1+eh with A_i > 0 -> all its tokens get zero gradient,
    including a token whose own ratio (=1) is inside the band."""
    el, eh = 3e-4, 4e-4
    mask = lengths_mask([3, 3], 3)
    old = torch.full((2, 3), -1.0, dtype=F64)
    delta = torch.tensor([[0.01, 0.0, -0.001], [0.0, 0.0, 0.0]], dtype=F64)
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    c = cfg(name, eps_low=el, eps_high=eh, beta=0.0,
            aggregation="token-mean" if name == "tepo" else "seq-mean-token-mean")
    _, g, _ = run(name, old + delta, old, adv, mask, c)
    assert torch.all(g[0] == 0)
    assert torch.all(g[1] < 0)


def test_gspo_token_form_gradient_matches_closed_form_and_verl_style_reference():
    """Property 16: logw = logp - sg(logp) + sg(L) with seq-mean-token-mean gives
    grad = (1/B) s_i A_i / |o_i| (unclipped region) -- reference written here, then tepo."""
    x = make_inputs(B=5, T=6, lengths=[6, 2, 4, 1, 5], seed=17, noise=0.3)
    lp = x.logp.clone().requires_grad_(True)
    delta = (lp - x.old) * x.mask
    L = delta.sum(-1) / x.mask.sum(-1)
    w = torch.exp(lp - lp.detach() + L.detach()[:, None])
    A = x.adv[:, None]
    tok = -torch.minimum(w * A, w.clamp(1 - 0.99, 1 + 100.0) * A)
    ref_loss = ((tok * x.mask).sum(-1) / x.mask.sum(-1)).mean()
    g_ref, = torch.autograd.grad(ref_loss, lp)
    exp, clipped = gspo_expected_grad(x, 0.99, 100.0)
    assert not any(clipped)
    assert_close(g_ref, exp)
    c = cfg("gspo_token", eps_low=0.99, eps_high=100.0, beta=0.0, aggregation="seq-mean-token-mean",
            log_ratio_clamp=20.0)
    loss, g, _ = run("gspo_token", x.logp, x.old, x.adv, x.mask, c)
    assert_close(g, exp)
    assert_close(loss, ref_loss)


# =============================================================================
# 6. TEPO (properties 17-23)
# =============================================================================

def tepo_cfg(**kw):
    base = dict(aggregation="token-mean", eps_low=0.2, eps_high=0.2, ratio_mode="gspo_token",
                entropy_criterion="cov", kl_target="old", kl_mode="soft", kl_estimator="abs", beta=0.0)
    base.update(kw)
    return cfg("tepo", **base)


@pytest.mark.parametrize("extra", [dict(beta=1.0, kl_estimator="abs"), dict(beta=1.0, kl_estimator="k3"),
                                   dict(beta=0.0), dict(beta=1.0, kl_mode="hard", kl_tau=0.01),
                                   dict(beta=1.0, entropy_criterion="measured")])
def test_tepo_gradient_at_ratio_one_equals_dapo_gradient(extra):
    """Properties 17, 21: at ratio 1 (KL to old: value 0, grad 0; hard mask inactive)
    TEPO grad = DAPO grad = -A_i / sum|o|, and the KL penalty metric is 0."""
    x = make_inputs(B=6, T=7, lengths=[7, 1, 3, 5, 2, 6], seed=18)
    c = tepo_cfg(eps_low=3e-4, eps_high=4e-4, **extra)
    loss, g, m = run_x("tepo", x, c, old=x.logp.clone())
    N = sum(x.lengths)
    exp = torch.zeros_like(g)
    for i, t in valid_tokens(x.mask):
        exp[i, t] = -float(x.adv[i]) / N
    assert_close(g, exp)
    assert_close(loss, -sum(float(x.adv[i]) for i, t in valid_tokens(x.mask)) / N)
    assert m["kl_mask/penalty"] == 0.0
    _, gd, _ = run("dapo", x.logp, x.logp.clone(), x.adv, x.mask,
                   cfg("dapo", aggregation="token-mean", beta=0.0))
    assert_close(g, gd)


def test_tepo_equals_sequence_ratio_form_under_token_mean():
    """Property 18: putting s_i itself (grad through s_i) on every token gives identical
    value and gradient to the GSPO-token form, under token-mean (off-policy, with clipping)."""
    x = make_inputs(B=6, T=7, seed=19, noise=0.25)
    el, eh = 0.05, 0.05
    lp = x.logp.clone().requires_grad_(True)
    s = torch.exp(((lp - x.old) * x.mask).sum(-1) / x.mask.sum(-1))[:, None]
    A = x.adv[:, None]
    tok = -torch.minimum(s * A, s.clamp(1 - el, 1 + eh) * A)
    ref_loss = (tok * x.mask).sum() / x.mask.sum()
    g_ref, = torch.autograd.grad(ref_loss, lp)
    loss, g, _ = run_x("tepo", x, tepo_cfg(eps_low=el, eps_high=eh))
    assert_close(loss, ref_loss)
    assert_close(g, g_ref)
    assert (g_ref == 0).any() and (g_ref != 0).any()  # both clipped and unclipped sequences


def tepo_expected_mask(x, criterion="cov"):
    cov = ref_cov(x.logp, x.adv, x.mask)
    M = torch.zeros(x.B, x.T, dtype=F64)
    for i, t in valid_tokens(x.mask):
        dec = cov[i, t] > 0 if criterion == "cov" else x.ent[i, t] < x.old_ent[i, t]
        if float(x.adv[i]) > 0 and dec:
            M[i, t] = 1.0
    return M


@pytest.mark.parametrize("criterion", ["cov", "measured"])
def test_tepo_abs_penalty_gradient_is_beta_sign_delta_over_token_count_on_masked_tokens(criterion):
    """Properties 19, 22: off-policy, abs estimator: grad(beta) - grad(0) = beta M sign(delta)/N,
    where M = [A>0] [entropy decreasing] [valid]; no other token is touched."""
    x = make_inputs(B=6, T=7, seed=20, noise=0.3)
    beta = 0.7
    _, g0, _ = run_x("tepo", x, tepo_cfg(entropy_criterion=criterion, beta=0.0))
    _, g1, m1 = run_x("tepo", x, tepo_cfg(entropy_criterion=criterion, beta=beta))
    M = tepo_expected_mask(x, criterion)
    N = float(x.mask.sum())
    assert 0 < M.sum() < N
    exp = beta * M * torch.sign(x.logp - x.old) / N
    assert_close(g1 - g0, exp)
    assert_close(m1["kl_mask/frac"], float(M.sum()) / N)
    assert_close(m1["kl_mask/penalty"], float((M * (x.logp - x.old).abs()).sum()) / N)


def test_tepo_k3_penalty_gradient_is_beta_one_minus_exp_minus_delta_on_masked_tokens():
    """kl_estimator k3 against old: grad difference = beta M (1 - e^{-delta}) / N."""
    x = make_inputs(B=6, T=7, seed=21, noise=0.3)
    beta = 0.7
    _, g0, _ = run_x("tepo", x, tepo_cfg(beta=0.0, kl_estimator="k3"))
    _, g1, _ = run_x("tepo", x, tepo_cfg(beta=beta, kl_estimator="k3"))
    M = tepo_expected_mask(x)
    N = float(x.mask.sum())
    assert_close(g1 - g0, beta * M * (1 - torch.exp(-(x.logp - x.old))) / N)


def test_tepo_cov_mask_with_centred_advantages_selects_positive_advantage_above_mean_logp():
    """Properties 19, 20: with mean(A)=0, M = [A>0] and [logp > mean logp] and valid only."""
    B, T, L = 6, 7, 5
    x = make_inputs(B=B, T=T, lengths=[L] * B, seed=22, noise=0.3)
    x.adv = x.adv - x.adv.mean()
    vt = valid_tokens(x.mask)
    mlp = sum(float(x.logp[i, t]) for i, t in vt) / len(vt)
    M = torch.zeros(B, T, dtype=F64)
    for i, t in vt:
        if float(x.adv[i]) > 0 and float(x.logp[i, t]) > mlp:
            M[i, t] = 1.0
    beta = 1.0
    _, g0, _ = run_x("tepo", x, tepo_cfg(beta=0.0))
    _, g1, m1 = run_x("tepo", x, tepo_cfg(beta=beta))
    N = float(x.mask.sum())
    diff = g1 - g0
    assert_close(diff, beta * M * torch.sign(x.logp - x.old) / N)
    assert torch.all(diff[x.adv <= 0] == 0) and torch.all(diff[x.mask == 0] == 0)
    assert_close(m1["kl_mask/frac"], float(M.sum()) / N)
    assert_close(m1["kl_mask/penalty"], float((M * (x.logp - x.old).abs()).sum()) / N)


def test_tepo_hard_mask_drops_policy_gradient_of_masked_tokens_beyond_tau():
    """1.5 kl_mode='hard': masked tokens with D=|delta| > tau lose their PG gradient;
    unmasked tokens keep the beta=0 gradient."""
    x = make_inputs(B=6, T=7, seed=23, noise=0.3)
    tau = 0.2
    _, g0, _ = run_x("tepo", x, tepo_cfg(beta=0.0))
    _, gh, _ = run_x("tepo", x, tepo_cfg(beta=1.0, kl_mode="hard", kl_tau=tau))
    M = tepo_expected_mask(x)
    D = (x.logp - x.old).abs()
    drop = (M > 0) & (D > tau)
    assert drop.any() and ((M > 0) & (D <= tau)).any()
    assert torch.all(gh[drop] == 0)
    keep = (M == 0)
    assert_close(gh[keep], g0[keep])


def test_tepo_equals_gspo_at_equal_lengths_and_reweights_sequences_by_length_otherwise():
    """Property 23: empty mask (beta=0): equal lengths -> TEPO = GSPO (value, grad) for any
    ratios; unequal lengths -> grad_TEPO = grad_GSPO * |o_i| / mean|o|."""
    kw = dict(eps_low=0.05, eps_high=0.05, beta=0.0)
    y = make_inputs(B=5, T=7, lengths=[5] * 5, seed=24, noise=0.3)
    lt, gt, _ = run_x("tepo", y, tepo_cfg(**kw))
    ls, gs, _ = run("gspo", y.logp, y.old, y.adv, y.mask, cfg("gspo", aggregation="seq-mean-token-mean", **kw))
    assert_close(lt, ls)
    assert_close(gt, gs)
    x = make_inputs(B=5, T=7, lengths=[7, 1, 3, 5, 4], seed=25, noise=0.3)
    _, gt, _ = run_x("tepo", x, tepo_cfg(**kw))
    _, gs, _ = run("gspo", x.logp, x.old, x.adv, x.mask, cfg("gspo", aggregation="seq-mean-token-mean", **kw))
    mean_len = sum(x.lengths) / 5
    scale = torch.tensor([L / mean_len for L in x.lengths], dtype=F64)[:, None]
    assert_close(gt, gs * scale)
    assert (gs != 0).any()


# =============================================================================
# 7. MPO (properties 24-29)
# =============================================================================

def mpo_cfg(**kw):
    base = dict(block_size=4, block_ratio="joint", block_agg="seq-mean-block-mean", eps_low=0.2,
                eps_high=0.2, beta=0.0)
    base.update(kw)
    return cfg("mpo", **base)


@HYP
@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000),
       block_ratio=st.sampled_from(["joint", "geomean"]), on_policy=st.booleans())
def test_mpo_with_block_size_one_equals_token_level_surrogate(B, T, seed, block_ratio, on_policy):
    """Property 24: K=1 -> seq-mean-block-mean = GRPO, token-weighted = DAPO (value, grad)."""
    x = make_inputs(B=B, T=T, seed=seed, noise=0.0 if on_policy else 0.3)
    old = x.logp.clone() if on_policy else x.old
    tok = dict(eps_low=0.2, eps_high=0.28, beta=0.0, dual_clip_c=None)
    lm, gm, _ = run("mpo", x.logp, old, x.adv, x.mask,
                    mpo_cfg(block_size=1, block_ratio=block_ratio, eps_low=0.2, eps_high=0.28))
    lg, gg, _ = run("grpo", x.logp, old, x.adv, x.mask, cfg("grpo", aggregation="seq-mean-token-mean", **tok))
    assert_close(lm, lg)
    assert_close(gm, gg)
    lm, gm, _ = run("mpo", x.logp, old, x.adv, x.mask,
                    mpo_cfg(block_size=1, block_ratio=block_ratio, block_agg="token-weighted",
                            eps_low=0.2, eps_high=0.28))
    ld, gd, _ = run("dapo", x.logp, old, x.adv, x.mask, cfg("dapo", aggregation="token-mean", **tok))
    assert_close(lm, ld)
    assert_close(gm, gd)


def test_mpo_single_block_geomean_equals_gspo_and_joint_is_full_product():
    """Property 25: K >= max length: geomean + seq-mean-block-mean = GSPO exactly;
    joint uses prod_t r_t (grad -(1/B) A rho per token when unclipped)."""
    x = make_inputs(B=5, T=6, lengths=[6, 2, 4, 1, 5], seed=26, noise=0.2)
    kw = dict(eps_low=0.05, eps_high=0.05)
    lm, gm, _ = run("mpo", x.logp, x.old, x.adv, x.mask, mpo_cfg(block_size=8, block_ratio="geomean", **kw))
    ls, gs, _ = run("gspo", x.logp, x.old, x.adv, x.mask,
                    cfg("gspo", aggregation="seq-mean-token-mean", beta=0.0, **kw))
    assert_close(lm, ls)
    assert_close(gm, gs)
    lr, n = tepo.block_log_ratio(x.logp, x.old, x.mask, 8, "joint")
    assert lr.shape == (5, 1) and n.shape == (5, 1)
    exp_lr = [sum(float(x.logp[i, t] - x.old[i, t]) for t in range(L)) for i, L in enumerate(x.lengths)]
    assert_close(lr[:, 0], torch.tensor(exp_lr, dtype=F64))
    _, gj, _ = run("mpo", x.logp, x.old, x.adv, x.mask,
                   mpo_cfg(block_size=8, block_ratio="joint", eps_low=0.99, eps_high=100.0))
    exp = torch.zeros_like(gj)
    for i, t in valid_tokens(x.mask):
        exp[i, t] = -float(x.adv[i]) * math.exp(exp_lr[i]) / 5
    assert_close(gj, exp)


@HYP
@given(lengths=st.lists(st.integers(0, 11), min_size=1, max_size=5), K=st.integers(1, 5),
       extra=st.integers(0, 3))
def test_block_counts_cover_each_response_exactly(lengths, K, extra):
    """Property 26: J_i = ceil(L_i/K), last block L_i-(J_i-1)K in [1,K], counts sum to L_i."""
    T = max(lengths) + extra
    if T == 0:
        T = 1
    mask = lengths_mask(lengths, T)
    z = torch.zeros(len(lengths), T, dtype=F64)
    lr, n = tepo.block_log_ratio(z, z, mask, K)
    assert n.shape == (len(lengths), math.ceil(T / K)) and lr.shape == n.shape
    for i, L in enumerate(lengths):
        counts = [int(v) for v in n[i].tolist() if v > 0]
        J = math.ceil(L / K)
        assert len(counts) == J
        assert sum(counts) == L
        if J:
            assert counts[:-1] == [K] * (J - 1)
            assert counts[-1] == L - (J - 1) * K and 1 <= counts[-1] <= K


def test_joint_block_log_ratio_sums_deltas_with_rho_gradient_and_is_permutation_invariant():
    """Property 27: log rho_ij = sum_{t in block} delta; d rho_ij/d logp_t = rho_ij;
    permuting tokens inside a block leaves rho unchanged. geomean = block mean."""
    x = make_inputs(B=3, T=7, lengths=[7, 5, 3], seed=27, noise=0.3)
    K = 3
    lp = x.logp.clone().requires_grad_(True)
    lr, n = tepo.block_log_ratio(lp, x.old, x.mask, K, "joint")
    rho = lr.exp()
    for i, L in enumerate(x.lengths):
        for j in range(math.ceil(7 / K)):
            ts = [t for t in range(j * K, min((j + 1) * K, L))]
            exp = sum(float(x.logp[i, t] - x.old[i, t]) for t in ts)
            assert_close(lr[i, j], exp)
            if ts:
                gr, = torch.autograd.grad(rho[i, j], lp, retain_graph=True)
                e = torch.zeros_like(gr)
                for t in ts:
                    e[i, t] = math.exp(exp)
                assert_close(gr, e)
    perm = torch.tensor([2, 0, 1, 5, 3, 4, 6])
    lr_p, _ = tepo.block_log_ratio(x.logp[:1, perm], x.old[:1, perm], x.mask[:1], K, "joint")
    assert_close(lr_p, lr[:1].detach())
    lg, _ = tepo.block_log_ratio(x.logp, x.old, x.mask, K, "geomean")
    assert_close(lg[n > 0], (lr.detach() / n.clamp(min=1))[n > 0])


def test_mpo_gradient_at_ratio_one_joint_scales_by_blocks_and_geomean_equals_grpo():
    """Property 28: ratio 1, joint + seq-mean-block-mean: grad = -(1/G) A_i / J_i;
    geomean with K | L_i equals GRPO."""
    x = make_inputs(B=4, T=8, lengths=[8, 3, 5, 1], seed=28)
    K = 2
    _, g, _ = run("mpo", x.logp, x.logp.clone(), x.adv, x.mask, mpo_cfg(block_size=K))
    exp = torch.zeros_like(g)
    for i, t in valid_tokens(x.mask):
        exp[i, t] = -float(x.adv[i]) / (4 * math.ceil(x.lengths[i] / K))
    assert_close(g, exp)
    y = make_inputs(B=4, T=8, lengths=[8, 2, 4, 6], seed=29)
    _, gm, _ = run("mpo", y.logp, y.logp.clone(), y.adv, y.mask, mpo_cfg(block_size=K, block_ratio="geomean"))
    _, gg, _ = run("grpo", y.logp, y.logp.clone(), y.adv, y.mask,
                   cfg("grpo", aggregation="seq-mean-token-mean", beta=0.0, dual_clip_c=None))
    assert_close(gm, gg)


def test_mpo_block_is_clipped_as_a_unit_and_other_blocks_are_unaffected():
    """Property 29: a block outside the band (direction of A) gets zero gradient on all its
    tokens; the other blocks keep -(1/B) A rho / J."""
    eps = 0.05
    mask = torch.ones(2, 8, dtype=F64)
    old = torch.full((2, 8), -1.0, dtype=F64)
    delta = torch.zeros(2, 8, dtype=F64)
    delta[0, 0] = 0.1      # row 0 (A>0): block 0 rho = e^0.1 > 1.05 -> clipped
    delta[1, 4] = -0.2     # row 1 (A<0): block 1 rho = e^-0.2 < 0.95 -> clipped
    delta[0, 5] = -0.3     # row 0 block 1: A>0, rho < 1-eps -> NOT clipped
    adv = torch.tensor([1.5, -0.8], dtype=F64)
    _, g, _ = run("mpo", old + delta, old, adv, mask, mpo_cfg(block_size=4, eps_low=eps, eps_high=eps))
    assert torch.all(g[0, :4] == 0) and torch.all(g[1, 4:] == 0)
    assert_close(g[0, 4:], torch.full((4,), -1.5 * math.exp(-0.3) / (2 * 2), dtype=F64))
    assert_close(g[1, :4], torch.full((4,), 0.8 / (2 * 2), dtype=F64))


# =============================================================================
# 7b. CISPO, GMPO, SAPO against the peers' published formulas (properties 50-55)
# =============================================================================
# Each reference below is written here from verl 0.9.1's core_algos.py (compute_policy_loss_cispo / _sapo /
# _geo_mean) or TRL 1.16 (GRPOTrainer's cispo branch, trl.experimental.gmpo), in their own shapes: per-token
# advantages A_i * mask, masks multiplied in, their clamps and denominators. Neither package is imported.

def peer_batch(seed, B=8, T=7):
    """Random float64 inputs with padding, two empty rows, a zero advantage and log-ratios up to ~1 in size."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = lengths[5] = 0
    mask = lengths_mask(lengths, T)
    old = -(torch.rand(B, T, generator=g, dtype=F64) * 2 + 0.05)
    logp = old + 0.4 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[3] = 0.0
    return logp, old, adv, mask


def loss_and_grad(fn, logp, *args):
    lp = logp.detach().clone().requires_grad_(True)
    loss = fn(lp, *args)
    return loss.detach(), torch.autograd.grad(loss, lp)[0]


def verl_cispo(logp, old, adv, mask, eps_low, eps_high):
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    pg_losses = -torch.clamp(ratio, 1 - eps_low, 1 + eps_high).detach() * (adv[:, None] * mask) * logp
    return (pg_losses * mask).sum() / mask.sum()                                 # agg_loss token-mean


def trl_cispo(logp, old, adv, mask, eps_high):
    per_token_loss = -torch.clamp(torch.exp(logp - old), max=eps_high).detach() * adv[:, None] * logp
    return (per_token_loss * mask).sum() / mask.sum()                            # num_items_in_batch


def verl_sapo(logp, old, adv, mask, tau_pos, tau_neg):
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    advantages = adv[:, None] * mask
    taus = torch.where(advantages > 0, torch.tensor(tau_pos, dtype=F64), torch.tensor(tau_neg, dtype=F64))
    pg_losses = -torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus) * advantages
    seq_losses = (pg_losses * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    return seq_losses.sum() / logp.shape[0]                     # seq-mean-token-mean over the global batch size


def verl_geo_mean(logp, old, adv, mask, eps_low, eps_high):
    l, advantages = logp - old, adv[:, None] * mask
    sgn = torch.sign(advantages)
    m = sgn * torch.min(sgn * l, sgn * torch.clamp(l, -eps_low, eps_high))
    ratio = torch.exp((m * mask).sum(-1) / (mask.sum(-1) + 1e-8))
    advantage = (advantages * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    return torch.mean(-advantage * ratio)


def trl_gmpo(logp, old, adv, mask, eps_low, eps_high):
    l = logp - old
    clamped = torch.clamp(l, min=-eps_low, max=eps_high)
    m = torch.where(adv[:, None] > 0, torch.minimum(l, clamped), torch.maximum(l, clamped))
    coef = torch.exp((m * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))
    return (-coef * adv).mean()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", ["cispo-verl", "cispo-trl-cap", "sapo-verl", "sapo-taus", "gmpo-verl", "gmpo-trl"])
def test_new_objectives_equal_the_peers_formulas_in_value_and_gradient(case, seed):
    """Properties 50-52: on random float64 batches with padding, empty rows and a zero advantage, CISPO (verl's clip;
    TRL's cap), SAPO (verl) and GMPO (verl, TRL) equal the peers' formulas to 1e-6 in loss and gradient. GMPO and
    SAPO are given num_seqs = B, as the peers divide by every row (train_small.py passes it)."""
    logp, old, adv, mask = peer_batch(seed)
    name, ov, reference = {
        "cispo-verl": ("cispo", dict(eps_low=0.2, eps_high=0.2), lambda lp: verl_cispo(lp, old, adv, mask, 0.2, 0.2)),
        "cispo-trl-cap": ("cispo", dict(cispo_weight="cap", eps_high=1.1),
                          lambda lp: trl_cispo(lp, old, adv, mask, 1.1)),
        "sapo-verl": ("sapo", {}, lambda lp: verl_sapo(lp, old, adv, mask, 1.0, 1.05)),
        "sapo-taus": ("sapo", dict(sapo_tau_pos=0.5, sapo_tau_neg=3.0),
                      lambda lp: verl_sapo(lp, old, adv, mask, 0.5, 3.0)),
        "gmpo-verl": ("gmpo", dict(eps_low=0.2, eps_high=0.2), lambda lp: verl_geo_mean(lp, old, adv, mask, 0.2, 0.2)),
        # TRL's GMPO gives a row with no token the loss -A_i (R_i = e^0); TRL never makes one (a completion holds its
        # end token), so its reference sees those rows with A = 0
        "gmpo-trl": ("gmpo", {}, lambda lp: trl_gmpo(lp, old, adv * (mask.sum(-1) > 0), mask, 0.4, 0.4)),
    }[case]
    loss, grad, _ = run(name, logp, old, adv, mask, cfg(name, **ov), num_seqs=logp.shape[0])
    ref_loss, ref_grad = loss_and_grad(reference, logp)
    assert_close(loss, ref_loss, atol=1e-9, rtol=1e-6)
    assert_close(grad, ref_grad, atol=1e-9, rtol=1e-6)
    assert grad[mask == 0].abs().max() == 0 and grad.abs().max() > 1e-3


def test_cispo_gradient_is_the_clipped_weight_times_the_policy_gradient_and_never_zero():
    """Property 53: CISPO's gradient is -w A / N at each valid token, w = clip(r, 1 - eps_low, 1 + eps_high) (cap:
    min(r, eps_high)), not zero where PPO-clip's is; at ratio 1 it equals PPO-clip's (DAPO's) exactly."""
    logp, old, adv, mask = peer_batch(7)
    A, N, r = adv[:, None].expand_as(logp), mask.sum(), torch.exp(logp - old)
    for ov, w in ((dict(eps_low=0.2, eps_high=0.2), r.clamp(0.8, 1.2)), (dict(cispo_weight="cap", eps_high=1.1),
                                                                          r.clamp(max=1.1))):
        _, g, m = run("cispo", logp, old, adv, mask, cfg("cispo", **ov))
        assert_close(g, -w * A * mask / N)
        assert m["clip_ratio/region_mean"] > 0
    _, g_ppo, _ = run("dapo", logp, old, adv, mask, cfg("dapo", eps_low=0.2, eps_high=0.2))
    clipped = (g_ppo == 0) & (mask > 0) & (A != 0)
    assert clipped.any() and (g[clipped] != 0).all()            # PPO-clip dropped them, CISPO keeps them
    _, g_on, _ = run("cispo", logp, logp.clone(), adv, mask, cfg("cispo"))
    _, g_dapo, _ = run("dapo", logp, logp.clone(), adv, mask, cfg("dapo"))
    assert_close(g_on, g_dapo)
    assert_close(g_on, -A * mask / N)


def test_sapo_gate_gradient_closed_form_and_its_shape_in_r_and_tau():
    """Property 54: SAPO's gradient is -A w(r) / (B' |o_i|), w = 4 r s (1 - s), s = sigmoid(tau (r - 1)), tau_pos
    where A > 0 and tau_neg where A <= 0; at r = 1 it is -A / (B' |o_i|) for any tau and the loss is the mean of
    -2 A / tau; w > 0 for every r > 0, and for fixed r != 1 it falls as tau grows."""
    logp, old, adv, mask = peer_batch(8)
    n_rows, lengths, A = (mask.sum(-1) > 0).sum(), mask.sum(-1, keepdim=True).clamp(min=1), adv[:, None]
    for tau_pos, tau_neg in ((1.0, 1.05), (0.3, 4.0)):
        c = cfg("sapo", sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
        tau = torch.where(A > 0, torch.tensor(tau_pos, dtype=F64), torch.tensor(tau_neg, dtype=F64))
        r = torch.exp(logp - old)
        s = torch.sigmoid(tau * (r - 1))
        _, g, m = run("sapo", logp, old, adv, mask, c)
        assert_close(g, -A * 4 * r * s * (1 - s) * mask / (lengths * n_rows))
        assert math.isclose(m["sapo/weight_mean"], float((4 * r * s * (1 - s) * mask).sum() / mask.sum()), rel_tol=1e-9)
        assert m["clip_ratio/region_mean"] == 0
        loss_on, g_on, m_on = run("sapo", logp, logp.clone(), adv, mask, c)
        assert_close(g_on, -A * mask / (lengths * n_rows))
        assert_close(loss_on, ((-2 * A / tau) * (mask.sum(-1, keepdim=True) > 0)).sum() / n_rows)
        assert m_on["sapo/weight_mean"] == pytest.approx(1.0, abs=1e-15)

    def weight(r, tau):   # d(-f(r) A)/d log pi at A = -1: the factor w(r), by autograd on one token
        lp = torch.tensor([[math.log(r)]], dtype=F64, requires_grad=True)
        loss, _ = tepo.sapo_loss(lp, torch.zeros(1, 1, dtype=F64), torch.tensor([-1.0], dtype=F64),
                                 torch.ones(1, 1), cfg("sapo", sapo_tau_neg=tau))
        return torch.autograd.grad(loss, lp)[0].item()
    for r in (0.05, 0.5, 0.9, 1.2, 3.0, 6.0):        # tau (r - 1) <= 20: the sigmoid does not round to 1
        ws = [weight(r, tau) for tau in (0.25, 1.0, 2.0, 4.0)]
        assert all(w > 0 for w in ws) and all(a > b for a, b in zip(ws, ws[1:])), (r, ws)
    assert [weight(1.0, tau) for tau in (0.25, 8.0)] == pytest.approx([1.0, 1.0], abs=1e-15)


def test_gmpo_gradient_is_grpos_at_ratio_one_and_a_clipped_token_adds_its_bound_with_zero_gradient():
    """Property 55: at every l = 0, GMPO's gradient is -A_i / (B |o_i|), GRPO's with seq-mean-token-mean; with A > 0,
    eps_high = 0.2 and l_k = 0.5, token k has zero gradient and adds 0.2 to the exponent, and the other tokens of its
    row share one gradient -A R / (B |o|); with A < 0 the same l_k is not clipped (the clip acts against A)."""
    logp, _, adv, mask = peer_batch(9)
    adv[3] = 0.7
    _, g, _ = run("gmpo", logp, logp.clone(), adv, mask, cfg("gmpo"))
    _, g_grpo, _ = run("grpo", logp, logp.clone(), adv, mask, cfg("grpo", beta=0.0))
    assert_close(g, g_grpo)
    assert_close(g, -adv[:, None] * mask / (mask.sum(-1, keepdim=True).clamp(min=1) * (mask.sum(-1) > 0).sum()))
    old = torch.full((2, 4), -1.0, dtype=F64)
    delta = torch.tensor([[0.5, 0.1, -0.3, 0.0]] * 2, dtype=F64)
    adv2 = torch.tensor([2.0, -2.0], dtype=F64)
    loss, g, m = run("gmpo", old + delta, old, adv2, torch.ones(2, 4), cfg("gmpo", eps_low=0.2, eps_high=0.2))
    # row 0 (A > 0): 0.5 -> 0.2 clipped, -0.3 kept (below the band is not A's direction); row 1 (A < 0): -0.3 -> -0.2
    R = torch.tensor([math.exp((0.2 + 0.1 - 0.3 + 0.0) / 4), math.exp((0.5 + 0.1 - 0.2 + 0.0) / 4)], dtype=F64)
    assert_close(loss, (-adv2 * R).mean())
    assert g[0, 0] == 0 and g[1, 2] == 0
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 8) and m["clip_ratio/low_mean"] == pytest.approx(1 / 8)
    assert_close(g[0, [1, 2, 3]], torch.full((3,), -2.0 * R[0] / (2 * 4), dtype=F64))
    assert_close(g[1, [0, 1, 3]], torch.full((3,), 2.0 * R[1] / (2 * 4), dtype=F64))


# =============================================================================
# 8. Entropy: logits helpers (properties 37, 42) and mathematics (properties 30-33)
# =============================================================================

@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_entropy_from_logits_is_full_vocabulary_entropy(temperature):
    """Property 37: entropy is -sum_v p_v log p_v over the whole vocabulary of softmax(z/T),
    not the sampled token's -log p; computed without grad."""
    g = torch.Generator().manual_seed(30)
    logits = (torch.randn(2, 3, 11, generator=g, dtype=F64) * 3).requires_grad_(True)
    H = tepo.entropy_from_logits(logits, temperature=temperature)
    assert H.shape == (2, 3) and not H.requires_grad
    exp = torch.tensor([[py_entropy(logits[b, t].tolist(), temperature) for t in range(3)]
                        for b in range(2)], dtype=F64)
    # float32-level tolerance here; float64 precision is checked by test_logits_helpers_keep_float64
    assert_close(H, exp, atol=1e-6, rtol=1e-6)
    nll = -torch.log_softmax(logits.detach() / temperature, -1).max(-1).values  # sampled-token -log p
    assert (H - nll).abs().max() > 0.1  # it is not the sampled token's -log p


def test_logits_helpers_keep_float64_precision():
    """float64 logits must give float64 results (the section-9 checks are float64 at ~1e-9);
    bf16 / fp16 may be upcast to float32."""
    g = torch.Generator().manual_seed(61)
    logits = torch.randn(2, 3, 7, generator=g, dtype=F64) * 3
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    exp_lp = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    exp_h = t_entropy(logits / 0.7)
    got_lp = tepo.token_logprobs_from_logits(logits, tokens, temperature=0.7)
    got_h = tepo.entropy_from_logits(logits, temperature=0.7)
    pred, meas = tepo.entropy_change_prediction(logits[0], logits[0] + 1e-3, temperature=0.7)
    assert (got_lp.dtype, got_h.dtype, pred.dtype, meas.dtype) == (F64,) * 4
    assert_close(got_lp, exp_lp, atol=1e-12)
    assert_close(got_h, exp_h, atol=1e-12)
    assert tepo.entropy_from_logits(logits.to(torch.bfloat16)).dtype == torch.float32


def test_entropy_from_logits_chunked_equals_unchunked():
    g = torch.Generator().manual_seed(31)
    logits = torch.randn(3, 7, 13, generator=g, dtype=F64) * 2
    full = tepo.entropy_from_logits(logits, chunk_size=10_000)
    for cs in [1, 2, 5, 8]:
        assert_close(tepo.entropy_from_logits(logits, chunk_size=cs), full, atol=1e-13)
    flat = tepo.entropy_from_logits(logits.reshape(21, 13), chunk_size=4)
    assert_close(flat, full.reshape(21), atol=1e-13)


def test_every_entropy_is_the_one_formula_of_entropy_from_logprobs():
    """Structure: entropy_from_logprobs is -sum_v p_v log p_v (checked by hand here), and softmax_entropy,
    entropy_from_logits, the entropy bonus and the measured change of entropy_change_prediction give
    exactly its values."""
    g = torch.Generator().manual_seed(32)
    logits = torch.randn(2, 3, 9, generator=g, dtype=F64) * 2
    H = tepo.entropy_from_logprobs(torch.log_softmax(logits / 0.7, -1))
    exp = torch.tensor([[py_entropy(logits[b, t].tolist(), 0.7) for t in range(3)] for b in range(2)], dtype=F64)
    assert_close(H, exp, atol=1e-12)
    assert torch.equal(tepo.softmax_entropy(logits / 0.7), H)
    assert torch.equal(tepo.entropy_from_logits(logits, temperature=0.7, chunk_size=2), H)
    bonus = tepo.entropy_bonus(logits, torch.ones(2, 3), tepo.ObjectiveConfig(entropy_coef=1.0), temperature=0.7)
    assert torch.equal(bonus, -H.mean())
    _, measured = tepo.entropy_change_prediction(torch.zeros_like(logits), logits, temperature=0.7)
    assert torch.equal(measured, H - tepo.softmax_entropy(torch.zeros_like(logits)))      # H(uniform) = log 9


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.5])
def test_token_logprobs_from_logits_use_the_sampling_temperature(temperature):
    """Property 42: log-probs at temperature T are log_softmax(logits / T) gathered."""
    g = torch.Generator().manual_seed(32)
    logits = torch.randn(2, 4, 9, generator=g, dtype=F64) * 3
    tokens = torch.randint(0, 9, (2, 4), generator=g)
    got = tepo.token_logprobs_from_logits(logits, tokens, temperature=temperature)
    exp = torch.zeros(2, 4, dtype=F64)
    for b in range(2):
        for t in range(4):
            zs = [float(v) / temperature for v in logits[b, t]]
            m = max(zs)
            exp[b, t] = zs[int(tokens[b, t])] - (m + math.log(sum(math.exp(v - m) for v in zs)))
    assert_close(got, exp, atol=2e-6, rtol=1e-6)  # float64 precision: test_logits_helpers_keep_float64
    if temperature != 1.0:  # untempered log-probs (property 42) are far off
        assert (tepo.token_logprobs_from_logits(logits, tokens) - exp).abs().max() > 0.1
    lg = logits.clone().requires_grad_(True)
    assert tepo.token_logprobs_from_logits(lg, tokens, temperature=temperature).requires_grad


def test_softmax_entropy_gradient_jacobian_and_fisher_closed_forms():
    """1.6 steps 1-3: dH/dz_b = -p_b(log p_b - E log p); d log p_a/d z_b = 1[a=b] - p_b;
    F = diag(p) - p p^T = E_p[grad log p grad log p^T]."""
    g = torch.Generator().manual_seed(33)
    z = torch.randn(7, generator=g, dtype=F64) * 2
    p = torch.softmax(z, -1)
    lp = torch.log_softmax(z, -1)
    assert_close(tepo.softmax_entropy(z), py_entropy(z.tolist()), atol=1e-12)
    eg = -p * (lp - (p * lp).sum())
    zz = z.clone().requires_grad_(True)
    auto, = torch.autograd.grad(t_entropy(zz), zz)
    assert_close(tepo.entropy_grad_wrt_logits(z), eg)
    assert_close(eg, auto)
    J = tepo.softmax_log_jacobian(z)
    assert_close(J, torch.eye(7, dtype=F64) - p[None, :])
    assert_close(J, torch.autograd.functional.jacobian(lambda v: torch.log_softmax(v, -1), z))
    F = tepo.fisher_matrix(z)
    assert_close(F, torch.diag(p) - torch.outer(p, p))
    assert_close(F, J.T @ torch.diag(p) @ J)


@HYP
@given(seed=st.integers(0, 10_000), V=st.integers(2, 40), scale=st.floats(0.1, 5.0))
def test_entropy_directional_derivative_is_exactly_minus_cov_logp_direction(seed, V, scale):
    """Property 30: d/dt H(softmax(z+tu))|0 = -Cov_p(log p, u), checked by central differences."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g, dtype=F64) * scale
    u = torch.randn(V, generator=g, dtype=F64)
    p, lp = torch.softmax(z, -1), torch.log_softmax(z, -1)
    h = 1e-5
    fd = (py_entropy((z + h * u).tolist()) - py_entropy((z - h * u).tolist())) / (2 * h)
    exact = -float(cov_p(p, lp, u))
    assert abs(fd - exact) < 1e-9 * max(1.0, abs(exact)) + 1e-9
    assert abs(float(tepo.first_order_entropy_change(z, u)) - exact) < 1e-12


def test_natural_gradient_step_is_eta_A_and_entropy_change_is_minus_eta_cov():
    """Property 31: F^+ (p (A - E_p A)) - A is constant, NPG step = eta A (up to a constant),
    Delta H = -eta Cov(log p, A) + O(eta^2)."""
    g = torch.Generator().manual_seed(34)
    z = torch.randn(9, generator=g, dtype=F64) * 1.5
    A = torch.randn(9, generator=g, dtype=F64) + 2.0
    p, lp = torch.softmax(z, -1), torch.log_softmax(z, -1)
    F = tepo.fisher_matrix(z)
    d = torch.linalg.pinv(F) @ (p * (A - (p * A).sum())) - A
    assert float(d.max() - d.min()) < 1e-9
    errs = []
    for eta in [1e-2, 1e-3]:
        z1 = tepo.natural_gradient_step(z, A, eta)
        assert_close(torch.softmax(z1, -1), torch.softmax(z + eta * A, -1))
        dH = py_entropy(z1.tolist()) - py_entropy(z.tolist())
        pred = -eta * float(cov_p(p, lp, A))
        errs.append(abs(dH - pred))
        assert abs(dH - pred) < 0.05 * abs(pred)
    assert 30 < errs[0] / errs[1] < 300  # second-order error
    assert_close(torch.softmax(tepo.natural_gradient_step(z, A + 7.0, 1e-2), -1),
                 torch.softmax(tepo.natural_gradient_step(z, A, 1e-2), -1))


def test_policy_gradient_entropy_change_uses_centred_advantage():
    """Property 32: PG step u = eta p (A - E_p A); Delta H ~ -eta Cov(log p, p(A - Abar));
    with uncentred A the form -eta Cov(log p, p A) is wrong."""
    g = torch.Generator().manual_seed(35)
    z = torch.randn(9, generator=g, dtype=F64) * 1.5
    A = torch.randn(9, generator=g, dtype=F64) + 5.0
    p, lp = torch.softmax(z, -1), torch.log_softmax(z, -1)
    eta = 1e-3
    z1 = tepo.policy_gradient_step(z, A, eta)
    u = eta * p * (A - (p * A).sum())
    assert_close(torch.softmax(z1, -1), torch.softmax(z + u, -1))
    dH = py_entropy(z1.tolist()) - py_entropy(z.tolist())
    centred = -eta * float(cov_p(p, lp, p * (A - (p * A).sum())))
    uncentred = -eta * float(cov_p(p, lp, p * A))
    assert abs(dH - centred) < 0.02 * abs(centred)
    assert abs(dH - uncentred) > 0.5 * abs(centred)
    assert_close(torch.softmax(tepo.policy_gradient_step(z, A + 3.0, eta), -1), torch.softmax(z1, -1))


def test_npg_entropy_sign_decreases_for_A_increasing_in_logp_and_increases_otherwise():
    """Property 33: A = log p -> entropy decreases; A = -log p -> entropy increases."""
    g = torch.Generator().manual_seed(36)
    z = torch.randn(8, generator=g, dtype=F64) * 2
    lp = torch.log_softmax(z, -1)
    H0 = py_entropy(z.tolist())
    assert py_entropy(tepo.natural_gradient_step(z, lp, 0.1).tolist()) < H0
    assert py_entropy(tepo.natural_gradient_step(z, -lp, 0.1).tolist()) > H0
    assert float(tepo.first_order_entropy_change(z, lp)) < 0 < float(tepo.first_order_entropy_change(z, -lp))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_change_prediction_is_minus_cov_and_matches_measured_for_small_steps(temperature):
    """entropy_change_prediction: predicted = -Cov_p(log p, dz/T) exactly, measured = H1 - H0,
    and predicted/measured -> 1 as the step -> 0."""
    g = torch.Generator().manual_seed(37)
    before = torch.randn(5, 10, generator=g, dtype=F64) * 2
    direction = torch.randn(5, 10, generator=g, dtype=F64)
    prev_err = None
    for step in [1e-2, 1e-3, 1e-4]:
        after = before + step * direction
        pred, meas = tepo.entropy_change_prediction(before, after, temperature=temperature)
        assert pred.shape == (5,) and meas.shape == (5,)
        for n in range(5):
            zt = before[n] / temperature
            p, lp = torch.softmax(zt, -1), torch.log_softmax(zt, -1)
            assert_close(pred[n], -cov_p(p, lp, step * direction[n] / temperature), atol=1e-14)
            expected = py_entropy(after[n].tolist(), temperature) - py_entropy(before[n].tolist(), temperature)
            assert_close(meas[n], expected, atol=1e-13)
        err = float(((pred - meas) / meas).abs().max())
        if prev_err is not None:
            assert err < prev_err / 5
        prev_err = err
    assert prev_err < 1e-3


# =============================================================================
# 9. Clip-Cov / KL-Cov (properties 34, 35)
# =============================================================================

def test_token_covariance_matches_loop_and_is_detached():
    x = make_inputs(B=5, T=6, lengths=[6, 1, 0, 4, 3], seed=38)
    lp = x.logp.clone().requires_grad_(True)
    cov = tepo.token_covariance(lp, x.adv, x.mask)
    assert not cov.requires_grad
    assert_close(cov, ref_cov(x.logp, x.adv, x.mask))
    assert torch.all(cov[x.mask == 0] == 0)


def cov_inputs(seed=39, noise=0.0):
    x = make_inputs(B=4, T=8, lengths=[8, 8, 6, 7], seed=seed, noise=noise)
    x.adv = torch.tensor([1.5, 0.5, -0.5, -1.5], dtype=F64)
    return x


def clip_cov_cfg(**kw):
    base = dict(eps_low=0.2, eps_high=0.2, beta=0.0, aggregation="token-mean", clip_cov_lb=0.05,
                clip_cov_ub=100.0, clip_cov_ratio=2e-4, dual_clip_c=None)
    base.update(kw)
    return cfg("clip_cov", **base)


def vanilla_grad(x, old, el=0.2, eh=0.2):
    N = float(x.mask.sum())
    exp = torch.zeros(x.B, x.T, dtype=F64)
    for i, t in valid_tokens(x.mask):
        A, r = float(x.adv[i]), math.exp(float(x.logp[i, t] - old[i, t]))
        if not is_clipped(A, r, el, eh):
            exp[i, t] = -A * r / N
    return exp


@pytest.mark.parametrize("ratio_mult", [1e-6, 3.5, 29.0])
def test_clip_cov_selects_min_of_clip_num_and_candidates_and_zeroes_only_their_gradient(ratio_mult):
    """Property 34: n = min(max(1, int(ratio N)), #candidates) tokens, all candidates
    (lb < Cov < ub, valid), get exactly zero gradient; all others equal vanilla PPO."""
    x = cov_inputs()
    N = float(x.mask.sum())
    cov = ref_cov(x.logp, x.adv, x.mask)
    cand = (cov > 0.05) & (cov < 100.0) & (x.mask > 0)
    n_cand = int(cand.sum())
    ratio = ratio_mult / N
    n_exp = min(max(1, int(ratio * N)), n_cand)
    assert 3 < n_cand < N
    torch.manual_seed(0)
    _, g, m = run("clip_cov", x.logp, x.logp.clone(), x.adv, x.mask, clip_cov_cfg(clip_cov_ratio=ratio))
    van = vanilla_grad(x, x.logp)
    selected = (g == 0) & (van != 0)
    assert int(selected.sum()) == n_exp
    assert torch.all(cand[selected])
    assert_close(g[~selected], van[~selected])
    assert m["cov/n_selected"] == float(n_exp)


def test_clip_cov_at_ratio_0_selects_nothing_and_is_vanilla_ppo():
    """Property 34, the control: clip_cov_ratio = 0 selects no token (verl's max(1, ...) would select one), so
    Clip-Cov switched off is PPO's clipped surrogate with Clip-Cov's settings, gradient included."""
    x = cov_inputs()
    _, g, m = run("clip_cov", x.logp, x.logp.clone(), x.adv, x.mask, clip_cov_cfg(clip_cov_ratio=0.0))
    assert m["cov/n_selected"] == 0.0
    assert_close(g, vanilla_grad(x, x.logp))


def test_clip_cov_excludes_tokens_already_clipped_by_ppo_from_candidates():
    """Property 34: PPO-clipped tokens are not candidates (n_selected counts only unclipped ones)."""
    x = cov_inputs(seed=40, noise=0.3)
    cov = ref_cov(x.logp, x.adv, x.mask)
    clipped = torch.zeros_like(x.mask, dtype=torch.bool)
    for i, t in valid_tokens(x.mask):
        clipped[i, t] = is_clipped(float(x.adv[i]), math.exp(float(x.logp[i, t] - x.old[i, t])), 0.2, 0.2)
    cand_all = (cov > 0.05) & (cov < 100.0) & (x.mask > 0)
    cand = cand_all & ~clipped
    assert (cand_all & clipped).any() and cand.any()
    torch.manual_seed(0)
    _, g, m = run("clip_cov", x.logp, x.old, x.adv, x.mask, clip_cov_cfg(clip_cov_ratio=1.0))
    assert m["cov/n_selected"] == float(int(cand.sum()))
    exp = vanilla_grad(x, x.old)
    exp[cand] = 0.0
    assert_close(g, exp)


def test_clip_cov_selection_is_deterministic_under_a_seed_and_random_across_seeds():
    """Property 34: same torch.manual_seed -> same selection; the draw is random among candidates."""
    x = cov_inputs(seed=41)
    c = clip_cov_cfg(clip_cov_ratio=3.5 / float(x.mask.sum()))
    grads = []
    for seed in [0, 0, 1, 2, 3, 4, 5]:
        torch.manual_seed(seed)
        grads.append(run("clip_cov", x.logp, x.logp.clone(), x.adv, x.mask, c)[1])
    assert torch.equal(grads[0], grads[1])
    patterns = {tuple((gr == 0).flatten().tolist()) for gr in grads}
    assert len(patterns) > 1


def test_kl_cov_at_ratio_one_equals_unclipped_policy_gradient():
    """Property 35: at ratio 1 KL-Cov value and gradient are those of -A r (token-mean)."""
    x = cov_inputs(seed=42)
    c = cfg("kl_cov", beta=1.0, kl_cov_ratio=0.2, aggregation="token-mean", eps_low=0.2, eps_high=0.2)
    loss, g, m = run("kl_cov", x.logp, x.logp.clone(), x.adv, x.mask, c)
    N = float(x.mask.sum())
    exp = torch.zeros_like(g)
    for i, t in valid_tokens(x.mask):
        exp[i, t] = -float(x.adv[i]) / N
    assert_close(g, exp)
    assert_close(loss, float(exp.sum()))
    assert m["cov/n_selected"] == float(max(1, int(0.2 * N)))


def test_kl_cov_off_policy_penalises_top_k_covariance_tokens_with_beta_sign_delta():
    """Property 35: top-k (k = max(1, int(N ratio))) tokens by Cov get -A r + beta |delta|;
    the rest -A r, never clipped. Gradient difference = beta sign(delta) / N on the top-k."""
    x = cov_inputs(seed=43, noise=0.4)
    beta = 0.8
    N = float(x.mask.sum())
    ratio = 0.15
    k = max(1, int(N * ratio))
    c = cfg("kl_cov", beta=beta, kl_cov_ratio=ratio, aggregation="token-mean", eps_low=0.2, eps_high=0.2)
    loss, g, m = run("kl_cov", x.logp, x.old, x.adv, x.mask, c)
    cov = ref_cov(x.logp, x.adv, x.mask)
    vt = valid_tokens(x.mask)
    top = sorted(vt, key=lambda it: float(cov[it]), reverse=True)[:k]
    exp = torch.zeros_like(g)
    val = 0.0
    n_would_clip = 0
    for i, t in vt:
        A, d = float(x.adv[i]), float(x.logp[i, t] - x.old[i, t])
        n_would_clip += is_clipped(A, math.exp(d), 0.2, 0.2)
        exp[i, t] = -A * math.exp(d) / N
        val += -A * math.exp(d) / N
        if (i, t) in top:
            exp[i, t] += beta * math.copysign(1.0, d) / N
            val += beta * abs(d) / N
    assert n_would_clip > 0
    assert_close(g, exp)
    assert_close(loss, val)
    assert m["cov/n_selected"] == float(k)


# =============================================================================
# 10. Cross-method sanity (property 36)
# =============================================================================

def test_all_group_objectives_share_the_gradient_at_ratio_one_with_equal_lengths():
    """Property 36: ratio 1, equal lengths: GRPO, GSPO, GSPO-token, DAPO, TEPO (empty mask at
    ratio 1), MPO (K=1), CISPO, GMPO and SAPO give the same gradient -A_i/(G L); Dr. GRPO's is that times
    (std_g + eps)."""
    B, T, G = 8, 6, 4
    g = torch.Generator().manual_seed(44)
    rewards = torch.tensor([1, 0, 0, 1, 0, 1, 1, 1], dtype=F64) + 0.1 * torch.rand(B, generator=g, dtype=F64)
    A = ref_group_adv(rewards, G)
    A_dr = ref_group_adv(rewards, G, scale="none")
    x = make_inputs(B=B, T=T, lengths=[T] * B, seed=45)
    exp = -A[:, None].expand(B, T) / (B * T)
    kw = dict(beta=0.0)
    cases = [("grpo", cfg("grpo", aggregation="seq-mean-token-mean", **kw)),
             ("gspo", cfg("gspo", aggregation="seq-mean-token-mean", **kw)),
             ("gspo_token", cfg("gspo_token", aggregation="seq-mean-token-mean", **kw)),
             ("dapo", cfg("dapo", aggregation="token-mean", **kw)),
             ("tepo", tepo_cfg(beta=1.0, eps_low=3e-4, eps_high=4e-4)),
             ("mpo", mpo_cfg(block_size=1)),
             ("cispo", cfg("cispo")), ("gmpo", cfg("gmpo")), ("sapo", cfg("sapo"))]
    for name, c in cases:
        _, gr, _ = run(name, x.logp, x.logp.clone(), A, x.mask, c, ref_logp=x.ref)
        assert_close(gr, exp, msg=name)
    _, gd, _ = run("dr_grpo", x.logp, x.logp.clone(), A_dr, x.mask,
                   cfg("dr_grpo", aggregation="seq-mean-token-sum-norm", norm_constant=None, **kw))
    stds = torch.tensor([statistics.stdev(rewards[k:k + G].tolist()) for k in range(0, B, G)], dtype=F64)
    assert_close(gd, exp * (stds.repeat_interleave(G) + 1e-6)[:, None])


# =============================================================================
# 11. Robustness: padding, empty rows, extreme ratios, bf16, metrics (properties 39, 43, 44)
# =============================================================================

@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000))
def test_padding_never_changes_loss_gradient_or_metrics(name, ov, B, T, seed):
    """Property 2 for every objective: perturbing logp/old_logp/ref_logp/entropies where
    mask=0 leaves loss, gradient and every metric identical; padding gradient is 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g).tolist()
    lengths[0] = max(lengths[0], 1)
    x = make_inputs(B=B, T=T, lengths=lengths, seed=seed, noise=0.3)
    c = cfg(name, **ov)
    pad = x.mask == 0

    def perturb(v, s):
        return torch.where(pad, v + s * torch.randn(B, T, generator=g, dtype=F64), v)

    y = SimpleNamespace(**vars(x))
    y.logp, y.old, y.ref = perturb(x.logp, 1e4), perturb(x.old, 50.0), perturb(x.ref, 1e3)
    y.ent, y.old_ent = perturb(x.ent, 10.0).abs(), perturb(x.old_ent, 10.0).abs()
    torch.manual_seed(0)
    l0, g0, m0 = run_x(name, x, c)
    torch.manual_seed(0)
    l1, g1, m1 = run_x(name, y, c)
    assert_close(l1, l0, atol=1e-12)
    assert_close(g1, g0, atol=1e-14)
    assert torch.all(g0[pad] == 0)
    assert set(m0) == set(m1)
    for k in m0:
        assert math.isclose(m0[k], m1[k], rel_tol=1e-9, abs_tol=1e-12), (k, m0[k], m1[k])


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
def test_nonfinite_values_at_padding_do_not_leak_into_loss_gradient_or_metrics(name, ov):
    """Property 43: NaN / -inf log-probs at masked positions (e.g. pad tokens) must not
    reach the loss, gradients or metrics through multiply-by-mask."""
    x = make_inputs(B=4, T=6, lengths=[6, 3, 0, 4], seed=46, noise=0.3)
    c = cfg(name, **ov)
    pad = x.mask == 0
    y = SimpleNamespace(**vars(x))
    y.logp = torch.where(pad, torch.full_like(x.logp, float("nan")), x.logp)
    y.old = torch.where(pad, torch.full_like(x.old, float("-inf")), x.old)
    y.ref = torch.where(pad, torch.full_like(x.ref, float("nan")), x.ref)
    y.ent = torch.where(pad, torch.full_like(x.ent, float("nan")), x.ent)
    torch.manual_seed(0)
    l0, g0, m0 = run_x(name, x, c)
    torch.manual_seed(0)
    l1, g1, m1 = run_x(name, y, c)
    assert torch.isfinite(l1) and torch.isfinite(g1).all()
    all_finite_metrics(m1)
    assert_close(l1, l0, atol=1e-12)
    assert_close(g1, g0, atol=1e-14)


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
def test_fully_masked_rows_and_batches_give_finite_zeros(name, ov):
    """Empty rows get zero gradient; an all-padding batch gives loss 0, zero grads, finite
    metrics, and loss.backward() still works."""
    x = make_inputs(B=4, T=5, lengths=[5, 0, 3, 0], seed=47, noise=0.3)
    c = cfg(name, **ov)
    torch.manual_seed(0)
    loss, g, m = run_x(name, x, c)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert torch.all(g[1] == 0) and torch.all(g[3] == 0)
    all_finite_metrics(m)
    z = make_inputs(B=4, T=5, lengths=[0, 0, 0, 0], seed=48, noise=0.3)
    lp = z.logp.clone().requires_grad_(True)
    torch.manual_seed(0)
    loss, m = tepo.OBJECTIVES[name](lp, z.old, z.adv, z.mask, c, ref_logp=z.ref, entropy=z.ent,
                                    old_entropy=z.old_ent)
    assert loss.item() == 0.0
    all_finite_metrics(m)
    assert loss.requires_grad, "all-padding micro-batch: loss must stay connected for backward()"
    loss.backward()
    assert torch.all(lp.grad == 0)


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
@pytest.mark.parametrize("on_policy", [True, False])
def test_groups_with_identical_rewards_give_zero_loss_and_gradient(name, ov, on_policy):
    """Property 1: identical rewards -> A = 0 -> loss 0 and zero gradient (KL to ref with
    pi = pi_ref). KL-Cov off-policy keeps its |delta| penalty on the top-k tokens whatever A is
    (verl behaviour): there only the policy-gradient part must vanish."""
    x = make_inputs(B=8, T=5, seed=49, noise=0.0 if on_policy else 0.3)
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4, dtype=F64)
    adv = tepo.group_advantages(rewards, 4)
    assert torch.all(adv == 0)
    old = x.logp.clone() if on_policy else x.old
    torch.manual_seed(0)
    loss, g, m = run_x(name, x, cfg(name, **ov), old=old, adv=adv, ref_logp=x.logp.clone())
    all_finite_metrics(m)
    if name == "kl_cov" and not on_policy:
        assert m["pg_loss"] == 0.0 and m["kl_loss"] > 0
        assert float(loss) == pytest.approx(cfg(name, **ov).beta * m["kl_loss"], rel=1e-12)
        return
    assert float(loss) == 0.0
    assert float(g.abs().max()) == 0.0


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
@pytest.mark.parametrize("big", [50.0, 1e4])
def test_extreme_log_ratios_stay_finite_in_loss_gradient_and_metrics(name, ov, big):
    x = make_inputs(B=4, T=6, lengths=[6, 5, 3, 6], seed=50)
    sign = torch.tensor([[1, -1, 1, -1, 1, -1], [1] * 6, [-1] * 6, [1, 1, -1, -1, 0, 0]], dtype=F64)
    old = x.logp - big * sign
    ref = x.logp + big * sign.flip(0)
    torch.manual_seed(0)
    loss, g, m = run_x(name, x, cfg(name, **ov), old=old, ref_logp=ref)
    assert torch.isfinite(loss), loss
    assert torch.isfinite(g).all()
    all_finite_metrics(m)


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
def test_bf16_inputs_give_finite_loss_close_to_float64(name, ov):
    x = make_inputs(B=4, T=6, lengths=[6, 5, 3, 6], seed=51, noise=0.1)
    c = cfg(name, **ov)
    bf = {k: getattr(x, k).to(torch.bfloat16) for k in ["logp", "old", "adv", "ref", "ent", "old_ent"]}
    lp = bf["logp"].clone().requires_grad_(True)
    torch.manual_seed(0)
    loss, m = tepo.OBJECTIVES[name](lp, bf["old"], bf["adv"], x.mask.bool(), c, ref_logp=bf["ref"],
                                    entropy=bf["ent"], old_entropy=bf["old_ent"])
    assert torch.isfinite(loss)
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad).all()
    all_finite_metrics(m)
    if name in ("clip_cov", "kl_cov", "tepo"):
        return  # token selection may legitimately differ after bf16 rounding
    f = {k: v.to(F64) for k, v in bf.items()}
    ref_loss, _, _ = run(name, f["logp"], f["old"], f["adv"], x.mask, c, ref_logp=f["ref"],
                         entropy=f["ent"], old_entropy=f["old_ent"])
    assert abs(loss.item() - float(ref_loss)) < 0.03 * max(1.0, abs(float(ref_loss)))


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
def test_on_policy_metric_is_one_exactly_when_old_logp_equals_logp(name, ov):
    """Property 44: 'on_policy' = 1.0 when old_logp == logp.detach() on valid tokens
    (whatever padding holds), 0.0 as soon as one valid token differs."""
    x = make_inputs(B=4, T=5, lengths=[5, 2, 4, 3], seed=52)
    c = cfg(name, **ov)
    old = x.logp.clone()
    torch.manual_seed(0)
    assert run_x(name, x, c, old=old)[2]["on_policy"] == 1.0
    old_pad = torch.where(x.mask > 0, old, old + 3.0)
    torch.manual_seed(0)
    assert run_x(name, x, c, old=old_pad)[2]["on_policy"] == 1.0
    old_off = old.clone()
    old_off[2, 1] += 1e-3
    torch.manual_seed(0)
    assert run_x(name, x, c, old=old_off)[2]["on_policy"] == 0.0


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
def test_kl_old_metrics_average_valid_tokens_only(name, ov):
    """Property 39: logged KL to old = mean over valid tokens of k1 / k3 of the log-ratio
    (never averaging padding)."""
    x = make_inputs(B=4, T=6, lengths=[6, 2, 4, 1], seed=53, noise=0.4)
    torch.manual_seed(0)
    _, _, m = run_x(name, x, cfg(name, **ov))
    vt = valid_tokens(x.mask)
    d = [float(x.logp[i, t] - x.old[i, t]) for i, t in vt]
    # KL(pi_old || pi_theta) from rollout tokens: x = old - logp = -delta (verl's ppo_kl: mean of the clamped -delta)
    assert math.isclose(m["kl_old/k1"], -sum(d) / len(d), rel_tol=1e-9)
    assert math.isclose(m["kl_old/k3"], sum(math.exp(v) - v - 1 for v in d) / len(d), rel_tol=1e-9)


@pytest.mark.parametrize("name", sorted(tepo.OBJECTIVES))
def test_the_metrics_k3_is_kl_penalty(name):
    """Structure: the metrics' k3 is kl_penalty's. kl_ref is the valid-token mean of kl_penalty(logp, ref_logp,
    "k3"), bit for bit. kl_old/k3 is kl_penalty(old_logp, logp, "k3") (x = -delta) wherever verl's clamps do not
    act, written as expm1(delta) - delta without them, for the two reasons _metrics gives: in float32 it keeps a
    KL of ~1e-8 near ratio 1 that exp(delta) - 1 loses to rounding, and it is not capped at 10."""
    x = make_inputs(B=6, T=7, seed=56, noise=0.4)
    torch.manual_seed(0)
    _, _, m = run_x(name, x, cfg(name, beta=0.1))
    mask = x.mask.bool()
    if name != "kl_cov":                                         # KL-Cov reads no reference
        assert m["kl_ref"] == tepo.masked_mean(tepo.kl_penalty(x.logp, x.ref, "k3"), mask).item()
    assert math.isclose(m["kl_old/k3"], tepo.masked_mean(tepo.kl_penalty(x.old, x.logp, "k3"), mask).item(),
                        rel_tol=1e-12)
    # float32 near ratio 1 (|delta| ~ 1e-4): within 0.1 % of the float64 value of the same float32 inputs
    noise = torch.randn(6, 7, generator=torch.Generator().manual_seed(57), dtype=F64)
    lp32, old32 = x.logp.float(), (x.logp + 1e-4 * noise).float()
    torch.manual_seed(0)
    _, _, m32 = run(name, lp32, old32, x.adv.float(), x.mask, cfg(name, beta=0.0))
    d = [float(lp32[i, t].double() - old32[i, t].double()) for i, t in valid_tokens(x.mask)]
    assert math.isclose(m32["kl_old/k3"], sum(math.expm1(v) - v for v in d) / len(d), rel_tol=1e-3)
    # a ratio that blew up (delta = 4 on every token) is logged as it is, not as kl_penalty's cap of 10
    _, _, m_big = run_x(name, x, cfg(name), old=x.logp - 4.0)
    assert math.isclose(m_big["kl_old/k3"], math.exp(4.0) - 5.0, rel_tol=1e-12)


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
def test_metrics_have_documented_keys_and_loss_metric_equals_loss(name, ov):
    x = make_inputs(B=4, T=6, seed=54, noise=0.2)
    c = cfg(name, **ov)
    torch.manual_seed(0)
    loss, _, m = run_x(name, x, c)
    keys = list(COMMON_METRICS)
    if name == "tepo":
        keys += ["kl_mask/frac", "kl_mask/penalty"]
    if name in ("clip_cov", "kl_cov"):
        keys += ["cov/n_selected"]
    if name == "sapo":
        keys += ["sapo/weight_mean"]
    if tepo.needs_ref(name, c):
        keys += ["kl_ref"]
    missing = [k for k in keys if k not in m]
    assert not missing, missing
    all_finite_metrics(m)
    assert math.isclose(m["loss"], float(loss), rel_tol=1e-12, abs_tol=1e-15)


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
def test_per_token_advantages_equal_to_per_sequence_ones_give_identical_results(name, ov):
    """advantages [B] and the same values broadcast to [B,T] (zero at padding) are equivalent;
    sequence-level objectives (GSPO, GMPO, MPO, TEPO-gmpo) refuse [B,T] with a ValueError instead."""
    x = make_inputs(B=4, T=6, seed=55, noise=0.2)
    c = cfg(name, **ov)
    if name in ("gspo", "gmpo", "mpo") or ov.get("ratio_mode") == "gmpo":
        raises_naming(lambda: run_x(name, x, c, adv=x.adv[:, None] * x.mask), r"advantages")
        return
    torch.manual_seed(0)
    l0, g0, _ = run_x(name, x, c)
    torch.manual_seed(0)
    l1, g1, _ = run_x(name, x, c, adv=x.adv[:, None] * x.mask)
    assert_close(l1, l0)
    assert_close(g1, g0)


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
def test_bool_mask_equals_float_mask(name, ov):
    x = make_inputs(B=4, T=6, seed=56, noise=0.2)
    c = cfg(name, **ov)
    torch.manual_seed(0)
    l0, g0, _ = run_x(name, x, c)
    y = SimpleNamespace(**vars(x))
    y.mask = x.mask.bool()
    torch.manual_seed(0)
    l1, g1, _ = run_x(name, y, c)
    assert_close(l1, l0)
    assert_close(g1, g0)


# =============================================================================
# 12. Gradient accumulation exactness (property 41)
# =============================================================================

@pytest.mark.parametrize("mode", MODES)
def test_aggregate_loss_micro_batches_with_global_counts_sum_to_full_batch(mode):
    """Property 41: micro-batch losses with the whole batch's counts add up to the whole batch's loss."""
    x = make_inputs(B=8, T=6, lengths=[6, 1, 3, 5, 2, 6, 4, 4], seed=57)
    l = torch.randn(8, 6, generator=torch.Generator().manual_seed(58), dtype=F64)
    full = tepo.aggregate_loss(l, x.mask, mode)
    N, S = float(x.mask.sum()), 8.0
    parts = [tepo.aggregate_loss(l[a:b], x.mask[a:b], mode, num_tokens=N, num_seqs=S)
             for a, b in [(0, 3), (3, 4), (4, 8)]]
    assert_close(sum(parts), full)


GA_CASES = [
    ("ppo", dict(aggregation="token-mean", beta=0.0)),
    ("ppo", dict(aggregation="seq-mean-token-sum", beta=0.0)),
    ("ppo", dict(aggregation="seq-mean-token-mean", beta=0.1, kl_estimator="k3")),
    ("grpo", dict(aggregation="seq-mean-token-mean", beta=0.04)),
    ("dapo", dict(aggregation="token-mean")),
    ("dr_grpo", dict(aggregation="seq-mean-token-sum-norm")),
    ("gspo", dict(eps_low=0.05, eps_high=0.05)),
    ("gspo_token", dict(eps_low=0.05, eps_high=0.05)),
    ("tepo", dict(beta=0.0, eps_low=0.05, eps_high=0.05)),
    ("mpo", dict(block_size=2, block_agg="seq-mean-block-mean")),
    ("mpo", dict(block_size=3, block_agg="token-weighted")),
    ("cispo", dict(cispo_weight="cap", eps_high=1.1)),
    ("gmpo", dict(eps_low=0.05, eps_high=0.05)),
    ("sapo", dict(beta=0.1)),
]


@pytest.mark.parametrize("name,ov", GA_CASES, ids=[f"{n}-{o}" for n, o in GA_CASES])
@settings(max_examples=10, deadline=None)
@given(split=st.lists(st.integers(1, 7), min_size=1, max_size=3, unique=True), seed=st.integers(0, 10_000))
def test_micro_batches_with_global_counts_reproduce_full_batch_loss_and_gradient(name, ov, split, seed):
    """Property 41: summing micro-batch losses computed with the global num_tokens / num_seqs equals the
    full-batch loss, and the concatenated gradients equal the full-batch gradient."""
    x = make_inputs(B=8, T=6, seed=seed, noise=0.2)
    c = cfg(name, **ov)
    l_full, g_full, _ = run_x(name, x, c)
    N, S = float(x.mask.sum()), 8.0
    cuts = [0] + sorted(split) + [8]
    total, grads = 0.0, []
    for a, b in zip(cuts[:-1], cuts[1:]):
        l, g, _ = run(name, x.logp[a:b], x.old[a:b], x.adv[a:b], x.mask[a:b], c, ref_logp=x.ref[a:b],
                      num_tokens=N, num_seqs=S)
        total += float(l)
        grads.append(g)
    assert_close(total, l_full)
    assert_close(torch.cat(grads), g_full)


# =============================================================================
# 13. Bad arguments raise ValueError naming the argument and the valid choices
# =============================================================================

def raises_naming(fn, arg_regex, choices=()):
    with pytest.raises(ValueError, match=arg_regex) as ei:
        fn()
    for ch in choices:
        assert ch in str(ei.value), f"valid choice {ch!r} not listed in: {ei.value}"


def call_with(name, **overrides):
    """Build the config and call the objective (validation may happen at either point)."""
    def f():
        x = make_inputs(B=4, T=5, seed=59, noise=0.1)
        c = cfg(name, **overrides)
        torch.manual_seed(0)
        run_x(name, x, c)
    return f


def test_unknown_aggregation_raises_with_choices():
    x = make_inputs(B=2, T=3)
    raises_naming(lambda: tepo.aggregate_loss(x.logp, x.mask, "bogus"), r"mode|aggregation", MODES)
    raises_naming(call_with("ppo", aggregation="bogus"), r"aggregation", MODES)


def test_unknown_kl_estimator_raises_with_choices():
    x = make_inputs(B=2, T=3)
    choices = ["k1", "abs", "k2", "k3"]
    raises_naming(lambda: tepo.kl_penalty(x.logp, x.ref, "bogus"), r"estimator", choices)
    raises_naming(call_with("grpo", beta=0.1, kl_estimator="bogus"), r"kl_estimator", choices)


def test_block_size_below_one_raises():
    x = make_inputs(B=2, T=3)
    raises_naming(lambda: tepo.block_log_ratio(x.logp, x.old, x.mask, 0), r"block_size")
    raises_naming(call_with("mpo", block_size=0), r"block_size")


@pytest.mark.parametrize("field", ["eps_low", "eps_high"])
def test_negative_clip_eps_raises(field):
    raises_naming(call_with("ppo", **{field: -0.1}), field)


@pytest.mark.parametrize("field,choices", [
    ("block_ratio", ["joint", "geomean"]),
    ("block_agg", ["seq-mean-block-mean", "block-mean", "token-weighted"]),
    ("ratio_mode", ["gspo_token", "gmpo"]),
    ("entropy_criterion", ["cov", "measured"]),
    ("kl_target", ["old", "ref"]),
    ("kl_mode", ["soft", "hard"]),
])
def test_unknown_string_option_raises_with_choices(field, choices):
    name = "mpo" if field.startswith("block") else "tepo"
    raises_naming(call_with(name, beta=1.0, **{field: "bogus"}), field, choices)


@pytest.mark.parametrize("name", list(tepo.OBJECTIVES))
def test_mismatched_shapes_raise_naming_the_argument(name):
    x = make_inputs(B=4, T=5, seed=60, noise=0.1)
    c = cfg(name)
    fn = tepo.OBJECTIVES[name]
    kw = dict(ref_logp=x.ref, entropy=x.ent, old_entropy=x.old_ent)
    raises_naming(lambda: fn(x.logp.clone().requires_grad_(True), x.old, x.adv, x.mask[:, :4], c, **kw), r"mask")
    raises_naming(lambda: fn(x.logp.clone().requires_grad_(True), x.old, torch.zeros(5, dtype=F64), x.mask, c, **kw),
                  r"advantages")
    raises_naming(lambda: fn(x.logp.clone().requires_grad_(True), x.old[:, :4], x.adv, x.mask, c, **kw), r"old_logp")


# Inputs that can only give a garbage loss, one per argument: (argument, how to spoil it, message).
# Each spoils one trained position (mask 1); kl_cov never reads ref_logp (its beta weighs |delta|).
def _spoil(value, row=0, col=1):
    def spoil(t):
        t = t.clone()
        t[(row, col) if t.dim() == 2 else row] = value
        return t
    return spoil


BAD_TENSORS = [
    ("logp", "nan-logp", _spoil(float("nan")), r"^logp: 1 non-finite values where mask is 1 "
                                                r"\(e\.g\. nan at \[0, 1\]\)"),
    ("old", "inf-old_logp", _spoil(float("inf")), r"^old_logp: 1 non-finite values where mask is 1 \(e\.g\. inf"),
    ("adv", "-inf-advantages", _spoil(float("-inf")), r"^advantages: 1 non-finite values where mask is 1 "
                                                       r"\(e\.g\. -inf at \[0\]\)"),
    ("ref", "nan-ref_logp", _spoil(float("nan")), r"^ref_logp: 1 non-finite values where mask is 1"),
    ("mask", "half-mask", _spoil(0.5), r"^mask: 1 values other than 0 and 1 \(e\.g\. 0\.5\); choose a bool mask"),
    ("ref", "short-ref_logp", lambda t: t[:, :-1], r"^ref_logp: shape \(4, 4\) does not match logp \(4, 5\)"),
    ("logp", "3d-logp", lambda t: t[..., None], r"^logp: expected shape \[B, T\]"),
]


@pytest.mark.parametrize("arg,case,spoil,message", BAD_TENSORS, ids=[b[1] for b in BAD_TENSORS])
@pytest.mark.parametrize("name", list(tepo.OBJECTIVES))
def test_tensors_that_can_only_give_garbage_raise_one_line_naming_the_argument(name, arg, case, spoil, message):
    """NaN / inf at a trained position, a mask that is not 0/1 and a shape mismatch: refused by
    every objective with a one-line ValueError naming the argument (beta > 0 so the reference is read)."""
    x = make_inputs(B=4, T=5, lengths=[5, 3, 0, 4], seed=61, noise=0.1)
    c = cfg(name, beta=0.1)
    if arg == "ref" and name == "kl_cov":
        loss, _, _ = run_x(name, x, c)
        spoilt, _, _ = run_x(name, x, c, ref_logp=spoil(x.ref))
        assert float(spoilt) == float(loss) != 0                       # kl_cov reads no reference
        return
    setattr(x, arg, spoil(getattr(x, arg)))
    with pytest.raises(ValueError, match=message) as e:
        run_x(name, x, c)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200


@pytest.mark.parametrize("name", list(tepo.OBJECTIVES))
def test_count_of_bad_values_and_valid_mask_dtypes(name):
    """The count covers trained positions only; bool and 0/1 int masks give the float mask's loss."""
    x = make_inputs(B=4, T=5, lengths=[5, 3, 0, 4], seed=62, noise=0.1)
    c = cfg(name, beta=0.1)
    logp = x.logp.clone()
    logp[0, :3] = float("nan")      # 3 trained positions
    logp[1, 3:] = float("nan")      # padding: not counted
    with pytest.raises(ValueError, match=r"^logp: 3 non-finite values where mask is 1"):
        run(name, logp, x.old, x.adv, x.mask, c, ref_logp=x.ref)
    losses = []
    for mask in (x.mask, x.mask.bool(), x.mask.long(), x.mask.to(torch.uint8)):
        torch.manual_seed(0)
        losses.append(float(run(name, x.logp, x.old, x.adv, mask, c, ref_logp=x.ref)[0]))
    assert losses[0] != 0 and losses == [losses[0]] * 4


@pytest.mark.parametrize("dtype,value", [(F64, 0.5), (F64, 1e-300), (F64, 1 - 2 ** -52), (F64, 2.0), (F64, -1.0),
                                         (F64, float("nan")), (torch.float32, 0.5), (torch.float16, 0.999),
                                         (torch.bfloat16, 0.5), (torch.long, 2), (torch.long, -1)])
def test_mask_values_other_than_zero_and_one_are_refused_in_every_dtype(dtype, value):
    x = make_inputs(B=3, T=4, lengths=[4, 2, 3], seed=65)
    mask = x.mask.to(dtype)
    mask[1, 3] = value                                                      # a padded position
    with pytest.raises(ValueError, match=rf"^mask: 1 values other than 0 and 1 \(e\.g\. "):
        run("dapo", x.logp, x.old, x.adv, mask, cfg("dapo"))


@pytest.mark.parametrize("name,ov", SWEEP, ids=SWEEP_IDS)
def test_nonfinite_advantages_and_tensors_at_padding_are_accepted_and_change_nothing(name, ov):
    """Property 43 for the advantages: inf in a per-token advantage at padding, and NaN as the
    per-sequence advantage of a row with no trained token, change neither loss nor gradient."""
    x = make_inputs(B=4, T=6, lengths=[6, 3, 0, 4], seed=63, noise=0.3)
    c = cfg(name, **ov)
    pad = x.mask == 0
    torch.manual_seed(0)
    l0, g0, _ = run_x(name, x, c)
    seq_adv = x.adv.clone()
    seq_adv[2] = float("nan")                                               # row 2 is all padding
    torch.manual_seed(0)
    l1, g1, m1 = run_x(name, x, c, adv=seq_adv, old=torch.where(pad, float("inf"), x.old))
    assert l1.item() == l0.item() and torch.equal(g1, g0)
    all_finite_metrics(m1)
    if name in ("gspo", "gmpo", "mpo") or ov.get("ratio_mode") == "gmpo":
        return                                                              # per-sequence advantages only
    token_adv = torch.where(pad, float("-inf"), x.adv[:, None].expand(4, 6))
    torch.manual_seed(0)
    l2, g2, _ = run_x(name, x, c, adv=token_adv)
    assert l2.item() == l0.item() and torch.equal(g2, g0)


@pytest.mark.parametrize("counts", [{}, dict(num_tokens=0, num_seqs=0)], ids=["own-counts", "zero-global-counts"])
@pytest.mark.parametrize("B,T", [(4, 5), (0, 5), (4, 0)])
@pytest.mark.parametrize("name", list(tepo.OBJECTIVES))
def test_empty_batch_gives_exactly_zero_loss_and_zero_gradient(name, B, T, counts):
    """An all-zero mask (and B = 0, T = 0; a global count of 0 for an empty step): loss exactly 0,
    every gradient exactly 0 (not NaN), every metric finite, in float64 with paper defaults + a KL."""
    x = make_inputs(B=B, T=T, lengths=[0] * B, seed=64, noise=0.3)
    c = cfg(name, beta=0.1)
    loss, grad, metrics = run_x(name, x, c, **counts)
    assert loss.dtype == F64 and loss.item() == 0.0
    assert grad.shape == (B, T) and torch.equal(grad, torch.zeros(B, T, dtype=F64))
    all_finite_metrics(metrics)
    assert metrics["loss"] == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_zero_or_negative_global_count_with_valid_tokens_raises(mode):
    x = make_inputs(B=2, T=3, lengths=[3, 1])
    count = "num_tokens" if mode == "token-mean" else "num_seqs"
    for bad in (0, -2):
        raises_naming(lambda: tepo.aggregate_loss(x.logp, x.mask, mode, **{count: bad}),
                      rf"^{count}={bad} is not valid for a micro-batch with 4 valid tokens")


def test_group_advantages_rejects_partial_groups_and_unknown_scale():
    r = torch.zeros(7, dtype=F64)
    raises_naming(lambda: tepo.group_advantages(r, 4), r"group_size|rewards")
    raises_naming(lambda: tepo.group_advantages(torch.zeros(8, dtype=F64), 4, scale="bogus"), r"scale",
                  ["group", "batch", "none"])
    raises_naming(lambda: tepo.dynamic_sampling_mask(r, 4), r"group_size|rewards")


def test_config_for_unknown_objective_or_field_raises():
    raises_naming(lambda: tepo.config_for("bogus"), r"name|objective", list(tepo.OBJECTIVES))
    raises_naming(lambda: tepo.config_for("grpo", not_a_field=1), r"not_a_field")


def test_an_invalid_setting_keeps_its_name_value_and_valid_values():
    """InvalidSetting is a ValueError whose parts a caller can word itself (train_small.py names the flag)."""
    for overrides, name, value, valid in [({"eps_low": -0.1}, "eps_low", -0.1, "a number >= 0"),
                                          ({"kl_mode": "firm"}, "kl_mode", "firm", "one of: soft, hard"),
                                          ({"clip_cov_lb": 6.0}, "clip_cov_lb", 6.0, "clip_cov_lb < clip_cov_ub=5.0")]:
        with pytest.raises(tepo.InvalidSetting) as caught:
            tepo.config_for("tepo", **overrides)
        assert isinstance(caught.value, ValueError)
        assert (caught.value.name, caught.value.value, caught.value.valid) == (name, value, valid)
        assert str(caught.value) == f"{name}={value!r} is not valid; choose {valid}"


# =============================================================================
# 14. Configuration (property 45)
# =============================================================================

def test_a_config_is_checked_when_made_and_not_on_every_call(monkeypatch):
    """Structure: ObjectiveConfig checks its settings when it is made (one-line InvalidSetting), cannot be
    changed after, and an objective call does not check it again; a cfg that is no ObjectiveConfig is refused."""
    with pytest.raises(tepo.InvalidSetting, match=r"^eps_low=-1 is not valid"):
        tepo.ObjectiveConfig(eps_low=-1)
    c = cfg("tepo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.eps_low = -1.0
    checks = []
    real_check = tepo.check_config
    monkeypatch.setattr(tepo, "check_config", lambda config: checks.append(config) or real_check(config))
    c = cfg("tepo", beta=0.5)                                               # made: checked once
    x = make_inputs(B=4, T=5, seed=66, noise=0.1)
    for _ in range(3):
        run_x("tepo", x, c)
    assert checks == [c]
    with pytest.raises(TypeError, match=r"^cfg: expected an ObjectiveConfig"):
        run_x("tepo", x, dataclasses.asdict(c))


def test_paper_defaults_cover_every_objective_and_config_for_copies():
    assert set(tepo.PAPER_DEFAULTS) == set(tepo.OBJECTIVES) == {
        "ppo", "grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "tepo", "mpo", "clip_cov", "kl_cov", "cispo", "gmpo",
        "sapo"}
    c = tepo.config_for("dapo", eps_high=0.5)
    assert c.eps_high == 0.5
    assert tepo.PAPER_DEFAULTS["dapo"].eps_high == 0.28
    assert isinstance(c, tepo.ObjectiveConfig)


def test_paper_defaults_match_the_papers():
    d = tepo.PAPER_DEFAULTS
    dapo = d["dapo"]
    assert (dapo.eps_low, dapo.eps_high, dapo.aggregation, dapo.beta) == (0.2, 0.28, "token-mean", 0.0)
    assert d["dapo"].dynamic_sampling and d["dapo"].overlong_penalty
    assert (d["gspo"].eps_low, d["gspo"].eps_high, d["gspo"].beta) == (3e-4, 4e-4, 0.0)
    assert (d["gspo_token"].eps_low, d["gspo_token"].eps_high) == (3e-4, 4e-4)
    assert d["grpo"].aggregation == "seq-mean-token-mean" and d["grpo"].advantage_scale == "group"
    assert (d["dr_grpo"].aggregation, d["dr_grpo"].advantage_scale, d["dr_grpo"].beta) == (
        "seq-mean-token-sum-norm", "none", 0.0)
    assert (d["clip_cov"].clip_cov_ratio, d["clip_cov"].clip_cov_lb, d["clip_cov"].clip_cov_ub) == (2e-4, 1.0, 5.0)
    assert d["kl_cov"].kl_cov_ratio == 2e-3 and d["kl_cov"].beta == 1.0
    # CISPO: no lower bound on the weight (paper), verl's example eps; GMPO: (e^-0.4, e^0.4); SAPO: tau 1 / 1.05
    assert (d["cispo"].eps_low, d["cispo"].eps_high, d["cispo"].aggregation, d["cispo"].cispo_weight) == (
        10.0, 0.2, "token-mean", "clip")
    assert (d["gmpo"].eps_low, d["gmpo"].eps_high, d["gmpo"].aggregation, d["gmpo"].beta) == (
        0.4, 0.4, "seq-mean-token-mean", 0.0)
    assert (d["sapo"].sapo_tau_pos, d["sapo"].sapo_tau_neg, d["sapo"].aggregation) == (1.0, 1.05, "seq-mean-token-mean")
    t = d["tepo"]
    assert (t.eps_low, t.eps_high, t.aggregation, t.ratio_mode, t.entropy_criterion, t.kl_target, t.beta) == (
        3e-4, 4e-4, "token-mean", "gspo_token", "cov", "old", 1.0)


def test_importing_tepo_needs_torch_only():
    """API: importing tepo must not import transformers."""
    import subprocess
    import sys
    import os
    code = "import sys, tepo; assert 'transformers' not in sys.modules, 'transformers imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(tepo.__file__)),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_needs_ref_and_needs_entropy():
    assert tepo.needs_ref("grpo", cfg("grpo", beta=0.04))
    assert not tepo.needs_ref("grpo", cfg("grpo", beta=0.0))
    assert tepo.needs_ref("tepo", cfg("tepo", beta=1.0, kl_target="ref"))
    assert not tepo.needs_ref("tepo", cfg("tepo", beta=1.0, kl_target="old"))
    assert tepo.needs_entropy("tepo", cfg("tepo", entropy_criterion="measured"))
    assert not tepo.needs_entropy("tepo", cfg("tepo", entropy_criterion="cov"))
    assert not tepo.needs_entropy("grpo", cfg("grpo"))


# Which fields each objective reads (tepo.FIELDS_READ), proved both ways on random off-policy inputs.
# Each field has valid values other than its default; a context switches on the settings some fields
# need before they can act (beta > 0 for kl_estimator, seq-mean-token-sum-norm for norm_constant, a
# dual clip, Clip-Cov bounds wide enough to select tokens, TEPO's hard mask for kl_tau).
FIELD_VALUES = {
    "eps_low": (0.05, 0.5), "eps_high": (0.05, 0.5), "dual_clip_c": (1.5, None), "log_ratio_clamp": (1e-4, 0.5),
    "beta": (0.0, 0.5), "kl_estimator": ("k1", "k2", "abs"), "aggregation": ("seq-mean-token-sum", "token-mean"),
    "norm_constant": (3.0, None), "advantage_scale": ("none", "batch"), "adv_eps": (0.1, 1e-3),
    "dynamic_sampling": (True, False), "overlong_penalty": (True, False), "ratio_mode": ("gmpo", "gspo_token"),
    "entropy_criterion": ("measured", "cov"), "kl_target": ("ref", "old"), "kl_mode": ("hard", "soft"),
    "clip_choice": ("random", "band"),
    "kl_tau": (0.05, 0.0), "block_size": (2, 3), "block_ratio": ("geomean", "joint"),
    "block_agg": ("block-mean", "token-weighted"), "clip_cov_ratio": (0.5, 0.05), "clip_cov_lb": (0.0, -100.0),
    "clip_cov_ub": (0.0, 100.0), "kl_cov_ratio": (0.5, 0.05), "entropy_coef": (0.01, 0.5),
    "cispo_weight": ("cap", "clip"), "sapo_tau_pos": (2.0, 0.5), "sapo_tau_neg": (2.0, 0.5),
    "sampler_correction": ("truncate", "mask"), "sampler_correction_cap": (1.2, 5.0), "top_entropy_share": (0.2, 0.5),
}
ACTIVE = dict(beta=0.5, kl_estimator="k3", aggregation="seq-mean-token-sum-norm", norm_constant=5.0, dual_clip_c=2.0,
              clip_cov_ratio=0.2, clip_cov_lb=-100.0, clip_cov_ub=100.0, kl_cov_ratio=0.2,
              sampler_correction="truncate")
FIELD_CONTEXTS = [{}, ACTIVE, dict(ACTIVE, kl_mode="hard", kl_tau=0.05)]


def loss_and_grad_per_value(name, field, x):
    """(context, value, loss, grad) for every context and every valid value of `field` (base value included)."""
    out = []
    for context in FIELD_CONTEXTS:
        base = cfg(name, **context)
        for value in (getattr(base, field),) + FIELD_VALUES[field]:
            try:
                c = cfg(name, **dict(context, **{field: value}))
            except ValueError:       # e.g. clip_cov_ub below clip_cov_lb: not a valid value here
                continue
            torch.manual_seed(0)     # Clip-Cov draws its tokens from the global RNG
            loss, grad, _ = run_x(name, x, c)
            out.append((id(context), value, loss, grad))
    return out


def test_fields_read_names_real_fields_and_every_objective():
    fields = {f.name for f in dataclasses.fields(tepo.ObjectiveConfig)}
    assert set(tepo.FIELDS_READ) == set(tepo.OBJECTIVES)
    assert set(FIELD_VALUES) == fields
    for name, read in tepo.FIELDS_READ.items():
        assert set(read) <= fields and len(set(read)) == len(read), name
        assert set(tepo.TRAINER_FIELDS) <= set(read), name


@pytest.mark.parametrize("name", sorted(tepo.OBJECTIVES))
def test_fields_an_objective_does_not_read_leave_loss_and_gradient_bit_identical(name):
    """Property 45: every field missing from FIELDS_READ[name], and every trainer-side field, changes
    nothing in the loss: value and gradient stay bit-identical."""
    x = make_inputs(B=8, T=7, seed=11, noise=0.5)
    unread = [f.name for f in dataclasses.fields(tepo.ObjectiveConfig)
              if f.name not in tepo.FIELDS_READ[name] or f.name in tepo.TRAINER_FIELDS]
    for field in unread:
        results = loss_and_grad_per_value(name, field, x)
        compared = 0
        for context_id, value, loss, grad in results:
            first = next(r for r in results if r[0] == context_id)
            if value != first[1]:
                compared += 1
                assert torch.equal(loss, first[2]) and torch.equal(grad, first[3]), (name, field, value)
        assert compared > 0, (name, field)


@pytest.mark.parametrize("name", sorted(tepo.OBJECTIVES))
def test_every_field_an_objective_reads_changes_its_loss_or_gradient(name):
    """Property 45: every loss-side field in FIELDS_READ[name] changes loss or gradient for some valid
    value in some context."""
    x = make_inputs(B=8, T=7, seed=11, noise=0.5)
    for field in set(tepo.FIELDS_READ[name]) - set(tepo.TRAINER_FIELDS):
        results = loss_and_grad_per_value(name, field, x)
        firsts = {r[0]: r for r in reversed(results)}
        assert any(not (torch.equal(loss, firsts[cid][2]) and torch.equal(grad, firsts[cid][3]))
                   for cid, _, loss, grad in results), (name, field)


def test_every_objective_is_a_def_of_its_own_name_with_its_equation_and_paper():
    """Structure: `grep "def <name>_loss" tepo.py` finds every objective: each function of OBJECTIVES is a
    module-level def of that name, decorated by @objective, whose maths is that def (not another objective's
    under a new name) and whose docstring, an equation and a paper (arXiv), is the objective's."""
    import ast
    import inspect
    tree = ast.parse(open(tepo.__file__).read())
    defs = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assigned = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)}
    for name, fn in tepo.OBJECTIVES.items():
        node = defs.get(fn.__name__)
        assert node is not None and fn.__name__.endswith("_loss") and fn.__name__ not in assigned, name
        assert [ast.unparse(d.func) for d in node.decorator_list if isinstance(d, ast.Call)] == ["objective"], name
        first_line = min([node.lineno] + [d.lineno for d in node.decorator_list])   # a def starts at its decorator
        assert fn.policy_terms.__code__.co_firstlineno == first_line and fn.policy_terms.__name__ == fn.__name__
        assert inspect.cleandoc(fn.__doc__) == ast.get_docstring(node), name
        assert "arXiv" in fn.__doc__ and "=" in fn.__doc__.split("\n\n")[1], name
    assert "RECONSTRUCTION" in tepo.tepo_loss.__doc__ and "RECONSTRUCTION" in tepo.mpo_loss.__doc__


def test_all_lists_every_public_name_once():
    public = {n for n, v in vars(tepo).items() if not n.startswith("_") and getattr(v, "__module__", "tepo") == "tepo"
              and not isinstance(v, type(os))} - {"annotations"}
    assert sorted(tepo.__all__) == sorted(public) and len(set(tepo.__all__)) == len(tepo.__all__)


def test_every_config_field_has_its_own_comment_without_python_names():
    """train_small.py shows these comments as --help: each field needs one, in words (no tepo constant names)."""
    import inspect
    lines = inspect.getsource(tepo.ObjectiveConfig).splitlines()
    constants = [n for n in dir(tepo) if n.isupper() and not n.startswith("_")]
    for f in dataclasses.fields(tepo.ObjectiveConfig):
        line = next(line for line in lines if re.match(rf"\s+{f.name}\s*:", line))
        comment = line.split("#", 1)[1].strip() if "#" in line else ""
        assert comment, f.name
        assert not [n for n in constants if re.search(rf"\b{n}\b", comment)], (f.name, comment)


# =====================================================================================================
# The entropy bonus (property 46)
# =====================================================================================================

@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_entropy_bonus_value_and_gradient_by_hand(aggregation):
    """Property 46: the value is -coef x the aggregated entropy (written out here), and the gradient on each
    logit is -coef w dH/dz, dH/dz_v = -p_v (log p_v + H), with w the position's aggregation weight."""
    torch.manual_seed(3)
    B, T, V, coef = 3, 4, 5, 0.3
    logits = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    c = tepo.ObjectiveConfig(entropy_coef=coef, aggregation=aggregation)
    loss = tepo.entropy_bonus(logits, mask, c)
    loss.backward()
    p = torch.softmax(logits.detach(), -1)
    H = -(p * p.log()).sum(-1)                                                     # [B, T]
    m = mask.double()
    w = m / m.sum() if aggregation == "token-mean" else m / m.sum(1, keepdim=True) / B           # [B, T]
    assert loss.item() == pytest.approx(-coef * (w * H).sum().item(), rel=1e-12)
    expected = -coef * w.unsqueeze(-1) * (-p * (p.log() + H.unsqueeze(-1)))
    assert torch.allclose(logits.grad, expected, atol=1e-12)
    assert (logits.grad[mask == 0] == 0).all()                                    # padding: no gradient


def test_entropy_bonus_is_zero_without_a_coefficient_and_raises_entropy_when_followed():
    logits = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 3)
    zero = tepo.entropy_bonus(logits, mask, tepo.ObjectiveConfig())
    assert zero.item() == 0 and not zero.requires_grad
    bonus = tepo.entropy_bonus(logits, mask, tepo.ObjectiveConfig(entropy_coef=1.0))
    bonus.backward()
    before = tepo.entropy_from_logits(logits.detach()).mean()
    after = tepo.entropy_from_logits(logits.detach() - 0.1 * logits.grad).mean()   # one descent step on the loss
    assert after > before


# ---- clip_choice="random": the band's number of clipped sequences, drawn at random (a control, ours) ----------------

def test_random_clip_drops_as_many_sequences_as_the_band_clips_and_leaves_the_others_unclipped():
    """tepo with clip_choice="random", float64, off-policy: the rows with zero gradient are exactly as many as the
    band's clipped rows, each a row with A != 0; every other row has the gradient the loss has with no clip at all
    (eps = inf), and the loss's value is the no-clip loss's. Two calls after the same seed drop the same rows, and
    other seeds drop other rows."""
    x = make_inputs(B=16, T=6, seed=3, noise=0.01)
    band = cfg("tepo", beta=0.0)
    _, _, m_band = run_x("tepo", x, band)
    _, g_band, _ = run_x("tepo", x, band)
    band_clipped = int((g_band.abs().sum(-1) == 0).sum())          # rows whose every token the band clipped
    assert 0 < band_clipped < 16, band_clipped
    loss_free, g_free, _ = run_x("tepo", x, cfg("tepo", beta=0.0, eps_low=float("inf"), eps_high=float("inf")))
    dropped_sets = set()
    for seed in range(6):
        torch.manual_seed(seed)
        loss, g, m = run_x("tepo", x, cfg("tepo", beta=0.0, clip_choice="random"))
        dropped = g.abs().sum(-1) == 0                              # [B]
        assert int(dropped.sum()) == band_clipped
        kept = ~dropped
        assert_close(g[kept], g_free[kept])
        assert_close(loss, loss_free)
        # what it reports as clipped is what it dropped, split by the sign of A, at the band's rate in sequences
        assert_close(m["clip_ratio/low_mean"] + m["clip_ratio/high_mean"],
                     float(x.mask[dropped].sum() / x.mask.sum()))
        torch.manual_seed(seed)
        assert torch.equal(run_x("tepo", x, cfg("tepo", beta=0.0, clip_choice="random"))[1], g)
        dropped_sets.add(tuple(dropped.tolist()))
    assert len(dropped_sets) > 1
    assert m_band["clip_ratio/low_mean"] + m_band["clip_ratio/high_mean"] > 0


def test_random_clip_drops_nothing_on_policy_and_draws_no_random_number_then():
    x = make_inputs(B=8, T=5, seed=4, noise=0.0)
    torch.manual_seed(0)
    _, g_random, _ = run_x("tepo", x, cfg("tepo", beta=0.0, clip_choice="random"))
    after = torch.rand(1)
    torch.manual_seed(0)
    _, g_band, _ = run_x("tepo", x, cfg("tepo", beta=0.0))
    assert torch.equal(g_random, g_band) and torch.equal(torch.rand(1), after)


def test_random_clip_is_refused_with_the_log_space_ratio():
    with pytest.raises(ValueError, match="clip_choice"):
        cfg("tepo", ratio_mode="gmpo", clip_choice="random")


# =====================================================================================================
# 15. Two options of every objective: the sampler's mismatch corrected, the forking-token mask (47-49)
# =====================================================================================================

def hand_weight(old, sampler, mode, cap=2.0):
    """The sampler's weight by hand: rho = pi_old / pi_sampler, truncated at the cap or 0 past it."""
    rho = torch.exp(old - sampler)
    return rho.clamp(max=cap) if mode == "truncate" else torch.where(rho <= cap, rho, torch.zeros_like(rho))


def test_sampler_weight_by_hand_truncated_or_masked_without_lower_bound_or_gradient():
    """Property 47: w = min(rho, 2) (truncate) and rho 1[rho <= 2] (mask), 1 at padding (even NaN), no gradient."""
    delta = torch.tensor([[-1.0, 0.0, 0.5, 1.0, math.log(3.0), float("nan")]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    e = math.exp
    truncated = tepo.sampler_correction_weight(delta, mask, "truncate", 2.0)
    masked = tepo.sampler_correction_weight(delta, mask, "mask", 2.0)
    assert_close(truncated, torch.tensor([[e(-1), 1, e(0.5), 2, 2, 1]], dtype=F64))
    assert_close(masked, torch.tensor([[e(-1), 1, e(0.5), 0, 0, 1]], dtype=F64))
    assert round(truncated[0, 0].item(), 3) == 0.368             # no lower bound
    assert not truncated.requires_grad and not masked.requires_grad
    with pytest.raises(ValueError, match="sampler_correction"):
        tepo.sampler_correction_weight(delta, mask, "none")


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("name", sorted(tepo.OBJECTIVES))
def test_every_objective_is_bit_identical_when_the_sampler_agrees_with_the_trainer(name, mode):
    """Property 47: sampler_logp = old_logp makes every weight exactly 1: loss, gradient and every metric of the
    objective without the option are the same bit for bit (off-policy, with a KL term)."""
    x = make_inputs(B=8, T=7, seed=3, noise=0.4)
    c = cfg(name, beta=0.1)
    torch.manual_seed(0)               # Clip-Cov draws its tokens from the global RNG
    loss0, grad0, m0 = run_x(name, x, c)
    torch.manual_seed(0)
    loss1, grad1, m1 = run_x(name, x, dataclasses.replace(c, sampler_correction=mode), sampler_logp=x.old.clone())
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
    assert {k: v for k, v in m1.items() if k in m0} == m0
    assert [m1[f"sampler_correction/{k}"] for k in ("weight_mean", "weight_min", "weight_max", "capped_frac")] == \
        [1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("name", ["ppo", "grpo", "dapo", "dr_grpo", "gspo_token", "tepo"])
def test_the_weight_multiplies_each_tokens_policy_gradient_and_never_the_kl(name, mode):
    """Property 48: off-policy, with a KL term, d loss / d logp_t = w_t g_t + the KL's gradient (unweighted), g_t the
    policy gradient without the option; the KL part of the loss is unchanged; the metrics are the weights'."""
    x = make_inputs(B=8, T=7, seed=5, noise=0.3)
    valid = x.mask.bool()
    w = torch.where(valid, hand_weight(x.old, x.sampler, mode), torch.zeros_like(x.old))
    assert (w[valid] > 1).any() and (w[valid] < 1).any() and (torch.exp(x.old - x.sampler)[valid] > 2).any()
    pg = run_x(name, x, cfg(name, beta=0.0))[1]
    _, with_kl, plain = run_x(name, x, cfg(name, beta=0.5))
    kl = with_kl - pg
    _, grad, m = run_x(name, x, cfg(name, beta=0.5, sampler_correction=mode))
    assert_close(grad, w * pg + kl, atol=1e-12)
    assert m["kl_loss"] == plain["kl_loss"]
    assert_close(m["sampler_correction/weight_mean"], w[valid].mean())
    assert_close(m["sampler_correction/weight_min"], w[valid].min())
    assert_close(m["sampler_correction/weight_max"], w[valid].max())
    assert_close(m["sampler_correction/capped_frac"], (torch.exp(x.old - x.sampler)[valid] > 2).to(F64).mean())


def test_a_token_weighed_zero_still_counts_in_the_token_mean():
    """Property 48: DAPO at ratio 1 with the masked weight: d loss / d logp_t = -w_t A_i / N, N every valid token
    (those past the cap included, as TRL and verl count them)."""
    x = make_inputs(B=6, T=5, seed=2)
    _, grad, _ = run("dapo", x.logp, x.logp, x.adv, x.mask, cfg("dapo", sampler_correction="mask"),
                     sampler_logp=x.sampler)
    w = hand_weight(x.logp, x.sampler, "mask")
    assert (w[x.mask.bool()] == 0).any()
    assert_close(grad, -x.adv[:, None] * w * x.mask / x.mask.sum(), atol=1e-14)


@pytest.mark.parametrize("block_ratio", ["joint", "geomean"])
def test_an_mpo_block_takes_the_weight_of_its_tokens_as_its_ratio_does(block_ratio):
    """Property 48: MPO's loss is per block: a block of K = 2 tokens weighs min(exp(sum of its tokens' log pi_old -
    log pi_sampler), cap) (joint; geomean: their mean), so each of its tokens' gradient is that times the plain one."""
    x = make_inputs(B=4, T=6, lengths=[6, 5, 3, 6], seed=4)
    plain = cfg("mpo", block_size=2, block_ratio=block_ratio)
    _, g0, _ = run("mpo", x.logp, x.logp, x.adv, x.mask, plain)
    _, g1, _ = run("mpo", x.logp, x.logp, x.adv, x.mask,
                   dataclasses.replace(plain, sampler_correction="truncate", sampler_correction_cap=1.5),
                   sampler_logp=x.sampler)
    for i, t in valid_tokens(x.mask):
        block = [u for u in (t - t % 2, t - t % 2 + 1) if u < x.T and x.mask[i, u] > 0]
        d = sum(float(x.logp[i, u] - x.sampler[i, u]) for u in block)
        w = min(math.exp(d / (len(block) if block_ratio == "geomean" else 1)), 1.5)
        assert_close(g1[i, t], w * g0[i, t], atol=1e-14)


@pytest.mark.parametrize("N, share", [(10, 0.2), (11, 0.2)] + [(N, s) for N in (1, 2, 5, 17, 40)
                                                                  for s in (0.05, 0.5, 0.9)])
def test_the_forking_token_mask_keeps_the_top_share_of_valid_tokens_by_entropy(N, share):
    """Property 49: of N distinct valid entropies N - ceil((1 - share)(N - 1)) are kept (10 at 0.2: 2; 11: 3), the
    highest; padded positions, holding the highest entropies, are neither kept nor in the quantile."""
    H = torch.randperm(1000, generator=torch.Generator().manual_seed(N))[:N].to(F64) / 100     # distinct
    entropy = torch.stack([H, torch.full_like(H, 1e6)], 1)                                     # [N, 2]: column 1 pads
    keep = tepo.top_entropy_mask(entropy, torch.tensor([[1, 0]] * N), share)
    kept = N - math.ceil((1 - share) * (N - 1))
    assert {(10, 0.2): 2, (11, 0.2): 3}.get((N, share), kept) == kept
    assert int(keep.sum()) == kept and not keep[:, 1].any()
    assert sorted(H[keep[:, 0]].tolist()) == sorted(H.tolist())[N - kept:]


def test_the_forking_token_mask_zeroes_the_policy_gradient_of_the_others_not_their_kl_nor_the_count():
    """Property 49: DAPO with a KL term and share 0.25: the kept tokens (old entropy >= the hand-made linear quantile of
    the valid ones) keep their policy gradient, the others lose it; the KL's gradient and the count stay whole."""
    x = make_inputs(B=6, T=7, seed=7, noise=0.3)
    valid = x.mask.bool()
    values = sorted(x.old_ent[valid].tolist())
    pos = 0.75 * (len(values) - 1)
    q = values[int(pos)] + (pos - int(pos)) * (values[min(int(pos) + 1, len(values) - 1)] - values[int(pos)])
    keep = valid & (x.old_ent >= q)
    pg = run_x("dapo", x, cfg("dapo"))[1]
    kl = run_x("dapo", x, cfg("dapo", beta=0.5))[1] - pg
    _, grad, m = run_x("dapo", x, cfg("dapo", beta=0.5, top_entropy_share=0.25))
    assert_close(grad, torch.where(keep, pg, torch.zeros_like(pg)) + kl, atol=1e-12)
    assert_close(m["top_entropy/kept_frac"], keep.sum().to(F64) / valid.sum())


@pytest.mark.parametrize("name", sorted(tepo.OBJECTIVES))
def test_the_forking_token_mask_changes_nothing_when_it_keeps_every_token(name):
    """Property 49: share 1 (off: no old entropy needed) and equal entropies (every valid token at the quantile, all
    kept) leave loss, gradient and the shared metrics bit-identical."""
    x = make_inputs(B=8, T=7, seed=6, noise=0.3)
    c = cfg(name, beta=0.1)
    torch.manual_seed(0)
    loss0, grad0, m0 = run_x(name, x, c)
    for share, old_entropy in ((1.0, None), (0.3, torch.full_like(x.old_ent, 0.7))):
        torch.manual_seed(0)
        c1 = dataclasses.replace(c, top_entropy_share=share)
        kw = {} if name == "tepo" and old_entropy is None else dict(old_entropy=old_entropy)
        loss1, grad1, m1 = run_x(name, x, c1, **kw)
        assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1), share
        assert {k: v for k, v in m1.items() if k in m0} == m0
        assert m1.get("top_entropy/kept_frac", 1.0) == 1.0


def test_an_mpo_block_is_trained_when_one_of_its_tokens_is_a_forking_token():
    """Property 49, MPO (K = 2, ratio 1): a token has a gradient exactly when a token of its block is kept."""
    x = make_inputs(B=4, T=6, lengths=[6, 5, 3, 6], seed=8)
    c = cfg("mpo", block_size=2, top_entropy_share=0.3)
    _, grad, _ = run("mpo", x.logp, x.logp, x.adv, x.mask, c, old_entropy=x.old_ent)
    keep = tepo.top_entropy_mask(x.old_ent, x.mask, 0.3)
    for i, t in valid_tokens(x.mask):
        assert (grad[i, t] != 0) == bool(keep[i, t - t % 2:t - t % 2 + 2].any()), (i, t)


def test_the_options_refuse_missing_inputs_and_invalid_settings_in_one_line():
    x = make_inputs(seed=1)
    with pytest.raises(ValueError, match="^sampler_logp: sampler_correction='truncate'"):
        run_x("grpo", x, cfg("grpo", sampler_correction="truncate"), sampler_logp=None)
    with pytest.raises(ValueError, match="^old_entropy: top_entropy_share=0.2"):
        run_x("gspo", x, cfg("gspo", top_entropy_share=0.2), old_entropy=None)
    spoiled = x.sampler.clone()
    spoiled[0, 0] = float("nan")
    with pytest.raises(ValueError, match="^sampler_logp: 1 non-finite"):
        run_x("dapo", x, cfg("dapo", sampler_correction="mask"), sampler_logp=spoiled)
    for field, value in (("sampler_correction", "clip"), ("sampler_correction_cap", 0.0),
                         ("top_entropy_share", 0.0), ("top_entropy_share", 1.5), ("top_entropy_share", float("nan"))):
        with pytest.raises(tepo.InvalidSetting, match=f"^{field}="):
            cfg("grpo", **{field: value})
