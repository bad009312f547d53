"""What /proc says about one process, for discovery: its rank keys in the environment, its command line,
the run files it keeps open, its launcher; and which processes write a run directory or share a run id.
Reads only (environ, cmdline, fd links); never signals; imports no torch.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import psutil

from ciuic_doctor.errors import UserError

LAUNCHER = re.compile(
    r"(^|[/\s])torchrun(\s|$)|torch\.distributed\.(run|launch)|deepspeed\.launcher|accelerate\s+launch"
)
LOCAL_RANK_ARG = re.compile(r"--local[-_]rank[=\s](\d+)")
HELPER = re.compile(r"multiprocessing\.(resource_tracker|forkserver)")
# ciuic-doctor's own viewers: watch --metrics-port's exporter inherits rank 0's environment (RANK,
# TORCHELASTIC_RUN_ID) and lives outside the job's process tree; it is never one of the job's ranks
OWN_VIEWER = re.compile(r"(^|[/\s])ciuic[-_]doctor\s+(export|top)(\s|$)")
SPAWNED = re.compile(r"--multiprocessing-fork|spawn_main\(")
# files a watched rank keeps open in its run directory: its steps stream, its watchdog's fatal-stack file
WATCHED_FILE = re.compile(r"(?:steps\.rank(\d+)\.jsonl|hang\.rank(\d+)\.fatal\.txt)$")
WORKER_COMM = "pt_data_worker"  # torch's DataLoader worker loop renames its process (torch/utils/data)
EXPORT_LOG = "export.log"  # what watch's exporter writes into the run directory (live/exporter.py)
SPAWN_SETTLE_S = 1.0  # a spawned child younger than this may still become a DataLoader worker by name
ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES")
# A Slurm task's node: two nodes may share one host (and one torchrun run id across them), so a node's
# ranks are those whose SLURMD_NODENAME is that node's (ciuic_doctor/cluster)
NODE_KEY = "SLURMD_NODENAME"
ENV_KEYS += (NODE_KEY,)


def read_environ(pid: int) -> dict[str, str] | None:
    """The keys of ENV_KEYS in the environment `pid` started with; None where it may not be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(1 << 20)
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:
        return None
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, _, value = item.partition(b"=")
        name = key.decode(errors="replace")
        if name in ENV_KEYS:
            out[name] = value.decode(errors="replace")
    return out


def int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def cmdline_of(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(proc.cmdline())
    return ""


def watched_file_rank(pid: int) -> tuple[int | None, Path | None]:
    """(rank, run dir) of a process watch is recording, from the files it keeps open there."""
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                match = WATCHED_FILE.search(target)
                if match:
                    return int(match.group(1) or match.group(2)), Path(target).parent
    return None, None


def attach(pid: int) -> psutil.Process:
    """The process at `pid`, or a UserError that says in one line why it cannot be looked at."""
    if pid == os.getpid():
        raise UserError(f"PID {pid} is this process")
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            raise UserError(f"PID {pid} has already exited (a zombie); nothing to watch")
        proc.create_time()
    except psutil.NoSuchProcess:
        raise UserError(f"no process with PID {pid}") from None
    except psutil.AccessDenied:
        raise UserError(f"PID {pid} may not be read (access denied): run as its user or as root") from None
    return proc


def job_root(proc: psutil.Process) -> psutil.Process:
    """The process that launched the job `proc` belongs to: its nearest launcher ancestor (torchrun,
    deepspeed), else the first ancestor outside the ranks (no RANK in its environment: `ciuic-doctor job
    --nproc`, any elastic agent), else the script that mp.spawn'ed it; else the process itself."""
    with contextlib.suppress(psutil.Error):
        for parent in proc.parents():
            if LAUNCHER.search(cmdline_of(parent)):
                return parent
    current = proc
    with contextlib.suppress(psutil.Error):
        while True:
            parent = current.parent()
            if parent is None or parent.pid <= 1:
                return current
            env, parent_env = read_environ(current.pid) or {}, read_environ(parent.pid)
            if "RANK" in env:
                if parent_env is not None and "RANK" in parent_env:
                    current = parent  # a DataLoader worker inherits its rank's RANK: climb to the rank
                    continue
                # the launcher of the ranks is a Python process (an elastic agent); a shell that ran a
                # single process with RANK set by hand is not part of the job
                return parent if "python" in cmdline_of(parent) or "ciuic" in cmdline_of(parent) else current
            if SPAWNED.search(cmdline_of(current)) or current.name() == WORKER_COMM:
                current = parent
                continue
            return current
    return current
    return current


def pids_writing(run_dir: Path) -> list[int]:
    """Processes with a file open under `run_dir` (a watched job keeps its fatal-stack files open), but
    not the exporter `watch --metrics-port` started, which keeps only its EXPORT_LOG open there (it
    outlives the job by its linger: it is no part of the job)."""
    prefix = str(run_dir.resolve()) + os.sep
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{entry}/fd/{fd}")
                    if target.startswith(prefix) and target != prefix + EXPORT_LOG:
                        found.append(int(entry))
                        break
    return found


def pids_of_run_id(run_id: str, node: str | None = None) -> list[int]:
    """Processes on this host whose environment carries TORCHELASTIC_RUN_ID=run_id (and, given `node`,
    SLURMD_NODENAME=node: another node's agents on this host are that node's)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            env = read_environ(int(entry))
            if env and env.get("TORCHELASTIC_RUN_ID") == run_id and env.get(NODE_KEY) == node:
                found.append(int(entry))
    return [pid for pid in found if not _own_viewer(pid)]


def _own_viewer(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            words = fh.read(8192).replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return OWN_VIEWER.search(words) is not None


def gpus_from_env(visible: str | None, local_rank: int | None, nvml_listed_any: bool) -> list[int]:
    """The device a rank most likely uses when NVML does not list it: `cuda:LOCAL_RANK` among
    CUDA_VISIBLE_DEVICES (indices only; UUIDs need NVML). Nothing when NVML lists processes but not this
    one (it holds no context: a CPU rank), or when the variable is empty or absent and no local rank is known.

    >>> gpus_from_env("2,3", 1, False), gpus_from_env(None, 0, False), gpus_from_env("", 0, False)
    ([3], [], [])
    """
    if nvml_listed_any or local_rank is None or not visible:
        return []
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if local_rank < len(devices) and devices[local_rank].isdigit():
        return [int(devices[local_rank])]
    return []


def script_of(cmdlines: list[str]) -> str:
    """What the ranks run, for the header: the script after `watch --`, the `-m` module, the first `*.py`.

    >>> script_of(["/usr/bin/python3 -m ciuic_doctor job --steps 9 --out /r"])
    'ciuic-doctor job'
    >>> script_of(["python -m ciuic_doctor watch --out r -- train.py --lr 3"])
    'train.py'
    >>> script_of(["python x/main.py"])
    'main.py'
    """
    for cmdline in cmdlines:
        words = cmdline.split()
        if "--" in words and words.index("--") + 1 < len(words):
            return os.path.basename(words[words.index("--") + 1])
        for i, word in enumerate(words[:-1]):
            if word == "-m":
                if words[i + 1] == "ciuic_doctor" and i + 2 < len(words):
                    return f"ciuic-doctor {words[i + 2]}"
                return words[i + 1]
        for word in words[1:]:
            if word.endswith(".py"):
                return os.path.basename(word)
    return os.path.basename((cmdlines[0].split() or ["?"])[0]) if cmdlines else "?"


def create_time(proc: psutil.Process) -> float:
    with contextlib.suppress(psutil.Error):
        return proc.create_time()
    return float("inf")


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
