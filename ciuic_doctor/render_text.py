"""Plain-text tables for the terminal (no dependency: this must work where rich is missing)."""

from __future__ import annotations

from collections.abc import Sequence

from ciuic_doctor.findings import Finding

_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "not_run": "----"}


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell; columns whose index is in `right` are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        padded = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=False))
        ]
        lines.append("  ".join(padded).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def findings_table(findings: Sequence[Finding]) -> str:
    """verdict | probe | check | where | summary, worst first."""
    if not findings:
        return "no findings: no stream in this run directory had an analysis that applies"
    rows = []
    for f in findings:
        where = " ".join(f"{k}={v}" for k, v in f.where.items())
        rows.append([_MARK[f.verdict], f.probe, f.check, where, f.summary])
    return table(["verdict", "probe", "check", "where", "summary"], rows)
