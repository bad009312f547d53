"""A big stream file's own columnar part, written by the process that wrote the file when it ends (watch
at a rank's exit, memwatch when it stops), so that even the first report of a run parses no JSON.

At 10,000 ranks x 1,000 steps the first report parsed 9.7 GB of JSON: ~88 s of CPU at pyarrow's
~110 MB/s a core, 44 s of wall on 2 cores before any analysis could start. Done by each rank at its exit,
on its own machine, the parse, its checks and the write are 12-17 ms of CPU a rank (528 KB), and reading
the part back, checks included, ~0.6 ms (Arrow IPC, not compressed: 205 KB for 1,000 steps).

    RUN/columnar/_files/<file name>.arrow     one Arrow IPC file per JSONL file (pyarrow.dataset and
                                              DuckDB's globs over columnar/<stream>/ never see it)

A part holds what the report's reader (`frames.read_table`) gives for that one file with the stream's
columns (`frames.STREAM_COLUMNS`): the typed rows, and the counts of what the reader dropped, nulled
and refused, with the file's [name, size, mtime_ns] when it was read (the `ciuic.part` metadata). The
reader takes a part only while the file still has that size and mtime, the part's columns have exactly
the reader's types, its rows are as many as it says and Arrow's full validation passes; anything else
and the file is parsed as before. So a part changes how fast a report reads, never what it finds
(tests/test_file_parts.py compares the two on the same files).

    part_writer.write(path, stream)           the part of one file (the reader's own read of it)
    part_writer.write_at_exit(path, stream, copies=N)   the same, never raising, when N such files
                                              make a stream worth a columnar copy (`copies.copy_min_bytes`)
    available(files)                          the files that have a part (one listing of a folder)
    read_run(paths, ...), probe/read_batch/add_batches    the reader's side (`frames.read_table`):
                                              small files' parts a run at a time, a big one's a batch
                                              at a time
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow

# the reader's Part (frames.parts.Part, not imported: parts reads these): rows, dropped, nulled, refused
Part = tuple[Any, int, dict[str, int], dict[str, int]]

FILES = "_files"  # under RUN/columnar/: a leading "_" keeps pyarrow.dataset's discovery out of it
SUFFIX = ".arrow"
KEY = b"ciuic.part"
FORMAT = 1
BATCH_ROWS = 1 << 20  # rows a record batch: a big file's part is read and copied a batch at a time
MAX_PART_BYTES = 16 << 30  # a part is data: never read past this
WHOLE_BYTES = 64 << 20  # a part up to this size is read in one go (every rank's steps)


@dataclass
class PartFile:
    """A big file's part, read a record batch at a time by the reader's threads (`read_batch`)."""

    path: Path
    batches: int
    meta: dict[str, Any]


def part_path(jsonl: Path) -> Path:
    from ciuic_doctor.rundir.columnar.layout import ROOT_NAME

    return Path(jsonl).parent / ROOT_NAME / FILES / f"{Path(jsonl).name}{SUFFIX}"


def source_of(jsonl: Path) -> list[Any] | None:
    """[name, size, mtime_ns] of a regular file (what the part was made from), None otherwise."""
    import stat

    try:
        info = os.lstat(jsonl)
    except OSError:
        return None
    return [Path(jsonl).name, info.st_size, info.st_mtime_ns] if stat.S_ISREG(info.st_mode) else None


def available(files: Sequence[Path]) -> set[str]:
    """Paths (as str) of `files` whose folder's columnar/_files holds a part named for them: one listing a
    folder. Whether the part may be used is `read`'s to say."""
    from ciuic_doctor.rundir.columnar.layout import ROOT_NAME

    listed: dict[str, set[str]] = {}
    out = set()
    for f in files:
        path = os.fspath(f)
        folder, _, name = path.rpartition("/")
        if folder not in listed:
            listed[folder] = set()
            with contextlib.suppress(OSError):
                listed[folder] = set(os.listdir(os.path.join(folder or ".", ROOT_NAME, FILES)))
        if name + SUFFIX in listed[folder]:
            out.add(path)
    return out


def _open(jsonl: Path, stream: str | None, dir_fd: int | None = None) -> tuple[Any, dict[str, Any]] | None:
    """(an IPC file reader, the part's metadata) when the part fits the file as it is now; None otherwise.
    A part of up to WHOLE_BYTES is read in one go; a bigger one (a whole job's memwatch.jsonl) through
    its descriptor, a record batch at a time."""
    import pyarrow as pa

    from ciuic_doctor.rundir import safe_io

    target = part_path(jsonl)
    try:
        if dir_fd is None:
            fd = safe_io.open_regular(target, max_bytes=MAX_PART_BYTES, root=Path(jsonl).parent)
        else:  # columnar/_files opened once for a run of files (`read_run`)
            fd = safe_io.open_regular(Path(target.name), max_bytes=MAX_PART_BYTES, dir_fd=dir_fd)
    except OSError:
        return None
    fh = os.fdopen(fd, "rb")
    try:
        if os.fstat(fd).st_size <= WHOLE_BYTES:
            with fh:
                source: Any = pa.py_buffer(fh.read(WHOLE_BYTES + 1))
        else:
            source = fh  # kept open by the reader, closed with it
        reader = pa.ipc.open_file(source)
        meta = json.loads((reader.schema.metadata or {}).get(KEY, b"null"))
    except (OSError, ValueError, pa.ArrowException):
        fh.close()
        return None
    if not _meta_ok(meta, stream) or meta["source"] != source_of(jsonl):
        fh.close()
        return None
    return reader, meta


def _counts(raw: Any) -> bool:
    return isinstance(raw, dict) and all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in raw.items()
    )


def _meta_ok(meta: Any, stream: str | None) -> bool:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("stream") != stream:
        return False
    whole = ("rows", "dropped_lines")
    if any(type(meta.get(name)) is not int or meta[name] < 0 for name in whole):
        return False
    return _counts(meta.get("nulled_values")) and _counts(meta.get("invalid_reasons"))


@functools.lru_cache(maxsize=16)
def _types(columns: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    from ciuic_doctor.rundir.columnar_schema import arrow_type

    return tuple((name, arrow_type(name)) for name in columns)


def _typed(table: pyarrow.Table, columns: Sequence[str]) -> pyarrow.Table | None:
    """`columns` of a part's rows when each has exactly the reader's type and Arrow's full validation
    passes (a part is data: offsets, lengths and nulls are checked before anything reads them)."""
    import pyarrow as pa

    types = dict(zip(table.schema.names, table.schema.types, strict=True))
    if any(types.get(name) != kind for name, kind in _types(tuple(columns))):
        return None
    table = table.select(list(columns))
    try:
        table.validate(full=True)
    except pa.ArrowException:
        return None
    return table


def _part(table: pyarrow.Table | None, meta: dict[str, Any], columns: Sequence[str]) -> Part:
    """The reader's `Part`: the rows (None: already copied) and the file's counts, nulls of `columns` only."""
    nulled = {c: n for c, n in meta["nulled_values"].items() if c in columns}
    return table, meta["dropped_lines"], nulled, dict(meta["invalid_reasons"])


def read(jsonl: Path, columns: Sequence[str], stream: str | None, dir_fd: int | None = None) -> Part | None:
    """A small file's part as the reader's `Part` (what `_read_one` would give for `columns`); None when
    there is no part the file may be read from (a small file's part is one record batch; a big file's is
    read a batch at a time: `probe`, `read_batch`)."""
    import pyarrow as pa

    opened = _open(jsonl, stream, dir_fd)
    if opened is None or opened[0].num_record_batches != 1:
        return None
    reader, meta = opened
    try:
        table = reader.read_all()
    except (OSError, pa.ArrowException):
        return None
    typed = _typed(table, columns) if table.num_rows == meta["rows"] else None
    return None if typed is None else _part(typed, meta, columns)


def read_batch(
    part: PartFile, index: int, columns: Sequence[str], stream: str | None
) -> pyarrow.Table | None:
    """Record batch `index` of a big file's part, `columns` typed and validated; None when the part no
    longer fits the file or the batch does not check (the reader then parses the whole file)."""
    import pyarrow as pa

    opened = _open(part.path, stream)
    if opened is None or opened[1] != part.meta or opened[0].num_record_batches != part.batches:
        return None
    try:
        batch = opened[0].get_batch(index)
    except (OSError, pa.ArrowException):
        return None
    return _typed(pa.Table.from_batches([batch]), columns)


def add_batches(
    part: PartFile,
    results: Iterator[Any],
    table: Any,
    columns: Sequence[str],
    parse: Callable[[], Part],
) -> tuple[Part, bool]:
    """A big file's batches copied into `table` as they come (`read_batch`'s results, in order); when one
    failed or they do not add up to the part's rows, what was copied is taken back and the file parsed
    (`parse`). (The file's counts, no table: it is in `table`; whether they came from the part.)"""
    start, rows, failed = table.mark(), 0, False
    for _ in range(part.batches):
        batch = next(results)  # every batch is taken, even after a failed one: the pool made them all
        if batch is None:
            failed = True
        elif not failed:
            rows += batch.num_rows
            # the JSONL bytes the batch stands for: the rows the table reserves are estimated from them
            table.add(batch, nbytes=part.meta["source"][1] * batch.num_rows // max(part.meta["rows"], 1))
        batch = None
    if failed or rows != part.meta["rows"]:
        table.rollback(start)
        parsed, *counts = parse()
        table.add(parsed, nbytes=0)
        return (None, *counts), False
    return _part(None, part.meta, columns), True


class PartRun(list):
    """Consecutive small files that have parts (a task of the reader's pool: read together, in order)."""


def probe(jsonl: Path, stream: str | None) -> PartFile | None:
    """A big file's part, its batches counted (its footer read), when it fits the file as it is now."""
    opened = _open(jsonl, stream)
    if opened is None:
        return None
    return PartFile(path=Path(jsonl), batches=opened[0].num_record_batches, meta=opened[1])


def read_run(
    paths: PartRun, columns: Sequence[str], stream: str | None, parse: Callable[[Path], tuple[Part, bool]]
) -> tuple[list[tuple[Part, bool]], int]:
    """The files of `paths` in order, each from its part where it may be (`read`), else parsed (`parse`):
    (the reader's entries, consecutive parts joined into one, and how many parts were read)."""
    import pyarrow as pa

    from ciuic_doctor.rundir import safe_io
    from ciuic_doctor.rundir.columnar.layout import ROOT_NAME

    entries: list[tuple[Part, bool]] = []
    held: list[Part] = []

    def join() -> None:  # one table for the held parts (one copy into the reader's table), counts summed
        if held:
            table = pa.concat_tables([p[0] for p in held]).combine_chunks()
            nulled = sum((Counter(p[2]) for p in held), Counter())
            invalid = sum((Counter(p[3]) for p in held), Counter())
            entries.append(((table, sum(p[1] for p in held), dict(nulled), dict(invalid)), False))
            held.clear()

    used = 0
    with contextlib.ExitStack() as stack:
        folders: dict[Path, int | None] = {}
        for path in paths:
            if path.parent not in folders:
                try:
                    folders[path.parent] = stack.enter_context(
                        safe_io.folder(path.parent, (ROOT_NAME, FILES))
                    )
                except OSError:  # no columnar/_files, or a symlink there: no part is read through it
                    folders[path.parent] = None
            dir_fd = folders[path.parent]
            part = read(path, columns, stream, dir_fd) if dir_fd is not None else None
            if part is not None:
                held.append(part)
                used += 1
                continue
            join()
            entries.append(parse(path))
    join()
    return entries, used
