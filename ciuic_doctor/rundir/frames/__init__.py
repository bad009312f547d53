"""Columnar reading of a run's streams for the analyses and the report: only the columns asked for, every
file of a stream in parallel, with pyarrow's JSON reader (or the Parquet file `ciuic-doctor compact` wrote
beside a stream file, when it is up to date).

Why pyarrow: measured side by side on this project's 2-core machine, shared with other work
(`benchmarks/columnar_readers.py --ranks 256`: 256 files, 133 MiB, 512,000 rows, 7 columns): pyarrow
1.0 s wall / 1.2 s CPU, Polars 0.9 s / 0.8 s, DuckDB 2.3 s / 1.0 s, the row reader (`json.loads` per
line) 13.9 s / 5.0 s. Polars is as fast, but its `ignore_errors` nulls a wrong value without saying so
(we must count them), and pyarrow is also the Parquet library that `compact` writes with: one
dependency for both. The row reader (`RunDir.read`) stays for small streams and for code that wants
whole records; this module sits beside it and does not change it.

Bad content never raises, it is counted, exactly as the row reader counts it: a line that is not a JSON
object is dropped (`dropped_lines`), a record off its stream's schema is dropped and counted with its
reason (`invalid_records`, `invalid_reasons`: `schemas.validate`'s words), and the stream's reader
problems land in `RunDir.read_problems` for the `records_readable` finding. Validation is column-wise
(`columnar_schema`): pyarrow parses each file with every schema field typed strictly, which is the
type test `validate` makes of every record. A file that fails it (a "nan" string the store wrote for a
non-finite float, a wrong type, a torn line in the middle) is read again record by record with
`json.loads` and `validate` (the rare path); a torn *last* line is read apart, so a crashed rank's file
stays on the fast path. A free field's value of the wrong type for its column becomes null
(`nulled_values`).

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> lines = '{"rank":0,"step":1,"loss":"nan"}\\n{"rank":0,"step":2,"loss":2.5}\\n{"ra'
>>> _ = (folder / "steps.rank0.jsonl").write_text(lines)
>>> read = read_table([folder / "steps.rank0.jsonl"], ("rank", "step", "loss"))
>>> read.table.column("step").to_pylist(), read.dropped_lines
([1, 2], 1)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ciuic_doctor.rundir import columnar_schema
from ciuic_doctor.rundir.columnar_schema import COLUMN_TYPES, _coerce, arrow_type, schema_for
from ciuic_doctor.rundir.frames import file_parts
from ciuic_doctor.rundir.frames.assemble import Assembler, add_big, plain_strings, task_bytes
from ciuic_doctor.rundir.frames.cache import (  # noqa: F401 - the cache's API, as frames.<name>
    _CACHE,
    CACHED_STREAMS,
    _stamp,
    checked,
    clear_cache,
    forget,
    held_rows,
    keep,
    one_snapshot,
    pinned,
)
from ciuic_doctor.rundir.frames.parts import BigFile, Part, _batches, _read_batch, _read_range
from ciuic_doctor.rundir.frames.tableread import TableRead
from ciuic_doctor.rundir.frames.values import float_values, whole_values
from ciuic_doctor.rundir.store import RunDir
from ciuic_doctor.rundir.stream_read import _open_regular

if TYPE_CHECKING:
    import pyarrow
    import pyarrow.json

__all__ = [
    "COLUMN_TYPES",
    "TableRead",
    "arrow_type",
    "float_values",
    "forget",
    "read_records",
    "read_stream",
    "read_table",
    "schema_for",
    "whole_values",
]

MAX_THREADS = 8


# ---- one file ------------------------------------------------------------------------------------


def _rows(lines: Iterable[bytes], columns: Sequence[str], stream: str | None) -> Part:
    """The slow, forgiving path, record by record as `store.read_jsonl` reads: a line that is not a JSON
    object is dropped, a record `schemas.validate` refuses is dropped and counted with its reason, and
    each value kept is coerced to its column's type (a free field's wrong value nulled and counted)."""
    import pyarrow as pa

    from ciuic_doctor.rundir.schemas import validate

    kinds = [COLUMN_TYPES.get(c, "float64") for c in columns]
    values: list[list[Any]] = [[] for _ in columns]
    dropped, nulled, invalid = 0, dict.fromkeys(columns, 0), {}
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError):
            dropped += 1
            continue
        if not isinstance(record, dict):
            dropped += 1
            continue
        reason = validate(stream, record) if stream else None
        if reason is not None:
            invalid[reason] = invalid.get(reason, 0) + 1
            continue
        for column, kind, out in zip(columns, kinds, values, strict=True):
            value, bad = _coerce(record.get(column), kind)
            out.append(value)
            nulled[column] += bad
    schema = schema_for(columns)
    table = pa.table(
        {c: pa.array(v, type=schema.field(c).type) for c, v in zip(columns, values, strict=True)}
    )
    return table, dropped, {c: n for c, n in nulled.items() if n}, invalid


def _read_rows(path: Path, columns: Sequence[str], stream: str | None) -> Part:
    with os.fdopen(_open_regular(path), "rb") as fh:
        return _rows(fh, columns, stream)


class _Prefix(io.RawIOBase):
    """The first `size` bytes of a file, for pyarrow to read block by block (a torn tail left out)."""

    def __init__(self, path: Path, size: int) -> None:
        self._fh = os.fdopen(_open_regular(path), "rb")
        self._left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:
        want = min(len(buffer), self._left)
        if want <= 0:
            return 0
        data = self._fh.read(want)
        buffer[: len(data)] = data
        self._left -= len(data)
        return len(data)

    def close(self) -> None:
        self._fh.close()
        super().close()


def _layout(path: Path) -> tuple[int, int, bytes]:
    """(bytes of whole lines, newlines among them, the torn last line after them): one sequential read in
    16 MiB pieces (no file-sized buffer, no mapping whose pages would count as our memory). A line a
    crash left without its newline is read apart, so it cannot send the whole file down the slow path."""
    lines, size, last = 0, 0, -1
    with os.fdopen(_open_regular(path), "rb") as fh:
        while chunk := fh.read(16 << 20):
            lines += chunk.count(b"\n")
            if (at := chunk.rfind(b"\n")) >= 0:
                last = size + at
            size += len(chunk)
        cut = last + 1
        fh.seek(cut)
        tail = fh.read()
    return cut, lines, tail


def _read_jsonl(path: Path, columns: Sequence[str], stream: str | None) -> Part:
    """pyarrow's JSON reader with every field of the stream's schema typed strictly: a parse that succeeds,
    with as many records as lines, has validated every record column-wise (`columnar_schema`). Anything
    else sends the file to `_read_rows`, which judges each record as the row reader does."""
    import pyarrow as pa
    import pyarrow.json as pj

    plan = columnar_schema.plan(stream, columns)
    if plan is None:
        return _read_rows(path, columns, stream)
    whole, lines, tail = _layout(path)
    parse = pj.ParseOptions(explicit_schema=plan.parse_schema, unexpected_field_behavior=plan.unexpected)
    source = str(path) if not tail else _Prefix(path, whole)
    try:  # one thread a file: the files themselves are read in parallel, a big one in pieces (read_table)
        table = pj.read_json(source, read_options=pj.ReadOptions(use_threads=False), parse_options=parse)
        parsed = (table.num_rows, plan.valid(table), *plan.conform(table))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return _read_rows(path, columns, stream)
    finally:
        if not isinstance(source, str):
            source.close()
    rows, valid, out, nulled = parsed
    # two records on one line parse as two rows here and as one bad line there: the counts must agree
    if rows != lines or not valid:
        return _read_rows(path, columns, stream)
    return _with_tail([out], nulled, tail, columns, stream)


def _with_tail(
    tables: list[pyarrow.Table],
    nulled: dict[str, int],
    tail: bytes,
    columns: Sequence[str],
    stream: str | None,
) -> Part:
    """A file's parsed whole lines, and the torn line after them judged by the row path."""
    import pyarrow as pa

    if tail.strip():
        part, dropped, more, invalid = _rows([tail], columns, stream)
        tables.append(part)
        for column, count in more.items():
            nulled[column] = nulled.get(column, 0) + count
    else:
        dropped, invalid = 0, {}
    return (tables[0] if len(tables) == 1 else pa.concat_tables(tables)), dropped, nulled, invalid


def _read_parquet(path: Path, columns: Sequence[str]) -> pyarrow.Table:
    """Only `columns` of a compacted file; columns `compact` stored as JSON text are decoded and coerced."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ciuic_doctor.rundir.parquet_store import JSON_COLUMNS_KEY

    parquet = pq.ParquetFile(path)
    names = set(parquet.schema_arrow.names)
    json_columns = set(json.loads((parquet.metadata.metadata or {}).get(JSON_COLUMNS_KEY, b"[]")))
    present = [c for c in columns if c in names]
    table = parquet.read(columns=present, use_threads=False)
    out = {}
    for column in columns:
        kind = arrow_type(column)
        if column not in names:
            out[column] = pa.nulls(table.num_rows, type=kind)
        elif column in json_columns:
            decoded = (None if v is None else json.loads(v) for v in table.column(column).to_pylist())
            out[column] = pa.array(
                [_coerce(v, COLUMN_TYPES.get(column, "float64"))[0] for v in decoded], type=kind
            )
        else:
            try:
                out[column] = table.column(column).cast(kind)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                out[column] = pa.array(
                    [
                        _coerce(v, COLUMN_TYPES.get(column, "float64"))[0]
                        for v in table.column(column).to_pylist()
                    ],
                    type=kind,
                )
    return pa.table(out)


def _read_one(path: Path, columns: Sequence[str], stream: str | None) -> tuple[Part, bool]:
    from ciuic_doctor.rundir.parquet_store import fresh_parquet, invalid_reasons, skipped_lines

    parquet = fresh_parquet(path) if path.suffix == ".jsonl" else None
    if parquet is not None:  # compact kept only valid records; what it left out still counts
        return (_read_parquet(parquet, columns), skipped_lines(parquet), {}, invalid_reasons(parquet)), True
    return _read_jsonl(path, columns, stream), False


def read_table(
    files: Iterable[Path],
    columns: Sequence[str],
    stream: str | None = None,
    *,
    encoded: bool = False,
    use_parts: bool = True,
) -> TableRead:
    """`columns` of every valid record in `files` (file order, then line order), files read in parallel.
    `stream` names the schema the records must fit (default: the stream the first file's name says).
    `encoded`: string columns of few values stay dictionary-encoded (the cache keeps them so; `select`
    decodes them for a reader). `use_parts`: read a file from the part its probe left (`file_parts`).

    Small files (a rank's steps) are parsed BATCH_BYTES at a time (`_read_batch`): at 10,000 ranks the
    per-file cost of a parse and its checks (~4 ms) outweighed the parse itself."""

    import pyarrow as pa

    from ciuic_doctor.parallel.cores import usable_cores
    from ciuic_doctor.rundir.schemas import stream_of

    files = list(files)
    columns = list(dict.fromkeys(columns))
    if stream is None and files:
        stream = stream_of(files[0].name)
    # the parts probes leave at their exit (file_parts): a file that has one is not parsed at all
    parted = file_parts.available(files) if use_parts and stream in STREAM_COLUMNS else set()
    tasks = _batches(files, stream, parted)
    units = [  # what the threads do: a task, or one piece of a big file (a batch of its part)
        (task, piece)
        for task in tasks
        for piece in (
            range(len(task.ranges))
            if isinstance(task, BigFile)
            else range(task.batches)
            if isinstance(task, file_parts.PartFile)
            else [None]
        )
    ]

    def work(unit: tuple[Any, int | None]) -> Any:
        task, piece = unit
        if isinstance(task, BigFile):
            return _read_range(task.path, *task.ranges[piece], columns, stream)
        if isinstance(task, file_parts.PartFile):
            return file_parts.read_batch(task, piece, columns, stream)
        if isinstance(task, file_parts.PartRun):
            return file_parts.read_run(task, columns, stream, parse=lambda p: _read_one(p, columns, stream))
        return _read_task(task, columns, stream), 0

    def parse(path: Path) -> Part:  # a big file whose part did not check
        return _read_jsonl(path, columns, stream)

    def by_row(path: Path) -> Part:  # a big file a piece of which failed its checks
        return _read_rows(path, columns, stream)

    def lines_by_row(lines: list[bytes]) -> Part:  # a big file's torn last line
        return _rows(lines, columns, stream)

    # one parse thread a usable core: the parse is CPU-bound (pyarrow, ~110 MB/s a core); two a core each
    # held a batch in flight, no faster (10,000 x 1,000 on 2 cores: 86-88 s vs 81-84 s) and ~100 MB more
    # at the first report's peak (2.90-2.94 GiB vs 2.83), files in the page cache
    threads = max(1, min(MAX_THREADS, len(units), usable_cores()))
    sizes = [task_bytes(task) for task in tasks]  # what the rows to reserve are estimated from
    table = Assembler(total_bytes=sum(sizes))
    parts: list[tuple[Part, bool]] = []  # each part's counts; its table is let go once copied
    part_files = 0
    # one unit (a rank's file, as watch reads its own at exit): no pool, which could not start threads
    # once the interpreter is shutting down (an atexit handler)
    with ThreadPoolExecutor(max_workers=threads) if threads > 1 else contextlib.nullcontext() as pool:
        done = pool.map(work, units) if pool else map(work, units)  # in order, each let go as taken
        for task, size in zip(tasks, sizes, strict=True):
            if isinstance(task, BigFile):
                parts.append((add_big(task, done, table, by_row, lines_by_row), False))
                continue
            if isinstance(task, file_parts.PartFile):
                counts, used = file_parts.add_batches(task, done, table, columns, partial(parse, task.path))
                part_files += used
                parts.append((counts, False))
                continue
            read, used = next(done)
            part_files += used
            for (part, *rest), parquet in read:
                table.add(part, nbytes=size // len(read))
                parts.append(((None, *rest), parquet))
            part = read = None
    if not parts:
        return TableRead(table=schema_for(columns).empty_table())
    built = table.table()
    pa.default_memory_pool().release_unused()  # the parse's blocks, kept by mimalloc: 88 MB at 3,000 ranks
    result = TableRead(
        table=built if encoded else plain_strings(built),
        files=files,
        dropped_lines=sum(p[0][1] for p in parts),
        parquet_files=sum(p[1] for p in parts),
        part_files=part_files,
    )
    for (_, _, nulled, invalid), _ in parts:
        for column, count in nulled.items():
            result.nulled_values[column] = result.nulled_values.get(column, 0) + count
        for reason, count in invalid.items():
            result.invalid_reasons[reason] = result.invalid_reasons.get(reason, 0) + count
            result.invalid_records += count
    return result


def _read_task(paths: list[Path], columns: Sequence[str], stream: str | None) -> list[tuple[Part, bool]]:
    if len(paths) > 1 and (part := _read_batch(paths, columns, stream)) is not None:
        return [(part, False)]
    return [_read_one(path, columns, stream) for path in paths]


# What the analyses and the report read of a stream, all together: the first reader reads them all, the
# others take their columns from the cached table (one parse of a 1.2 GB run instead of five).
STREAM_COLUMNS = {
    "steps": (
        *("rank", "step", "t", "host", "step_time_s", "pre_backward_s", "weights_checksum", "desync_ranks"),
        *("loss", "lr", "grad_norm", "loss_scale", "skipped", "clip_max_norm", "rss", "uss"),
        *("mem_allocated", "mem_reserved", "mem_active_peak", "alloc_retries", "inactive_split_bytes"),
        *("loss_scale_next", "optimizer", "tokens", "segment"),
    ),
    "memwatch": (
        *("t", "host", "pid", "role", "rank", "rss", "anon", "uss", "pss"),
        *("gpu_bytes", "gpu_total_bytes", "sys_available_bytes"),
    ),
}


def read_stream(
    run: RunDir,
    stream: str,
    columns: Sequence[str],
    *,
    encoded: bool = False,
    cached: bool = True,
    any_order: bool = False,
) -> TableRead:
    """`columns` of every valid record of `stream` (shared file first, then per-rank files in rank order);
    what the reader skipped goes to `run.read_problems[stream]`. `encoded`: strings of few values (host,
    role) stay dictionary-encoded (`TableRead.select`). `any_order`: the rows may come as the columnar
    copy's parts hold them, `stream_rows` their places in the stream (for a reader that groups them).
    The table is kept while the stream's files are unchanged (sizes, mtimes): the analyses and the page of
    one report parse it once; the CACHED_STREAMS last streams are kept. `cached=False`: read past the cache
    (a stream read once, which would push steps or memwatch out). Inside `one_snapshot`, a table this
    snapshot has read or checked is used without looking at the files again (one cached before is checked)."""
    key = (str(run.path.resolve()), stream)
    if (taken := pinned(key, columns)) is not None:
        _note_problems(run, stream, taken)
        return (taken if any_order else taken.in_stream_order()).select(columns, encoded=encoded)
    files = run.stream_files(stream)
    stamp, sources = _stamp(files)
    held = _CACHE.get(key)
    if held is not None and held[0] == stamp and set(columns) <= set(held[1].table.column_names):
        read = held[1]
        checked(key)
    elif not cached:
        read = _read_through_copy(run, stream, files, list(columns), sources=sources)
    else:
        _CACHE.pop(key, None)
        wanted = [*columns, *STREAM_COLUMNS.get(stream, ())]
        read = _read_through_copy(run, stream, files, wanted, sources=sources, any_order=any_order)
        keep(key, stamp, read)
    _note_problems(run, stream, read)
    return (read if any_order else read.in_stream_order()).select(columns, encoded=encoded)


def columnar_copy(run: RunDir, stream: str) -> TableRead:
    """The stream read through its columnar copy, the copy written whatever the stream's size (`compact`
    makes it ahead of the first report); `read.copy_id` is None when it could not be (`run.notes`)."""
    files = run.stream_files(stream)
    _, sources = _stamp(files)
    return _read_through_copy(run, stream, files, list(STREAM_COLUMNS[stream]), sources=sources, threshold=0)


def _read_through_copy(
    run: RunDir,
    stream: str,
    files: list[Path],
    columns: list[str],
    *,
    sources: list[list[Any]],
    threshold: int | None = None,
    any_order: bool = False,
) -> TableRead:
    """The stream from its columnar copy when one matches the files as they are now (`sources`: taken
    before the read, so a file that grows during it makes the copy stale); else from the JSONL, and then
    (a big stream, in a writable run) the copy is written for the next report (`copies`)."""
    from ciuic_doctor.rundir.frames import copies

    plan = copies.plan(stream, files, sources, threshold) if stream in STREAM_COLUMNS else None
    if plan is None:
        return read_table(files, columns, stream, encoded=True)
    if (read := copies.load(run, plan, columns, any_order=any_order)) is not None:
        return read
    read = read_table(files, columns, stream, encoded=True)
    copies.save(run, plan, read)
    return read


def _note_problems(run: RunDir, stream: str, read: TableRead) -> None:
    problems = "; ".join(p for p in (run._irregular.get(stream), read.problems()) if p)
    if problems:
        run.read_problems[stream] = problems


def read_records(run: RunDir, stream: str) -> list[dict[str, Any]]:
    """Every valid record of a small stream whose records nest (comm's per-rank times, the loader's
    worker lists, checkpoint fingerprints, memwatch's process events), as dicts: the row reader, whose
    validation the columnar path matches (tests/test_frames_validation.py). These streams hold a table
    of sizes or a sweep, tens to thousands of lines at any job size; a stream that grows with ranks ×
    time (steps, memwatch samples) is read with `read_stream`."""
    if not run.has_stream(stream):
        return []
    return run.read(stream).records


def last_per_rank(run: RunDir, stream: str, columns: Sequence[str]) -> dict[int, dict[str, Any]]:
    """Each rank's record with the highest `step` (the later one on a tie), `columns` of it only: the
    hang analysis's "last step record" without reading 2 M records into dicts."""
    import pyarrow.compute as pc

    wanted = list(dict.fromkeys(["rank", "step", *columns]))
    table = read_stream(run, stream, wanted).table
    table = table.filter(pc.is_valid(table["rank"]))
    if not table.num_rows:
        return {}
    import numpy as np

    rank = table["rank"].to_numpy()
    step = table["step"].fill_null(0).to_numpy()
    order = np.lexsort((np.arange(len(rank)), step, rank))  # by rank, then step, then position
    last = order[np.r_[rank[order][1:] != rank[order][:-1], True]]
    rows = table.take(last).to_pylist()
    return {row["rank"]: {k: v for k, v in row.items() if k in wanted} for row in rows}
