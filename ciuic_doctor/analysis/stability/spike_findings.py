"""Loss and grad-norm spikes as findings: one per event a person would name, sized in nats and printed
quanta as well as a ratio, its verdict from size and persistence (stability.events), and the excursions
that need no action folded into one calm finding each:

    loss_outliers       one or two logged points up to 3× that came back at once with no grad-norm spike
                        before or with them (hard batches), and recovered bumps under MINOR_RISE_NATS
    grad_norm_outliers  grad-norm spikes the loss never answered

Split from `stability/checks.py` (divergence, non-finite losses, clipping) to keep each in one sitting.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ciuic_doctor.analysis.stability.events import (
    MINOR_RISE_NATS,
    Judged,
    calm_grad,
    judge,
    merge_events,
    start_level,
)
from ciuic_doctor.analysis.stability.findings import _finding, _g, _times
from ciuic_doctor.analysis.stats.spikes import (
    GRAD_NORM_RULE,
    LOSS_RULE,
    MIN_POINTS,
    Spike,
    find_spikes,
    quantum_of,
)
from ciuic_doctor.rundir.findings import Finding

if TYPE_CHECKING:
    from ciuic_doctor.analysis.stability.curve import Curve

MAX_SPIKE_FINDINGS = 10
LEAD_STEPS = 100  # a grad-norm spike up to this many steps before a loss spike led it (OLMo 2's observation)
# One or two logged points up to 3× their neighbours that are back right after, with a grad norm that did
# not move, are a hard batch (Baize's batch-size-2 fine-tune: 8 of them at ~2.2×), not instability: where
# the log has a row per step, or where each row is one step's loss sampled every N steps (Lightning
# `_step`, nanoGPT, torchtitan; 1.5–2.3× blips every 50 steps). Not where a row is an interval's
# mean: a mean that doubles hides a far bigger step, and the row's one grad norm cannot vouch for the rest.
OUTLIER_MAX_MAGNITUDE = 3.0
OUTLIER_MAX_POINTS = 2
# Where no per-step grad norm vouches for it, a one-step sample's blip (nanoGPT, modded-nanogpt, Lightning
# `_step`, torchtitan) is the log's own heavy-tailed batch noise when it is within this many robust σ of the
# log's point-to-point log changes: modded-nanogpt's Muon record has 1.23–1.39× single-step blips up to
# 12.4σ; a planted 1.6× point on a 2 %-noise curve is ~23σ, a spike even if one sampled row shows it.
SAMPLED_MAX_Z = 16.0
GRAD_MOVED = 3.0
TIGHT_ROWS = 2
TIGHT_STEPS = 5


def spikes(
    curve: Curve, diverged_at: int | None, *, adversarial: bool = False
) -> tuple[list[Spike], list[Spike], list[Finding]]:
    """(loss events raised, grad-norm spikes, findings); `diverged_at` is the divergence's onset step.

    `adversarial`: a coupled loss (a GAN's) whose rise never comes back is its level, which is not judged
    (stability.series_kind); a spike that recovers still is."""
    grad_spikes = find_spikes(
        curve.step, curve.grad_norm, GRAD_NORM_RULE, quantum=quantum_of(curve.grad_norm)
    )
    loss_quantum = quantum_of(curve.loss)
    raw = find_spikes(curve.step, curve.loss, LOSS_RULE, quantum=loss_quantum)
    if diverged_at is not None:  # an unrecovered rise at the divergence is the divergence, reported there
        raw = [
            s for s in raw if s.recovered_after_steps is not None or s.start_step < diverged_at - LEAD_STEPS
        ]
    if adversarial:
        raw = [s for s in raw if s.recovered_after_steps is not None]
    has_grad = int(np.isfinite(curve.grad_norm).sum()) >= MIN_POINTS  # 0.0 is a norm
    grad = grad_spikes if has_grad else None
    events = merge_events(raw, curve.step)
    outliers = [s for s, parts in events if parts == 1 and _hard_batch(curve, s, grad)]
    reference = start_level(curve.vocab_size)
    judged = [
        judge(
            s,
            parts,
            curve.step,
            curve.loss,
            quantum=loss_quantum,
            reference=reference,
            nats=True,
            lr=curve.lr,
        )
        for s, parts in events
        if s not in outliers
    ]
    minor = [j for j in judged if j.verdict == "minor"]
    raised = [j for j in judged if j.verdict != "minor"]
    has_loss = int(np.isfinite(curve.loss).sum()) >= MIN_POINTS  # 0.0 is a loss
    row_steps = float(np.median(curve.interval)) if len(curve.interval) else 1.0
    calm, answered = [], grad_spikes
    if has_loss:
        loss_events = [j.spike for j in raised]
        near = _near_steps(curve)
        calm, answered = calm_grad(
            grad_spikes, loss_events, lead_steps=LEAD_STEPS, near_steps=near, row_steps=row_steps
        )
    findings = _spike_findings(
        "loss_spike", "loss", curve.loss, raised, grad, quiet=len(outliers) + len(minor), curve=curve
    )
    if outliers or minor:
        findings.append(_outlier_finding(outliers, minor, has_grad=grad is not None))
    grad_judged = [
        judge(s, 1, curve.step, curve.grad_norm, quantum=0.0, reference=None, nats=False) for s in answered
    ]
    findings += _spike_findings(
        "grad_norm_spike", "grad norm", curve.grad_norm, grad_judged, None, quiet=len(calm)
    )
    if calm:
        findings.append(_calm_grad_finding(calm, curve))
    return [j.spike for j in raised], grad_spikes, findings


def _hard_batch(curve: Curve, spike: Spike, grad: list[Spike] | None) -> bool:
    """At most OUTLIER_MAX_POINTS points, back right after, at most OUTLIER_MAX_MAGNITUDE×, on a per-step
    row (with a grad norm read that did not spike before or with it) or on a sampled row of a log that
    samples one step every N (with no grad-norm spike there either, where the log has grad norms)."""
    if spike.points > OUTLIER_MAX_POINTS or spike.recovered_after_steps is None:
        return False
    if spike.magnitude > OUTLIER_MAX_MAGNITUDE:
        return False
    row = int(np.searchsorted(curve.step, spike.start_step))
    if row >= len(curve.step) or curve.step[row] != spike.start_step:
        return False
    per_step = curve.interval[row] <= 1
    sampled = curve.loss_kind == "sample"
    vouched = per_step and grad is not None and not _grad_moved(curve, row, spike.points)
    if not vouched and not (
        sampled and math.log(spike.magnitude) <= SAMPLED_MAX_Z * _noise_sigma(curve.loss)
    ):
        return False
    near = _near_steps(curve)
    return not any(spike.start_step - near <= g.start_step <= spike.end_step for g in grad or [])


def _grad_moved(curve: Curve, row: int, points: int) -> bool:
    """The grad norm on the excursion's rows is GRAD_MOVED× the median of the (up to 8) rows before it, a
    jump the spike detector can miss in a log's chaotic first steps (torchtitan on Aurora: loss 10.9 ->
    14.4 at step 2 with the grad norm 3.2 -> 41.8): then it is no hard batch."""
    grad = curve.grad_norm
    before = grad[max(0, row - 8) : row]
    before = before[np.isfinite(before) & (before > 0)]
    during = grad[row : row + max(1, points)]
    during = during[np.isfinite(during)]
    return bool(len(before) and len(during) and during.max() >= GRAD_MOVED * float(np.median(before)))


def _near_steps(curve: Curve) -> float:
    """How close a grad-norm spike must be to a one- or two-point loss excursion to be its cause: TIGHT_ROWS
    rows (at least TIGHT_STEPS steps). OLMo 2's lead of up to LEAD_STEPS is for spikes that last; two
    single-step outliers 65 steps apart in a per-step log (llm.c's GPT-2 run) are unrelated."""
    row_steps = float(np.median(curve.interval)) if len(curve.interval) else 1.0
    return max(TIGHT_STEPS, TIGHT_ROWS * row_steps)


def _noise_sigma(values: np.ndarray) -> float:
    """Robust σ of point-to-point log changes (1.4826 MAD / √2: a change holds two points' noise)."""
    finite = values[np.isfinite(values) & (values > 0)]
    if len(finite) < 3:
        return 0.0
    steps = np.diff(np.log(finite))
    return float(1.4826 * np.median(np.abs(steps - np.median(steps))) / math.sqrt(2))


def _outlier_finding(outliers: list[Spike], minor: list[Judged], *, has_grad: bool) -> Finding:
    every = sorted([*outliers, *(j.spike for j in minor)], key=lambda s: s.start_step)
    steps = [s.start_step for s in every]
    worst = max(every, key=lambda s: s.magnitude)
    largest_rise = max((j.rise for j in minor), default=None)
    evidence = {
        "count": len(every),
        "hard_batches": len(outliers),
        "small_bumps": len(minor),
        "steps": steps[:100],
        "max_magnitude": round(worst.magnitude, 3),
        "median_magnitude": round(float(np.median([s.magnitude for s in every])), 3),
        "max_points": max(s.points for s in every),
        "largest_bump_nats": round(largest_rise, 4) if largest_rise is not None else None,
        "grad_norm_led": False if has_grad else None,
    }
    parts = []
    if outliers:
        why = (
            "no grad-norm spike before or with it"
            if has_grad
            else f"within {SAMPLED_MAX_Z:g}σ of the log's own step-to-step noise (it prints no grad norm)"
        )
        parts.append(
            f"{len(outliers)} short loss outlier(s) each back within {OUTLIER_MAX_POINTS} logged points, "
            f"{why} (hard batches, not instability)"
        )
    if minor:
        parts.append(
            f"{len(minor)} small bump(s) that came back, each under {MINOR_RISE_NATS} nats (largest "
            f"{largest_rise:.3g} nats, though {_times(max(j.spike.magnitude for j in minor))} as a ratio)"
        )
    shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
    summary = "; ".join(parts) + f" (at steps {shown})"
    return _finding("loss_outliers", "pass", summary, evidence)


def _calm_grad_finding(calm: list[Spike], curve: Curve) -> Finding:
    worst = max(calm, key=lambda s: s.magnitude)
    steps = [s.start_step for s in calm]
    finite = curve.grad_norm[np.isfinite(curve.grad_norm) & (curve.grad_norm > 0)]
    evidence = {
        "count": len(calm),
        "steps": steps[:100],
        "max_magnitude": round(worst.magnitude, 3),
        "max_peak": worst.peak,
        "max_step": worst.start_step,
        "median_grad_norm": float(np.median(finite)) if len(finite) else None,
        "loss_response": False,
    }
    shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
    summary = (
        f"{len(calm)} isolated grad-norm outlier(s), the largest {_times(worst.magnitude)} at step "
        f"{worst.start_step} (peak {_g(worst.peak)}); the loss did not respond to any: nothing to act on "
        f"(at steps {shown})"
    )
    return _finding("grad_norm_outliers", "pass", summary, evidence)


def _spike_findings(
    check: str,
    name: str,
    values,
    found: list[Judged],
    grad: list[Spike] | None,
    *,
    quiet: int = 0,
    curve: Curve | None = None,
) -> list[Finding]:
    points = int(np.isfinite(values).sum())  # 0.0 and -0.0 are values
    if points < MIN_POINTS:
        why = (
            f"no {name} in this log"
            if points == 0
            else f"too short: {points} {name} points (need {MIN_POINTS})"
        )
        return [_finding(check, "not_run", why)]
    if not found:
        summary = f"no {name} spike in {points} logged points"
        if quiet:
            calm = "loss_outliers" if check == "loss_spike" else "grad_norm_outliers"
            summary = f"no {name} spike to act on in {points} logged points ({quiet} calm one(s): see {calm})"
        return [_finding(check, "pass", summary)]
    by_size = sorted(found, key=lambda j: (j.verdict != "fail", -j.spike.magnitude))
    shown = sorted(by_size[:MAX_SPIKE_FINDINGS], key=lambda j: j.spike.start_step)
    out = []
    for item in shown:
        spike = item.spike
        evidence = spike.to_evidence()
        evidence.update(rise=item.rise, rise_quanta=item.quanta, merged_spikes=item.parts)
        size = f"{_times(spike.magnitude)}"
        if check == "loss_spike":
            size += f", +{item.rise:.3g} nats"
            evidence["rise_nats"] = item.rise
        summary = (
            f"{name} spiked {size} at step {spike.start_step} (baseline {_g(spike.baseline)}, peak "
            f"{_g(spike.peak)} at step {spike.peak_step}); "
        )
        if spike.recovered_after_steps is None:
            summary += "not recovered by the end of the log"
        else:
            summary += f"back to baseline after {spike.recovered_after_steps} steps"
        if item.verdict == "fail" and spike.recovered_after_steps is not None:
            summary += f"; severe: {item.why}"
            evidence["severe"] = item.why
        if check == "loss_spike":
            led = _leading(spike, grad)
            evidence["grad_norm_led"] = None if grad is None else led is not None
            if led is not None:
                evidence["grad_norm_spike_step"] = led.start_step
                lead = spike.start_step - led.start_step
                summary += f"; grad norm spiked {lead} step{'s' if lead > 1 else ''} before it"
            elif curve is not None and grad is not None:
                row = int(np.searchsorted(curve.step, spike.start_step))
                if row < len(curve.step) and _grad_moved(curve, row, spike.points):
                    evidence["grad_norm_with"] = True
                    summary += f"; the grad norm jumped {GRAD_MOVED:g}× or more with it"
        out.append(_finding(check, item.verdict, summary, evidence, spike.start_step))
    if len(found) > len(shown):
        others = [j.spike.start_step for j in found if j not in shown]
        out[-1].evidence["more_spikes_at_steps"] = others[:100]
        out[-1].summary += f" ({len(others)} smaller spikes not listed)"
    return out


def _leading(spike: Spike, grad: list[Spike] | None) -> Spike | None:
    """The grad-norm spike that started within LEAD_STEPS before the loss spike, if any."""
    if not grad:
        return None
    before = [g for g in grad if spike.start_step - LEAD_STEPS <= g.start_step < spike.start_step]
    return before[-1] if before else None
