"""Robust trend of a noisy series: Theil–Sen slope, R² of that line, Mann–Kendall z (numpy only).

Why these: memory series carry outliers (a GC pass, a checkpoint save, a burst of pinned buffers) that
drag an ordinary least-squares slope; the Theil–Sen slope (median of pairwise slopes) ignores up to
~29 % of wild points. Mann–Kendall asks only "does y tend to rise with x", so together with a minimum
growth and R² it keeps a flat, noisy series from being called a leak. R² leaves out residuals beyond
4 robust σ for the same reason: one sample read while a process was dying would otherwise hide a
perfect line.

Long series are first reduced to at most `MAX_POINTS` bins (median x and y per bin): the pairwise
slopes are O(n²), and bin medians also damp sample noise.

>>> fit = robust_trend([0, 1, 2, 3, 4, 5, 6, 7], [10, 12, 14, 16, 18, 20, 22, 24])
>>> fit.slope, round(fit.r2, 3), fit.z > 3
(2.0, 1.0, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MAX_POINTS = 200
OUTLIER_MADS = 4.0  # a residual beyond 4 robust σ (1.4826 × MAD) is an outlier, left out of R²
# A single step (two flat levels) must leave at most this share of the line's squared residuals to be the
# better account of a series: a steady leak leaves a step 4x the line's, a one-time jump the reverse.
SHIFT_SSE_RATIO = 0.5


@dataclass(kw_only=True)
class Trend:
    slope: float  # y units per x unit
    intercept: float
    r2: float  # of the Theil–Sen line over the inliers (see module doc); < 0 when worse than the mean
    z: float  # Mann–Kendall z: > 3 is a rising trend with p < 0.0015 (one-sided), noise gives |z| ≲ 2
    n: int  # points used (after binning)
    x_first: float
    x_last: float
    y_start: float  # the fitted line at x_first
    y_end: float  # the fitted line at x_last

    @property
    def growth(self) -> float:
        """Fitted growth over the observed span."""
        return self.slope * (self.x_last - self.x_first)


def _binned(x, y):  # numpy arrays -> numpy arrays
    import numpy as np

    if len(x) <= MAX_POINTS:
        return x, y
    order = np.argsort(x, kind="stable")
    chunks = np.array_split(order, MAX_POINTS)
    return (
        np.array([np.median(x[c]) for c in chunks]),
        np.array([np.median(y[c]) for c in chunks]),
    )


def robust_trend(x: Sequence[float], y: Sequence[float]) -> Trend | None:
    """Theil–Sen line, its R² and the Mann–Kendall z of y against x; None with fewer than 3 points
    or no spread in x."""
    import numpy as np

    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = _binned(xa[keep], ya[keep])
    n = len(xa)
    if n < 3 or np.ptp(xa) == 0:
        return None
    i, j = np.triu_indices(n, k=1)
    dx, dy = xa[j] - xa[i], ya[j] - ya[i]
    distinct = dx != 0
    slope = float(np.median(dy[distinct] / dx[distinct]))
    intercept = float(np.median(ya - slope * xa))
    residual = ya - (slope * xa + intercept)
    mad = float(np.median(np.abs(residual - np.median(residual))))
    inlier = np.abs(residual - np.median(residual)) <= OUTLIER_MADS * 1.4826 * mad
    ss_res = float(np.sum(residual[inlier] ** 2))
    ss_tot = float(np.sum((ya[inlier] - ya[inlier].mean()) ** 2))
    r2 = (1.0 if ss_res == 0 else 0.0) if ss_tot == 0 else 1 - ss_res / ss_tot
    # Mann–Kendall S over pairs ordered by x (pairs with equal x carry no order and are left out)
    s = float(np.sum(np.sign(dy[distinct]) * np.sign(dx[distinct])))
    variance = n * (n - 1) * (2 * n + 5) / 18
    z = 0.0 if s == 0 else (s - math.copysign(1, s)) / math.sqrt(variance)
    x_first, x_last = float(xa.min()), float(xa.max())
    return Trend(
        slope=slope,
        intercept=intercept,
        r2=r2,
        z=z,
        n=n,
        x_first=x_first,
        x_last=x_last,
        y_start=slope * x_first + intercept,
        y_end=slope * x_last + intercept,
    )


@dataclass(kw_only=True)
class LevelShift:
    """A series better told as two flat levels than as a line: a one-time jump (an epoch boundary's
    buffers, a lazily built cache), not a leak. mnist's jump between epochs was called a leak.
    """

    at_x: float  # first x of the upper level
    before: float  # median level before
    after: float  # median level after
    sse_ratio: float  # two-level squared residuals / the line's

    @property
    def jump(self) -> float:
        return self.after - self.before


def level_shift(x: Sequence[float], y: Sequence[float], line: Trend) -> LevelShift | None:
    """The best single step of `y` against `x` when it explains the series at least twice as well as
    `line` (SHIFT_SSE_RATIO) with at least 3 points on each side; else None.

    >>> xs = list(range(20))
    >>> shift = level_shift(xs, [100] * 10 + [160] * 10, robust_trend(xs, [100] * 10 + [160] * 10))
    >>> shift.at_x, shift.jump
    (10.0, 60.0)
    >>> level_shift(xs, [100 + 3 * v for v in xs], robust_trend(xs, [100 + 3 * v for v in xs])) is None
    True
    """
    import numpy as np

    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = _binned(xa[keep], ya[keep])
    order = np.argsort(xa, kind="stable")
    xa, ya = xa[order], ya[order]
    n = len(ya)
    if n < 6:
        return None
    line_sse = float(np.sum((ya - (line.slope * xa + line.intercept)) ** 2))
    csum, csq = np.cumsum(ya), np.cumsum(ya**2)
    k = np.arange(3, n - 2)  # split before index k: 3 or more points each side
    left_sse = csq[k - 1] - csum[k - 1] ** 2 / k
    right_n = n - k
    right_sum, right_sq = csum[-1] - csum[k - 1], csq[-1] - csq[k - 1]
    right_sse = right_sq - right_sum**2 / right_n
    total = left_sse + right_sse
    best = int(np.argmin(total))
    split, step_sse = int(k[best]), max(float(total[best]), 0.0)
    if line_sse <= 0 or step_sse > SHIFT_SSE_RATIO * line_sse:
        return None
    return LevelShift(
        at_x=float(xa[split]),
        before=float(np.median(ya[:split])),
        after=float(np.median(ya[split:])),
        sse_ratio=step_sse / line_sse,
    )
