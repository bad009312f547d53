"""Loss curves of two runs at the same steps: bit-identical, the same within their own noise, or apart.

The tolerance comes from the runs themselves: a loss curve is a slow trend plus step-to-step noise, and
the first differences of a series cancel the trend, so the noise of one step is the robust spread of the
differences over sqrt(2) (MAD × 1.4826 / sqrt(2)). Two runs' losses at one step then differ by noise alone
with a standard deviation of sqrt(σA² + σB²); a step whose difference exceeds TOLERANCE_SIGMAS of that is
outside the noise. Whether B is lower or higher overall is the mean paired difference with a circular
block bootstrap interval (differences at consecutive steps are correlated: same data, nearby weights).

Per step the loss is the mean over ranks (each rank sees its own shard of the batch). Bit-identical is
checked on every rank's value, exactly, as a resume-fidelity check would: same seed, same data order and a
deterministic backend (the CPU job) reproduce every bit; anything else should not claim it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from typing import Any

from ciuic_doctor.compare.change import PROBE, Change
from ciuic_doctor.compare.stats import ALPHA, MIN_SAMPLES, mean_difference
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import as_float

TOLERANCE_SIGMAS = 4.0  # |z| > 4 happens by chance at 6 in 100,000 steps of Gaussian noise


def _losses(records: list[dict[str, Any]]) -> dict[int, dict[int, float]]:
    """{step: {rank: loss}} for finite losses; a loss beyond ±1e150 (no float32/bf16 training gives one:
    their largest value is 3.4e38) is left out, so the means and differences below cannot overflow."""
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for r in records:
        value = as_float(r.get("loss"))
        if (
            isinstance(r.get("step"), int)
            and value is not None
            and math.isfinite(value)
            and abs(value) <= 1e150
        ):
            out[r["step"]][r.get("rank") if isinstance(r.get("rank"), int) else 0] = value
    return out


def step_noise(curve: list[float]) -> float:
    """One step's loss noise around the trend: MAD of first differences × 1.4826 / sqrt(2).

    >>> round(step_noise([5.0, 5.2, 4.9, 5.1, 4.8, 5.0, 4.7]), 3)
    0.262
    """
    diffs = [b - a for a, b in itertools.pairwise(curve)]
    if len(diffs) < 2:
        return 0.0
    middle = statistics.median(diffs)
    return 1.4826 * statistics.median(abs(d - middle) for d in diffs) / math.sqrt(2)


def loss_finding(
    steps_a: list[dict[str, Any]], steps_b: list[dict[str, Any]], prefix: str
) -> tuple[Finding, Change]:
    la, lb = _losses(steps_a), _losses(steps_b)
    matched = sorted(set(la) & set(lb))
    change = Change(
        check="loss", metric="mean loss", scope="matched steps", unit="", n_a=len(la), n_b=len(lb)
    )
    if len(matched) < MIN_SAMPLES:
        change.note = f"{len(matched)} matched steps with a loss (need {MIN_SAMPLES})"
        return (
            Finding(
                probe=PROBE, check="loss", verdict="not_run", summary=f"loss: not compared ({change.note})"
            ),
            change,
        )
    curve_a = [statistics.fmean(la[s].values()) for s in matched]
    curve_b = [statistics.fmean(lb[s].values()) for s in matched]
    change.a, change.b = statistics.fmean(curve_a), statistics.fmean(curve_b)
    evidence: dict[str, Any] = {
        "matched_steps": len(matched),
        "first_step": matched[0],
        "last_step": matched[-1],
    }
    identical = all(la[s] == lb[s] for s in matched)
    if identical:
        change.ratio, change.ci_low, change.ci_high, change.p_value = 1.0, 1.0, 1.0, 1.0
        change.significant, change.method = False, "exact comparison of every rank's loss"
        return (
            Finding(
                probe=PROBE,
                check="loss",
                verdict="pass",
                summary=f"{prefix}loss bit-identical at all {len(matched)} matched steps, every rank "
                f"(steps {matched[0]}–{matched[-1]})",
                evidence={
                    **evidence,
                    "bit_identical": True,
                    "ratio": 1.0,
                    "ci_low": 1.0,
                    "ci_high": 1.0,
                    "significant": False,
                    "max_abs_diff": 0.0,
                },
            ),
            change,
        )
    noise = math.hypot(step_noise(curve_a), step_noise(curve_b))
    tolerance = TOLERANCE_SIGMAS * noise
    diffs = [b - a for a, b in zip(curve_a, curve_b, strict=True)]
    outside = [s for s, d in zip(matched, diffs, strict=True) if abs(d) > tolerance]
    mean, low, high, p = mean_difference(diffs)
    change.ratio = change.b / change.a if change.a else None
    change.ci_low = (change.a + low) / change.a if change.a else None
    change.ci_high = (change.a + high) / change.a if change.a else None
    change.p_value, change.p_adjusted = p, p
    change.significant = p < ALPHA
    change.method = "circular block bootstrap of the paired differences"
    direction = change.direction
    evidence.update(
        bit_identical=False,
        ratio=change.ratio,
        ci_low=change.ci_low,
        ci_high=change.ci_high,
        significant=change.significant,
        change=direction,
        p_value=p,
        mean_diff=mean,
        diff_ci=[low, high],
        max_abs_diff=max(abs(d) for d in diffs),
        step_noise=noise,
        tolerance=tolerance,
        tolerance_rule=f"{TOLERANCE_SIGMAS:g} × sqrt(σA² + σB²), σ from each run's first differences",
        steps_outside=len(outside),
        first_step_outside=outside[0] if outside else None,
    )
    where = {"step": outside[0]} if outside else {}
    apart = (
        f"{len(outside)} of {len(matched)} steps differ by more than the tolerance {tolerance:.3g} "
        f"(first at step {outside[0]})"
        if outside
        else f"every step within the tolerance {tolerance:.3g} from the runs' own noise"
    )
    shown = f"{_signed(mean)}, 95 % CI {_signed(low)} … {_signed(high)}"
    level = (
        f"B's loss is {direction} on average ({shown})"
        if change.significant
        else f"no significant difference on average ({shown})"
    )
    return (
        Finding(
            probe=PROBE,
            check="loss",
            verdict="warn" if direction == "worse" else "pass",
            summary=f"{prefix}loss not bit-identical at {len(matched)} matched steps: {apart}; {level}",
            evidence=evidence,
            where=where,
        ),
        change,
    )


def _signed(value: float) -> str:
    """+0.0123 / −0.0123 with a true minus sign, as the percentages are written."""
    return f"{value:+.3g}".replace("-", "−")
