"""Pearson's chi-square goodness-of-fit test, without scipy (for sampling-distribution tests)."""
from __future__ import annotations

import math
from collections.abc import Sequence


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the upper regularized gamma Q(df/2, x/2),
    from the lower one's power series (exact enough for the p-values tests compare)."""
    s, x = df / 2.0, statistic / 2.0
    if x <= 0:
        return 1.0
    term = total = 1.0 / s
    n = 0
    while term > total * 1e-15 and n < 100_000:
        n += 1
        term *= x / (s + n)
        total += term
    lower = math.exp(s * math.log(x) - x - math.lgamma(s)) * total
    return max(0.0, 1.0 - lower)


def chi_square_pvalue(observed: Sequence[int], expected_probs: Sequence[float],
                      min_expected: float = 5.0) -> float:
    """p-value of `observed` counts against `expected_probs` (cells with an expected count
    under `min_expected` are pooled into one, as the test's approximation requires)."""
    n = sum(observed)
    stat, df = 0.0, -1
    pooled_obs, pooled_exp = 0, 0.0
    for obs, prob in zip(observed, expected_probs):
        exp = n * prob
        if exp < min_expected:
            pooled_obs += obs
            pooled_exp += exp
            continue
        stat += (obs - exp) ** 2 / exp
        df += 1
    if pooled_exp > 0:
        if pooled_exp < 1e-12:
            return 0.0 if pooled_obs else chi2_sf(stat, max(df, 1))
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    return chi2_sf(stat, max(df, 1))
