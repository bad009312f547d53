"""Find every rank of a running job from outside: from a torchrun agent PID, a rank PID, or a run directory
that is being written.

What tells a process's rank, strongest first (shared/reference/live-mfu-moe.md, "Where a rank is"):
- `RANK` in `/proc/<pid>/environ` (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK and
  TORCHELASTIC_RUN_ID in every worker; readable by the job's user and root);
- the rank a watched process writes under (`steps.rank<R>.jsonl` and `hang.rank<R>.fatal.txt`, which
  `watch` and the embedded job keep open in the run directory: also how the run directory is found);
- `--local-rank N` / `--local_rank=N` in its command line (torch.distributed.launch);
- a child of the launching script started by `torch.multiprocessing.spawn` (`--multiprocessing-fork` in
  its command line): ranks in start order, as mp.spawn starts them.
A child of a rank named `pt_data_worker` (torch's DataLoader worker loop names itself so) is that rank's
worker, and so is one below the rank's forkserver (torch starts forkserver workers as its children); any
other child is a helper: multiprocessing's resource tracker and forkserver, watch's sentinel, whatever the
script shells out to. Several agents of one job on one host are
joined through TORCHELASTIC_RUN_ID (not when it is torchrun's default "none").

GPUs: NVML's processes per device by PID (ciuic_doctor.machine.nvml), else the device CUDA_VISIBLE_DEVICES and
LOCAL_RANK point at. Reads /proc only; never signals, never attaches a debugger; imports no torch.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ciuic_doctor.errors import UserError
from ciuic_doctor.live.procs import (
    HELPER,
    LAUNCHER,
    LOCAL_RANK_ARG,
    NODE_KEY,
    OWN_VIEWER,
    SPAWN_SETTLE_S,
    SPAWNED,
    WORKER_COMM,
    attach,
    cmdline_of,
    create_time,
    gpus_from_env,
    int_or_none,
    job_root,
    pids_of_run_id,
    pids_writing,
    read_environ,
    running,
    script_of,
    watched_file_rank,
)


def _young(proc: psutil.Process) -> bool:
    return time.time() - create_time(proc) < SPAWN_SETTLE_S


@dataclass(kw_only=True)
class RankProc:
    """One rank as seen from outside."""

    rank: int
    pid: int
    rank_source: str  # env | watch | cmdline | spawn | root
    local_rank: int | None = None
    world_size: int | None = None
    group_rank: int | None = None
    run_id: str | None = None
    cuda_visible_devices: str | None = None
    host: str = field(default_factory=socket.gethostname)
    agent_pid: int | None = None
    workers: list[int] = field(default_factory=list)
    helpers: list[int] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    run_dir: Path | None = None
    cmdline: str = ""


@dataclass(kw_only=True)
class JobLayout:
    """Every rank found, plus what the header says about the job."""

    ranks: dict[int, RankProc]
    agents: list[int]
    script: str
    world_size: int | None
    run_id: str | None
    run_dir: Path | None
    notes: list[str] = field(default_factory=list)

    @property
    def hosts(self) -> list[str]:
        return sorted({r.host for r in self.ranks.values()})


@dataclass(kw_only=True)
class _Seen:
    proc: psutil.Process
    role: str  # rank | worker | helper | agent | launcher | pending
    rank: int | None
    source: str
    env: dict[str, str] = field(default_factory=dict)
    run_dir: Path | None = None
    agent: int | None = None


class Discovery:
    """Walks the job's process trees on every `refresh`; a process is named once, when first seen."""

    def __init__(self, *, pid: int | None = None, run_dir: Path | None = None, nvml: object = None) -> None:
        if pid is None and run_dir is None:
            raise UserError("give a PID (--pid) or a run directory")
        self.run_dir = run_dir
        self.roots: list[psutil.Process] = []
        self._nvml = nvml
        self._seen: dict[int, _Seen] = {}
        self._spawn_order: dict[int, int] = {}
        self._run_ids_joined: set[tuple[str, str | None]] = set()
        self._notes: set[str] = set()
        if pid is not None:
            self.roots.append(job_root(attach(pid)))
        else:
            self._roots_from_run_dir()

    def _roots_from_run_dir(self) -> None:
        known = {r.pid for r in self.roots}
        for pid in pids_writing(self.run_dir):
            with contextlib.suppress(psutil.Error):
                root = job_root(psutil.Process(pid))
                if root.pid not in known:
                    self.roots.append(root)
                    known.add(root.pid)

    def alive(self) -> bool:
        return any(running(root) for root in self.roots)

    def refresh(self) -> JobLayout:
        if self.run_dir is not None and not self.alive():
            self._roots_from_run_dir()
        self._walk()
        if self._join_run_ids():  # another agent of the same job: its ranks belong in this layout now
            self._walk()
        return self._layout()

    def _walk(self) -> None:
        procs: dict[int, psutil.Process] = {}
        me = os.getpid()
        for root in self.roots:
            with contextlib.suppress(psutil.Error):
                for proc in [root, *root.children(recursive=True)]:
                    if proc.pid != me:
                        procs.setdefault(proc.pid, proc)
        for pid in [p for p in self._seen if p not in procs]:
            del self._seen[pid]
        for proc in sorted(procs.values(), key=create_time):
            seen = self._seen.get(proc.pid)
            if seen is None or seen.proc != proc or seen.role == "pending":
                with contextlib.suppress(psutil.Error):
                    seen = self._seen[proc.pid] = self._name(proc)
                    seen.env = read_environ(proc.pid) or {}
                    if seen.role == "rank":
                        seen.agent = self._agent_of(proc)  # named once: psutil's parents() is dear
            if seen is not None and seen.role == "rank" and seen.run_dir is None:
                seen.run_dir = watched_file_rank(proc.pid)[1]  # watch opens it a moment after start

    def _join_run_ids(self) -> bool:
        """Other agents of the same torchrun job on this host (several --nnodes on one machine); True
        when one was added. Each run id is looked for once (a scan reads every process's environ)."""
        added = False
        ids = set()
        for seen in self._seen.values():
            if seen.role == "rank":
                run_id = seen.env.get("TORCHELASTIC_RUN_ID")
                if run_id and run_id != "none":
                    ids.add((run_id, seen.env.get(NODE_KEY)))  # this node's agents only
        known = {r.pid for r in self.roots}
        for run_id, node in ids - self._run_ids_joined:
            self._run_ids_joined.add((run_id, node))
            for pid in pids_of_run_id(run_id, node):
                with contextlib.suppress(psutil.Error):
                    root = job_root(psutil.Process(pid))
                    if root.pid not in known:
                        self.roots.append(root)
                        known.add(root.pid)
                        added = True
        return added

    def _parent_seen(self, proc: psutil.Process) -> _Seen | None:
        with contextlib.suppress(psutil.Error):
            for parent in proc.parents():
                if parent.pid in self._seen:
                    return self._seen[parent.pid]
        return None

    def _name(self, proc: psutil.Process) -> _Seen:
        env = read_environ(proc.pid)
        if env is None:
            self._notes.add("some processes' environments could not be read (ranks guessed)")
        env = env or {}
        cmdline = cmdline_of(proc)
        comm = proc.name()
        parent = self._parent_seen(proc)
        env_rank = int_or_none(env.get("RANK"))
        if OWN_VIEWER.search(cmdline):
            return _Seen(proc=proc, role="helper", rank=None, source="cmdline")
        spawned = SPAWNED.search(cmdline) is not None and comm != WORKER_COMM and not HELPER.search(cmdline)
        if parent is not None and parent.role == "rank" and parent.source == "root":
            if env_rank is not None:
                parent.role = "launcher"  # the root launched ranks (an in-process elastic agent): not rank 0
            elif spawned:
                return self._spawned(proc, parent)
        if (
            parent is not None
            and parent.role == "rank"
            and (comm == WORKER_COMM or env_rank is None or env_rank == parent.rank)
        ):
            return self._below_rank(proc, parent, comm, cmdline)
        if parent is not None and parent.role == "helper" and comm == WORKER_COMM:
            # forkserver's workers are its children, not the rank's (torch's DataLoader under forkserver)
            return _Seen(proc=proc, role="worker", rank=parent.rank, source="parent")
        if parent is not None and parent.role in ("worker", "helper"):
            if parent.role == "helper" and _young(proc):
                return _Seen(proc=proc, role="pending", rank=None, source="parent")  # not renamed yet
            return _Seen(proc=proc, role=parent.role, rank=parent.rank, source="parent")
        if env_rank is not None:
            return _Seen(proc=proc, role="rank", rank=env_rank, source="env")
        if LAUNCHER.search(cmdline):
            return _Seen(proc=proc, role="agent", rank=None, source="cmdline")
        watched, _ = watched_file_rank(proc.pid)
        if watched is not None:
            return _Seen(proc=proc, role="rank", rank=watched, source="watch")
        match = LOCAL_RANK_ARG.search(cmdline)
        if match:
            return _Seen(proc=proc, role="rank", rank=int(match.group(1)), source="cmdline")
        if HELPER.search(cmdline):
            return _Seen(proc=proc, role="helper", rank=None, source="cmdline")
        if parent is not None and spawned:
            return self._spawned(proc, parent)
        if parent is None:
            return _Seen(proc=proc, role="rank", rank=0, source="root")
        return _Seen(proc=proc, role="helper", rank=parent.rank, source="parent")

    @staticmethod
    def _below_rank(proc: psutil.Process, parent: _Seen, comm: str, cmdline: str) -> _Seen:
        """A child of a rank: a DataLoader worker when torch has named it (`pt_data_worker`, set by the
        worker loop as it starts), multiprocessing's helpers and anything else the rank or its tools run
        (watch's sentinel, a shell-out) a helper. One younger than SPAWN_SETTLE_S and not named yet is
        looked at again: a fork-started worker carries its rank's name until its loop renames it."""
        if comm == WORKER_COMM:
            return _Seen(proc=proc, role="worker", rank=parent.rank, source="parent")
        if not HELPER.search(cmdline) and _young(proc):
            return _Seen(proc=proc, role="pending", rank=None, source="parent")
        return _Seen(proc=proc, role="helper", rank=parent.rank, source="parent")

    def _spawned(self, proc: psutil.Process, parent: _Seen) -> _Seen:
        """A child torch.multiprocessing.spawn started: ranks in start order below their launcher. One
        younger than SPAWN_SETTLE_S is named later: a spawn-context DataLoader worker renames itself."""
        if parent.role == "rank" and parent.source == "root":
            parent.role = "launcher"
        watched, _ = watched_file_rank(proc.pid)
        if watched is not None:  # under watch each spawned rank writes its own stream: its true rank
            return _Seen(proc=proc, role="rank", rank=watched, source="watch")
        if time.time() - create_time(proc) < SPAWN_SETTLE_S:
            return _Seen(proc=proc, role="pending", rank=None, source="spawn")
        key = self._nearest(proc)
        number = self._spawn_order.get(key, 0)
        self._spawn_order[key] = number + 1
        return _Seen(proc=proc, role="rank", rank=number, source="spawn")

    def _nearest(self, proc: psutil.Process) -> int:
        with contextlib.suppress(psutil.Error):
            for parent in proc.parents():
                if parent.pid in self._seen:
                    return parent.pid
        return -1

    def _layout(self) -> JobLayout:
        ranks: dict[int, RankProc] = {}
        for pid, seen in self._seen.items():
            if seen.role != "rank" or seen.rank is None:
                continue
            env = seen.env
            agent = seen.agent
            run_dir = seen.run_dir
            ranks[seen.rank] = RankProc(
                rank=seen.rank,
                pid=pid,
                rank_source=seen.source,
                local_rank=int_or_none(env.get("LOCAL_RANK")),
                world_size=int_or_none(env.get("WORLD_SIZE")),
                group_rank=int_or_none(env.get("GROUP_RANK")),
                run_id=env.get("TORCHELASTIC_RUN_ID"),
                cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
                host=env.get(NODE_KEY) or socket.gethostname(),  # a Slurm task: its node's name
                agent_pid=agent,
                run_dir=run_dir or self.run_dir,
                cmdline=cmdline_of(seen.proc),
            )
        for pid, seen in self._seen.items():
            if seen.role in ("worker", "helper") and seen.rank in ranks:
                owner = ranks[seen.rank]
                if pid != owner.pid:
                    (owner.workers if seen.role == "worker" else owner.helpers).append(pid)
        self._assign_gpus(ranks)
        world = next((r.world_size for r in ranks.values() if r.world_size), None)
        run_dir = self.run_dir or next((r.run_dir for r in ranks.values() if r.run_dir), None)
        return JobLayout(
            ranks=dict(sorted(ranks.items())),
            agents=[p for p, s in self._seen.items() if s.role in ("agent", "launcher")],
            script=script_of(
                [r.cmdline for _, r in sorted(ranks.items()) if not SPAWNED.search(r.cmdline)]
                + [cmdline_of(root) for root in self.roots]  # mp.spawn's ranks run `python -c ...`
            ),
            world_size=world or (len(ranks) if ranks else None),
            run_id=next((r.run_id for r in ranks.values() if r.run_id), None),
            run_dir=run_dir,
            notes=sorted(self._notes),
        )

    def _agent_of(self, proc: psutil.Process) -> int | None:
        with contextlib.suppress(psutil.Error):
            for parent in proc.parents():
                seen = self._seen.get(parent.pid)
                if seen is not None and seen.role in ("agent", "launcher"):
                    return parent.pid
        return None

    def _assign_gpus(self, ranks: dict[int, RankProc]) -> None:
        per_pid = {}
        if self._nvml is not None and getattr(self._nvml, "available", False):
            per_pid = self._nvml.process_memory()
        for rank in ranks.values():
            listed = per_pid.get(rank.pid)
            if listed is not None and listed.devices:
                rank.gpus = list(listed.devices)
            else:
                rank.gpus = gpus_from_env(rank.cuda_visible_devices, rank.local_rank, bool(per_pid))
