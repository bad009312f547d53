"""The hang dumps of a run directory, and Python stacks of processes that cannot dump their own (py-spy).

    RUN/hang.rank<R>.armed.json   written when the watchdog starts: rank, host, pid (who should have dumped)
    RUN/hang.rank<R>.json         a dump (probes/watch/hang.py): reason, stacks, Flight Recorder status, peers
    RUN/hang.rank<R>.fatal.txt    faulthandler's stacks after a fatal signal (empty when there was none)
    RUN/hang.fr/rank<R>           Flight Recorder's own pickle, read with torch's loader (`read_dump`)
    RUN/hang.pyspy.json           `ciuic-doctor hang --pid`'s py-spy stacks of every rank it found

Standard library only at import (the CLI imports this for `hang --pid`); torch is imported only to read
Flight Recorder files.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ciuic_doctor.frames import last_per_rank
from ciuic_doctor.store import RunDir

_RANK = re.compile(r"^hang\.rank(\d+)\.(json|armed\.json|last\.json|fatal\.txt)$")
_FAULT_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FAULT_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
PY_SPY_TIMEOUT_S = 30


@dataclass(kw_only=True)
class HangFiles:
    """Everything a run holds about a hang, keyed by global rank."""

    armed: dict[int, dict[str, Any]] = field(default_factory=dict)
    dumps: dict[int, dict[str, Any]] = field(default_factory=dict)
    fatal: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # threads, from faulthandler
    last: dict[int, dict[str, Any]] = field(default_factory=dict)  # the last Python collective issued
    fr_entries: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    py_spy: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> {pid, state, threads}
    last_steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # files that could not be read, one line each

    @property
    def any(self) -> bool:
        return bool(self.dumps or self.fatal or self.py_spy)


def has_hang_dumps(path: Path) -> bool:
    """True when a run directory holds a hang dump (not just an armed watchdog)."""
    for p in path.glob("hang.rank*"):
        match = _RANK.match(p.name)
        if match and (match.group(2) == "json" or (match.group(2) == "fatal.txt" and p.stat().st_size > 0)):
            return True
    return (path / "hang.pyspy.json").is_file()


def load(run: RunDir) -> HangFiles:
    """Read every hang file of `run`; a file that does not parse is named in `problems`, never raised."""
    files = HangFiles()
    for path in sorted(run.path.glob("hang.rank*")):
        match = _RANK.match(path.name)
        if not match:
            continue
        rank, kind = int(match.group(1)), match.group(2)
        try:
            text = path.read_text()
        except OSError as exc:
            files.problems.append(f"{path.name}: {exc.strerror}")
            continue
        if kind == "fatal.txt":
            if text.strip():
                files.fatal[rank] = parse_faulthandler(text)
            continue
        if kind == "last.json" and not text.strip():
            continue
        try:
            data = json.loads(text)
        except ValueError:
            files.problems.append(f"{path.name}: not valid JSON (a dump cut short?)")
            continue
        {"armed.json": files.armed, "last.json": files.last, "json": files.dumps}[kind][rank] = data
    for rank, dump in files.dumps.items():
        if dump.get("fr_file"):
            entries = read_flight_recorder(run.path / dump["fr_file"], files.problems)
            if entries is not None:
                files.fr_entries[rank] = entries
    spy = run.path / "hang.pyspy.json"
    if spy.is_file():
        try:
            files.py_spy = {int(k): v for k, v in json.loads(spy.read_text()).get("ranks", {}).items()}
        except (ValueError, AttributeError):
            files.problems.append("hang.pyspy.json: not valid JSON")
    for rank, seen in files.py_spy.items():  # the job's own Flight Recorder dumps (NCCL's, on a timeout)
        if seen.get("fr_file") and rank not in files.fr_entries:
            entries = read_flight_recorder(run.path / seen["fr_file"], files.problems)
            if entries is not None:
                files.fr_entries[rank] = entries
    if run.has_stream("steps"):  # each rank's last step record, column-wise (not 2 M dicts)
        files.last_steps = last_per_rank(run, "steps", ("t", "host"))
    return files


def read_flight_recorder(path: Path, problems: list[str]) -> list[dict[str, Any]] | None:
    """One rank's Flight Recorder entries, through torch's own loader (the format torchfrtrace reads)."""
    try:
        from torch.distributed.flight_recorder.components.loader import read_dump
    except ImportError:
        problems.append(f"{path.name}: torch's Flight Recorder loader is not installed; entries not read")
        return None
    try:
        return list(read_dump("rank", str(path))["entries"])
    except Exception as exc:  # a torn or foreign pickle: say so, keep the rest
        problems.append(f"{path.parent.name}/{path.name}: unreadable Flight Recorder dump ({exc})")
        return None


def fr_status_of(path: Path) -> dict[str, Any] | None:
    """A Flight Recorder dump's per-group counters (plain Python types: no torch needed to read them)."""
    import pickle

    try:
        return pickle.loads(path.read_bytes()).get("pg_status")
    except Exception:  # a torn or foreign file: the entries reader names it
        return None


def parse_faulthandler(text: str) -> list[dict[str, Any]]:
    """faulthandler's text (most recent call first) as threads of {file, line, function} frames."""
    threads: list[dict[str, Any]] = []
    for line in text.splitlines():
        if head := _FAULT_THREAD.match(line):
            threads.append(
                {
                    "thread_id": int(head.group(2), 16),
                    "main": False,
                    "current": head.group(1) != "Thread",
                    "frames": [],
                }
            )
        elif (frame := _FAULT_FRAME.match(line)) and threads:
            threads[-1]["frames"].append(
                {"file": frame.group(1), "line": int(frame.group(2)), "function": frame.group(3)}
            )
    # faulthandler does not name the main thread: it is the one not started by threading, listed last
    own = [t for t in threads if t["frames"] and not t["frames"][-1]["file"].endswith("threading.py")]
    if own:
        own[-1]["main"] = True
    threads.sort(key=lambda t: not t["main"])
    return threads


def py_spy_binary() -> str | None:
    """py-spy next to this interpreter (a venv) or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def py_spy_stacks(pid: int) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Every Python thread of `pid`, innermost frame first, or (None, why not).

    --nonblocking: py-spy reads the process's memory without pausing it (a stopped rank stays stopped,
    a running one is not slowed). Reading another process's memory needs ptrace permission.
    """
    binary = py_spy_binary()
    if binary is None:
        return None, "py-spy is not installed (pip install 'ciuic-doctor[hang]')"
    command = [binary, "dump", "--pid", str(pid), "--json", "--nonblocking", "--full-filenames"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump --pid {pid} gave no answer in {PY_SPY_TIMEOUT_S} s"
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or ["no output"])[0]
        if "ermission" in done.stderr or "ptrace" in done.stderr.lower():
            return None, (
                f"py-spy was refused access to PID {pid} ({error}): it needs ptrace permission "
                "(run as the job's user with kernel.yama.ptrace_scope=0, or as root / with CAP_SYS_PTRACE)"
            )
        return None, f"py-spy dump --pid {pid} failed: {error}"
    try:
        raw = json.loads(done.stdout)
    except ValueError:
        return None, f"py-spy dump --pid {pid}: output is not JSON"
    threads = [
        {
            "thread_id": t.get("thread_id"),
            "name": t.get("thread_name") or "?",
            "main": t.get("thread_name") == "MainThread",
            "frames": [
                {"file": f.get("filename"), "line": f.get("line"), "function": f.get("name")}
                for f in t.get("frames", [])
            ],
        }
        for t in raw
    ]
    threads.sort(key=lambda t: not t["main"])
    return threads, None
