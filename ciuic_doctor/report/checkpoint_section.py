"""The checkpoint section's tables: what a save and a load cost on each rank, the two load methods side by
side, whether each resumed variant continued the run that never stopped, and what the file holds.

Figures come from the same functions the analysis judged them with (`analysis.checkpoint.cost_figures`,
the `resume_mismatch` findings), so a table never disagrees with the verdict above it. Records from other
tools or older versions (no `kind`) fall back to a plain table of the records.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ciuic_doctor.analysis.checkpoint import cost_figures
from ciuic_doctor.report.blocks import Section, Table, bytes_cell, generic_content
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import as_float

_MISSING = ("—", "")
KNOWN_KINDS = {"config", "save", "load", "resume", "inspect"}


def checkpoint_content(
    section: Section,
    records: list[dict[str, Any]],
    findings: Sequence[Finding],
) -> None:
    """Fill `section` with the checkpoint tables; records of no known kind get the plain records table."""
    records = [r for r in records if isinstance(r, dict)]
    ours = [r for r in records if r.get("kind") in KNOWN_KINDS]
    if not ours:
        generic_content(section, records)
        return
    try:
        figures = cost_figures(ours)
    except (TypeError, ValueError):  # a hand-edited or foreign record: show the rest, not a traceback
        figures = {}
    _cost_tables(section, figures)
    _resume_table(section, findings)
    for record in ours:
        if record.get("kind") == "inspect":
            _contents_table(section, record)


def _seconds(value: Any) -> tuple[str, Any]:
    number = as_float(value)
    if number is None:
        return _MISSING
    return (f"{number * 1000:.1f}" if number < 1 else f"{number * 1000:,.0f}", number)


def _text(value: Any) -> tuple[str, Any]:
    if value is None or value == []:
        return _MISSING
    if isinstance(value, list | tuple):
        value = ", ".join(str(v) for v in value)
    return (str(value), str(value))


def _cost_tables(section: Section, figures: dict[str, Any]) -> None:
    per_rank = [row for row in figures.get("per_rank") or [] if isinstance(row, dict)]
    if per_rank:
        repeats = figures.get("repeats") or 0
        section.tables.append(
            Table(
                title=f"Save and load per rank (median of {repeats} repetition{'' if repeats == 1 else 's'})",
                headers=[
                    "rank",
                    "save ms",
                    "barrier wait ms",
                    "load ms, each reads",
                    "load ms, rank 0 + bcast",
                    "peak RSS, each reads",
                    "peak RSS, rank 0 + bcast",
                ],
                rows=[
                    [
                        (str(row.get("rank")), as_float(row.get("rank"))),
                        _seconds(row.get("save_s")),
                        _seconds(row.get("barrier_wait_s")),
                        _seconds(row.get("load_s")),
                        _seconds(row.get("broadcast_load_s")),
                        bytes_cell(row.get("peak_load_rss_bytes")),
                        bytes_cell(row.get("broadcast_peak_rss_bytes")),
                    ]
                    for row in per_rank
                ],
                numeric=[0, 1, 2, 3, 4, 5, 6],
            )
        )
    if figures.get("load_s") is not None or figures.get("broadcast_load_s") is not None:
        # The slowest rank per repetition, then the median: every rank waits for the slowest to go on.
        methods = {  # shown name: the cost_figures keys of (time, peak RSS, RSS added, tensors held)
            "every rank reads the file": (
                "load_s",
                "peak_load_rss_bytes",
                "load_rss_delta_bytes",
                "load_held_bytes",
            ),
            "rank 0 reads + broadcast": (
                "broadcast_load_s",
                "broadcast_peak_rss_bytes",
                "broadcast_rss_delta_bytes",
                "broadcast_held_bytes",
            ),
        }
        section.tables.append(
            Table(
                title="Two ways to load, side by side (slowest rank; RSS on the worst rank)",
                headers=["method", "load ms", "peak RSS", "RSS added", "tensors held"],
                rows=[
                    [_text(name), _seconds(figures.get(time_key))]
                    + [bytes_cell(figures.get(key)) for key in byte_keys]
                    for name, (time_key, *byte_keys) in methods.items()
                ],
                numeric=[1, 2, 3, 4],
            )
        )


def _resume_table(section: Section, findings: Sequence[Finding]) -> None:
    resumes = [f for f in findings if f.check == "resume_mismatch" and f.verdict != "not_run"]
    if not resumes:
        return
    rows = []
    for finding in resumes:
        ev = finding.evidence
        first = ev.get("first_divergent_step")
        diff = as_float(ev.get("max_abs_loss_diff"))
        rows.append(
            [
                _text(ev.get("variant")),
                (finding.verdict, finding.verdict),
                _text(ev.get("missing")),
                (str(ev.get("steps_compared", "—")), as_float(ev.get("steps_compared"))),
                ("none", -1) if first is None else (str(first), as_float(first)),
                _MISSING if diff is None else (f"{diff:.3g}", diff),
                _text(ev.get("differs")),
            ]
        )
    section.tables.append(
        Table(
            title="Resume against the run that never stopped (each variant restarted from the same file)",
            headers=[
                "variant",
                "verdict",
                "state missing",
                "steps compared",
                "first divergent step",
                "max |Δ loss|",
                "state that differs after",
            ],
            rows=rows,
            numeric=[3, 4, 5],
        )
    )


def _contents_table(section: Section, record: dict[str, Any]) -> None:
    rows = []
    present = record.get("present") if isinstance(record.get("present"), dict) else {}
    empty = record.get("empty") if isinstance(record.get("empty"), dict) else {}
    conditional = record.get("conditional") if isinstance(record.get("conditional"), dict) else {}
    missing = record.get("missing") if isinstance(record.get("missing"), list) else []
    for state, key in present.items():
        rows.append([_text(state), _text("present"), _text(key)])
    for state, why in empty.items():
        rows.append([_text(state), _text("empty"), _text(why)])
    for state in missing:
        rows.append([_text(state), _text("missing"), _text(conditional.get(state, ""))])
    for state, why in conditional.items():
        if state not in present and state not in empty and state not in missing:
            rows.append([_text(state), _text("not needed here"), _text(why)])
    if rows:
        where = Path(str(record["path"])).name if record.get("path") else "the checkpoint"
        section.tables.append(
            Table(
                title=f"What {where} holds ({record.get('role') or 'file'})",
                headers=["state", "status", "key in the file, or why"],
                rows=rows,
            )
        )
