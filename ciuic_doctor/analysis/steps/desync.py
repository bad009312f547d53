"""The weight checksums of steps.py's `rank_desync`, one check step at a time, as numpy arrays.

Why: watch records a checksum every K steps on every rank (300,000 rows at 3,000 ranks × 1,000 steps,
K = 10); those rows as dicts (`to_pylist`) and a dict of dicts by step added 119 MiB to the steps
analysis at 3,000 ranks. Here they are arrays from the table's columns (30 MiB), and only a step a
finding quotes becomes Python values. Records (a list of dicts, as the row reader gives them) go through the
same arrays (`from_records`), so both paths share one rule.

The rule: a row counts with an integer rank and step; a (step, rank) recorded twice keeps the later
checksum (a restarted rank); a rank whose checksum differs from the lowest rank's by more than
CHECKSUM_RTOL × max(1, |reference|) differs (NaN differs: `measures.ranks.differing_ranks`), and so do
the ranks a record names in `desync_ranks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ciuic_doctor.measures.ranks import CHECKSUM_RTOL
from ciuic_doctor.rundir.store import as_float

if TYPE_CHECKING:
    import numpy as np
    import pyarrow


@dataclass
class StepChecks:
    """One check step: its ranks in order, each one's (last) checksum, the ranks reported desynced."""

    step: int
    ranks: np.ndarray
    checksums: np.ndarray
    reported: set[int] = field(default_factory=set)

    def differing(self) -> set[int]:
        """`differing_ranks` of the ranks in order (none with one rank), and the reported ranks."""
        import numpy as np

        bad = set(self.reported)
        if len(self.ranks) > 1:
            reference = float(self.checksums[0])
            tolerance = CHECKSUM_RTOL * max(1.0, abs(reference))
            with np.errstate(invalid="ignore"):  # inf - inf: NaN, which differs
                bad.update(self.ranks[~(np.abs(self.checksums - reference) <= tolerance)].tolist())
        return bad

    def values(self) -> dict[str, float]:
        return {str(r): v for r, v in zip(self.ranks.tolist(), self.checksums.tolist(), strict=True)}


def by_step(
    step: np.ndarray, rank: np.ndarray, checksum: np.ndarray, reported: dict[int, set[int]]
) -> list[StepChecks]:
    """StepChecks in step order from rows (in record order) that carry a checksum, and the ranks
    reported by step; a step with reports only has no ranks."""
    import numpy as np

    order = np.lexsort((np.arange(len(step)), rank, step))  # by step, rank, then record order
    step, rank, checksum = step[order], rank[order], checksum[order]
    last = np.ones(len(step), bool)  # the later record of a (step, rank) counts
    last[:-1] = (step[1:] != step[:-1]) | (rank[1:] != rank[:-1])
    step, rank, checksum = step[last], rank[last], checksum[last]
    starts = np.flatnonzero(np.r_[True, step[1:] != step[:-1]]) if len(step) else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], len(step)] if len(step) else starts
    out = {
        int(step[a]): StepChecks(step=int(step[a]), ranks=rank[a:b], checksums=checksum[a:b])
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    }
    empty = np.zeros(0, np.int64), np.zeros(0)
    for s, ranks in reported.items():
        out.setdefault(s, StepChecks(step=s, ranks=empty[0], checksums=empty[1])).reported |= ranks
    return [out[s] for s in sorted(out)]


def from_records(records: list[dict[str, Any]]) -> list[StepChecks]:
    import numpy as np

    rows: list[tuple[int, int, float]] = []
    reported: dict[int, set[int]] = {}
    for rec in records:
        step, rank = rec.get("step"), rec.get("rank")
        if not isinstance(step, int) or not isinstance(rank, int):
            continue
        value = as_float(rec.get("weights_checksum"))
        if value is not None:
            rows.append((step, rank, value))
        if rec.get("desync_ranks"):
            reported.setdefault(step, set()).update(int(r) for r in rec["desync_ranks"])
    step, rank = (np.array([row[i] for row in rows], dtype=np.int64) for i in (0, 1))
    return by_step(step, rank, np.array([row[2] for row in rows], dtype=float), reported)


def from_table(table: pyarrow.Table) -> list[StepChecks]:
    """From the steps table's rank, step, weights_checksum and desync_ranks columns."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from ciuic_doctor.rundir.frames import float_values

    keyed = pc.and_(pc.is_valid(table.column("rank")), pc.is_valid(table.column("step")))
    carries = pc.and_(keyed, pc.is_valid(table.column("weights_checksum")))
    rows = table.select(["step", "rank", "weights_checksum"]).filter(carries)  # not the host strings
    step, rank = (rows.column(c).cast(pa.int64()).to_numpy() for c in ("step", "rank"))
    values = float_values(rows.column("weights_checksum"))
    reported: dict[int, set[int]] = {}
    desync = table.column("desync_ranks")
    if pa.types.is_list(desync.type) and desync.null_count < len(desync):
        # the few records that name desynced ranks, as dicts; list lengths of the rows with a list only
        # (of every row they were 50 MiB at 3,000 ranks × 1,000 steps, the column all null)
        lists = table.select(["step", "desync_ranks"]).filter(pc.and_(keyed, pc.is_valid(desync)))
        lists = lists.filter(pc.greater(pc.list_value_length(lists.column("desync_ranks")), 0))
        for rec in lists.to_pylist():
            reported.setdefault(rec["step"], set()).update(int(r) for r in rec["desync_ranks"])
    return by_step(step, rank, values, reported)
