"""Where a rank's threads and its peers are: the stacks and process states a hang dump records.

Standard library only (hang_pid uses `process_state` without torch).

    >>> process_state(2**22 + 12345)
    'gone'
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from ciuic_doctor.rundir.store import RunDir

_OWN = (
    str(Path(__file__).resolve().parents[1]),  # probes/, installed as ciuic_doctor.probes
    str(Path(__file__).resolve().parents[2] / "ciuic_doctor"),
    "logging",
)


def thread_stacks() -> list[dict[str, Any]]:
    """Every Python thread's stack, innermost frame first (the order Flight Recorder's frames use).

    The dump's own frames (this module, the logging call that carried a collective's error) are left
    off the top of the dumping thread's stack: the frame below them is where that thread really is.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    stacks = []
    for ident, frame in sys._current_frames().items():
        frames = [
            {"file": f.filename, "line": f.lineno, "function": f.name}
            for f in reversed(traceback.extract_stack(frame))
        ]
        while len(frames) > 1 and any(own in frames[0]["file"] for own in _OWN):
            frames.pop(0)
        stacks.append(
            {"thread_id": ident, "name": names.get(ident, "?"), "main": ident == main, "frames": frames}
        )
    stacks.sort(key=lambda s: not s["main"])
    return stacks


def format_stacks(stacks: list[dict[str, Any]]) -> str:
    """Stacks as faulthandler prints them: most recent call first."""
    lines = []
    for stack in stacks:
        lines.append(f"Thread {stack['thread_id']} ({stack['name']}{', main' if stack.get('main') else ''}):")
        lines += [f'  File "{f["file"]}", line {f["line"]} in {f["function"]}' for f in stack["frames"]]
        lines.append("")
    return "\n".join(lines)


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks (/proc/PID/stat field 22): tells a reused PID apart."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


_STATES = {"R": "running", "S": "sleeping", "D": "disk-wait", "T": "stopped", "t": "stopped", "Z": "exited"}


def process_state(pid: int, start_ticks: int | None = None) -> str:
    """running / sleeping / disk-wait / stopped (SIGSTOP, a debugger) / exited (a zombie) / gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    fields = stat.rsplit(")", 1)[1].split()
    if start_ticks is not None and fields[19] != str(start_ticks):
        return "gone"  # the PID was reused
    return _STATES.get(fields[0], fields[0])


def peer_states(run: RunDir, rank: int, host: str) -> list[dict[str, Any]]:
    """The other armed ranks on this host, as the kernel sees them now; a stopped one gets py-spy's stack
    (it cannot dump its own)."""
    from ciuic_doctor.rundir import safe_io
    from ciuic_doctor.rundir.hang.files import py_spy_stacks
    from ciuic_doctor.rundir.hang.shapes import clean_armed

    peers = []
    for path in sorted(run.path.glob("hang.rank*.armed.json")):
        try:
            armed, _ = clean_armed(json.loads(safe_io.read_bytes(path, max_bytes=safe_io.MAX_JSON_BYTES)))
        except (OSError, ValueError, RecursionError):
            continue
        if armed is None or armed["rank"] is None or armed["pid"] is None:
            continue
        if armed.get("rank") == rank or armed.get("host") != host:
            continue
        state = process_state(armed["pid"], armed.get("start_ticks"))
        peer: dict[str, Any] = {"rank": armed["rank"], "pid": armed["pid"], "state": state}
        if state == "stopped":
            peer["threads"], peer["py_spy_error"] = py_spy_stacks(armed["pid"])
        peers.append(peer)
    return peers
