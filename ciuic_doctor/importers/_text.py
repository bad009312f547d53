"""Shared pieces of the text-log importers: chunked reading and the prefixes launchers add to lines.

Logs are read in chunks cut at line ends, so a 1,000,000-line log is parsed a few MB at a time with
whole-text regexes (one C-level pass per chunk) and memory stays flat. Bytes that are not UTF-8 become
U+FFFD; a carriage return (tqdm progress bars) ends a line like a newline does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

CHUNK_BYTES = 8 << 20

# Line prefixes added by launchers, not by the framework: torchrun `--tee`/`--local-ranks-filter`
# (`[rank3]: `, `[default3]:`), srun --label / pdsh (`3: `).
RANK_PREFIX = r"(?:\[(?:rank|default|RANK)\s*(\d+)\]:[ \t]?|(\d{1,5}):[ \t]+)?"
TIMESTAMP = r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?"


def read_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """Decoded text of `path` in pieces that end at a line end (the last piece may not)."""
    rest = b""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk_bytes)
            if not block:
                break
            data = rest + block
            cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
            if cut < 0:
                rest = data
                continue
            rest = data[cut + 1 :]
            yield _decode(data[: cut + 1])
    if rest:
        yield _decode(rest + b"\n")


def _decode(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def count_lines(text: str) -> int:
    """Lines in a chunk, empty ones left out (they belong to nothing but are not worth counting)."""
    return text.count("\n") - text.count("\n\n") + (0 if text.endswith("\n") else 1)


def rank_of(bracketed: str, labelled: str) -> float:
    """The rank from a RANK_PREFIX match's two groups, NaN when there was no prefix."""
    value = bracketed or labelled
    return float(value) if value else float("nan")


def unix_seconds(stamps):  # pandas Series of str -> float seconds (NaN where absent)
    """`2024-05-01 12:00:00(.123|,123)` -> unix seconds; naive stamps are read as UTC."""
    import pandas as pd

    first = stamps.dropna()
    plain = len(first) and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", str(first.iloc[0]))
    if plain:  # the common case, parsed by pandas' fast path for an exact format
        parsed = pd.to_datetime(stamps, format="%Y-%m-%d %H:%M:%S", errors="coerce", utc=True)
    else:
        text = stamps.astype("str").str.replace(",", ".", regex=False)
        parsed = pd.to_datetime(text, format="ISO8601", errors="coerce", utc=True)
    seconds = (parsed - pd.Timestamp(0, tz="UTC")).dt.total_seconds()
    return seconds.astype("float64")
