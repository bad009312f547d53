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

from ciuic_doctor.rundir import safe_io
from ciuic_doctor.rundir.frames import last_per_rank
from ciuic_doctor.rundir.hang import flight_recorder as fr_dump
from ciuic_doctor.rundir.hang.shapes import MAX_RANK, clean_armed, clean_dump, clean_last, clean_pyspy
from ciuic_doctor.rundir.store import RunDir

_RANK = re.compile(r"^hang\.rank(\d{1,9})\.(json|armed\.json|last\.json|fatal\.txt)$")
_FAULT_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FAULT_FRAME = re.compile(r'^\s+File "(.*)", line (\d{1,9}) in (.*)$')
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
    """True when a run directory holds a hang dump (not just an armed watchdog); only regular files
    count (a FIFO or a symlink named like a dump is not one)."""
    for p in path.glob("hang.rank*"):
        match = _RANK.match(p.name)
        if not match or not safe_io.is_regular(p):
            continue
        if match.group(2) == "json" or (match.group(2) == "fatal.txt" and p.lstat().st_size > 0):
            return True
    return safe_io.is_regular(path / "hang.pyspy.json")


def _read(run: RunDir, name: str, problems: list[str], *, max_bytes: int) -> str | None:
    """A hang file's text, or None with one line in `problems` (symlink, FIFO, device, too big)."""
    try:
        return safe_io.read_text(run.path / name, max_bytes=max_bytes, root=run.path)
    except OSError as exc:
        problems.append(f"{name}: skipped ({getattr(exc, 'why', None) or exc.strerror or exc})")
        return None


def _json(text: str, name: str, problems: list[str]) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        problems.append(f"{name}: not valid JSON (a dump cut short?)")
        return None


_CLEAN = {"armed.json": clean_armed, "last.json": clean_last, "json": clean_dump}


def load(run: RunDir) -> HangFiles:
    """Read every hang file of `run`; a file that does not parse, does not fit its shape
    (`hang.shapes`) or is not a regular file inside the run is named in `problems`, never raised."""
    files = HangFiles()
    for path in sorted(run.path.glob("hang.rank*")):
        match = _RANK.match(path.name)
        if not match:
            continue
        rank, kind = int(match.group(1)), match.group(2)
        if rank >= MAX_RANK:
            files.problems.append(f"{path.name}: skipped (rank above {MAX_RANK})")
            continue
        cap = safe_io.MAX_TEXT_BYTES if kind == "fatal.txt" else safe_io.MAX_JSON_BYTES
        text = _read(run, path.name, files.problems, max_bytes=cap)
        if text is None:
            continue
        if kind == "fatal.txt":
            if text.strip():
                files.fatal[rank] = parse_faulthandler(text)
            continue
        if kind == "last.json" and not text.strip():
            continue
        data = _json(text, path.name, files.problems)
        if data is None:
            continue
        cleaned, reason = _CLEAN[kind](data)
        if cleaned is None:
            files.problems.append(f"{path.name}: skipped ({reason})")
            continue
        {"armed.json": files.armed, "last.json": files.last, "json": files.dumps}[kind][rank] = cleaned
    for rank, dump in files.dumps.items():
        if dump.get("fr_file") is not None:
            _add_flight_recorder(run, rank, dump["fr_file"], files)
    if (text := _spy_text(run, files.problems)) is not None:
        data = _json(text, "hang.pyspy.json", files.problems)
        if isinstance(data, dict):
            files.py_spy, problems = clean_pyspy(data.get("ranks", {}))
            files.problems += problems
        elif data is not None:
            files.problems.append("hang.pyspy.json: skipped (not a JSON object)")
    for rank, seen in files.py_spy.items():  # the job's own Flight Recorder dumps (NCCL's, on a timeout)
        if seen.get("fr_file") is not None and rank not in files.fr_entries:
            _add_flight_recorder(run, rank, seen["fr_file"], files)
    if run.has_stream("steps"):  # each rank's last step record, column-wise (not 2 M dicts)
        files.last_steps = last_per_rank(run, "steps", ("t", "host"))
    return files


def _spy_text(run: RunDir, problems: list[str]) -> str | None:
    spy = run.path / "hang.pyspy.json"
    if not (spy.exists() or spy.is_symlink()):
        return None
    return _read(run, spy.name, problems, max_bytes=safe_io.MAX_JSON_BYTES)


def _add_flight_recorder(run: RunDir, rank: int, name: Any, files: HangFiles) -> None:
    """Rank `rank`'s Flight Recorder entries from `name` (a path the dump gives): only a file inside the
    run, reached without a symlink, read as data (hang.flight_recorder)."""
    path = safe_io.confined(run.path, name)
    if path is None:
        files.problems.append(
            f"rank {rank}: Flight Recorder file {str(name)[:80]!r} refused (outside the run)"
        )
        return
    entries = read_flight_recorder(path, files.problems, root=run.path)
    if entries is not None:
        files.fr_entries[rank] = entries


def read_flight_recorder(
    path: Path, problems: list[str], *, root: Path | None = None
) -> list[dict[str, Any]] | None:
    """One rank's Flight Recorder entries (the format torchfrtrace reads), unpickled as data only."""
    try:
        return fr_dump.read(path, root=root)["entries"]
    except (OSError, ValueError) as exc:  # a torn, foreign or hostile file: say so, keep the rest
        problems.append(f"{path.parent.name}/{path.name}: unreadable Flight Recorder dump ({exc})")
        return None


def fr_status_of(path: Path, *, root: Path | None = None) -> dict[str, Any] | None:
    """A Flight Recorder dump's per-group counters, read as data only (no torch needed)."""
    try:
        return fr_dump.read(path, root=root)["pg_status"]
    except (OSError, ValueError):  # a torn or foreign file: the entries reader names it
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


def py_spy_stacks(pid: int, *, native: bool = False) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Every Python thread of `pid`, innermost frame first, or (None, why not).

    --nonblocking: py-spy reads the process's memory without pausing it (a stopped rank stays stopped,
    a running one is not slowed). Reading another process's memory needs ptrace permission.
    `native`: C/C++ frames too (`--native`, which pauses the process for the look, ~10 ms): where the
    Python stack ends in torch's C++ (DDP's all_reduce inside backward shows only there); each such
    frame is marked `native`.
    """
    binary = py_spy_binary()
    if binary is None:
        return None, "py-spy is not installed (pip install 'ciuic-doctor[hang]')"
    how = ["--native"] if native else ["--nonblocking"]
    command = [binary, "dump", "--pid", str(pid), "--json", *how, "--full-filenames"]
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
                | ({"native": True} if _native(f) else {})
                for f in t.get("frames", [])
            ],
        }
        for t in raw
    ]
    threads.sort(key=lambda t: not t["main"])
    return threads, None


def _native(frame: dict[str, Any]) -> bool:
    """A C/C++ frame of py-spy --native: a shared object's function, no Python line."""
    name = str(frame.get("filename") or "")
    return (
        not name.endswith(".py")
        and (frame.get("line") in (0, None))
        and (".so" in name or "0x" in str(frame.get("name")))
    )
