"""Time one (collective, size, placement) on every rank and fold the ranks' figures into one record.

The timing is nccl-tests': a barrier, then the wall clock around `iters` back-to-back launches plus
one device sync, divided by iters (launch overhead included). Per-iteration times come from a mark
after each launch (a CUDA event on GPUs, perf_counter on CPU), so p50 / p99 describe the spread
without changing the loop. Across ranks the record keeps min / avg / max (avg is what nccl-tests
prints) and every rank's own time, to find a consistently slow rank.

In-place reductions are timed on zeros: after a thousand in-place sums the pattern would overflow to
inf. Correctness is a separate call on fresh pattern data, as nccl-tests checks.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ciuic_doctor.machine.nccl import busbw_factor
from ciuic_doctor.probes.comm.check import count_wrong, expected, fill_inputs, pattern_for
from ciuic_doctor.probes.comm.collectives import DTYPES, REDUCING, Shape, allocate, launch

CORRUPT_ENV = "CIUIC_COMM_CORRUPT_RANK"  # test hook: this rank adds 1 to element 0 of every checked result


@dataclass(kw_only=True)
class Timing:
    """How many iterations to time: fixed, or as many as fit a per-size time budget."""

    warmup: int
    iters: int | None
    budget_s: float
    min_iters: int
    max_iters: int


@dataclass(kw_only=True)
class RankResult:
    """What one rank measured for one row (gathered to rank 0)."""

    time_s: float  # wall clock of the timed loop
    iters: int
    durations_us: list[float]
    wrong: int


class Marks:
    """Time stamps after each launch: CUDA events on a GPU (they see the device), perf_counter on CPU."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(n)] if self.cuda else []
        self.times = [0.0] * n

    def mark(self, i: int) -> None:
        if self.cuda:
            self.events[i].record()
        else:
            self.times[i] = time.perf_counter()

    def durations_us(self) -> list[float]:
        if self.cuda:
            return [a.elapsed_time(b) * 1e3 for a, b in zip(self.events, self.events[1:], strict=False)]
        return [(b - a) * 1e6 for a, b in zip(self.times, self.times[1:], strict=False)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_row(
    collective: str,
    sh: Shape,
    *,
    inplace: bool,
    dtype: str,
    device: torch.device,
    rank: int,
    world_size: int,
    group: Any,
    control: Any,
    timing: Timing,
    root: int = 0,
    tick: Callable[[], None] = lambda: None,
) -> RankResult:
    """Warm up, agree on iters, time the loop, then check one call's result exactly."""
    buf = allocate(sh, inplace=inplace, dtype=DTYPES[dtype], device=device, rank=rank)
    pattern = pattern_for(dtype, world_size)
    if not (inplace and collective in REDUCING):
        fill_inputs(buf, rank=rank, pattern=pattern)

    def op() -> None:
        launch(collective, buf, group, root)

    iters, elapsed, marks = time_op(
        op,
        timing=timing,
        device=device,
        control=control,
        tick=tick,
        min_warmup=1 if timing.iters is None else 0,
    )

    fill_inputs(buf, rank=rank, pattern=pattern)
    op()
    sync(device)
    if os.environ.get(CORRUPT_ENV) == str(rank):
        flat = buf.recv.view(-1)  # via float32: float8 has no add on CPU
        flat[0] = (flat[0].to(torch.float32) + 1).to(flat.dtype)
    want = expected(collective, sh, rank=rank, pattern=pattern, like=buf.recv, root=root)
    wrong = count_wrong(buf.recv, want)
    return RankResult(time_s=elapsed, iters=iters, durations_us=marks.durations_us(), wrong=wrong)


def time_op(
    op: Callable[[], None],
    *,
    timing: Timing,
    device: torch.device,
    control: Any,
    tick: Callable[[], None] = lambda: None,
    min_warmup: int = 1,
) -> tuple[int, float, Marks]:
    """(iters, elapsed_s, per-iteration marks) of `op` on this rank: warm up, agree with every rank on the
    iteration count (the slowest rank's estimate), then time the loop between a barrier and a sync, as
    nccl-tests does. `tick` runs between calls (the liveness heartbeat)."""
    n_warm = max(timing.warmup, min_warmup)
    start = time.perf_counter()
    for _ in range(n_warm):
        op()
    sync(device)
    iters = timing.iters or _agree_on_iters((time.perf_counter() - start) / n_warm, timing, control)
    tick()
    marks = Marks(iters + 1, device)
    dist.barrier(group=control)
    sync(device)
    marks.mark(0)
    start = time.perf_counter()
    for i in range(iters):
        op()
        marks.mark(i + 1)
        tick()
    sync(device)
    return iters, time.perf_counter() - start, marks


def _agree_on_iters(per_op_s: float, timing: Timing, control: Any) -> int:
    """Every rank must run the same count: take the slowest rank's warm-up estimate."""
    slowest = torch.tensor([per_op_s], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=control)
    wanted = math.ceil(timing.budget_s / max(float(slowest.item()), 1e-9))
    return max(timing.min_iters, min(timing.max_iters, wanted))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def aggregate(
    results: Sequence[RankResult], *, collective: str, sh: Shape, hosts: Sequence[str]
) -> dict[str, Any]:
    """One record's figures from every rank's result (rank order).

    time_us is the mean over ranks of each rank's loop time / iters (nccl-tests' default); p50 / p99 are
    over iterations of the slowest rank's time in that iteration.
    """
    figures = timing_figures(results, sh.bytes, busbw_factor(collective, len(results)), hosts)
    return {"bytes": sh.bytes, "count": sh.count, **figures}


def timing_figures(
    results: Sequence[RankResult], bytes_moved: int, factor: float, hosts: Sequence[str]
) -> dict[str, Any]:
    """The timing fields every comm record carries (as `aggregate`), for `bytes_moved` per rank and the
    collective's busbw factor; shared with `--splits-from`'s uneven all_to_all record."""
    n = len(results)
    rank_us = [r.time_s * 1e6 / r.iters for r in results]
    avg_us = sum(rank_us) / n
    per_iter = [max(d) for d in zip(*(r.durations_us for r in results), strict=False)]
    algbw = bytes_moved / (avg_us * 1e-6) / 1e9 if avg_us > 0 else 0.0
    slowest = max(range(n), key=lambda r: rank_us[r])
    return {
        "iters": results[0].iters,
        "time_us": avg_us,
        "time_us_min": min(rank_us),
        "time_us_max": max(rank_us),
        "time_us_p50": percentile(per_iter, 50),
        "time_us_p99": percentile(per_iter, 99),
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * factor,
        "busbw_factor": factor,
        "wrong": sum(r.wrong for r in results),
        "slowest_rank": slowest,
        "slowest_host": hosts[slowest] if slowest < len(hosts) else None,
        "rank_time_us": rank_us,
    }
