"""Live verdicts on the window top and export keep, from the rules the report uses on a whole run.

- stalled: a rank the kernel shows stopped (SIGSTOP, a debugger: state T/t) is stalled at once; a watched
  rank whose last step is older than STALL_MEDIAN_STEPS × the job's median step time (and at least
  STALL_MIN_S) is stalled too. When some ranks are stalled and others are past the same age only because
  they wait for them in a collective (they are stopped at a later step, or a stopped peer explains it),
  those are `waiting`, not culprits: the hang report's distinction between the culprit and the ranks
  that wait in the collective. While a peer is stopped, a rank without a step for WAIT_STEPS median
  steps (and WAIT_MIN_S) is `waiting` at once, not after the 30 s a stall takes. A rank its peers wait
  for inside a collective (the watchdog's wait records) is named in seconds: live/waits.py's rule.
- straggler: the rank's median pace (time before backward where recorded: in DDP the step time is evened
  out by the gradient all-reduce; else the step time) is above the lower median of all ranks by the
  report's floor (crossrank.slow_floor: 10 %, down to 5 % among >= 8 alike ranks) and beyond NOISE_MADS ×
  (its MAD + the typical MAD): analysis/steps/crossrank.py's level rule.
- memory climbing: the rank's RSS over the sampled window rises by Mann–Kendall z ≥ LEAK_Z with R² ≥
  LEAK_R2 and growth ≥ max(LEAK_MIN_BYTES, LEAK_MIN_FRACTION × level): the report's memory_leak rule
  (analysis/memory/data.py's constants: z 3, R² 0.5, 16 MiB, 0.5 %).
- overflow storm: ≥ storm_skips skipped steps within storm_window_steps after the scaler's calibration
  burst: analysis/stats/scaler.py's rule (5 in 100 for GradScaler's defaults).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.analysis.stats.scaler import ScalerRule
from ciuic_doctor.analysis.steps.crossrank import NOISE_MADS, slow_floor
from ciuic_doctor.live.sample import RankSample
from ciuic_doctor.live.streams import StepWindow
from ciuic_doctor.live.waits import Wait, culprits

STALL_MEDIAN_STEPS = 20.0  # the hang watchdog's default: 20 median steps without a step...
STALL_MIN_S = 30.0  # ...and at least 30 s (README, "When a job hangs")
# A rank whose peer is stopped waits at its next collective: past 2 median steps (one to reach it, one of
# slack for the step in flight) and 1 s (the sampling interval) without a step, it reads `waiting`.
WAIT_STEPS = 2.0
WAIT_MIN_S = 1.0
MIN_PACE_STEPS = 10  # steps per rank before a pace is judged
MEMORY_POINTS = 20  # RSS samples before a trend is judged
MEMORY_WINDOW = 300
MEMORY_JUDGE_EVERY = 10
STOPPED_STATES = ("stopped", "traced")


@dataclass(kw_only=True)
class RankVerdict:
    rank: int
    up: bool = True
    stalled: bool = False
    waiting: bool = False
    straggler: bool = False
    memory_climbing: bool = False
    overflow_storm: bool = False
    why: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        """The one word top shows, worst first."""
        for flag, word in (
            (not self.up, "DOWN"),
            (self.stalled, "STALLED"),
            (self.waiting, "waiting"),
            (self.straggler, "straggler"),
            (self.overflow_storm, "overflows"),
            (self.memory_climbing, "mem-climb"),
        ):
            if flag:
                return word
        return "ok"

    @property
    def severity(self) -> int:
        return ("DOWN", "STALLED", "waiting", "straggler", "overflows", "mem-climb", "ok").index(self.status)


@dataclass(kw_only=True)
class Thresholds:
    stall_median_steps: float = STALL_MEDIAN_STEPS
    stall_min_s: float = STALL_MIN_S


class MemoryHistory:
    """(time, RSS) per rank over the last MEMORY_WINDOW samples. The trend is fitted every
    MEMORY_JUDGE_EVERY samples (a Theil–Sen fit is O(n²) pairs; memory does not climb in one second)."""

    def __init__(self) -> None:
        self.points: dict[int, deque] = {}
        self.added = 0
        self.judged: dict[int, str] = {}

    def add(self, t: float, samples: dict[int, RankSample]) -> None:
        self.added += 1
        for rank, sample in samples.items():
            if sample.rss_bytes is not None:
                self.points.setdefault(rank, deque(maxlen=MEMORY_WINDOW)).append((t, sample.rss_bytes))


def stalled(
    samples: dict[int, RankSample],
    figures: dict[int, dict[str, Any]],
    limits: Thresholds,
    *,
    waits: dict[int, Wait] | None = None,
    now: float | None = None,
) -> dict[int, tuple[str, str]]:
    """rank -> ("stalled" | "waiting", why)."""
    import time

    out: dict[int, tuple[str, str]] = {}
    for rank, sample in samples.items():
        if sample.up and sample.state in STOPPED_STATES:
            out[rank] = ("stalled", f"process {sample.state} (state T: SIGSTOP or a debugger)")
    times = [f["step_time_s"] for f in figures.values() if f.get("step_time_s")]
    if waits and not out:
        typical = statistics.median(times) if times else 0.0
        out.update(culprits(waits, samples, figures, typical, time.time() if now is None else now))
    if out:  # a stopped peer: the others block at their next collective, within a step or two
        typical = statistics.median(times) if times else 0.0
        for rank, sample in samples.items():
            if rank in out or not sample.up:
                continue
            age = figures.get(rank, {}).get("since_last_step_s")
            if age is None or age > max(WAIT_STEPS * typical, WAIT_MIN_S):
                why = "waiting on a stopped rank" + (f" (no step for {age:.0f} s)" if age is not None else "")
                out[rank] = ("waiting", why)
    if times:
        limit = max(limits.stall_median_steps * statistics.median(times), limits.stall_min_s)
        late = {
            r: f
            for r, f in figures.items()
            if f.get("since_last_step_s") is not None and f["since_last_step_s"] > limit and r not in out
        }
        if late:
            behind = min(int(f.get("step") or 0) for f in late.values())
            stopped_peer = bool(out)
            for rank, f in late.items():
                age = f"no step for {f['since_last_step_s']:.0f} s (> {limit:.0f} s)"
                ahead = int(f.get("step") or 0) > behind
                if stopped_peer or ahead:
                    out[rank] = ("waiting", f"{age}, waiting on a stalled rank")
                else:
                    out[rank] = ("stalled", age)
    return out


def stragglers(windows: dict[int, StepWindow]) -> dict[int, str]:
    """rank -> why, for ranks whose pace is slow_floor beyond the lower median of all ranks."""
    metric = "pre_backward_s"
    if not all((p := w.pace(metric)) and p[2] >= MIN_PACE_STEPS for w in windows.values()):
        metric = "step_time_s"
    paces = {rank: p for rank, w in windows.items() if (p := w.pace(metric)) and p[2] >= MIN_PACE_STEPS}
    if len(paces) < 2:
        return {}
    level = {r: p[0] for r, p in paces.items()}
    mads = {r: p[1] for r, p in paces.items()}
    typical, typical_mad = statistics.median_low(level.values()), statistics.median(mads.values())
    if typical <= 0:
        return {}
    floor = slow_floor([v / typical for v in level.values()])
    out = {}
    for rank, value in level.items():
        excess = value - typical
        if excess >= floor * typical and excess > NOISE_MADS * (mads[rank] + typical_mad):
            share = 100 * excess / typical
            shown = f"{share:.1f}" if share < 10 else f"{share:.0f}"
            out[rank] = f"{metric} {value:.3g} s, {shown} % above the typical rank"
    return out


def memory_climbing(history: MemoryHistory) -> dict[int, str]:
    from ciuic_doctor.analysis.memory.data import LEAK_MIN_BYTES, LEAK_MIN_FRACTION, LEAK_R2, LEAK_Z
    from ciuic_doctor.analysis.stats.trend import robust_trend

    out = {}
    for rank, points in history.points.items():
        if len(points) < MEMORY_POINTS:
            continue
        trend = robust_trend([p[0] for p in points], [p[1] for p in points])
        if trend is None:
            continue
        floor = max(LEAK_MIN_BYTES, LEAK_MIN_FRACTION * abs(trend.y_start))
        if trend.z >= LEAK_Z and trend.r2 >= LEAK_R2 and trend.growth >= floor:
            out[rank] = f"RSS +{trend.growth / (1 << 20):.0f} MiB over {trend.x_last - trend.x_first:.0f} s"
    return out


def _memory_verdicts(history: MemoryHistory) -> dict[int, str]:
    if history.added % MEMORY_JUDGE_EVERY == 1 or MEMORY_JUDGE_EVERY == 1:
        history.judged = memory_climbing(history)
    return history.judged


def overflow_storms(windows: dict[int, StepWindow], rule: ScalerRule | None = None) -> dict[int, str]:
    """rank -> why, for ranks with ≥ storm_skips skipped steps in their last storm_window_steps after
    the calibration burst (the run's first skips, back to back from step 1)."""
    rule = rule or ScalerRule()
    out = {}
    for rank, window in windows.items():
        records = list(window.records)
        if not records:
            continue
        calibrated_at = 0
        if records[0]["step"] <= 2 and records[0].get("skipped"):  # the run's start, in its burst
            last, count = records[0]["step"], 1
            for record in records[1:]:
                clean_between = record["step"] - 1 - last
                if clean_between > rule.calibration_gap_steps or count >= rule.max_calibration_skips:
                    break
                if record.get("skipped"):
                    last, count = record["step"], count + 1
            calibrated_at = last
        newest = records[-1]["step"]
        skips = [
            r["step"]
            for r in records
            if r.get("skipped") and r["step"] > calibrated_at and r["step"] > newest - rule.storm_window_steps
        ]
        if len(skips) >= rule.storm_skips:
            out[rank] = f"{len(skips)} skipped steps in the last {rule.storm_window_steps}"
    return out


def judge(
    samples: dict[int, RankSample],
    windows: dict[int, StepWindow],
    figures: dict[int, dict[str, Any]],
    history: MemoryHistory,
    limits: Thresholds,
    *,
    waits: dict[int, Wait] | None = None,
) -> dict[int, RankVerdict]:
    verdicts = {rank: RankVerdict(rank=rank, up=s.up) for rank, s in samples.items()}
    for rank, sample in samples.items():
        if not sample.up:
            verdicts[rank].why.append("process exited")
    for rank, (kind, why) in stalled(samples, figures, limits, waits=waits).items():
        if rank in verdicts:
            setattr(verdicts[rank], kind, True)
            verdicts[rank].why.append(why)
    checks = (
        ("straggler", stragglers(windows)),
        ("overflow_storm", overflow_storms(windows)),
        ("memory_climbing", _memory_verdicts(history)),
    )
    for name, found in checks:
        for rank, why in found.items():
            if rank in verdicts:
                setattr(verdicts[rank], name, True)
                verdicts[rank].why.append(why)
    return verdicts
