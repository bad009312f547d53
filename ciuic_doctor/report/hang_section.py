"""The report's "Hang" section, present only when the run has hang dumps (a `hang` finding that failed).

It shows what `ciuic-doctor hang RUN` judged: the finding (kind, culprit, the collective the others wait
in), one row per rank (where it was, from which source), and what to look at next. The rows come from the
finding's evidence, so the table never disagrees with the verdict above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ciuic_doctor.report.blocks import Section, Table
from ciuic_doctor.rundir.findings import Finding, sort_findings

_MISSING = ("—", "")


def hang_sections(findings: Sequence[Finding]) -> list[Section]:
    """[the Hang section] when a `hang` finding says the job hung; [] otherwise (no section at all)."""
    ours = [f for f in findings if f.probe == "hang"]
    hang = next((f for f in ours if f.check == "hang" and f.verdict == "fail"), None)
    if hang is None:
        return []
    section = Section(
        id="hang",
        title="Hang (watch's hang dumps)",
        command="hang",
        probes=("hang",),
        streams=(),
        intro="Where every rank was when the job stopped making progress, from its own dump (Flight Recorder "
        "and Python stacks), faulthandler after an abort, or py-spy; the culprit is the rank the others wait "
        "for.",
        ran=True,
        findings=sort_findings(ours),
    )
    rows = [_row(r) for r in hang.evidence.get("ranks", [])]
    section.tables.append(
        Table(
            title="Ranks",
            headers=["rank", "host", "seen by", "state", "position", "collective", "sizes", "own frame"],
            rows=rows,
            numeric=[0],
        )
    )
    if hang.evidence.get("next"):
        section.notes.append(f"Next: {hang.evidence['next']}")
    return [section]


def _cell(value: Any) -> tuple[str, Any]:
    if value is None or value == "":
        return _MISSING
    return (str(value), str(value))


def _row(rank: dict[str, Any]) -> list[tuple[str, Any]]:
    if rank.get("in_collective"):
        position = f"in #{rank.get('seq')}" if rank.get("seq") is not None else "in a collective"
    elif rank.get("in_collective") is False:
        position = "outside any collective"
    else:
        position = "unknown"
    where = rank.get("call_site") if rank.get("in_collective") else None
    collective = f"{rank.get('op')} from {where}" if rank.get("op") and where else rank.get("op")
    return [
        (str(rank.get("rank")), rank.get("rank")),
        _cell(rank.get("host")),
        _cell(rank.get("source") if rank.get("source") != "none" else "nobody"),
        _cell(rank.get("state")),
        _cell(position),
        _cell(collective),
        _cell(rank.get("sizes")),
        _cell(rank.get("frame")),
    ]
