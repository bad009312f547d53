"""Cross-rank step-time arithmetic for `steps.py`: one ranks × steps matrix (`steps.grid`), every rank
judged by the same vectorised rules, RANK_BLOCK ranks at a time (`steps.pace`).

The pace of rank r at step s is divided by the (lower) median pace of all ranks at that step: a step that
is slow everywhere (an eval, a checkpoint, a longer batch) cancels out, and what is left is how much slower
this rank is than the job's typical rank *at the same step*. From that normalised matrix, per rank:

- level: the median over the run (≥ 1.10 = chronic: slow the whole run);
- a change point: the split of the run into two segments that best separates their means (CUSUM /
  binary segmentation, one split, on values clipped to [0, 2] so a single 10× step cannot drag it), with
  each segment at least MIN_SEGMENT_FRACTION of the run; a shift ≥ 10 % that is significant against the
  segments' own noise is an onset (fast before, slow after) or a recovery (slow before, fast after);
- one-off slow steps: steps ≥ 50 % (and 6 robust σ) above the others, on a rank otherwise at pace;
- a stall: ≥ STALL_MIN_STEPS consecutive steps at ≥ STALL_RATIO × the typical pace (Holmes' "irregular
  iteration" is > 2× normal) costing ≥ MIN_COST_S: a data-loader stall, a slow read, a blocked worker.
  One such step alone is a GC pause or a hiccup, and stays a one-off;
- intermittent slowness: one-off steps (not in a stall) on ≥ INTERMITTENT_MIN_STEPS steps and ≥
  INTERMITTENT_MIN_SHARE of the rank's steps, costing ≥ INTERMITTENT_MIN_COST of its time and ≥
  MIN_COST_S: slow every n-th step (a periodic task on that host, a throttling cycle).

How much slower is worth a warning depends on how alike the ranks are: SLOW_FRACTION (10 %) always; down
to MIN_SLOW_FRACTION (5 %) where at least SPREAD_MIN_UNITS ranks keep so close a pace that 5 % stands
SPREAD_SIGMAS robust σ beyond the spread of their levels (`slow_floor`). On 1,024 ranks with per-step
jitter of 1-4 % the levels spread by ~0.6 % (σ): 5 % is 8 σ out, which no healthy rank reaches; a job
of 2-4 ranks, or a noisy one, keeps the 10 % rule. A change under 10 % must last SUSTAINED_STEPS steps.
A host is judged as one unit too (`host_paces`): the per-step median of its ranks has ~√8 less noise
than one rank, so a whole host 5 % slower is found where its ranks one by one are at the edge of the
noise.

Significance is a z-test on the segment medians: shift > SIGNIFICANCE_Z × √(π/2) × σ × √(1/n₁ + 1/n₂),
σ the segments' pooled MAD (× 1.4826); √(π/2) because a median of n noisy steps varies √(π/2) times more
than their mean (without it, a 12-step end segment of a rank with 4 % jitter passed at a 6 % shift: 2 of
204,800 ranks judged in 200 runs of 1,024). Z = 5 leaves room for the 1,024 ranks × ~1,000 candidate
splits each (the best split of pure noise has a z of about 3–4). A chronic straggler passes that test
on its level, or the one steps.py used before in seconds (excess > 2 × (its MAD + the typical MAD)),
which a few noisy steps of a small job pass more easily.

Pure numpy; no torch, no records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ciuic_doctor.analysis.stats.grouped import member_nanmedians
from ciuic_doctor.analysis.steps.grid import (  # noqa: F401 - the report's, steps.py's
    StepMatrix,
    step_matrix,
)
from ciuic_doctor.analysis.steps.pace import (  # noqa: F401 - quiet_nan, normalised: the report's too
    MAD_TO_SIGMA,
    RANK_BLOCK,
    Seconds,
    normalised,
    quiet_nan,
    row_medians,
    typical_pace,
)

if TYPE_CHECKING:
    import numpy as np

SLOW_FRACTION = 0.10  # a rank ≥ 10 % slower than the others' median is worth acting on...
MIN_SLOW_FRACTION = 0.05  # ...and from 5 % where the ranks are alike enough (slow_floor)
SPREAD_SIGMAS = 8.0
SPREAD_MIN_UNITS = 8  # ranks (or hosts) before their spread is trusted
# a change under SLOW_FRACTION counts when it lasts SUSTAINED_STEPS steps: the median of 12-16 steps of a
# rank with 4 % jitter strayed 5 % on 1 of 35,000 healthy ranks (34 runs of 1,024)
SUSTAINED_STEPS = 30
SIGNIFICANCE_Z = 5.0
MEDIAN_SE = 1.2533  # √(π/2): a median's standard error over a mean's, for normal noise
NOISE_MADS = 2.0  # or: the excess in seconds beyond 2 × (its MAD + the typical rank's MAD)
MIN_SEGMENT_STEPS = 10
MIN_SEGMENT_FRACTION = 0.05
ONE_OFF_FRACTION = 0.5  # a single step ≥ 50 % slower than the others
ONE_OFF_SIGMAS = 6.0
STALL_RATIO = 2.0
STALL_MIN_STEPS = 2
INTERMITTENT_MIN_STEPS = 4
INTERMITTENT_MIN_SHARE = 0.02
INTERMITTENT_MIN_COST = 0.01  # the recurring steps cost >= 1 % of the rank's time...
# ...and a stall or the recurring steps together cost the job >= 1 s: a loader stall (a worker restart, a
# slow shard read) takes seconds; a tiny job's 20 ms steps doubling under CPU contention is not one
MIN_COST_S = 1.0


@dataclass(kw_only=True)
class RankPace:
    """How one rank's normalised pace behaves over the run (1.0 = the typical rank)."""

    rank: int
    host: str | None
    level: float  # median over the run
    kind: str  # "ok" | "chronic" | "onset" | "recovered" | "one_off"
    change_step: int | None = None
    before: float | None = None
    after: float | None = None
    one_off_steps: list[int] = field(default_factory=list)
    stall_steps: list[int] = field(default_factory=list)  # the longest run of consecutive stalled steps
    stall_ratio: float | None = None  # its median pace over the typical rank's
    intermittent_steps: list[int] = field(default_factory=list)

    @property
    def excess_pct(self) -> float:
        """How much slower than the typical rank where it is slow (after an onset, before a recovery)."""
        slow = {"onset": self.after, "recovered": self.before}.get(self.kind, self.level)
        return round(100.0 * ((slow if slow is not None else self.level) - 1.0), 2)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "host": self.host, "kind": self.kind}
        out["excess_pct"] = self.excess_pct
        if self.change_step is not None:
            out.update(
                change_step=self.change_step,
                before_pct=round(100.0 * ((self.before or 1.0) - 1.0), 2),
                after_pct=round(100.0 * ((self.after or 1.0) - 1.0), 2),
            )
        if self.one_off_steps:
            out["one_off_steps"] = self.one_off_steps[:10]
        return out


def _change_points(clipped: np.ndarray, min_segment: int) -> np.ndarray:
    """Per row, the split index k (segments [:k], [k:]) that maximises the between-segment variance."""
    import numpy as np

    n = clipped.shape[1]
    cumulative = np.cumsum(clipped, axis=1)
    total = cumulative[:, -1:]
    k = np.arange(min_segment, n - min_segment + 1)
    before = cumulative[:, k - 1] / k
    after = (total - cumulative[:, k - 1]) / (n - k)
    score = k * (n - k) / n * (after - before) ** 2
    return k[np.argmax(score, axis=1)]


def _mad(values: np.ndarray) -> float:
    import numpy as np

    values = values[np.isfinite(values)]
    if len(values) < 2:
        return 0.0
    return float(MAD_TO_SIGMA * np.median(np.abs(values - np.median(values))))


def slow_floor(levels: Any) -> float:
    """The smallest slowdown (a fraction) worth a warning among units whose levels (each unit's pace over
    the typical unit's, 1.0 = typical) are `levels`: SLOW_FRACTION, lowered towards MIN_SLOW_FRACTION
    where at least SPREAD_MIN_UNITS units spread so little that the floor is SPREAD_SIGMAS robust σ out.

    >>> slow_floor([1.0, 1.2])
    0.1
    >>> slow_floor([1.0 + 0.001 * (i % 7) for i in range(64)])
    0.05
    >>> slow_floor([1.0 + 0.004 * (i % 7) for i in range(64)])
    0.09489
    """
    import math
    import statistics

    finite = [float(v) for v in levels if math.isfinite(v)]
    if len(finite) < SPREAD_MIN_UNITS:
        return SLOW_FRACTION
    middle = statistics.median(finite)
    spread = MAD_TO_SIGMA * statistics.median(abs(v - middle) for v in finite)
    return round(min(SLOW_FRACTION, max(MIN_SLOW_FRACTION, SPREAD_SIGMAS * spread)), 5)


def classify(matrix: StepMatrix) -> list[RankPace]:
    """Every rank's RankPace from the normalised pace matrix, in two passes: the second divides by the
    median of the ranks the first found at pace, so that a slow host (8 of 32 ranks) does not lift the
    "typical" rank it is measured against (16 % instead of 18 % with the slow ranks in the median)."""
    import numpy as np

    seconds = Seconds.of(matrix.pace_s)
    with quiet_nan():
        floor = slow_floor(seconds.median / seconds.typical) if seconds.typical > 0 else SLOW_FRACTION
    first = _classify(matrix, typical_pace(matrix.pace_s), seconds, floor)
    at_pace = np.array([p.kind in ("ok", "one_off") for p in first])
    if at_pace.all() or at_pace.sum() < 2:
        return first
    return _classify(matrix, typical_pace(matrix.pace_s, at_pace), seconds, floor)


def _classify(matrix: StepMatrix, typical: np.ndarray, seconds: Seconds, floor: float) -> list[RankPace]:
    """RANK_BLOCK ranks at a time: a dozen temporaries of the block's shape are alive at once (165 MiB
    over the whole matrix at 3,000 ranks × 1,000 steps)."""
    out: list[RankPace] = []
    for lo in range(0, len(matrix.ranks), RANK_BLOCK):
        with quiet_nan():
            norm = matrix.pace_s[lo : lo + RANK_BLOCK] / typical
        out.extend(_classify_block(matrix, norm, lo, seconds, floor))
    return out


def _classify_block(
    matrix: StepMatrix, norm: np.ndarray, lo: int, seconds: Seconds, floor: float
) -> list[RankPace]:
    """The RankPace of the ranks from `lo` on, `norm` their normalised pace; `floor` the smallest
    slowdown worth a warning (slow_floor)."""
    import numpy as np

    level = row_medians(norm)
    n_steps = norm.shape[1]
    min_segment = max(MIN_SEGMENT_STEPS, int(MIN_SEGMENT_FRACTION * n_steps))
    fill = np.where(np.isfinite(norm), norm, level[:, None])
    clipped = np.clip(np.nan_to_num(fill, nan=1.0), 0.0, 2.0)
    del fill
    splits = _change_points(clipped, min_segment) if n_steps >= 2 * min_segment else None
    if splits is not None:
        k_idx = np.arange(n_steps)[None, :] < splits[:, None]
        with quiet_nan():
            mean_before = np.where(k_idx, clipped, 0).sum(axis=1) / splits
            mean_after = np.where(~k_idx, clipped, 0).sum(axis=1) / (n_steps - splits)
        candidates = np.abs(mean_after - mean_before) >= floor / 2
    else:
        candidates = np.zeros(len(norm), dtype=bool)
    del clipped
    # one-off steps: far above the others at that step, counted on every rank (vectorised)
    with quiet_nan():
        deviation = np.abs(norm - level[:, None])
        sigma = MAD_TO_SIGMA * row_medians(deviation)
        spikes = norm - level[:, None] >= np.maximum(ONE_OFF_FRACTION, ONE_OFF_SIGMAS * sigma)[:, None]
    del deviation
    with quiet_nan():
        big = norm >= STALL_RATIO
    stalled = (big[:, 1:] & big[:, :-1]).any(axis=1) if norm.shape[1] > 1 else np.zeros(len(norm), bool)
    del big
    out: list[RankPace] = []
    for i, rank in enumerate(matrix.ranks[lo : lo + len(norm)].tolist()):
        pace = RankPace(rank=rank, host=matrix.hosts[lo + i], level=float(level[i]), kind="ok")
        row = norm[i]
        if candidates[i]:
            k = int(splits[i])
            first, second = row[:k], row[k:]
            before, after = float(np.nanmedian(first)), float(np.nanmedian(second))
            pooled = np.concatenate([first - before, second - after])
            sigma_seg = _mad(pooled)
            n1, n2 = np.isfinite(first).sum(), np.isfinite(second).sum()
            spread = MEDIAN_SE * sigma_seg * float(np.sqrt(1 / max(n1, 1) + 1 / max(n2, 1)))
            noise = SIGNIFICANCE_Z * spread
            shift = after - before
            slow_steps = n2 if shift > 0 else n1
            if abs(shift) >= floor and abs(shift) > noise:
                slow, fast = (after, before) if shift > 0 else (before, after)
                brief = slow - 1.0 < SLOW_FRACTION and slow_steps < SUSTAINED_STEPS  # the lowered floor's
                if slow - 1.0 >= floor and fast - 1.0 < floor and not brief:
                    pace.kind = "onset" if shift > 0 else "recovered"
                    pace.change_step = int(matrix.steps[k])
                    pace.before, pace.after = before, after
        if pace.kind == "ok" and level[i] - 1.0 >= floor:
            n = int(np.isfinite(row).sum())
            z_test = level[i] - 1.0 > SIGNIFICANCE_Z * float(sigma[i]) / max(1.0, np.sqrt(n))
            excess = seconds.median[lo + i] - seconds.typical
            if z_test or excess > NOISE_MADS * (seconds.mad[lo + i] + seconds.typical_mad):
                pace.kind = "chronic"
        one_off = matrix.steps[spikes[i]].tolist()
        if one_off:
            pace.one_off_steps = [int(s) for s in one_off]
            if pace.kind == "ok":
                pace.kind = "one_off"
        if stalled[i] or len(one_off) >= INTERMITTENT_MIN_STEPS:
            with quiet_nan():  # seconds beyond the typical rank's at each step
                excess = np.nan_to_num(matrix.pace_s[lo + i] * (1.0 - 1.0 / row), nan=0.0)
            if stalled[i]:
                _stall(pace, row, excess, matrix.steps)
            recurring = sorted(set(pace.one_off_steps) - set(pace.stall_steps))
            cost = float(excess[np.isin(matrix.steps, recurring)].sum())
            if len(recurring) >= max(
                INTERMITTENT_MIN_STEPS, INTERMITTENT_MIN_SHARE * n_steps
            ) and cost >= max(MIN_COST_S, INTERMITTENT_MIN_COST * float(np.nansum(matrix.pace_s[lo + i]))):
                pace.intermittent_steps = recurring
        out.append(pace)
    return out


def _stall(pace: RankPace, row: np.ndarray, excess: np.ndarray, steps: np.ndarray) -> None:
    """The rank's longest run of consecutive steps at >= STALL_RATIO x the typical pace, if long enough
    and costing the job >= MIN_COST_S."""
    import numpy as np

    big = np.r_[False, np.nan_to_num(row, nan=0.0) >= STALL_RATIO, False].astype(np.int8)
    edges = np.flatnonzero(np.diff(big))
    starts, ends = edges[::2], edges[1::2]
    if not len(starts):
        return
    longest = int(np.argmax(ends - starts))
    a, b = int(starts[longest]), int(ends[longest])
    if b - a >= STALL_MIN_STEPS and float(excess[a:b].sum()) >= MIN_COST_S:
        pace.stall_steps = [int(s) for s in steps[a:b]]
        pace.stall_ratio = round(float(np.median(row[a:b])), 2)


@dataclass(kw_only=True)
class HostPace:
    host: str
    ranks: list[int]
    flagged: list[int]
    excess_pct: float
    change_step: int | None
    as_unit: bool = False  # found on the median of its ranks (host_paces), not rank by rank


HOST_FLAGGED_FRACTION = 0.75  # "all ranks of one host", with room for one rank that sits at the threshold


def host_paces(matrix: StepMatrix) -> dict[str, RankPace]:
    """Each host (of >= 2 ranks, holding fewer than half of them) judged as one unit: its ranks' median
    pace at every step, classified as a rank is, against the other hosts. {} with fewer than 2 hosts."""
    import numpy as np

    members: dict[str, list[int]] = {}
    for i, host in enumerate(matrix.hosts):
        if host is not None:
            members.setdefault(host, []).append(i)
    total = sum(len(v) for v in members.values())
    hosts = [h for h, idx in members.items() if len(idx) >= 2 and 2 * len(idx) <= total]
    if len(hosts) < 2:
        return {}
    rows = [members[h] for h in hosts]
    pace, step_time = member_nanmedians(matrix.pace_s, rows), member_nanmedians(matrix.step_time_s, rows)
    units = StepMatrix(
        ranks=np.arange(len(hosts)),
        steps=matrix.steps,
        hosts=hosts,
        step_time_s=step_time,
        pace_s=pace,
        pace_metric=matrix.pace_metric,
    )
    return {p.host: p for p in classify(units) if p.host is not None}


def slow_hosts(paces: list[RankPace], matrix: StepMatrix | None = None) -> tuple[list[HostPace], int]:
    """Hosts (≥ 2 ranks) where ≥ 75 % of the ranks are slow, or (given the matrix) whose ranks' median
    pace is slow judged as one unit (host_paces): a host problem, not a rank problem.

    Returns (slow hosts worst first, number of hosts seen)."""
    import statistics

    by_host: dict[str, list[RankPace]] = {}
    for pace in paces:
        if pace.host is not None:
            by_host.setdefault(pace.host, []).append(pace)
    total = sum(len(v) for v in by_host.values())
    units = host_paces(matrix) if matrix is not None else {}
    out = []
    for host, members in by_host.items():
        flagged = [p for p in members if p.kind in ("chronic", "onset", "recovered")]
        unit = units.get(host)
        slow_unit = unit is not None and unit.kind in ("chronic", "onset", "recovered")
        if len(members) < 2 or 2 * len(members) > total:
            continue
        if len(flagged) >= HOST_FLAGGED_FRACTION * len(members):
            changes = [p.change_step for p in flagged if p.change_step is not None]
            out.append(
                HostPace(
                    host=host,
                    ranks=sorted(p.rank for p in members),
                    flagged=[p.rank for p in sorted(flagged, key=lambda p: -p.excess_pct)],
                    excess_pct=round(statistics.median(p.excess_pct for p in flagged), 2),
                    change_step=int(statistics.median(changes)) if len(changes) * 2 > len(flagged) else None,
                )
            )
        elif slow_unit:
            out.append(
                HostPace(
                    host=host,
                    ranks=sorted(p.rank for p in members),
                    flagged=[p.rank for p in sorted(members, key=lambda p: -p.level)],
                    excess_pct=unit.excess_pct,
                    change_step=unit.change_step,
                    as_unit=True,
                )
            )
    return sorted(out, key=lambda h: -h.excess_pct), len(by_host)
