"""Parts of `frames.read_table`: which files are parsed together and which big file is cut in pieces
(`_batches`, `BigFile`), a batch's or a piece's parse with one file's checks (`_read_batch`,
`_read_range`), and `_all_null` for columns no record fills (the parts are joined by
`frames.assemble`). Split from frames.py, which keeps the one-file readers.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ciuic_doctor.rundir import columnar_schema
from ciuic_doctor.rundir.stream_read import _open_regular

if TYPE_CHECKING:
    from collections.abc import Sequence

    import pyarrow

BIG_FILE_BYTES = 64 << 20  # a JSONL file this big (memwatch.jsonl of a whole job) is parsed in pieces
RANGE_BYTES = 32 << 20  # one piece of a big file: whole lines, parsed by one thread

Part = tuple["pyarrow.Table", int, dict[str, int], dict[str, int]]  # table, dropped, nulled, invalid
BATCH_BYTES = 16 << 20  # small files parsed together, up to this much text at once
PART_RUN_FILES = 64  # small files' parts read by one task (10,000 ranks: 157 tasks of ~0.6 ms a file)


@dataclass
class BigFile:
    """A big JSONL file cut at line ends into pieces of ~RANGE_BYTES (`ranges`, byte offsets), the
    bytes after its last newline apart (`tail`: a line a crash left torn). The pieces are parsed by
    the pool's threads like any other task, and judged together as the one file (`frames._add_big`),
    so one pool and one parse-and-check (`_parse_lines`) serve every file; it replaced pyarrow's
    streaming reader, which used threads of its own (memwatch.jsonl of a 10,000-rank job: 23-31 s)."""

    path: Path
    ranges: list[tuple[int, int]] = field(default_factory=list)
    tail: bytes = b""


def _split(path: Path) -> BigFile | None:
    """`path` cut into whole-line pieces; None when it cannot be read (its own read says why)."""
    try:
        fd = _open_regular(path)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size  # what is there now: a live file may have grown
        end = _last_line_end(fh, size)
        fh.seek(end)
        tail = fh.read(size - end)
        cuts = [0]
        while cuts[-1] + RANGE_BYTES < end:
            fh.seek(cuts[-1] + RANGE_BYTES)
            fh.readline()  # to the end of the line the cut falls in
            at = fh.tell()
            if at >= end:
                break
            cuts.append(at)
    cuts.append(end)
    ranges = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
    return BigFile(path=path, ranges=ranges, tail=tail)


def _last_line_end(fh: BinaryIO, size: int) -> int:
    """The offset after the file's last newline (0 when it has none)."""
    at = size
    while at > 0:
        step = min(1 << 20, at)
        fh.seek(at - step)
        found = fh.read(step).rfind(b"\n")
        if found >= 0:
            return at - step + found + 1
        at -= step
    return 0


def _read_range(
    path: Path, start: int, stop: int, columns: Sequence[str], stream: str | None
) -> tuple[Part, int] | None:
    """(the piece's table conformed to `columns` with its nulled counts, its lines) when every line of
    the piece parsed as one record of the schema; None otherwise (the whole file is then read by row)."""
    plan = columnar_schema.plan(stream, columns)
    if plan is None:
        return None
    try:
        fd = _open_regular(path)
    except OSError:
        return None
    try:
        text = os.pread(fd, stop - start, start)
    finally:
        os.close(fd)
    if len(text) != stop - start:
        return None  # the file changed under us: the row path reads what is there
    parsed = _parse_lines(text, plan)
    if parsed is None:
        return None
    out, nulled, lines = parsed
    return (out, 0, nulled, {}), lines


def _parse_lines(
    text: bytes, plan: columnar_schema.ReadPlan
) -> tuple[pyarrow.Table, dict[str, int], int] | None:
    """Whole lines parsed with every schema field typed and checked as `frames._read_jsonl` checks a
    file: (the asked-for columns, the values nulled per column, the lines) when each line parsed as one
    record the schema accepts; None otherwise (the caller then reads by record)."""
    import pyarrow as pa
    import pyarrow.json as pj

    lines = text.count(b"\n")
    parse = pj.ParseOptions(explicit_schema=plan.parse_schema, unexpected_field_behavior=plan.unexpected)
    # one block, so one chunk a column: with pyarrow's 1 MiB blocks a 16 MiB batch came as 16 chunks, and
    # copying them into the table (frames.assemble) took 14 times as many calls (32,820 for 3,000 ranks)
    read = pj.ReadOptions(use_threads=False, block_size=max(len(text), 1 << 20))
    try:
        table = pj.read_json(pa.BufferReader(text), read_options=read, parse_options=parse)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != lines or not plan.valid(table):
        return None
    out, nulled = plan.conform(table)
    return out, nulled, lines


def _batches(
    files: list[Path], stream: str | None = None, parted: set[str] | frozenset[str] = frozenset()
) -> list[Any]:
    """Runs of consecutive small JSONL files (each without a fresh Parquet copy) of up to BATCH_BYTES
    together; a big JSONL file of a stream parsed column-wise as a `BigFile` (its pieces parsed in
    parallel); any other file alone. Files in `parted` (`file_parts.available`) are read from the part
    their writer left: runs of up to PART_RUN_FILES small ones (a `PartRun`), a big one a batch at a time
    (a `PartFile`). File order is kept: the tasks are read back in order."""
    from ciuic_doctor.rundir.frames import file_parts
    from ciuic_doctor.rundir.parquet_store import parquet_path

    columnar = columnar_schema.plan(stream, ()) is not None  # else its files are read by record, whole
    tasks: list[Any] = []
    run: list[Path] = []
    size = 0

    def end_run() -> None:
        nonlocal run, size
        if run:
            tasks.append(run)
        run, size = [], 0

    for path in files:
        try:
            nbytes = path.stat().st_size
        except OSError:
            nbytes = BIG_FILE_BYTES + 1  # read alone: its own read says what is wrong with it
        jsonl = path.suffix == ".jsonl" and not parquet_path(path).exists()
        big = jsonl and nbytes > BIG_FILE_BYTES
        if jsonl and os.fspath(path) in parted:
            whole = file_parts.probe(path, stream) if big else None
            if whole is not None or not big:
                end_run()
                if whole is not None:
                    tasks.append(whole)
                elif tasks and isinstance(tasks[-1], file_parts.PartRun) and len(tasks[-1]) < PART_RUN_FILES:
                    tasks[-1].append(path)
                else:
                    tasks.append(file_parts.PartRun([path]))
                continue
        alone = not jsonl or nbytes > BATCH_BYTES or big
        if alone or size + nbytes > BATCH_BYTES:
            end_run()
        if alone:
            pieces = _split(path) if big and columnar else None
            tasks.append(pieces if pieces is not None and len(pieces.ranges) > 1 else [path])
        else:
            run.append(path)
            size += nbytes
    end_run()
    return tasks


def _read_batch(paths: list[Path], columns: Sequence[str], stream: str | None) -> Part | None:
    """Several small files' whole lines parsed as one text, with the checks `_read_jsonl` makes of one
    file (rows = lines, `ReadPlan.valid`): each check is a property of every row, so the batch passes
    exactly when each file would. None (each file then read alone) when any file is not all whole,
    valid lines — a torn tail, a bad record — so what is dropped and counted is the one-file path's."""

    plan = columnar_schema.plan(stream, columns)
    if plan is None:
        return None
    texts = []
    try:
        for path in paths:
            with os.fdopen(_open_regular(path), "rb") as fh:
                data = fh.read()
            if data and not data.endswith(b"\n"):
                return None  # a torn last line: read apart, by the one-file path
            texts.append(data)
    except OSError:
        return None
    text = b"".join(texts)
    del texts
    if not text:
        return None
    parsed = _parse_lines(text, plan)
    if parsed is None:
        return None
    out, nulled, _ = parsed
    return out, 0, nulled, {}


def _all_null(kind: pyarrow.DataType, rows: int) -> pyarrow.Array:
    """A column of `rows` nulls whose buffers are calloc'ed and never written, so they cost no resident
    memory until read: a GPU job's steps carry 5 such fields (inactive_split_bytes, tokens, loss_scale,
    loss_scale_next, desync_ranks), 440 MB of zeros at 10,000 ranks × 1,000 steps."""
    import numpy as np
    import pyarrow as pa

    def zeros(nbytes: int) -> pyarrow.Buffer:
        return pa.py_buffer(np.zeros(max(nbytes, 1), dtype=np.uint8))

    validity = zeros(-(-rows // 8))
    if pa.types.is_list(kind):
        child = pa.array([], type=kind.value_type)
        return pa.ListArray.from_buffers(kind, rows, [validity, zeros(4 * (rows + 1))], rows, 0, [child])
    if pa.types.is_string(kind):
        return pa.Array.from_buffers(kind, rows, [validity, zeros(4 * (rows + 1)), zeros(0)], rows)
    if pa.types.is_boolean(kind):
        return pa.Array.from_buffers(kind, rows, [validity, zeros(-(-rows // 8))], rows)
    if pa.types.is_primitive(kind):
        return pa.Array.from_buffers(kind, rows, [validity, zeros(rows * kind.bit_width // 8)], rows)
    return pa.nulls(rows, kind)
