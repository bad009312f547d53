"""How a watched run ended, as meta.json says it or as its readers can still tell (no torch, no analysis).

`ciuic-doctor watch` records `probes.watch.status` itself for every end Python sees (finished, failed,
interrupted, exited, exec, killed by SIGTERM). A fatal signal (SIGSEGV in a C extension, SIGABRT from a
failed CUDA assert, SIGBUS) or SIGKILL ends the process before any Python code runs, so watch also starts a
sentinel process (probes/watch/sentinel.py) that waits for the watched PID to end and, if meta.json still
says `running`, records how it ended: the signal faulthandler named in hang.rank<R>.fatal.txt, else the
exit status the kernel still holds for a zombie, else `ended_unrecorded`. Readers on the same host apply
the last rule themselves when even the sentinel is gone (the OOM killer takes the whole cgroup): a
`running` record whose PID (with its start time, so a reused PID is not mistaken for it) no longer exists.

    >>> signal_from_fatal("Fatal Python error: Segmentation fault\\n\\nThread 0x1 ...")
    'SIGSEGV'
    >>> describe({"status": "crashed", "signal": "SIGSEGV", "exit_code": 139})
    'crashed (SIGSEGV, exit 139)'
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

# faulthandler's first line ("Fatal Python error: <what>") for each signal it handles (CPython's
# Modules/faulthandler.c, faulthandler_handlers).
_FATAL = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
ABNORMAL = ("failed", "interrupted", "killed", "crashed", "ended_unrecorded", "refused")


def process_fields() -> dict[str, Any]:
    """pid, host and start time of this process, for a `running` record whose end this process records
    (`watch`, `job`): a reader on this host can then tell when it is gone without a record."""
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "pid_start": process_start(pid)}


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and ')'), [] if gone:
    field N of proc(5) is at index N - 3."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read(4096).decode(errors="replace")
    except OSError:
        return []
    return text.rpartition(")")[2].split()


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if gone."""
    fields = _stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def zombie_exit_status(pid: int) -> int | None:
    """The wait status (as waitpid gives it) of a process that ended but is not reaped yet (field 52 of
    /proc/<pid>/stat, Linux >= 3.5); None once its parent reaped it or when unreadable."""
    fields = _stat_fields(pid)
    if len(fields) < 50 or fields[0] != "Z" or not fields[49].isdigit():
        return None
    return int(fields[49])


def signal_from_fatal(text: str) -> str | None:
    """The signal named by faulthandler's first line, if the text is faulthandler's."""
    first = text.lstrip().split("\n", 1)[0]
    if not first.startswith("Fatal Python error: "):
        return None
    return _FATAL.get(first.removeprefix("Fatal Python error: ").strip())


def status_for_signal(signum: int) -> dict[str, Any]:
    """The fields recorded for a death by `signum` (128 + N, as a shell reports it)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    status = {signal.SIGINT: "interrupted", signal.SIGTERM: "killed", signal.SIGKILL: "killed"}.get(
        signum, "crashed"
    )
    return {"status": status, "signal": name, "exit_code": 128 + signum}


def watch_record(meta: dict[str, Any]) -> dict[str, Any] | None:
    """meta.json's probes.watch, with a `running` record whose process is gone (same host) read as
    `ended_unrecorded`; None for a run watch did not record."""
    probes = meta.get("probes") if isinstance(meta.get("probes"), dict) else {}
    record = probes.get("watch")
    if not isinstance(record, dict):
        return None
    if record.get("status") == "running" and _gone(record):
        record = {
            **record,
            "status": "ended_unrecorded",
            "reason": f"process {record['pid']} on {record['host']} is gone and recorded no end "
            "(SIGKILL, the OOM killer, or a fatal signal with no sentinel left to see it)",
        }
    return record


def _gone(record: dict[str, Any]) -> bool:
    pid, host, start = record.get("pid"), record.get("host"), record.get("pid_start")
    if not isinstance(pid, int) or pid <= 0 or host != socket.gethostname():
        return False  # another host's process: nothing here can tell
    now = process_start(pid)
    if now is None:
        return True
    return isinstance(start, int) and now != start  # the PID was reused by another process


def describe(record: dict[str, Any]) -> str:
    """One phrase: `crashed (SIGSEGV, exit 139)`, `finished (exit 0)`, `ended_unrecorded`."""
    status = str(record.get("status") or "unknown")
    parts = [str(record["signal"])] if record.get("signal") else []
    if isinstance(record.get("exit_code"), int):
        parts.append(f"exit {record['exit_code']}")
    return status + (f" ({', '.join(parts)})" if parts else "")
