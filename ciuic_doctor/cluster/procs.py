"""A job step's processes on this node, found from outside the step (memwatch, top, export, hang).

Slurm starts each task of a step as a child of its slurmstepd, with SLURM_JOB_ID, SLURM_STEP_ID and
SLURMD_NODENAME in its environment, and a task's children inherit them. Two nodes may share one
machine (the test cluster runs two slurmd on one host), so a node's processes are those whose
SLURMD_NODENAME is this node's. /proc/PID/environ is readable for one's own processes (and by root).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from ciuic_doctor.cluster import NODE_ENV, STEP_NAME_ENV
from ciuic_doctor.errors import UserError

ENVIRON_CAP = 1 << 20  # a process's environment is at most ARG_MAX-sized (2 MiB typical); 1 MiB is plenty


def environ(pid: int) -> dict[str, str]:
    """The environment `pid` started with ({} when it is gone or not ours to read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(ENVIRON_CAP)
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def node_of(pid: int) -> str | None:
    """The Slurm node a process runs for (its SLURMD_NODENAME), None outside Slurm."""
    return environ(pid).get(NODE_ENV) or None


def step_roots(name: str, node: str | None = None) -> list[int]:
    """The top processes of the step named `name` on `node` (default this node): the tasks slurmstepd
    started (one torchrun agent per node in our steps); their children are the ranks."""
    node = node or os.environ.get(NODE_ENV)
    job = os.environ.get("SLURM_JOB_ID")
    tagged = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        env = environ(int(entry.name))
        if env.get(STEP_NAME_ENV) != name or "SLURM_STEP_ID" not in env:
            continue  # the caller that named the step (and its srun) carry the name but are in no step
        if (node and env.get(NODE_ENV) != node) or (job and env.get("SLURM_JOB_ID") != job):
            continue
        tagged.add(int(entry.name))
    return sorted(pid for pid in tagged if _ppid(pid) not in tagged)


def wait_for_step(name: str, timeout_s: float, poll_s: float = 0.2) -> int:
    """The first top process of step `name` on this node, waiting up to `timeout_s` for it to start."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            roots = step_roots(name)
            if roots:
                return roots[0]
        if time.monotonic() > deadline:
            node = os.environ.get(NODE_ENV, "this node")
            raise UserError(f"--step {name}: no process of that step on {node} within {timeout_s:.0f} s")
        time.sleep(poll_s)
