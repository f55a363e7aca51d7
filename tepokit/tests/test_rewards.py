"""The rewards of --reward (tepokit/core/reward.py REWARDS): each one on texts written to hit and miss it, the
weighted sum the advantages see, each reward's mean in metrics.jsonl, and bad --reward values refused."""
from decimal import Decimal

import pytest
import torch

import tepo
import train_small as ts
from tepokit.core.reward import REWARDS, parse_reward_spec, reward_spec_problem, weighted_rewards
from tepokit.tests.helpers import MICRO, assert_refused_in_one_line, read_rows, run_main

TEXTS = ["3+4=7\n#### 7", "3+4=7\n#### 8", "so it is 7", "#### 7 apples", "#### 1,007", ""]
GOLDS = [Decimal(7), Decimal(7), Decimal(7), Decimal(7), Decimal(1007), Decimal(7)]


def test_each_reward_reads_what_its_name_says():
    assert [REWARDS["strict"](t, g) for t, g in zip(TEXTS, GOLDS)] == [1, 0, 0, 0, 1, 0]     # right, final ####
    assert [REWARDS["lenient"](t, g) for t, g in zip(TEXTS, GOLDS)] == [1, 0, 1, 1, 1, 0]    # right, last number
    assert [REWARDS["format"](t, g) for t, g in zip(TEXTS, GOLDS)] == [1, 1, 0, 0, 1, 0]     # a final ####, any number
    assert REWARDS["strict"]("#### 7", None) == REWARDS["lenient"]("7", None) == 0          # an unreadable gold


def test_the_weighted_sum_is_what_the_advantages_see_and_each_reward_is_kept_apart():
    rewards, parts = weighted_rewards(TEXTS, GOLDS, "strict,format:0.1,lenient:-0.5")
    expected = [1.0 * s + 0.1 * f - 0.5 * lenient for s, f, lenient in
                zip([1, 0, 0, 0, 1, 0], [1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 1, 0])]
    assert rewards.tolist() == pytest.approx(expected, abs=1e-7)
    assert parts["format"].tolist() == [1, 1, 0, 0, 1, 0] and set(parts) == {"strict", "format", "lenient"}
    assert parse_reward_spec("strict") == [("strict", 1.0)]
    args, cfg = ts.Args(reward="strict,format:0.25"), tepo.config_for("dapo")         # DAPO: the length cost too
    lengths = torch.tensor([3, 24, 24, 20, 5, 1])
    scored = ts.compute_rewards(TEXTS, GOLDS, lengths, args, cfg)
    cost = tepo.soft_overlong_punishment(lengths.float(), args.max_new_tokens, args.overlong_cache)
    assert cost.abs().sum() > 0
    assert scored["rewards"].tolist() == pytest.approx((parts["strict"] + 0.25 * parts["format"] + cost).tolist())
    assert scored["strict"].tolist() == [1, 0, 0, 0, 1, 0] and scored["lenient"].tolist() == [1, 0, 1, 1, 1, 0]


@pytest.mark.parametrize("spec, problem", [("strict,foo", "'foo' is not a reward"), ("strict:inf", "finite"),
                                           ("strict:x", "finite"), ("strict,strict", "once"), ("", "not a reward")])
def test_bad_reward_values_are_named(spec, problem):
    assert problem in reward_spec_problem(spec)


@pytest.mark.parametrize("spec", ["strict,foo", "format:nan", "strict,,format"])
def test_bad_reward_values_are_refused_in_one_line_and_nothing_is_written(spec, tmp_path):
    assert_refused_in_one_line(["--reward", spec, "--out", str(tmp_path / "run")], "--reward",
                               "strict, lenient, format")
    assert not (tmp_path / "run").exists()


def test_each_reward_is_logged_apart_and_the_reward_is_their_weighted_sum(tmp_path):
    run_main([*MICRO, "--reward", "lenient,format:0.5", "--objective", "grpo", "--steps", "2", "--out", str(tmp_path)])
    rows = read_rows(tmp_path)[1:]
    for row in rows:
        assert row["reward"] == pytest.approx(row["rewards/lenient/mean"] + 0.5 * row["rewards/format/mean"])
        assert row["rewards/lenient/mean"] == pytest.approx(row["accuracy/lenient"])
    assert any(row["rewards/lenient/mean"] > 0 for row in rows)
