"""tepokit/diagnostics/forking_tokens.py and the hidden-type task: decision tokens, strategies, per-type results, the
task's make-up."""
import math

import pytest
import torch

import tepo
from tepokit.diagnostics.forking_tokens import (decision_mask, eval_by_type, rollout_fork_metrics, solved_by_either,
                                                strategy_of, top_entropy_mean, valid_format)
from tepokit.diagnostics.stats import pass_at_k
from tepokit.setup.task import CUE_ITEMS, hidden_type_task_size, make_hidden_type_task
from tepokit.core.reward import gold_answer, parse_strict


def test_hidden_type_task_has_the_majority_share_hidden_types_and_type_free_demonstrations():
    task = make_hidden_type_task(9, 4000, 500, seed=1, majority=0.7)
    rows = list(task["train"]) + list(task["test"])
    assert len(task["train"]) == 4000 and len(task["test"]) == 500
    assert not set(task["test"]["question"]) & set(task["train"]["question"])
    share = sum(r["type"] == "add" for r in rows) / len(rows)
    assert abs(share - 0.7) < 0.03                                   # 4,500 draws: 3 standard errors ~ 0.02
    demo_add = sum(strategy_of(r["demonstration"]) == "add" for r in rows) / len(rows)
    assert abs(demo_add - 0.5) < 0.03                                # the warm-up's fair coin
    for kind in ("add", "mul"):                                      # ... independent of the hidden type
        of_kind = [r for r in rows if r["type"] == kind]
        assert abs(sum(strategy_of(r["demonstration"]) == "add" for r in of_kind) / len(of_kind) - 0.5) < 0.05
    for r in rows[:200]:
        name_a_b = [int(x) for x in r["question"].split() if x.isdigit()]
        a, b = name_a_b
        assert gold_answer(r["answer"]) == (a + b if r["type"] == "add" else a * b)
        assert gold_answer(r["demonstration"]) in (a + b, a * b)      # always worked out right
        assert r["question"].count(str(a)) >= 1 and "add" not in r["question"] and "+" not in r["question"]
    assert list(make_hidden_type_task(9, 40, 10, seed=1)["test"]["question"]) == list(task["test"]["question"][:10])
    assert hidden_type_task_size(9) == 10 * 8 * 64


@pytest.mark.parametrize("text, strategy", [("7+3=10\n#### 10", "add"), ("7*3=21\n#### 21", "mul"),
                                            ("7*3+1=22", "mul"), ("73=10", None), ("", None)])
def test_strategy_is_the_first_operator(text, strategy):
    assert strategy_of(text) == strategy


def test_decision_mask_marks_the_first_operator_character():
    mask = decision_mask(["7+3=10", "12*3=36", "nothing", "9+9=18"], (4, 5), "cpu")
    assert mask.tolist() == [[0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0] * 5, [0, 1, 0, 0, 0]]
    assert decision_mask(["1234567*2"], (1, 5), "cpu").sum() == 0            # beyond the completion's tokens


def test_top_entropy_mean_and_valid_format():
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])               # the 10 is padding
    assert top_entropy_mean(entropy, mask, fraction=0.2) == pytest.approx((5 + 4) / 2)   # top 2 of 9
    assert math.isnan(top_entropy_mean(entropy, torch.zeros_like(mask)))
    assert valid_format(["3+4=7\n#### 7", "3+4=7", "#### 8"]).tolist() == [1.0, 0.0, 1.0]


def test_rollout_fork_metrics_by_hand():
    texts = ["2+3=5\n#### 5", "2*3=6\n#### 6", "4+4=8\n#### 8", "4+4=8\n#### 8"]   # 2 groups of 2
    types = ["add", "add", "mul", "mul"]
    T = 14
    mask = torch.ones(4, T)
    entropy = torch.full((4, T), 0.1)
    entropy[:, 1] = torch.tensor([0.6, 0.6, 0.2, 0.2])           # position 1: every decision token
    logp = torch.randn(4, T, dtype=torch.float64)
    adv = torch.tensor([0.7, -0.7, 0.0, 0.0])
    correct = torch.tensor([1.0, 0.0, 0.0, 0.0])
    row = rollout_fork_metrics(texts, types, entropy, logp, adv, mask, correct, group_size=2)
    assert row["forks/entropy"] == pytest.approx(0.4)
    assert row["forks/entropy_rest"] == pytest.approx(0.1)
    assert row["forks/strategies_per_group"] == 1.5               # {+, *} and {+}
    assert row["forks/majority_share"] == 0.75
    assert row["accuracy/add"] == 0.5 and row["accuracy/mul"] == 0.0
    assert row["format/valid"] == 1.0
    at_fork = torch.zeros(4, T)
    at_fork[:, 1] = 1
    x, a = logp[:, 1], adv.double()                                # Cov over the 4 decision tokens, by hand
    assert row["forks/cov_logp_adv"] == pytest.approx(((x - x.mean()) * (a - a.mean())).mean().item())
    assert "forks/entropy" not in rollout_fork_metrics(texts, None, entropy, logp, adv, mask, correct, 2)
    other_tokenizer = rollout_fork_metrics(texts, types, entropy, logp, adv, mask, correct, 2,
                                           one_token_per_character=False)
    assert "forks/entropy" not in other_tokenizer and other_tokenizer["forks/strategies_per_group"] == 1.5


def test_eval_by_type_splits_pass_at_k_and_accuracy():
    types = ["add", "mul", "add", "mul", "add"]
    greedy = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    right = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])     # K = 2 samples of the first 3 problems
    texts = ["#### 1"] * 5 + ["nope"]
    row = eval_by_type(greedy, right, texts, types, pass_k=2)
    assert row["eval/accuracy/add"] == pytest.approx(2 / 3) and row["eval/accuracy/mul"] == 0.5
    assert row["eval/pass@2/add"] == pytest.approx((1 + 0) / 2)    # problems 0 and 2
    assert row["eval/pass@1/mul"] == pytest.approx(pass_at_k(2, 1, 1))
    assert row["eval/mean@2/mul"] == 0.5
    assert row["eval/format"] == pytest.approx(5 / 6)
    assert parse_strict(texts[0]) is not None
    assert set(tepo.__all__) >= {"entropy_bonus"}


def test_problems_either_operator_solves_are_left_out_of_each_type_and_counted():
    """2 and 2: 2+2 = 2*2, so a right answer there says nothing about the type chosen. With the answers given,
    eval_by_type and rollout_fork_metrics leave such problems out of each type's results."""
    answers = ["2*2=4\n#### 4", "3*2=6\n#### 6", "2+2=4\n#### 4", "3+4=7\n#### 7"]
    types = ["mul", "mul", "add", "add"]
    greedy = torch.tensor([1.0, 0.0, 1.0, 0.0])
    right = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    texts = ["2+2=4\n#### 4"] * 2 + ["3+2=5\n#### 5"] * 2 + ["2+2=4\n#### 4"] * 2 + ["3+4=7\n#### 7"] * 2
    row = eval_by_type(greedy, right, texts, types, pass_k=2, answers=answers)
    assert row["eval/solved_by_either"] == 2
    assert row["eval/accuracy/mul"] == 0.0 and row["eval/pass@2/mul"] == 0.0     # only 3 x 2 is counted
    assert row["eval/accuracy/add"] == 0.0 and row["eval/mean@2/add"] == 0.5
    kept = eval_by_type(greedy, right, texts, types, pass_k=2)                        # without answers: all four
    assert kept["eval/accuracy/mul"] == 0.5 and kept["eval/solved_by_either"] == 0
    mask, zeros = torch.ones(4, 14), torch.zeros(4, 14)
    fork = rollout_fork_metrics([texts[i] for i in (0, 2, 4, 6)], types, zeros, zeros, torch.zeros(4), mask,
                                torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, answers=answers)
    assert fork["accuracy/mul"] == 0.0 and fork["accuracy/add"] == 1.0
    assert solved_by_either("2*2=4\n#### 4") and not solved_by_either("3*3=9\n#### 9")
    assert not solved_by_either("7-3=4\n#### 4")                                      # not a hidden-type answer


def test_the_cue_variant_keeps_the_questions_and_demonstrations_and_its_cue_is_right_on_its_share():
    """--cue 0.9: the same questions and warm-up demonstrations as the task without a cue (so the same start
    model), the item word's type right on about 90% of the problems, the majority's share still about 0.70, and
    a policy that follows the cue scores about 0.9 where always adding scores 0.7."""
    plain = make_hidden_type_task(9, 4000, 500, seed=1, majority=0.7)
    cued = make_hidden_type_task(9, 4000, 500, seed=1, majority=0.7, cue=0.9)
    for split in ("train", "test"):
        assert plain[split]["question"] == cued[split]["question"]
        assert plain[split]["demonstration"] == cued[split]["demonstration"]
    rows = list(cued["train"]) + list(cued["test"])
    for r in rows:
        item = r["question"].split()[3][:-1]                         # "Ann has 7 cups and ...": cup
        assert r["cue"] == ("add" if item in CUE_ITEMS["add"] else "mul")
        a, b = (int(x) for x in r["question"].split() if x.isdigit())
        assert gold_answer(r["answer"]) == (a + b if r["type"] == "add" else a * b)
    follows = sum(r["type"] == r["cue"] for r in rows) / len(rows)
    adds = sum(r["type"] == "add" for r in rows) / len(rows)
    assert abs(follows - 0.9) < 0.015 and abs(adds - 0.7) < 0.03      # 4,500 draws: 3 standard errors
    assert "cue" not in plain["train"].column_names
    texts = ["3+4=7", "3*4=12", "3*4=12", "3+4=7"]
    row = rollout_fork_metrics(texts, ["add", "mul", "add", "mul"], torch.zeros(4, 8), torch.zeros(4, 8),
                               torch.zeros(4), torch.ones(4, 8), torch.zeros(4), 2, cues=["add", "mul", "mul", "mul"])
    assert row["forks/cue_share"] == 0.75
    sampled = eval_by_type(torch.zeros(2), torch.zeros(2, 2), texts, ["add", "mul"], pass_k=2, cues=["add", "add"])
    assert sampled["eval/cue_share"] == 0.5     # problem 0: + and * (cue add), problem 1: * and + (cue add)
