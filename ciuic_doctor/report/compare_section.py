"""The report's comparison section (`report RUN_B --baseline RUN_A`): what changed against a baseline run.

The figures come from `ciuic_doctor.compare` (the same rows `ciuic-doctor compare` prints), the plots draw
both runs overlaid (A dashed, B solid): step time and loss per step, busbw per size, and every change with
its 95 % interval on one axis, so "better", "worse" and "inside the noise" read at a glance.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from ciuic_doctor.compare import Comparison
from ciuic_doctor.compare.change import UNJUDGED, interval, percent
from ciuic_doctor.compare.steps import job_series
from ciuic_doctor.report.blocks import Section, Table, bytes_cell
from ciuic_doctor.report.plots import INK, PALETTE, _pyplot, _text, _thin, busbw_plot, to_svg
from ciuic_doctor.rundir.store import RunDir, as_float

COLOURS = {"A": PALETTE[6], "B": PALETTE[0]}  # baseline grey, candidate blue
STYLES = {"A": "--", "B": "-"}
COMPARISON_FILE = "comparison.json"  # the same file `ciuic-doctor compare --out RUN` writes


def write_comparison(baseline: RunDir, run: RunDir) -> Section:
    """Compare `run` with `baseline`, write RUN/comparison.json, and return the report section."""
    from ciuic_doctor.compare import compare_runs

    comparison = compare_runs(baseline, run)
    run.write_json(COMPARISON_FILE, comparison.to_dict())
    return comparison_section(comparison, baseline, run)


def comparison_section(comparison: Comparison, baseline: RunDir, run: RunDir) -> Section:
    section = Section(
        id="compare",
        title="Compared with the baseline (compare)",
        command="compare",
        probes=("compare",),
        streams=(),
        ran=True,
        intro=(
            f"B = this run, A = the baseline {baseline.path.name}. Every change is B / A with a 95 % "
            "confidence interval; step times are autocorrelated, so their intervals come from a circular "
            "block bootstrap. Rows of one check are Holm-corrected; across checks each stands at 5 %."
        ),
        findings=list(comparison.findings),
    )
    steps_a, steps_b = baseline.read("steps").records, run.read("steps").records
    for svg in (
        _forest_plot(comparison),
        _series_plot(
            steps_a, steps_b, "step_time_s", label="step time (ms)", scale=1e3, name="step time, A vs B"
        ),
        _series_plot(
            steps_a, steps_b, "loss", label="loss (mean over ranks)", scale=1.0, name="loss, A vs B"
        ),
        _busbw_plot(baseline.read("comm").records, run.read("comm").records),
    ):
        if svg:
            section.plots.append(svg)
    if comparison.settings:
        section.tables.append(
            Table(
                title="Settings that differ",
                headers=["setting", "A (baseline)", "B (this run)", "source"],
                rows=[
                    [(s.key, s.key), _plain(s.a), _plain(s.b), (s.source, s.source)]
                    for s in comparison.settings
                ],
            )
        )
    else:
        section.notes.append(
            "Both runs used the same settings (spec, injected faults, environment, versions)."
        )
    rows = []
    for c in comparison.changes:
        ci = interval(c.ci_low, c.ci_high) if c.ci_low is not None and c.ci_high is not None else "—"
        rows.append(
            [
                (c.check, c.check),
                (c.metric, c.metric),
                (c.scope, c.scope),
                _value(c.a, c.unit),
                _value(c.b, c.unit),
                (percent(c.ratio), c.ratio) if c.ratio is not None else ("—", ""),
                (ci, c.ci_low if c.ci_low is not None else ""),
                _p(c.p_adjusted if c.p_adjusted is not None else c.p_value),
                (c.note if c.direction == UNJUDGED and c.note else c.direction, c.direction),
            ]
        )
    section.tables.append(
        Table(
            title="Every measurement both runs have",
            headers=["check", "measure", "scope", "A", "B", "change", "95 % CI", "p (Holm)", "judged"],
            rows=rows,
            numeric=[3, 4, 5, 7],
        )
    )
    return section


def _plain(value: Any) -> tuple[str, Any]:
    text = "(unset)" if value is None else str(value)
    return (text, text)


def _value(value: float | None, unit: str) -> tuple[str, Any]:
    if value is None:
        return ("—", "")
    if unit == "s":
        return (f"{value * 1e3:.1f} ms", value)
    if unit == "bytes":
        return bytes_cell(value)
    if unit == "bytes/step":
        shown, _ = bytes_cell(abs(value))
        return (f"{'−' if value < 0 else ''}{shown}/step", value)
    return (f"{value:.4g} {unit}".strip(), value)


def _p(value: float | None) -> tuple[str, Any]:
    if value is None:
        return ("—", "")
    return ("< 0.001" if value < 0.001 else f"{value:.3f}", value)


def _forest_plot(comparison: Comparison) -> str | None:
    """Every judged change as a point with its 95 % interval, in per cent; 0 is "no change"."""
    rows = [
        c
        for c in comparison.changes
        if c.ratio is not None and c.ci_low is not None and c.ci_high is not None
    ]
    if not rows:
        return None
    plt = _pyplot()
    # A page, not a wall: every comm-bench size would crowd out the rest, so only the sizes that changed
    # significantly are drawn (the table below has them all).
    rows = [c for c in rows if c.check != "busbw" or c.significant][:40]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9.5, 0.28 * len(rows) + 1.0), layout="constrained")
    colour = {"better": PALETTE[2], "worse": PALETTE[5]}
    for i, c in enumerate(reversed(rows)):
        mid, low, high = ((v - 1) * 100 for v in (c.ratio, c.ci_low, c.ci_high))
        ax.errorbar(
            mid,
            i,
            xerr=[[mid - low], [high - mid]],
            fmt="o",
            markersize=4,
            capsize=2,
            color=colour.get(c.direction, PALETTE[6]),
        )
    ax.axvline(0, color=INK, linewidth=0.8)
    # An interval from two checkpoint saves can span +1000 %: clip the axis, not the point estimates.
    mids = [(c.ratio - 1) * 100 for c in rows]
    ax.set_xlim(max(-100.0, min(mids) - 50), max(50.0, min(max(mids) + 50, 400.0)))
    ax.set_yticks(range(len(rows)), [_text(f"{c.metric} · {c.scope}") for c in reversed(rows)], fontsize=8)
    ax.set_xlabel("change B vs A (%), 95 % CI — green better, red worse, grey inside the noise")
    return to_svg(fig, "every change with its 95 % confidence interval")


def _series_plot(
    steps_a: list[dict[str, Any]],
    steps_b: list[dict[str, Any]],
    key: str,
    *,
    label: str,
    scale: float,
    name: str,
) -> str | None:
    series = {}
    for run, records in (("A", steps_a), ("B", steps_b)):
        by_step: dict[int, list[float]] = defaultdict(list)
        for r in records:
            value = as_float(r.get(key))
            if isinstance(r.get("step"), int) and value is not None and math.isfinite(value):
                by_step[r["step"]].append(value)
        if by_step:
            series[run] = sorted(by_step.items())
    if len(series) < 2:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 3.0), layout="constrained")
    for run, points in series.items():
        xs = [s for s, _ in points]
        ys = [
            scale * sorted(v)[len(v) // 2] if key == "step_time_s" else scale * sum(v) / len(v)
            for _, v in points
        ]
        xs, ys = _thin(xs, ys)
        ax.plot(xs, ys, linestyle=STYLES[run], color=COLOURS[run], linewidth=1.3, label=f"{run}")
    if key == "step_time_s":
        steady = [*job_series(steps_a), *job_series(steps_b)]
        if steady:  # keep a slow first step from flattening the rest
            ax.set_ylim(0, 1.6 * max(steady) * scale)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.legend(["A (baseline)", "B (this run)"], fontsize=8)
    return to_svg(fig, name)


def _busbw_plot(records_a: list[dict[str, Any]], records_b: list[dict[str, Any]]) -> str | None:
    """busbw vs size per collective, out-of-place, both runs on one panel: the report's own busbw plot
    with each algorithm named per run ("ring · A", "ring · B")."""
    both = {str(r.get("collective")) for r in records_a} & {str(r.get("collective")) for r in records_b}
    merged = [
        {**r, "algo": f"{r.get('algo') or r.get('algo_used') or 'default'} · {run}"}
        for run, records in (("A", records_a), ("B", records_b))
        for r in records
        if not r.get("inplace") and str(r.get("collective")) in both
    ]
    return busbw_plot(merged) if merged else None
