"""The statistics behind the report's intervals (SciPy for the distributions).

- ``t_interval``: mean and two-sided interval of a small sample (Student's t, n - 1
  degrees of freedom, ``scipy.stats.t``): the seed-paired difference of two variants;
  ``t_pvalue`` its two-sided p-value, ``holm`` the Holm step-down adjustment of a
  family of p-values.
- ``wilson``: the Wilson score interval of a binomial proportion (an accuracy over n
  samples; it stays inside [0, 1] at 0 or n successes, where the normal one does not).
- ``bootstrap``: a percentile bootstrap over evaluation units (windows, samples), the
  units drawn jointly for every series (paired) and within each stratum (domain).
  ``scipy.stats.bootstrap`` has no strata and no blocks, hence our own loop.
- ``seeds_for_power``: how many seeds a two-sided paired t-test needs for 80% power at
  an observed effect and paired SD (SciPy's noncentral t, exact, not the normal
  approximation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats as sps

LEVEL = 0.95  # every interval of the report
BOOT_DRAWS = 2000  # percentile bootstrap resamples: the 2.5% tail holds 50 draws
BOOT_SEED = 0  # the bootstrap's generator: a report is the same every time it is written
POWER = 0.80  # the power ``seeds_for_power`` asks for
POWER_MAX_SEEDS = 100_000  # beyond this, "more than" (an effect of ~0 at any spread)


def student_t_ppf(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"student_t_ppf: needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    return float(sps.t.ppf(p, df))


def normal_ppf(p: float) -> float:
    """The p-quantile of the standard normal."""
    return float(sps.norm.ppf(p))


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


def t_pvalue(xs: Sequence[float]) -> float | None:
    """The two-sided p-value of the one-sample t-test of mean 0 (None: zero variance)."""
    x = np.asarray(xs, dtype=np.float64)
    s = float(x.std(ddof=1)) if len(x) > 1 else 0.0
    if s == 0.0:
        return None
    t = float(x.mean()) / (s / math.sqrt(len(x)))
    return float(2.0 * sps.t.sf(abs(t), len(x) - 1))


def holm(pvalues: Sequence[float]) -> list:
    """Holm's step-down adjusted p-values (family-wise error), in the input's order."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def wilson(successes: float, n: int, level: float = LEVEL) -> tuple:
    """(p, lo, hi): the Wilson score interval of ``successes`` out of ``n``."""
    if n <= 0:
        raise ValueError("wilson: needs n > 0")
    z = normal_ppf(0.5 + level / 2.0)
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(0.0, p * (1 - p)) / n + z * z / (4 * n * n)) / denom
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
    values = bootstrap_values(statistic, strata, draws, seed)
    alpha = (1.0 - level) / 2.0
    return float(np.quantile(values, alpha)), float(np.quantile(values, 1.0 - alpha))


def bootstrap_values(
    statistic: Callable[[list], float], strata: Sequence[int], draws: int = BOOT_DRAWS, seed: int = BOOT_SEED
) -> np.ndarray:
    """The ``draws`` resampled values of ``statistic`` (see ``bootstrap``)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    values = np.empty(draws, dtype=np.float64)
    for b in range(draws):
        values[b] = statistic([rng.integers(0, n, size=n) for n in strata])
    return values


def paired_t_power(effect: float, sd: float, n: int, level: float = LEVEL) -> float:
    """The power of the two-sided paired t-test at ``n`` pairs for a true mean difference
    ``effect`` with paired SD ``sd`` (noncentral t with n - 1 df, noncentrality
    effect / sd * sqrt(n))."""
    df, nc = n - 1, effect / sd * math.sqrt(n)
    crit = float(sps.t.ppf(0.5 + level / 2.0, df))
    return float(sps.nct.sf(crit, df, nc) + sps.nct.cdf(-crit, df, nc))


def seeds_for_power(effect: float, sd: float, power: float = POWER, level: float = LEVEL) -> int | None:
    """The fewest seeds (n >= 2) whose two-sided paired t-test has ``power`` at the observed
    ``effect`` and paired ``sd``; None when sd is 0 or there is no effect to detect, or when
    more than POWER_MAX_SEEDS would be needed."""
    if not (sd > 0.0) or effect == 0.0 or not math.isfinite(effect / sd):
        return None
    if paired_t_power(effect, sd, POWER_MAX_SEEDS, level) < power:
        return None
    lo, hi = 1, 2  # power(lo) < power <= power(hi); power rises with n
    while paired_t_power(effect, sd, hi, level) < power:
        lo, hi = hi, hi * 2
    hi = min(hi, POWER_MAX_SEEDS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if paired_t_power(effect, sd, mid, level) >= power:
            hi = mid
        else:
            lo = mid
    return hi


def excludes_zero(lo: float | None, hi: float | None) -> bool | None:
    """Whether an interval excludes zero (None when there is no interval)."""
    if lo is None or hi is None:
        return None
    return lo > 0.0 or hi < 0.0
