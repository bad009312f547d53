"""Plain-text tables for the terminal (no dependency: this must work where rich is missing)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from ciuic_doctor.rundir.findings import Finding

_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "not_run": "----"}


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell; columns whose index is in `right` are right-aligned."""
    cells = [[terminal(h) for h in headers]] + [[terminal(c) for c in row] for row in rows]
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


# C0/C1 controls (ESC starts a terminal escape sequence), DEL, and the bidirectional overrides that
# reorder what a reader sees ("Trojan Source", CVE-2021-42574): shown as \xNN / \uNNNN, never sent.
_UNSAFE = {*range(0x20), 0x7F, *range(0x80, 0xA0), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
           *range(0x2066, 0x206A)}  # fmt: skip


def terminal(text: object) -> str:
    """`text` safe to print: a string from a dump, a log or a host name cannot move the cursor, change
    colours, retitle the terminal or reorder the line (control characters are shown escaped).

    >>> terminal("rank\\x1b[2J 1\\u202e")
    'rank\\\\x1b[2J 1\\\\u202e'
    """
    text = str(text)
    if all(ord(ch) not in _UNSAFE for ch in text):
        return text
    return "".join(
        ch if ord(ch) not in _UNSAFE else (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        for ch in text
    )


class StageLine:
    """One status line on a terminal, rewritten in place as a long command moves from stage to stage
    ("report: analysing memory (4/9) · 35 s"), cleared by `done`. Where `stream` is not a terminal it
    writes nothing: a log or a pipe gets only the command's own output.

    >>> import io
    >>> line = StageLine("report", io.StringIO())
    >>> line("analysing steps (1/2)")  # not a terminal: nothing is written
    >>> line.stream.getvalue()
    ''
    """

    def __init__(self, command: str, stream: TextIO) -> None:
        import time

        self.command, self.stream = command, stream
        self.enabled = stream.isatty()
        self._start = time.monotonic()

    def __call__(self, stage: str) -> None:
        import time

        if self.enabled:
            elapsed = time.monotonic() - self._start
            self.stream.write(f"\r\x1b[K{self.command}: {terminal(stage)} · {elapsed:.0f} s")
            self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
