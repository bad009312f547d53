"""The job's own figures in one verify run directory: mean step time and time before backward after the
warm-up (compare.steps.job_series: per step the median over ranks), host RSS level, skipped steps."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(kw_only=True)
class RunFigures:
    step_time_s: float | None = None
    pre_backward_s: float | None = None
    rss_bytes: float | None = None
    skipped: int = 0
    steps: int = 0
    records: list[dict[str, Any]] | None = None

    def level(self, key: str) -> float | None:
        return {"step_time": self.step_time_s, "pre_backward": self.pre_backward_s, "rss": self.rss_bytes}[
            key
        ]


def run_figures(path: str | Path) -> RunFigures:
    """The job's figures in one run directory (nothing when it left no step records)."""
    from ciuic_doctor.compare.steps import job_series
    from ciuic_doctor.rundir.store import RunDir

    path = Path(path)
    if not path.is_dir():
        return RunFigures()
    records = RunDir(path).read("steps").records
    out = RunFigures(records=records)
    for attr, key in (
        ("step_time_s", "step_time_s"),
        ("pre_backward_s", "pre_backward_s"),
        ("rss_bytes", "rss"),
    ):
        series = job_series(records, key)
        if series:
            setattr(out, attr, statistics.fmean(series))
    first = min((r["rank"] for r in records if isinstance(r.get("rank"), int)), default=0)
    mine = [r for r in records if r.get("rank", first) == first and isinstance(r.get("step"), int)]
    out.steps, out.skipped = len(mine), sum(1 for r in mine if r.get("skipped"))
    return out
