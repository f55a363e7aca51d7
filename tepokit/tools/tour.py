"""A 20-second tour of tepo.py: every objective on one random batch with its paper defaults, on-policy and after
one update, and section 4's first-order entropy change against the exact one. Run: python -m tepokit.tools.tour"""

from __future__ import annotations

import torch

from tepo import (OBJECTIVES, PAPER_DEFAULTS, first_order_entropy_change, group_advantages, natural_gradient_step,
                  softmax_entropy)


def main() -> None:
    torch.manual_seed(0)
    B, G, T = 8, 4, 6
    rewards = torch.tensor([1., 0, 0, 1, 1, 1, 0, 1])
    adv = group_advantages(rewards, G)
    mask = torch.ones(B, T)
    mask[0, 4:] = 0                   # row 0 is 4 tokens long, the others 6
    old_logp = -torch.rand(B, T) * 2
    ref_logp = old_logp + 0.05 * torch.randn(B, T)
    print(f"rewards {rewards.tolist()}\nadvantages {[round(a, 3) for a in adv.tolist()]}\n")
    print("Each objective with its paper defaults: loss and gradient norm |d loss / d logp| on-policy")
    print("(logp = old_logp), then loss and fraction of clipped tokens after logp moved by 0.3 * noise.\n")
    print(f"{'objective':<11} {'on-policy loss':>15} {'|grad|':>8} {'off-policy loss':>16} {'clip':>6}")
    grad_norms = {}
    for name, fn in OBJECTIVES.items():
        cfg = PAPER_DEFAULTS[name]
        row = []
        for shift in (0.0, 0.3):
            logp = (old_logp + shift * torch.randn(B, T)).requires_grad_(True)
            loss, m = fn(logp, old_logp, adv, mask, cfg, ref_logp=ref_logp)
            loss.backward()
            row.append((loss.item(), logp.grad.norm().item(), m["clip_ratio/region_mean"]))
        grad_norms[name] = row[0][1]
        print(f"{name:<11} {row[0][0]:>15.4f} {row[0][1]:>8.4f} {row[1][0]:>16.4f} {row[1][2]:>6.2f}")
    others = [v for k, v in grad_norms.items() if k != "mpo"]
    print(f"""
What to notice:
  - On-policy every ratio is 1 and nothing is clipped: all objectives but MPO have nearly the same gradient
    norm ({min(others):.2f}-{max(others):.2f}); they differ in how tokens are weighed, Clip-Cov in a detached token.
  - The on-policy loss is ~0 where every sequence weighs the same (grpo, gspo, gspo_token, gmpo, mpo): the
    advantages are centred in each group. Token-mean and Dr. GRPO's token sum weigh the short row 0 less;
    CISPO's loss is -A log pi, SAPO's -2A/tau: not 0 either. The gradient is not 0 in any case.
  - MPO's gradient norm is {grad_norms["mpo"]:.2f}: its block ratio is the product of K = 4 token ratios, each
    block passes the gradient to all its tokens at full weight, and a sequence's loss is divided by its
    J = ceil(|o| / K) blocks, not |o| tokens: each token weighs |o| / J = 3-4 times what it weighs in GRPO.
  - Off-policy the clipped fractions differ: GSPO's tiny band (3e-4, 4e-4) clips most sequences, KL-Cov and
    SAPO never clip, and Clip-Cov's band [0, 2] clips few tokens.""")
    z = torch.randn(10, dtype=torch.float64)
    A = torch.log_softmax(z, -1)      # advantage rises with log p: NPG must lower entropy
    eta = 1e-3
    print(f"\nNPG step, A = log p: predicted dH {first_order_entropy_change(z, eta * A).item():.3e}, "
          f"exact {(softmax_entropy(natural_gradient_step(z, A, eta)) - softmax_entropy(z)).item():.3e}\n"
          "(section 4: to first order a natural-gradient step changes entropy by -eta Cov(log p, A))")


if __name__ == "__main__":
    main()
