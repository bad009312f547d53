"""Every rank's memory series and its trend in one grouped pass: what `memory.data._trend`
does for one `Series`, done for all ranks of a job over a flat (rank, x, y) table.

The per-rank checks built a Series per rank and fitted it alone: at 1,024 ranks that was 4,114
robust_trend calls and 540,000 np.median calls, 73 s of a 136 s report. Here the series are chosen per
rank with the same rules (`host_fits`: memwatch's anon / uss / rss mapped to steps when enough samples
survive the warm-up, else the steps' uss / rss; `device_fits`: the steps' mem_allocated, else NVML's
bytes; `steps_fits`: one step field; `non_pytorch_fits`: NVML bytes − reserved at the rank's last step
before each sample), cut by the same warm-up, and fitted by `stats.batch_trend.fit`. A check then builds
findings
only for the ranks it names (growing, steepest); `RankFits.series(i)` gives one rank's `Series` back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from ciuic_doctor.analysis.memory.blocks import _DataBlock, in_blocks
from ciuic_doctor.analysis.memory.columns import pid_of
from ciuic_doctor.analysis.memory.data import (
    LEAK_MIN_FRACTION,
    LEAK_R2,
    LEAK_Z,
    MIN_POINTS,
    WARMUP_FRACTION,
    WARMUP_STEPS,
    Series,
    _Data,
)
from ciuic_doctor.analysis.stats.batch_trend import RankSeries, Trends, fit

if TYPE_CHECKING:
    import numpy as np

HOST_METRICS = ("anon", "uss", "rss")


@dataclass(kw_only=True)
class RankFits:
    """One series per rank (where it has one) and its trend; index i is `ranks[i]`. Fits joined from
    blocks of ranks (`join_fits`) keep no points (`points` is None): `series(i)` makes rank i's again
    from its own rows (`remake`). The checks read the series of a few ranks (the growing ones and the
    steepest), and keeping every block's points held 240 MB a fit at 10,000 ranks × 1,000 steps, two
    fits at once (host and device): 0.5 GB of the report's peak."""

    ranks: list[int]
    points: RankSeries | None  # every point of each rank's chosen series (not warmed), in series order
    has: np.ndarray  # bool: the rank has a series
    step_unit: np.ndarray  # bool: x is steps (else seconds since the first sample)
    metric: list[str | None] = field(default_factory=list)
    source: list[str | None] = field(default_factory=list)
    pid: list[int | None] = field(default_factory=list)
    host: list[str | None] = field(default_factory=list)
    trends: Trends | None = None
    remake: Callable[[int], RankFits] | None = None  # joined fits: rank i's fits alone, made again

    def series(self, i: int) -> Series:
        """Rank `ranks[i]`'s chosen series, every point (the warm-up too)."""
        if self.points is None:
            assert self.remake is not None, "fits joined from blocks are made with a remake"
            return self.remake(i).series(0)
        mask = self.points.ids == i
        return Series(
            x=self.points.x[mask].tolist(),
            y=self.points.y[mask].tolist(),
            x_unit="step" if self.step_unit[i] else "s",
            metric=self.metric[i] or "",
            source=self.source[i] or "",
            pid=self.pid[i],
            host=self.host[i],
        )

    def grows(self, min_bytes: float) -> np.ndarray:
        """`memory.data._grows` for every rank (False where there is no trend)."""
        import numpy as np

        t = self.trends
        if t is None:
            return np.zeros(len(self.ranks), dtype=bool)
        floor = np.maximum(min_bytes, LEAK_MIN_FRACTION * np.abs(t.y_start))
        with np.errstate(invalid="ignore"):
            return t.valid & (t.z >= LEAK_Z) & (t.r2 >= LEAK_R2) & (t.growth >= floor)


def trends_of(points: RankSeries, step_unit: np.ndarray, start: np.ndarray | None = None) -> Trends:
    """`memory.data._trend` of every series: warm-up cut (WARMUP_STEPS, in step units only, and the first
    WARMUP_FRACTION of the span), at least MIN_POINTS distinct x after it (and MIN_POINTS − 1 steps of
    span against steps), then the robust trend. `start`: first usable x per series."""
    import numpy as np

    if start is not None:  # a first step means nothing to a series against seconds
        start = np.where(step_unit, start, -np.inf)
    warm = points.warm(np.where(step_unit, float(WARMUP_STEPS), 0.0), WARMUP_FRACTION, start=start)
    span = warm.per_series(warm.x, "max") - warm.per_series(warm.x, "min")
    with np.errstate(invalid="ignore"):
        ok = (warm.distinct_x() >= MIN_POINTS) & (~step_unit | (span >= MIN_POINTS - 1))
    trends = fit(warm.select(ok[warm.ids]))
    trends.valid &= ok
    return trends


def _warm_counts(points: RankSeries, step_unit: np.ndarray) -> np.ndarray:
    import numpy as np

    return points.warm(np.where(step_unit, float(WARMUP_STEPS), 0.0), WARMUP_FRACTION).lengths()


# ---- building the series ---------------------------------------------------------------------------
class _Index:
    """The job's ranks as positions 0..n-1, and where each step row and each rank's process sits."""

    def __init__(self, data: _Data) -> None:
        import numpy as np

        from ciuic_doctor.analysis.stats.grouped import places

        self.ranks = data.ranks()
        self.rank_array = np.asarray(self.ranks, dtype=np.int64)
        steps = data.steps
        self.step_rank = steps.flat("rank").astype(np.int64) if len(steps) else np.empty(0, np.int64)
        self.step_id = places(self.rank_array, self.step_rank)
        self.pids = [data.rank_pid(r) for r in self.ranks]


def _from_steps(data: _Data, index: _Index, name: str) -> tuple[RankSeries, np.ndarray]:
    """(every rank's (step, value) points with both finite, in step-row order; points per rank)."""
    steps = data.steps
    if not len(steps):
        empty = RankSeries.of([], [], [], len(index.ranks))
        return empty, empty.lengths()
    series = RankSeries.of(index.step_id, steps.flat("step"), steps.flat(name), len(index.ranks))
    return series, series.lengths()


def _from_memwatch(
    data: _Data, index: _Index, metric: str, wanted: np.ndarray
) -> tuple[RankSeries, np.ndarray, np.ndarray]:
    """`memory.leaks._memwatch_series` for every rank in `wanted`: (points, step_unit, first time)."""
    import numpy as np

    from ciuic_doctor.analysis.memory.columns import group_interp

    count = len(index.ranks)
    bounds = data.memwatch.bounds()
    ids, rows = [], []
    for i in np.flatnonzero(wanted).tolist():
        start, stop = bounds[index.pids[i]]
        ids.append(np.full(stop - start, i))
        rows.append(np.arange(start, stop))
    if not rows:
        return RankSeries.of([], [], [], count), np.zeros(count, bool), np.full(count, np.nan)
    ids, rows = np.concatenate(ids), np.concatenate(rows)
    t, y = data.memwatch.flat("t")[rows], data.memwatch.flat(metric)[rows]
    present = ~np.isnan(y)
    ids, t, y = ids[present], t[present], y[present]
    step_t, step_no = data.steps.flat("t"), data.steps.flat("step")
    finite = np.isfinite(step_t) & np.isfinite(step_no)
    x_step = group_interp(ids, t, index.step_id[finite], step_t[finite], step_no[finite])
    mapped = np.bincount(ids[~np.isnan(x_step)], minlength=count)
    step_unit = mapped >= MIN_POINTS
    first_t = RankSeries(ids=ids, x=t, y=t, count=count).per_series(t, "first")
    use_step = step_unit[ids]
    x = np.where(use_step, x_step, t - first_t[ids])
    keep = ~use_step | ~np.isnan(x_step)
    return RankSeries.of(ids[keep], x[keep], y[keep], count), step_unit, first_t


def _memwatch_counts(data: _Data, index: _Index, metric: str) -> np.ndarray:
    """Samples of each rank's process that carry `metric`."""
    import numpy as np

    values = data.memwatch.flat(metric)
    bounds = data.memwatch.bounds()
    out = np.zeros(len(index.ranks), dtype=np.int64)
    if not len(values):
        return out
    present = np.r_[0, np.cumsum(~np.isnan(values))]
    for i, pid in enumerate(index.pids):
        if pid is not None:
            start, stop = bounds[pid]
            out[i] = present[stop] - present[start]
    return out


def _choose(count: int, candidates: list[tuple[RankSeries, np.ndarray, np.ndarray, dict[str, Any]]]):
    """Per rank, the first candidate it has with MIN_POINTS after the warm-up, else the first it has."""
    import numpy as np

    has = np.zeros((len(candidates), count), dtype=bool)
    usable = np.zeros_like(has)
    for k, (points, step_unit, present, _) in enumerate(candidates):
        has[k] = present
        usable[k] = present & (_warm_counts(points, step_unit) >= MIN_POINTS)
    pick = np.where(usable.any(axis=0), usable.argmax(axis=0), has.argmax(axis=0))
    return has.any(axis=0), pick


def _assemble(index: _Index, candidates, has: np.ndarray, pick: np.ndarray) -> RankFits:
    import numpy as np

    count = len(index.ranks)
    ids, xs, ys = [], [], []
    step_unit = np.zeros(count, dtype=bool)
    fits = RankFits(ranks=index.ranks, points=RankSeries.of([], [], [], count), has=has, step_unit=step_unit)
    fits.metric, fits.source, fits.pid, fits.host = (
        [None] * count,
        [None] * count,
        [None] * count,
        [None] * count,
    )
    for k, (points, unit, _, info) in enumerate(candidates):
        chosen = has & (pick == k)
        mask = chosen[points.ids]
        ids.append(points.ids[mask])
        xs.append(points.x[mask])
        ys.append(points.y[mask])
        step_unit[chosen] = unit[chosen]
        for i in np.flatnonzero(chosen).tolist():
            fits.metric[i] = info["metric"][i] if isinstance(info["metric"], list) else info["metric"]
            fits.source[i] = info["source"]
            fits.pid[i] = info["pid"][i]
            fits.host[i] = info["host"][i]
    fits.points = RankSeries.of(np.concatenate(ids), np.concatenate(xs), np.concatenate(ys), count)
    return fits


def _step_hosts(data: _Data, index: _Index) -> list[str | None]:
    return [data.steps.host(r) for r in index.ranks]


def _memwatch_hosts(data: _Data, index: _Index) -> list[str | None]:
    return [None if p is None else data.memwatch.host(p) for p in index.pids]


def fits_in_blocks(data: _Data, make: Callable[[Any], RankFits]) -> RankFits:
    """`make(data)` a block of ranks at a time (`memory.blocks.in_blocks`), joined; a rank's series is
    then made again from that rank's rows alone when asked (the same series: every rule is per rank,
    tests/test_scale_gpu.py checks each one against one block's)."""
    fits = in_blocks(data, make, join_fits, slim=without_points)
    if fits.points is None:  # `ranks`, not `fits`: a closure over fits would keep `data` in a cycle
        ranks = fits.ranks
        fits.remake = lambda i: make(_DataBlock(data, [ranks[i]]))
    return fits


def host_fits(data: _Data) -> RankFits:
    """`memory.leaks._host_series` and its trend, for every rank (a block of ranks at a time)."""
    return fits_in_blocks(data, _host_fits)


def _host_fits(data: _Data) -> RankFits:
    import numpy as np

    index = _Index(data)
    count = len(index.ranks)
    candidates = []
    # memwatch: the first metric the rank's process has MIN_POINTS samples of
    metric = [None] * count
    wanted = np.zeros(count, dtype=bool)
    for name in HOST_METRICS:
        enough = (_memwatch_counts(data, index, name) >= MIN_POINTS) & ~wanted
        for i in np.flatnonzero(enough).tolist():
            metric[i] = name
        wanted |= enough
    if wanted.any():
        parts = [
            _from_memwatch(data, index, name, wanted & np.array([m == name for m in metric]))
            for name in HOST_METRICS
        ]
        points = RankSeries.of(
            np.concatenate([p[0].ids for p in parts]),
            np.concatenate([p[0].x for p in parts]),
            np.concatenate([p[0].y for p in parts]),
            count,
        )
        step_unit = np.logical_or.reduce([p[1] for p in parts])
        info = {
            "metric": metric,
            "source": "memwatch",
            "pid": [pid_of(p) for p in index.pids],
            "host": _memwatch_hosts(data, index),
        }
        candidates.append((points, step_unit, wanted, info))
    # the steps' own uss, else rss
    chosen = np.zeros(count, dtype=bool)
    step_ids, step_x, step_y, step_metric = [], [], [], [None] * count
    for name in ("uss", "rss"):
        points, lengths = _from_steps(data, index, name)
        take = (lengths >= MIN_POINTS) & ~chosen
        mask = take[points.ids]
        step_ids.append(points.ids[mask])
        step_x.append(points.x[mask])
        step_y.append(points.y[mask])
        for i in np.flatnonzero(take).tolist():
            step_metric[i] = name
        chosen |= take
    if chosen.any():
        points = RankSeries.of(
            np.concatenate(step_ids), np.concatenate(step_x), np.concatenate(step_y), count
        )
        info = {
            "metric": step_metric,
            "source": "steps",
            "pid": [None] * count,
            "host": _step_hosts(data, index),
        }
        candidates.append((points, np.ones(count, dtype=bool), chosen, info))
    return _fitted(data, index, candidates)


def device_fits(data: _Data) -> RankFits:
    """`memory.leaks._device_series` and its trend, for every rank (a block of ranks at a time)."""
    return fits_in_blocks(data, _device_fits)


def _device_fits(data: _Data) -> RankFits:
    import numpy as np

    index = _Index(data)
    count = len(index.ranks)
    candidates = []
    points, lengths = _from_steps(data, index, "mem_allocated")
    on_steps = lengths >= MIN_POINTS
    info = {
        "metric": "mem_allocated",
        "source": "steps",
        "pid": [None] * count,
        "host": _step_hosts(data, index),
    }
    candidates.append((points.select(on_steps[points.ids]), np.ones(count, dtype=bool), on_steps, info))
    nvml = (_memwatch_counts(data, index, "gpu_bytes") >= MIN_POINTS) & ~on_steps
    if nvml.any():
        points, step_unit, _ = _from_memwatch(data, index, "gpu_bytes", nvml)
        info = {
            "metric": "gpu_bytes",
            "source": "memwatch",
            "pid": [pid_of(p) for p in index.pids],
            "host": _memwatch_hosts(data, index),
        }
        candidates.append((points, step_unit, nvml, info))
    has = np.logical_or.reduce([c[2] for c in candidates])
    pick = np.where(on_steps, 0, 1)
    fits = _assemble(index, candidates, has, pick)
    fits.trends = trends_of(fits.points, fits.step_unit, _start(data, index))
    return fits


def steps_fits(data: _Data, name: str, ranks: list[int] | None = None) -> RankFits:
    """One step field of every rank (or of `ranks`) against steps, and its trend (a block at a time)."""
    return fits_in_blocks(data, partial(_steps_fits, name=name, ranks=ranks))


def _steps_fits(data: _Data, name: str, ranks: list[int] | None) -> RankFits:
    import numpy as np

    index = _Index(data)
    count = len(index.ranks)
    points, lengths = _from_steps(data, index, name)
    has = lengths > 0
    if ranks is not None:
        has &= np.isin(index.rank_array, ranks)
    info = {"metric": name, "source": "steps", "pid": [None] * count, "host": _step_hosts(data, index)}
    candidates = [(points.select(has[points.ids]), np.ones(count, dtype=bool), has, info)]
    fits = _assemble(index, candidates, has, np.zeros(count, dtype=np.int64))
    fits.trends = trends_of(fits.points, fits.step_unit)
    return fits


def _fitted(data: _Data, index: _Index, candidates) -> RankFits:
    import numpy as np

    count = len(index.ranks)
    if not candidates:
        fits = RankFits(
            ranks=index.ranks,
            points=RankSeries.of([], [], [], count),
            has=np.zeros(count, dtype=bool),
            step_unit=np.zeros(count, dtype=bool),
        )
        fits.metric = fits.source = fits.pid = fits.host = [None] * count
        return fits
    has, pick = _choose(count, candidates)
    fits = _assemble(index, candidates, has, pick)
    fits.trends = trends_of(fits.points, fits.step_unit, _start(data, index))
    return fits


def _start(data: _Data, index: _Index) -> np.ndarray | None:
    """Issue 23's hook: each rank's first usable step (data.first_step), as an array; None when unset."""
    import numpy as np

    if not data.first_step:
        return None
    return np.array([data.first_step.get(r, -np.inf) for r in index.ranks], dtype=float)


def without_points(fits: RankFits) -> RankFits:
    """A block's fits as `join_fits` reads them: without their points."""
    fits.points = None
    return fits


def join_fits(parts: list[RankFits]) -> RankFits:
    """The blocks' fits as one, in block order, without their points (`RankFits.remake`)."""
    import numpy as np

    fits = RankFits(
        ranks=[r for p in parts for r in p.ranks],
        points=None,
        has=np.concatenate([p.has for p in parts]),
        step_unit=np.concatenate([p.step_unit for p in parts]),
        metric=[m for p in parts for m in p.metric],
        source=[s for p in parts for s in p.source],
        pid=[x for p in parts for x in p.pid],
        host=[h for p in parts for h in p.host],
    )
    if any(p.trends is not None for p in parts):  # a block without candidates has no trends: none valid
        trends = [p.trends or _no_trends(len(p.ranks)) for p in parts]
        names = ("valid", "slope", "intercept", "r2", "z", "n", "x_first", "x_last")
        fits.trends = Trends(**{k: np.concatenate([getattr(t, k) for t in trends]) for k in names})
    return fits


def _no_trends(count: int) -> Trends:
    import numpy as np

    return Trends(
        valid=np.zeros(count, dtype=bool),
        **{k: np.full(count, np.nan) for k in ("slope", "intercept", "r2", "z", "x_first", "x_last")},
        n=np.zeros(count, dtype=np.int64),
    )
