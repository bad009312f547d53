"""The process tree memwatch follows, and the role of each process in it (agent / rank N / worker).

Roles (record `role`, `rank`, `rank_source`):
- `rank N`: a process whose environment has RANK=N (read from /proc/PID/environ where permitted);
  else a child of an agent, ranked by `--local-rank N` in its command line or by start order
  (rank_source "cmdline" / "order": local ranks, right on one node).
- `worker of rank N`: any descendant of rank N (DataLoader workers are children of their rank; forked
  workers inherit RANK, which is how they are told from a new rank);
  `helper of rank N` for multiprocessing's resource tracker / forkserver, which do no data work.
- `agent`: torchrun (or another launcher), or any root process with ranks below it; a child of an
  agent whose readable environment has no RANK is a `helper of agent`.
- a root process with no rank anywhere below it is a one-process job: `rank 0` (rank_source "root");
  it becomes `agent` (rank_source "relabelled") if ranks appear below it later.

Like the sampler it never imports torch.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from ciuic_doctor.errors import UserError

_LAUNCHER = re.compile(
    r"(^|[/\s])torchrun(\s|$)|torch\.distributed\.(run|launch)|deepspeed\.launcher|accelerate\s+launch"
)
_LOCAL_RANK_ARG = re.compile(r"--local[-_]rank[=\s](\d+)")
_HELPER = re.compile(r"multiprocessing\.(resource_tracker|forkserver)")


@dataclass(kw_only=True)
class Role:
    role: str
    rank: int | None
    rank_source: str  # env | cmdline | order | root | parent


_PYTHON = re.compile(r"python|torchrun")


def attach(pid: int) -> psutil.Process:
    """The target process, or a UserError that says in one line why it cannot be watched."""
    if pid == os.getpid():
        raise UserError(f"PID {pid} is this ciuic-doctor process itself, not a training job")
    try:
        proc = psutil.Process(pid)
        name = proc.name()
        if pid == 1 and not _PYTHON.search(" ".join([name, *_cmdline(proc)[:2]])):
            # every process descends from init: its tree is the whole machine, not a job. A container
            # whose entrypoint is torchrun or python has the job at PID 1, and that one is watched.
            raise UserError(
                f"PID 1 ({name}) is the system's init process, not a training job: give the torchrun "
                "agent's PID or a rank's"
            )
        if proc.status() == psutil.STATUS_ZOMBIE:
            raise UserError(
                f"PID {pid} ({name}) has already exited (a zombie waiting for parent PID {proc.ppid()} "
                "to reap it); nothing to watch"
            )
        proc.memory_info()
    except psutil.ZombieProcess:
        raise UserError(f"PID {pid} has already exited (zombie); nothing to watch") from None
    except psutil.NoSuchProcess:
        raise UserError(f"no process with PID {pid}") from None
    except psutil.AccessDenied:
        raise UserError(
            f"PID {pid} belongs to user {owner_of(pid)}; memwatch may not read its memory (access denied): "
            "run it as that user or as root"
        ) from None
    return proc


def _cmdline(proc: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return proc.cmdline()
    return []


def owner_of(pid: int) -> str:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).username()
    return "another user"


def _env_rank(proc: psutil.Process) -> tuple[int | None, bool]:
    """RANK from the process's initial environment; (None, False) when it may not be read."""
    try:
        value = proc.environ().get("RANK", "")
    except (psutil.AccessDenied, psutil.ZombieProcess):
        return None, False
    return (int(value) if value.isdigit() else None), True


def cmdline_of(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(proc.cmdline())
    return ""


class ProcessTree:
    """The target and its descendants, with a role for each; `refresh` re-walks /proc each sample."""

    def __init__(self, root: psutil.Process) -> None:
        self.root = root
        self.procs: dict[int, psutil.Process] = {}
        self.roles: dict[int, Role] = {}
        self._order: dict[int, int] = {}  # agent pid -> ranks numbered by start order so far
        self.env_denied: set[int] = set()
        self.walk_cpu_s = 0.0
        self.exited: set[psutil.Process] = set()  # seen to exit; a zombie stays listed until reaped

    def root_gone(self) -> bool:
        """The root has exited (or is a zombie): the only reason a watch ends by itself."""
        try:
            return not self.root.is_running() or self.root.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    def refresh(self) -> tuple[list[int], list[int]]:
        """(new pids, gone pids). Raises psutil.NoSuchProcess only when the root itself is gone.

        A child that exits while the walk reads it raises NoSuchProcess too; that was taken for the root
        exiting and ended the watch at once, 0-1 samples in, while the target ran on. Such a
        walk is skipped: the next one sees the tree as it is.
        """
        start = time.thread_time()
        try:
            found = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            if self.root_gone():
                raise
            return [], []
        self.walk_cpu_s = time.thread_time() - start  # the walk alone: naming new processes is once each
        mine = os.getpid()
        alive: dict[int, psutil.Process] = {}
        for proc in found:
            if (
                proc.pid == mine
                or proc in self.exited
                or (proc.pid in self.procs and self.procs[proc.pid] != proc)
            ):
                continue  # memwatch under its own target (`--pid $PPID`), an exited or a reused PID
            alive[proc.pid] = self.procs.get(proc.pid, proc)  # keep the object: cpu_percent needs it
        new = [pid for pid in alive if pid not in self.procs]
        gone = [pid for pid in self.procs if pid not in alive]
        for pid in gone:
            del self.procs[pid]
        new.sort(key=lambda pid: (_create_time(alive[pid]), pid))  # parents before their children
        named = []
        for pid in new:
            try:
                role = self._role(alive[pid])
            except psutil.NoSuchProcess:  # gone between the walk and its naming: never part of the tree
                if pid == self.root.pid:
                    raise
                continue
            self.procs[pid] = alive[pid]
            self.roles[pid] = role
            named.append(pid)
        new = named
        self._relabel_root()
        return new, gone

    def forget(self, pid: int) -> None:
        """A process seen to exit (or turn zombie) while being sampled."""
        proc = self.procs.pop(pid, None)
        if proc is not None:
            self.exited.add(proc)

    def _nearest_ancestor(self, proc: psutil.Process) -> int | None:
        with contextlib.suppress(psutil.Error):
            for parent in proc.parents():
                if parent.pid in self.roles:
                    return parent.pid
        return None

    def _role(self, proc: psutil.Process) -> Role:
        rank, readable = _env_rank(proc)
        if not readable:
            self.env_denied.add(proc.pid)
        cmdline = cmdline_of(proc)
        if proc.pid == self.root.pid:
            if rank is not None:
                return Role(role=f"rank {rank}", rank=rank, rank_source="env")
            if _LAUNCHER.search(cmdline):
                return Role(role="agent", rank=None, rank_source="cmdline")
            return Role(role="rank 0", rank=0, rank_source="root")
        parent = self.roles.get(self._nearest_ancestor(proc) or -1)
        parent_rank = parent.rank if parent else None
        # a root first taken for a one-process job (rank_source "root") is not a rank to inherit
        if rank is not None and (parent is None or parent.rank_source == "root" or parent.rank != rank):
            return Role(role=f"rank {rank}", rank=rank, rank_source="env")
        if _LAUNCHER.search(cmdline):
            return Role(role="agent", rank=None, rank_source="cmdline")
        if parent is not None and parent.rank is None and readable:
            return Role(role="helper of agent", rank=None, rank_source="parent")  # no RANK: not a rank
        if parent is None or parent.rank is None:  # below an agent, RANK unreadable: a rank nonetheless
            match = _LOCAL_RANK_ARG.search(cmdline)
            if match:
                return Role(role=f"rank {match.group(1)}", rank=int(match.group(1)), rank_source="cmdline")
            key = self._nearest_ancestor(proc) or self.root.pid
            number = self._order.get(key, 0)
            self._order[key] = number + 1
            return Role(role=f"rank {number}", rank=number, rank_source="order")
        kind = "helper" if _HELPER.search(cmdline) else "worker"
        return Role(role=f"{kind} of rank {parent_rank}", rank=parent_rank, rank_source="parent")

    def _relabel_root(self) -> None:
        """A root first taken for a one-process job turns out to launch ranks: it is their agent."""
        root = self.roles.get(self.root.pid)
        if root is None or root.rank_source != "root":
            return
        below = [r for pid, r in self.roles.items() if pid != self.root.pid]
        if any(r.role == "agent" or (r.role.startswith("rank ") and r.rank_source == "env") for r in below):
            self.roles[self.root.pid] = Role(role="agent", rank=None, rank_source="relabelled")


def _create_time(proc: psutil.Process) -> float:
    with contextlib.suppress(psutil.Error):
        return proc.create_time()
    return math.inf


def safe_call(method: Callable[[], Any]) -> Any:
    with contextlib.suppress(psutil.Error):
        return method()
    return None
