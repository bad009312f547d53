"""Where a stream's columnar copy lives and what its manifest says (the layout is described for other
engines in this folder's README.md).

    RUN/columnar/<stream>/manifest.json
    RUN/columnar/<stream>/rank_block=<k>/part-0.parquet      ranks 1,024 k … 1,024 k + 1,023
    RUN/columnar/<stream>/rank_block=__HIVE_DEFAULT_PARTITION__/part-0.parquet   records without a rank

The manifest is the copy's only authority: the source files it was made from (name, size, mtime in ns),
the columns and their arrow types, each part's rows, and what the JSONL reader dropped or nulled on the
way (the counts a report states in its `records_readable` finding must not change with the copy).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT_NAME = "columnar"
MANIFEST = "manifest.json"
FORMAT = 1
RANKS_PER_PART = 1024  # a part is 1,024 ranks: the block the analyses work in (memory.blocks)
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"  # Hive's (and pyarrow's, DuckDB's) name for a null key
ROW_COLUMN = "_row"  # the record's place in the stream, stored only when parts are not in stream order
MAX_MANIFEST_BYTES = 64 * 2**20  # 100,000 sources at ~60 bytes each is 6 MB


@dataclass(kw_only=True)
class Counts:
    """What the JSONL reader left out or nulled, as `frames.TableRead` carries it."""

    dropped_lines: int = 0
    nulled_values: dict[str, int] = field(default_factory=dict)
    invalid_records: int = 0
    invalid_reasons: dict[str, int] = field(default_factory=dict)


@dataclass(kw_only=True)
class PartInfo:
    path: str  # relative to the stream's folder
    rank_block: int | None
    rows: int


@dataclass(kw_only=True)
class Manifest:
    stream: str
    sources: list[list[Any]]  # [name, size, mtime_ns] of every JSONL file, in read order
    columns: dict[str, str]  # name -> arrow type, as str(pyarrow type)
    rows: int
    ordered: bool  # the parts, in order, are the stream's rows in order (no _row column)
    parts: list[PartInfo]
    counts: Counts
    copy_id: str = field(default_factory=lambda: secrets.token_hex(8))
    format: int = FORMAT

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


def stream_dir(run_path: Path, stream: str) -> Path:
    return Path(run_path) / ROOT_NAME / stream


def part_name(rank_block: int | None) -> str:
    key = NULL_PARTITION if rank_block is None else str(rank_block)
    return f"rank_block={key}/part-0.parquet"


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _counts(raw: Any) -> dict[str, int] | None:
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and _int(v) and v >= 0 for k, v in raw.items()
    ):
        return None
    return dict(raw)


def parse_manifest(raw: Any, stream: str) -> Manifest | None:
    """The manifest when every field has its type and the parts add up; None for anything else (an old
    format, a hand-edited or foreign file): the report then reads the JSONL, as without a copy."""
    try:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("stream") != stream:
            return None
        counts_raw = raw["counts"]
        nulled, reasons = _counts(counts_raw["nulled_values"]), _counts(counts_raw["invalid_reasons"])
        dropped, invalid = counts_raw["dropped_lines"], counts_raw["invalid_records"]
        if nulled is None or reasons is None or not (_int(dropped) and _int(invalid)):
            return None
        sources = raw["sources"]
        if not isinstance(sources, list) or not all(
            isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and _int(s[1]) and _int(s[2])
            for s in sources
        ):
            return None
        columns = raw["columns"]
        if not isinstance(columns, dict) or not all(isinstance(v, str) for v in columns.values()):
            return None
        parts = []
        for part in raw["parts"]:
            block, rows, path = part["rank_block"], part["rows"], part["path"]
            if not (block is None or _int(block)) or not _int(rows) or rows < 0 or path != part_name(block):
                return None
            parts.append(PartInfo(path=path, rank_block=block, rows=rows))
        if not _int(raw["rows"]) or sum(p.rows for p in parts) != raw["rows"]:
            return None
        if not isinstance(raw["ordered"], bool) or not isinstance(raw["copy_id"], str):
            return None
        return Manifest(
            stream=stream,
            sources=sources,
            columns=columns,
            rows=raw["rows"],
            ordered=raw["ordered"],
            parts=parts,
            counts=Counts(
                dropped_lines=dropped, nulled_values=nulled, invalid_records=invalid, invalid_reasons=reasons
            ),
            copy_id=raw["copy_id"],
        )
    except (KeyError, TypeError):
        return None


def read_manifest(run_path: Path, stream: str) -> Manifest | None:
    from ciuic_doctor.rundir import safe_io

    path = stream_dir(run_path, stream) / MANIFEST
    return parse_manifest(safe_io.read_json(path, max_bytes=MAX_MANIFEST_BYTES, root=Path(run_path)), stream)
