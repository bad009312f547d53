"""memwatch: sample the memory of a running job from outside, following its whole process tree.

Attach to a PID — a training process, or the torchrun agent above the ranks — and every `interval_s`
write one record per live process to RUN/memwatch.jsonl: RSS, USS/PSS where permitted, CPU %, threads,
GPU memory from NVML when a driver is present, and the machine's available memory and /dev/shm. The
tree is re-walked as it runs, so ranks and DataLoader workers started later are picked up: every
sample at the default 1 s; at 10 Hz every few samples, as its CPU budget allows (below). What is
not a sample — start (with NVML's availability, recorded once), each process's role and command line,
exits, notes, end — goes to RUN/memwatch_events.jsonl, so every memwatch record is a sample.

It never imports torch (nor anything that does): attaching must not cost the job a CUDA context or
the watcher a 2-second import. NVML comes through `ciuic_doctor.machine.nvml`, which needs only the driver.

Roles (agent / rank N / worker of rank N) are assigned in `memwatch_tree`.

USS/PSS (`memory_full_info`) read /proc/PID/smaps_rollup: the kernel walks every mapping of the
target and holds its mmap lock meanwhile, so on a large rank it is both slow and felt by the job.
Its CPU cost is measured per process as it runs; each process gets an equal share of
`full_info_budget` (0.5 % of a core) and one that costs more is read every k-th sample (record field
`uss_every`; the summary names the sparsest k and the dearest cost). Finding new children costs a
read of every process's /proc/PID/stat on the machine, so the walk has its own budget (0.5 %):
every sample when it fits, else every k-th (exits are still seen at once). RSS, its anonymous part,
CPU and threads come from raw reads of /proc/PID/stat and statm (`memwatch_proc`), ~5 µs a process.
Together that keeps memwatch within the issue's ≤ 2 % of a core at 10 Hz (benchmarks/memwatch_cost.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ciuic_doctor.machine import nvml
from ciuic_doctor.probes.memwatch.proc import BasicReader
from ciuic_doctor.probes.memwatch.tree import ProcessTree, attach, cmdline_of, owner_of, safe_call
from ciuic_doctor.rundir.frames import part_writer
from ciuic_doctor.rundir.store import JsonlWriter, RunDir

STREAM = "memwatch"  # one record per process per sample, nothing else (the report reads it as is)
EVENTS = "memwatch_events"  # start, process (role, cmdline), exit, note, end
SHM_PATH = "/dev/shm"


@dataclass(kw_only=True)
class MemwatchConfig:
    pid: int
    interval_s: float = 1.0
    duration_s: float | None = None  # None: until the target exits or Ctrl-C
    full_info_budget: float = 0.005  # share of one core USS/PSS reads may take (see module doc)
    walk_budget: float = 0.005  # share of one core the tree walk may take (see module doc)
    progress_every_s: float = 10.0
    # One memwatch per node (checkup in a Slurm allocation): each writes memwatch.rank<I>.jsonl, I its
    # node's index (SLURM_NODEID), so two nodes never append to one file; every reader of the stream
    # finds the files by the per-rank naming. Records keep their own `rank` (the watched process's).
    stream_index: int | None = None


@dataclass(kw_only=True)
class RoleSummary:
    """One role's memory over the watch, summed over its processes at each sample."""

    role: str
    pids: set[int] = field(default_factory=set)
    rss_start: int | None = None
    rss_end: int | None = None
    rss_peak: int = 0
    uss_first: dict[int, int] = field(default_factory=dict)  # per pid: USS is read every k-th sample
    uss_last: dict[int, int] = field(default_factory=dict)
    gpu_peak: int | None = None

    def add(self, records: list[dict[str, Any]]) -> None:
        rss = sum(r["rss"] for r in records)
        self.rss_start = rss if self.rss_start is None else self.rss_start
        self.rss_end = rss
        self.rss_peak = max(self.rss_peak, rss)
        for r in records:
            self.pids.add(r["pid"])
            if r["uss"] is not None:
                self.uss_first.setdefault(r["pid"], r["uss"])
                self.uss_last[r["pid"]] = r["uss"]
        gpu = [r["gpu_bytes"] for r in records if r["gpu_bytes"] is not None]
        if gpu:
            self.gpu_peak = max(self.gpu_peak or 0, sum(gpu))

    @property
    def uss_growth(self) -> int | None:
        """Sum over the role's processes of last − first USS read."""
        if not self.uss_first:
            return None
        return sum(self.uss_last[pid] - first for pid, first in self.uss_first.items())


@dataclass(kw_only=True)
class WatchResult:
    run: RunDir
    target: str
    samples: int = 0
    duration_s: float = 0.0
    end_reason: str = ""
    roles: dict[str, RoleSummary] = field(default_factory=dict)
    nvml_reason: str | None = None  # None: NVML available
    full_info_budget: float = 0.01
    full_info_every: int = 1  # the sparsest any process got
    walk_every: int = 1
    full_info_cost_ms: float = 0.0  # the dearest process's CPU ms for one memory_full_info
    notes: list[str] = field(default_factory=list)
    sys_available_min: int | None = None
    sys_total: int | None = None
    shm_used_peak: int | None = None


class _Stop(Exception):
    """SIGTERM: end like Ctrl-C, with the summary and every record kept."""


def _system() -> dict[str, Any]:
    vm = psutil.virtual_memory()
    out: dict[str, Any] = {"sys_available_bytes": vm.available, "sys_total_bytes": vm.total}
    try:
        shm = shutil.disk_usage(SHM_PATH)
        out.update(shm_used_bytes=shm.used, shm_free_bytes=shm.free)
    except OSError:
        out.update(shm_used_bytes=None, shm_free_bytes=None)
    return out


class Sampler:
    """One sample of every process in the tree per `sample()` call, written as it is taken."""

    def __init__(
        self,
        config: MemwatchConfig,
        tree: ProcessTree,
        writer: JsonlWriter,
        events: JsonlWriter,
        gpu: nvml.Nvml,
    ):
        self.config = config
        self.tree = tree
        self.writer = writer
        self.events = events
        self.gpu = gpu
        self.index = 0
        self.full_cost_s: dict[int, float] = {}  # pid -> smoothed CPU seconds of one memory_full_info
        self.full_every: dict[int, int] = {}  # pid -> take it every k-th sample
        self.full_denied: set[int] = set()
        self.basic = BasicReader()
        self.walk_cost_s: float | None = None  # smoothed CPU seconds of one walk of /proc
        self.walk_every = 1
        self.nvml_pid_note_done = False
        self.notes: list[str] = []

    def sample(self) -> list[dict[str, Any]] | None:
        """Records of this sample; None when the target has exited."""
        new: list[int] = []
        gone: list[int] = []
        if self.index % self.walk_every == 0:
            try:
                new, gone = self.tree.refresh()
            except psutil.NoSuchProcess:
                return None
            self._schedule_walk(self.tree.walk_cpu_s)
        for pid in new:
            self._write_process(pid)
        for pid in gone:
            self.events.write({"kind": "exit", "pid": pid, "role": self.tree.roles[pid].role})
        t = time.time()
        common = {"t": t, "sample": self.index, **_system()}
        gpus = self._gpu()
        records = []
        for pid, proc in list(self.tree.procs.items()):
            every = self.full_every.get(pid, 1)
            record = self._one(proc, take_full=(self.index + pid) % every == 0)  # pid staggers the k-th
            if record is None:
                if pid == self.tree.root.pid and self.tree.root_gone():
                    return None
                if pid == self.tree.root.pid:  # unreadable this once (access denied): the watch goes on
                    continue
                self.tree.forget(pid)
                self.events.write({"kind": "exit", "pid": pid, "role": self.tree.roles[pid].role})
                continue
            role = self.tree.roles[pid]
            record.update(pid=pid, role=role.role, rank=role.rank, uss_every=every)
            record.update(**gpus.get(pid, _NO_GPU), **common)
            records.append(record)
            self.writer.write(record)
        self.index += 1
        return records

    def _one(self, proc: psutil.Process, *, take_full: bool) -> dict[str, Any] | None:
        """One process's figures; None once it has exited."""
        try:
            record = self.basic.read(proc)
        except psutil.AccessDenied:
            self._note_once(proc.pid, "its memory cannot be read (access denied); it is left out")
            return None
        if record is None:
            return None
        record.update(uss=None, pss=None, swap=None)
        if not take_full or proc.pid in self.full_denied:
            return record
        start = time.thread_time()  # CPU, not wall: on a busy machine waiting is not our cost
        try:
            full = proc.memory_full_info()
            record.update(uss=full.uss, pss=full.pss, swap=full.swap)
        except psutil.AccessDenied:
            self.full_denied.add(proc.pid)
            self._note_once(proc.pid, "USS/PSS not readable (access denied); recording RSS only for it")
        except psutil.NoSuchProcess:
            return None
        self._schedule_full(proc.pid, time.thread_time() - start)
        return record

    def _schedule_walk(self, spent_s: float) -> None:
        """Walk /proc every k-th sample, k keeping the walk within its budget of one core: psutil
        reads every process's /proc/PID/stat to find children (~10 µs each, 1 ms on a quiet box)."""
        previous = self.walk_cost_s
        self.walk_cost_s = spent_s if previous is None else 0.7 * previous + 0.3 * spent_s
        budget_s = self.config.walk_budget * self.config.interval_s
        self.walk_every = max(1, math.ceil(self.walk_cost_s / budget_s))

    def _schedule_full(self, pid: int, spent_s: float) -> None:
        """Each process gets an equal share of the budget; one that costs more than its share per
        interval (a big rank: the kernel walks its page tables) is read every k-th sample instead."""
        previous = self.full_cost_s.get(pid)
        cost = spent_s if previous is None else 0.7 * previous + 0.3 * spent_s
        self.full_cost_s[pid] = cost
        share_s = self.config.full_info_budget * self.config.interval_s / max(1, len(self.tree.procs))
        self.full_every[pid] = max(1, math.ceil(cost / share_s))

    def _gpu(self) -> dict[int, dict[str, Any]]:
        if not self.gpu.available:
            return {}
        totals = {d.index: d.total_bytes for d in self.gpu.devices()}
        per_pid = self.gpu.process_memory()
        mine = {
            pid: {
                "gpu_bytes": entry.used_bytes,
                "gpu_devices": entry.devices,
                "gpu_total_bytes": totals.get(entry.devices[0]) if entry.devices else None,
            }
            for pid, entry in per_pid.items()
            if pid in self.tree.procs
        }
        if per_pid and not mine and not self.nvml_pid_note_done:
            self.nvml_pid_note_done = True
            if not any(psutil.pid_exists(pid) for pid in per_pid):
                self.notes.append(
                    "NVML lists GPU processes whose PIDs do not exist here: a container without "
                    "--pid=host sees other PIDs than NVML, so per-process GPU memory cannot be matched"
                )
                self.events.write({"kind": "note", "note": self.notes[-1]})
        return mine

    def _write_process(self, pid: int) -> None:
        proc, role = self.tree.procs[pid], self.tree.roles[pid]
        self.events.write(
            {
                "kind": "process",
                "pid": pid,
                "ppid": safe_call(proc.ppid),
                "name": safe_call(proc.name),
                "cmdline": cmdline_of(proc)[:400],
                "create_time": safe_call(proc.create_time),
                "role": role.role,
                "rank": role.rank,
                "rank_source": role.rank_source,
                "environ_readable": pid not in self.tree.env_denied,
            }
        )

    def _note_once(self, pid: int, text: str) -> None:
        line = f"PID {pid} (user {owner_of(pid)}): {text}"
        if line not in self.notes:
            self.notes.append(line)
            self.events.write({"kind": "note", "pid": pid, "note": line})
            print(f"memwatch: note: {line}", file=sys.stderr)


_NO_GPU: dict[str, Any] = {"gpu_bytes": None, "gpu_devices": [], "gpu_total_bytes": None}


@contextlib.contextmanager
def _sigterm_stops() -> Iterator[None]:
    """SIGTERM (a scheduler ending the watcher) ends it like Ctrl-C: summary printed, records kept."""

    def handler(signum: int, frame: object) -> None:
        raise _Stop

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def watch(config: MemwatchConfig, run_path: Path, *, progress: Callable[[str], None] = print) -> WatchResult:
    """Sample the tree under `config.pid` into `run_path` until it exits, the duration ends, Ctrl-C or
    SIGTERM. A PID that cannot be watched raises UserError before the run directory is created."""
    root = attach(config.pid)
    run = RunDir.create(run_path)
    tree = ProcessTree(root)
    gpu = nvml.get()
    result = WatchResult(run=run, target=f"PID {root.pid} ({safe_call(root.name)})", nvml_reason=gpu.reason)
    _record_meta(run, config)
    progress(
        f"memwatch: watching {result.target} every {config.interval_s:g} s into {run.path} (Ctrl-C ends it)"
    )
    started = time.monotonic()
    index = config.stream_index
    writer_of = (lambda name: JsonlWriter(run.stream_path(name, index))) if index is not None else run.writer
    with writer_of(STREAM) as writer, writer_of(EVENTS) as events, _sigterm_stops():
        events.write(
            {
                "kind": "start",
                "target_pid": root.pid,
                "interval_s": config.interval_s,
                "duration_s": config.duration_s,
                "nvml_available": gpu.available,
                "nvml_reason": gpu.reason,  # recorded once: no driver means no GPU fields below
            }
        )
        sampler = Sampler(config, tree, writer, events, gpu)
        result.end_reason = _loop(config, sampler, result, started, progress)
        result.duration_s = time.monotonic() - started
        result.samples = sampler.index
        result.full_info_budget = config.full_info_budget
        result.walk_every = sampler.walk_every
        result.full_info_every = max(sampler.full_every.values(), default=1)
        result.full_info_cost_ms = max(sampler.full_cost_s.values(), default=0.0) * 1e3
        result.notes = sampler.notes
        events.write(
            {
                "kind": "end",
                "reason": result.end_reason,
                "samples": result.samples,
                "duration_s": round(result.duration_s, 3),
            }
        )
    # the file's columnar part for the report (frames.file_parts): one memwatch a node writes one file each
    part_writer.write_at_exit(writer.path, STREAM, copies=_nodes() if index is not None else 1)
    if index is not None:  # merged one level deep: each node's entry is kept beside the others
        from ciuic_doctor.cluster import node_name

        run.update_meta(
            memwatch_nodes={
                node_name(): {
                    "index": index,
                    "status": result.end_reason,
                    "samples": result.samples,
                    "target_pid": root.pid,
                }
            }
        )
    run.record_probe(
        "memwatch",
        status=result.end_reason,
        samples=result.samples,
        target_pid=root.pid,
        nvml_available=gpu.available,
        nvml_reason=gpu.reason,
    )
    return result


def _nodes() -> int:
    """The nodes of the Slurm allocation (one memwatch each), 1 outside one."""
    raw = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1"
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def _loop(
    config: MemwatchConfig,
    sampler: Sampler,
    result: WatchResult,
    started: float,
    progress: Callable[[str], None],
) -> str:
    next_tick = started
    next_progress = started + config.progress_every_s
    try:
        while True:
            records = sampler.sample()
            if records is None:
                return "target exited"
            _accumulate(result, records)
            now = time.monotonic()
            if now >= next_progress:
                next_progress += config.progress_every_s
                total = sum(r["rss"] for r in records)
                progress(
                    f"  {now - started:6.0f} s  {len(records)} processes  rss sum {total / 2**20:,.0f} MiB"
                )
            if config.duration_s is not None and now - started >= config.duration_s:
                return "duration reached"
            next_tick += config.interval_s
            if next_tick < now:  # a slow sample: skip the missed ticks rather than burst
                next_tick = now + config.interval_s - (now - started) % config.interval_s
            time.sleep(max(0.0, next_tick - time.monotonic()))
    except KeyboardInterrupt:
        return "interrupted"
    except _Stop:
        return "terminated"


def _accumulate(result: WatchResult, records: list[dict[str, Any]]) -> None:
    by_role: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_role.setdefault(record["role"], []).append(record)
    for role, group in by_role.items():
        result.roles.setdefault(role, RoleSummary(role=role)).add(group)
    first = records[0] if records else {}
    if first.get("sys_available_bytes") is not None:
        avail = first["sys_available_bytes"]
        result.sys_available_min = min(avail, result.sys_available_min or avail)
        result.sys_total = first["sys_total_bytes"]
    if first.get("shm_used_bytes") is not None:
        result.shm_used_peak = max(first["shm_used_bytes"], result.shm_used_peak or 0)


def _record_meta(run: RunDir, config: MemwatchConfig) -> None:
    run.record_environment(with_torch=False)  # memwatch never imports torch
    run.record_probe(
        "memwatch",
        status="running",
        argv=sys.argv,
        target_pid=config.pid,
        interval_s=config.interval_s,
        duration_s=config.duration_s,
    )
