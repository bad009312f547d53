"""A big stream's columnar copy as the stream readers use it (`rundir.columnar`): when a read may come
from the copy, reading it back as a `TableRead`, and writing it after a JSONL read."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ciuic_doctor.rundir.frames.tableread import TableRead
from ciuic_doctor.rundir.store import RunDir

COPY_MIN_BYTES = 32 * 2**20  # below ~32 MiB of JSONL (a 64-rank run) a parse takes under a second


@dataclass(kw_only=True)
class CopyPlan:
    stream: str
    files: list[Path]
    sources: list[list[Any]]  # taken before the read: a file that grows during it makes the copy stale
    threshold: int


def copy_min_bytes() -> int:
    """JSONL bytes from which a big stream gets a columnar copy; CIUIC_COLUMNAR_MIN_BYTES overrides
    COPY_MIN_BYTES (0: always, a negative number: never, so no copy is read either)."""
    raw = os.environ.get("CIUIC_COLUMNAR_MIN_BYTES", "")
    try:
        return int(raw) if raw.strip() else COPY_MIN_BYTES
    except ValueError:
        return COPY_MIN_BYTES


def plan(
    stream: str, files: list[Path], sources: list[list[Any]], threshold: int | None = None
) -> CopyPlan | None:
    """None when no copy is to be read or written (turned off). `sources`: [name, size, mtime_ns] of
    `files`; `threshold`: the bytes from which a copy is written (default: `copy_min_bytes`)."""
    threshold = copy_min_bytes() if threshold is None else threshold
    if threshold < 0:
        return None
    return CopyPlan(stream=stream, files=files, sources=sources, threshold=threshold)


def fresh_manifest(run: RunDir, stream: str, sources: list[list[Any]]) -> Any | None:
    """The manifest of `stream`'s copy when it was made from these files as they are (`sources`:
    [name, size, mtime_ns] of each); None otherwise."""
    from ciuic_doctor.rundir import columnar

    manifest = columnar.read_manifest(run.path, stream)
    return manifest if manifest is not None and manifest.sources == sources else None


def load(run: RunDir, plan: CopyPlan, columns: list[str], *, any_order: bool = False) -> TableRead | None:
    """The stream from its copy when the copy was made from these files as they are; None otherwise (a
    copy that does not match its manifest is never half-used: the caller reads the JSONL). `any_order`:
    the rows as the copy's parts hold them (`TableRead.stream_rows`)."""
    from ciuic_doctor.rundir import columnar

    manifest = fresh_manifest(run, plan.stream, plan.sources)
    if manifest is None:
        return None
    try:
        table, stream_rows = columnar.load_any_order(run.path, manifest, columns, stream_order=not any_order)
    except (columnar.StaleCopy, OSError, ValueError):
        return None
    counts = manifest.counts
    return TableRead(
        table=table,
        files=plan.files,
        dropped_lines=counts.dropped_lines,
        nulled_values=dict(counts.nulled_values),
        invalid_records=counts.invalid_records,
        invalid_reasons=dict(counts.invalid_reasons),
        copy_id=manifest.copy_id,
        stream_rows=stream_rows,
    )


def save(run: RunDir, plan: CopyPlan, read: TableRead) -> None:
    """Write the copy of what `read` parsed, when the stream is big enough to be worth one; sets
    `read.copy_id`. A copy that cannot be written is said in `run.notes`, and the report goes on."""
    from ciuic_doctor.rundir import columnar

    if not read.rows or sum(size for _, size, _ in plan.sources) < plan.threshold:
        return
    counts = columnar.Counts(
        dropped_lines=read.dropped_lines,
        nulled_values=dict(read.nulled_values),
        invalid_records=read.invalid_records,
        invalid_reasons=dict(read.invalid_reasons),
    )
    written = columnar.save(run.path, plan.stream, plan.sources, read.table, counts)
    if isinstance(written, str):
        run.notes.append(written)
    else:
        read.copy_id = written.copy_id
