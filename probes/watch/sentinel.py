"""The sentinel: a small process that records how a watched process ended when that process could not.

A fatal signal (SIGSEGV from a C extension, SIGABRT, SIGBUS) or SIGKILL ends a process before any of its
Python code runs, so `ciuic-doctor watch`'s own record would stay `running`. The launching watch process
starts this sentinel (`python -m ciuic_doctor.probes.watch.sentinel RUN PID RANK`) in a session of its own
(Ctrl-C and a kill of the job's process group do not reach it; it has nothing to stop). It waits for PID
to end (a pidfd: woken at once, no polling; /proc polled every 0.2 s where pidfds are missing), and then,
only if meta.json's probes.watch is still this PID's `running` record, writes the end
(ciuic_doctor.rundir.watch_end): the signal faulthandler named in hang.rank<R>.fatal.txt, else the wait status
the kernel holds while the process is a zombie, else `ended_unrecorded`. It imports no torch (about
40 ms and 15 MiB) and ends right after the watched process.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ciuic_doctor.rundir import safe_io, watch_end
from ciuic_doctor.rundir.store import RunDir


def start(run_path: Path, rank: int) -> subprocess.Popen | None:
    """Start the sentinel for this process; None (and one line on stderr) when it cannot be started."""
    try:
        return subprocess.Popen(
            [sys.executable, "-m", __name__, str(run_path), str(os.getpid()), str(rank)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # the job's Ctrl-C and killpg are not its end
            close_fds=True,
        )
    except OSError as exc:
        print(f"ciuic-doctor watch: no sentinel for a fatal signal ({exc})", file=sys.stderr)
        return None


def wait_for_end(pid: int, start: int | None) -> None:
    """Return once `pid` (started at `start` ticks) has ended."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while not poller.poll():
                pass
        finally:
            os.close(fd)
        return
    while start is not None and watch_end.process_start(pid) == start:
        if watch_end.zombie_exit_status(pid) is not None:
            return
        time.sleep(0.2)


def how_it_ended(run: RunDir, pid: int, rank: int) -> dict[str, Any]:
    """The fields to record for `pid`'s end, from the best witness left."""
    status = watch_end.zombie_exit_status(pid)  # first: its parent may reap it any moment
    fatal = None
    with contextlib.suppress(Exception):
        text = safe_io.read_text(run.path / f"hang.rank{rank}.fatal.txt", max_bytes=4096)
        fatal = watch_end.signal_from_fatal(text)
    if fatal is not None:
        return {**watch_end.status_for_signal(signal.Signals[fatal]), "seen_by": "faulthandler"}
    if status is not None and os.WIFSIGNALED(status):
        return {**watch_end.status_for_signal(os.WTERMSIG(status)), "seen_by": "kernel (zombie)"}
    if status is not None and os.WIFEXITED(status):
        return {"status": "failed", "exit_code": os.WEXITSTATUS(status), "seen_by": "kernel (zombie)"}
    return {
        "status": "ended_unrecorded",
        "reason": f"process {pid} ended without recording how (SIGKILL, the OOM killer, or a fatal "
        "signal the script's own faulthandler took)",
    }


def main(argv: list[str]) -> int:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # it ends on its own, right after PID
        signal.signal(signum, signal.SIG_IGN)
    run_path, pid, rank = Path(argv[0]), int(argv[1]), int(argv[2])
    start = watch_end.process_start(pid)
    wait_for_end(pid, start)
    run = RunDir(run_path)
    with contextlib.suppress(Exception):  # the run was moved or removed: nothing to record
        record = (run.read_meta().get("probes") or {}).get("watch") or {}
        if record.get("status") != "running" or record.get("pid") != pid:
            return 0  # watch recorded its own end (or another run owns the record now)
        fields = how_it_ended(run, pid, rank)
        kept = {k: v for k, v in record.items() if k not in ("updated", "status", "reason")}
        run.record_probe("watch", **{**kept, **fields})
        said = watch_end.describe(fields)
        print(f"ciuic-doctor watch: the script {said}; recorded in {run.path / 'meta.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
