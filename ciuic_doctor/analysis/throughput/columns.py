"""Tokens/s and goodput of every rank at once, from the steps table's columns (throughput.py's per-rank
rules, `tokens_per_s` and `goodput`, as grouped numpy operations).

Why: the per-record path turned the steps table into 2 M dicts (`to_pylist`) and looped over them per
rank — 55 s of a 1,024-rank × 2,000-step report under cProfile, and 10 M dicts at 10,000 ranks. Here each
rule is a sort by (rank, key) and per-rank reductions. A rank whose records the grouped rules would not
reproduce exactly — a step number recorded twice after start-up (a rollback: the last record of a step
counts, in dict order), or a NaN in a column a rule compares — is judged by the per-record functions
on that rank's records alone (tests/test_throughput_columns.py compares both ways on fuzzed ranks). Sums are
numpy's, so an evidence figure may differ from the per-record sum in its last bits, never in what is
printed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ciuic_doctor.analysis.stats.grouped import grouped_median, in_order

if TYPE_CHECKING:
    import numpy as np
    import pyarrow

COLUMNS = ("rank", "step", "t", "step_time_s", "tokens", "skipped", "segment", "optimizer")
WARMUP_STEPS = 2


def _column(table: pyarrow.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(the column as float64 numpy with nulls as NaN, read-only: `frames.float_values`; where a value is
    a NaN rather than a null); a column the table lacks is all null."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from ciuic_doctor.rundir.frames import float_values

    if name not in table.column_names:
        return np.full(table.num_rows, np.nan), np.zeros(table.num_rows, bool)
    column = table.column(name)
    if pa.types.is_boolean(column.type):
        column = pc.cast(column, pa.int8())
    nan = np.zeros(table.num_rows, bool)
    if pa.types.is_floating(column.type):
        nan = pc.is_nan(column).fill_null(False).to_numpy(zero_copy_only=False)
    return float_values(column), nan


def _groups(rank: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group ids in sorted order, group starts, group sizes) of a rank array already sorted."""
    import numpy as np

    if not len(rank):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    sizes = np.diff(np.r_[starts, len(rank)])
    return np.repeat(np.arange(len(starts)), sizes), starts, sizes


@dataclass
class _Figures:
    """What the blocks found: the grouped rules' figures, and for the ranks they would not reproduce
    (`odd`), the per-record rules' (tokens/s, goodput figures; None where a rule found none)."""

    rates: dict[int, float] = field(default_factory=dict)
    good: dict[int, dict[str, float]] = field(default_factory=dict)
    odd: dict[int, tuple[float | None, dict[str, float] | None]] = field(default_factory=dict)


def per_rank(
    table: pyarrow.Table,
    created: Any,
    tokens_rule: Callable[[list[dict[str, Any]]], float | None],
    goodput_rule: Callable[[list[dict[str, Any]], Any], dict[str, float] | None],
) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """({rank: tokens/s}, {rank: goodput figures}) for every rank of the steps table; a rank without a
    figure is left out. The rules are throughput.py's per-record functions, for the ranks that need them.

    A block of whole ranks at a time (`stats.rank_blocks`): over the whole table the sorts and per-row
    temporaries added 324 MiB at 3,000 ranks × 1,000 steps. The ranks come in rank order, then the ones
    the per-record rules judged, as when the whole table was one block (ties are broken in this order)."""
    from ciuic_doctor.analysis.stats.rank_blocks import rank_blocks

    found = _Figures()
    for block in rank_blocks(table):
        _block(block, created, tokens_rule, goodput_rule, found)
    rates, good = dict(sorted(found.rates.items())), dict(sorted(found.good.items()))
    for r, (value, figures) in sorted(found.odd.items()):
        if value is not None:
            rates[r] = value
        if figures is not None:
            good[r] = figures
    return rates, good


def _block(
    table: pyarrow.Table,
    created: Any,
    tokens_rule: Callable[[list[dict[str, Any]]], float | None],
    goodput_rule: Callable[[list[dict[str, Any]], Any], dict[str, float] | None],
    found: _Figures,
) -> None:
    """The figures of one block's ranks (all of each rank's rows) into `found`."""
    import numpy as np

    from ciuic_doctor.analysis.stats.rank_blocks import rank_of

    rank = rank_of(table)
    if not len(rank):
        return
    cols, nan = {}, np.zeros(len(rank), bool)
    for name in COLUMNS[1:]:
        cols[name], is_nan = _column(table, name)
        nan |= is_nan
    rates = _rates(rank, cols)
    good, repeated = _goodput(rank, cols, created)
    del cols
    odd = set(rank[nan].tolist()) | repeated
    for r in sorted(odd):  # the per-record rules, on that rank's records alone
        rows = _rows_of(table, rank, r)
        rates.pop(r, None)
        good.pop(r, None)
        found.odd[r] = (tokens_rule(rows), goodput_rule(rows, created))
    found.rates.update(rates)
    found.good.update(good)


def _rows_of(table: pyarrow.Table, rank: np.ndarray, r: int) -> list[dict[str, Any]]:
    rows = table.filter(rank == r).to_pylist()  # a record without a rank is rank 0 (`rank_of`)
    for row in rows:
        if isinstance(row.get("skipped"), int) and not isinstance(row.get("skipped"), bool):
            row["skipped"] = bool(row["skipped"])
    return rows


def _rates(rank: np.ndarray, cols: dict[str, np.ndarray]) -> dict[int, float]:
    """tokens_per_s: records ordered by (segment or 1, step or 0, file order); the first WARMUP_STEPS
    left out when a rank has more than WARMUP_STEPS + 2; median of tokens / step time."""
    import numpy as np

    segment = np.where(np.isnan(cols["segment"]) | (cols["segment"] == 0), 1, cols["segment"])
    step = np.nan_to_num(cols["step"], nan=0.0)
    order = np.arange(len(rank))
    if not in_order(step, segment, rank):
        order = np.lexsort((order, step, segment, rank))
    r = rank[order]
    group, starts, sizes = _groups(r)
    position = np.arange(len(r)) - starts[group]
    steady = (position >= WARMUP_STEPS) | (sizes[group] <= WARMUP_STEPS + 2)
    tokens, time_s = cols["tokens"][order], cols["step_time_s"][order]
    ok = steady & ~np.isnan(tokens) & (tokens != 0) & (time_s > 0)
    medians = grouped_median(group[ok], tokens[ok] / time_s[ok], len(starts))
    return {int(r[s]): float(m) for s, m in zip(starts, medians, strict=True) if not np.isnan(m)}


def _goodput(
    rank: np.ndarray, cols: dict[str, np.ndarray], created: Any
) -> tuple[dict[int, dict[str, float]], set[int]]:
    """throughput.goodput's figures per rank (see there for what counts as productive), and the ranks
    that record a step number twice after their first record (left to the per-record rule: the last
    record of a step counts there, in the order a dict keeps)."""
    import numpy as np

    optimizer = cols["optimizer"]
    ids, rid = np.unique(rank, return_inverse=True)
    first = np.full(len(ids), np.inf)
    has = ~np.isnan(optimizer)
    np.minimum.at(first, rid[has], optimizer[has])
    keep = ~np.isnan(cols["t"]) & (np.isnan(optimizer) | (optimizer == first[rid]))
    index = np.flatnonzero(keep)
    if not in_order(cols["t"][index], rank[index]):
        index = index[np.lexsort((index, cols["t"][index], rank[index]))]  # by rank, then t (stable)
    order = index
    r = rank[order]
    group, starts, sizes = _groups(r)
    if not len(r):
        return {}, set()
    t, step_s = cols["t"][order], cols["step_time_s"][order]
    skipped = np.nan_to_num(cols["skipped"][order], nan=0.0) != 0
    after = np.ones(len(r), bool)
    after[starts] = False  # rows[1:]
    step = np.nan_to_num(cols["step"][order], nan=0.0)
    rs, ss = r[after], step[after]
    if not in_order(ss, rs):  # by rank, then step: a step recorded twice in neighbouring rows
        twice = np.lexsort((ss, rs))
        rs, ss = rs[twice], ss[twice]
    repeated = set(rs[1:][(rs[1:] == rs[:-1]) & (ss[1:] == ss[:-1])].tolist())
    positive = step_s > 0
    typical = grouped_median(group[positive], step_s[positive], len(starts))
    ends = starts + sizes - 1
    first_s = step_s[starts]
    start = t[starts] - np.where(np.isnan(first_s) | (first_s == 0), typical, first_s)
    if isinstance(created, int | float):
        start = np.where(created < start, float(created), start)
    step_or_0 = np.nan_to_num(step_s, nan=0.0)
    typical_of = typical[group]
    counted = after & ~skipped
    productive = np.add.reduceat(np.where(counted, np.minimum(step_or_0, typical_of), 0.0), starts)
    stalled = np.add.reduceat(np.where(counted, np.maximum(0.0, step_or_0 - typical_of), 0.0), starts)
    skipped_s = np.add.reduceat(np.where(after & skipped, step_or_0, 0.0), starts)
    wall = t[ends] - start
    startup = t[starts] - start
    out = {}
    for i in np.flatnonzero((sizes >= 3) & ~np.isnan(typical) & (wall > 0)).tolist():
        out[int(r[starts[i]])] = {
            "goodput": float(productive[i] / wall[i]),
            "goodput_after_startup": float(productive[i] / max(wall[i] - startup[i], 1e-9)),
            "wall_s": float(wall[i]),
            "productive_s": float(productive[i]),
            "startup_s": float(startup[i]),
            "skipped_s": float(skipped_s[i]),
            "over_typical_s": float(stalled[i]),
            "typical_step_s": float(typical[i]),
            "steps": int(sizes[i] - 1),
        }
    return out, repeated
