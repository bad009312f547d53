"""Spike and divergence detection on a loss or grad-norm curve (pure numpy/pandas, no findings here).

A loss curve is not a stationary signal: it decays (fast in warm-up, slowly after), its noise grows with
its level, it is logged every step or as interval means, and it has gaps. So each point is compared with
its own neighbourhood, in log space (where noise proportional to the level has one width everywhere):

    noise σ   RMS of |Δ log| over the 128 points around, winsorized at 3× its median (robust to the
              spikes; differences remove the trend; ~90 % of a standard deviation's efficiency, so a 6σ
              line is not pulled to 5σ by a window that came out narrow by chance)
    baseline  median of the 64 points around (no lag on a trend, a spike of a few points barely moves
              it) — or of the 8 points before, where the 8 after sit ≥ 3σ above the 8 before (a spike
              that recovers slowly, which a centred median would ride on). 8 points lag a steady trend by
              4.5 points, less than the 6.3 a trend needs to reach the line on its own.
    spike     x / baseline − 1 ≥ max(6σ, 5 %) for the loss (a batch mean of token losses: roughly
              Gaussian noise around its level); log x − log baseline ≥ max(6σ, log 1.5) for the grad norm
              (skewed, closer to log-normal)

A spike starts at the first point over the line; the baseline is then frozen and the spike lasts until the
curve is back within 3σ of it (recovered_after_steps) or the data ends (not recovered). While a spike has
not recovered, a fresh jump over the line (the point before it was not over) of at least 25 % is a spike of
its own; a loss that ramps up stays one spike. The first 16 points have no σ and are not judged.

OLMo-core's StabilityMonitor also draws its line at 6σ, but of raw values around a mean of the 128
before, which a trend inflates and warm-up leaves unjudged (benchmarks/stability_rules.py compares them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ROBUST_SIGMA = 1.4826 / math.sqrt(2)  # MAD -> σ for a Gaussian, and Δ of two points has √2 σ
NESTED_MIN_RISE = 0.25  # a second spike on top of one still up
SLOW_SPIKE_Z = 3.0  # the 8 points after sit this many σ above the 8 before: a spike still up, not noise
WINSOR = 3.0  # |Δ| capped at 3× its median = 2.02 σ_Δ (median |Z| is 0.6745)


def _capped_second_moment(a: float) -> float:
    """E[min(Z², a²)] for a standard normal Z: what winsorizing at ±a leaves of the variance."""
    phi = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
    inside = math.erf(a / math.sqrt(2))  # P(|Z| < a)
    return inside - 2 * a * phi + a * a * (1 - inside)


WINSOR_CORRECTION = _capped_second_moment(WINSOR * 0.6745)


@dataclass(kw_only=True)
class SpikeRule:
    z: float = 6.0
    min_rise: float = 0.05  # a loss spike is at least 5 % above its baseline, however quiet the curve
    baseline_points: int = 8
    noise_points: int = 128
    min_history: int = 16
    recover_z: float = 3.0
    relative: bool = True  # threshold on x/b − 1 (loss) or on log x − log b (grad norm)


LOSS_RULE = SpikeRule()
GRAD_NORM_RULE = SpikeRule(min_rise=0.5, relative=False)  # noisier and skewed; a spike is ≥ 1.5× baseline


@dataclass(kw_only=True)
class Spike:
    start_step: int
    peak_step: int
    peak: float
    baseline: float
    magnitude: float  # peak / baseline
    recovered_after_steps: int | None
    end_step: int
    points: int  # logged points above the recovery line

    def to_evidence(self) -> dict:
        return {
            "peak": self.peak,
            "peak_step": self.peak_step,
            "baseline": self.baseline,
            "magnitude": round(self.magnitude, 3),
            "recovered_after_steps": self.recovered_after_steps,
            "points": self.points,
        }


def robust_bands(y: np.ndarray, rule: SpikeRule) -> tuple[np.ndarray, np.ndarray]:
    """(baseline, σ) for each point of log-values `y` (NaN where there is too little before it)."""
    import pandas as pd

    series = pd.Series(y)
    sigma = _noise(series.diff().abs(), rule)
    before = series.rolling(rule.baseline_points, min_periods=rule.baseline_points).median().shift(1)
    before = before.to_numpy()
    # Offline the points after are known too: a median of the 64 points around the point has no lag on a
    # trend and a third of the noise of 8 points before, and a spike of a few points barely moves it.
    # Only where the 8 points after are clearly higher than the 8 before (a spike that recovers slowly,
    # which the centred median would ride on) is the baseline the median of the 8 points before.
    centred = series.rolling(8 * rule.baseline_points + 1, center=True).median().to_numpy()
    after = series[::-1].rolling(rule.baseline_points).median()[::-1].shift(-1).to_numpy()
    with np.errstate(invalid="ignore"):
        riding = (after - before > SLOW_SPIKE_Z * sigma) | np.isnan(centred)
    baseline = np.where(riding, before, centred)
    baseline[np.isnan(before)] = np.nan
    return baseline, sigma


def _noise(steps, rule: SpikeRule) -> np.ndarray:  # |Δ log| Series -> σ per point
    """σ from |Δ| in a window centred on each point: |Δ| winsorized at 3× its median (a spike adds two
    capped terms, not two huge ones), then root-mean-square, corrected for the cap and for Δ having √2 σ.
    That estimator has ~90 % of the efficiency of a plain standard deviation, against 37 % for the median
    alone, so a 6σ line is not pulled to 5σ by a window whose median came out low by chance. Early, where
    fewer than `noise_points` come before, the median estimate from the points before is used when it is
    the wider (the steep start of a curve widens its differences)."""
    import pandas as pd

    window = rule.noise_points + 1
    median = steps.rolling(window, min_periods=rule.min_history, center=True).median().to_numpy()
    capped = pd.Series(np.minimum(steps.to_numpy(), WINSOR * median) ** 2)
    mean_square = capped.rolling(window, min_periods=rule.min_history, center=True).mean().to_numpy()
    sigma = np.sqrt(mean_square / WINSOR_CORRECTION / 2.0)
    past = steps.rolling(rule.noise_points, min_periods=rule.min_history).median().shift(1).to_numpy()
    early = slice(0, rule.noise_points)
    sigma[early] = np.fmax(past[early] * ROBUST_SIGMA, sigma[early])
    sigma[np.isnan(past)] = np.nan
    return sigma


def find_spikes(steps: np.ndarray, values: np.ndarray, rule: SpikeRule = LOSS_RULE) -> list[Spike]:
    """Upward spikes of a positive series; non-finite and non-positive points are left out."""
    ok = np.isfinite(values) & (values > 0)
    s, v = steps[ok], values[ok]
    n = len(v)
    if n <= rule.min_history:
        return []
    y = np.log(v)
    baseline, sigma = robust_bands(y, rule)
    floor = math.log1p(rule.min_rise)
    if rule.relative:  # x/b − 1 ≥ zσ: a batch-mean loss has roughly Gaussian noise around its level
        threshold = np.maximum(np.log1p(rule.z * sigma), floor)
    else:  # log x − log b ≥ zσ: a norm's noise is skewed, closer to log-normal
        threshold = np.maximum(rule.z * sigma, floor)
    with np.errstate(invalid="ignore"):
        over = (y - baseline) >= threshold
    spikes: list[Spike] = []
    starts: list[int] = []
    next_free = 0
    for i in np.flatnonzero(over):
        # Inside a spike that has not recovered, only a fresh jump (the point before was not over the line)
        # once the baseline has moved onto the spike's level, and a clear one (≥ 25 %: a spike's tail is
        # steep and noisy), is a spike of its own; a ramp is one spike.
        if i < next_free:
            fresh = not over[i - 1] and i - starts[-1] > rule.baseline_points
            level = float(np.median(y[i - rule.baseline_points : i]))  # where the earlier spike is now
            if not fresh or y[i] - level < max(threshold[i], math.log1p(NESTED_MIN_RISE)):
                continue
        base, noise = baseline[i], sigma[i]
        level = base + max(rule.recover_z * noise, floor / 2)
        back = np.flatnonzero(y[i + 1 :] <= level)
        j = i + 1 + int(back[0]) if len(back) else n
        start = i
        peak = start + int(np.argmax(y[start:j]))
        spikes.append(
            Spike(
                start_step=int(s[start]),
                peak_step=int(s[peak]),
                peak=float(v[peak]),
                baseline=float(math.exp(base)),
                magnitude=float(math.exp(y[peak] - base)),
                recovered_after_steps=int(s[j] - s[start]) if j < n else None,
                end_step=int(s[j - 1]),
                points=int(j - start),
            )
        )
        starts.append(start)
        next_free = max(next_free, j)
    return spikes


@dataclass(kw_only=True)
class Divergence:
    onset_step: int
    detected_step: int
    best: float
    final: float
    ratio: float


def find_divergence(
    steps: np.ndarray, values: np.ndarray, *, ratio: float = 1.5, tail_fraction: float = 0.05
) -> Divergence | None:
    """The loss ends ≥ `ratio` × its best (smoothed) level and stayed above √ratio × best for the tail.

    A spike recovers; a divergence does not come back before the log ends. Smoothing is a trailing median
    over max(16, n/50) points so that noise cannot make a best that was never there.
    """
    import pandas as pd

    ok = np.isfinite(values) & (values > 0)
    s, y = steps[ok], np.log(values[ok])
    n = len(y)
    if n < 32:
        return None
    window = int(min(200, max(16, n // 50)))
    smooth = pd.Series(y).rolling(window, min_periods=window // 2).median().to_numpy()
    best = np.fmin.accumulate(np.where(np.isnan(smooth), np.inf, smooth))
    gap = smooth - best
    tail = max(window, int(n * tail_fraction))
    if not (gap[-1] >= math.log(ratio) and np.all(gap[-tail:] >= 0.5 * math.log(ratio))):
        return None
    # Onset: the bottom of the U — where the curve last sat at its best before the rise.
    rising = np.flatnonzero(gap < 0.5 * math.log(ratio))
    last_low = int(rising[-1]) if len(rising) else 0
    small = pd.Series(y).rolling(8, min_periods=1, center=True).median().to_numpy()
    lo = max(0, last_low - window)
    onset = lo + int(np.argmin(small[lo : last_low + 1]))
    detected = int(np.flatnonzero(gap >= math.log(ratio))[0])
    return Divergence(
        onset_step=int(s[onset]),
        detected_step=int(s[detected]),
        best=float(math.exp(best[-1])),
        final=float(math.exp(smooth[-1])),
        ratio=float(math.exp(gap[-1])),
    )
