"""What the hang watchdog polls besides steps: Flight Recorder's counters, and the main thread itself.

Is a rank that made no optimizer step for a while still working? Two looks at its main thread.

An evaluation pass, a checkpoint save or a long data preparation makes no optimizer step for minutes; it
is not a hang. As `hang --pid` does with py-spy's two looks, the watchdog looks at the main thread twice
(one poll apart): its Python stack (the frames outside the standard library and watch) and its CPU time.
It is *moving* when the stack changed, or when it burnt CPU while not inside a collective (a rank that
spins in a collective's wait burns CPU too). A moving rank is stalled only when a peer waits on it: a
peer's unresumed hang dump newer than this rank's last progress.

A look costs a few microseconds (one frame walk and one /proc read); torch is imported only to read
Flight Recorder.

    >>> a = Look(t=0.0, stack=(("train.py", 10),), cpu_s=1.0, in_collective=False)
    >>> moved(a, Look(t=0.5, stack=(("train.py", 10),), cpu_s=1.3, in_collective=False))
    True
    >>> moved(a, Look(t=0.5, stack=(("train.py", 10),), cpu_s=1.0, in_collective=False))
    False
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ciuic_doctor.rundir.safe_io import read_json

BUSY_FRACTION = 0.05  # CPU seconds per wall second that count as working (a thread blocked in a wait: ~0)
_STDLIB = os.path.dirname(os.__file__)
_OWN = (str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2] / "ciuic_doctor"))
MAX_FRAMES = 64
PEER_DUMP_MAX_BYTES = 64 << 20


@dataclass(kw_only=True)
class Look:
    t: float
    stack: tuple[tuple[str, int], ...]  # (file, line) of the main thread's frames outside stdlib and watch
    cpu_s: float | None  # the main thread's CPU time (None: /proc unreadable)
    in_collective: bool


def look(t: float, *, in_collective: bool) -> Look:
    """The main thread now."""
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident)  # type: ignore[arg-type]
    stack = []
    while frame is not None and len(stack) < MAX_FRAMES:
        name = frame.f_code.co_filename
        if "distributed_c10d.py" in name:
            in_collective = True
        if not name.startswith((_STDLIB, *_OWN)) and not name.startswith("<frozen"):
            stack.append((name, frame.f_lineno))
        frame = frame.f_back
    return Look(t=t, stack=tuple(stack), cpu_s=_thread_cpu_s(main.native_id), in_collective=in_collective)


def moved(before: Look, after: Look) -> bool:
    """Its stack changed, or it used CPU outside any collective, between the two looks."""
    if before.stack != after.stack:
        return True
    if before.cpu_s is None or after.cpu_s is None or after.in_collective or before.in_collective:
        return False
    wall = max(after.t - before.t, 1e-3)
    return (after.cpu_s - before.cpu_s) / wall >= BUSY_FRACTION


def _thread_cpu_s(native_id: int | None) -> float | None:
    """utime + stime of one thread of this process (/proc/self/task/<tid>/stat fields 14 and 15)."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as fh:
            fields = fh.read(4096).rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def still_moving(watchdog: Any, status: dict[str, Any] | None) -> bool | None:
    """After hang-after seconds without progress: None while undecided (the first look) or when the main
    thread is working and no peer waits on it (its progress clock restarts); else whether it was moving
    (a stall: True only when a peer waits on a rank that keeps working, e.g. an endless rank-0 eval)."""
    pending = any(
        int(s.get("last_enqueued_collective", -1)) > int(s.get("last_completed_collective", -1))
        for s in (status or {}).values()
    )
    now = look(time.monotonic(), in_collective=pending)
    before, watchdog._look = watchdog._look, now
    if before is None or now.t - before.t > 4 * watchdog.config.poll_s:
        return None
    if not moved(before, now):
        return False
    since_t = time.time() - (time.monotonic() - watchdog._progress_t)
    if peer_waits(watchdog.run.path, watchdog.rank, since_t) is None:
        watchdog._progress_t, watchdog._look = time.monotonic(), None
        return None
    return True


def keep_earlier(run_path: Path, rank: int, k: int) -> None:
    """A later dump never overwrites an earlier one: the earlier files move aside to
    hang.rank<R>.earlier<k>.json / .stacks.txt (each dump's Flight Recorder file has its own name and
    stays, so the fr_file it names is still right); `hang RUN` judges the latest (hang.rank<R>.json)."""
    for old, new in (
        (f"hang.rank{rank}.json", f"hang.rank{rank}.earlier{k}.json"),
        (f"hang.rank{rank}.stacks.txt", f"hang.rank{rank}.earlier{k}.stacks.txt"),
    ):
        with contextlib.suppress(OSError):
            os.replace(run_path / old, run_path / new)


def release_files(run_path: Path, rank: int) -> None:
    """A launcher that stepped aside for the ranks it started takes back what it armed in rank `rank`'s
    name (its empty faulthandler and last-collective files, its armed record), before they start."""
    for name in (f"hang.rank{rank}.fatal.txt", f"hang.rank{rank}.last.json"):
        with contextlib.suppress(OSError):
            path = run_path / name
            if not path.is_symlink() and path.stat().st_size == 0:
                path.unlink()
    armed = run_path / f"hang.rank{rank}.armed.json"
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if not armed.is_symlink() and json.loads(armed.read_text()).get("pid") == os.getpid():
            armed.unlink()


def rearm_as_group_rank(watchdog: Any) -> None:
    """At the first step the process group exists: a rank mp.spawn started armed with its spawn index
    and no WORLD_SIZE; its armed record gets the group's rank and world size."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # on the training thread: never the user's training
        _rearm(watchdog, dist.get_rank(), dist.get_world_size())


def _rearm(watchdog: Any, rank: int, world: int) -> None:
    if rank == watchdog.rank and world == int(os.environ.get("WORLD_SIZE", "1")):
        return
    if rank != watchdog.rank:
        with contextlib.suppress(OSError):
            (watchdog.run.path / f"hang.rank{watchdog.rank}.armed.json").unlink()
        watchdog.rank = rank
    watchdog._write_armed(world_size=world)


def peer_waits(run_path: Path, rank: int, since_t: float) -> int | None:
    """A peer rank that dumped for lack of progress after `since_t` (unix time) and has not resumed: it
    waits, possibly on this rank. Its rank, or None."""
    for path in sorted(run_path.glob("hang.rank*.json")):
        parts = path.name.split(".")
        if len(parts) != 3 or parts[1] == f"rank{rank}":
            continue
        dump = read_json(path, max_bytes=PEER_DUMP_MAX_BYTES)
        if not isinstance(dump, dict) or dump.get("resumed_t"):
            continue
        if dump.get("reason") in ("no-progress", "collective-error") and (dump.get("t") or 0) > since_t:
            return int(parts[1].removeprefix("rank")) if parts[1].removeprefix("rank").isdigit() else None
    return None


def fr_status() -> dict[str, Any] | None:
    """Flight Recorder's per-group counters ({pg: {last_enqueued_collective, last_completed_collective}})."""
    import pickle

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch._C._distributed_c10d import _dump_fr_trace

    dump = pickle.loads(_dump_fr_trace(includeCollectives=False, includeStackTraces=False, onlyActive=False))
    return dump.get("pg_status") or {}


def fr_entries(*, only_active: bool = False) -> list[dict[str, Any]]:
    """Flight Recorder's collective entries, oldest first, without stacks (torch's own bytes, in this
    process: not a file anyone else wrote)."""
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    raw = _dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=only_active)
    return pickle.loads(raw).get("entries") or []


def _pg_timeout_s() -> float | None:
    """The default group's timeout, from Flight Recorder's own entries (each carries `timeout_ms`)."""
    timeouts = [e["timeout_ms"] for e in fr_entries() if e.get("timeout_ms")]
    return timeouts[-1] / 1000 if timeouts else None
