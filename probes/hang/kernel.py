"""What the kernel says a rank's threads wait on, for `hang --pid` when `py-spy --native` cannot look.

`py-spy dump --native` shows DDP's all_reduce inside `loss.backward()` as C++ frames (c10d::Reducer::...),
but it pauses the process through ptrace and unwinds its native stack: refused without ptrace permission,
unavailable where py-spy's unwinder is not built, and off when CIUIC_PYSPY_NATIVE=0. Without it, the
kernel still tells, for every thread of the rank (any user may read these of their own processes):

    /proc/<pid>/task/<tid>/comm    the thread's name: gloo_tcp_loop, pt_gloo_runloop, pt_nccl_watchdg ...
    /proc/<pid>/task/<tid>/stat    its state: R running, S sleeping, D disk wait
    /proc/<pid>/task/<tid>/wchan   the kernel function it sleeps in: futex_do_wait, do_epoll_wait ...
    /proc/<pid>/task/<tid>/stack   its kernel stack, where readable (root)

A rank whose Python stack stopped inside torch's autograd backward, whose main thread sleeps on a futex
while no thread runs and a collective backend's threads (gloo, NCCL) exist, waits in native code for
another thread: under DDP that is the gradient all_reduce the reducer launches at the end of backward. It
is then given one frame saying so, marked as inferred and naming what the kernel said, so the verdict
names the wait without C++ frames. Anything less certain gets a frame naming the wait only (no op).
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

MAX_THREADS = 512  # threads read per rank (a rank with OpenMP pools has ~100)
_BACKEND_THREADS = ("gloo", "pt_gloo", "pt_nccl", "nccl", "ncclproxy")  # comm names (15 chars at most)
_BACKWARD = ("backward", "_engine_run_backward", "run_backward")


def native_enabled() -> bool:
    """False when CIUIC_PYSPY_NATIVE is 0/no/false/off: `hang --pid` then never runs py-spy --native."""
    return os.environ.get("CIUIC_PYSPY_NATIVE", "1").strip().lower() not in ("0", "no", "false", "off")


def _read(path: Path, limit: int = 4096) -> str | None:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return f.read(limit).decode(errors="replace")
    return None


def kernel_threads(pid: int) -> list[dict[str, Any]]:
    """Every thread of `pid`: {tid, name, state, wchan, stack (kernel functions, where readable)}."""
    out: list[dict[str, Any]] = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit())
    except OSError:
        return out
    for tid in tids[:MAX_THREADS]:
        base = Path(f"/proc/{pid}/task/{tid}")
        stat = _read(base / "stat")
        if stat is None:
            continue  # ended while we looked
        fields = stat.rpartition(")")[2].split()
        thread: dict[str, Any] = {
            "tid": tid,
            "name": (_read(base / "comm") or "?").strip(),
            "state": fields[0] if fields else "?",
            "wchan": (_read(base / "wchan") or "").strip() or None,
        }
        if stack := _read(base / "stack", 16384):  # "[<0>] futex_do_wait+0x46/0x90" per line
            thread["stack"] = [line.split("] ", 1)[-1].split("+", 1)[0] for line in stack.splitlines()][:16]
        out.append(thread)
    return out


def waits_in_native(
    pid: int, threads: list[dict[str, Any]] | None, why_no_native: str
) -> dict[str, Any] | None:
    """One frame (innermost) for the main thread of `threads` (py-spy's Python stacks) saying where the
    kernel has it wait, and the kernel's look itself; None when the main thread is not asleep there."""
    kernel = kernel_threads(pid)
    main = next((t for t in kernel if t["tid"] == pid), None)
    if main is None or main["state"] not in ("S", "D") or not main.get("wchan"):
        return None
    python = next((t.get("frames", []) for t in threads or [] if t.get("main")), [])
    in_backward = any(
        "/torch/" in str(f.get("file")) and str(f.get("function")) in _BACKWARD for f in python[:8]
    )
    backend = sorted({t["name"] for t in kernel if t["name"].lower().startswith(_BACKEND_THREADS)})
    running = [t["name"] for t in kernel if t["state"] == "R"]
    said = f"main thread asleep in {main['wchan']}"
    if main.get("stack"):
        said += f" ({' < '.join(main['stack'][:3])})"
    if backend:
        said += f"; {', '.join(backend)} threads " + ", ".join(
            sorted({f"in {t['wchan']}" for t in kernel if t["name"] in backend and t.get("wchan")})
        )
    said += f"; {len(running)} thread(s) running"
    if in_backward and "futex" in main["wchan"] and backend and not running:
        function = (
            "c10d::Reducer:: gradient all_reduce, inferred: backward waits on another thread with no thread "
            f"running and a collective backend present (kernel: {said}; no C++ frames: {why_no_native})"
        )
    else:
        function = f"native code, waiting in the kernel (kernel: {said}; no C++ frames: {why_no_native})"
    return {
        "frame": {"file": f"/proc/{pid}/wchan", "line": None, "function": function, "native": True},
        "kernel": kernel,
    }
