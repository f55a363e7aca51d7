"""tepokit/diagnostics/kl_mask_details.py: details.jsonl, where TEPO's KL mask falls in each step."""
import os

import pytest

from tepokit.tests.helpers import MICRO, run_main, read_rows, read_details


# No DAPO filter, so that every step has both groups and makes epochs x mini_batches = 4 optimizer
# steps; a band wide enough that the ratios are not all clipped.
DETAILS_ARGS = [*MICRO, "--objective", "tepo", "--steps", "3", "--no-dynamic-sampling", "--epochs", "2",
                "--eps-low", "0.05", "--eps-high", "0.05"]


@pytest.fixture(scope="module")
def details_run(workdir):
    """A micro TEPO run (default criterion cov): its metrics rows and details rows."""
    out = "runs/details_cov"
    run_main([*DETAILS_ARGS, "--out", out])
    return read_rows(out), read_details(out)


def test_details_jsonl_has_one_row_per_step_with_consistent_lengths(details_run):
    metrics, details = details_run
    assert [d["step"] for d in details] == [1, 2, 3]
    for d, m in zip(details, metrics[1:]):
        for key in ("kl_mask_frac_by_minibatch", "kl_mask_frac_cov_by_minibatch", "kl_mask_frac_measured_by_minibatch"):
            assert len(d[key]) == 2 * 2, key                          # epochs x mini_batches
            assert all(0 <= f <= 1 for f in d[key]), key
        masked, valid = d["kl_mask_position_counts"], d["valid_position_counts"]
        assert len(masked) == len(valid) <= 12                           # T <= --max-new-tokens
        assert all(0 <= k <= v for k, v in zip(masked, valid))
        # every valid token of the 8 completions is counted once per epoch
        assert sum(valid) == 2 * round(8 * m["completions/mean_length"])
        sample = d["sample"]
        n = len(sample["tokens"])
        assert 1 <= n <= 12 and isinstance(sample["prompt"], str) and sample["prompt"].endswith("\n")
        for key in ("kl_mask", "kl_mask_cov", "kl_mask_measured", "entropy", "entropy_after", "cov", "log_ratio"):
            assert len(sample[key]) == n, key
        for key in ("kl_mask", "kl_mask_cov", "kl_mask_measured"):
            assert set(sample[key]) <= {0, 1}, key
        assert sample["kl_mask"] == sample["kl_mask_cov"]            # the configured criterion is cov
        if sample["advantage"] <= 0:                                  # A <= 0: never masked
            assert not any(sample["kl_mask_cov"]) and not any(sample["kl_mask_measured"])


def test_details_measured_mask_is_empty_before_any_update_and_configured_is_cov(details_run):
    """First mini-batch: the policy is the rollout policy, so no entropy has fallen (H < H_old is
    false everywhere). Later mini-batches follow an optimizer step, where it can be true."""
    _, details = details_run
    for d in details:
        assert d["kl_mask_frac_measured_by_minibatch"][0] == 0
        assert d["kl_mask_frac_by_minibatch"] == d["kl_mask_frac_cov_by_minibatch"]
    assert any(f > 0 for d in details for f in d["kl_mask_frac_measured_by_minibatch"][1:])


def test_details_mask_fractions_average_to_the_objectives_kl_mask_frac(details_run):
    metrics, details = details_run
    for d, m in zip(details, metrics[1:]):
        fracs = d["kl_mask_frac_by_minibatch"]
        assert abs(sum(fracs) / len(fracs) - m["kl_mask/frac"]) < 1e-6


def test_details_follow_the_measured_criterion_when_configured_even_with_beta_0(workdir):
    """--beta 0: the mask has no effect on the loss but is still computed and logged."""
    out = "runs/details_measured"
    run_main([*DETAILS_ARGS, "--steps", "2", "--entropy-criterion", "measured", "--beta", "0", "--out", out])
    metrics, details = read_rows(out), read_details(out)
    assert [d["step"] for d in details] == [1, 2]
    for d, m in zip(details, metrics[1:]):
        assert d["kl_mask_frac_by_minibatch"] == d["kl_mask_frac_measured_by_minibatch"]
        assert d["sample"]["kl_mask"] == d["sample"]["kl_mask_measured"]
        assert abs(sum(d["kl_mask_frac_by_minibatch"]) / 4 - m["kl_mask/frac"]) < 1e-6


def test_non_tepo_run_writes_no_details(workdir):
    out = "runs/details_grpo"
    run_main([*MICRO, "--objective", "grpo", "--steps", "1", "--out", out])
    assert os.path.exists(os.path.join(out, "metrics.jsonl"))
    assert not os.path.exists(os.path.join(out, "details.jsonl"))
