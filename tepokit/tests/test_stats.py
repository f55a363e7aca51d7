"""tepokit/diagnostics/stats.py: t quantiles and intervals, pass@k, the accuracy AUC, against independent computations."""
import math

import pytest
import torch

from tepokit.diagnostics.stats import (MIN_STEPS_FOR_R, accuracy_auc, pass_at_k, pass_k_values, pearson, student_t_central,
                           t_interval, t_quantile_975)
from tepokit.tests.helpers import brute_force_pass_at_k


@pytest.mark.parametrize("dof, textbook", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (5, 2.5706),
                                           (9, 2.2622), (10, 2.2281), (29, 2.0452), (100, 1.9840)])
def test_t_quantile_matches_the_textbook_table(dof, textbook):
    assert t_quantile_975(dof) == pytest.approx(textbook, abs=1e-4)


@pytest.mark.parametrize("dof", [1, 2, 3, 4, 5, 8])
def test_student_t_closed_form_matches_the_integrated_density(dof):
    """P(|T| <= t) = 2 * integral_0^t of the density (lgamma form), trapezoid rule on 200,001 points, float64."""
    log_c = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
    for t in (0.3, 1.0, 2.5, 7.0):
        x = torch.linspace(0, t, 200_001, dtype=torch.float64)
        density = torch.exp(log_c - (dof + 1) / 2 * torch.log1p(x ** 2 / dof))
        assert student_t_central(t, dof) == pytest.approx(2 * torch.trapezoid(density, x).item(), abs=1e-9)


def test_t_interval_against_a_hand_computation():
    # The README's per-seed gains, TEPO minus GRPO on seeds 1-3: -5.6, -1.6, +4.4.
    d = [18.6 - 24.2, 8.2 - 9.8, 27.4 - 23.0]
    mean = -2.8 / 3
    std = math.sqrt(((-5.6 - mean) ** 2 + (-1.6 - mean) ** 2 + (4.4 - mean) ** 2) / 2)     # 5.0332
    got = t_interval(d)
    assert got["mean"] == pytest.approx(mean) and got["std"] == pytest.approx(std) and got["n"] == 3
    assert got["half_width"] == pytest.approx(4.3027 * std / math.sqrt(3), rel=1e-4)           # 12.50
    assert (got["low"], got["high"]) == pytest.approx((mean - got["half_width"], mean + got["half_width"]))
    assert t_interval([2.0])["half_width"] is None and t_interval([])["mean"] is None


def test_pass_at_k_equals_enumerating_every_subset_of_k_samples():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)          # k = 1: the fraction right
    assert [pass_at_k(16, c, 16) for c in (0, 1, 16)] == [0.0, 1.0, 1.0]   # k = n: any right
    assert pass_k_values(16) == [1, 2, 4, 8, 16] and pass_k_values(6) == [1, 2, 4, 6]
    assert pass_k_values(1) == [1]


def test_accuracy_auc_is_the_trapezoid_area_over_the_run_length():
    # 25 * (0.2 + 0.4) / 2 + 25 * 0.4 + 10 * (0.4 + 0.5) / 2 = 7.5 + 10 + 4.5 = 22 over 60 steps
    assert accuracy_auc([0, 25, 50, 60], [0.2, 0.4, 0.4, 0.5]) == pytest.approx(22 / 60)
    assert accuracy_auc([0], [0.3]) == 0.3


def test_mean_pass_at_k_averages_each_logged_k_over_problems():
    from tepokit.diagnostics.stats import mean_pass_at_k
    row = mean_pass_at_k([0, 2, 4], 4)
    assert sorted(row) == pass_k_values(4) == [1, 2, 4]
    assert row[1] == pytest.approx((0 + 0.5 + 1) / 3)
    assert row[4] == pytest.approx(2 / 3)                  # any of the 4 right: problems 2 and 3
    assert row[2] == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)  # C(2, 2) / C(4, 2) = 1/6 for the middle one


def test_pearson_needs_enough_finite_pairs_and_equals_the_textbook_formula():
    x, y = [0.1, -0.3, 0.7, 0.2, -0.5, float("nan")], [0.2, -0.1, 0.5, 0.4, -0.6, 1.0]
    n = 5                                                      # the nan pair is left out
    mx, my = sum(x[:n]) / n, sum(y[:n]) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x[:n], y[:n]))
    textbook = sxy / math.sqrt(sum((a - mx) ** 2 for a in x[:n]) * sum((b - my) ** 2 for b in y[:n]))
    assert pearson(x, y, MIN_STEPS_FOR_R) == pytest.approx(textbook, abs=1e-12)
    assert math.isnan(pearson(x[:4], y[:4], MIN_STEPS_FOR_R))   # 4 steps: too few for a per-step r
    assert pearson(x[:4], y[:4]) == pytest.approx(pearson(x[:4], y[:4], 4))   # the default asks for 3
    assert math.isnan(pearson(x[:2], y[:2]))
