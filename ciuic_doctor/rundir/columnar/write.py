"""Writing a stream's columnar copy: the table a report read from JSONL, cut into parts of 1,024 ranks,
each part checked by reading it back, the manifest written last and the whole folder put in place with
one rename (a reader sees the old copy, no copy, or the new one: never half of one)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ciuic_doctor.rundir.columnar.layout import (
    MANIFEST,
    RANKS_PER_PART,
    ROOT_NAME,
    ROW_COLUMN,
    Counts,
    Manifest,
    PartInfo,
    part_name,
    stream_dir,
)

if TYPE_CHECKING:
    import numpy as np
    import pyarrow

NULL_KEY = -(2**62)  # the sort key of a record without a rank: before every real block
CUT_ROWS = 1 << 20  # rows whose rank blocks `cut` finds at a time (8 MB of keys) when the ranks are in order
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def block_keys(table: pyarrow.Table) -> np.ndarray:
    """Each row's rank block (rank // 1,024, floor), NULL_KEY where the rank is null or absent."""
    import numpy as np

    if "rank" not in table.column_names:
        return np.full(table.num_rows, NULL_KEY, np.int64)
    rank = table.column("rank")
    values = rank.fill_null(0).to_numpy().astype(np.int64, copy=False)
    keys = np.floor_divide(values, RANKS_PER_PART)
    if rank.null_count:
        keys[rank.is_null().to_numpy(zero_copy_only=False)] = NULL_KEY
    return keys


def _ordered_cut(table: pyarrow.Table) -> list[tuple[int | None, Any]] | None:
    """`cut`'s parts when every row has a rank and the ranks' blocks never go down (per-rank files, read in
    rank order), found a million rows at a time; None otherwise. The whole table's keys were 160 MB at
    10,000 ranks x 1,000 steps, made while both streams' tables are held: the first report's peak."""
    import numpy as np

    if "rank" not in table.column_names or table.column("rank").null_count or not table.num_rows:
        return None
    parts: list[tuple[int | None, Any]] = []
    block, start, at = None, 0, 0
    for chunk in table.column("rank").chunks:
        values = chunk.to_numpy()
        for lo in range(0, len(values), CUT_ROWS):
            keys = np.floor_divide(values[lo : lo + CUT_ROWS], RANKS_PER_PART)
            if (block is not None and keys[0] < block) or (keys[1:] < keys[:-1]).any():
                return None
            for i in np.flatnonzero(np.r_[block is None or keys[0] != block, keys[1:] != keys[:-1]]).tolist():
                if block is not None:
                    parts.append((block, (start, at + i)))
                block, start = int(keys[i]), at + i
            at += len(keys)
    parts.append((block, (start, at)))
    return parts


def cut(table: pyarrow.Table) -> tuple[list[tuple[int | None, Any]], bool]:
    """The table's parts as (rank block, rows), one per block in block order, and whether the parts are
    in the table's order. Rows a rank's file holds in rank order (the steps of per-rank files) are a
    (start, stop) slice; otherwise (one shared file, ranks interleaved in time) the rows' places, which
    the part stores in `_row`. A part is built only when it is written (`materialize`): all of them at
    once would be a second copy of the stream."""
    import numpy as np

    if (ordered := _ordered_cut(table)) is not None:
        return ordered, True
    keys = block_keys(table)
    if not len(keys):
        return [], True
    ordered = bool(np.all(keys[1:] >= keys[:-1]))
    order = None if ordered else np.argsort(keys, kind="stable")
    sorted_keys = keys if order is None else keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    stops = np.r_[starts[1:], len(keys)]
    parts = []
    for lo, hi in zip(starts.tolist(), stops.tolist(), strict=True):
        block = None if sorted_keys[lo] == NULL_KEY else int(sorted_keys[lo])
        parts.append((block, (lo, hi) if order is None else order[lo:hi]))
    return parts, ordered


def materialize(table: pyarrow.Table, rows: Any) -> pyarrow.Table:
    import pyarrow as pa

    if isinstance(rows, tuple):
        return table.slice(rows[0], rows[1] - rows[0])
    return table.take(pa.array(rows)).append_column(ROW_COLUMN, pa.array(rows, pa.int64()))


def _write_part(folder: Path, name: str, table: pyarrow.Table, rows: Any) -> None:
    """One part file, created new (O_EXCL | O_NOFOLLOW) in a folder only this writer made, then read back
    and compared with what was meant to be written."""
    import pyarrow.parquet as pq

    part = materialize(table, rows)
    path = folder / name
    os.mkdir(path.parent, 0o755)
    with os.fdopen(os.open(path, _CREATE, 0o644), "wb") as fh:
        # LZ4 (Parquet's LZ4_RAW, which DuckDB and Spark read), not zstd: the copy is read by every later
        # report. 10,000 ranks x 1,000 steps, 2.7 GB decoded: read 1.4 vs 2.1 s CPU, written 6.4 vs 7.8 s,
        # 492 vs 350 MiB on disk (zstd level 1)
        pq.write_table(part, fh, compression="lz4")
    # read back a column at a time: a whole part of 1,024 ranks' steps is ~200 MB decoded, and two parts
    # are written at once, while both streams' tables are held (the first report's peak)
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as fh:
        back = pq.ParquetFile(fh)
        same = back.schema_arrow.names == part.column_names and all(
            _same(back.read(columns=[column], use_threads=False).column(0), part.column(i))
            for i, column in enumerate(part.column_names)
        )
    if not same:
        raise ValueError(f"{name}: read back differs from the records it was written from")


def _same(back: Any, written: Any) -> bool:
    """Equal values, nulls in the same places, and a NaN where a NaN was (arrow's `equals` calls two NaNs
    different; a loss that went NaN is a value the copy must keep)."""
    import numpy as np
    import pyarrow as pa

    if back.equals(written):
        return True
    if not pa.types.is_floating(written.type) or back.type != written.type:
        return False
    if not back.is_null().equals(written.is_null()):
        return False
    a = back.to_numpy(zero_copy_only=False)
    b = written.to_numpy(zero_copy_only=False)
    return bool(np.array_equal(a, b, equal_nan=True))


def save(
    run_path: Path, stream: str, sources: list[list[Any]], table: pyarrow.Table, counts: Counts
) -> str | None:
    """Write `table` (every valid record of `stream`, read from the files `sources` names) as the stream's
    columnar copy. Returns None when written, else why not in one line (a read-only or unsafe run folder,
    a full disk): the report goes on without a copy."""
    from ciuic_doctor.rundir import safe_io

    run_path = Path(run_path)
    parts, ordered = cut(table)
    manifest = Manifest(
        stream=stream,
        sources=sources,
        columns={f.name: str(f.type) for f in table.schema},
        rows=table.num_rows,
        ordered=ordered,
        parts=[PartInfo(path=part_name(block), rank_block=block, rows=_count(rows)) for block, rows in parts],
        counts=counts,
    )
    tmp = None
    try:
        safe_io.make_dir(run_path, ROOT_NAME)  # refuses a symlink or a file under the name
        root = run_path / ROOT_NAME
        tmp = root / f".{stream}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        os.mkdir(tmp, 0o755)  # new: a planted name makes this fail, never write through it
        # pyarrow's encoder releases the GIL; two parts in flight bound the memory a shuffled stream takes
        threads = max(1, min(2, len(parts), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda part: _write_part(tmp, part_name(part[0]), table, part[1]), parts))
        with os.fdopen(os.open(tmp / MANIFEST, _CREATE, 0o644), "wb") as fh:
            fh.write(manifest.to_json())
        _put_in_place(tmp, stream_dir(run_path, stream))
        tmp = None
        return manifest
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return f"no columnar copy of {stream} written: {why}"
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        from ciuic_doctor.rundir.frames.cache import give_back_memory

        give_back_memory()  # the writing's: under the tables the analyses build next, +140 MB at the peak


def _count(rows: Any) -> int:
    return rows[1] - rows[0] if isinstance(rows, tuple) else len(rows)


def _put_in_place(tmp: Path, target: Path) -> None:
    """Replace the folder `target` with `tmp`: the old copy moved aside, then removed."""
    old = target.with_name(f".{target.name}.{secrets.token_hex(4)}.old")
    try:
        if target.is_symlink():
            target.unlink()  # a link planted as the copy: removed, never followed
        else:
            os.rename(target, old)
    except FileNotFoundError:
        old = None
    try:
        os.rename(tmp, target)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another report put its copy there first: keep theirs
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
