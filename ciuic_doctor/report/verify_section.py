"""The report's "Verified on the job" section: what `ciuic-doctor verify` found (RUN/verification.json).

One row per change tried: its status, the figure its rule aims at with the 95 % interval from the
interleaved rounds, and why; a forest plot draws the verified changes on one axis (0 = no change),
so "helps", "hurts" and "within noise" read at a glance.
"""

from __future__ import annotations

from typing import Any

from ciuic_doctor.compare.change import interval, percent
from ciuic_doctor.recommend.verified import HELPS, HURTS
from ciuic_doctor.report import plots
from ciuic_doctor.report.sections import Section, Table


def verify_section(data: dict[str, Any]) -> Section:
    cands = [c for c in data.get("candidates") or [] if isinstance(c, dict)]
    job = data.get("job") if isinstance(data.get("job"), dict) else {}
    section = Section(
        id="verify",
        title="Verified on the job (verify)",
        command="verify",
        probes=(),
        streams=(),
        ran=True,
        intro=(
            f"Each change was tried alone on the job ({job.get('kind', '?')}), as it is (A) and changed (B), "
            f"interleaved A B A B in {data.get('rounds', 0)} round(s) of {data.get('warmup_steps', 2)} "
            "warm-up "
            f"+ {data.get('steps_per_run', '?')} steps a run, within {data.get('budget_s', 0):.0f} s. "
            "The interval is B / A of the figure the change aims at, a t interval over the rounds "
            "(paired by round); a change helps when that figure is significantly better and nothing "
            "(step time, time before backward, host memory, skipped steps, the loss) is worse."
        ),
    )
    rows = []
    for c in cands:
        shown = "—"
        if c.get("ratio") is not None and c.get("ci_low") is not None:
            shown = f"{percent(c['ratio'])} ({interval(c['ci_low'], c['ci_high'])})"
        rows.append(
            [
                (str(c.get("label", "")), str(c.get("label", ""))),
                (str(c.get("status", "")), str(c.get("status", ""))),
                (str(c.get("target_metric") or "—"), str(c.get("target_metric") or "")),
                (shown, c.get("ratio") or 0.0),
                (str(c.get("rounds") or "—"), c.get("rounds") or 0),
                (str(c.get("reason", "")), ""),
            ]
        )
    section.tables.append(
        Table(
            title="changes tried on the job",
            headers=["change", "status", "figure", "B / A, 95 % CI", "rounds", "why"],
            rows=rows,
            numeric=[4],
        )
    )
    svg = _forest(cands)
    if svg:
        section.plots.append(svg)
    return section


def _forest(cands: list[dict[str, Any]]) -> str | None:
    rows = [c for c in cands if c.get("ratio") is not None and c.get("ci_low") is not None]
    if not rows:
        return None
    plt = plots._pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 0.32 * len(rows) + 1.1), layout="constrained")
    colour = {HELPS: plots.PALETTE[2], HURTS: plots.PALETTE[5]}
    for i, c in enumerate(reversed(rows)):
        mid, low, high = ((float(v) - 1) * 100 for v in (c["ratio"], c["ci_low"], c["ci_high"]))
        ax.errorbar(
            mid, i, xerr=[[mid - low], [high - mid]], fmt="o", markersize=4, capsize=2,
            color=colour.get(c.get("status"), plots.PALETTE[6]),
        )  # fmt: skip
    ax.axvline(0, color=plots.INK, linewidth=0.8)
    mids = [(float(c["ratio"]) - 1) * 100 for c in rows]
    ax.set_xlim(max(-100.0, min(mids) - 50), max(50.0, min(max(mids) + 50, 400.0)))
    labels = [plots._text(f"{c.get('label')} · {c.get('target_metric')}") for c in reversed(rows)]
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_xlabel("change B vs A (%), 95 % CI — green helps, red hurts, grey within noise")
    return plots.to_svg(fig, "each verified change with its 95 % confidence interval")


def status_text(evidence: dict[str, Any]) -> str:
    """A recommendation's verification as one cell: "helps: time before backward −40 % (95 % CI …)"."""
    found = evidence.get("verification") if isinstance(evidence.get("verification"), dict) else None
    if not found:
        return ""
    text = str(found.get("status") or "")
    if found.get("ratio") is not None and found.get("ci_low") is not None:
        text += f": {found.get('target_metric')} {percent(found['ratio'])}"
        text += f" (95 % CI {interval(found['ci_low'], found['ci_high'])})"
        if found.get("conclusive") is False:  # the interval is wider than a change that matters
            text += ": more rounds would tell"
    elif found.get("reason"):
        text += f": {found['reason']}"
    return text
