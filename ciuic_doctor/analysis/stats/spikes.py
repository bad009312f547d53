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
its own; a loss that ramps up stays one spike.

Printed precision and size: a rise must also be at least QUANTUM_MARGIN quanta of the log's printed
precision (`quantum_of`: HF rounds losses to 4 places, so 0.0001 -> 0.0002 is one quantum, not a 2× spike)
and, for a loss, at least LOSS_MIN_ABS_RISE nats (a rise smaller than that changes nothing in training).

Short logs and the first points: the rolling σ needs 16 points; before them (and in a log shorter than the
window) σ is the same robust estimate over the whole log, and the baseline is the median of the points
before, so a spike at the third logged point is seen (Megatron-DeepSpeed's 12.4 -> 41 at iteration 3);
the second point, with one point before it, is judged against the higher of that point and the median of
the 8 after it (a 20-point Megatron log's 12.0 -> 22.5 -> 12.6). Fewer than MIN_POINTS points cannot
be judged at all (the caller says not_run).

OLMo-core's StabilityMonitor also draws its line at 6σ, but of raw values around a mean of the 128
before, which a trend inflates and warm-up leaves unjudged (benchmarks/stability_rules.py compares them).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

ROBUST_SIGMA = 1.4826 / math.sqrt(2)  # MAD -> σ for a Gaussian, and Δ of two points has √2 σ
NESTED_MIN_RISE = 0.25  # a second spike on top of one still up
SLOW_SPIKE_Z = 3.0  # the 8 points after sit this many σ above the 8 before: a spike still up, not noise
WINSOR = 3.0  # |Δ| capped at 3× its median = 2.02 σ_Δ (median |Z| is 0.6745)
MIN_POINTS = 8  # below this a log has no noise level to speak of: not judged
MIN_BEFORE = 2  # a point is judged against the median of at least 2 points before it
QUANTUM_MARGIN = 5  # a rise of a few printed quanta is rounding, not a spike
LOSS_MIN_ABS_RISE = 0.01  # nats: 5 % of a loss of 0.2; below it a "spike" moves nothing


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
    min_abs_rise: float = 0.0  # in the series' units: the rise must be at least this big as well


LOSS_RULE = SpikeRule(min_abs_rise=LOSS_MIN_ABS_RISE)
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


def threshold_of(sigma: np.ndarray, rule: SpikeRule) -> np.ndarray:
    """The line in log terms: x/b − 1 ≥ zσ for a batch-mean loss (roughly Gaussian noise around its
    level), log x − log b ≥ zσ for a grad norm (skewed, closer to log-normal); never under min_rise."""
    floor = math.log1p(rule.min_rise)
    with np.errstate(invalid="ignore"):
        line = np.log1p(rule.z * sigma) if rule.relative else rule.z * sigma
    return np.maximum(line, floor)


def robust_bands(y: np.ndarray, rule: SpikeRule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(baseline, σ, line) for log-values `y`; the baseline is computed only where a point might be over
    the line (NaN elsewhere: those points are not spikes whatever it is).

    A coarse level (medians of blocks of 32, from the blocks around and from the blocks before, the lower
    of the two) picks the points that come within 2σ of the line; only there are the medians of the 8
    before, the 8 after and the 64 around computed — a rolling median over every point of a 10^6-step log
    costs most of a second, this costs nothing.
    """
    import pandas as pd

    n = len(y)
    steps = pd.Series(y).diff().abs()
    sigma = _noise(steps, rule)
    # The first points (and all of a short log) have no rolling σ: the whole log's robust σ stands in.
    early = np.isnan(sigma)
    early[rule.min_history :] = False
    if early.any():
        known = sigma[np.isfinite(sigma)]
        sigma[early] = max(_whole_log_sigma(steps.to_numpy()), float(known[0]) if len(known) else 0.0)
    line = threshold_of(sigma, rule)
    with np.errstate(invalid="ignore"):
        maybe = (y - _coarse_level(y)) >= line - 2 * sigma
    maybe[: rule.noise_points] = True  # the steep start: look at every point
    maybe[:1] = False  # the first point has nothing before it
    maybe &= np.isfinite(sigma) & (sigma > 0)
    at = np.flatnonzero(maybe)
    baseline = np.full(n, np.nan)
    baseline[at] = _baseline_at(y, sigma, at, rule)
    return baseline, sigma, line


def _whole_log_sigma(steps: np.ndarray) -> float:
    """The winsorized RMS σ of _noise over every |Δ log| of the log (NaN-free; 0.0 when there is none)."""
    finite = steps[np.isfinite(steps)]
    if not len(finite):
        return 0.0
    cap = WINSOR * float(np.median(finite))
    return float(np.sqrt(np.mean(np.minimum(finite, cap) ** 2) / WINSOR_CORRECTION / 2.0))


def quantum_of(values: np.ndarray, sample: int = 4096) -> float:
    """The printed precision of a series: 10**-d for the most decimals d (≤ 8) its values need, from an
    even sample of up to 4096 finite values (HF's rounded losses give 1e-4; Megatron's `%E` 1e-6 or finer).

    >>> quantum_of(np.array([0.1234, 2.5, 0.0001]))
    0.0001
    """
    finite = values[np.isfinite(values)]
    if not len(finite):
        return 0.0
    if len(finite) > sample:
        finite = finite[:: len(finite) // sample]
    for decimals in range(9):
        scaled = finite * 10.0**decimals
        if np.all(np.abs(scaled - np.round(scaled)) <= 1e-6 * np.maximum(1.0, np.abs(scaled))):
            return 10.0**-decimals
    return 0.0


def _coarse_level(y: np.ndarray, size: int = 32) -> np.ndarray:
    """A cheap level under the curve: block medians interpolated through block centres, and the same
    from the block before (which a spike that has just started has not lifted yet); the lower of the two."""
    n = len(y)
    medians = _block_medians(y, size)[::size]
    centres = np.arange(len(medians)) * size + (size - 1) / 2
    around = np.interp(np.arange(n), centres, medians)
    before = np.interp(np.arange(n), centres + size, medians)
    return np.fmin(around, before)


def _baseline_at(y: np.ndarray, sigma: np.ndarray, at: np.ndarray, rule: SpikeRule) -> np.ndarray:
    """The baseline at indices `at`: the median of the 64 points around, unless the 8 points after sit
    SLOW_SPIKE_Z σ above the 8 before (a spike that recovers slowly, which a centred median would ride on):
    then the median of the 8 before. A centred median has no lag on a trend and a third of the noise of 8
    points before, and a spike of a few points barely moves it."""
    n, b = len(y), rule.baseline_points
    if not len(at):
        return np.empty(0)
    first = at < b  # the first points: the median of the (at least MIN_BEFORE) points there are before them
    before = np.empty(len(at))
    before[~first] = np.median(y[at[~first, None] + np.arange(-b, 0)], axis=1)
    if first.any():
        padded = np.concatenate([np.full(b, np.nan), y[:b]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            before[first] = np.nanmedian(padded[at[first, None] + np.arange(0, b)], axis=1)
    after_idx = np.minimum(at[:, None] + np.arange(1, b + 1), n - 1)
    after = np.median(y[after_idx], axis=1)
    half = 4 * b
    inside = (at - half >= 0) & (at + half < n)
    centred = np.full(len(at), np.nan)
    if inside.any():
        centred[inside] = np.median(y[at[inside, None] + np.arange(-half, half + 1)], axis=1)
    with np.errstate(invalid="ignore"):
        riding = (after - before > SLOW_SPIKE_Z * sigma[at]) | (at + b >= n) | np.isnan(centred)
    # Fewer than MIN_BEFORE points before (the second logged point): one point alone is no baseline, so
    # the point must stand above the points after it as well (Megatron's 12.0 -> 22.5 -> 12.6).
    thin = at < MIN_BEFORE
    return np.where(thin, np.fmax(before, after), np.where(riding, before, centred))


def _noise(steps, rule: SpikeRule) -> np.ndarray:  # |Δ log| Series -> σ per point
    """σ from |Δ| in a window centred on each point: |Δ| winsorized at 3× its median (a spike adds two
    capped terms, not two huge ones), then root-mean-square, corrected for the cap and for Δ having √2 σ.
    That estimator has ~90 % of the efficiency of a plain standard deviation, against 37 % for the median
    alone, so a 6σ line is not pulled to 5σ by a window whose median came out low by chance. Early, where
    fewer than `noise_points` come before, the median estimate from the points before is used when it is
    the wider (the steep start of a curve widens its differences)."""
    import pandas as pd

    window = rule.noise_points + 1
    values = steps.to_numpy()
    # The cap only needs the scale of |Δ|: medians of consecutive blocks do (and cost O(n), not O(n log w)).
    cap = WINSOR * _block_medians(values, rule.noise_points)
    capped = pd.Series(np.minimum(values, cap) ** 2)
    mean_square = capped.rolling(window, min_periods=rule.min_history, center=True).mean().to_numpy()
    sigma = np.sqrt(mean_square / WINSOR_CORRECTION / 2.0)
    early = slice(0, rule.noise_points + 1)
    head = steps.iloc[early]
    past = head.rolling(rule.noise_points, min_periods=rule.min_history).median().shift(1).to_numpy()
    sigma[early] = np.fmax(past * ROBUST_SIGMA, sigma[early])
    sigma[early][np.isnan(past)] = np.nan
    return sigma


def _block_medians(values: np.ndarray, size: int) -> np.ndarray:
    """Each point's value replaced by the median of its block of `size` (NaN ignored), same length."""
    n = len(values)
    blocks = -(-n // size)
    padded = np.full(blocks * size, np.nan)
    padded[:n] = values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN block stays NaN, quietly
        medians = np.nanmedian(padded.reshape(blocks, size), axis=1)
    return np.repeat(medians, size)[:n]


def find_spikes(
    steps: np.ndarray, values: np.ndarray, rule: SpikeRule = LOSS_RULE, *, quantum: float = 0.0
) -> list[Spike]:
    """Upward spikes of a positive series; non-finite and non-positive points are left out. `quantum` is
    the log's printed precision (quantum_of): a rise must be QUANTUM_MARGIN of them, and min_abs_rise."""
    ok = np.isfinite(values) & (values > 0)
    s, v = steps[ok], values[ok]
    n = len(v)
    if n < MIN_POINTS:
        return []
    y = np.log(v)
    baseline, sigma, threshold = robust_bands(y, rule)
    floor = math.log1p(rule.min_rise)
    least = max(rule.min_abs_rise, QUANTUM_MARGIN * quantum)
    with np.errstate(invalid="ignore"):
        over = (y - baseline) >= threshold  # NaN baseline: not over
        if least > 0:
            over &= v - np.exp(baseline) >= least
    spikes: list[Spike] = []
    starts: list[int] = []
    next_free = 0
    for i in np.flatnonzero(over):
        # Inside a spike that has not recovered, only a fresh jump (the point before was not over the line)
        # once the baseline has moved onto the spike's level, and a clear one (≥ 25 %: a spike's tail is
        # steep and noisy), is a spike of its own; a ramp is one spike.
        if i < next_free:
            fresh = not over[i - 1] and i - starts[-1] > rule.baseline_points
            level = float(np.median(y[max(0, i - rule.baseline_points) : i]))  # the earlier spike now
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
                magnitude=float(math.exp(min(y[peak] - base, 700.0))),  # 1e-300 -> 1e300 stays finite
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


SHORT_LOG_POINTS = 64  # below this the blocks shrink to n/8 points (a 62-point log climbing 11.6 -> 20.4)
DIVERGENCE_MIN_ABS = 0.05  # nats: a loss of 0.0001 that ends at 0.0003 has not diverged


# Below 16 loss points (the spike and climb checks' floor) blocks are 2 points, and a noisy 12-point loss
# (a short watched run on random batches) ended 1.5x its best block by chance: 34 % of 12-point lognormal
# series with sigma 0.35 (±40 %), and 23 of 40 seeds of a 12-step SGD run on batches of 4, were called
# divergent. There a divergence needs strong evidence: at least 3 blocks in the last half, each above the one
# before, the last the highest of the run, and at least STRONG_RATIO x the best; that leaves 0 of the 40
# seeds and still finds a 12-point loss growing 1.2x a step. A jump to STRONG_RATIO x the best that stays up
# to the end (two points or more) is a divergence at any length from 3 points (_short_blowup).
STRONG_BELOW_POINTS = 16
# The end must stand BAND_Z robust σ of a block median above the best: held levels of a flat band of 10 blocks
# span about 2.2 σ, rarely 3.5; a divergence of 1.5x in blocks of 16+ points is tens of σ.
BAND_Z = 4.0
STRONG_RATIO = 3.0


def _short_blowup(s: np.ndarray, y: np.ndarray, quantum: float) -> Divergence | None:
    """A blow-up a person sees in a handful of points: one point jumps to STRONG_RATIO× the typical (median)
    point before it, every point from there on is above every point before it, and every point from there to
    the end (two or more) stays above √STRONG_RATIO× the best before it (Megatron logs
    of 4-5 iterations going 12.5 -> 40.8 or 14.1 -> 76.8 and staying there). Blocks of 2 points need 8 points
    and a rise over the last half; a jump-and-stay has neither, and is the plainest divergence there is.
    `y` is the log of the finite, positive values at steps `s`."""
    for j in range(1, len(y) - 1):
        best = float(y[:j].min())
        if y[j] - float(np.median(y[:j])) < math.log(STRONG_RATIO):
            continue
        # a level the run never held before: every point from the jump on is above every point before it
        # (a batch-of-4 loss that jumps 10x from step to step ends high by chance, and had been that high)
        if y[j:].min() <= y[:j].max():
            continue
        if np.all(y[j:] - best >= 0.5 * math.log(STRONG_RATIO)):
            with np.errstate(over="ignore"):
                low, final = math.exp(best), float(np.exp(y[-1]))
            if final - low < max(DIVERGENCE_MIN_ABS, 10 * quantum):
                return None
            return Divergence(
                onset_step=int(s[j]), detected_step=int(s[j]), best=low, final=final, ratio=final / low
            )
        # this jump came back: a spike, not a blow-up; a later one may still stay up
    return None


def _block_sigma(blocks: np.ndarray) -> float:
    """Robust σ of one block median around the curve: 1.4826 MAD of block-to-block changes (less their
    median, a steady trend) over √2."""
    if len(blocks) < 3:
        return 0.0
    change = np.diff(blocks)
    return float(1.4826 * np.median(np.abs(change - np.median(change))) / math.sqrt(2))


def _held(blocks: np.ndarray) -> np.ndarray:
    """Each block median replaced by the median of it and its two neighbours (at the ends, the mean of the
    two there are): a level the curve held, not one lucky block. The best of a flat noisy band was its one
    lowest block, and the band "ended 1.5x its best" by chance (17 of 100 seeds of a flat 1,000-point band
    with 50 % noise; 31 of 100 at 30 points and 30 % noise)."""
    if len(blocks) < 3:
        return blocks
    padded = np.concatenate([[blocks[0]], blocks, [blocks[-1]]])
    held = np.median(np.stack([padded[:-2], padded[1:-1], padded[2:]]), axis=0)
    held[0], held[-1] = blocks[:2].mean(), blocks[-2:].mean()
    return held


def _strong_rise(smooth: np.ndarray, gap: np.ndarray) -> bool:
    half = smooth[len(smooth) // 2 :]
    rising = len(half) >= 3 and np.all(np.diff(half) > 0)
    return bool(rising and smooth[-1] >= smooth.max() and gap[-1] >= math.log(STRONG_RATIO))


def find_divergence(
    steps: np.ndarray,
    values: np.ndarray,
    *,
    ratio: float = 1.5,
    tail_fraction: float = 0.05,
    quantum: float = 0.0,
) -> Divergence | None:
    """The loss ends ≥ `ratio` × its best (smoothed) level and stayed above √ratio × best for the tail,
    and ends at least DIVERGENCE_MIN_ABS (and 10 printed quanta) above that best.

    A spike recovers; a divergence does not come back before the log ends. The curve is smoothed as medians
    of blocks of max(16, n/50) points, so that noise cannot make a best that was never there; a log shorter
    than SHORT_LOG_POINTS uses 8 blocks of n/8 points (at least 2), so 16 points are enough to judge.
    """
    ok = np.isfinite(values) & (values > 0)
    s, y = steps[ok], np.log(values[ok])
    n = len(y)
    if n < STRONG_BELOW_POINTS and (blowup := _short_blowup(s, y, quantum)) is not None:
        return blowup
    window = int(min(200, max(16, n // 50))) if n >= SHORT_LOG_POINTS else max(2, n // 8)
    count = n // window
    if count < 4:
        return None
    first = n - count * window  # whole blocks ending at the last point
    blocks = np.median(y[first:].reshape(count, window), axis=1)
    smooth = _held(blocks)
    best = np.minimum.accumulate(smooth)
    gap = smooth - best
    tail = -(-max(window, int(n * tail_fraction)) // window)
    if not (gap[-1] >= math.log(ratio) and np.all(gap[-tail:] >= 0.5 * math.log(ratio))):
        return None
    if gap[-1] < BAND_Z * _block_sigma(blocks):
        return None  # the end and the best are both inside the band the blocks wander in
    if n < STRONG_BELOW_POINTS and not _strong_rise(smooth, gap):
        return None  # fewer points than the other checks judge: only a steady, large climb counts
    with np.errstate(over="ignore"):  # a fuzzed 1e300 loss: inf, not an OverflowError
        rise = float(np.exp(smooth[-1]) - np.exp(best[-1]))
    if rise < max(DIVERGENCE_MIN_ABS, 10 * quantum):
        return None
    low = np.flatnonzero(gap < 0.5 * math.log(ratio))
    last_low = first + (int(low[-1]) + 1) * window - 1 if len(low) else first + window - 1
    detected = first + (int(np.flatnonzero(gap >= math.log(ratio))[0]) + 1) * window - 1
    # (a curve that rose, fell back and rose again has its last low after the first detection)
    lo, hi = max(0, min(last_low, detected) - 3 * window), min(n, max(last_low, detected) + window)
    onset = lo + _hinge(s[lo:hi].astype(np.float64), y[lo:hi])
    with np.errstate(over="ignore"):
        return Divergence(
            onset_step=int(s[onset]),
            detected_step=int(s[detected]),
            best=float(np.exp(best[-1])),
            final=float(np.exp(smooth[-1])),
            ratio=float(np.exp(gap[-1])),
        )


def _hinge(t: np.ndarray, y: np.ndarray) -> int:
    """Index of the knee of the best fit y ≈ a + b·t + c·max(0, t − t_k) (least squares over every k).

    A divergence is a trend that turns into a rise; the knee is where it turned. All candidate knees are
    fitted at once from suffix sums (each fit is a 3×3 normal-equation solve).
    """
    t = t - t[0]
    n = len(t)
    if n < 8:
        return 0

    def suffix(x: np.ndarray) -> np.ndarray:
        return np.cumsum(x[::-1])[::-1]

    c1, st, st2, sy, sty = suffix(np.ones(n)), suffix(t), suffix(t * t), suffix(y), suffix(t * y)
    k = np.arange(1, n - 2)  # a knee with at least 3 points after it
    tk = t[k]
    sx = st[k] - tk * c1[k]  # Σ (t − t_k) over t ≥ t_k
    sxx = st2[k] - 2 * tk * st[k] + tk * tk * c1[k]
    stx = st2[k] - tk * st[k]
    sxy = sty[k] - tk * sy[k]
    gram = np.empty((len(k), 3, 3))
    gram[:, 0, 0], gram[:, 0, 1], gram[:, 0, 2] = n, t.sum(), sx
    gram[:, 1, 1], gram[:, 1, 2], gram[:, 2, 2] = (t * t).sum(), stx, sxx
    gram[:, 1, 0], gram[:, 2, 0], gram[:, 2, 1] = gram[:, 0, 1], gram[:, 0, 2], gram[:, 1, 2]
    rhs = np.stack([np.full(len(k), y.sum()), np.full(len(k), (t * y).sum()), sxy], axis=1)
    try:
        beta = np.linalg.solve(gram, rhs[..., None])[..., 0]
    except np.linalg.LinAlgError:
        return 0
    sse = (y * y).sum() - (beta * rhs).sum(axis=1)
    return int(k[int(np.nanargmin(sse))])
