"""The statistics the runs report: Pearson's r, the Wald interval of an accuracy, pass@k (Chen et al. 2021), the
area under the accuracy curve, Student's t intervals (closed form, no SciPy) for paired differences over seeds and
their p-values, Fisher's exact test of two counts of successes, and Holm's correction of a family of p-values."""

from __future__ import annotations

import math

import torch

# The fewest steps whose entropy changes make a per-step correlation worth printing. With 3 points r is near +-1
# by chance alone (to differ from 0 at the 5% level it must exceed 0.997; with 5 points, 0.88), so a run with
# fewer checked steps reports "too few steps" instead of a number.
MIN_STEPS_FOR_R = 5


def pearson(x: list[float], y: list[float], at_least: int = 3) -> float:
    """Pearson's r over the pairs where both values are finite; nan with fewer than `at_least` pairs."""
    pairs = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < max(3, at_least):
        return float("nan")
    xs, ys = torch.tensor(pairs, dtype=torch.float64).T
    return torch.corrcoef(torch.stack([xs, ys]))[0, 1].item()


def wald_half_width(p: float, n: int) -> float:
    """Half-width of the 95% (Wald) interval of a fraction p over n independent problems: 1.96 sqrt(p(1-p)/n).
    For a mean of per-problem values in [0, 1] (pass@k, mean@k) it is an upper bound: their variance is at most
    p(1-p)."""
    return 1.96 * math.sqrt(p * (1 - p) / n)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem from n samples of which c are right (Chen et al. 2021,
    arXiv 2107.03374, eq. 1): 1 - C(n-c, k) / C(n, k), the chance that k samples drawn without
    replacement from the n include a right one. Averaging it over problems has less variance than
    drawing only k samples each; k = n gives "any of the n is right", k = 1 gives c / n (= mean@n)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_k_values(k_max: int) -> list[int]:
    """The k of the logged pass@k: every power of two up to k_max, and k_max itself."""
    return sorted({2 ** i for i in range(k_max.bit_length())} | {k_max})


def mean_pass_at_k(n_right: list[int], n: int) -> dict[int, float]:
    """pass@k averaged over problems, for every logged k (pass_k_values(n)): n_right holds the number of right
    samples of each problem, out of its n."""
    return {k: sum(pass_at_k(n, c, k) for c in n_right) / len(n_right) for k in pass_k_values(n)}


def accuracy_auc(steps: list[int], accuracy: list[float]) -> float:
    """Area under the held-out accuracy curve divided by the run's length: the mean height of the curve
    that joins the evaluation points with straight lines (trapezoid rule, step 0 to the last step).
    It averages the noise of several evaluations, where the final accuracy has only one's."""
    if len(steps) == 1:
        return accuracy[0]
    area = sum((s1 - s0) * (a0 + a1) / 2 for s0, s1, a0, a1 in zip(steps, steps[1:], accuracy, accuracy[1:]))
    return area / (steps[-1] - steps[0])


def t_interval(values: list[float]) -> dict:
    """Mean of n values and its 95% interval, mean ± t(0.975, n-1) · std / sqrt(n), std with n-1
    (Student's t: the values are treated as independent draws, here one per seed). With fewer than
    two values there is no interval (low = high = None)."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "half_width": None, "low": None, "high": None}
    mean = sum(values) / n
    if n == 1:
        return {"n": 1, "mean": mean, "std": None, "half_width": None, "low": None, "high": None}
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "half_width": half, "low": mean - half, "high": mean + half}


def t_quantile_975(dof: int) -> float:
    """The 97.5% quantile of Student's t with `dof` degrees of freedom (12.706 for 1, 4.303 for 2,
    2.776 for 4, -> 1.960), by bisection on the exact distribution function student_t_central."""
    low, high = 0.0, 1.0
    while student_t_central(high, dof) < 0.95:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if student_t_central(mid, dof) < 0.95 else (low, mid)
    return (low + high) / 2


def student_t_central(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with an integer number of degrees of freedom, in closed form
    (Abramowitz & Stegun 26.7.3 for odd dof, 26.7.4 for even), with theta = atan(t / sqrt(dof)):
    odd:  2/pi (theta + sin theta (cos theta + 2/3 cos^3 theta + ... + 2*4..(dof-3) / 1*3..(dof-2) cos^(dof-2) theta))
    even: sin theta (1 + 1/2 cos^2 theta + ... + 1*3..(dof-3) / 2*4..(dof-2) cos^(dof-2) theta)."""
    theta = math.atan(t / math.sqrt(dof))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    series = 0.0
    if dof % 2 == 1:
        term = math.cos(theta)
        for j in range((dof - 1) // 2):
            series += term
            term *= (2 * j + 2) / (2 * j + 3) * cos2
        return 2 / math.pi * (theta + sin * series)
    term = 1.0
    for j in range(dof // 2):
        series += term
        term *= (2 * j + 1) / (2 * j + 2) * cos2
    return sin * series


def paired_t_p(values: list[float]) -> float:
    """Two-sided p-value of the one-sample t test that the mean of `values` is 0 (for paired differences: one
    value per seed), t = mean / (std / sqrt(n)) with n - 1 degrees of freedom, std with n - 1, so that p < 0.05
    exactly when t_interval's 95% interval leaves out 0. With fewer than two values there is no test (nan).
    Zero variance (every value equal) makes t infinite or undefined: p = 1 when the values are all 0 and p = 0
    otherwise, a limit, not a measurement: five seeds that agree to the logged digits say nothing about the
    spread a sixth would show."""
    n = len(values)
    if n < 2:
        return float("nan")
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    if variance == 0:
        return 1.0 if mean == 0 else 0.0
    t = abs(mean) / math.sqrt(variance / n)
    return max(0.0, 1.0 - student_t_central(t, n - 1))


def fisher_exact_two_sided(a_success: int, a_n: int, b_success: int, b_n: int) -> float:
    """Two-sided p-value of Fisher's exact test of the 2x2 table (successes and failures of arms a and b):
    with the margins fixed, the successes of arm a follow the hypergeometric distribution; p is the total
    probability of every table at most as probable as the observed one (relative tolerance 1e-7 for the ties of
    floating point, as SciPy's fisher_exact). Symmetric in the two arms; 5/5 against 0/5 gives 2/252."""
    if not (0 <= a_success <= a_n and 0 <= b_success <= b_n):
        raise ValueError(f"successes must lie in [0, n]: {a_success}/{a_n}, {b_success}/{b_n}")
    probabilities = hypergeometric_table_probabilities(a_success + b_success, a_n, b_n)
    observed = probabilities[a_success]
    return min(1.0, sum(p for p in probabilities.values() if p <= observed * (1 + 1e-7)))


def hypergeometric_table_probabilities(successes: int, a_n: int, b_n: int) -> dict[int, float]:
    """{successes of arm a: probability} over every 2x2 table with these margins: C(a_n, x) C(b_n, successes - x)
    / C(a_n + b_n, successes)."""
    total = math.comb(a_n + b_n, successes)
    low, high = max(0, successes - b_n), min(a_n, successes)
    return {x: math.comb(a_n, x) * math.comb(b_n, successes - x) / total for x in range(low, high + 1)}


def holm(pvalues: dict[str, float], alpha: float = 0.05) -> dict[str, dict]:
    """Holm's step-down correction of a family of p-values (Holm 1979): sorted ascending, the i-th smallest of m
    is multiplied by m - i + 1; the adjusted p-values are made monotone (each at least the one before it) and
    capped at 1. A hypothesis is rejected when its adjusted p is at most alpha, which controls the chance of any
    false rejection in the family at alpha. Returns {name: {"p", "adjusted_p", "rejected"}}. A nan p-value (no
    test) has no place in a family: leave it out."""
    if any(math.isnan(p) for p in pvalues.values()):
        raise ValueError("holm: a p-value is nan; leave the comparisons without a test out of the family")
    order = sorted(pvalues, key=lambda name: pvalues[name])
    m, running_max, out = len(order), 0.0, {}
    for i, name in enumerate(order):
        running_max = max(running_max, min(1.0, (m - i) * pvalues[name]))
        out[name] = {"p": pvalues[name], "adjusted_p": running_max, "rejected": running_max <= alpha}
    return out
