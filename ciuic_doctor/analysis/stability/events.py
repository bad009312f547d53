"""Spikes as the events a person names (pure numpy; the findings are built in stability.checks).

merge_events     spikes that follow each other within MERGE_GAP_ROWS logged points are one excursion:
                 a bump at an epoch boundary that the nested-spike rule split was warned twice
size             how big a loss excursion is in nats (the loss's own unit) and in printed quanta, next
                 to the ratio: 0.035 -> 0.158 is 4.5× but 0.12 nats, on a loss near its floor
severity         fail when the loss did not come back. Fail too, once the run had learned (its loss
                 below 80 % of where it started), when it rose above the level the run started at (ln
                 of the vocabulary where the log prints it: a uniform guess) for BLOWUP_MIN_POINTS or
                 more points and BLOWUP_FRACTION of the log or until the LR was cut to half (a word LM
                 at 12 -> 17 rescued only by LR annealing), or when it rose BIG_RISE_NATS or more for
                 LONG_FRACTION of the log. Before the run has learned anything (Megatron-DeepSpeed's
                 12.4 -> 41 at iteration 3, back by 16) a spike that recovers is a warning. "minor"
                 when it came back and rose less than MINOR_RISE_NATS. Else warn.
calm_grad        grad-norm spikes the loss never answered (no loss excursion from the grad spike to
                 LEAD_STEPS after it): isolated outliers that clipping and Adam absorb, folded into one
                 pass finding instead of a warning each (a batch-size-1 run had ten warnings)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ciuic_doctor.analysis.stats.spikes import Spike

MERGE_GAP_ROWS = 3
MINOR_RISE_NATS = 0.2  # e^0.2 = 1.22: the likelihood of the right token fell by under a fifth, briefly
BIG_RISE_NATS = 1.0
LONG_FRACTION = 0.1
BLOWUP_MIN_POINTS = 3
BLOWUP_FRACTION = 0.05  # ... and stayed up for 5 % of the log, or until the LR was cut
LR_CUT = 0.5
LEARNED_FRACTION = 0.8  # the run had learned: its loss had fallen below 80 % of where it started


@dataclass(kw_only=True)
class Judged:
    spike: Spike
    parts: int  # detector spikes merged into this event
    rise: float  # peak − baseline, in the series' units (nats for a loss)
    quanta: float | None  # the rise in printed quanta
    verdict: str  # fail | warn | minor
    why: str = ""  # what made it a fail


def merge_events(spikes: list[Spike], steps: np.ndarray) -> list[tuple[Spike, int]]:
    """(event, parts): a spike is part of the one before when it starts within MERGE_GAP_ROWS rows after
    that one ended, or while it was still up but within MERGE_GAP_ROWS rows of its last part's start (the
    steep edge of one bump). A fresh spike hundreds of steps into a slow recovery is an event of its own."""
    if not spikes:
        return []
    gaps = np.diff(steps)
    row_steps = float(np.median(gaps[gaps > 0])) if (gaps > 0).any() else 1.0
    reach = MERGE_GAP_ROWS * row_steps
    out: list[tuple[Spike, int]] = []
    last_start = 0
    for spike in sorted(spikes, key=lambda s: s.start_step):
        after = out and out[-1][0].end_step < spike.start_step <= out[-1][0].end_step + reach
        edge = out and spike.start_step <= out[-1][0].end_step and spike.start_step - last_start <= reach
        last_start = spike.start_step
        if after or edge:
            first, parts = out[-1]
            peak = spike if spike.peak > first.peak else first
            recovered = (
                None
                if spike.recovered_after_steps is None
                else spike.start_step + spike.recovered_after_steps - first.start_step
            )
            merged = replace(
                first,
                peak_step=peak.peak_step,
                peak=peak.peak,
                magnitude=peak.peak / first.baseline if first.baseline > 0 else peak.magnitude,
                recovered_after_steps=recovered,
                end_step=max(first.end_step, spike.end_step),
                points=first.points + spike.points,
            )
            out[-1] = (merged, parts + 1)
        else:
            out.append((spike, 1))
    return out


def start_level(vocab_size: int | None) -> float | None:
    """What an untrained model scores where the log says: ln(vocabulary), a uniform guess (else None:
    `judge` takes the run's own start, the highest of the first three losses logged before the event)."""
    return math.log(vocab_size) if vocab_size and vocab_size > 1 else None


def judge(
    spike: Spike,
    parts: int,
    steps: np.ndarray,
    values: np.ndarray,
    *,
    quantum: float,
    reference: float | None,
    nats: bool,
    lr: np.ndarray | None = None,
) -> Judged:
    """The event's size and verdict (see the module doc); `nats` is False for a grad norm."""
    rise = spike.peak - spike.baseline
    quanta = rise / quantum if quantum > 0 else None
    judged = Judged(spike=spike, parts=parts, rise=rise, quanta=quanta, verdict="warn")
    if spike.recovered_after_steps is None:
        judged.verdict, judged.why = "fail", "not recovered by the end of the log"
        return judged
    if not nats:
        return judged
    before = values[(steps < spike.start_step) & np.isfinite(values)]
    if reference is None and len(before):
        reference = float(before[:3].max())
    learned = reference is not None and len(before) and float(before.min()) <= LEARNED_FRACTION * reference
    span = float(steps[-1] - steps[0]) if len(steps) > 1 else 0.0
    lasted = spike.recovered_after_steps
    rescued = _lr_cut(spike, steps, lr)
    persistent = spike.points >= BLOWUP_MIN_POINTS and (rescued or lasted >= BLOWUP_FRACTION * span)
    if learned and spike.peak >= reference and persistent:
        judged.verdict = "fail"
        judged.why = (
            f"it rose above {reference:.4g}, what an untrained model scores, after the run had reached "
            f"{float(before.min()):.4g}: the run lost what it had learned for {lasted} steps"
            + (" and came back only after the LR was cut" if rescued else "")
        )
        return judged
    if learned and rise >= BIG_RISE_NATS and span > 0 and lasted >= LONG_FRACTION * span:
        judged.verdict = "fail"
        judged.why = f"{rise:.3g} nats up for {lasted} steps, {lasted / span:.0%} of the log"
        return judged
    if rise < MINOR_RISE_NATS:
        judged.verdict = "minor"
    return judged


def _lr_cut(spike: Spike, steps: np.ndarray, lr: np.ndarray | None) -> bool:
    """The LR where the loss came back is at most half the LR where it rose: a decay rescued the run."""
    if lr is None or spike.recovered_after_steps is None:
        return False
    ok = np.isfinite(lr) & (lr > 0)
    before = lr[ok & (steps <= spike.start_step)]
    after = lr[ok & (steps >= spike.start_step + spike.recovered_after_steps)]
    return bool(len(before) and len(after) and after[0] <= LR_CUT * before[-1])


def calm_grad(
    grad_spikes: list[Spike],
    loss_events: list[Spike],
    *,
    lead_steps: int,
    near_steps: float,
    row_steps: float,
) -> tuple[list[Spike], list[Spike]]:
    """(calm, answered): a recovered grad-norm spike is calm when no raised loss excursion started from one
    row before it to `lead_steps` after its end (`near_steps` after, for a spike of one or two points)."""
    calm, answered = [], []
    for g in grad_spikes:
        reach = lead_steps if g.points > 2 else near_steps
        low, high = g.start_step - row_steps, g.end_step + reach
        hit = any(low <= e.start_step <= high for e in loss_events)
        (answered if hit or g.recovered_after_steps is None else calm).append(g)
    return calm, answered
