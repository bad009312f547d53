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

Bad content never raises, it is counted: a line that is not a JSON object (a torn last line after a crash)
is dropped, and a value of the wrong type for its column (a string where a number belongs) becomes null —
`TableRead.dropped_lines`, `TableRead.nulled_values`. Non-finite numbers, which the store writes as the
strings "nan" / "inf", are read back as floats. pyarrow rejects a whole file on the first such line, so
that file alone is read again line by line with `json.loads` (the rare path).

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> lines = '{"rank":0,"step":1,"loss":"nan"}\\n{"rank":0,"step":2,"loss":2.5}\\n{"ra'
>>> _ = (folder / "steps.rank0.jsonl").write_text(lines)
>>> read = read_table([folder / "steps.rank0.jsonl"], ("rank", "step", "loss"))
>>> read.table.column("step").to_pylist(), read.dropped_lines
([1, 2], 1)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas
    import pyarrow

    from ciuic_doctor.store import RunDir

# Column types of the fields the analyses read; a column not named here is read as float64.
COLUMN_TYPES = {
    "schema": "int64",
    "t": "float64",
    "host": "string",
    "rank": "int64",
    "step": "int64",
    "pid": "int64",
    "role": "string",
    "kind": "string",
    "skipped": "bool",
    "desync_ranks": "list<int64>",
    "grad_norm_source": "string",
}
MAX_THREADS = 8


@dataclass(kw_only=True)
class TableRead:
    """What a columnar read found: the table, and what it had to drop (lines) or null (values)."""

    table: pyarrow.Table
    files: list[Path] = field(default_factory=list)
    dropped_lines: int = 0
    nulled_values: dict[str, int] = field(default_factory=dict)
    parquet_files: int = 0

    def frame(self) -> pandas.DataFrame:
        """The table as pandas (numpy-backed columns; null ints become float NaN)."""
        return self.table.to_pandas()

    @property
    def rows(self) -> int:
        return self.table.num_rows

    def select(self, columns: Sequence[str]) -> TableRead:
        """The same read, `columns` only (counts kept: they describe the files, not the columns)."""
        return TableRead(
            table=self.table.select(list(dict.fromkeys(columns))),
            files=self.files,
            dropped_lines=self.dropped_lines,
            nulled_values=self.nulled_values,
            parquet_files=self.parquet_files,
        )


def arrow_type(column: str) -> pyarrow.DataType:
    import pyarrow as pa

    name = COLUMN_TYPES.get(column, "float64")
    if name == "list<int64>":
        return pa.list_(pa.int64())
    return {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string(), "bool": pa.bool_()}[name]


def schema_for(columns: Sequence[str]) -> pyarrow.Schema:
    import pyarrow as pa

    return pa.schema([(c, arrow_type(c)) for c in columns])


# ---- one file ------------------------------------------------------------------------------------
def _coerce(value: Any, kind: str) -> tuple[Any, bool]:
    """(value as the column's type, whether it had to be nulled). None stays None and is not counted."""
    if value is None:
        return None, False
    if kind == "float64":
        if isinstance(value, bool):
            return None, True
        if isinstance(value, int | float):
            return float(value), False
        if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
            return float(value), False
        return None, True
    if kind == "int64":
        if isinstance(value, bool):
            return None, True
        if isinstance(value, int):
            return value, False
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value), False
        return None, True
    if kind == "string":
        return (value, False) if isinstance(value, str) else (None, True)
    if kind == "bool":
        return (value, False) if isinstance(value, bool) else (None, True)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value, False
    return None, True


def _read_lines(path: Path, columns: Sequence[str]) -> tuple[pyarrow.Table, int, dict[str, int]]:
    """The slow, forgiving path: json.loads per line, each value coerced to its column's type."""
    import pyarrow as pa

    kinds = [COLUMN_TYPES.get(c, "float64") for c in columns]
    values: list[list[Any]] = [[] for _ in columns]
    dropped, nulled = 0, dict.fromkeys(columns, 0)
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                dropped += 1
                continue
            if not isinstance(record, dict):
                dropped += 1
                continue
            for column, kind, out in zip(columns, kinds, values, strict=True):
                value, bad = _coerce(record.get(column), kind)
                out.append(value)
                nulled[column] += bad
    schema = schema_for(columns)
    table = pa.table(
        {c: pa.array(v, type=schema.field(c).type) for c, v in zip(columns, values, strict=True)}
    )
    return table, dropped, {c: n for c, n in nulled.items() if n}


def _read_jsonl(path: Path, columns: Sequence[str]) -> tuple[pyarrow.Table, int, dict[str, int]]:
    import pyarrow as pa
    import pyarrow.json as pj

    parse = pj.ParseOptions(explicit_schema=schema_for(columns), unexpected_field_behavior="ignore")
    try:
        # one thread per file: the files themselves are read in parallel (read_files)
        table = pj.read_json(path, read_options=pj.ReadOptions(use_threads=False), parse_options=parse)
    except pa.ArrowInvalid:  # a torn line, a "nan" string, a wrong type: this file takes the slow path
        return _read_lines(path, columns)
    return table.select(list(columns)), 0, {}


def _read_parquet(path: Path, columns: Sequence[str]) -> pyarrow.Table:
    """Only `columns` of a compacted file; columns `compact` stored as JSON text are decoded and coerced."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ciuic_doctor.parquet_store import JSON_COLUMNS_KEY

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


def _read_one(path: Path, columns: Sequence[str]) -> tuple[pyarrow.Table, int, dict[str, int], bool]:
    from ciuic_doctor.parquet_store import fresh_parquet, skipped_lines

    parquet = fresh_parquet(path) if path.suffix == ".jsonl" else None
    if parquet is not None:  # the torn lines compact skipped still count as dropped
        return _read_parquet(parquet, columns), skipped_lines(parquet), {}, True
    return (*_read_jsonl(path, columns), False)


def read_table(files: Iterable[Path], columns: Sequence[str]) -> TableRead:
    """`columns` of every record in `files` (file order, then line order), files read in parallel."""
    import pyarrow as pa

    files = list(files)
    columns = list(dict.fromkeys(columns))
    threads = max(1, min(MAX_THREADS, len(files), (os.cpu_count() or 1) * 2))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        parts = list(pool.map(lambda f: _read_one(f, columns), files))
    if not parts:
        return TableRead(table=schema_for(columns).empty_table())
    result = TableRead(
        table=pa.concat_tables([p[0] for p in parts]),
        files=files,
        dropped_lines=sum(p[1] for p in parts),
        parquet_files=sum(p[3] for p in parts),
    )
    for _, _, nulled, _ in parts:
        for column, count in nulled.items():
            result.nulled_values[column] = result.nulled_values.get(column, 0) + count
    result.table = _bounded(result.table, result.nulled_values)
    return result


def _bounded(table: pyarrow.Table, nulled: dict[str, int]) -> pyarrow.Table:
    """Finite floats beyond ±schemas.NUMBER_BOUND nulled and counted, as the row reader refuses them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from ciuic_doctor.schemas import NUMBER_BOUND

    for i, column_field in enumerate(table.schema):
        if not pa.types.is_floating(column_field.type):
            continue
        column = table.column(i)
        bad = pc.and_(pc.is_finite(column), pc.greater(pc.abs(column), NUMBER_BOUND))
        count = pc.sum(bad).as_py() or 0
        if count:
            table = table.set_column(
                i, column_field, pc.if_else(bad, pa.scalar(None, column_field.type), column)
            )
            nulled[column_field.name] = nulled.get(column_field.name, 0) + count
    return table


# What the analyses and the report read of a stream, all together: the first reader reads them all, the
# others take their columns from the cached table (one parse of a 610 MiB run instead of four).
STREAM_COLUMNS = {
    "steps": (
        *("rank", "step", "t", "host", "step_time_s", "pre_backward_s", "weights_checksum", "desync_ranks"),
        *("loss", "lr", "grad_norm", "loss_scale", "skipped", "clip_max_norm", "rss", "uss"),
        *("mem_allocated", "mem_reserved", "mem_active_peak", "alloc_retries", "inactive_split_bytes"),
    )
}
_CACHE: dict[tuple[str, str], tuple[tuple, TableRead]] = {}


def _stamp(files: list[Path]) -> tuple:
    from ciuic_doctor.parquet_store import parquet_path, source_stamp

    def copy_stamp(jsonl: Path) -> bytes:
        # a Parquet copy made (or removed) since the last read changes the stamp too; stat only, its
        # metadata is read once per file by the read itself (4,096 files × every caller otherwise)
        target = parquet_path(jsonl)
        return source_stamp(target) if target.is_file() else b""

    return tuple((str(f), source_stamp(f), copy_stamp(f)) for f in files)


def clear_cache() -> None:
    """Forget the cached table (tests that rewrite a stream within one second of reading it)."""
    _CACHE.clear()


def read_stream(run: RunDir, stream: str, columns: Sequence[str]) -> TableRead:
    """`columns` of every record of `stream` (shared file first, then per-rank files in rank order).

    The stream's table is kept while its files are unchanged (same sizes and mtimes), so the analyses and
    the report of one `ciuic-doctor report` parse it once; only the last stream read is kept."""
    files = run.stream_files(stream)
    key, stamp = (str(run.path.resolve()), stream), _stamp(files)
    cached = _CACHE.get(key)
    if cached is not None and cached[0] == stamp and set(columns) <= set(cached[1].table.column_names):
        return cached[1].select(columns)
    wanted = [*columns, *STREAM_COLUMNS.get(stream, ())]
    read = read_table(files, wanted)
    _CACHE.clear()
    _CACHE[key] = (stamp, read)
    return read.select(columns)
