"""The shapes of the hang files, checked before anything reads a field: a file is data from anyone.

A run directory travels (copied between machines, shared on NFS), so a hang file may be a list instead
of an object, hold a string world size, miss keys, nest a thousand levels deep or carry 10^8 ranks.
Each reader turns a file into the shape the hang doctor uses, or into one counted problem: the top
level is checked with `schemas.validate` (the same tool the streams use), stacks are rebuilt frame by
frame, and every number that sizes something is bounded first:

    MAX_WORLD_SIZE  131,072 ranks (the largest jobs run today have ~100 k GPUs)
    MAX_RANK        the same bound, for rank numbers in file names and records
    MAX_THREADS     1,024 threads a stack dump; MAX_FRAMES 512 frames a thread; MAX_STR 4,096 characters

>>> clean_armed({"rank": 0, "world_size": 100000000})
(None, 'world_size: 100000000 is above 131072')
>>> clean_armed({"rank": 0, "world_size": 2, "host": "n0", "pid": 7})[0]["world_size"]
2
"""

from __future__ import annotations

import math
from typing import Any

from ciuic_doctor.rundir.schemas import validate

MAX_WORLD_SIZE = 131_072
MAX_RANK = MAX_WORLD_SIZE
MAX_THREADS = 1024
MAX_FRAMES = 512
MAX_STR = 4096
MAX_PEERS = MAX_WORLD_SIZE


def _shape(kind: str, record: Any) -> str | None:
    return validate(kind, record)


def _text(value: Any) -> str | None:
    return value[:MAX_STR] if isinstance(value, str) else None


def _int(value: Any, bound: int = 2**63) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and -bound < value < bound:
        return value
    return None


def _finite(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        return number if math.isfinite(number) else None
    return None


def clean_threads(threads: Any) -> list[dict[str, Any]]:
    """Stacks as [{thread_id, name, main, frames: [{file, line, function}]}], innermost frame first;
    a thread or frame that is not an object is dropped."""
    if not isinstance(threads, list):
        return []
    out = []
    for thread in threads[:MAX_THREADS]:
        if not isinstance(thread, dict):
            continue
        frames = thread.get("frames")
        out.append(
            {
                "thread_id": _int(thread.get("thread_id")),
                "name": _text(thread.get("name")) or "?",
                "main": thread.get("main") is True,
                "frames": [
                    {
                        "file": _text(f.get("file", f.get("filename"))),
                        "line": _int(f.get("line")),
                        "function": _text(f.get("function", f.get("name"))),
                    }
                    | ({"native": True} if f.get("native") is True else {})
                    for f in (frames[:MAX_FRAMES] if isinstance(frames, list) else [])
                    if isinstance(f, dict)
                ],
            }
        )
    return out


def clean_armed(record: Any) -> tuple[dict[str, Any] | None, str | None]:
    """An armed watchdog's record (rank, world_size, host, pid) or (None, why not)."""
    if reason := _shape("hang.armed", record):
        return None, reason
    world = record.get("world_size")
    if world is not None and not 0 < world <= MAX_WORLD_SIZE:
        return (
            None,
            f"world_size: {world} is above {MAX_WORLD_SIZE}" if world > 0 else "world_size: not positive",
        )
    return {
        "rank": _int(record.get("rank"), MAX_RANK),
        "world_size": world or 0,
        "host": _text(record.get("host")),
        "pid": _int(record.get("pid"), 2**22 + 1),
        "start_ticks": _int(record.get("start_ticks")),
    }, None


def clean_dump(record: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A rank's hang dump with every field the doctor reads of its type, or (None, why not)."""
    if reason := _shape("hang.dump", record):
        return None, reason
    from ciuic_doctor.rundir.hang.flight_recorder import clean_status

    peers = []
    for peer in (record.get("peers") or [])[:MAX_PEERS]:
        if _shape("hang.peer", peer) is None and _int(peer.get("rank"), MAX_RANK) is not None:
            state, threads = _text(peer.get("state")), clean_threads(peer.get("threads"))
            peers.append(
                {"rank": peer["rank"], "pid": _int(peer.get("pid")), "state": state, "threads": threads}
            )
    return {
        "rank": _int(record.get("rank"), MAX_RANK),
        "host": _text(record.get("host")),
        "reason": _text(record.get("reason")),
        "error": _text(record.get("error")),
        "t": _finite(record.get("t")) or 0.0,
        "resumed_t": _finite(record.get("resumed_t")),
        "pg_status": clean_status(record.get("pg_status")),
        "fr_file": record.get("fr_file"),
        "threads": clean_threads(record.get("threads")),
        "peers": peers,
    }, None


def clean_last(record: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The last Python collective a rank issued (watch's hang_last record), or (None, why not)."""
    if reason := _shape("hang.last", record):
        return None, reason
    return {
        "op": _text(record.get("op")),
        "file": _text(record.get("file")),
        "line": _int(record.get("line")),
        "function": _text(record.get("function")),
        "input_sizes": _sizes(record.get("input_sizes")),
        "input_dtypes": _texts(record.get("input_dtypes")),
        "prev_sizes": _sizes(record.get("prev_sizes")),
    }, None


def clean_pyspy(ranks: Any) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """hang.pyspy.json's ranks: {rank: {pid, state, watched, threads, fr_file, pg_status, moving}}."""
    from ciuic_doctor.rundir.hang.flight_recorder import clean_status

    if not isinstance(ranks, dict):
        return {}, ["hang.pyspy.json: ranks is not an object"]
    out: dict[int, dict[str, Any]] = {}
    problems: list[str] = []
    for key, entry in list(ranks.items())[:MAX_WORLD_SIZE]:
        rank = int(key) if isinstance(key, str) and key.isdigit() and len(key) <= 6 else None
        reason = _shape("hang.pyspy", entry)
        if rank is None or rank >= MAX_RANK or reason:
            problems.append(f"hang.pyspy.json: rank {str(key)[:20]!r} skipped ({reason or 'not a rank'})")
            continue
        out[rank] = {
            "pid": _int(entry.get("pid")),
            "state": _text(entry.get("state")),
            "watched": entry.get("watched") is True,
            "threads": clean_threads(entry.get("threads")),
            "error": _text(entry.get("error")),
            "fr_file": entry.get("fr_file"),
            "pg_status": clean_status(entry.get("pg_status")),
            "moving": entry.get("moving") is True,
        }
    return out, problems


def _sizes(value: Any) -> list[list[int]] | None:
    from ciuic_doctor.rundir.hang.flight_recorder import _sizes as sizes

    return sizes(value)


def _texts(value: Any) -> list[str] | None:
    from ciuic_doctor.rundir.hang.flight_recorder import _strings

    return _strings(value)
