"""Cross-rank scores that a probe computes while it runs and the analysis judges afterwards.

- `differing_ranks`: which ranks' weight checksums differ from rank 0's (watch records them in the step
  record; analysis/steps.py judges desync from them).
- `slowest_rank`: the rank that is slowest in most comm-bench rows, by how much (comm-bench prints it
  at the end of a sweep; analysis/comm.py turns it into the `straggler` finding).

Pure functions of numbers: no torch, no pandas.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.rundir.store import as_float

CHECKSUM_RTOL = 1e-12  # float64 sums of identical replicas are bit-identical; this absorbs JSON rounding

# A straggler is the slowest rank in at least this share of rows, by at least STRAGGLER_PCT, over at
# least STRAGGLER_MIN_ROWS rows: one slow row is noise, the same rank every time is a finding.
STRAGGLER_SHARE = 0.75
STRAGGLER_PCT = 5.0
STRAGGLER_MIN_ROWS = 4


def differing_ranks(checksums: list[float], ranks: list[int]) -> list[int]:
    """Ranks whose checksum differs from the first rank's (DDP broadcasts from rank 0). NaN differs.

    >>> differing_ranks([1.5, 1.5, 1.25], [0, 1, 2])
    [2]
    """
    reference = checksums[0]
    tolerance = CHECKSUM_RTOL * max(1.0, abs(reference))
    return [
        rank
        for rank, value in zip(ranks, checksums, strict=True)
        if not abs(value - reference) <= tolerance  # written so that NaN counts as different
    ]


@dataclass(kw_only=True)
class SlowestRank:
    """The rank most often slowest across comm rows (`rank_time_us` per rank in each row)."""

    rank: int
    rows_slowest: int
    rows: int
    slowdown_pct: float  # median, over the rows where it was slowest, of its time over the others' median
    hosts: dict[int, str] = field(default_factory=dict)

    @property
    def consistent(self) -> bool:
        return self.rows_slowest >= STRAGGLER_MIN_ROWS and self.rows_slowest / self.rows >= STRAGGLER_SHARE

    @property
    def is_straggler(self) -> bool:
        return self.consistent and self.slowdown_pct >= STRAGGLER_PCT


def slowest_rank(rows: list[dict[str, Any]]) -> SlowestRank | None:
    """The slowest rank in most rows with per-rank times from at least 2 ranks; None without such rows.

    >>> rows = [{"rank_time_us": [10.0, 10.0, 13.0]}] * 4
    >>> s = slowest_rank(rows); (s.rank, s.rows_slowest, round(s.slowdown_pct), s.is_straggler)
    (2, 4, 30, True)
    """
    timed = [r for r in rows if len(r.get("rank_time_us") or []) >= 2]
    if not timed:
        return None
    slowest: Counter[int] = Counter()
    slowdowns: dict[int, list[float]] = defaultdict(list)
    hosts: dict[int, str] = {}
    for r in timed:
        times = [as_float(t) or 0.0 for t in r["rank_time_us"]]
        worst = max(range(len(times)), key=times.__getitem__)
        others = statistics.median(t for i, t in enumerate(times) if i != worst)
        slowest[worst] += 1
        slowdowns[worst].append((times[worst] / others - 1) * 100 if others > 0 else 0.0)
        if r.get("slowest_rank") == worst and r.get("slowest_host"):
            hosts[worst] = r["slowest_host"]
    rank, count = slowest.most_common(1)[0]
    return SlowestRank(
        rank=rank,
        rows_slowest=count,
        rows=len(timed),
        slowdown_pct=statistics.median(slowdowns[rank]),
        hosts=hosts,
    )
