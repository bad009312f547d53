"""The statistics behind every comparison: is the change between two runs larger than their own noise?

Step times are autocorrelated (a busy neighbour, a DataLoader refill, the allocator warming up slow several
consecutive steps), so resampling single steps would understate the noise and call noise a change. The
circular block bootstrap (Politis & Romano 1992) resamples blocks of consecutive steps instead; the block
length comes from the series' own autocorrelation by the Politis & White (2004) rule with the correction of
Patton, Politis & White (2009), the rule the `arch` package implements as `optimal_block_length`.

Each run is resampled on its own (two runs are independent), the statistic is the ratio B / A of a level
(mean step time, mean samples/s). The bootstrap gives the standard error of the log ratio (with blocks of
BLOCK_FACTOR × the Politis-White length and a k / (k − 1) small-sample correction, see BLOCK_FACTOR); the
95 % interval is log r ± t · se with the degrees of freedom counted in blocks, and the p-value is the same
t test's, so p < alpha exactly when the interval excludes 1. Several comparisons in one check (per rank,
per size, per configuration) are judged together with Holm's step-down correction, so "significant"
keeps its 5 % meaning for the family.

RNG seeds are fixed: the same two runs always give the same interval.

>>> import numpy as np
>>> rng = np.random.default_rng(1)
>>> a = 0.100 + 0.005 * rng.standard_normal(60)
>>> r = ratio_of_means(a, a * 0.9)
>>> round(r.ratio, 3), r.ci_low < 0.9 < r.ci_high, r.p_value < 0.05
(0.9, True, True)
>>> holm([0.01, 0.04, 0.03])
[0.03, 0.06, 0.06]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from ciuic_doctor.measures.student import t_cdf, t_interval, t_quantile  # noqa: F401 - their API

REPLICATES = 2000  # bootstrap replicates: the 2.5 % tail then rests on 50 replicates
SEED = 20260401
ALPHA = 0.05
MIN_SAMPLES = 5  # fewer values than this say nothing about their own noise
# Blocks three times the Politis-White length: that rule minimises the error of the variance estimate,
# which at the 40-60 steps of a short job still leaves it low. Measured, nominal 5 %: on AR(1) series
# (phi 0.3-0.8, n 38-58) 1x gave 12-20 % false positives; on 40-step draws from a real recording of the
# embedded job under load (tests/data/compare) 2x gave 11-13 %, 3x with the k / (k - 1) correction below
# 6-9 % (12 % where the load holds for 16 steps at a time); AR(1) 5-8 % (benchmarks/compare_fpr.py).
BLOCK_FACTOR = 3


@dataclass(kw_only=True)
class RatioEstimate:
    """B / A of a level, its 1 - alpha interval, the two-sided p-value, and how it was resampled."""

    ratio: float
    ci_low: float
    ci_high: float
    p_value: float
    n_a: int
    n_b: int
    block_a: int
    block_b: int
    method: str


def block_length(values: Sequence[float] | np.ndarray) -> int:
    """Circular-bootstrap block length for `values` (Politis & White 2004; Patton et al. 2009).

    The significant autocorrelations decide how far the flat-top kernel reaches: the smallest lag m after
    which K_N = max(5, sqrt(log10 n)) consecutive autocorrelations stay inside 2 sqrt(log10 n / n); the
    kernel reaches 2 m. The block is (2 G² / D)^(1/3) n^(1/3), capped at min(3 sqrt(n), n / 3), at least 1.

    >>> block_length([1.0, 2.0] * 30) >= 1
    True
    >>> block_length(list(range(60))) > 5  # a trend: strong autocorrelation, long blocks
    True
    """
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n < MIN_SAMPLES:
        return 1
    x = x - x.mean()
    var = float(x @ x) / n
    if var <= 0:
        return 1
    k_n = max(5, math.ceil(math.sqrt(math.log10(n))))
    m_max = math.ceil(math.sqrt(n)) + k_n
    max_lag = min(n - 1, m_max + k_n)
    acov = np.array([float(x[: n - k] @ x[k:]) / n for k in range(max_lag + 1)])
    rho = acov / var
    threshold = 2.0 * math.sqrt(math.log10(n) / n)
    m_hat = m_max
    for m in range(max_lag - k_n + 1):
        if np.all(np.abs(rho[m + 1 : m + 1 + k_n]) < threshold):
            m_hat = m
            break
    reach = min(2 * max(m_hat, 1), m_max, max_lag)
    lags = np.arange(-reach, reach + 1)
    t = np.abs(lags) / reach
    kernel = np.where(t <= 0.5, 1.0, np.where(t <= 1.0, 2.0 * (1.0 - t), 0.0))
    cov = acov[np.abs(lags)]
    g = float(np.sum(kernel * np.abs(lags) * cov))
    d = (4.0 / 3.0) * float(np.sum(kernel * cov)) ** 2
    if d <= 0 or g == 0:
        return 1
    b = (2.0 * g * g / d) ** (1.0 / 3.0) * n ** (1.0 / 3.0)
    return int(max(1, min(round(b), math.ceil(3 * math.sqrt(n)), n // 3)))


def circular_block_indices(n: int, block: int, replicates: int, rng: np.random.Generator) -> np.ndarray:
    """(replicates, n) indices: blocks of `block` consecutive positions, wrapping at the end (circular, so
    the first and last steps are drawn as often as the middle ones)."""
    blocks = math.ceil(n / block)
    starts = rng.integers(0, n, size=(replicates, blocks))
    idx = (starts[:, :, None] + np.arange(block)) % n
    return idx.reshape(replicates, blocks * block)[:, :n]


def _log_level_replicates(
    x: np.ndarray, level: Callable[..., np.ndarray], rng: np.random.Generator, *, blocks: bool
) -> tuple[np.ndarray, int]:
    """Bootstrap replicates of log(level(x)) and the block length used."""
    block = min(BLOCK_FACTOR * block_length(x), max(1, len(x) // 3)) if blocks else 1
    with np.errstate(divide="ignore", invalid="ignore"):
        reps = np.log(level(x[circular_block_indices(len(x), block, REPLICATES, rng)], axis=1))
    return reps[np.isfinite(reps)], block


MIN_LEVEL, MAX_LEVEL = 1e-12, 1e18  # a picosecond of step time up to an exabyte of memory
MAX_LOG_RATIO = math.log(1e9)  # a change a billion-fold is a mix-up of runs or units, not a change


def ratio_of_means(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    alpha: float = ALPHA,
    seed: int = SEED,
    blocks: bool = True,
    level: Callable[..., np.ndarray] = np.mean,
) -> RatioEstimate:
    """level(b) / level(a), its 1 - alpha interval and two-sided p-value.

    The standard error of the log ratio comes from a circular block bootstrap of each run (iid bootstrap
    with blocks=False: for separate measurements, not a series, such as loader windows); the interval is
    log r ± t · se with Welch-Satterthwaite degrees of freedom counted in blocks (n / block − 1 per run),
    because a 40-step series of 8-step blocks holds 5 independent pieces of information, not 40.
    """
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(xa) < MIN_SAMPLES or len(xb) < MIN_SAMPLES:
        raise ValueError(f"need at least {MIN_SAMPLES} values per run, got {len(xa)} and {len(xb)}")
    level_a, level_b = float(level(xa)), float(level(xb))
    if not (level_a > 0 and level_b > 0):
        raise ValueError("a ratio needs positive levels in both runs")
    # A level that is subnormal or infinite is no measurement, and its ratio under- or overflows (a step
    # time of 5e-324 s made the ratio 0 and the log a "math domain error"): say which run's level it is.
    for name, value in (("A", level_a), ("B", level_b)):
        if not MIN_LEVEL <= value <= MAX_LEVEL:
            raise ValueError(
                f"run {name}'s level {value:.3g} is not a measurement "
                f"(outside {MIN_LEVEL:g} to {MAX_LEVEL:g})"
            )
    if abs(math.log(level_b) - math.log(level_a)) > MAX_LOG_RATIO:
        raise ValueError(
            f"the two levels {level_a:.3g} and {level_b:.3g} are {math.e**MAX_LOG_RATIO:.0g} or more "
            "apart: not one job's measurements"
        )
    rng = np.random.default_rng(seed)
    ra, block_a = _log_level_replicates(xa, level, rng, blocks=blocks)
    rb, block_b = _log_level_replicates(xb, level, rng, blocks=blocks)
    df_a, df_b = max(len(xa) / block_a - 1, 1.0), max(len(xb) / block_b - 1, 1.0)
    # The bootstrap variance divides by the number of blocks, as a sample variance with ddof=0 would:
    # with 5 blocks that is 20 % low. Scale it by k / (k − 1), as ddof=1 does.
    var_a = float(np.var(ra)) * (df_a + 1) / df_a
    var_b = float(np.var(rb)) * (df_b + 1) / df_b
    se = math.sqrt(var_a + var_b)
    df = (var_a + var_b) ** 2 / (var_a**2 / df_a + var_b**2 / df_b) if se > 0 else df_a + df_b
    low, high, p_value = t_interval(math.log(level_b / level_a), se, df, alpha)
    return RatioEstimate(
        ratio=level_b / level_a,
        ci_low=math.exp(low),
        ci_high=math.exp(high),
        p_value=p_value,
        n_a=len(xa),
        n_b=len(xb),
        block_a=block_a,
        block_b=block_b,
        method=(
            "circular block bootstrap (3x Politis-White block), t interval on the log ratio"
            if blocks
            else "bootstrap, t interval on the log ratio"
        ),
    )


def ratio_from_log_normal(
    ratio: float, sd_log: float, *, n_a: int = 1, n_b: int = 1, alpha: float = ALPHA
) -> RatioEstimate:
    """A ratio whose log has a known standard error (collective timings summarised per size): the normal
    interval exp(log r ± z sd) and its two-sided p-value."""
    z = NormalDist().inv_cdf(1 - alpha / 2)
    log_r = math.log(ratio)
    p = math.erfc(abs(log_r) / (sd_log * math.sqrt(2))) if sd_log > 0 else (0.0 if log_r else 1.0)
    return RatioEstimate(
        ratio=ratio,
        ci_low=math.exp(log_r - z * sd_log),
        ci_high=math.exp(log_r + z * sd_log),
        p_value=p,
        n_a=n_a,
        n_b=n_b,
        block_a=1,
        block_b=1,
        method="normal on log ratio (noise from repeated measurements within each run)",
    )


def mean_difference(
    diffs: Sequence[float] | np.ndarray, *, alpha: float = ALPHA, seed: int = SEED
) -> tuple[float, float, float, float]:
    """Mean of paired differences (B − A at matched steps), its interval and p-value, from a circular
    block bootstrap of the difference series (the same t interval as `ratio_of_means`)."""
    d = np.asarray(diffs, dtype=float)
    block = min(BLOCK_FACTOR * block_length(d), max(1, len(d) // 3))
    rng = np.random.default_rng(seed)
    reps = d[circular_block_indices(len(d), block, REPLICATES, rng)].mean(axis=1)
    low, high, p = t_interval(float(d.mean()), float(np.std(reps)), max(len(d) / block - 1, 1.0), alpha)
    return float(d.mean()), low, high, p


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values: reject where adjusted < alpha; the family-wise error rate stays
    at alpha for any dependence between the tests (Holm 1979)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [1.0] * len(p_values)
    running = 0.0
    m = len(p_values)
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = round(running, 12)
    return adjusted


def count_test(k_a: int, n_a: int, k_b: int, n_b: int) -> float:
    """Two-sided exact test that two event counts (skipped steps) come from the same per-step rate:
    conditional on k_a + k_b events, k_b ~ Binomial(k, n_b / (n_a + n_b))."""
    k = k_a + k_b
    if k == 0 or n_a + n_b == 0:
        return 1.0
    q = n_b / (n_a + n_b)
    probs = [math.comb(k, i) * q**i * (1 - q) ** (k - i) for i in range(k + 1)]
    observed = probs[k_b]
    return float(min(1.0, sum(p for p in probs if p <= observed * (1 + 1e-9))))
