"""The CUDA checks' per-rank figures, every rank in one grouped pass: NVML − reserved against
steps (`non_pytorch_fits`) and the steady medians and allocator retries fragmentation judges
(`fragmentation_figures`). Split from `memory.batch` (the series and trends the leak check shares);
the rules they feed are `memory.cuda`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ciuic_doctor.analysis.memory.batch import (
    RankFits,
    _assemble,
    _Index,
    join_fits,
    trends_of,
    without_points,
)
from ciuic_doctor.analysis.memory.blocks import _DataBlock, in_blocks
from ciuic_doctor.analysis.memory.columns import pid_of
from ciuic_doctor.analysis.memory.data import WARMUP_STEPS, _Data
from ciuic_doctor.analysis.stats.batch_trend import RankSeries

if TYPE_CHECKING:
    import numpy as np


@dataclass(kw_only=True)
class NonPytorch:
    """NVML bytes − reserved per rank: the series' point count, median, last value and trend."""

    fits: RankFits
    points: np.ndarray
    level: np.ndarray
    last: np.ndarray


def non_pytorch_fits(data: _Data) -> NonPytorch:
    """`memory.cuda._non_pytorch_series` of every rank: NVML's bytes at each sample minus the reserved
    bytes of the rank's last step at or before it, against the sample's (fractional) step (a block of
    ranks at a time, `memory.blocks`)."""
    batch = in_blocks(data, _non_pytorch_fits, _join_non_pytorch, slim=_without_points)
    if batch.fits.points is None:  # joined: a rank's series is made again from its rows alone
        ranks = batch.fits.ranks  # not `batch`: a closure over it would keep `data` in a cycle
        batch.fits.remake = lambda i: _non_pytorch_fits(_DataBlock(data, [ranks[i]])).fits
    return batch


def _without_points(batch: NonPytorch) -> NonPytorch:
    without_points(batch.fits)
    return batch


def _join_non_pytorch(parts: list[NonPytorch]) -> NonPytorch:
    import numpy as np

    return NonPytorch(
        fits=join_fits([p.fits for p in parts]),
        **{k: np.concatenate([getattr(p, k) for p in parts]) for k in ("points", "level", "last")},
    )


def _non_pytorch_fits(data: _Data) -> NonPytorch:
    import numpy as np

    from ciuic_doctor.analysis.memory.columns import group_interp, group_last_before

    index = _Index(data)
    count = len(index.ranks)
    bounds = data.memwatch.bounds()
    ids, rows = [], []
    for i, pid in enumerate(index.pids):
        if pid is not None:
            start, stop = bounds[pid]
            ids.append(np.full(stop - start, i))
            rows.append(np.arange(start, stop))
    ids = np.concatenate(ids) if ids else np.empty(0, np.int64)
    rows = np.concatenate(rows) if rows else np.empty(0, np.int64)
    gpu = data.memwatch.flat("gpu_bytes")[rows] if len(rows) else np.empty(0)
    present = ~np.isnan(gpu)
    ids, rows, gpu = ids[present], rows[present], gpu[present]
    t = data.memwatch.flat("t")[rows] if len(rows) else np.empty(0)
    first_pid = [None] * count
    first_host = [None] * count
    for i in np.unique(ids).tolist():
        first_pid[i] = pid_of(index.pids[i])
        first_host[i] = data.memwatch.host(index.pids[i])
    reserved = data.steps.flat("mem_reserved") if len(data.steps) else np.empty(0)
    with_reserved = ~np.isnan(reserved)
    enough = np.bincount(index.step_id[with_reserved], minlength=count) >= 2
    step_t = data.steps.flat("t")[with_reserved] if len(data.steps) else np.empty(0)
    before = group_last_before(ids, t, index.step_id[with_reserved], step_t)
    keep = (before >= 0) & enough[ids]
    ids, t = ids[keep], t[keep]
    diff = gpu[keep] - reserved[with_reserved][before[keep]]
    if len(data.steps):
        step_no, all_t = data.steps.flat("step"), data.steps.flat("t")
        finite = np.isfinite(all_t) & np.isfinite(step_no)
        x = group_interp(ids, t, index.step_id[finite], all_t[finite], step_no[finite])
    else:
        x = np.full(len(ids), np.nan)
    mapped = ~np.isnan(x)
    points = RankSeries(ids=ids[mapped], x=x[mapped], y=diff[mapped], count=count)
    info = {"metric": "nvml_minus_reserved_bytes", "source": "memwatch+steps", "pid": first_pid,
            "host": first_host}  # fmt: skip
    has = enough & np.isin(np.arange(count), ids)
    fits = _assemble(index, [(points, np.ones(count, dtype=bool), has, info)], has, np.zeros(count, np.int64))
    fits.trends = trends_of(fits.points, fits.step_unit)
    return NonPytorch(
        fits=fits,
        points=fits.points.lengths(),
        level=fits.points.per_series(fits.points.y, "median"),
        last=fits.points.per_series(fits.points.y, "last"),
    )


@dataclass(kw_only=True)
class Fragmentation:
    """Per rank with CUDA allocator fields: steady medians (NaN where none) and allocator retries."""

    ranks: list[int]
    reserved: np.ndarray
    allocated: np.ndarray
    peak: np.ndarray
    inactive_split: np.ndarray
    retries: np.ndarray


def fragmentation_figures(data: _Data) -> Fragmentation:
    """`memory.cuda._fragmentation`'s figures of every rank, grouped: the medians of the steady records
    (those with mem_reserved from the rank's first such step + WARMUP_STEPS on, or all of them when
    none is that late), and num_alloc_retries over all its records (the last value of a counter that
    never decreases, else the sum). A block of ranks at a time: at 10,000 ranks the job's frame and
    its filtered copies were 2 GB above the cached streams."""
    return in_blocks(data, _fragmentation_figures, _join_fragmentation)


def _join_fragmentation(parts: list[Fragmentation]) -> Fragmentation:
    import numpy as np

    names = ("reserved", "allocated", "peak", "inactive_split", "retries")
    return Fragmentation(
        ranks=[r for p in parts for r in p.ranks],
        **{k: np.concatenate([getattr(p, k) for p in parts]) for k in names},
    )


def _fragmentation_figures(data: _Data) -> Fragmentation:
    """Each rank's medians after its warm-up (over every row when none is past it), NaN left out as pandas'
    groupby median leaves it, in grouped numpy passes: pandas' groupby was 1.4 s of CPU at 10,000 ranks."""
    import numpy as np

    from ciuic_doctor.analysis.stats.grouped import grouped_median

    index = _Index(data)
    steps = data.steps
    names = ("mem_reserved", "mem_allocated", "mem_active_peak", "inactive_split_bytes")
    if not len(steps):
        return Fragmentation(
            ranks=[],
            **{k: np.empty(0) for k in ("reserved", "allocated", "peak", "inactive_split", "retries")},
        )
    count = len(index.ranks)
    rows = np.flatnonzero(~np.isnan(steps.flat("mem_reserved")))  # rows with the allocator's figures
    group, step = index.step_id[rows], steps.flat("step")[rows]
    ids = np.flatnonzero(np.bincount(group, minlength=count))
    first = np.full(count, np.inf)
    np.fmin.at(first, group, step)  # NaN left out, as pandas' min
    steady = step >= first[group] + WARMUP_STEPS
    any_steady = np.bincount(group[steady], minlength=count) > 0
    used = steady | ~any_steady[group]
    medians = {}
    for name in names:
        values = steps.flat(name)[rows][used]
        known = ~np.isnan(values)
        medians[name] = grouped_median(group[used][known], values[known], count)[ids]
    retries = np.zeros(len(ids))
    values = steps.flat("alloc_retries")
    finite = ~np.isnan(values)
    if finite.any():
        rid, v = index.step_id[finite], np.trunc(values[finite])
        same = rid[1:] == rid[:-1]
        drops = np.bincount(rid[1:][same & (v[1:] < v[:-1])], minlength=len(index.ranks))
        total = np.bincount(rid, weights=v, minlength=len(index.ranks))
        last = np.full(len(index.ranks), 0.0)
        ends = np.r_[~same, True]
        last[rid[ends]] = v[ends]
        per_rank = np.where(drops > 0, total, last)
        retries = per_rank[ids]
    return Fragmentation(
        ranks=[index.ranks[i] for i in ids.tolist()],
        reserved=medians["mem_reserved"],
        allocated=medians["mem_allocated"],
        peak=medians["mem_active_peak"],
        inactive_split=medians["inactive_split_bytes"],
        retries=retries,
    )
