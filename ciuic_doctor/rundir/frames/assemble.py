"""The parts of a columnar read (`frames.read_table`) copied, as each arrives, into one buffer per column,
so a stream's table is built while it is parsed instead of after.

Why: the parts of a 10,000-rank job's steps (330 batches of 32 files) held 1.8 GB, and joining them into
one chunk per column (which lets a reader take a numpy view of a column instead of a copy) needed a second
1.8 GB: freeing a part's column gave nothing back to the OS while the other columns of the same parts
still lived in the allocator's pages, so the read peaked at twice the table (3.56 GB, RSS measured by
`benchmarks/report_scale.py`'s run and a sampler). Here a part lives only until its columns are copied;
the parse reuses its memory for the next part.

A column of numbers or booleans goes to a numpy buffer reserved for the rows the stream's bytes promise
(reserved, not touched: the OS gives pages on first write, so an over-estimate costs address space only)
and grows if a part brings more. Other columns (strings, lists) keep the parts' chunks and are joined at
the end, one column at a time. A big file's pieces go in as they come (`add_big`), taken back if a
later piece fails its checks. The table keeps a string column of few values as dictionary codes;
`plain_strings` decodes them for a reader.

>>> import pyarrow as pa
>>> table = Assembler(total_bytes=20)
>>> table.add(pa.table({"x": [1.0, None]}), nbytes=10)
>>> table.add(pa.table({"x": [3.0, 4.0]}), nbytes=10)
>>> table.table().column("x").to_pylist()
[1.0, None, 3.0, 4.0]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ciuic_doctor.rundir.frames.parts import BigFile, Part, _all_null

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np
    import pyarrow

HEADROOM = 1.25  # rows reserved over the bytes' promise: a later part's lines may be shorter


class _Numbers:
    """A fixed-width column (ints, floats, booleans as bytes): values and, once a null is seen, validity."""

    def __init__(self, kind: pyarrow.DataType, capacity: int) -> None:
        import numpy as np
        import pyarrow as pa

        self.kind = kind
        self.boolean = pa.types.is_boolean(kind)
        self.dtype = np.dtype(bool) if self.boolean else np.dtype(kind.to_pandas_dtype())
        self.values = np.empty(capacity, self.dtype)
        self.valid: np.ndarray | None = None  # every row valid until a null arrives
        self.nulls = 0

    def put(self, at: int, chunk: pyarrow.Array) -> None:
        import numpy as np
        import pyarrow.compute as pc

        rows, nulls = len(chunk), chunk.null_count
        if nulls < rows:  # an all-null chunk leaves its pages untouched (and never resident)
            if self.boolean:
                values = pc.fill_null(chunk, False).to_numpy(zero_copy_only=False)
            else:
                data = chunk.buffers()[1]
                values = np.frombuffer(
                    data, self.dtype, count=rows, offset=chunk.offset * self.dtype.itemsize
                )
            self.values[at : at + rows] = values
        if nulls and self.valid is None:
            self.valid = np.empty(len(self.values), bool)
            self.valid[:at] = True
        if self.valid is not None:
            self.valid[at : at + rows] = chunk.is_valid().to_numpy(zero_copy_only=False) if nulls else True
        self.nulls += nulls

    def mark(self) -> int:
        return self.nulls

    def rollback(self, nulls: int | None, rows: int) -> None:
        self.nulls = nulls or 0  # the rows after the mark are written over by the next parts

    def grow(self, capacity: int, rows: int) -> None:
        import numpy as np

        for name in ("values", "valid"):
            old = getattr(self, name)
            if old is not None:
                new = np.empty(capacity, old.dtype)
                new[:rows] = old[:rows]
                setattr(self, name, new)

    def array(self, rows: int) -> pyarrow.Array:
        import numpy as np
        import pyarrow as pa

        if rows and self.nulls == rows:
            return _all_null(self.kind, rows)
        validity = None
        if self.nulls:
            validity = pa.py_buffer(np.packbits(self.valid[:rows], bitorder="little"))
        values = self.values[:rows]
        data = pa.py_buffer(np.packbits(values, bitorder="little") if self.boolean else values)
        return pa.Array.from_buffers(self.kind, rows, [validity, data], self.nulls)


class _Chunks:
    """Any other column (strings, lists, null-typed): the parts' chunks, joined at the end."""

    def __init__(self, kind: pyarrow.DataType) -> None:
        self.kind = kind
        self.chunks: list[pyarrow.Array] = []

    def put(self, at: int, chunk: pyarrow.Array) -> None:
        self.chunks.append(chunk)

    def mark(self) -> None:
        return None

    def rollback(self, mark: None, rows: int) -> None:
        kept, at = [], 0
        for chunk in self.chunks:
            if at >= rows:
                break
            kept.append(chunk if at + len(chunk) <= rows else chunk.slice(0, rows - at))
            at += len(chunk)
        self.chunks = kept

    def grow(self, capacity: int, rows: int) -> None:
        pass

    def array(self, rows: int) -> pyarrow.Array:
        import pyarrow as pa

        chunks, self.chunks = self.chunks, []
        if rows and sum(c.null_count for c in chunks) == rows:
            return _all_null(self.kind, rows)
        if len(chunks) == 1:
            return chunks[0]
        return pa.concat_arrays(chunks) if chunks else pa.nulls(0, self.kind)


class _Strings:
    """A string column of few distinct values (a host, a role): codes (int32) into the values seen, so a
    10,000-rank job's 10 M host names cost 40 MB instead of 116 MB. The table keeps it dictionary-encoded;
    `frames.TableRead.select` gives readers plain strings. Past MAX_VALUES distinct values it becomes
    plain chunks (`_Chunks`) it hands every part to."""

    MAX_VALUES = 1 << 16

    def __init__(self, kind: pyarrow.DataType, capacity: int) -> None:
        import pyarrow as pa

        self.kind = kind
        self.codes = _Numbers(pa.int32(), capacity)
        self.values: dict[str, int] = {}
        self.plain: _Chunks | None = None  # set when the column has too many values to encode

    def put(self, at: int, chunk: pyarrow.Array) -> None:
        import numpy as np
        import pyarrow as pa

        if self.plain is not None:
            self.plain.put(at, chunk)
            return
        encoded = chunk.dictionary_encode()
        local = [self.values.setdefault(v, len(self.values)) for v in encoded.dictionary.to_pylist()]
        if len(self.values) > self.MAX_VALUES:
            self.plain = _Chunks(self.kind)
            if at:
                self.plain.put(0, self._decoded(at))
            self.codes = None
            self.plain.put(at, chunk)
            return
        indices = encoded.indices
        codes = np.zeros(len(chunk), np.int32)
        if local:
            codes = np.asarray(local, np.int32)[indices.fill_null(0).to_numpy()]
        mask = ~indices.is_valid().to_numpy(zero_copy_only=False) if chunk.null_count else None
        self.codes.put(at, pa.array(codes, mask=mask))

    def _decoded(self, rows: int) -> pyarrow.Array:
        import pyarrow as pa

        codes = self.codes.array(rows)
        return pa.DictionaryArray.from_arrays(codes, pa.array(list(self.values), self.kind)).cast(self.kind)

    def mark(self) -> int | None:
        return self.codes.mark() if self.plain is None else None

    def rollback(self, mark: int | None, rows: int) -> None:
        (self.codes if self.plain is None else self.plain).rollback(mark, rows)

    def grow(self, capacity: int, rows: int) -> None:
        if self.plain is None:
            self.codes.grow(capacity, rows)

    def array(self, rows: int) -> pyarrow.Array:
        import pyarrow as pa

        if self.plain is not None:
            return self.plain.array(rows)
        codes = self.codes.array(rows)
        if rows and codes.null_count == rows:
            return _all_null(self.kind, rows)
        return pa.DictionaryArray.from_arrays(codes, pa.array(list(self.values), self.kind))


def _column(kind: pyarrow.DataType, capacity: int) -> _Numbers | _Strings | _Chunks:
    import pyarrow as pa

    if pa.types.is_boolean(kind) or pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return _Numbers(kind, capacity)
    if pa.types.is_string(kind):
        return _Strings(kind, capacity)
    return _Chunks(kind)


class Assembler:
    """Parts of one schema, in order, as one table of one chunk per column (`table()`).

    `total_bytes`: the bytes of every file the parts come from; with each part's `nbytes` it says how
    many rows to reserve (the rows per byte seen so far, times the bytes, with HEADROOM)."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.bytes_seen = 0
        self.rows = 0
        self.capacity = 0
        self.schema: pyarrow.Schema | None = None
        self.columns: dict[str, Any] = {}

    def add(self, part: pyarrow.Table, nbytes: int) -> None:
        """Copy `part`'s columns in (its schema must be the first part's); the part may then be let go."""
        if self.schema is None:
            self.schema = part.schema
        elif not part.schema.equals(self.schema):
            raise ValueError(f"a part's columns differ: {part.schema} vs {self.schema}")
        self.bytes_seen += nbytes
        self._reserve(self.rows + part.num_rows)
        for name, column in zip(part.column_names, part.columns, strict=True):
            at = self.rows
            for chunk in column.chunks:
                self.columns[name].put(at, chunk)
                at += len(chunk)
        self.rows += part.num_rows

    def mark(self) -> tuple[int, int, dict[str, Any]]:
        """Where the table stands now, for `rollback`."""
        return self.rows, self.bytes_seen, {n: c.mark() for n, c in self.columns.items()}

    def rollback(self, mark: tuple[int, int, dict[str, Any]]) -> None:
        """Forget every row added since `mark` (a big file whose later piece failed is read again by row)."""
        self.rows, self.bytes_seen, columns = mark
        for name, column in self.columns.items():
            column.rollback(columns.get(name), self.rows)

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity and self.columns:
            return
        promised = needed * max(self.total_bytes, self.bytes_seen) / max(self.bytes_seen, 1)
        capacity = max(needed, int(promised * HEADROOM) + 1024)
        if not self.columns:
            self.columns = {f.name: _column(f.type, capacity) for f in self.schema}
        else:
            for column in self.columns.values():
                column.grow(capacity, self.rows)
        self.capacity = capacity

    def table(self) -> pyarrow.Table:
        """The table; the assembler is empty afterwards (each column let go as it is built)."""
        import pyarrow as pa

        arrays = {}
        for name in list(self.columns):
            arrays[name] = self.columns.pop(name).array(self.rows)
        return pa.table(arrays)  # not schema=self.schema: that would decode the dictionary columns


def plain_strings(table: pyarrow.Table) -> pyarrow.Table:
    """`table` with its dictionary-encoded columns decoded (the others as they are: no copy)."""
    import pyarrow as pa

    for at, column in enumerate(table.columns):
        if pa.types.is_dictionary(column.type):
            table = table.set_column(at, table.field(at).name, column.cast(column.type.value_type))
    return table


def task_bytes(task: list[Path] | BigFile) -> int:
    """The bytes a task reads (what the rows to reserve are estimated from)."""
    if isinstance(task, BigFile):
        return task.ranges[-1][1] if task.ranges else 0
    if not isinstance(task, list):  # a big file's part (file_parts.PartFile): its JSONL's size
        task = [task.path]
    total = 0
    for path in task:
        with contextlib.suppress(OSError):  # its own read says what is wrong with it
            total += path.stat().st_size
    return total


def add_big(
    big: BigFile,
    results: Iterator[Any],
    table: Assembler,
    by_row: Callable[[Path], Part],
    lines_by_row: Callable[[list[bytes]], Part],
) -> Part:
    """A big file's pieces copied into `table` as they come, judged as the one file they are: when any
    piece failed its checks, what was copied is taken back and the whole file read by row (`by_row`:
    `_read_jsonl`'s rule, what is dropped and counted is the row reader's); a torn last line is read by
    `lines_by_row`. The file's counts (no table: it is in `table`)."""
    start, nulled, failed = table.mark(), {}, False
    share = max(big.ranges[-1][1] // len(big.ranges), 1) if big.ranges else 0
    for _ in big.ranges:
        piece = next(results)  # every piece is taken, even after a failed one: the pool made them all
        if piece is None:
            failed = True
        elif not failed:
            (part, _, more, _), _ = piece
            table.add(part, nbytes=share)
            for column, count in more.items():
                nulled[column] = nulled.get(column, 0) + count
        piece = part = None
    if failed:
        table.rollback(start)
        part, *counts = by_row(big.path)
        table.add(part, nbytes=0)
        return (None, *counts)
    if not big.tail.strip():
        return None, 0, nulled, {}
    part, dropped, more, invalid = lines_by_row([big.tail])  # a torn last line: the row path
    table.add(part, nbytes=len(big.tail))
    for column, count in more.items():
        nulled[column] = nulled.get(column, 0) + count
    return None, dropped, nulled, invalid
