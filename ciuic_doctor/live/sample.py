"""Per-rank figures read from /proc and NVML at each sample: CPU %, RSS, USS, threads, I/O rates, the
process state, its DataLoader workers' CPU and memory, and its GPUs' utilisation, memory, power and clocks.

Costs (why raw /proc): /proc/PID/stat + statm + io are three small reads (~10 µs); USS needs
/proc/PID/smaps_rollup, which walks every mapping's page tables: 16 ms for one 500 MB torch rank here
(benchmarks/live_overhead.py's profile), so USS is read one rank at a time, round robin, only while
those reads have cost under `uss_budget` of one core (0.3 %): at 8 ranks each rank's USS is ~50 s old.
Nothing here signals or pauses a process (a stopped rank stays stopped).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.live.discover import JobLayout

HAS_PROC = os.path.exists("/proc/self/statm")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if HAS_PROC else 4096
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if HAS_PROC else 100
USS_START_S = 0.25  # CPU seconds the first USS reads may take beyond the budget (8 ranks: ~130 ms)
STATES = {"R": "running", "S": "sleeping", "D": "disk wait", "T": "stopped", "t": "traced", "Z": "zombie"}


def _read(path: str, limit: int = 8192) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


@dataclass(kw_only=True)
class ProcFigures:
    """One process at one instant; `cpu_seconds` and the byte counters are totals since it started."""

    state: str
    cpu_seconds: float
    rss_bytes: int
    threads: int
    start_ticks: int
    read_bytes: int | None = None
    write_bytes: int | None = None


def read_proc(pid: int) -> ProcFigures | None:
    """stat + statm + io of `pid`; None once it is gone. io is None where it may not be read."""
    try:
        stat, statm = _read(f"/proc/{pid}/stat"), _read(f"/proc/{pid}/statm")
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # the name in (...) may hold spaces
    figures = ProcFigures(
        state=fields[0].decode(),
        cpu_seconds=(int(fields[11]) + int(fields[12])) / TICKS_PER_S,
        rss_bytes=int(statm.split()[1]) * PAGE_BYTES,
        threads=int(fields[17]),
        start_ticks=int(fields[19]),
    )
    try:
        for line in _read(f"/proc/{pid}/io").splitlines():
            key, _, value = line.partition(b":")
            if key == b"rchar":
                figures.read_bytes = int(value)
            elif key == b"wchar":
                figures.write_bytes = int(value)
    except OSError:
        pass
    return figures


def read_uss(pid: int) -> int | None:
    """Unique set size: private clean + dirty pages (smaps_rollup), None where unreadable."""
    try:
        text = _read(f"/proc/{pid}/smaps_rollup", 4096)
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        if line.startswith((b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")):
            total += int(line.split()[1]) * 1024
    return total


@dataclass(kw_only=True)
class RankSample:
    """What top shows and export serves for one rank at one sample (None: not known)."""

    rank: int
    pid: int
    up: bool
    state: str = "?"
    cpu_percent: float | None = None
    cpu_seconds: float | None = None
    rss_bytes: int | None = None
    uss_bytes: int | None = None
    threads: int | None = None
    read_bytes_per_s: float | None = None
    write_bytes_per_s: float | None = None
    read_bytes: int | None = None
    write_bytes: int | None = None
    workers: int = 0
    workers_cpu_percent: float | None = None
    workers_rss_bytes: int | None = None
    gpus: list[dict[str, Any]] = field(default_factory=list)


@dataclass(kw_only=True)
class _Prev:
    t: float
    figures: ProcFigures


class Sampler:
    """Remembers the previous reading of each process, for rates; one instance per view."""

    def __init__(self, *, nvml: Any = None, uss_budget: float = 0.003) -> None:
        self._prev: dict[int, _Prev] = {}
        self._nvml = nvml
        self._uss_budget = uss_budget
        self._uss: dict[int, int | None] = {}
        self._uss_cost_s = 0.0
        self._uss_next = 0  # round robin over the ranks
        self._started = time.monotonic()
        self.cpu_s = 0.0  # this sampler's own CPU time, for the exporter's overhead gauge

    def _rate(self, pid: int, now: float, figures: ProcFigures) -> tuple[float | None, ...]:
        prev = self._prev.get(pid)
        self._prev[pid] = _Prev(t=now, figures=figures)
        if prev is None or prev.figures.start_ticks != figures.start_ticks or now <= prev.t:
            return None, None, None
        dt = now - prev.t
        cpu = 100 * (figures.cpu_seconds - prev.figures.cpu_seconds) / dt
        read = write = None
        if figures.read_bytes is not None and prev.figures.read_bytes is not None:
            read = max(0.0, (figures.read_bytes - prev.figures.read_bytes) / dt)
        if figures.write_bytes is not None and prev.figures.write_bytes is not None:
            write = max(0.0, (figures.write_bytes - prev.figures.write_bytes) / dt)
        return round(cpu, 1), read, write

    def sample(self, layout: JobLayout) -> dict[int, RankSample]:
        started = time.thread_time()
        now = time.monotonic()
        devices = self._device_figures()
        out: dict[int, RankSample] = {}
        live: set[int] = set()
        for rank, proc in layout.ranks.items():
            figures = read_proc(proc.pid)
            if figures is None or figures.state in ("Z", "X"):
                out[rank] = RankSample(rank=rank, pid=proc.pid, up=False, state="exited")
                continue
            live.add(proc.pid)
            cpu, read, write = self._rate(proc.pid, now, figures)
            sample = RankSample(
                rank=rank,
                pid=proc.pid,
                up=True,
                state=STATES.get(figures.state, figures.state),
                cpu_percent=cpu,
                cpu_seconds=figures.cpu_seconds,
                rss_bytes=figures.rss_bytes,
                threads=figures.threads,
                read_bytes_per_s=read,
                write_bytes_per_s=write,
                read_bytes=figures.read_bytes,
                write_bytes=figures.write_bytes,
                gpus=[devices[g] for g in proc.gpus if g in devices],
            )
            worker_cpu, worker_rss = 0.0, 0
            for pid in proc.workers:
                wf = read_proc(pid)
                if wf is None:
                    continue
                live.add(pid)
                wcpu, _, _ = self._rate(pid, now, wf)
                worker_cpu += wcpu or 0.0
                worker_rss += wf.rss_bytes
                sample.workers += 1
            if sample.workers:
                sample.workers_cpu_percent, sample.workers_rss_bytes = round(worker_cpu, 1), worker_rss
            out[rank] = sample
        self._read_uss(out, now)
        for pid in [p for p in self._prev if p not in live]:
            del self._prev[pid]
            self._uss.pop(pid, None)
        self.cpu_s += time.thread_time() - started
        return out

    def _read_uss(self, out: dict[int, RankSample], now: float) -> None:
        """USS of the ranks not read yet (within a one-off USS_START_S allowance, so the first frame has
        them), else of the next rank in turn, while the reads stay within the budget."""
        ranks = sorted(r for r, s in out.items() if s.up)
        unread = [r for r in ranks if out[r].pid not in self._uss]
        allowed = self._uss_budget * max(1.0, now - self._started)
        for rank in unread or ranks[self._uss_next % len(ranks) :][:1] if ranks else []:
            if self._uss_cost_s > allowed + (USS_START_S if unread else 0.0):
                break
            self._uss_next += 0 if unread else 1
            began = time.thread_time()
            self._uss[out[rank].pid] = read_uss(out[rank].pid)
            self._uss_cost_s += time.thread_time() - began
        for sample in out.values():
            sample.uss_bytes = self._uss.get(sample.pid)

    def _device_figures(self) -> dict[int, dict[str, Any]]:
        if self._nvml is None or not getattr(self._nvml, "available", False):
            return {}
        return {d["index"]: d for d in self._nvml.device_figures()}
