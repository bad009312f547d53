"""The overview picture at the top of the report: the whole job on one step axis, with every warn/fail
finding that happened at a step marked where it happened.

    step time across ranks   band min..max, line p50       (the job's own runs: every rank)
    loss                     p50 over ranks (an imported log: its one curve)
    memory (or LR)           band min..max, line p50 (an imported log: its learning rate)

Why hand-written SVG rather than matplotlib: the markers carry `data-check`, `data-step` and
`data-verdict` and link to the section with the evidence, and the picture states its own step-to-x
mapping (`data-step-first`, `data-step-last`, `data-x0`, `data-x1`), so a reader — or a test — can
read a marker's step from the SVG itself. It is drawn from the cross-rank bands the job section
already computed (rank_view.table_band: at most MAX_BINS points a series), never from the records,
so it costs the same at 8 ranks and at 10,000: a few kilobytes.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.report.plots import PALETTE
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import as_float

WIDTH, LEFT, RIGHT = 1100, 64, 12  # viewBox units; the page draws it at most 1,100 px wide
LANE = 30  # the marker labels' lane above the panels
TITLE, PANEL_H, GAP, AXIS = 14, 58, 6, 22
MAX_POINTS = 600  # per series: more than a 1,100 px wide picture can show
MAX_MARKS = 40  # markers drawn one by one; more are counted in the caption
WARN, FAIL = "#e69f00", "#d55e00"
LABELS = {
    "loss_spike": "loss spike",
    "grad_norm_spike": "grad spike",
    "overflow_storm": "overflow storm",
    "straggler_onset": "straggler",
    "memory_leak": "leak",
    "hang": "hang",
    "divergence": "divergence",
    "rank_desync": "desync",
    "scale_collapse": "scale collapse",
}
# Where a finding says at which step it happened: where.step, else its evidence's own step keys.
STEP_KEYS = ("change_step", "onset_step", "start_step", "first_step", "step")


@dataclass(kw_only=True)
class Series:
    """One panel: a band (lows, highs) and/or a line over `steps`, in `unit`."""

    title: str
    steps: list[float]
    line: list[float]
    low: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)
    color: str = PALETTE[0]
    log: bool = False  # a log y scale (the learning rate spans decades)


@dataclass(kw_only=True)
class Mark:
    step: int
    check: str
    verdict: str
    probe: str
    summary: str
    anchor: str
    inferred: bool = False  # a leak without a step of its own: drawn where the records start


def finding_step(finding: Finding) -> int | None:
    """The step a finding happened at, when it says (where.step, else a step key of its evidence)."""
    for source in (finding.where, finding.evidence):
        for key in ("step", *STEP_KEYS) if source is finding.where else STEP_KEYS:
            value = as_float(source.get(key))
            if value is not None and math.isfinite(value):
                return int(value)
    return None


def marks_of(findings: Sequence[Finding], anchors: dict[str, str], first_step: int | None) -> list[Mark]:
    """A mark per warn/fail finding that happened at a step; a leak found over the whole run (no step of
    its own) is marked at the first step, flagged `inferred`."""
    out: list[Mark] = []
    for f in findings:
        if f.verdict not in ("warn", "fail"):
            continue
        step, inferred = finding_step(f), False
        if step is None and f.check == "memory_leak" and first_step is not None:
            step, inferred = first_step, True
        if step is None:
            continue
        out.append(
            Mark(
                step=step, check=f.check, verdict=f.verdict, probe=f.probe, summary=f.summary,
                anchor=anchors.get(f.probe, "verdicts"), inferred=inferred,
            )
        )  # fmt: skip
    return sorted(out, key=lambda m: (m.step, m.check))


def band_series(frame: Any, unit: str, title: str, color: str, scale: float = 1.0) -> Series | None:
    """A panel from a rank_view band frame (step, min_/p50_/max_<unit>)."""
    if frame is None or not len(frame):
        return None
    col = lambda name: [float(v) * scale for v in frame[f"{name}_{unit}"].tolist()]  # noqa: E731
    return Series(
        title=title, steps=[float(s) for s in frame["step"].tolist()], line=col("p50"),
        low=col("min"), high=col("max"), color=color,
    )  # fmt: skip


def record_series(
    records: Sequence[dict[str, Any]], key: str, title: str, color: str, log: bool = False
) -> Series | None:
    """A panel from one rank's records (an imported log's loss or LR), thinned to MAX_POINTS by bins that
    keep each bin's lowest and highest value, so a one-step spike stays in the line."""
    pts = sorted(
        (float(r["step"]), v)
        for r in records
        if isinstance(r.get("step"), int) and (v := as_float(r.get(key))) is not None and math.isfinite(v)
    )
    if log:
        pts = [p for p in pts if p[1] > 0]
    if not pts:
        return None
    per = max(1, -(-len(pts) // (MAX_POINTS // 2)))
    steps, line = [], []
    for i in range(0, len(pts), per):
        chunk = pts[i : i + per]
        for p in sorted({min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])}):
            steps.append(p[0])
            line.append(p[1])
    return Series(title=title, steps=steps, line=line, color=color, log=log)


def _pair(low: float, high: float) -> tuple[str, str]:
    """A panel's bottom and top values, with the digits that tell them apart (29,480 and 29,870 MiB,
    not 2.9e+04 twice)."""
    span = high - low if high > low else abs(high) or 1.0
    biggest = max(abs(low), abs(high))
    if biggest >= 1e7 or biggest < 1e-3:
        digits = max(2, math.ceil(math.log10(biggest / span)) + 2) if biggest > 0 else 2
        return f"{low:.{digits}g}", f"{high:.{digits}g}"
    decimals = min(4, max(0, 1 - math.floor(math.log10(span))))
    return f"{low:,.{decimals}f}", f"{high:,.{decimals}f}"


def _ticks(first: float, last: float, count: int = 6) -> list[int]:
    """Round step numbers across [first, last] (1, 2 or 5 × a power of ten apart)."""
    span = max(last - first, 1.0)
    raw = span / count
    power = 10 ** math.floor(math.log10(raw))
    stride = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    start = math.ceil(first / stride) * stride
    return [int(start + i * stride) for i in range(int((last - start) // stride) + 1)]


def _limits(series: Series) -> tuple[float, float]:
    """The y range: the line and the band, but not a band's one-off extreme (first steps, a warm-up
    compile) that would flatten everything else: the top is at most 1.5 × the line's 98th percentile."""
    values = [v for v in (*series.line, *series.low, *series.high) if math.isfinite(v)]
    if series.log:
        values = [math.log10(v) for v in values if v > 0]
    if not values:  # nothing finite to draw: an empty panel, never a traceback
        return -1.0, 1.0
    low, high = min(values), max(values)
    if series.high and not series.log:
        ordered = sorted(v for v in series.line if math.isfinite(v))
        cap = ordered[int(0.98 * (len(ordered) - 1))] if ordered else high
        if cap > 0 and high > 1.5 * cap:
            high = 1.5 * cap
    if high - low < 1e-12:
        low, high = low - 0.5 * (abs(low) or 1), high + 0.5 * (abs(high) or 1)
    pad = 0.06 * (high - low)
    low, high = low - pad, high + pad
    if not (math.isfinite(low) and math.isfinite(high) and high > low):
        # values near the float range (1e308) or a span a float cannot hold: a flat, still drawable panel
        return -1.0, 1.0
    return low, high


def overview_svg(panels: Sequence[Series | None], marks: Sequence[Mark], *, caption: str) -> str | None:
    """The picture as an inline <svg> (currentColor ink, so it follows the page's light or dark theme)."""
    panels = [p for p in panels if p is not None and p.steps]
    if not panels:
        return None
    first = min(min(p.steps) for p in panels)
    last = max(max(p.steps) for p in panels)
    first = min(first, *(m.step for m in marks)) if marks else first
    last = max(last, *(m.step for m in marks)) if marks else last
    if last <= first:
        last = first + 1
    x0, x1 = LEFT, WIDTH - RIGHT

    def x(step: float) -> float:
        return round(x0 + (step - first) / (last - first) * (x1 - x0), 2)

    height = LANE + len(panels) * (TITLE + PANEL_H + GAP) + AXIS
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="plot overview" viewBox="0 0 {WIDTH} {height}" '
        f'style="max-width:{WIDTH}px" role="img" aria-label="{html.escape(caption, quote=True)}" '
        f'data-step-first="{first:g}" data-step-last="{last:g}" data-x0="{x0}" data-x1="{x1}" '
        'font-family="system-ui, sans-serif" font-size="11" fill="currentColor">',
        f"<title>{html.escape(caption)}</title>",
    ]
    top = LANE
    for panel in panels:
        out.extend(_panel(panel, x, top, x0, x1))
        top += TITLE + PANEL_H + GAP
    bottom = top - GAP
    for tick in _ticks(first, last):
        out.append(
            f'<line x1="{x(tick)}" x2="{x(tick)}" y1="{bottom}" y2="{bottom + 4}" stroke="currentColor"/>'
            f'<text x="{x(tick)}" y="{bottom + 15}" text-anchor="middle">{tick}</text>'
        )
    out.append(f'<text x="{x0 - 12}" y="{bottom + 15}" text-anchor="end" opacity=".7">step</text>')
    out.extend(_marks(marks[:MAX_MARKS], x, bottom))
    out.append("</svg>")
    return "".join(out)


def _panel(panel: Series, x: Any, top: float, x0: float, x1: float) -> list[str]:
    title_y, top = top + 11, top + TITLE  # the title on a row of its own: no line runs through it
    low, high = _limits(panel)

    def y(value: float) -> float:
        v = math.log10(value) if panel.log and value > 0 else value
        v = min(max(v, low), high)  # the capped extremes sit on the panel's edge
        return round(top + PANEL_H - (v - low) / (high - low) * PANEL_H, 2)

    out = [
        f'<g class="panel" data-series="{html.escape(panel.title, quote=True)}">',
        f'<rect x="{x0}" y="{top}" width="{x1 - x0}" height="{PANEL_H}" fill="none" '
        'stroke="currentColor" stroke-opacity=".18"/>',
    ]
    # points to a tenth of a unit (the picture is at most 1,100 px wide): 600 points a series stay small
    if panel.low and panel.high:
        upper = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in zip(panel.steps, panel.high, strict=True))
        lower = " ".join(
            f"{x(s):.1f},{y(v):.1f}" for s, v in zip(reversed(panel.steps), reversed(panel.low), strict=True)
        )
        out.append(
            f'<polygon class="band" points="{upper} {lower}" fill="{panel.color}" fill-opacity=".22"/>'
        )
    line = " ".join(
        f"{x(s):.1f},{y(v):.1f}" for s, v in zip(panel.steps, panel.line, strict=True) if math.isfinite(v)
    )
    out.append(
        f'<polyline class="line" points="{line}" fill="none" stroke="{panel.color}" stroke-width="1.4"/>'
    )
    bottom_text, top_text = _pair(10**low, 10**high) if panel.log else _pair(low, high)
    out.append(f'<text x="{x0 - 5}" y="{top + 9}" text-anchor="end" opacity=".7">{top_text}</text>')
    out.append(f'<text x="{x0 - 5}" y="{top + PANEL_H}" text-anchor="end" opacity=".7">{bottom_text}</text>')
    out.append(f'<text x="{x0}" y="{title_y}" font-weight="600">{html.escape(panel.title)}</text>')
    out.append("</g>")
    return out


def _marks(marks: Sequence[Mark], x: Any, bottom: float) -> list[str]:
    """A vertical line per mark across every panel, its label in the lane above (two rows, so labels of
    nearby marks do not sit on each other), the whole mark a link to the section with the evidence."""
    out = []
    last_end = [-1e9, -1e9]
    for mark in marks:
        px = x(mark.step)
        colour = FAIL if mark.verdict == "fail" else WARN
        label = LABELS.get(mark.check, mark.check.replace("_", " "))
        text = f"{label} · {mark.step}" + (" (from the start)" if mark.inferred else "")
        width = 6.2 * len(text)
        row = 0 if px - width / 2 > last_end[0] else 1 if px - width / 2 > last_end[1] else 0
        last_end[row] = px + width / 2
        anchor = "start" if px < LEFT + width / 2 else "end" if px > WIDTH - RIGHT - width / 2 else "middle"
        ty = 11 + 13 * row
        title = f"{mark.verdict}: {mark.probe}/{mark.check} at step {mark.step}: {mark.summary}"
        out.append(
            f'<a href="#{html.escape(mark.anchor, quote=True)}"><g class="mark" '
            f'data-check="{html.escape(mark.check, quote=True)}" data-step="{mark.step}" '
            f'data-verdict="{mark.verdict}" data-x="{px}"><title>{html.escape(title)}</title>'
            f'<line x1="{px}" x2="{px}" y1="{ty + 3}" y2="{bottom}" stroke="{colour}" stroke-width="1.6" '
            f'stroke-dasharray="{"" if mark.verdict == "fail" else "4 3"}"/>'
            f'<text x="{px}" y="{ty}" text-anchor="{anchor}" fill="{colour}" font-weight="600">'
            f"{html.escape(text)}</text></g></a>"
        )
    return out


def job_overview(
    steps: Sequence[dict[str, Any]], findings: Sequence[Finding], anchors: dict[str, str], *, imported: bool
) -> str | None:
    """The overview of a run: from every rank's bands (the job's own records), or an imported log's loss
    and learning rate; None when there are no steps to draw."""
    from ciuic_doctor.report.rank_view import table_band
    from ciuic_doctor.report.steps_section import MEMORY_LABEL, memory_key

    table = getattr(steps, "table", None)
    if imported or table is None or not table.has_steps():
        panels = [
            record_series(steps, "loss", "loss", PALETTE[1]),
            record_series(steps, "lr", "learning rate (log scale)", PALETTE[4], log=True),
        ]
        what = "the log's loss and learning rate"
        if not imported:
            panels.insert(0, record_series(steps, "step_time_s", "step time (s)", PALETTE[0]))
            what = "step time, loss and learning rate"
    else:
        ranks = len(table.ranks)
        title = (
            f"step time (ms) across {ranks} ranks: band min–max, line median"
            if ranks > 1
            else "step time (ms)"
        )
        panels = [
            band_series(table_band(table, "step_time_s", unit="ms", scale=1e3), "ms", title, PALETTE[0]),
            band_series(table_band(table, "loss", unit="loss"), "loss", "loss", PALETTE[1]),
        ]  # fmt: skip
        key = _leak_key(table, findings) or memory_key(table)
        if key is not None:
            band = table_band(table, key, unit="mib", scale=1 / 2**20)
            panels.append(band_series(band, "mib", f"{MEMORY_LABEL[key]} (MiB)", PALETTE[2]))
        what = "step time (band: min–max over ranks, line: median), loss and memory"
    drawn = [p for p in panels if p is not None and p.steps]
    if not drawn:
        return None
    first = int(min(min(p.steps) for p in drawn))
    marks = marks_of(findings, anchors, first)
    caption = (
        f"The job over its steps: {what}; every warn/fail finding at its step (a mark links to its evidence)"
    )
    return overview_svg(drawn, marks, caption=caption)


def _leak_key(table: Any, findings: Sequence[Finding]) -> str | None:
    """The host-memory column (USS, else RSS) when a warn/fail leak is of host memory and the step records
    carry it: the panel then shows the leak it marks (CUDA allocated would be flat beside it)."""
    host = any(
        f.check == "memory_leak" and f.verdict in ("warn", "fail") and f.evidence.get("kind") == "host"
        for f in findings
    )
    if not host:
        return None
    return next((k for k in ("uss", "rss") if table.positive(k)), None)
