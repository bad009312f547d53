"""One live view of a running job: discovery, samples, the steps streams and the verdicts, as a `Frame`
both fronts (top, export) render. The API the fronts share:

    job = LiveJob(pid=12345)            # or LiveJob(run_dir=Path("reports/mine"))
    frame = job.update()                # call every sampling interval; each call is one sample
    for row in frame.rows:
        row.rank, row.sample.cpu_percent, row.figures.get("steps_per_s"), row.verdict.status

The process tree is walked again every `rediscover_s` (psutil's walk reads every process of the host),
the ranks' /proc files at every update.
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ciuic_doctor.live.discover import Discovery, JobLayout
from ciuic_doctor.live.sample import RankSample, Sampler
from ciuic_doctor.live.streams import StepsTail, StepWindow
from ciuic_doctor.live.verdicts import MemoryHistory, RankVerdict, Thresholds, judge
from ciuic_doctor.live.waits import read_waits

SERIES_POINTS = 60  # sparkline length


@dataclass(kw_only=True)
class Row:
    rank: int
    pid: int
    host: str
    local_rank: int | None
    gpu: str  # the NVML index of the device the rank uses, "" when none is known
    sample: RankSample
    figures: dict[str, Any]
    verdict: RankVerdict
    workers: int = 0


@dataclass(kw_only=True)
class Frame:
    t: float
    script: str
    world_size: int | None
    hosts: list[str]
    run_id: str | None
    run_dir: Path | None
    agents: list[int]
    rows: list[Row]
    step: int | None = None
    steps_per_s: float | None = None
    tokens_per_s: float | None = None  # summed over the ranks that record tokens (`tokens_ranks` of them)
    tokens_ranks: int = 0
    step_time_series: list[float] = field(default_factory=list)
    loss_series: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    alive: bool = True


class LiveJob:
    def __init__(
        self,
        *,
        pid: int | None = None,
        run_dir: Path | None = None,
        nvml: Any = None,
        rediscover_s: float = 5.0,
        limits: Thresholds | None = None,
    ) -> None:
        self.discovery = Discovery(pid=pid, run_dir=run_dir, nvml=nvml)
        self.sampler = Sampler(nvml=nvml)
        self.memory = MemoryHistory()
        self.limits = limits or Thresholds()
        self._rediscover_s = rediscover_s
        self._discovered_at = -1e9
        self.layout: JobLayout | None = None
        self.tails: dict[Path, StepsTail] = {}
        self.host = socket.gethostname()

    @staticmethod
    def _run_dirs(layout: JobLayout) -> set[Path]:
        dirs = {r.run_dir for r in layout.ranks.values() if r.run_dir is not None}
        if layout.run_dir is not None:
            dirs.add(layout.run_dir)
        return dirs

    def _windows(self, layout: JobLayout) -> dict[int, StepWindow]:
        dirs = self._run_dirs(layout)
        windows: dict[int, StepWindow] = {}
        for run_dir in sorted(dirs):
            tail = self.tails.setdefault(run_dir, StepsTail(run_dir))
            windows.update(tail.poll())
        return {r: w for r, w in windows.items() if r in layout.ranks}

    def update(self) -> Frame:
        started = time.monotonic()
        if self.layout is None or started - self._discovered_at >= self._rediscover_s:
            fresh = self.discovery.refresh()
            if self.layout is not None:  # an exited rank stays, shown DOWN, until a process takes its rank
                for rank, proc in self.layout.ranks.items():
                    fresh.ranks.setdefault(rank, proc)
                fresh.ranks = dict(sorted(fresh.ranks.items()))
            self.layout = fresh
            self._discovered_at = started
        layout = self.layout
        now = time.time()
        samples = self.sampler.sample(layout)
        self.memory.add(now, samples)
        windows = self._windows(layout)
        figures = {rank: windows[rank].figures(now) if rank in windows else {} for rank in layout.ranks}
        waits = read_waits(self._run_dirs(layout))
        verdicts = judge(samples, windows, figures, self.memory, self.limits, waits=waits)
        rows = [
            Row(
                rank=rank,
                pid=proc.pid,
                host=proc.host,
                local_rank=proc.local_rank,
                gpu=str(proc.gpus[0]) if proc.gpus else "",
                sample=samples[rank],
                figures=figures.get(rank, {}),
                verdict=verdicts[rank],
                workers=len(proc.workers),
            )
            for rank, proc in layout.ranks.items()
            if rank in samples
        ]
        frame = Frame(
            t=now,
            script=layout.script,
            world_size=layout.world_size,
            hosts=layout.hosts,
            run_id=layout.run_id,
            run_dir=layout.run_dir,
            agents=layout.agents,
            rows=rows,
            notes=list(layout.notes),
            alive=self.discovery.alive(),
        )
        _job_figures(frame, windows)
        for tail in self.tails.values():
            frame.notes.extend(f"{name}: {why}" for name, why in sorted(tail.refused.items()))
        return frame


def _job_figures(frame: Frame, windows: dict[int, StepWindow]) -> None:
    """Header figures: the newest step, the median steps/s, the summed tokens/s, and per step the slowest
    rank's step time and the ranks' mean loss (the sparklines).

    The job's tokens/s is the sum of its ranks': right for data parallelism (each rank trains its own
    tokens); tensor-parallel peers see the same tokens, so there it counts them once per peer."""
    steps = [r.figures["step"] for r in frame.rows if r.figures.get("step") is not None]
    frame.step = max(steps) if steps else None
    rates = [r.figures["steps_per_s"] for r in frame.rows if r.figures.get("steps_per_s")]
    frame.steps_per_s = statistics.median(rates) if rates else None
    tokens = [r.figures["tokens_per_s"] for r in frame.rows if r.figures.get("tokens_per_s")]
    frame.tokens_per_s = sum(tokens) if tokens else None
    frame.tokens_ranks = len(tokens)
    per_step_time: dict[int, float] = {}
    per_step_loss: dict[int, list[float]] = {}
    for window in windows.values():
        for record in list(window.records)[-SERIES_POINTS:]:
            step = record["step"]
            value = record.get("step_time_s")
            if isinstance(value, (int, float)):
                per_step_time[step] = max(per_step_time.get(step, 0.0), float(value))
            loss = record.get("loss")
            if isinstance(loss, (int, float)) and math.isfinite(loss):
                per_step_loss.setdefault(step, []).append(float(loss))
    frame.step_time_series = [per_step_time[s] for s in sorted(per_step_time)][-SERIES_POINTS:]
    frame.loss_series = [statistics.fmean(per_step_loss[s]) for s in sorted(per_step_loss)][-SERIES_POINTS:]
