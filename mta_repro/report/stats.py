"""The statistics behind the report's intervals, in plain float64 (no SciPy at run time).

- ``t_interval``: mean and two-sided interval of a small sample (Student's t, n - 1
  degrees of freedom): the seed-paired difference of two variants.
- ``wilson``: the Wilson score interval of a binomial proportion (an accuracy over n
  samples; it stays inside [0, 1] at 0 or n successes, where the normal one does not).
- ``bootstrap``: a percentile bootstrap over evaluation units (windows, samples), the
  units drawn jointly for every series (paired) and within each stratum (domain).
- ``student_t_ppf``: the quantile of Student's t, by bisection on its CDF through the
  regularised incomplete beta function (Numerical Recipes' continued fraction).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

LEVEL = 0.95  # every interval of the report
BOOT_DRAWS = 2000  # percentile bootstrap resamples: the 2.5% tail holds 50 draws
BOOT_SEED = 0  # the bootstrap's generator: a report is the same every time it is written


def _betacf(a: float, b: float, x: float) -> float:
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def student_t_ppf(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom (|error| < 1e-12)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"student_t_ppf: needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -student_t_ppf(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def normal_ppf(p: float) -> float:
    """The p-quantile of the standard normal (bisection on erf)."""
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def mean_std(xs: Sequence[float]) -> tuple:
    """(mean, sample standard deviation with n - 1; None for one value)."""
    x = np.asarray(xs, dtype=np.float64)
    return float(x.mean()), (float(x.std(ddof=1)) if len(x) > 1 else None)


def t_interval(xs: Sequence[float], level: float = LEVEL) -> tuple:
    """(mean, lo, hi): the two-sided ``level`` t-interval of the mean of ``xs`` (n >= 2)."""
    x = np.asarray(xs, dtype=np.float64)
    n = len(x)
    if n < 2:
        raise ValueError("t_interval: needs at least two values")
    m, s = float(x.mean()), float(x.std(ddof=1))
    half = student_t_ppf(0.5 + level / 2.0, n - 1) * s / math.sqrt(n)
    return m, m - half, m + half


def wilson(successes: float, n: int, level: float = LEVEL) -> tuple:
    """(p, lo, hi): the Wilson score interval of ``successes`` out of ``n``."""
    if n <= 0:
        raise ValueError("wilson: needs n > 0")
    z = normal_ppf(0.5 + level / 2.0)
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return p, max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(
    statistic: Callable[[list], float],
    strata: Sequence[int],
    draws: int = BOOT_DRAWS,
    seed: int = BOOT_SEED,
    level: float = LEVEL,
) -> tuple:
    """(lo, hi): the percentile interval of ``statistic`` over resamples. ``strata[i]`` is
    the number of units in stratum i; each resample draws, within every stratum, that
    many unit indices with replacement and passes ``statistic`` one index array per
    stratum (the same indices for every series it computes: a paired bootstrap)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    values = np.empty(draws, dtype=np.float64)
    for b in range(draws):
        values[b] = statistic([rng.integers(0, n, size=n) for n in strata])
    alpha = (1.0 - level) / 2.0
    return float(np.quantile(values, alpha)), float(np.quantile(values, 1.0 - alpha))


def resolved(lo: float | None, hi: float | None) -> bool | None:
    """Whether an interval excludes zero (None when there is no interval)."""
    if lo is None or hi is None:
        return None
    return lo > 0.0 or hi < 0.0
