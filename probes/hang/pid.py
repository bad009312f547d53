"""`ciuic-doctor hang --pid`: gather every rank's position in a running (hung) job, watched or not.

For each rank below PID (torchrun agent, or the rank itself; roles as memwatch names them):
- watched by `ciuic-doctor watch` (it keeps RUN/hang.rank<R>.fatal.txt open): SIGUSR1, then wait for
  its own dump (Flight Recorder + stacks) to appear;
- otherwise, or when it does not answer (stopped, or its watchdog cannot run): py-spy's stacks;
- Flight Recorder dumps the job wrote itself (NCCL's dump on timeout) where the rank's environment's
  TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE point: copied into RUN/hang.fr/rank<R>.

Everything goes into one run directory: hang.pyspy.json (ranks, pids, states, stacks) plus the copies.
Standard library and psutil only: no torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import psutil

from ciuic_doctor.cluster.procs import node_of
from ciuic_doctor.errors import UserError
from ciuic_doctor.probes.hang.kernel import native_enabled, waits_in_native
from ciuic_doctor.probes.memwatch.tree import ProcessTree, attach
from ciuic_doctor.probes.watch.hang.where import process_state
from ciuic_doctor.rundir import safe_io
from ciuic_doctor.rundir.hang import flight_recorder as fr_dump
from ciuic_doctor.rundir.hang.files import fr_status_of, py_spy_binary, py_spy_stacks
from ciuic_doctor.rundir.store import RunDir, default_run_path

_FATAL = re.compile(r"hang\.rank(\d+)\.fatal\.txt$")
SECOND_LOOK_S = 2.0  # a rank whose main thread is where it was 2 s ago is stuck there
_FR_ENV = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
NCCL_DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"  # ProcessGroupNCCL's dump when neither variable is set


def find_ranks(pid: int) -> dict[int, psutil.Process]:
    """rank -> process, for the job at `pid` (an agent or a rank). A UserError when there is none."""
    tree = ProcessTree(attach(pid))
    tree.refresh()
    ranks = {
        role.rank: tree.procs[p]
        for p, role in tree.roles.items()
        if role.rank is not None and role.role.startswith("rank ")
    }
    if not ranks:
        raise UserError(f"PID {pid}: no training rank found in its process tree")
    return dict(sorted(ranks.items()))


def watched_run(proc: psutil.Process) -> Path | None:
    """The run directory a watched rank writes into (the fatal-stack file watch keeps open there)."""
    with contextlib.suppress(psutil.Error):
        for f in proc.open_files():
            if _FATAL.search(f.path):
                return Path(f.path).parent
    return None


def gather(pid: int, *, out: str | None, wait_s: float) -> RunDir:
    """Ask, wait, py-spy, copy: the run directory holding every rank's position."""
    if out is not None and Path(out).exists():  # a refused --out is said first, whatever runs at `pid`
        RunDir.create(out)
    ranks = find_ranks(pid)
    watched = {rank: run for rank, proc in ranks.items() if (run := watched_run(proc)) is not None}
    if out is not None:
        _refuse_other_run(Path(out), pid, set(watched.values()))
    if not watched and py_spy_binary() is None:  # nothing is written for a look that cannot be taken
        raise UserError("py-spy is not installed (pip install 'ciuic-doctor[hang]'); it reads the stacks of "
                        "ranks that watch does not record")  # fmt: skip
    run = RunDir.create(out or next(iter(watched.values()), None) or default_run_path("hang"))
    asked = time.time()
    for rank in watched:
        with contextlib.suppress(psutil.Error):
            ranks[rank].send_signal(signal.SIGUSR1)
    # each rank dumps into its own run directory, wherever that is; with --out elsewhere, copied here
    answered = _wait_for_dumps(watched, since=asked, wait_s=wait_s) if watched else set()
    for rank in sorted(answered):
        if watched[rank].resolve() != run.path.resolve() and not _bring_dump(rank, watched[rank], run):
            answered.discard(rank)
    record: dict[str, Any] = {
        "schema": 1,
        "t": time.time(),
        "pid": pid,
        # the job's node as Slurm names it (SLURMD_NODENAME in its environment), else this host's name
        "host": node_of(pid) or socket.gethostname(),
        "ranks": {},
    }
    first_looks: dict[int, Any] = {}
    for rank, proc in ranks.items():
        entry: dict[str, Any] = {
            "pid": proc.pid,
            "state": process_state(proc.pid),
            "watched": rank in watched,
        }
        if rank not in answered:
            entry["threads"], entry["error"] = py_spy_stacks(proc.pid)
            first_looks[rank] = entry["threads"]
        if fr := _copy_flight_recorder(proc, rank, run.path):
            entry["fr_file"] = fr
            entry["pg_status"] = fr_status_of(run.path / fr, root=run.path)
        record["ranks"][str(rank)] = entry
    if first_looks:  # one look can catch a healthy rank between two collectives: look again
        time.sleep(SECOND_LOOK_S)
        for rank, first in first_looks.items():
            again, _ = py_spy_stacks(ranks[rank].pid)
            entry = record["ranks"][str(rank)]
            entry["moving"] = _main(first) != _main(again)
            entry["threads"] = again or first
            if not entry["moving"] and _ends_in_torch(entry["threads"]):
                # its Python stack ends in a call into torch's C++ (backward, a collective's wait): the
                # native frames say whether that is DDP's all_reduce inside backward
                native, why = None, "CIUIC_PYSPY_NATIVE=0"
                if native_enabled():
                    native, why = py_spy_stacks(ranks[rank].pid, native=True)
                if native:
                    entry["threads"] = native
                else:
                    entry["native_error"] = why
                    _kernel_look(entry, ranks[rank].pid, why or "py-spy --native gave nothing")
    run.write_json("hang.pyspy.json", record)
    refused = [e["error"] for e in record["ranks"].values() if e.get("error")]
    if refused and len(refused) == len(ranks) and not answered:
        raise UserError(refused[0])
    return run


def _refuse_other_run(out: Path, pid: int, watched_runs: set[Path]) -> None:
    """--out that already holds another run's records (not the run this job's watched ranks write) is
    refused before anything is written: the stacks of the job at `pid` would sit among another job's
    steps and meta.json, and `hang RUN` would judge them as that job's."""
    if not out.is_dir() or out.resolve() in {p.resolve() for p in watched_runs}:
        return
    with contextlib.suppress(OSError, ValueError):  # an earlier look at this same job: looked at again
        earlier = safe_io.read_json(out / "hang.pyspy.json", max_bytes=16 << 20)
        if isinstance(earlier, dict) and earlier.get("pid") == pid:
            return
    held = sorted(
        (
            name
            for name in os.listdir(out)
            if name == "meta.json" or name.endswith(".jsonl") or name.startswith("hang.")
        ),
        key=lambda name: (name != "meta.json", name),
    )
    if held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UserError(
            f"--out {out}: holds another run ({shown}), not the one the job at PID {pid} writes; "
            "choose a new or empty folder"
        )


def _kernel_look(entry: dict[str, Any], pid: int, why: str) -> None:
    """Without C++ frames: what the kernel says the rank's threads wait on (probes/hang/kernel.py), as an
    innermost frame of its main thread plus the threads' own look (`kernel`)."""
    seen = waits_in_native(pid, entry.get("threads"), why)
    if seen is None:
        return
    entry["kernel"] = seen["kernel"]
    for thread in entry.get("threads") or []:
        if thread.get("main"):
            thread["frames"] = [seen["frame"], *thread.get("frames", [])]


def _wait_for_dumps(watched: dict[int, Path], *, since: float, wait_s: float) -> set[int]:
    """The ranks whose dump, in their own run directory, is newer than the request."""
    deadline = time.monotonic() + wait_s
    done: set[int] = set()
    while time.monotonic() < deadline and done != set(watched):
        for rank in set(watched) - done:
            dump = watched[rank] / f"hang.rank{rank}.json"
            with contextlib.suppress(OSError):
                if dump.lstat().st_mtime >= since - 1:
                    done.add(rank)
        time.sleep(0.2)
    return done


def _bring_dump(rank: int, source: Path, run: RunDir) -> bool:
    """Copy rank `rank`'s dump (JSON, stacks, Flight Recorder file) from its run directory into `run`:
    regular files inside `source` only, each at most its cap, written without following a symlink."""
    names = [
        (f"hang.rank{rank}.stacks.txt", safe_io.MAX_TEXT_BYTES),
        (_fr_name(rank, source), safe_io.MAX_PICKLE_BYTES),
        (f"hang.rank{rank}.armed.json", safe_io.MAX_JSON_BYTES),
        (f"hang.rank{rank}.json", safe_io.MAX_JSON_BYTES),  # last: its presence means complete
    ]
    for name, cap in names:
        try:
            data = safe_io.read_bytes(source / name, max_bytes=cap, root=source)
        except FileNotFoundError:
            continue
        except OSError:
            if name.endswith(".json") and ".armed" not in name:
                return False
            continue
        with contextlib.suppress(OSError):
            if name.startswith("hang.fr/"):
                safe_io.make_dir(run.path, "hang.fr")
            safe_io.write_atomic(run.path / name, data, root=run.path)
    return True


def _fr_name(rank: int, source: Path) -> str:
    """The Flight Recorder file rank `rank`'s dump names: a rank that dumped before writes its next
    dump's entries to `hang.fr/rank<R>.<index>`, so the copy must take that file, not the first one.
    Only a name of that shape is taken from the (untrusted) dump; anything else falls back to the first."""
    first = f"hang.fr/rank{rank}"
    try:
        dump = json.loads(
            safe_io.read_bytes(
                source / f"hang.rank{rank}.json", max_bytes=safe_io.MAX_JSON_BYTES, root=source
            )
        )
    except (OSError, ValueError):
        return first
    named = dump.get("fr_file") if isinstance(dump, dict) else None
    if isinstance(named, str) and re.fullmatch(rf"hang\.fr/rank{rank}(\.[0-9]{{1,6}})?", named):
        return named
    return first


def _copy_flight_recorder(proc: psutil.Process, rank: int, run_path: Path) -> str | None:
    """NCCL's own Flight Recorder dump of `rank` (file `<prefix><rank>`), copied next to ours.

    The file is the job's user's (run as root on a user's job, it is someone else's): it is read only
    when it is a regular file owned by the rank's own user (/tmp is shared), not through a symlink, at
    most safe_io.MAX_PICKLE_BYTES, and it is parsed as data only (hang.flight_recorder: no global, so no
    code runs)
    before it is kept. Anything else is left where it is.
    """
    try:
        env = proc.environ()
        uid = proc.uids().real
    except psutil.Error:
        return None
    for name in _FR_ENV:
        prefix = env.get(name, NCCL_DEFAULT_PREFIX if name == _FR_ENV[-1] else None)
        if not prefix:
            continue
        source = Path(f"{prefix}{rank}")
        try:
            fd = safe_io.open_regular(source, max_bytes=safe_io.MAX_PICKLE_BYTES)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as fh:
            if os.fstat(fh.fileno()).st_uid != uid:  # the descriptor's owner: no race with a rename
                continue
            raw = fh.read(safe_io.MAX_PICKLE_BYTES + 1)
        try:
            fr_dump.parse(raw)
        except ValueError:
            continue
        target = run_path / "hang.fr" / f"rank{rank}"
        if not safe_io.is_regular(target):
            try:
                safe_io.make_dir(run_path, "hang.fr")
                safe_io.write_atomic(target, raw, root=run_path)
            except OSError:
                continue
        return f"hang.fr/rank{rank}"
    return None


def _ends_in_torch(threads: list[dict[str, Any]] | None) -> bool:
    """The main thread's innermost Python frame is torch's own (a call into C++ that has not returned)."""
    frames = _main(threads)
    return bool(frames) and "/torch/" in str(frames[0][0])


def _main(threads: list[dict[str, Any]] | None) -> list[Any]:
    """The main thread's frames (file, line, function), to compare two looks."""
    for thread in threads or []:
        if thread.get("main"):
            return [(f.get("file"), f.get("line"), f.get("function")) for f in thread.get("frames", [])]
    return []
