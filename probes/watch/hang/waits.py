"""Which collective a rank is waiting in, and since when, left on disk for the live view (part of the
hang watchdog).

A rank blocked in a collective cannot say which peer holds it up; the live view (`top`, `export`) can,
if it knows who is waiting: the peer that is *not* in the collective, and has made no step since the
others began to wait, is the one they wait for. The watchdog already polls Flight Recorder's per-group
counters every 0.5 s; a group whose last enqueued collective is newer than its last completed one has a
collective in flight. Once one has been in flight for RECORD_AFTER_S, this writes

    RUN/hang.rank<R>.wait.json   {"schema": 1, "rank", "pid", "t_since", "op", "seq", "group"}

(`t_since`: unix time the collective was enqueued, from Flight Recorder's entry; `op` without the
backend's prefix, e.g. "all_reduce"), and removes it when the collective completes. A collective of a
healthy job takes milliseconds: the file is written only for the waits worth naming, one write each.

    >>> op_name("gloo:all_reduce")
    'all_reduce'
    >>> op_name("nccl:_allgather_base")
    '_allgather_base'
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

RECORD_AFTER_S = 1.0  # well past any healthy collective of a small job, and 2 polls: seen twice


def op_name(profiling_name: str) -> str:
    return profiling_name.split(":", 1)[-1]


def pending(status: dict[str, Any] | None) -> tuple[str, int] | None:
    """(group, sequence number) of a collective in flight, or None."""
    for group, counters in (status or {}).items():
        enqueued = int(counters.get("last_enqueued_collective", -1))
        if enqueued > int(counters.get("last_completed_collective", -1)):
            return str(group), enqueued
    return None


def _entry(seq: int) -> dict[str, Any]:
    """Flight Recorder's entry of collective `seq` (its name and enqueue time), {} when not found."""
    from ciuic_doctor.probes.watch.hang.poll import fr_entries

    entries = fr_entries(only_active=True)
    for entry in reversed(entries):
        if entry.get("collective_seq_id") == seq:
            return entry
    return entries[-1] if entries else {}


class WaitRecord:
    """Kept by the watchdog thread: `update(status)` at every poll."""

    def __init__(self, run: Any, rank: int) -> None:
        self.run = run
        self.rank = rank
        self._seen: tuple[str, int] | None = None
        self._seen_t = 0.0
        self._written = False

    @property
    def name(self) -> str:
        return f"hang.rank{self.rank}.wait.json"

    def update(self, status: dict[str, Any] | None) -> None:
        now = pending(status)
        if now != self._seen:
            self.clear()
            self._seen, self._seen_t = now, time.monotonic()
        if now is None or self._written or time.monotonic() - self._seen_t < RECORD_AFTER_S:
            return
        entry = _entry(now[1])
        created = entry.get("time_created_ns")
        since = created / 1e9 if isinstance(created, int) else time.time() - (time.monotonic() - self._seen_t)
        self.run.write_json(
            self.name,
            {
                "schema": 1,
                "rank": self.rank,
                "pid": os.getpid(),
                "t_since": since,
                "op": op_name(str(entry.get("profiling_name") or "collective")),
                "seq": now[1],
                "group": now[0],
            },
        )
        self._written = True

    def clear(self) -> None:
        if self._written:
            self._written = False
            with contextlib.suppress(OSError):
                Path(self.run.path, self.name).unlink()
