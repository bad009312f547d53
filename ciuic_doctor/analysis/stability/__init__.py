"""Training stability: loss and grad-norm spikes, divergence, non-finite losses, and the fp16 loss scaler.

Reads our `steps` stream (`analyze(run)`) or any log the importers read (`analyze_log(log)`, used by the
`stability` command). Checks, with the evidence other tools rely on:

    loss_spike        one per event (spikes within 3 rows merged): where.step = first step; peak, baseline,
                      magnitude (peak/baseline), rise_nats, rise_quanta, recovered_after_steps (None: not
                      back by the end of the log), grad_norm_led; fail when not recovered or severe (above
                      where the run started after it had learned, or ≥ 1 nat for 10 % of the log)
    grad_norm_spike   one per spike the loss answered (same evidence, no grad_norm_led)
    divergence        the loss ends ≥ 1.5× its best and stays there, or climbed steadily ≥ 1.5× its best
                      (an epoch-boundary drop at the end does not hide it), or the eval loss rose ≥ 1.5×
                      its best and stayed up (warn alone: overfitting); where.step = onset
    nonfinite_loss    NaN/inf losses: count, first/last step, persistent (the log ends in them)
    overflow_storm    ≥ 5 skipped steps within 100 steps after calibration
    scale_collapse    the scale reached the framework's floor and kept skipping, went below 1 (GradScaler),
                      or the run died with "already at minimum"
    loss_scaler       precision, skipped_total, skipped_after_calibration, calibration_steps, steady_scale,
                      suggested_init_scale, suggest_bf16 (+ overflows_near_lr_peak and the advice)
    clipping          clip_max_norm, clipped_fraction, suggested_max_norm (from healthy steps)

    loss_outliers     one- or two-point outliers back at once with no grad-norm spike with them (hard
                      batches), and recovered bumps under 0.2 nats: one pass finding, not a warning each
    grad_norm_outliers  grad-norm spikes the loss never answered: one pass finding
    log_import        what was read (formats, rows, unread lines, engines, series) and what the import had
                      to decide; warn when paths that are not one run were given together

Rows from several ranks are folded into one curve per step first (mean loss, max grad norm, min scale, any
skip), so that a loss spike on one rank's batch still shows and a skip is counted once. Several series (two
DeepSpeed engines in one log, or separate runs) are judged one by one and their findings merged: one
finding per check naming the series (the worst first), and one per spike or storm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ciuic_doctor.analysis.stability.curve import Curve, fold
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir

if TYPE_CHECKING:
    from ciuic_doctor.importers import StepLog

STREAMS = ("steps",)
SECONDS_PER_MILLION_STEP_ROWS = 0.08  # 0.76 s at 10,000 ranks × 1,000 steps (side by side: longest first)
PROBE = "stability"


def analyze(run: RunDir) -> list[Finding]:
    from ciuic_doctor.errors import UserError
    from ciuic_doctor.importers import ours, ours_columnar

    try:
        many = len(run.stream_files("steps")) >= ours_columnar.MIN_FILES  # 1,024 rank files
        log = ours_columnar.load(run.path) if many else ours.load(run.path)
    except UserError as exc:
        return [Finding(probe=PROBE, check="loss_spike", verdict="not_run", summary=str(exc))]
    return analyze_log(log)


def analyze_log(log: StepLog, *, clip_max_norm: float | None = None) -> list[Finding]:
    """Every stability check on an imported log; `clip_max_norm` overrides the one in the log's meta."""
    from ciuic_doctor.analysis.stability.series import import_finding, merge_series

    if log.table is None or log.table.empty:
        return [Finding(probe=PROBE, check="loss_spike", verdict="not_run", summary="no step records")]
    series = sorted(int(k) for k in log.table["series"].unique())
    if len(series) == 1:
        findings = _judge(fold(log.table), log, clip_max_norm)
    else:
        names = log.series_names if len(log.series_names) == len(series) else [f"series {k}" for k in series]
        per_series = {
            name: _judge(
                fold(log.table[log.table["series"] == k]), log, clip_max_norm, name in log.adversarial
            )
            for name, k in zip(names, series, strict=True)
        }
        findings = merge_series(per_series)
    imported = import_finding(log)
    return findings + ([imported] if imported else [])


def _judge(
    curve: Curve, log: StepLog, clip_max_norm: float | None, adversarial: bool = False
) -> list[Finding]:
    import numpy as np

    # Values near the float range (a 1.7e308 loss) overflow to inf in a mean or a difference, which the
    # checks read as non-finite; numpy's RuntimeWarning for each reached the user as noise.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _judge_curve(curve, log, clip_max_norm, adversarial)


def _judge_curve(curve: Curve, log: StepLog, clip_max_norm: float | None, adversarial: bool) -> list[Finding]:
    from dataclasses import replace

    import numpy as np

    from ciuic_doctor.analysis.stability import checks
    from ciuic_doctor.analysis.stability.scaler_findings import scaler
    from ciuic_doctor.analysis.stability.series_kind import no_learning, signed_findings
    from ciuic_doctor.analysis.stats.signs import below_zero

    curve.loss_kind, curve.vocab_size = log.loss_kind, log.vocab_size
    curve.eval_loss = list(log.eval_loss) if curve.series == 0 else []  # the log's eval is its main run's
    findings: list[Finding] = no_learning(curve)
    signs = below_zero(curve.loss)
    if signs is not None:  # no floor at zero: the loss's level is not judged (stability.series_kind)
        findings += signed_findings(signs, checks._nonfinite_tail(curve))
        # the grad norm is still judged, on its own: a pass without the loss (its findings are replaced)
        _, grad_spikes, spike_findings = checks.spikes(
            replace(curve, loss=np.full(len(curve.loss), np.nan)), None
        )
        findings += [f for f in spike_findings if f.check not in ("loss_spike", "loss_outliers")]
    else:
        diverged, divergence_findings = checks.divergence(curve, adversarial=adversarial)
        _, grad_spikes, spike_findings = checks.spikes(curve, diverged, adversarial=adversarial)
        findings += spike_findings + divergence_findings
    findings += checks.nonfinite(curve)
    findings += scaler(curve, log)
    clip = clip_max_norm if clip_max_norm is not None else log.clip_max_norm
    findings += checks.clipping(curve, clip, grad_spikes)
    return findings


def write_findings(run: RunDir, findings: list[Finding]) -> None:
    """Merge `findings` into RUN/findings.json: this probe's earlier findings are replaced, the others'
    kept, in the file `analyze` writes (same keys; written whole with an atomic rename)."""
    import time

    from ciuic_doctor.analysis import FINDINGS_FILE, load_findings
    from ciuic_doctor.rundir.findings import sort_findings

    try:
        previous = run.read_json(FINDINGS_FILE) if (run.path / FINDINGS_FILE).exists() else {}
        kept = [f for f in load_findings(run) if f.probe != PROBE]
    except (ValueError, KeyError, TypeError):  # an unreadable findings.json is replaced, not merged
        previous, kept = {}, []
    analyses = previous.get("analyses", []) if isinstance(previous, dict) else []
    merged = sort_findings(kept + list(findings))
    run.write_json(
        FINDINGS_FILE,
        {
            "schema": 1,
            "created": time.time(),
            "analyses": sorted({*analyses, "stability"}),
            "findings": [f.to_dict() for f in merged],
        },
    )
