"""Student's t distribution for intervals over few paired rounds (comm-bench's routed vs even
all_to_all, verify's interleaved runs, compare's per-run figures), for the probe that prints it and the
analysis that judges it alike: its distribution function through the
regularised incomplete beta function, its quantile by bisection, and the t interval. Pure math."""

from __future__ import annotations

import math


def t_interval(estimate: float, se: float, df: float, alpha: float) -> tuple[float, float, float]:
    """estimate ± t_{1-alpha/2, df} · se and the two-sided p-value of estimate = 0."""
    if se <= 0:
        return estimate, estimate, 0.0 if estimate else 1.0
    t = t_quantile(1 - alpha / 2, df)
    p = 2.0 * (1.0 - t_cdf(abs(estimate) / se, df))
    return estimate - t * se, estimate + t * se, float(min(1.0, max(p, 0.0)))


def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function (through the regularised incomplete beta function)."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2, 0.5, x)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Inverse of `t_cdf` by bisection (60 halvings: far below any figure we print).

    >>> round(t_quantile(0.975, 10), 3)
    2.228
    """
    low, high = -1e3, 1e3
    for _ in range(60):
        mid = (low + high) / 2
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) by its continued fraction (Lentz's method)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast on this side only
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return math.exp(log_front) * h / a


def paired_ratio(a: list[float], b: list[float], alpha: float = 0.05) -> tuple[float, float, float] | None:
    """B / A over rounds paired by position, as (ratio, low, high): the t interval on the mean log ratio
    (df = rounds − 1). Rounds are the independent units; pairing takes out load that drifted between
    them. None with fewer than 2 positive pairs.

    >>> r, low, high = paired_ratio([10, 11, 9, 10], [11, 12, 10, 11])
    >>> round(r, 2), low > 1.0
    (1.1, True)
    """
    logs = [math.log(y / x) for x, y in zip(a, b, strict=False) if x > 0 and y > 0]
    if len(logs) < 2:
        return None
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / (len(logs) - 1))
    low, high, _ = t_interval(mean, sd / math.sqrt(len(logs)), len(logs) - 1, alpha)
    return math.exp(mean), math.exp(low), math.exp(high)
