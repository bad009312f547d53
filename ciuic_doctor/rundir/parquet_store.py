"""The Parquet copy of a JSONL stream file that `ciuic-doctor compact` writes beside it (same stem), and
how to get every record back out of it exactly.

Lossless by construction and checked: every record's keys, in their order, are kept in a dictionary-
encoded `_keys` column (so a missing key and an explicit null stay different), and a field is stored
as a typed column (bool, int64, float64, string) only when every value it has in the file is of that
one JSON type; anything else (nested objects, lists, a field that is sometimes a number and sometimes
"nan", integers beyond 64 bits) is stored as JSON text in a column named in the `ciuic.json_columns`
metadata. `compact_file` reads the written file back and compares it with the row reader's records
before it keeps it. Lines the row reader skips (a torn last line) are not records; their count is kept
in `ciuic.skipped_lines`; records off their stream's schema (dropped and counted by every reader) are
not kept either, and their count per reason is kept in `ciuic.invalid_reasons`.

Readers (`frames.read_stream`) use the Parquet file only while the JSONL file has the size and mtime
recorded in `ciuic.source`, so a stream that grew after compaction is read from its JSONL again.

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> jsonl = folder / "notes.jsonl"  # a stream without a schema: any JSON object is a record
>>> _ = jsonl.write_text('{"a":1,"b":null}\\n{"b":"x","c":[1,2]}\\n')
>>> result = compact_file(jsonl)
>>> parquet_records(result.parquet) == [{"a": 1, "b": None}, {"b": "x", "c": [1, 2]}]
True
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEYS_COLUMN = "_keys"
REST_COLUMN = "_rest"  # per record, as one JSON object, the keys past MAX_COLUMNS
# Columns a copy holds: the most frequent keys. Every distinct key a column made the copy cost
# columns x records (2,000 records of 50 keys each, all distinct: 100,000 columns, past 60 s); the
# streams' own schemas have under 60 fields.
MAX_COLUMNS = 512
KEY_SEPARATOR = "\x1f"  # ASCII unit separator: cannot appear unescaped in a JSON key we write
SOURCE_KEY = b"ciuic.source"
JSON_COLUMNS_KEY = b"ciuic.json_columns"
SKIPPED_KEY = b"ciuic.skipped_lines"
INVALID_KEY = b"ciuic.invalid_reasons"  # off-schema records left out, {reason: count}
INT64_MAX = 2**63 - 1


@dataclass(kw_only=True)
class CompactResult:
    jsonl: Path
    parquet: Path
    records: int
    skipped_lines: int
    jsonl_bytes: int
    parquet_bytes: int


def parquet_path(jsonl: Path) -> Path:
    return jsonl.with_suffix(".parquet")


def source_stamp(jsonl: Path) -> bytes:
    stat = jsonl.lstat()
    return f"{stat.st_size}:{stat.st_mtime_ns}".encode()


def fresh_parquet(jsonl: Path) -> Path | None:
    """The Parquet copy of `jsonl` when it was made from the file as it is now (size and mtime match)."""
    import pyarrow.parquet as pq

    from ciuic_doctor.rundir.safe_io import is_regular

    target = parquet_path(jsonl)
    if not is_regular(target):  # a symlink planted as the copy is not read through
        return None
    try:
        metadata = pq.read_metadata(target).metadata or {}
        return target if metadata.get(SOURCE_KEY) == source_stamp(jsonl) else None
    except (OSError, ValueError):  # a half-written or foreign file: read the JSONL instead
        return None


def skipped_lines(path: Path) -> int:
    """How many lines of the JSONL file were not records when it was compacted."""
    import pyarrow.parquet as pq

    return int((pq.read_metadata(path).metadata or {}).get(SKIPPED_KEY, b"0"))


def invalid_reasons(path: Path) -> dict[str, int]:
    """The off-schema records `compact` left out of a Parquet copy, per reason (none for older copies)."""
    import pyarrow.parquet as pq

    raw = (pq.read_metadata(path).metadata or {}).get(INVALID_KEY, b"{}")
    try:
        reasons = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(reasons, dict):
        return {}
    return {str(k): v for k, v in reasons.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if -INT64_MAX - 1 <= value <= INT64_MAX else "json"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return "json"


def _table(records: list[dict[str, Any]]):  # -> (pyarrow.Table, json column names)
    import pyarrow as pa

    counts: dict[str, int] = {}
    for record in records:
        for key in record:
            counts[key] = counts.get(key, 0) + 1
    if any(KEY_SEPARATOR in name for name in counts):  # it would split one key into two on the way back
        raise ValueError("a record has a key holding U+001F: cannot compact it losslessly")
    names = dict.fromkeys(counts)
    rest: set[str] = set()
    if len(names) > MAX_COLUMNS:
        kept = set(sorted(names, key=lambda n: -counts[n])[:MAX_COLUMNS])
        rest = {n for n in names if n not in kept}
        names = {n: None for n in names if n in kept}
        if REST_COLUMN in counts:
            raise ValueError(f"a record has a field named {REST_COLUMN!r}: cannot compact it losslessly")
    kinds: dict[str, set[str]] = {name: set() for name in names}
    for record in records:
        for key, value in record.items():
            if value is not None and key in kinds:
                kinds[key].add(_kind(value))
    arrow = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "string": pa.string()}
    columns: dict[str, Any] = {
        KEYS_COLUMN: pa.array([KEY_SEPARATOR.join(r) for r in records], pa.string()).dictionary_encode()
    }
    as_json = []
    for name in names:
        found = kinds[name]
        values = [r.get(name) for r in records]
        if len(found) == 1 and (kind := next(iter(found))) in arrow:
            columns[name] = pa.array(values, arrow[kind])
        else:
            as_json.append(name)
            columns[name] = pa.array(
                [None if v is None else json.dumps(v, separators=(",", ":")) for v in values], pa.string()
            )
    if rest:
        extra = [{k: v for k, v in r.items() if k in rest} for r in records]
        columns[REST_COLUMN] = pa.array([json.dumps(e, separators=(",", ":")) if e else None for e in extra])
    if KEYS_COLUMN in names:
        raise ValueError(f"a record has a field named {KEYS_COLUMN!r}: cannot compact it losslessly")
    return pa.table(columns), as_json


def parquet_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a compacted file, each with its own keys in their order (what read_jsonl gave)."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    json_columns = set(json.loads((parquet.metadata.metadata or {}).get(JSON_COLUMNS_KEY, b"[]")))
    table = parquet.read()
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    keys = columns.pop(KEYS_COLUMN)
    rest = columns.pop(REST_COLUMN, None)
    out = []
    for i, joined in enumerate(keys):
        record = {}
        extra = json.loads(rest[i]) if rest is not None and rest[i] is not None else {}
        for key in joined.split(KEY_SEPARATOR) if joined else []:
            if key in extra:
                record[key] = extra[key]
                continue
            value = columns[key][i]
            record[key] = json.loads(value) if key in json_columns and value is not None else value
        out.append(record)
    return out


def compact_file(jsonl: Path) -> CompactResult:
    """Write `jsonl`'s Parquet copy (beside it, atomically), read it back, keep it only when every record
    comes back equal; ValueError (and no file) otherwise."""
    import pyarrow.parquet as pq

    from ciuic_doctor.rundir.safe_io import atomic_file
    from ciuic_doctor.rundir.store import read_jsonl

    stamp = source_stamp(jsonl)
    read = read_jsonl(jsonl)
    table, as_json = _table(read.records)
    metadata = {
        SOURCE_KEY: stamp,
        JSON_COLUMNS_KEY: json.dumps(as_json).encode(),
        SKIPPED_KEY: str(read.skipped_lines).encode(),
        INVALID_KEY: json.dumps(read.invalid_reasons).encode(),
    }
    table = table.replace_schema_metadata(metadata)
    target = parquet_path(jsonl)
    # the temp file: O_EXCL | O_NOFOLLOW, random name, removed on any failure or Ctrl-C (safe_io)
    with atomic_file(target) as (fh, tmp):
        pq.write_table(table, fh, compression="zstd")
        fh.flush()
        back = parquet_records(tmp)
        # compared as JSON text: a NaN read from a NaN literal is != itself, and key order counts too
        if json.dumps(back) != json.dumps(read.records) or source_stamp(jsonl) != stamp:
            raise ValueError(f"{jsonl.name}: the Parquet copy does not give back the same records")
    return CompactResult(
        jsonl=jsonl,
        parquet=target,
        records=len(read.records),
        skipped_lines=read.skipped_lines,
        jsonl_bytes=jsonl.stat().st_size,
        parquet_bytes=target.stat().st_size,
    )
