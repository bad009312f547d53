"""The fp16 loss scaler's story from skipped steps and scale values: calibration, storms, collapse, advice.

Semantics this reads against (shared/reference/training-logs.md):
- torch.amp.GradScaler starts at 2**16, halves the scale on every skipped step (backoff 0.5) and doubles it
  after 2000 clean steps; it has no floor. Megatron starts at 2**32 with hysteresis 2, window 1000, floor 1;
  DeepSpeed at 2**16 with hysteresis 2, window 1000, min_loss_scale 1, and "already at minimum" is fatal.
- So a run starts by *calibrating*: a burst of consecutive skips while the scale halves down to what the
  gradients allow. After it, PyTorch expects skips "once every few hundred or thousand iterations" (each
  growth attempt that overflows). Many skips in a short window after calibration is a storm; a scale that
  reaches the floor (or goes below 1 for GradScaler) has collapsed and the run no longer trains.
- The configured window W and hysteresis h set what "rare" means: after W clean steps the scaler doubles
  the scale to probe, and a probe that overflows costs up to h skips (hysteresis h lets h − 1 overflows pass
  without lowering the scale). So a healthy scaler at its ceiling skips about h per W steps: DeepSpeed-Chat's
  window 100 with hysteresis 2 gives 2 skips every ~100 steps (2 %), which is the scaler working as
  configured, not fp16 struggling. The skip rate and the storm threshold are judged against h / W.

`scaler_config` takes W, h, the floor and the initial scale from the log where it prints them (the
importers' StepLog.scaler), else infers W and h from the skip pattern (the size of each burst of skips
after calibration, and the spacing of bursts while the scale they leave stays level: a probing scaler),
else takes the framework's defaults; the evidence says which.
"""

from __future__ import annotations

import itertools
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
    configured_rate_margin: float = 2.0  # ... or more than twice the h / W a probing scaler skips


# Defaults of each framework's dynamic scaler (shared/reference/training-logs.md).
DEFAULTS = {
    "gradscaler": {"window_steps": 2000, "hysteresis": 1, "initial_scale": 2.0**16, "min_scale": None},
    "megatron": {"window_steps": 1000, "hysteresis": 2, "initial_scale": 2.0**32, "min_scale": 1.0},
    "deepspeed": {"window_steps": 1000, "hysteresis": 2, "initial_scale": 2.0**16, "min_scale": 1.0},
}
MIN_BURSTS_TO_INFER = 4  # bursts after calibration needed before their spacing says what the window is


@dataclass(kw_only=True)
class ScalerConfig:
    window_steps: int
    hysteresis: int
    initial_scale: float | None
    min_scale: float | None
    source: dict[str, str]  # per field: "log" | "inferred" | "default"

    @property
    def skips_per_step(self) -> float:
        """What a scaler probing at its ceiling skips: h per W steps."""
        return self.hysteresis / max(1, self.window_steps)

    def to_evidence(self) -> dict:
        return {
            "window_steps": self.window_steps,
            "hysteresis": self.hysteresis,
            "initial_scale": self.initial_scale,
            "min_scale": self.min_scale,
            "source": dict(self.source),
        }


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
    config: ScalerConfig | None = None
    storm_skips: int = 5  # the storm threshold used (raised for a short window or a high hysteresis)


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
    step: np.ndarray,
    skipped: np.ndarray,
    *,
    scale: np.ndarray,
    lr: np.ndarray,
    after: int,
    rule: ScalerRule,
    attempted: np.ndarray | None = None,
) -> list[Storm]:
    """Windows of storm_window_steps after calibration holding ≥ storm_skips skipped steps; overlapping
    windows are one storm (from its first skipped row to its last). The scale before a storm is the one
    its first overflow attempted where the log prints it (DeepSpeed: growth since the last overflow is
    silent, so the last scale seen is too low), else the last scale seen before it."""
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
                scale_before=_scale_before(before, attempted, first_row),
                scale_after=_finite_or_none(inside.min()) if len(inside) else None,
                lr_at_start=_finite_or_none(lr[first_row]),
            )
        )
    return storms


def _scale_before(before: np.ndarray, attempted: np.ndarray | None, row: int) -> float | None:
    if attempted is not None and np.isfinite(attempted[row]):
        return float(attempted[row])
    return _finite_or_none(before[-1]) if len(before) else None


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
    framework: str | None = None,
    printed: dict | None = None,
    attempted: np.ndarray | None = None,
) -> ScalerReport:
    """Everything the loss_scaler, overflow_storm and scale_collapse checks report. `printed` is the
    configuration the log printed (StepLog.scaler), `framework` picks the defaults for what it did not."""
    rule = rule or ScalerRule()
    printed = printed or {}
    finite_scale = scale[np.isfinite(scale)]
    uses = bool((finite_scale > 1).any() or fatal_steps or (skipped.sum() > 0 and not len(finite_scale)))
    if printed.get("min_scale") is not None:
        floor = float(printed["min_scale"])
    report = ScalerReport(uses_scaler=uses, floor=floor, skipped_total=int(skipped.sum()))
    if not uses:
        return report
    report.lowest_scale = _finite_or_none(finite_scale.min()) if len(finite_scale) else None
    report.calibration_steps, report.calibration_skipped = calibration(step, skipped, interval, rule)
    after = step > report.calibration_steps
    report.config = scaler_config(step, skipped, scale, after, printed=printed, framework=framework)
    shown = printed.get("initial_scale")
    report.initial_scale = (
        float(shown) if shown is not None else _finite_or_none(finite_scale[0]) if len(finite_scale) else None
    )
    report.skipped_after_calibration = int(skipped[after].sum())
    report.steps_after_calibration = int(interval[after].sum())
    # A storm is more than a probing scaler skips in the window: h per W steps, twice over, plus one.
    probes = math.ceil(rule.storm_window_steps / report.config.window_steps)
    report.storm_skips = max(rule.storm_skips, 2 * report.config.hysteresis * probes + 1)
    if steps_known:
        storm_rule = ScalerRule(**{**rule.__dict__, "storm_skips": report.storm_skips})
        report.storms = find_storms(
            step, skipped, scale=scale, lr=lr, after=report.calibration_steps, rule=storm_rule,
            attempted=attempted,
        )  # fmt: skip
    _collapse(report, step, skipped, scale, floor=floor, fatal_steps=fatal_steps)
    steady = scale[after & np.isfinite(scale) & (scale > 0)]
    if report.collapse_step is not None:
        steady = scale[after & np.isfinite(scale) & (scale > 0) & (step < report.collapse_step)]
    if len(steady):
        report.steady_scale = float(2.0 ** math.floor(math.log2(float(np.median(steady)))))
    report.overflows_near_lr_peak = _near_lr_peak(step, skipped, lr, after, rule, least=report.storm_skips)
    return report


def scaler_config(step, skipped, scale, after, *, printed: dict, framework: str | None) -> ScalerConfig:
    """Window and hysteresis as printed, else inferred from the skip pattern, else the framework's
    defaults (DeepSpeed's for a log that does not say whose scaler it is)."""
    defaults = DEFAULTS.get(framework or "", DEFAULTS["deepspeed"])
    source: dict[str, str] = {}
    values: dict = {}
    inferred = _inferred(step, skipped, scale, after)
    for key in ("window_steps", "hysteresis", "initial_scale", "min_scale"):
        if printed.get(key) is not None:
            values[key], source[key] = printed[key], "log"
        elif inferred.get(key) is not None:
            values[key], source[key] = inferred[key], "inferred"
        else:
            values[key], source[key] = defaults[key], "default"
    return ScalerConfig(
        window_steps=max(1, int(values["window_steps"])),
        hysteresis=max(1, int(values["hysteresis"])),
        initial_scale=values["initial_scale"],
        min_scale=values["min_scale"],
        source=source,
    )


def _inferred(step, skipped, scale, after) -> dict:
    """Hysteresis: the median size of a burst of skips after calibration (skipped rows ≤ 2 rows apart).
    Window: the lower quartile of the steps between bursts, when there are MIN_BURSTS_TO_INFER of them and
    the scale each leaves stays level (a probing scaler returns to the same scale; a struggling one keeps
    falling, and its spacing says nothing about the window)."""
    rows = np.flatnonzero(after & (skipped > 0))
    if len(rows) < MIN_BURSTS_TO_INFER:
        return {}
    cuts = np.flatnonzero(np.diff(rows) > 2) + 1
    bursts = np.split(rows, cuts)
    if len(bursts) < MIN_BURSTS_TO_INFER:
        return {}
    sizes = [int(skipped[b].sum()) for b in bursts]
    out: dict = {"hysteresis": int(np.median(sizes))}
    left = [float(np.nanmin(scale[b])) if np.isfinite(scale[b]).any() else math.nan for b in bursts]
    left = np.asarray(left)
    left = left[np.isfinite(left) & (left > 0)]
    half = len(left) // 2
    level = len(left) >= MIN_BURSTS_TO_INFER and np.median(left[half:]) >= np.median(left[:half]) / 2
    if level:
        gaps = [int(step[b[0]] - step[a[-1]]) for a, b in itertools.pairwise(bursts)]
        out["window_steps"] = int(np.quantile(gaps, 0.25))
    return out


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


def _near_lr_peak(step, skipped, lr, after, rule: ScalerRule, *, least: int) -> bool:
    """Skips after calibration crowd where the LR is within 10 % of its peak, more than time spent there;
    judged only on as many skips as make a storm (`least`): two skips near the peak are a coincidence."""
    finite = np.isfinite(lr)
    if not finite.any() or skipped[after].sum() < least:
        return False
    peak = np.nanmax(lr)
    if not peak > 0:
        return False
    high = finite & (lr >= rule.lr_peak_fraction * peak)
    rows = after & (skipped > 0)
    share_of_skips = float(skipped[rows & high].sum() / max(1, skipped[rows].sum()))
    share_of_time = float(high[after].mean()) if after.any() else 1.0
    return share_of_skips >= 0.5 and share_of_skips >= 2 * share_of_time
