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
# One or two logged points that are back right after are a hard batch, not instability (Baize's
# batch-size-2 fine-tune: 8 of them at ~2.2×), where the log shows the whole excursion and nothing says the
# model was hurt: a row per step with a grad norm that did not move (or moved for that one step only), or a
# row per step of a log that prints each step's own loss; where each row is one step's loss sampled every N
# steps (Lightning `_step`, nanoGPT, torchtitan: 1.5–2.3× blips every 50 steps), within SAMPLED_MAX_Z of the
# log's noise. Not where a row is an interval's mean: a mean that doubles hides a far bigger step, and the
# row's one grad norm cannot vouch for the rest. A per-step row of a small batch (batch 1-32: HF
# `logging_steps=1`, Lightning per batch) swings far: public fine-tunes of that kind have hard batches of
# 3-4.75x with the grad norm calm and the next step back on the curve while the loss still falls fast, so a
# hard batch may reach ONE_STEP_MAX_MAGNITUDE.
ONE_STEP_MAX_MAGNITUDE = 5.0
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
    events, outliers = _fold_hard_batches(curve, raw, grad)
    reasons = [_hard_batch_reason(curve, s, grad) or "calm" for s in outliers]
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
        findings.append(_outlier_finding(outliers, minor, reasons))
    grad_judged = [
        judge(s, 1, curve.step, curve.grad_norm, quantum=0.0, reference=None, nats=False) for s in answered
    ]
    findings += _spike_findings(
        "grad_norm_spike", "grad norm", curve.grad_norm, grad_judged, None, quiet=len(calm)
    )
    if calm:
        findings.append(_calm_grad_finding(calm, curve))
    return [j.spike for j in raised], grad_spikes, findings


def _fold_hard_batches(
    curve: Curve, raw: list[Spike], grad: list[Spike] | None
) -> tuple[list[tuple[Spike, int]], list[Spike]]:
    """(events to judge, hard batches): an event of at most OUTLIER_MAX_POINTS detector spikes, each a hard
    batch on its own (back on the curve at once), is those hard batches. Two one-step blips two rows apart
    merge into one event, yet the curve was back between them: two hard batches, not one 3-row excursion."""
    events: list[tuple[Spike, int]] = []
    outliers: list[Spike] = []
    for event, parts in merge_events(raw, curve.step):
        inside = [r for r in raw if event.start_step <= r.start_step <= event.end_step]
        if parts <= OUTLIER_MAX_POINTS and all(_hard_batch(curve, r, grad) for r in inside):
            outliers += inside
        else:
            events.append((event, parts))
    return events, outliers


def _hard_batch(curve: Curve, spike: Spike, grad: list[Spike] | None) -> bool:
    return _hard_batch_reason(curve, spike, grad) is not None


def _hard_batch_reason(curve: Curve, spike: Spike, grad: list[Spike] | None) -> str | None:
    """Why the excursion is a hard batch (a REASONS key), None when it is not. At most OUTLIER_MAX_POINTS
    points, back right after, and one of:

    - a per-step row with a grad norm that did not spike before or with it (up to ONE_STEP_MAX_MAGNITUDE);
    - a per-step row of a log that prints each step's own loss (`loss_kind` "sample": llm.c, modded-nanogpt,
      Lightning per batch): the whole excursion is in the log, and it came straight back (up to
      ONE_STEP_MAX_MAGNITUDE; modded-nanogpt's two adjacent 1.48x rows at 1 % noise are 39σ, yet over);
    - a sampled row of a log that prints one step every N, within SAMPLED_MAX_Z of the log's noise (a row
      may be the tip of a longer rise there);
    - never a per-step mean with no grad norm, nor an interval's mean: nothing vouches for the row.

    A single loss point with a single grad-norm reading at the same step, both back at the next, is one
    hard batch as well (`_same_step`): a batch's loss and the gradient of that loss are computed before its
    update, so a batch that is hard shows in both; an update that hurt shows in the loss after it, and
    here the next step's loss is back (llm.c's GPT-2 124M: loss 1.09x with the grad norm 3x)."""
    if spike.points > OUTLIER_MAX_POINTS or spike.recovered_after_steps is None:
        return None
    if spike.magnitude > ONE_STEP_MAX_MAGNITUDE:
        return None
    row = int(np.searchsorted(curve.step, spike.start_step))
    if row >= len(curve.step) or curve.step[row] != spike.start_step:
        return None
    per_step = curve.interval[row] <= 1
    sampled = curve.loss_kind == "sample"
    near = _near_steps(curve)
    close = [g for g in grad or [] if spike.start_step - near <= g.start_step <= spike.end_step]
    paired = per_step and bool(close) and all(_same_step(g, spike) for g in close)
    if close and not paired:
        return None
    calm = grad is not None and (paired or not _grad_moved(curve, row, spike.points))
    if grad is not None and not calm:
        return None
    if per_step and calm:
        return "paired" if paired else "calm"
    if per_step and sampled:
        return "whole"
    if sampled and math.log(spike.magnitude) <= SAMPLED_MAX_Z * _noise_sigma(curve.loss):
        return "noise"
    return None


REASONS = {
    "calm": "no grad-norm spike before or with it",
    "paired": "a grad-norm reading up at the same step only, back at the next with the loss",
    "whole": "each step's own loss, every step printed: the whole excursion is in the log",
    "noise": f"within {SAMPLED_MAX_Z:g}σ of the log's own step-to-step noise",
}


def _same_step(g: Spike, spike: Spike) -> bool:
    """A grad-norm spike of one reading at the loss point's own step, back at the next, beside a loss
    excursion of one point."""
    return (
        spike.points == 1
        and g.points == 1
        and g.start_step == spike.start_step
        and g.recovered_after_steps is not None
    )


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


def _outlier_finding(outliers: list[Spike], minor: list[Judged], reasons: list[str]) -> Finding:
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
        "grad_norm_led": False if {"calm", "paired"} & set(reasons) else None,
        "why": {key: reasons.count(key) for key in REASONS if key in reasons},
    }
    parts = []
    if outliers:
        counted = [(reasons.count(key), text) for key, text in REASONS.items() if key in reasons]
        why = "; ".join(text if len(counted) == 1 else f"{count}: {text}" for count, text in counted)
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
        f"{worst.start_step} (peak {_g(worst.peak)}); the loss did not rise after any: nothing to act on "
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
