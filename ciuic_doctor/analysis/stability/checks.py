"""The stability checks as findings: one function per check family, each taking the folded Curve —
divergence (end against best, a steady climb, the eval loss), non-finite losses, clipping; the spikes are
in `stability/spike_findings.py` (re-exported here as `spikes`).

Kept apart from `stability.py` (the analysis entry point) so each file reads in one sitting; the
loss-scaler checks are in `stability/scaler_findings.py`, and the detectors themselves in `stats/spikes.py`
and
`stats/scaler.py`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ciuic_doctor.analysis.stability.climb import RECOVERED_RATIO, Climb, find_climb, find_eval_rise
from ciuic_doctor.analysis.stability.spike_findings import spikes
from ciuic_doctor.analysis.stats.spikes import GRAD_NORM_RULE, Spike, find_divergence, quantum_of

__all__ = ["clipping", "divergence", "nonfinite", "spikes"]
from ciuic_doctor.analysis.stability.findings import _finding, _g, _times
from ciuic_doctor.analysis.stability.series_kind import adversarial_divergence
from ciuic_doctor.rundir.findings import Finding

if TYPE_CHECKING:
    from ciuic_doctor.analysis.stability.curve import Curve

HEALTHY_QUANTILE = 0.99  # suggested max_norm sits above 99 % of healthy steps, so it trims only outliers
MOST_STEPS = 0.5  # clipping more than half the steps changes every update rather than guarding against spikes
# The first steps from initialisation carry the largest grad norms of a run: nanoGPT, minGPT's chargpt and
# build-nanogpt got max_norm 1.6 / 2.2 / 3.3 read from their first 20-41 steps. max_norm is read
# from the steady phase only: after the LR warm-up and after the first STEADY_AFTER_STEPS steps.
STEADY_AFTER_STEPS = 20
DIVERGENCE_MIN_POINTS = 16  # 8 blocks of 2 points: fewer cannot tell a rise from noise


# ---- spikes and divergence ---------------------------------------------------------------------


def divergence(curve: Curve, *, adversarial: bool = False) -> tuple[int | None, list[Finding]]:
    """(onset step of a divergence, findings): the loss ends far above its best (find_divergence), climbed
    steadily and did not come back (find_climb: an epoch-boundary drop at the end cannot hide it), ends in
    NaN/inf, or its eval loss rose from its best and stayed up (find_eval_rise).

    `adversarial`: the series is one of several optimizers' coupled losses (a GAN's): its level is not its
    quality, so only a non-finite tail is judged (stability.series_kind)."""
    has_loss = np.isfinite(curve.loss).any()
    if not has_loss and not curve.nonfinite.any():
        return None, [_finding("divergence", "not_run", "no loss values in this log")]
    if adversarial:
        return None, adversarial_divergence(curve, _nonfinite_tail(curve))
    points = int(np.isfinite(curve.loss).sum())  # 0.0 is a loss too
    quantum = quantum_of(curve.loss)
    found = find_divergence(curve.step, curve.loss, quantum=quantum)
    climb = find_climb(curve.step, curve.loss, curve.lr, quantum=quantum) if found is None else None
    eval_rise = find_eval_rise(curve.eval_loss, quantum=quantum)
    tail = _nonfinite_tail(curve)
    if found is None and climb is None and tail is None and eval_rise is None:
        if points < DIVERGENCE_MIN_POINTS:
            why = f"too short: {points} loss point{'s' if points != 1 else ''} (need {DIVERGENCE_MIN_POINTS})"
            return None, [_finding("divergence", "not_run", why)]
        finite = curve.loss[np.isfinite(curve.loss)]
        summary = "the loss did not diverge"
        if len(finite) >= 2:
            summary += f" (ends at {_g(finite[-1])}, best {_g(finite.min())}; no steady climb"
            summary += (
                f"; eval loss: {len(curve.eval_loss)} points, none stayed up)" if curve.eval_loss else ")"
            )
        return None, [_finding("divergence", "pass", summary)]
    evidence: dict[str, Any] = {"nonfinite_tail": tail is not None}
    verdict, onset = "fail", None
    parts: list[str] = []
    if found is not None:
        evidence.update(onset_step=found.onset_step, detected_step=found.detected_step, best_loss=found.best,
                        final_loss=found.final, ratio=found.ratio)  # fmt: skip
        onset = found.onset_step
        parts.append(
            f"loss diverged from step {onset}: it ends at {_g(found.final)}, {_times(found.ratio)} its best "
            f"{_g(found.best)}, and does not come back"
        )
    elif climb is not None:
        onset = climb.onset_step
        evidence.update(onset_step=onset, detected_step=climb.peak_step, best_loss=climb.best)
        evidence.update(final_loss=climb.final, ratio=climb.final_ratio, climb=_climb_evidence(climb))
        parts.append(_climb_text(climb))
        if climb.recovered_step is not None:
            verdict = "warn"
    elif tail is not None:
        onset = tail
        evidence.update(onset_step=tail, detected_step=tail)
    if tail is not None and found is None:
        parts.append(f"loss became NaN/inf at step {tail} and stayed so to the end of the log")
        verdict = "fail"
    if eval_rise is not None:
        evidence["eval"] = {
            "best_step": eval_rise.best_step,
            "best": eval_rise.best,
            "last_step": eval_rise.last_step,
            "last": eval_rise.last,
            "ratio": eval_rise.ratio,
            "points": eval_rise.points,
        }
        text = (
            f"eval loss rose {_times(eval_rise.ratio)} from its best {_g(eval_rise.best)} (step "
            f"{eval_rise.best_step}) to {_g(eval_rise.last)} at step {eval_rise.last_step} and did not come "
            "back"
        )
        if not parts:
            onset = eval_rise.best_step
            text += " while the train loss did not climb: overfitting, or eval data unlike the train data"
            verdict = "warn"
        elif verdict == "warn":
            verdict = "fail"  # the train loss came back, the eval loss did not: the run did not recover
        parts.append(text)
    return (onset if verdict == "fail" else None), [
        _finding("divergence", verdict, "; ".join(parts), evidence, onset)
    ]


def _climb_text(climb: Climb) -> str:
    text = (
        f"loss climbed {_times(climb.ratio)} from its best {_g(climb.best)} over {climb.steps} steps (from "
        f"step {climb.onset_step} to {_g(climb.peak)} at step {climb.peak_step})"
    )
    if climb.lr_warming and climb.lr_at_onset is not None and climb.lr_peak is not None:
        text += f" while the LR was still warming up ({_g(climb.lr_at_onset)} of a {_g(climb.lr_peak)} peak)"
    if climb.recovered_step is not None:
        return text + f"; back within {RECOVERED_RATIO:g}× of the best by step {climb.recovered_step}"
    return text + (
        f"; it ends at {_g(climb.final)}, {_times(climb.final_ratio)} its best, and never came back (a drop "
        "at the end, such as an epoch boundary, does not undo the climb)"
    )


def _climb_evidence(climb: Climb) -> dict[str, Any]:
    return {
        "onset_step": climb.onset_step, "peak_step": climb.peak_step, "best": climb.best, "peak": climb.peak,
        "ratio": climb.ratio, "final": climb.final, "final_ratio": climb.final_ratio,
        "recovered_step": climb.recovered_step, "steps": climb.steps, "lr_warming": climb.lr_warming,
    }  # fmt: skip


def _nonfinite_tail(curve: Curve, min_rows: int = 3) -> int | None:
    """First step of a run of non-finite losses that lasts to the end of the log."""
    bad = curve.nonfinite > 0
    if len(bad) < min_rows or not bad[-min_rows:].all():
        return None
    good = np.flatnonzero(~bad)
    first = good[-1] + 1 if len(good) else 0
    return int(curve.step[first])


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
        evidence = {"steady_points": int(healthy.sum()), "clip_max_norm": clip}  # the threshold in force
        return [_finding("clipping", "not_run", summary, evidence)]
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
        "steady_steps": list(steady),  # the steps max_norm is read from
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
            f"{fraction:.0%} of steps had grad norm above max_norm {clip:g}: clipping changes every update "
            f"(with SGD a smaller LR; with Adam-family optimizers mostly the moment estimates) instead of "
            f"guarding against spikes; healthy steps reach {_g(p99)} (p99, {based}): max_norm≈{computed:g}"
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
