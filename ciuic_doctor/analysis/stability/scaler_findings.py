"""The fp16 loss-scaler checks as findings: `loss_scaler` (skips, calibration, steady scale, a suggested
init_scale or bf16), `overflow_storm` (≥ 5 skipped steps within 100 after calibration) and
`scale_collapse` (the scale at the framework's floor and still skipping, below 1 with GradScaler, or the
run died "already at minimum").

The detector is `stats/scaler.py`; this module turns its report into findings. Split from
`stability/checks.py` (spikes, divergence, non-finite losses, clipping) to keep each under 300 lines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ciuic_doctor.analysis.stability.findings import _finding
from ciuic_doctor.analysis.stats.scaler import ScalerReport, ScalerRule, analyse_scaler
from ciuic_doctor.rundir.findings import Finding

if TYPE_CHECKING:
    from ciuic_doctor.analysis.stability.curve import Curve
    from ciuic_doctor.importers import StepLog


def scaler(curve: Curve, log: StepLog) -> list[Finding]:
    own = [e for e in log.events if e.get("series", curve.series) == curve.series]  # this curve's, or shared
    fatal = [e["step"] for e in own if e.get("kind") == "scale_at_minimum" and e.get("step")]
    report = analyse_scaler(
        curve.step, curve.skipped, curve.interval, curve.scale, curve.lr,
        floor=log.min_scale, fatal_steps=fatal, steps_known=log.steps_known,
        framework=log.framework, printed=log.scaler, attempted=curve.attempted,
    )  # fmt: skip
    if not report.uses_scaler:
        if log.precision in ("bf16", "fp32"):
            why = f"precision {log.precision}: no dynamic loss scaling"
        elif log.precision == "fp16":
            why = "fp16, but the log prints no loss scale and no skipped step to judge the scaler by"
        else:
            why = "no dynamic loss scale in this log (bf16/fp32, or the log does not print it)"
        return [
            _finding(check, "not_run", why) for check in ("loss_scaler", "overflow_storm", "scale_collapse")
        ]
    return [_scaler_finding(report, curve, log), *_storm_findings(report, log), _collapse_finding(report)]


def _scaler_finding(report: ScalerReport, curve: Curve, log: StepLog) -> Finding:
    rule = ScalerRule()
    after_steps = max(1, report.steps_after_calibration)
    rate = report.skipped_after_calibration / after_steps
    config = report.config
    assert config is not None  # a scaler in use always has one
    allowed = max(rule.frequent_skip_rate, rule.configured_rate_margin * config.skips_per_step)
    frequent = report.skipped_after_calibration >= report.storm_skips and rate > allowed
    struggling = bool(report.storms) or report.collapse_step is not None or frequent
    suggested = report.steady_scale if report.steady_scale and report.collapse_step is None else None
    evidence = {
        "precision": log.precision or "fp16",
        "skipped_total": report.skipped_total,
        "skipped_after_calibration": report.skipped_after_calibration,
        "calibration_steps": report.calibration_steps,
        "calibration_skipped": report.calibration_skipped,
        "steady_scale": report.steady_scale,
        "initial_scale": report.initial_scale,
        "suggested_init_scale": suggested,
        "suggest_bf16": struggling,
        "skips_per_1000_steps_after_calibration": round(1000 * rate, 2),
        "overflows_near_lr_peak": report.overflows_near_lr_peak,
        "framework": log.framework,
        "scale_floor": report.floor,
        "steps_known": log.steps_known,
        "config": config.to_evidence(),
        "configured_skips_per_1000_steps": round(1000 * config.skips_per_step, 2),
    }
    calibrating = (
        f"{report.calibration_skipped} calibrating (to step {report.calibration_steps})"
        if report.calibration_skipped
        else "none calibrating"
    )
    parts = [
        f"{report.skipped_total} steps skipped: {calibrating}, {report.skipped_after_calibration} after "
        f"({1000 * rate:.3g} per 1000 steps)"
    ]
    if report.skipped_after_calibration and not frequent and not report.storms:
        said = {"log": "as the log sets it", "inferred": "inferred from the skip pattern"}.get(
            config.source["window_steps"], "the default"
        )
        setting = f"window {config.window_steps} steps, hysteresis {config.hysteresis}: {said}"
        if rate <= 1.25 * config.skips_per_step:
            parts.append(
                f"the scaler probing as configured ({setting}; up to {config.hysteresis} skips per "
                f"{config.window_steps} steps)"
            )
        else:
            parts.append(
                f"below the {1000 * allowed:.3g} per 1000 steps that would mean fp16 struggles ({setting})"
            )
    advice = []
    if suggested and report.calibration_skipped >= 2:
        advice.append(f"init_scale={suggested:g} (the scale it settled at) skips the calibration")
    if struggling:
        advice.append("fp16 keeps overflowing: bf16 (fp32's exponent range) needs no loss scaling")
    if report.overflows_near_lr_peak:
        advice.append("the skips crowd at the LR peak: lower the peak LR or lengthen the warm-up")
    summary = "; ".join(parts + advice)
    # Calibration skips alone are normal (Megatron's 2**32 start costs ~20): advice, not a warning.
    verdict = "warn" if struggling or report.overflows_near_lr_peak else "pass"
    return _finding("loss_scaler", verdict, summary, evidence)


def _storm_findings(report: ScalerReport, log: StepLog) -> list[Finding]:
    if not log.steps_known:
        return [
            _finding("overflow_storm", "not_run", "the overflow lines carry no step numbers (no step= lines)")
        ]
    if not report.storms:
        return [
            _finding(
                "overflow_storm",
                "pass",
                f"no {report.storm_skips}+ skips within {ScalerRule().storm_window_steps} steps after "
                "calibration",
            )
        ]
    out = []
    for storm in report.storms:
        evidence = {
            "start_step": storm.start_step,
            "end_step": storm.end_step,
            "skipped": storm.skipped,
            "window_steps": ScalerRule().storm_window_steps,
            "storm_skips": report.storm_skips,
            "scale_before": storm.scale_before,
            "scale_after": storm.scale_after,
            "lr_at_start": storm.lr_at_start,
            "near_lr_peak": report.overflows_near_lr_peak,
        }
        scale = ""
        if storm.scale_before is not None and storm.scale_after is not None:
            scale = f"; scale {storm.scale_before:g} → {storm.scale_after:g}"
        summary = (
            f"{storm.skipped} steps skipped between steps {storm.start_step} and {storm.end_step}{scale}"
        )
        out.append(_finding("overflow_storm", "warn", summary, evidence, storm.start_step))
    return out


def _collapse_finding(report: ScalerReport) -> Finding:
    floor = "below 1 (GradScaler has no floor)" if report.floor is None else f"the floor {report.floor:g}"
    if report.collapse_step is None:
        lowest = report.lowest_scale
        seen = f" (lowest {lowest:g})" if lowest is not None else ""
        never = "never went below 1" if report.floor is None else f"never sat at its floor {report.floor:g}"
        return _finding("scale_collapse", "pass", f"the loss scale {never}{seen}")
    evidence = {
        "scale": report.collapse_scale,
        "floor": report.floor,
        "fatal": report.fatal,
        "steady_scale": report.steady_scale,
        "skipped_from_collapse": report.skipped_from_collapse,
    }
    scale = f"{report.collapse_scale:g}" if report.collapse_scale is not None else "its floor"
    summary = f"loss scale collapsed at step {report.collapse_step}: it fell to {scale}, {floor}"
    if report.fatal:
        summary += '; the run died ("already at minimum")'
    elif report.floor is None:
        summary += "; PyTorch: that usually means NaN/inf in the forward pass (e.g. a bf16-pretrained model)"
    else:
        summary += f"; {report.skipped_from_collapse} steps skipped from there (the model stops training)"
    return _finding("scale_collapse", "fail", summary, evidence, report.collapse_step)
