"""Divergence as a trend: a loss that climbs over a window and does not come back, and an eval loss that
rises from its best and stays up (pure numpy; the findings are built in stability.checks).

`find_divergence` (in _spikes) compares where the log *ends* with its best, so a run whose train loss
climbed 0.12 -> 0.33 over 450 steps and then dropped to 0.18 at an epoch boundary (a fine-tune that
memorises: each new epoch starts lower) read as "did not diverge". `find_climb` looks at the whole curve:

    smooth    medians of blocks of n/16 points (at least 2, at most 200), in log space
    climb     the block furthest above the best before it (the running minimum): at least CLIMB_RATIO×
              that best and DIVERGENCE_MIN_ABS nats above it, reached over at least MIN_CLIMB_BLOCKS blocks
              with a Mann–Kendall z of at least CLIMB_Z (a steady rise; a sharp jump is a spike and judged
              as one), so one epoch-boundary drop after it cannot hide it
    recovered the curve came back within RECOVERED_RATIO× that best before the log ends

`find_eval_rise` does the same for the eval loss the log prints (a handful of points): the last one and the
one before it at least √CLIMB_RATIO× the best, the last CLIMB_RATIO×: "doubling and never recovering".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ciuic_doctor.analysis.stats.spikes import DIVERGENCE_MIN_ABS
from ciuic_doctor.analysis.stats.trend import robust_trend

CLIMB_RATIO = 1.5
RECOVERED_RATIO = 1.1  # back within 10 % of the best: the excursion is over
MIN_CLIMB_BLOCKS = 4
CLIMB_Z = 3.0  # Mann–Kendall: p < 0.0015 one-sided that the blocks rise
EVAL_MIN_POINTS = 3
WARMING_FRACTION = 0.95  # the LR is still warming up while below 95 % of its peak and rising


@dataclass(kw_only=True)
class Climb:
    onset_step: int  # first step after the best block
    peak_step: int
    best: float
    peak: float
    final: float
    ratio: float  # peak / best
    final_ratio: float  # final / best
    recovered_step: int | None  # first step back within RECOVERED_RATIO× the best
    steps: int  # onset to peak
    lr_warming: bool  # the LR was still rising to its peak during the climb
    lr_at_onset: float | None
    lr_peak: float | None


@dataclass(kw_only=True)
class EvalRise:
    best_step: int
    best: float
    last_step: int
    last: float
    ratio: float
    points: int


def _blocks(n: int) -> int:
    """Points per block: 16 blocks or more (a climb needs MIN_CLIMB_BLOCKS of them), at most 200 points."""
    return int(min(200, max(2, n // 16)))


def find_climb(
    steps: np.ndarray, values: np.ndarray, lr: np.ndarray | None = None, *, quantum: float = 0.0
) -> Climb | None:
    """The steady climb of a positive series furthest above its best so far (None when there is none)."""
    ok = np.isfinite(values) & (values > 0)
    s, y = steps[ok], np.log(values[ok])
    rates = lr[ok] if lr is not None and len(lr) == len(values) else None
    n = len(y)
    window = _blocks(n)
    count = n // window
    if count < 2 * MIN_CLIMB_BLOCKS:
        return None
    first = n - count * window
    smooth = np.median(y[first:].reshape(count, window), axis=1)
    best = np.minimum.accumulate(smooth)
    gap = smooth - best
    top = int(np.argmax(gap))
    if gap[top] < math.log(CLIMB_RATIO):
        return None
    low = int(np.flatnonzero(smooth[: top + 1] <= best[top])[-1])  # the best block before the peak
    if top - low < MIN_CLIMB_BLOCKS:
        return None  # a sharp jump: a spike, judged by the spike detector
    trend = robust_trend(list(range(low, top + 1)), smooth[low : top + 1].tolist())
    if trend is None or trend.z < CLIMB_Z:
        return None
    with np.errstate(over="ignore"):
        best_value, peak_value = float(np.exp(best[top])), float(np.exp(smooth[top]))
        final_value = float(np.exp(smooth[-1]))
    if peak_value - best_value < max(DIVERGENCE_MIN_ABS, 10 * quantum):
        return None
    back = np.flatnonzero(smooth[top + 1 :] - best[top] <= math.log(RECOVERED_RATIO))
    onset_index = first + (low + 1) * window
    peak_index = first + top * window + int(np.argmax(y[first + top * window : first + (top + 1) * window]))
    recovered = None if not len(back) else int(s[first + (top + 1 + int(back[0])) * window])
    warming, at_onset, peak_lr = False, None, None
    if rates is not None and np.isfinite(rates).any():
        peak_lr = float(np.nanmax(rates))
        at_onset = float(rates[onset_index]) if math.isfinite(rates[onset_index]) else None
        during = rates[onset_index : peak_index + 1]
        during = during[np.isfinite(during)]
        warming = bool(
            at_onset is not None
            and peak_lr > 0
            and at_onset < WARMING_FRACTION * peak_lr
            and len(during) > 1
            and during[-1] > during[0]
        )
    return Climb(
        onset_step=int(s[onset_index]),
        peak_step=int(s[peak_index]),
        best=best_value,
        peak=peak_value,
        final=final_value,
        ratio=peak_value / best_value,
        final_ratio=final_value / best_value,
        recovered_step=recovered,
        steps=int(s[peak_index] - s[onset_index]),
        lr_warming=warming,
        lr_at_onset=at_onset,
        lr_peak=peak_lr,
    )


def find_eval_rise(points: list[tuple[int, float]], *, quantum: float = 0.0) -> EvalRise | None:
    """An eval loss whose last point is CLIMB_RATIO× its best, the one before √CLIMB_RATIO× (it stayed up)."""
    finite = sorted((int(s), float(v)) for s, v in points if math.isfinite(v) and v > 0)
    if len(finite) < EVAL_MIN_POINTS:
        return None
    best_step, best = min(finite, key=lambda p: p[1])
    last_step, last = finite[-1]
    before = finite[-2][1]
    if best_step >= last_step or last < CLIMB_RATIO * best or before < math.sqrt(CLIMB_RATIO) * best:
        return None
    if last - best < max(DIVERGENCE_MIN_ABS, 10 * quantum):
        return None
    return EvalRise(
        best_step=best_step, best=best, last_step=last_step, last=last, ratio=last / best, points=len(finite)
    )
