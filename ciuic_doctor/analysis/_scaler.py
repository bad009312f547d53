"""The fp16 loss scaler's story from skipped steps and scale values: calibration, storms, collapse, advice.

Semantics this reads against (shared/reference/training-logs.md):
- torch.amp.GradScaler starts at 2**16, halves the scale on every skipped step (backoff 0.5) and doubles it
  after 2000 clean steps; it has no floor. Megatron starts at 2**32 with hysteresis 2, window 1000, floor 1;
  DeepSpeed at 2**16 with hysteresis 2, window 1000, min_loss_scale 1, and "already at minimum" is fatal.
- So a run starts by *calibrating*: a burst of consecutive skips while the scale halves down to what the
  gradients allow. After it, PyTorch expects skips "once every few hundred or thousand iterations" (each
  growth attempt that overflows). Many skips in a short window after calibration is a storm; a scale that
  reaches the floor (or goes below 1 for GradScaler) has collapsed and the run no longer trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(kw_only=True)
class ScalerRule:
    storm_skips: int = 5  # skips within storm_window_steps after calibration; a healthy scaler skips
    storm_window_steps: int = 100  # once per growth interval (2000 for GradScaler), twice with hysteresis
    calibration_gap_steps: int = 2  # calibration skips come back to back, from the first logged step
    max_calibration_skips: int = 64  # 2**32 down to 1 with hysteresis 2 takes 64 skips at most
    lr_peak_fraction: float = 0.9
    frequent_skip_rate: float = 0.01  # after calibration, more than 1 step in 100 skipped: fp16 is struggling


@dataclass(kw_only=True)
class Storm:
    start_step: int
    end_step: int
    skipped: int
    scale_before: float | None
    scale_after: float | None
    lr_at_start: float | None


@dataclass(kw_only=True)
class ScalerReport:
    uses_scaler: bool
    calibration_steps: int = 0
    calibration_skipped: int = 0
    skipped_total: int = 0
    skipped_after_calibration: int = 0
    steps_after_calibration: int = 0
    steady_scale: float | None = None
    initial_scale: float | None = None
    storms: list[Storm] = field(default_factory=list)
    collapse_step: int | None = None
    collapse_scale: float | None = None
    skipped_from_collapse: int = 0
    fatal: bool = False
    overflows_near_lr_peak: bool = False
    floor: float | None = None
    lowest_scale: float | None = None


def _finite_or_none(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def calibration(
    step: np.ndarray, skipped: np.ndarray, interval: np.ndarray, rule: ScalerRule
) -> tuple[int, int]:
    """(last step of the initial skip burst, skips in it); (0, 0) when the log does not start with one.

    The burst starts in the first logged row (the scaler's first step overflows at an initial scale that is
    too high) and goes on while skipped rows follow each other with at most calibration_gap_steps between.
    """
    rows = np.flatnonzero(skipped > 0)
    if not len(rows) or rows[0] != 0:
        return 0, 0
    count = int(skipped[0])
    last = 0
    for r in rows[1:]:
        gap = step[r] - interval[r] - step[last]  # clean steps between this skipped row and the last
        if gap > rule.calibration_gap_steps or count >= rule.max_calibration_skips:
            break
        count += int(skipped[r])
        last = r
    return int(step[last]), count


def find_storms(
    step: np.ndarray, skipped: np.ndarray, *, scale: np.ndarray, lr: np.ndarray, after: int, rule: ScalerRule
) -> list[Storm]:
    """Windows of storm_window_steps after calibration holding ≥ storm_skips skipped steps; overlapping
    windows are one storm (from its first skipped row to its last)."""
    rows = np.flatnonzero((skipped > 0) & (step > after))
    if not len(rows):
        return []
    s, k = step[rows], skipped[rows].astype(np.int64)
    total = np.concatenate([[0], np.cumsum(k)])
    end = np.searchsorted(s, s + rule.storm_window_steps, side="left")  # rows in [s, s + window)
    starts = np.flatnonzero(total[end] - total[np.arange(len(s))] >= rule.storm_skips)
    if not len(starts):
        return []
    last = end[starts] - 1  # the last skipped row inside each storm window
    reach = np.maximum.accumulate(last)
    new = np.concatenate([[True], starts[1:] > reach[:-1]])  # a window that starts past all before it
    firsts = starts[new]
    lasts = reach[np.concatenate([np.flatnonzero(new)[1:] - 1, [len(starts) - 1]])]
    storms: list[Storm] = []
    for i, j in zip(firsts, lasts, strict=True):
        first_row, last_row = rows[i], rows[j]
        before = scale[:first_row][np.isfinite(scale[:first_row])]
        inside = scale[first_row : last_row + 1][np.isfinite(scale[first_row : last_row + 1])]
        storms.append(
            Storm(
                start_step=int(s[i]),
                end_step=int(s[j]),
                skipped=int(total[j + 1] - total[i]),
                scale_before=_finite_or_none(before[-1]) if len(before) else None,
                scale_after=_finite_or_none(inside.min()) if len(inside) else None,
                lr_at_start=_finite_or_none(lr[first_row]),
            )
        )
    return storms


def analyse_scaler(
    step: np.ndarray,
    skipped: np.ndarray,
    interval: np.ndarray,
    scale: np.ndarray,
    lr: np.ndarray,
    *,
    floor: float | None,
    fatal_steps: list[int],
    steps_known: bool = True,
    rule: ScalerRule | None = None,
) -> ScalerReport:
    """Everything the loss_scaler, overflow_storm and scale_collapse checks report."""
    rule = rule or ScalerRule()
    finite_scale = scale[np.isfinite(scale)]
    uses = bool((finite_scale > 1).any() or fatal_steps or (skipped.sum() > 0 and not len(finite_scale)))
    report = ScalerReport(uses_scaler=uses, floor=floor, skipped_total=int(skipped.sum()))
    if not uses:
        return report
    report.initial_scale = _finite_or_none(finite_scale[0]) if len(finite_scale) else None
    report.lowest_scale = _finite_or_none(finite_scale.min()) if len(finite_scale) else None
    report.calibration_steps, report.calibration_skipped = calibration(step, skipped, interval, rule)
    after = step > report.calibration_steps
    report.skipped_after_calibration = int(skipped[after].sum())
    report.steps_after_calibration = int(interval[after].sum())
    if steps_known:
        report.storms = find_storms(
            step, skipped, scale=scale, lr=lr, after=report.calibration_steps, rule=rule
        )
    _collapse(report, step, skipped, scale, floor=floor, fatal_steps=fatal_steps)
    steady = scale[after & np.isfinite(scale) & (scale > 0)]
    if report.collapse_step is not None:
        steady = scale[after & np.isfinite(scale) & (scale > 0) & (step < report.collapse_step)]
    if len(steady):
        report.steady_scale = float(2.0 ** math.floor(math.log2(float(np.median(steady)))))
    report.overflows_near_lr_peak = _near_lr_peak(step, skipped, lr, after, rule)
    return report


def _collapse(
    report: ScalerReport, step, skipped, scale, *, floor: float | None, fatal_steps: list[int]
) -> None:
    """GradScaler: the scale went below 1. Floored scalers: the scale sat at the floor and still skipped."""
    if floor is None:
        hit = np.flatnonzero(np.isfinite(scale) & (scale < 1.0))
    else:
        at_floor = np.isfinite(scale) & (scale <= floor)
        reached = np.flatnonzero(at_floor)
        hit = reached if len(reached) and skipped[reached[0] :].sum() > 0 else np.array([], dtype=int)
    if len(hit):
        report.collapse_step = int(step[hit[0]])
        report.collapse_scale = float(np.nanmin(scale[hit]))
    if len(hit):
        report.skipped_from_collapse = int(skipped[step >= report.collapse_step].sum())
    if fatal_steps:
        report.fatal = True
        first_fatal = min(fatal_steps)
        if report.collapse_step is None or first_fatal < report.collapse_step:
            report.collapse_step = first_fatal
            report.collapse_scale = report.collapse_scale if report.collapse_scale is not None else floor


def _near_lr_peak(step, skipped, lr, after, rule: ScalerRule) -> bool:
    """Skips after calibration crowd where the LR is within 10 % of its peak, more than time spent there."""
    finite = np.isfinite(lr)
    if not finite.any() or skipped[after].sum() < 2:
        return False
    peak = np.nanmax(lr)
    if not peak > 0:
        return False
    high = finite & (lr >= rule.lr_peak_fraction * peak)
    rows = after & (skipped > 0)
    share_of_skips = float(skipped[rows & high].sum() / max(1, skipped[rows].sum()))
    share_of_time = float(high[after].mean()) if after.any() else 1.0
    return share_of_skips >= 0.5 and share_of_skips >= 2 * share_of_time
