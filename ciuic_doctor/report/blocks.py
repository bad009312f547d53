"""What every report section is made of: the `Section` (a probe's findings, plots, tables and notes),
its `Table`s, the cell formatters (shown text + sort key) and the plain records table a section falls back
on for records of no known kind.

Split from `sections.py` so that `sections.py` (the section list and the per-probe content) and the
section modules that build on these (steps, checkpoint, hang, compare) and `html.py` all import them
from below, instead of `sections.py` and its section modules importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import as_float
from ciuic_doctor.units import format_bytes, format_size_short


@dataclass(kw_only=True)
class Table:
    title: str
    headers: list[str]
    rows: list[list[tuple[str, Any]]]  # (shown text, sort key) per cell
    numeric: list[int] = field(default_factory=list)  # right-aligned columns
    csv: str = ""  # a file beside report.html with every row (when the table shows only some)


@dataclass(kw_only=True)
class Section:
    id: str
    title: str
    command: str
    probes: tuple[str, ...]
    streams: tuple[str, ...]
    intro: str = ""
    ran: bool = False
    reason: str = ""
    findings: list[Finding] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # name -> text, written beside report.html


def _cell(value: Any, fmt: str | None = None) -> tuple[str, Any]:
    if value is None:
        return ("—", "")
    if isinstance(value, bool):
        return (str(value).lower(), int(value))
    number = as_float(value) if isinstance(value, int | float | str) else None
    if number is not None and fmt and not isinstance(value, str):
        return (format(number, fmt), number)
    return (str(value), number if number is not None else str(value))


def _size_cell(n: Any) -> tuple[str, Any]:
    return (format_size_short(n), n) if isinstance(n, int) else _cell(n)


def bytes_cell(n: Any) -> tuple[str, Any]:
    value = as_float(n)
    return (format_bytes(value), value) if value is not None else ("—", "")


def generic_content(section: Section, records: list[dict[str, Any]]) -> None:
    """A plain table of a stream's records (checkpoint records of no known kind), less bookkeeping."""
    skip = {"schema", "t"}
    keys: list[str] = []
    for r in records:
        keys.extend(k for k in r if k not in skip and k not in keys and not isinstance(r[k], dict | list))
    keys = keys[:10]
    if records and keys:
        section.tables.append(
            Table(
                title="Records",
                headers=keys,
                rows=[
                    [_cell(r.get(k), ".4g" if isinstance(r.get(k), float) else None) for k in keys]
                    for r in records[:200]
                ],
            )
        )
