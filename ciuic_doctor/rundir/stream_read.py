"""Reading one JSONL stream file: the records, and what had to be skipped (store.py re-exports these).

A line that is not a JSON object, a record off its stream's schema (ciuic_doctor.rundir.schemas) and a line
above safe_io.MAX_LINE_BYTES are counted, never raised; a file that is not a regular file reached
without a symlink (a FIFO, a device, a link out) reads as empty and is named.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ciuic_doctor.rundir import safe_io


@dataclass(kw_only=True)
class StreamRead:
    """What a reader found: the records in file order, and what it had to skip.

    `skipped_lines` counts lines that are not JSON objects (a torn last line after a crash);
    `invalid_records` counts JSON objects that do not fit the stream's schema
    (ciuic_doctor.rundir.schemas), with
    the reasons (`invalid_reasons`: reason -> count). Neither kind reaches an analysis.
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0
    invalid_records: int = 0
    invalid_reasons: dict[str, int] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)  # files that could not be read at all, with why
    files: list[Path] = field(default_factory=list)

    def frame(self):  # -> pandas.DataFrame
        """The records as a DataFrame (pandas imported here, not at module level)."""
        import pandas as pd

        return pd.DataFrame.from_records(self.records)

    def merge(self, part: StreamRead) -> None:
        self.records.extend(part.records)
        self.skipped_lines += part.skipped_lines
        self.invalid_records += part.invalid_records
        for reason, count in part.invalid_reasons.items():
            self.invalid_reasons[reason] = self.invalid_reasons.get(reason, 0) + count
        self.unreadable += part.unreadable
        self.files += part.files

    def problems(self) -> str | None:
        """One line saying what was skipped, for a command to print; None when nothing was."""
        parts = []
        if self.skipped_lines:
            parts.append(f"{self.skipped_lines} unparsable line(s)")
        if self.invalid_records:
            worst = sorted(self.invalid_reasons.items(), key=lambda kv: -kv[1])[:3]
            parts.append(
                f"{self.invalid_records} record(s) off schema ("
                + "; ".join(f"{reason} x{count}" for reason, count in worst)
                + ")"
            )
        parts += self.unreadable
        return ", ".join(parts) or None


def _open_regular(path: Path, max_bytes: int = safe_io.MAX_STREAM_BYTES) -> int:
    """A read-only descriptor of a regular file reached without a symlink, of at most `max_bytes`;
    OSError (safe_io.Unsafe) for a symlink, directory, FIFO, socket or device, or a file too large.

    O_NONBLOCK: opening a FIFO with no writer would block forever (`report` hung on one).
    """
    return safe_io.open_regular(path, max_bytes=max_bytes)


def read_jsonl(path: Path, stream: str | None = None) -> StreamRead:
    """Read one JSONL file. A line that is not a JSON object is counted and skipped; a record that does
    not fit `stream`'s schema (default: the stream the file name says) is counted, with its reason, and
    skipped. A path that is not a regular file (a directory, a FIFO) reads as empty, named as unreadable."""
    from ciuic_doctor.rundir.schemas import stream_of, validate

    stream = stream or stream_of(path.name)
    result = StreamRead(files=[path])
    try:
        fh = os.fdopen(_open_regular(path), "rb")
    except OSError as exc:
        result.unreadable.append(
            f"{path.name} unreadable ({getattr(exc, 'why', None) or exc.strerror or exc})"
        )
        return result
    with fh:
        for raw in safe_io.lines(fh):  # a line above safe_io.MAX_LINE_BYTES is None: counted, skipped
            if raw is None:
                result.skipped_lines += 1
                continue
            line = raw.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except (ValueError, UnicodeDecodeError, RecursionError):
                result.skipped_lines += 1
                continue
            if not isinstance(record, dict):
                result.skipped_lines += 1
                continue
            reason = validate(stream, record)
            if reason is None:
                result.records.append(record)
            else:
                result.invalid_records += 1
                result.invalid_reasons[reason] = result.invalid_reasons.get(reason, 0) + 1
    return result
