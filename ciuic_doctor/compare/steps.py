"""Step records of two runs, compared: step time (overall and the pace of each rank), throughput,
skipped steps, and host / device memory (peaks and growth).

Step time is judged after the warm-up the step analysis drops too (analysis.steps.WARMUP_STEPS: step 1
has no time, step 2 still warms the allocator and the DataLoader). The job's step time is, per step, the
median over ranks: under DDP every rank ends a step together, so the ranks' times are one measurement, not
several. Who got slower shows in each rank's own pace, its time before backward (`pre_backward_s`, the
same figure the straggler check uses), compared rank by rank.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from ciuic_doctor.analysis.steps import MIN_STEADY_STEPS, WARMUP_STEPS
from ciuic_doctor.compare.change import Change, finding_for, judge_family
from ciuic_doctor.compare.stats import MIN_SAMPLES, RatioEstimate, count_test, ratio_of_means
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import as_float


def per_rank_series(records: list[dict[str, Any]], key: str) -> dict[int, dict[int, float]]:
    """{rank: {step: value}} of finite values of `key`, without the warm-up steps when enough remain."""
    raw: dict[int, dict[int, float]] = defaultdict(dict)
    for r in records:
        value = as_float(r.get(key))
        if (
            isinstance(r.get("rank"), int)
            and isinstance(r.get("step"), int)
            and value is not None
            and math.isfinite(value)
        ):
            raw[r["rank"]][r["step"]] = value
    out: dict[int, dict[int, float]] = {}
    for rank, by_step in raw.items():
        steady = {s: v for s, v in by_step.items() if s > WARMUP_STEPS}
        out[rank] = steady if len(steady) >= MIN_STEADY_STEPS else by_step
    return out


def job_series(records: list[dict[str, Any]], key: str = "step_time_s") -> list[float]:
    """Per step (in step order) the median over ranks: the job's own step time."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for series in per_rank_series(records, key).values():
        for step, value in series.items():
            by_step[step].append(value)
    return [statistics.median(values) for _, values in sorted(by_step.items())]


def _change(
    check: str, metric: str, scope: str, a: list[float], b: list[float], *, unit: str = "s"
) -> Change:
    """A level change of two series (step times, a memory level) by the block bootstrap."""
    change = Change(check=check, metric=metric, scope=scope, unit=unit, n_a=len(a), n_b=len(b))
    if len(a) < MIN_SAMPLES or len(b) < MIN_SAMPLES:
        change.note = f"fewer than {MIN_SAMPLES} steady steps ({len(a)} and {len(b)})"
        return change
    try:
        est = ratio_of_means(a, b)
    except ValueError as exc:
        change.note = str(exc)
        return change
    fill(change, est, statistics.fmean(a), statistics.fmean(b))
    return change


def fill(change: Change, est: RatioEstimate, a: float, b: float) -> None:
    change.a, change.b = a, b
    change.ratio, change.ci_low, change.ci_high = est.ratio, est.ci_low, est.ci_high
    change.p_value, change.method = est.p_value, est.method
    change.n_a, change.n_b = est.n_a, est.n_b


def step_time_findings(
    steps_a: list[dict[str, Any]],
    steps_b: list[dict[str, Any]],
    *,
    batch_a: tuple[int, int] | None,
    batch_b: tuple[int, int] | None,
    prefix: str,
) -> tuple[list[Finding], list[Change]]:
    """step_time, throughput and rank_pace findings (and their rows, for the report and the frame).

    batch_* = (samples, tokens) per optimizer step of the whole job, when known (from the spec).
    """
    a, b = job_series(steps_a), job_series(steps_b)
    overall = _change("step_time", "step time", "overall", a, b)
    judge_family([overall])
    findings = [
        finding_for(
            "step_time",
            [overall],
            prefix=prefix,
            what="step times",
            evidence={
                "a_mean_step_s": overall.a,
                "b_mean_step_s": overall.b,
                "steps_a": len(a),
                "steps_b": len(b),
            },
        )
    ]
    rows = [overall]
    throughput = _throughput(overall, batch_a, batch_b)
    rows += throughput
    findings.append(
        finding_for(
            "throughput",
            throughput[:1],  # tokens/s is samples/s times seq_len: one test, not a family of two
            prefix=prefix,
            what="throughput",
            evidence={
                "derived_from": "step_time (the same test: its interval inverted, its p-value)",
                "rows": [c.to_dict() for c in throughput],
            },
        )
    )
    pace_key = "pre_backward_s"
    pace_a, pace_b = per_rank_series(steps_a, pace_key), per_rank_series(steps_b, pace_key)
    if not (pace_a and pace_b):
        pace_key = "step_time_s"
        pace_a, pace_b = per_rank_series(steps_a, pace_key), per_rank_series(steps_b, pace_key)
    metric = "time before backward" if pace_key == "pre_backward_s" else "step time"
    per_rank = [
        _change("rank_pace", metric, f"rank {rank}", list(pace_a[rank].values()), list(pace_b[rank].values()))
        for rank in sorted(set(pace_a) & set(pace_b))
    ]
    judge_family(per_rank)
    worst = sorted(
        (c for c in per_rank if c.significant and c.ratio is not None),
        key=lambda c: -abs(c.ratio - 1.0),
    )
    findings.append(
        finding_for(
            "rank_pace",
            per_rank,
            prefix=prefix,
            what="per-rank pace",
            evidence={"pace_metric": pace_key},
            where={"ranks": [int(c.scope.split()[1]) for c in worst]} if worst else {},
        )
    )
    return findings, rows + per_rank


def _throughput(
    step: Change, batch_a: tuple[int, int] | None, batch_b: tuple[int, int] | None
) -> list[Change]:
    """samples/s and tokens/s from the step time: rate = batch / step time, so the ratio is the batch
    ratio over the step-time ratio, and its interval is the step time's, inverted."""
    rows = []
    for index, (metric, unit) in enumerate((("samples/s", "samples/s"), ("tokens/s", "tokens/s"))):
        change = Change(check="throughput", metric=metric, scope="overall", unit=unit, lower_is_better=False)
        if batch_a is None or batch_b is None or not batch_a[index] or not batch_b[index]:
            change.note = "samples per step unknown: a run recorded no global batch"
        elif step.ratio is None:
            change.note = step.note
        else:
            scale = batch_b[index] / batch_a[index]
            change.a = batch_a[index] / step.a if step.a else None
            change.b = batch_b[index] / step.b if step.b else None
            change.ratio = scale / step.ratio
            change.ci_low, change.ci_high = scale / step.ci_high, scale / step.ci_low
            change.p_value, change.p_adjusted = step.p_value, step.p_adjusted
            change.significant = step.significant if scale == 1 else None
            change.method = f"from step time ({step.method})"
            change.n_a, change.n_b = step.n_a, step.n_b
            if scale != 1:
                change.note = f"batch differs ({batch_a[index]} → {batch_b[index]} per step): not tested"
        rows.append(change)
    return rows


def skipped_finding(steps_a: list[dict[str, Any]], steps_b: list[dict[str, Any]], prefix: str) -> Finding:
    """Steps the GradScaler skipped (rank 0's records: every rank skips the same steps)."""

    def counts(records: list[dict[str, Any]]) -> tuple[int, int]:
        first = min((r["rank"] for r in records if isinstance(r.get("rank"), int)), default=0)
        mine = [r for r in records if r.get("rank", first) == first and isinstance(r.get("step"), int)]
        return sum(1 for r in mine if r.get("skipped")), len(mine)

    (k_a, n_a), (k_b, n_b) = counts(steps_a), counts(steps_b)
    change = Change(
        check="skipped_steps", metric="skipped steps", scope="overall", unit="steps", n_a=n_a, n_b=n_b
    )
    change.a, change.b = float(k_a), float(k_b)
    if n_a and n_b:
        rate_a, rate_b = k_a / n_a, k_b / n_b
        change.p_value = count_test(k_a, n_a, k_b, n_b)
        change.method = "exact conditional binomial test of the two skip rates"
        change.ratio = (rate_b / rate_a) if rate_a else (1.0 if not rate_b else None)
        judge_family([change])
    if change.ratio is None and n_a and n_b:
        return Finding(
            probe="compare",
            check="skipped_steps",
            verdict="warn" if change.significant else "pass",
            summary=f"{prefix}skipped steps {k_a} of {n_a} → {k_b} of {n_b}"
            + (": more, significant at 5 %" if change.significant else ": no significant change at 5 %"),
            evidence={**change.to_dict(), "ratio": None, "ci_low": None, "ci_high": None},
        )
    finding = finding_for("skipped_steps", [change], prefix=prefix, what="skipped-step counts")
    finding.summary = finding.summary.replace(change.text(), f"skipped steps {k_a} of {n_a} → {k_b} of {n_b}")
    return finding


def memory_changes(steps_a: list[dict[str, Any]], steps_b: list[dict[str, Any]]) -> list[Change]:
    """Peak and growth of each memory field the steps carry (host RSS; CUDA allocated / reserved / peak).

    A peak is one number per run: its ratio is shown without an interval. The steady level is a series
    and gets the block-bootstrap test; growth (bytes per step, first to last steady step) is shown."""
    rows = []
    for key, label in (
        ("rss", "host RSS"),
        ("mem_allocated", "CUDA allocated"),
        ("mem_reserved", "CUDA reserved"),
        ("mem_active_peak", "CUDA peak"),
    ):
        sa, sb = per_rank_series(steps_a, key), per_rank_series(steps_b, key)
        if not (sa and sb):
            continue
        level_a = job_series(steps_a, key)
        level_b = job_series(steps_b, key)
        level = _change("memory", f"{label} (steady level)", "overall", level_a, level_b, unit="bytes")
        rows.append(level)
        peak_a = max(max(v.values()) for v in sa.values())
        peak_b = max(max(v.values()) for v in sb.values())
        rows.append(
            Change(
                check="memory",
                metric=f"{label} peak",
                scope="overall",
                unit="bytes",
                a=peak_a,
                b=peak_b,
                ratio=peak_b / peak_a if peak_a else None,
                note="one peak per run: no interval",
            )
        )
        growth_a, growth_b = _growth(level_a), _growth(level_b)
        rows.append(
            Change(
                check="memory",
                metric=f"{label} growth",
                scope="overall",
                unit="bytes/step",
                a=growth_a,
                b=growth_b,
                note="growth per steady step (last − first) / steps: no interval",
            )
        )
    return rows


def _growth(series: list[float]) -> float | None:
    return (series[-1] - series[0]) / (len(series) - 1) if len(series) > 1 else None
