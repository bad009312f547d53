"""Reading a stream's columnar copy back: the whole stream in its order (a report), or the rows of some
ranks (one block of the per-block checks, on whichever machine runs it)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ciuic_doctor.rundir.columnar.layout import (
    RANKS_PER_PART,
    ROW_COLUMN,
    Manifest,
    PartInfo,
    read_manifest,
    stream_dir,
)

if TYPE_CHECKING:
    import numpy as np
    import pyarrow

MAX_PART_BYTES = 64 * 2**30  # the cap of a stream file: a part holds at most a stream's records


class StaleCopy(LookupError):
    """The copy is absent, stale (its sources changed) or not the one the caller planned with."""


def _read_part(run_path: Path, stream: str, part: PartInfo, columns: list[str]) -> pyarrow.Table:
    """One part, `columns` only, opened without following a symlink anywhere below the run folder."""
    import os

    import pyarrow.parquet as pq

    from ciuic_doctor.rundir import safe_io

    path = stream_dir(run_path, stream) / part.path
    fd = safe_io.open_regular(path, max_bytes=MAX_PART_BYTES, root=Path(run_path))
    with os.fdopen(fd, "rb") as fh:
        table = pq.read_table(fh, columns=columns, use_threads=False)
    if table.num_rows != part.rows:
        raise StaleCopy(f"{part.path}: {table.num_rows} rows, the manifest says {part.rows}")
    return table


def _as_written(table: pyarrow.Table, manifest: Manifest) -> pyarrow.Table:
    """`table` with each column of the type the manifest names; `StaleCopy` when one differs. Parquet
    names a list's field "element" where arrow named it "item": that column is cast back, the only
    difference a copy may have."""
    import pyarrow as pa

    for index, column in enumerate(table.schema):
        if column.name == ROW_COLUMN:
            continue
        expected = manifest.columns.get(column.name)
        if str(column.type) == expected:
            continue
        if pa.types.is_list(column.type) and str(pa.list_(column.type.value_type)) == expected:
            table = table.set_column(
                index, column.name, table.column(index).cast(pa.list_(column.type.value_type))
            )
            continue
        raise StaleCopy(f"column {column.name} is {column.type}, the manifest says {expected}")
    return table


def load(run_path: Path, manifest: Manifest, columns: Sequence[str]) -> pyarrow.Table:
    """`columns` of every record, in the stream's order; `StaleCopy` when a part does not match the
    manifest (the caller reads the JSONL instead)."""
    return load_any_order(run_path, manifest, columns, stream_order=True)[0]


def load_any_order(
    run_path: Path, manifest: Manifest, columns: Sequence[str], *, stream_order: bool = False
) -> tuple[pyarrow.Table, np.ndarray | None]:
    """`columns` of every record, and None where the rows are in the stream's order; else the rows as
    the parts hold them (rank block by rank block) and each row's place in the stream. A stream whose
    ranks interleave (memwatch's shared file) is put in its order by a take() of every column: its 10 M
    samples at 10,000 ranks are read in 1.6-3.3 s that way, in 0.7 s as the parts hold them.
    `stream_order`: in the stream's order, always."""
    import pyarrow as pa

    wanted = list(dict.fromkeys(columns))
    if not set(wanted) <= set(manifest.columns):
        raise StaleCopy("the copy lacks a column asked for")
    if not manifest.parts:
        from ciuic_doctor.rundir.columnar_schema import schema_for

        return schema_for(wanted).empty_table(), None
    table, places = _in_stream_order(run_path, manifest, wanted, reorder=stream_order)
    # the decoded pages and the reordering's columns, kept by the allocator: 1.7 GB at 100,000 ranks
    pa.default_memory_pool().release_unused()
    return table, places


def _read_parts(run_path: Path, manifest: Manifest, columns: list[str]) -> list[pyarrow.Table]:
    threads = max(1, min(8, len(manifest.parts)))
    with ThreadPoolExecutor(max_workers=threads) as pool:  # pyarrow's decoder releases the GIL
        return list(pool.map(lambda p: _read_part(run_path, manifest.stream, p, columns), manifest.parts))


def _in_stream_order(
    run_path: Path, manifest: Manifest, columns: list[str], *, reorder: bool = True
) -> tuple[pyarrow.Table, np.ndarray | None]:
    """The stream's rows in its order, one contiguous array a column, built a column at a time (each read
    from every part, joined, and for a shuffled stream taken in order): the peak is the result and one
    column's parts, not the parts and the result, and the columns come out as the JSONL reader makes
    them (one chunk: a chunked column is copied by every `to_numpy`, and the analyses make dozens).
    `reorder` False: a shuffled stream's rows stay in the parts' order, and their places come back."""
    import numpy as np
    import pyarrow as pa

    from ciuic_doctor.rundir.frames.parts import _all_null

    order = places = None
    if not manifest.ordered:
        parts = _read_parts(run_path, manifest, [ROW_COLUMN])
        places = np.concatenate([t.column(0).to_numpy() for t in parts])
        del parts
        inverse = _inverse(places, manifest.rows)  # checks that the places are the stream's rows
        if reorder:
            order = pa.array(inverse)
            places = None
        elif len(places) < 2**31:  # kept beside the table: 40 MB instead of 80 at 10,000 ranks
            places = places.astype(np.int32)
        del inverse
    taken = {}
    for name in columns:
        parts = _read_parts(run_path, manifest, [name])
        column = _as_written(pa.concat_tables(parts), manifest).unify_dictionaries().column(0)
        del parts
        if order is not None:
            column = column.take(order)
        taken[name] = column.combine_chunks()
        if len(column) and column.null_count == len(column):
            # a field no record has (a job without a GradScaler: loss_scale, loss_scale_next): zeros the
            # JSONL reader leaves untouched, not Parquet's written ones: 78 MB a column at 10,000 x 1,000
            taken[name] = _all_null(column.type, len(column))
        del column
        # this column's parts and reordering back to the system now, not at the end: with the other big
        # stream read beside this one (`frames.beside`), held to the end they were +300 MB at the peak
        pa.default_memory_pool().release_unused()
    return pa.table(taken), places


def _inverse(places: np.ndarray, rows: int) -> np.ndarray:
    """The row numbers that put `places` in order (`order[places[i]] = i`: what a stable argsort of a
    permutation gives), `StaleCopy` unless `places` holds 0 … rows - 1 once each. One scatter instead of
    a sort to check and a sort to order: 0.12 s instead of 1.9 s for memwatch's 10 M rows at 10,000 ranks.

    >>> import numpy as np
    >>> _inverse(np.array([2, 0, 1]), 3).tolist()
    [1, 2, 0]
    """
    import numpy as np

    if len(places) != rows or (rows and (places.min() < 0 or places.max() >= rows)):
        raise StaleCopy("the parts' row places are not the stream's rows once each")
    order = np.full(rows, -1, np.int64)
    order[places] = np.arange(rows)
    if rows and order.min() < 0:  # a place twice leaves another one unfilled
        raise StaleCopy("the parts' row places are not the stream's rows once each")
    return order


def read_ranks(
    run_path: Path, stream: str, ranks: Sequence[int], columns: Sequence[str], *, copy_id: str
) -> pyarrow.Table:
    """The rows of `ranks` (records with those ranks), `columns` only, in the stream's order, from the
    copy whose manifest has `copy_id` (the one the caller checked fresh; `StaleCopy` otherwise). Reads only
    the parts that hold those ranks: a block's worth of a 100,000-rank stream, not the stream.

    For a reader of one block on a machine that shares the run folder (an engine's worker, a query of
    a few ranks); `report --scheduler` ships each block's arrays to Dask instead, which needs no shared
    file system (ciuic_doctor/parallel/README.md)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    manifest = read_manifest(run_path, stream)
    if manifest is None or manifest.copy_id != copy_id:
        raise StaleCopy(f"{stream}: the columnar copy is not the one the report checked")
    wanted = list(dict.fromkeys(columns))
    blocks = {int(r) // RANKS_PER_PART for r in ranks}
    chosen = [p for p in manifest.parts if p.rank_block in blocks]
    read = [*dict.fromkeys([*wanted, "rank"]), *([] if manifest.ordered else [ROW_COLUMN])]
    if not chosen:
        from ciuic_doctor.rundir.columnar_schema import schema_for

        return schema_for(wanted).empty_table()
    table = pa.concat_tables([_read_part(run_path, stream, p, read) for p in chosen])
    table = _as_written(table, manifest)
    table = table.filter(pc.is_in(table["rank"], value_set=pa.array(sorted(set(ranks)), pa.int64())))
    if not manifest.ordered:
        table = table.take(pa.array(np.argsort(table.column(ROW_COLUMN).to_numpy(), kind="stable")))
    return table.select(wanted).combine_chunks()
