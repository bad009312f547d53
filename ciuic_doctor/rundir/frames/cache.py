"""The streams' tables kept between readers of one process (`frames.read_stream`): the key, the stamp
that says a kept table still matches its files, letting a stream go (`forget`), and the snapshot a
report reads (`one_snapshot`). Split from frames/__init__.py, which reads the streams.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ciuic_doctor.rundir.frames.tableread import TableRead
    from ciuic_doctor.rundir.store import RunDir

CACHED_STREAMS = 2  # steps and memwatch, the two streams that grow with ranks × time
_CACHE: dict[tuple[str, str], tuple[tuple, TableRead]] = {}
_CACHE_LOCK = threading.Lock()  # two streams may be read at once (`frames.beside`)


def keep(key: tuple[str, str], stamp: tuple, read: TableRead) -> None:
    """Cache `read` as `key`'s table (the oldest let go past CACHED_STREAMS); checked in this snapshot."""
    with _CACHE_LOCK:
        _CACHE.pop(key, None)
        while len(_CACHE) >= CACHED_STREAMS:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (stamp, read)
    checked(key)


def _stamp(files: list[Path]) -> tuple[tuple, list[list[Any]]]:
    """(what the cache compares, the files as the columnar copy's manifest lists them): one lstat a file.
    A Parquet copy `compact` made (or removed) beside a file changes the stamp too; whether one exists is
    looked up in one listing of the folder, not a stat a file (100,000 files: seconds, every caller)."""
    folders = {os.path.dirname(f) or "." for f in files}
    names: set[str] = set()
    for folder in folders:
        with contextlib.suppress(OSError):
            names.update(os.listdir(folder))
    stamp, sources = [], []
    for f in files:  # strings, not pathlib: its name and suffix cost seconds at 100,000 files
        path = os.fspath(f)
        info = os.lstat(path)
        folder, _, name = path.rpartition("/")
        sources.append([name, info.st_size, info.st_mtime_ns])
        stem, dot, _ = name.rpartition(".")
        copy = f"{stem if dot else name}.parquet"  # parquet_store.parquet_path
        copied = b""
        copy_path = os.path.join(folder, copy)
        if copy in names and os.path.isfile(copy_path):  # compact's copy: read only when it is fresh
            copy_info = os.lstat(copy_path)
            copied = f"{copy_info.st_size}:{copy_info.st_mtime_ns}".encode()
        stamp.append((path, info.st_size, info.st_mtime_ns, copied))
    return tuple(stamp), sources


@dataclass
class _Snapshot:
    """How deep in `one_snapshot` this process is, and the cache keys read or checked against their
    files since the outermost one began (a table cached before it may be stale: it is checked first)."""

    depth: int = 0
    checked: set[tuple[str, str]] = field(default_factory=set)


_SNAPSHOT = _Snapshot()


@contextlib.contextmanager
def one_snapshot() -> Iterator[None]:
    """Within it, a stream's table read (or checked against its files) once is taken as it is, without
    listing and stat'ing its files again: the analyses and the page of one report judge one snapshot of
    the run (a live run's files that grew mid-report were read anew by the later readers, which then
    judged more steps than the earlier ones), and at 100,000 ranks each look cost 1.8 s (a listing and
    100,000 lstat calls)."""
    _SNAPSHOT.depth += 1
    try:
        yield
    finally:
        _SNAPSHOT.depth -= 1
        if not _SNAPSHOT.depth:
            _SNAPSHOT.checked.clear()


def pinned(key: tuple[str, str], columns: Sequence[str]) -> TableRead | None:
    """The cached table of `key` when this snapshot has checked it and it has `columns`; else None."""
    held = _CACHE.get(key) if key in _SNAPSHOT.checked else None
    return held[1] if held is not None and set(columns) <= set(held[1].table.column_names) else None


def held_rows(run: RunDir, stream: str) -> int:
    """Rows of `run`'s cached table of `stream` (0 when none is held): how big a job is, without a look
    at its files."""
    held = _CACHE.get((str(run.path.resolve()), stream))
    return held[1].table.num_rows if held is not None else 0


def checked(key: tuple[str, str]) -> None:
    """`key`'s cached table matches its files as they are now: inside a snapshot, it is taken as it is."""
    if _SNAPSHOT.depth:
        _SNAPSHOT.checked.add(key)


def clear_cache() -> None:
    """Forget the cached tables (tests that rewrite a stream within one second of reading it)."""
    _CACHE.clear()


def forget(run: RunDir, stream: str) -> None:
    """Let `run`'s cached table of `stream` go (no reader still to come needs it: `analysis.run_all`);
    its memory is freed once the callers' selections of it are gone too."""
    if _CACHE.pop((str(run.path.resolve()), stream), None) is not None:
        import pyarrow as pa

        # back to the system: Arrow's pool keeps freed pages, which numpy's temporaries cannot reuse
        pa.default_memory_pool().release_unused()


def give_back_memory() -> None:
    """Hand freed memory back to the OS: pages kept by Arrow's pool and by glibc's heaps (a thread's
    arena too). Kept, they sit under what is built next: a copy's writing left ~140 MB under the first
    report's tables, and the two streams read side by side (`frames.beside`) left ~200 MB under the
    memory checks' forked workers, which start from this process's pages (10,000 ranks x 1,000 steps)."""
    import ctypes

    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):  # glibc's; another C library has no malloc_trim
        ctypes.CDLL(None).malloc_trim(0)
