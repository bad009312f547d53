"""The stability checks as findings: one function per check family, each taking the folded Curve —
spikes and divergence, non-finite losses, clipping.

Kept apart from `stability.py` (the analysis entry point) so each file reads in one sitting; the
loss-scaler checks are in `_stability_scaler.py`, and the detectors themselves in `_spikes.py` and
`_scaler.py`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ciuic_doctor.analysis._spikes import (
    GRAD_NORM_RULE,
    LOSS_RULE,
    MIN_POINTS,
    Divergence,
    Spike,
    find_divergence,
    find_spikes,
    quantum_of,
)
from ciuic_doctor.analysis._stability_findings import _finding, _g, _times
from ciuic_doctor.findings import Finding

if TYPE_CHECKING:
    from ciuic_doctor.analysis._stability_curve import Curve

MAX_SPIKE_FINDINGS = 10
LEAD_STEPS = 100  # a grad-norm spike up to this many steps before a loss spike led it (OLMo 2's observation)
HEALTHY_QUANTILE = 0.99  # suggested max_norm sits above 99 % of healthy steps, so it trims only outliers
MOST_STEPS = 0.5  # clipping more than half the steps rescales the LR rather than guarding against spikes
# The first steps from initialisation carry the largest grad norms of a run: nanoGPT, minGPT's chargpt and
# build-nanogpt got max_norm 1.6 / 2.2 / 3.3 read from their first 20-41 steps (issue 21). max_norm is read
# from the steady phase only: after the LR warm-up and after the first STEADY_AFTER_STEPS steps.
STEADY_AFTER_STEPS = 20
DIVERGENCE_MIN_POINTS = 16  # 8 blocks of 2 points: fewer cannot tell a rise from noise
# One or two logged points up to 3× their neighbours that are back right after, with a grad norm that did
# not move, are a hard batch (Baize's batch-size-2 fine-tune: 8 of them at ~2.2×), not instability. Only
# where the log has a row per step: an interval's row shows one step's grad norm, which cannot vouch for
# the others, and an interval mean that doubles hides a far bigger step.
OUTLIER_MAX_MAGNITUDE = 3.0
OUTLIER_MAX_POINTS = 2


# ---- spikes and divergence ---------------------------------------------------------------------


def divergence(curve: Curve) -> tuple[Divergence | None, list[Finding]]:
    has_loss = np.isfinite(curve.loss).any()
    if not has_loss and not curve.nonfinite.any():
        return None, [_finding("divergence", "not_run", "no loss values in this log")]
    points = int((np.isfinite(curve.loss) & (curve.loss > 0)).sum())
    found = find_divergence(curve.step, curve.loss, quantum=quantum_of(curve.loss))
    tail = _nonfinite_tail(curve)
    if found is None and tail is None and points < DIVERGENCE_MIN_POINTS:
        why = f"too short: {points} loss point{'s' if points != 1 else ''} (need {DIVERGENCE_MIN_POINTS})"
        return None, [_finding("divergence", "not_run", why)]
    if found is None and tail is None:
        finite = curve.loss[np.isfinite(curve.loss)]
        summary = "the loss did not diverge"
        if len(finite) >= 2:
            summary += f" (ends at {_g(finite[-1])}, best {_g(finite.min())})"
        return None, [_finding("divergence", "pass", summary)]
    evidence: dict[str, Any] = {"nonfinite_tail": tail is not None}
    if found is not None:
        evidence.update(onset_step=found.onset_step, detected_step=found.detected_step, best_loss=found.best,
                        final_loss=found.final, ratio=found.ratio)  # fmt: skip
        onset = found.onset_step
        summary = (
            f"loss diverged from step {onset}: it ends at {_g(found.final)}, {_times(found.ratio)} its best "
            f"{_g(found.best)}, and does not come back"
        )
    else:
        onset = tail
        evidence.update(onset_step=tail, detected_step=tail)
        summary = f"loss became NaN/inf at step {tail} and stayed so to the end of the log"
    return found, [_finding("divergence", "fail", summary, evidence, onset)]


def _nonfinite_tail(curve: Curve, min_rows: int = 3) -> int | None:
    """First step of a run of non-finite losses that lasts to the end of the log."""
    bad = curve.nonfinite > 0
    if len(bad) < min_rows or not bad[-min_rows:].all():
        return None
    good = np.flatnonzero(~bad)
    first = good[-1] + 1 if len(good) else 0
    return int(curve.step[first])


def spikes(curve: Curve, diverged: Divergence | None) -> tuple[list[Spike], list[Spike], list[Finding]]:
    findings: list[Finding] = []
    grad_spikes = find_spikes(
        curve.step, curve.grad_norm, GRAD_NORM_RULE, quantum=quantum_of(curve.grad_norm)
    )
    loss_spikes = find_spikes(curve.step, curve.loss, LOSS_RULE, quantum=quantum_of(curve.loss))
    if diverged is not None:  # an unrecovered rise at the divergence is the divergence, reported there
        loss_spikes = [
            s for s in loss_spikes
            if s.recovered_after_steps is not None or s.start_step < diverged.onset_step - LEAD_STEPS
        ]  # fmt: skip
    has_grad = int((np.isfinite(curve.grad_norm) & (curve.grad_norm > 0)).sum()) >= MIN_POINTS
    grad = grad_spikes if has_grad else None
    outliers = [s for s in loss_spikes if _per_step_row(curve, s.start_step) and _hard_batch(s, grad)]
    loss_spikes = [s for s in loss_spikes if s not in outliers]
    findings += _spike_findings("loss_spike", "loss", curve.loss, loss_spikes, grad, outliers=len(outliers))
    if outliers:
        findings.append(_outlier_finding(outliers))
    findings += _spike_findings("grad_norm_spike", "grad norm", curve.grad_norm, grad_spikes, None)
    return loss_spikes, grad_spikes, findings


def _per_step_row(curve: Curve, step: int) -> bool:
    row = int(np.searchsorted(curve.step, step))
    return row < len(curve.step) and curve.step[row] == step and curve.interval[row] <= 1


def _hard_batch(spike: Spike, grad: list[Spike] | None) -> bool:
    """At most OUTLIER_MAX_POINTS points, back right after, at most OUTLIER_MAX_MAGNITUDE×, and a grad norm
    that was read and did not spike before or with it."""
    if grad is None or spike.points > OUTLIER_MAX_POINTS or spike.recovered_after_steps is None:
        return False
    if spike.magnitude > OUTLIER_MAX_MAGNITUDE:
        return False
    return not any(spike.start_step - LEAD_STEPS <= g.start_step <= spike.end_step for g in grad)


def _outlier_finding(outliers: list[Spike]) -> Finding:
    steps = [s.start_step for s in outliers]
    worst = max(outliers, key=lambda s: s.magnitude)
    evidence = {
        "count": len(outliers),
        "steps": steps[:100],
        "max_magnitude": round(worst.magnitude, 3),
        "median_magnitude": round(float(np.median([s.magnitude for s in outliers])), 3),
        "max_points": max(s.points for s in outliers),
        "grad_norm_led": False,
    }
    summary = (
        f"{len(outliers)} short loss outlier(s) up to {_times(worst.magnitude)} (at steps "
        f"{', '.join(map(str, steps[:8]))}{', ...' if len(steps) > 8 else ''}): each back within "
        f"{OUTLIER_MAX_POINTS} logged points, with no grad-norm spike before or with it; they look like hard "
        "batches, not instability"
    )
    return _finding("loss_outliers", "pass", summary, evidence)


def _spike_findings(
    check: str, name: str, values, found: list[Spike], grad: list[Spike] | None, *, outliers: int = 0
):
    points = int((np.isfinite(values) & (values > 0)).sum())
    if points < MIN_POINTS:
        why = (
            f"no {name} in this log"
            if points == 0
            else f"too short: {points} {name} points (need {MIN_POINTS})"
        )
        return [_finding(check, "not_run", why)]
    if not found:
        summary = f"no {name} spike in {points} logged points"
        if outliers:
            summary = (
                f"no {name} spike that lasted in {points} logged points ({outliers} short outlier(s) that "
                "recovered at once: see loss_outliers)"
            )
        return [_finding(check, "pass", summary)]
    shown = sorted(sorted(found, key=lambda s: -s.magnitude)[:MAX_SPIKE_FINDINGS], key=lambda s: s.start_step)
    out = []
    for spike in shown:
        evidence = spike.to_evidence()
        summary = (
            f"{name} spiked {_times(spike.magnitude)} at step {spike.start_step} (baseline "
            f"{_g(spike.baseline)}, peak {_g(spike.peak)} at step {spike.peak_step}); "
        )
        if spike.recovered_after_steps is None:
            summary += "not recovered by the end of the log"
        else:
            summary += f"back to baseline after {spike.recovered_after_steps} steps"
        if check == "loss_spike":
            led = _leading(spike, grad)
            evidence["grad_norm_led"] = None if grad is None else led is not None
            if led is not None:
                evidence["grad_norm_spike_step"] = led.start_step
                lead = spike.start_step - led.start_step
                summary += f"; grad norm spiked {lead} step{'s' if lead > 1 else ''} before it"
        verdict = "fail" if spike.recovered_after_steps is None else "warn"
        out.append(_finding(check, verdict, summary, evidence, spike.start_step))
    if len(found) > len(shown):
        others = [s.start_step for s in found if s not in shown]
        out[-1].evidence["more_spikes_at_steps"] = others[:100]
        out[-1].summary += f" ({len(others)} smaller spikes not listed)"
    return out


def _leading(spike: Spike, grad: list[Spike] | None) -> Spike | None:
    """The grad-norm spike that started within LEAD_STEPS before the loss spike, if any."""
    if not grad:
        return None
    before = [g for g in grad if spike.start_step - LEAD_STEPS <= g.start_step < spike.start_step]
    return before[-1] if before else None


# ---- non-finite losses -------------------------------------------------------------------------


def nonfinite(curve: Curve) -> list[Finding]:
    rows = np.flatnonzero(curve.nonfinite > 0)
    if not len(rows):
        if not np.isfinite(curve.loss).any():
            return [_finding("nonfinite_loss", "not_run", "no loss values in this log")]
        return [_finding("nonfinite_loss", "pass", "every logged loss is finite")]
    steps = curve.step[rows]
    persistent = bool(curve.nonfinite[-1] > 0)
    handled = int((curve.skipped[rows] > 0).sum())
    evidence = {
        "count": int(curve.nonfinite[rows].sum()),
        "rows": len(rows),
        "first_step": int(steps[0]),
        "last_step": int(steps[-1]),
        "steps": [int(s) for s in steps[:20]],
        "persistent": persistent,
        "skipped_by_scaler": handled,
    }
    summary = f"{evidence['count']} non-finite loss value(s), first at step {steps[0]}"
    if persistent:
        summary += "; the log ends in them (the run is dead)"
    elif handled:
        summary += f"; the loss scaler skipped {handled} of those steps"
    return [_finding("nonfinite_loss", "fail" if persistent else "warn", summary, evidence, int(steps[0]))]


# ---- clipping --------------------------------------------------------------------------------------


def clipping(curve: Curve, clip: float | None, grad_spikes: list[Spike]) -> list[Finding]:
    finite = np.isfinite(curve.grad_norm) & (curve.skipped == 0)
    if finite.sum() <= GRAD_NORM_RULE.min_history:
        count = int(finite.sum())
        why = "no grad norm in this log" if not count else f"only {count} grad norm values (need > 16)"
        return [_finding("clipping", "not_run", why)]
    first = float(np.min(curve.step[finite]))
    early = curve.step < first + STEADY_AFTER_STEPS
    healthy = finite & ~_inside(curve.step, grad_spikes) & _after_warmup(curve, finite) & ~early
    if healthy.sum() <= GRAD_NORM_RULE.min_history:
        summary = (
            f"max_norm is read from the steady phase only (after the LR warm-up and the first "
            f"{STEADY_AFTER_STEPS} steps, where grad norms from initialisation are largest): "
            f"{int(healthy.sum())} steady steps here, need > {GRAD_NORM_RULE.min_history}"
        )
        return [_finding("clipping", "not_run", summary, {"steady_points": int(healthy.sum())})]
    values = curve.grad_norm[healthy]
    steady = (int(np.min(curve.step[healthy])), int(np.max(curve.step[healthy])))
    based = f"from {len(values)} steady steps ({steady[0]}–{steady[1]})"
    p99 = float(np.quantile(values, HEALTHY_QUANTILE))
    median = float(np.median(values))
    computed = _nice_ceil(p99)
    evidence: dict[str, Any] = {
        "clip_max_norm": clip,
        "clipped_fraction": None,
        "suggested_max_norm": computed,
        "healthy_median": median,
        "healthy_p99": p99,
        "healthy_points": len(values),
        "steady_steps": list(steady),  # issue 21: the steps max_norm is read from
        "based_on": based,
        "grad_norm_spikes": len(grad_spikes),
    }
    if clip is None:
        summary = (
            "clip threshold unknown (pass --clip, or record job.optim.clip_max_norm); healthy grad norms "
            f"stay below {_g(p99)}"
        )
        return [_finding("clipping", "not_run", summary, evidence)]
    norms = curve.grad_norm[finite]
    fraction = float((norms > clip).mean()) if clip > 0 else 0.0
    evidence["clipped_fraction"] = round(fraction, 4)
    peaks = [s.peak for s in grad_spikes]
    if clip > 0 and fraction > MOST_STEPS:
        summary = (
            f"{fraction:.0%} of steps had grad norm above max_norm {clip:g}: clipping rescales the LR "
            f"instead of guarding against spikes; healthy steps reach {_g(p99)} (p99, {based}): "
            f"max_norm≈{computed:g}"
        )
        return [_finding("clipping", "warn", summary, evidence)]
    if peaks and (clip <= 0 or clip > max(peaks)):
        state = "disabled" if clip <= 0 else f"at {clip:g} is above every spike (peak {_g(max(peaks))})"
        summary = (
            f"clipping {state}: the {len(peaks)} grad-norm spike(s) went through unclipped; "
            f"max_norm≈{computed:g} sits above 99 % of healthy steps ({based}) and would cap them"
        )
        return [_finding("clipping", "warn", summary, evidence)]
    evidence["suggested_max_norm"] = clip if clip > 0 else computed  # nothing to change
    if clip > 0:
        summary = (
            f"max_norm {clip:g} clipped {fraction:.1%} of steps; healthy grad norms {based}: median "
            f"{_g(median)}, p99 {_g(p99)}"
        )
    else:
        summary = f"clipping disabled and no grad-norm spike needed it (healthy p99 {_g(p99)}, {based})"
    return [_finding("clipping", "pass", summary, evidence)]


def _inside(step: np.ndarray, found: list[Spike]) -> np.ndarray:
    mask = np.zeros(len(step), dtype=bool)
    for s in found:
        mask |= (step >= s.start_step) & (step <= s.end_step)
    return mask


def _after_warmup(curve: Curve, finite: np.ndarray) -> np.ndarray:
    """Steps after the LR first reaches 95 % of its peak (else after the first 10 % of the log)."""
    lr = curve.lr
    if np.isfinite(lr).any() and np.nanmax(lr) > 0:
        reached = np.flatnonzero(lr >= 0.95 * np.nanmax(lr))
        mask = np.arange(len(lr)) >= reached[0]
        if (mask & finite).sum() > GRAD_NORM_RULE.min_history:
            return mask
    return np.arange(len(lr)) >= len(lr) // 10


def _nice_ceil(value: float) -> float:
    """Round up to two significant digits (0.0137 -> 0.014, 2.31 -> 2.4)."""
    if not value > 0 or not math.isfinite(value):
        return value
    digits = 1 - math.floor(math.log10(value))
    return math.ceil(value * 10**digits) / 10**digits
