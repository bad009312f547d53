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

# A straggler is slow (>= STRAGGLER_PCT over the row's median) or the slowest rank in at least this share
# of rows, over at least STRAGGLER_MIN_ROWS rows: one slow row is noise, the same rank every time is a
# finding.
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
    """The rank most often slow across comm rows (`rank_time_us` per rank in each row), and its peers:
    other ranks as consistently slow (a slow link slows the two ranks at its ends alike, so neither is
    the slowest in most rows: each is in about half)."""

    rank: int
    rows_slowest: int
    rows: int
    slowdown_pct: float  # median, over the rows where it was slow, of its time over the row's median
    hosts: dict[int, str] = field(default_factory=dict)
    rows_slow: int = 0  # rows where it was >= STRAGGLER_PCT above the row's median
    peers: list[int] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        rows = max(self.rows_slowest, self.rows_slow)
        return rows >= STRAGGLER_MIN_ROWS and rows / self.rows >= STRAGGLER_SHARE

    @property
    def is_straggler(self) -> bool:
        return self.consistent and self.slowdown_pct >= STRAGGLER_PCT


def slowest_rank(rows: list[dict[str, Any]]) -> SlowestRank | None:
    """The rank slow in most rows with per-rank times from at least 2 ranks; None without such rows.

    >>> rows = [{"rank_time_us": [10.0, 10.0, 13.0]}] * 4
    >>> s = slowest_rank(rows); (s.rank, s.rows_slowest, round(s.slowdown_pct), s.is_straggler)
    (2, 4, 30, True)
    >>> pair = [{"rank_time_us": [10.0, 12.0, 10.0, 12.1]}, {"rank_time_us": [10.0, 12.1, 10.0, 12.0]}] * 2
    >>> s = slowest_rank(pair); (s.rank, s.peers, s.is_straggler)
    (1, [3], True)
    """
    timed = [r for r in rows if len(r.get("rank_time_us") or []) >= 2]
    if not timed:
        return None
    slowest: Counter[int] = Counter()
    slow: Counter[int] = Counter()
    when_slowest: dict[int, list[float]] = defaultdict(list)  # its slowdown in the rows it was slowest
    when_slow: dict[int, list[float]] = defaultdict(list)  # ... in the rows it was >= STRAGGLER_PCT slow
    hosts: dict[int, str] = {}
    for r in timed:
        times = [as_float(t) or 0.0 for t in r["rank_time_us"]]
        worst = max(range(len(times)), key=times.__getitem__)
        others = statistics.median(t for i, t in enumerate(times) if i != worst)
        slowest[worst] += 1
        when_slowest[worst].append((times[worst] / others - 1) * 100 if others > 0 else 0.0)
        for i, t in enumerate(times if others > 0 else []):
            if (t / others - 1) * 100 >= STRAGGLER_PCT:
                slow[i] += 1
                when_slow[i].append((t / others - 1) * 100)
        if r.get("slowest_rank") == worst and r.get("slowest_host"):
            hosts[worst] = r["slowest_host"]
    # the rank slow in most rows (ties: the one most often the slowest); none slow: the most often slowest
    rank = max(slow, key=lambda k: (slow[k], slowest[k])) if slow else slowest.most_common(1)[0][0]
    share = STRAGGLER_SHARE * len(timed)
    peers = sorted(k for k, n in slow.items() if k != rank and n >= max(share, STRAGGLER_MIN_ROWS))
    return SlowestRank(
        rank=rank,
        rows_slowest=slowest[rank],
        rows=len(timed),
        slowdown_pct=statistics.median(when_slow[rank] or when_slowest[rank] or [0.0]),
        hosts=hosts,
        rows_slow=slow[rank],
        peers=peers,
    )
