"""The steps table as a `steps.crossrank.StepMatrix` (every rank's step time and pace at every step), read
from
the arrow table BLOCK_ROWS rows at a time.

Why blocks: the pandas frame of rank, step, host and the two times, the factorize of every row's host
string and np.unique / searchsorted over all rows added 503 MiB over the cached table at 3,000 ranks ×
1,000 steps (0.53 s CPU). Here it is 72 MiB (0.21 s): the grids (8 bytes × ranks × steps each, 46 MiB)
and one block's arrays. The rows may come in any order: nothing here assumes a rank's rows are together.

The rules, as the pandas version had them: a row without a whole-number rank and step is left out; the
steps after the warm-up are kept when at least `min_steady_steps` of them remain, else all; a (rank,
step) recorded twice keeps the later record's value (a restarted rank); a rank's host is the last one
its kept rows name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    import pyarrow


@dataclass(kw_only=True)
class StepMatrix:
    """One value per (rank, step): `ranks` and `steps` sorted, NaN where a rank recorded no value."""

    ranks: np.ndarray
    steps: np.ndarray
    hosts: list[str | None]
    step_time_s: np.ndarray
    pace_s: np.ndarray
    pace_metric: str

    @property
    def host_of(self) -> dict[int, str | None]:
        return dict(zip(self.ranks.tolist(), self.hosts, strict=True))


BLOCK_ROWS = 1 << 18  # 262,144 rows: 2 MiB an array, where a whole column is 80 MB at 10,000 ranks
TIMES = ("step_time_s", "pre_backward_s")


def table_of(frame: pd.DataFrame) -> pyarrow.Table:
    """Records' frame as the table `matrix_from_table` reads: rank, step and the times as float64 (NaN
    where a value is not a number), host as text (None where missing)."""
    import pandas as pd
    import pyarrow as pa

    columns = {}
    for name in ("rank", "step", *TIMES):
        if name in frame:
            numbers = pd.to_numeric(frame[name], errors="coerce").to_numpy(dtype=float, na_value=float("nan"))
            columns[name] = pa.array(numbers, type=pa.float64())
    if "host" in frame:
        missing = frame["host"].isna().tolist()
        hosts = [None if gone else str(h) for h, gone in zip(frame["host"].tolist(), missing, strict=True)]
        columns["host"] = pa.array(hosts, type=pa.string())
    return pa.table(columns)


def _blocks(table: pyarrow.Table) -> Iterator[tuple[int, pyarrow.Table]]:
    for start in range(0, table.num_rows, BLOCK_ROWS):
        yield start, table.slice(start, BLOCK_ROWS)


def _keys(part: pyarrow.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, step, whether the row has both) of a block of rows."""
    import numpy as np

    from ciuic_doctor.rundir.frames import whole_values

    rank, has_rank = whole_values(part.column("rank"))
    step, has_step = whole_values(part.column("step"))
    known = [valid for valid in (has_rank, has_step) if valid is not None]
    return rank, step, np.logical_and.reduce(known) if known else np.ones(len(rank), bool)


def _ids(table: pyarrow.Table, warmup_steps: int, min_steady_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, steps) of the matrix, sorted: the steady steps (or all), the ranks that have a row there."""
    import numpy as np

    from ciuic_doctor.analysis.stats.grouped import distinct

    steps, ranks, steady_ranks = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for _, part in _blocks(table):
        rank, step, ok = _keys(part)
        steps.append(distinct(step[ok]))
        ranks.append(distinct(rank[ok]))
        steady_ranks.append(distinct(rank[ok & (step > warmup_steps)]))
    all_steps = np.unique(np.concatenate(steps))
    steady = all_steps[all_steps > warmup_steps]
    if len(steady) >= min_steady_steps:
        return np.unique(np.concatenate(steady_ranks)), steady
    return np.unique(np.concatenate(ranks)), all_steps


def matrix_from_table(table: pyarrow.Table, *, warmup_steps: int, min_steady_steps: int) -> StepMatrix | None:
    """The StepMatrix of a table with columns rank and step (host and the TIMES where there); None when
    no row has both a rank and a step."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from ciuic_doctor.analysis.stats.grouped import places
    from ciuic_doctor.rundir.frames import float_values

    names = set(table.column_names)
    if not table.num_rows or not {"rank", "step"} <= names:
        return None
    ranks, steps = _ids(table, warmup_steps, min_steady_steps)
    if not len(ranks) or not len(steps):
        return None
    # a column without a value anywhere (pace from another tool's log) gets no grid: it would be all NaN
    times = [c for c in TIMES if c in names and table.column(c).null_count < table.num_rows]
    grids = {c: np.full((len(ranks), len(steps)), np.nan) for c in times}
    last_named = np.full(len(ranks), -1, np.int64)  # each rank's last row that names a host
    for start, part in _blocks(table):
        rank, step, ok = _keys(part)
        col = places(steps, step)
        ok &= steps[col] == step  # a warm-up step left out
        rows, col = places(ranks, rank[ok]), col[ok]
        for name, grid in grids.items():
            grid[rows, col] = float_values(part.column(name))[ok]  # rows in order: a later record wins
        if "host" in names:
            named = pc.is_valid(part.column("host")).to_numpy(zero_copy_only=False)[ok]
            np.maximum.at(last_named, rows[named], start + np.flatnonzero(ok)[named])
        del rank, step, ok, rows, col
    for grid in grids.values():
        grid[~np.isfinite(grid)] = np.nan
    hosts: list[str | None] = [None] * len(ranks)
    if "host" in names and (last_named >= 0).any():
        where = np.flatnonzero(last_named >= 0)
        named_hosts = table.column("host").take(pa.array(last_named[where])).to_pylist()
        for i, host in zip(where.tolist(), named_hosts, strict=True):
            hosts[i] = str(host)
    step_time = grids.get("step_time_s", np.full((len(ranks), len(steps)), np.nan))
    pace = grids.get("pre_backward_s")
    # pre_backward_s is the rank's own pace; without it (other tools' logs) step time is all there is
    has_pace = pace is not None and bool(np.isfinite(pace).any(axis=1).all())
    return StepMatrix(
        ranks=ranks,
        steps=steps,
        hosts=hosts,
        step_time_s=step_time,
        pace_s=pace if has_pace else step_time,
        pace_metric="pre_backward_s" if has_pace else "step_time_s",
    )


# ---- a frame's rows (records) ---------------------------------------------------------------------
def step_matrix(frame: pd.DataFrame, *, warmup_steps: int, min_steady_steps: int) -> StepMatrix | None:
    """The steps stream as matrices (rows with a whole-number rank and step only); None when empty.
    A frame of records goes through the same reader as the steps table."""
    if "rank" not in frame or "step" not in frame or frame.empty:
        return None
    return matrix_from_table(table_of(frame), warmup_steps=warmup_steps, min_steady_steps=min_steady_steps)
