"""Where entropy collapse shows: the decision tokens of a rollout, and the hidden-type task's strategies.

Most tokens of a worked answer are near-deterministic (copying a number, `####`); a few "forking" tokens
carry the decisions (Wang et al., arXiv 2506.01939). A mean over all tokens dilutes what happens at them,
so a collapse at the forks can hide under a mean entropy that barely moves. Two views of the forks:

  - any task: the mean entropy of the top 20% of a rollout's tokens by entropy (Wang et al.'s forks);
  - the hidden-type task (tepokit/setup/task.py): its known decision token, the operator each completion chose
    (its strategy), the entropy there, the number of distinct strategies in each group, and the
    accuracy of each hidden type.

And the sign that tells a collapse from a policy that breaks: the share of completions in the valid
`#### n` format stays near 1 in a collapse and falls when the policy breaks (docs/collapse.md).
The built-in tokenizer has one token per character, so a character's index in a completion's text is
its token's position: the decision positions are read from the texts (built-in model only).
"""

from __future__ import annotations

import re

import torch

import tepo
from tepokit.diagnostics.stats import mean_pass_at_k
from tepokit.setup.task import HIDDEN_TYPES
from tepokit.core.reward import parse_strict

TOP_FRACTION = 0.2      # Wang et al.'s share of forking tokens


def valid_format(texts: list[str]) -> torch.Tensor:
    """1.0 where a completion ends in a readable `#### n` (right or wrong), else 0.0.        -> [B]"""
    return torch.tensor([float(parse_strict(t) is not None) for t in texts])


def top_entropy_mean(entropy: torch.Tensor, mask: torch.Tensor, fraction: float = TOP_FRACTION) -> float:
    """Mean entropy of the top `fraction` of valid tokens by entropy.                   [B, T], [B, T] -> float"""
    values = entropy[mask.bool()]
    if values.numel() == 0:
        return float("nan")
    k = max(1, round(fraction * values.numel()))
    return values.float().topk(k).values.mean().item()


def decision(text: str) -> tuple[int, str] | None:
    """Where a completion of the hidden-type task decides, and what: (the position of its first operator, the
    type that operator solves), e.g. "7+3=10" -> (1, "add"); None when it has no operator."""
    found = [(text.find(op), kind) for kind, op in HIDDEN_TYPES.items() if op in text]
    return min(found) if found else None


def strategy_of(text: str) -> str | None:
    """The hidden-type task's strategy of a completion: the type its first operator solves ("add" or "mul")."""
    found = decision(text)
    return found[1] if found else None


def each_solved_by_either(answers: list[str] | None, n: int) -> list[bool]:
    """solved_by_either of each of n problems, from their right worked answers; none when those are not known."""
    return [solved_by_either(a) for a in answers] if answers is not None else [False] * n


def solved_by_either(answer: str) -> bool:
    """Does either operator solve this hidden-type problem? Only 2 and 2 (2+2 = 2*2): a right answer there says
    nothing about which type the policy chose, so the per-type results leave such problems out."""
    found = re.match(r"(\d+)[+*](\d+)=", answer)
    return found is not None and int(found[1]) + int(found[2]) == int(found[1]) * int(found[2])


def decision_mask(texts: list[str], shape: tuple, device) -> torch.Tensor:
    """1 at each completion's decision token (its first operator; character tokenizer), else 0.   -> [B, T]"""
    mask = torch.zeros(shape, dtype=torch.long, device=device)
    for row, text in enumerate(texts):
        found = decision(text)
        if found and found[0] < shape[1]:
            mask[row, found[0]] = 1
    return mask


def rollout_fork_metrics(texts: list[str], types: list[str] | None, entropy: torch.Tensor, logp: torch.Tensor,
                         adv: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor, group_size: int,
                         one_token_per_character: bool = True, answers: list[str] | None = None,
                         cues: list[str] | None = None) -> dict:
    """One rollout's forks. entropy, logp [B, T] (the rollout policy's), adv [B], mask [B, T], correct [B];
    answers [B] the right worked answers (their problems that either operator solves are left out of the
    accuracy of each type), cues [B] the type each row's item word points to (the cue variant) or None.
    The decision token's position is read from the text, so its metrics need one token per character (the
    built-in tokenizer); with another tokenizer (--model) they are left out.

      entropy/top20              mean entropy of the top 20% of tokens by entropy (any task)
      format/valid               share of completions with a readable `#### n` (any task)
    The hidden-type task (types given), at the decision token (the operator):
      forks/entropy              mean entropy there; forks/entropy_rest: at every other valid token
      forks/cov_logp_adv         Cov(log pi, A) over the decision tokens (Cui et al.: > 0 lowers entropy)
      forks/strategies_per_group distinct strategies among a group's completions (1: the group agrees)
      forks/majority_share       share of completions that chose the majority's strategy
      accuracy/<type>            the rollout's accuracy on the problems of each hidden type (solved_by_either
                                 problems left out)
      forks/cue_share            the cue variant: share of completions that chose the type the cue points to
    """
    row = {"entropy/top20": top_entropy_mean(entropy, mask), "format/valid": valid_format(texts).mean().item()}
    if types is None:
        return row
    strategies = [strategy_of(t) for t in texts]
    groups = [strategies[i:i + group_size] for i in range(0, len(strategies), group_size)]
    row |= {"forks/strategies_per_group": sum(len({s for s in g if s}) for g in groups) / len(groups),
            "forks/majority_share": sum(s == next(iter(HIDDEN_TYPES)) for s in strategies) / len(strategies)}
    if one_token_per_character:
        at_fork = decision_mask(texts, mask.shape, mask.device) * mask
        rest = mask * (1 - at_fork)
        row |= {"forks/entropy": tepo.masked_mean(entropy, at_fork.bool()).item(),
                "forks/entropy_rest": tepo.masked_mean(entropy, rest.bool()).item(),
                "forks/cov_logp_adv": tepo.masked_mean(tepo.token_covariance(logp, adv.to(logp.device), at_fork),
                                                       at_fork.bool()).item()}
    if cues is not None:
        row["forks/cue_share"] = sum(s == c for s, c in zip(strategies, cues)) / len(strategies)
    either = each_solved_by_either(answers, len(types))
    for kind in HIDDEN_TYPES:
        rows = [i for i, t in enumerate(types) if t == kind and not either[i]]
        if rows:
            row[f"accuracy/{kind}"] = correct[rows].mean().item()
    return row


def eval_by_type(greedy: torch.Tensor, right: torch.Tensor, sampled_texts: list[str], types: list[str],
                 pass_k: int, answers: list[str] | None = None, cues: list[str] | None = None) -> dict:
    """Held-out results of each hidden type: greedy accuracy [N], pass@k and mean@k from the K samples of the
    first problems (right [problems, K]), and the valid-format share of those samples. answers [N], the right
    worked answers: the problems either operator solves are left out of each type's results and counted
    (eval/solved_by_either). cues [N] (the cue variant): eval/cue_share, the share of the samples that chose the
    type the cue points to."""
    either = each_solved_by_either(answers, len(types))
    row = {"eval/format": valid_format(sampled_texts).mean().item(), "eval/solved_by_either": float(sum(either))}
    if cues is not None:
        chosen = [strategy_of(t) for t in sampled_texts]                    # K samples of each problem in turn
        row["eval/cue_share"] = sum(s == cues[i // pass_k] for i, s in enumerate(chosen)) / max(1, len(chosen))
    for kind in HIDDEN_TYPES:
        greedy_rows = [i for i, t in enumerate(types) if t == kind and not either[i]]
        sampled_rows = [i for i in greedy_rows if i < right.shape[0]]
        if greedy_rows:
            row[f"eval/accuracy/{kind}"] = greedy[greedy_rows].mean().item()
        if sampled_rows:
            n_right = right[sampled_rows].sum(1).long().tolist()
            row |= {f"eval/pass@{k}/{kind}": value for k, value in mean_pass_at_k(n_right, pass_k).items()}
            row[f"eval/mean@{pass_k}/{kind}"] = right[sampled_rows].mean().item()
    return row
