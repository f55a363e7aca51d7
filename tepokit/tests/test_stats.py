"""tepokit/diagnostics/stats.py: t quantiles and intervals, pass@k, the accuracy AUC, against independent
computations."""
import math

import pytest
import torch

from tepokit.diagnostics.stats import (MIN_STEPS_FOR_R, accuracy_auc, pass_at_k, pass_k_values, pearson,
                                       student_t_central, t_interval, t_quantile_975)
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


@pytest.mark.parametrize("a, b, expected", [((5, 5), (0, 5), 2 / 252), ((4, 5), (0, 5), 0.047619),
                                            ((2, 5), (0, 5), 0.444444), ((5, 5), (5, 5), 1.0),
                                            ((3, 5), (1, 5), 0.523810), ((2, 5), (4, 5), 0.523810)])
def test_fisher_exact_against_hand_computed_tables(a, b, expected):
    """P(x successes in arm a) = C(5, x) C(5, s - x) / C(10, s) for s successes in all.
    5/5 vs 0/5 (s = 5): only the two extreme tables are as rare as the observed, 1/252 each: 2/252.
    4/5 vs 0/5 (s = 4): 5, 50, 100, 50, 5 (/210) for x = 0..4; observed 5/210, with x = 0: 10/210 = 0.047619.
    2/5 vs 0/5 (s = 2): 10, 25, 10 (/45); observed 10/45, with x = 0: 20/45. 3/5 vs 1/5: 110/210 = 0.523810."""
    from tepokit.diagnostics.stats import fisher_exact_two_sided
    assert fisher_exact_two_sided(*a, *b) == pytest.approx(expected, abs=1e-6)
    assert fisher_exact_two_sided(*b, *a) == pytest.approx(expected, abs=1e-6)          # symmetric in the arms


@pytest.mark.parametrize("successes, a_n, b_n", [(5, 5, 5), (7, 9, 4), (3, 6, 10), (0, 3, 3)])
def test_the_tables_with_fixed_margins_have_probabilities_that_sum_to_one(successes, a_n, b_n):
    from tepokit.diagnostics.stats import fisher_exact_two_sided, hypergeometric_table_probabilities
    probabilities = hypergeometric_table_probabilities(successes, a_n, b_n)
    assert sum(probabilities.values()) == pytest.approx(1.0, abs=1e-12)
    most_probable = max(probabilities, key=probabilities.get)       # the likeliest table: nothing is rarer than it
    assert fisher_exact_two_sided(most_probable, a_n, successes - most_probable, b_n) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        fisher_exact_two_sided(6, 5, 0, 5)


@pytest.mark.parametrize("t, dof", [(2.776, 4), (12.706, 1), (2.262, 9), (2.571, 5)])
def test_paired_t_p_is_005_at_the_textbook_975_quantile(t, dof):
    from tepokit.diagnostics.stats import paired_t_p
    n = dof + 1
    values = [1.0, -1.0] * (n // 2) + [0.0] * (n % 2)           # mean 0: then shift so that mean / se = t
    std = math.sqrt(sum(v * v for v in values) / (n - 1))
    shifted = [v + t * std / math.sqrt(n) for v in values]
    assert paired_t_p(shifted) == pytest.approx(0.05, abs=1e-3)
    assert paired_t_p([-v for v in shifted]) == pytest.approx(0.05, abs=1e-3)   # two-sided


def test_paired_t_p_agrees_with_the_interval_and_handles_degenerate_samples():
    from tepokit.diagnostics.stats import paired_t_p
    d = [18.6 - 24.2, 8.2 - 9.8, 27.4 - 23.0]         # the interval test's: mean -0.93, std 5.03, t = -0.321, 2 dof
    assert paired_t_p(d) == pytest.approx(1 - student_t_central(abs(sum(d) / 3) / (5.0332 / math.sqrt(3)), 2),
                                          abs=1e-4)
    assert paired_t_p(d) == pytest.approx(0.7785, abs=1e-3)      # t = 0.3213 at 2 dof (tables: p = 0.78)
    low_edge = [1.0, 2.0, 3.0, 4.0, 5.0]
    half = t_interval(low_edge)["half_width"]
    assert paired_t_p([v - 3.0 + half for v in low_edge]) == pytest.approx(0.05, abs=1e-9)   # the bound touches 0
    assert paired_t_p([0.0] * 5) == 1.0 and paired_t_p([0.2] * 5) == 0.0     # zero variance: the limits
    assert math.isnan(paired_t_p([1.0]))


def test_holm_against_a_hand_worked_family():
    """p sorted: 0.01 (x4 = 0.04), 0.015 (x3 = 0.045), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04 -> 0.06, monotone).
    At 0.05 the first two are rejected, and the step-down stops at the third."""
    from tepokit.diagnostics.stats import holm
    got = holm({"a": 0.03, "b": 0.01, "c": 0.04, "d": 0.015})
    assert {k: round(v["adjusted_p"], 10) for k, v in got.items()} == {"b": 0.04, "d": 0.045, "a": 0.06, "c": 0.06}
    assert [k for k, v in got.items() if v["rejected"]] == ["b", "d"]
    assert holm({"x": 0.6, "y": 0.9})["x"]["adjusted_p"] == 1.0               # capped at 1
    assert holm({"x": 0.6, "y": 0.9})["y"]["adjusted_p"] == 1.0
    assert holm({}) == {}
    with pytest.raises(ValueError):
        holm({"x": float("nan")})
