"""The memory analysis's data layer and shared rules: the run's records indexed per rank and process
(`_Data`), one quantity as a `Series`, the warm-up cut, the robust trend, and the growth test every memory
check applies (`_grows`).

Split from `memory.py` so that the checks (`memory.leaks`, `memory.cuda`, `memory.workers`) import it
from below instead of from the module that runs them. The numbers behind the rules (warm-up of 3 steps
and 10 % of the span, 8 points, Mann–Kendall z ≥ 3, R² ≥ 0.5, growth ≥ max(16 MiB, 0.5 % of the level))
are stated in `memory.py`'s docstring, the contract of the findings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ciuic_doctor.analysis.memory.steps import StepColumns, binned
from ciuic_doctor.analysis.stats.trend import Trend, robust_trend
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir

PROBE = "memory"
MIB = 2**20

WARMUP_STEPS = 3  # optimizer state appears at steps 1–2 (reference/memory.md)
WARMUP_FRACTION = 0.1  # and the first 10 % of any series: allocator caches and page cache settle
MIN_POINTS = 8
LEAK_Z = 3.0
LEAK_R2 = 0.5
LEAK_MIN_BYTES = 16 * MIB
LEAK_MIN_FRACTION = 0.005  # of the level: 150 MB on a 30 GB rank, but never below LEAK_MIN_BYTES


@dataclass(kw_only=True)
class Series:
    """One quantity of one process against steps (x_unit "step") or seconds (x_unit "s")."""

    x: list[float]
    y: list[float]
    x_unit: str
    metric: str
    source: str
    pid: int | None = None
    host: str | None = None


def _nvml_reason(run: RunDir) -> str | None:
    """Why memwatch had no per-process GPU figures, as its first start event says (None: it had them).
    Two columns of the events, read column-wise: the events hold a line per watched process (112,501 at
    100,000 ranks), and reading them all as records took 8 s of a report for this one string."""
    from ciuic_doctor.rundir.frames import read_stream

    if not run.has_stream("memwatch_events"):
        return None
    events = read_stream(run, "memwatch_events", ["kind", "nvml_reason"], cached=False).table
    starts = [i for i, kind in enumerate(events.column("kind").to_pylist()) if kind == "start"]
    return events.column("nvml_reason")[starts[0]].as_py() if starts else None


class _Data:
    """The run's records, indexed the ways the checks need them: steps and memwatch samples column-wise
    (`StepColumns`, `MemwatchColumns`), a rank's or a process's records built only when a check asks."""

    def __init__(self, run: RunDir) -> None:
        from ciuic_doctor.analysis.memory.columns import MemwatchColumns
        from ciuic_doctor.rundir.frames.beside import read_beside

        with read_beside(run, "steps"):  # side by side: 6.4-6.8 -> 4.4-4.6 s at 10,000 ranks x 1,000 steps
            self.memwatch = MemwatchColumns(run)
            self.nvml_reason: str | None = _nvml_reason(run)  # None: NVML was there, or no events
        self.steps = StepColumns(run)
        self.by_pid = self.memwatch  # pid -> its samples as records (built when asked)
        self.role_pids: dict[str, list[int]] = {}
        for pid, role in self.memwatch.roles.items():  # a pid's last role wins: a root relabelled "agent"
            self.role_pids.setdefault(role, []).append(pid)
        self.device_totals = _meta_device_totals(run.read_meta())
        # Issue 23's hook: the first step of each rank the leak trends may use (its first optimizer step),
        # rank -> step; None keeps every step after the warm-up.
        self.first_step: dict[int, float] | None = None
        # (pass key -> its blocks' results): the grouped passes `memory.blocks.run_ahead` made together
        self.made_ahead: dict[Any, list[Any]] = {}

    def gpu_absent_reason(self) -> str:
        """Why the samples carry no per-process GPU memory."""
        if not self.memwatch.rows:
            return "memwatch did not sample this run"
        return self.nvml_reason or "NVML listed none of the watched processes"

    def ranks(self) -> list[int]:
        from_roles = {int(r.split()[1]) for r in self.role_pids if r.startswith("rank ")}
        return sorted(from_roles | set(self.steps))

    def rank_pid(self, rank: int) -> int | None:
        """The rank's process (the one watched longest when torchrun restarted it)."""
        pids = self.role_pids.get(f"rank {rank}", [])
        bounds = self.memwatch.bounds()
        return max(pids, key=lambda p: bounds[p][1] - bounds[p][0], default=None)

    def rank_samples(self, rank: int) -> list[dict[str, Any]]:
        """Samples of the rank's process, as records (a few ranks' worth: leaking ones)."""
        pid = self.rank_pid(rank)
        return [] if pid is None else self.memwatch[pid]

    def steps_field(self, rank: int, name: str) -> tuple[list[float], list[float]]:
        import numpy as np

        steps, values = self.steps.column(rank, "step"), self.steps.column(rank, name)
        keep = np.isfinite(values) & np.isfinite(steps)
        return steps[keep].tolist(), values[keep].tolist()

    def step_of(self, rank: int, times: list[float]) -> list[float] | None:
        """Each time as a (fractional) step of `rank`, by interpolating its step records' end times;
        None when the rank has too few steps. Times outside the stepped span become NaN."""
        import numpy as np

        t, step = self.steps.column(rank, "t"), self.steps.column(rank, "step")
        keep = np.isfinite(t) & np.isfinite(step)
        if keep.sum() < 2:
            return None
        out = np.interp(times, t[keep], step[keep], left=np.nan, right=np.nan)
        return [float(v) for v in out]

    def step_time_s(self, rank: int) -> float | None:
        import numpy as np

        times = self.steps.column(rank, "step_time_s")
        times = times[np.isfinite(times) & (times != 0)]
        return float(np.median(times)) if len(times) else None


def _meta_device_totals(meta: dict[str, Any]) -> list[int]:
    env = meta.get("env") or {}
    return [d["total_memory_bytes"] for d in env.get("devices") or [] if d.get("total_memory_bytes")]


def _warm(series: Series) -> Series:
    """Drop the warm-up: the first WARMUP_STEPS steps (or none in time) and the first 10 % of the span."""
    import numpy as np

    if not len(series.x):
        return series
    x, y = np.asarray(series.x, dtype=float), np.asarray(series.y, dtype=float)
    first, last = x.min(), x.max()
    skip = (WARMUP_STEPS if series.x_unit == "step" else 0.0) + WARMUP_FRACTION * (last - first)
    keep = x >= first + skip
    return Series(
        x=x[keep].tolist(),
        y=y[keep].tolist(),
        **{k: getattr(series, k) for k in ("x_unit", "metric", "source", "pid", "host")},
    )


def _trend(series: Series) -> Trend | None:
    warm = _warm(series)
    # Steady points, not samples: memwatch's 10 Hz samples of a 4-step checkup were hundreds of points on
    # a 4-step span of start-up growth, and called a leak. Against steps the span itself must
    # cover MIN_POINTS steps after the warm-up; too few is not_run.
    if len(set(warm.x)) < MIN_POINTS:
        return None
    if series.x_unit == "step" and max(warm.x) - min(warm.x) < MIN_POINTS - 1:
        return None
    return robust_trend(*binned(warm.x, warm.y))


def _grows(trend: Trend, min_bytes: float) -> bool:
    floor = max(min_bytes, LEAK_MIN_FRACTION * abs(trend.y_start))
    return trend.z >= LEAK_Z and trend.r2 >= LEAK_R2 and trend.growth >= floor


def _slope_evidence(trend: Trend, unit: str) -> dict[str, Any]:
    key = "slope_bytes_per_step" if unit == "step" else "slope_bytes_per_s"
    return {
        key: round(trend.slope, 1),
        f"growth_mb_per_{unit}": round(trend.slope / MIB, 4),
        "r2": round(trend.r2, 3),
        "mann_kendall_z": round(trend.z, 2),
        "points": trend.n,
    }


def _not_run(check: str, why: str, *, where: dict[str, Any] | None = None, **evidence: Any) -> Finding:
    return Finding(
        probe=PROBE, check=check, verdict="not_run", summary=why, evidence=evidence, where=where or {}
    )
