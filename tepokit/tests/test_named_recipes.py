"""The named recipes of docs/papers.md that are settings of tepo's objectives (LUSPO, Lite PPO, TRL's two-sided
clip `delta`): each command line there parses to the settings it names, and each equals the recipe's formula as
TRL 1.16 writes it (written here independently, in float64, value and gradient)."""
import os
import re

import torch

import tepo
import train_small as ts
from tepokit.cli.flags import objective_config, parse_args
from tepokit.tests.helpers import F64, REPO, assert_close


def recipe_commands() -> dict[str, list[str]]:
    """Each recipe's name -> its command's flags, read from docs/papers.md's "Named recipes" section."""
    text = open(os.path.join(REPO, "docs", "papers.md")).read()
    section = text[text.index("### Named recipes"):].split("How each objective maps")[0]
    commands = {}
    for block in [b for b in section.split("\n\n") if b.startswith("**")]:
        name = re.match(r"\*\*(.+?)\*\*", block).group(1)
        command = re.search(r"`python train_small\.py ([^`]+)`", block.replace("\n", " ")).group(1)
        commands[name] = command.split()
    return commands


def config_of(flags: list[str]) -> tuple:
    args, overrides = parse_args(ts.Args, flags)
    return args.objective, objective_config(args, overrides)


def batch(seed: int = 0):
    """Random float64 log-probs [4, 6] with padding (row 3 empty), advantages with a zero, ratios off 1."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(4, 6, generator=g, dtype=F64) * 2).requires_grad_()
    old = logp.detach() + torch.randn(4, 6, generator=g, dtype=F64) * 0.3
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0] * 6], dtype=torch.bool)
    return logp, old, torch.tensor([1.2, -0.7, 0.0, 0.5], dtype=F64), mask


def test_every_recipe_command_parses_to_the_settings_it_names():
    commands = recipe_commands()
    assert set(commands) == {"LUSPO", "Lite PPO", "TRL's two-sided clip `delta`"}
    name, cfg = config_of(commands["LUSPO"])
    assert name == "gspo_token" and cfg.aggregation == "seq-mean-token-sum"
    assert (cfg.eps_low, cfg.eps_high) == (tepo.PAPER_DEFAULTS["gspo"].eps_low, tepo.PAPER_DEFAULTS["gspo"].eps_high)
    name, cfg = config_of(commands["Lite PPO"])
    assert name == "grpo" and cfg.beta == 0 and cfg.advantage_scale == "batch" and cfg.aggregation == "token-mean"
    name, cfg = config_of(commands["TRL's two-sided clip `delta`"])
    assert name == "grpo" and cfg.dual_clip_c == 3


def test_luspo_is_gspo_with_each_sequence_scaled_by_its_length():
    """TRL's luspo: per-sequence GSPO loss l_i (sequence ratio s_i, clipped per sequence), summed over the
    sequence's tokens, then averaged over the B sequences: (1/B) sum_i |y_i| l_i."""
    logp, old, adv, mask = batch()
    name, cfg = config_of(recipe_commands()["LUSPO"])
    loss, _ = tepo.OBJECTIVES[name](logp, old, adv, mask, cfg)
    lengths = mask.sum(1)
    s = torch.exp(((logp - old) * mask).sum(1) / lengths.clamp(min=1))                    # [B]
    per_seq = -torch.min(s * adv, s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)       # [B]
    # TRL's mean runs over all B rows, tepo's over the non-empty ones (aggregate_loss): they differ only for a row
    # with no token (row 3 here), which a rollout never has (every completion holds at least its first token)
    reference = (per_seq * lengths).sum() / (lengths > 0).sum()
    grad, = torch.autograd.grad(loss, logp)
    expected, = torch.autograd.grad(reference, logp)
    assert_close(loss, reference, atol=1e-12)
    assert_close(grad, expected, atol=1e-12)
    assert grad.abs().sum() > 0


def test_the_dual_clip_is_trls_two_sided_clip_delta():
    """TRL: r1 = min(r, delta), r2 = clip(r, 1 - eps, 1 + eps), loss = -min(r1 A, r2 A) per token. With ratios far
    above delta on negative advantages, both bound the loss at delta |A|."""
    logp, old, adv, mask = batch(1)
    old = old.clone()
    old[1, :3] -= 2.0                                   # r = e^2 > 3 on a negative advantage: the dual clip acts
    cfg = tepo.config_for("grpo", beta=0.0, dual_clip_c=3.0, aggregation="token-mean")
    loss, _ = tepo.OBJECTIVES["grpo"](logp, old, adv, mask, cfg)
    r = torch.exp(logp - old)
    a = adv[:, None].expand_as(r)
    per_token = -torch.min(r.clamp(max=3.0) * a, r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * a)
    reference = (per_token * mask).sum() / mask.sum()
    grad, = torch.autograd.grad(loss, logp)
    expected, = torch.autograd.grad(reference, logp)
    assert_close(loss, reference, atol=1e-12)
    assert_close(grad, expected, atol=1e-12)
    assert (grad[1, :3] == 0).all() and grad[1, 3:].abs().sum() > 0   # past delta: no gradient, as the bound says
