"""The steps stream as the report reads it: straight from the cached pyarrow table (frames.read_stream), a
block of rows at a time, never as one pandas frame of every row.

Why: the report made the table a pandas frame, sorted all of its rows by (rank, step) for the per-rank
table and copied it for each ranks × steps grid (`frame[keep].assign(...)`; tests/test_report_columns.py
keeps that code as the reference). At 3,000 ranks × 1,000 steps (3 M rows) the frame cost 56 MiB over
the cached table, each grid 129 MiB (23 MiB of it the grid), the per-rank table 94 MiB; at 10,000
ranks, three times that. Here a block is BLOCK_ROWS rows (a numpy view of a float column without nulls,
else a copy of the block):

- `grid(column)`: the ranks × steps matrix of one column, filled a block at a time;
- `per_rank()`: `summarise` on blocks of whole ranks in (rank, step) order. A run's rows are
  its per-rank files in rank order, each in step order: when a vectorised check confirms it (no null
  rank or step, rank never decreasing, step never decreasing within a rank) the blocks are slices of the
  table; otherwise (a shared file, a restarted rank) they are taken through a stable sort of the row
  numbers by (rank, step), the order `sort_values(["rank", "step"], kind="stable")` gave.

A host column may be dictionary-encoded (pandas Categorical); a block casts it to plain strings first, so
the per-rank table is the same either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    import pyarrow as pa

# 256 ranks of 1,000 steps. The per-rank table of 3,000 such ranks in blocks of 2^18 rows: 0.11 s, +12 MiB;
# of 2^20: 0.10 s, +35 MiB; of 2^16: 0.18 s (pandas' cost per groupby call); sorted whole: 0.17 s, +90 MiB.
BLOCK_ROWS = 1 << 18
PER_RANK_COLUMNS = ("rank", "step", "host", "step_time_s", "loss", "skipped", "rss")


class StepTable:
    """The report's columns of every step record (a pyarrow table of frames.STREAM_COLUMNS' types)."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table

    @classmethod
    def from_records(cls, records: Sequence[dict[str, Any]], columns: Sequence[str]) -> StepTable:
        """Plain records (a caller without the column-wise read), each value coerced to its column's type
        as the columnar reader does with a record of a file (a value of the wrong type becomes null)."""
        import pyarrow as pa

        from ciuic_doctor.rundir.columnar_schema import COLUMN_TYPES, _coerce
        from ciuic_doctor.rundir.frames import schema_for

        schema = schema_for(columns)
        return cls(
            pa.table(
                {
                    c: pa.array(
                        [_coerce(r.get(c), COLUMN_TYPES.get(c, "float64"))[0] for r in records],
                        type=schema.field(c).type,
                    )
                    for c in columns
                }
            )
        )

    @property
    def rows(self) -> int:
        return self.table.num_rows

    def has_steps(self) -> bool:
        return self.rows > 0 and self.table["step"].null_count < self.rows

    @property
    def ranks(self) -> list[int]:
        """Every rank a record names (whether or not its step is known), sorted."""
        import pyarrow.compute as pc

        return sorted(pc.unique(self.table["rank"]).drop_null().to_pylist())

    @property
    def hosts(self) -> list[str]:
        import pyarrow.compute as pc

        return sorted(str(h) for h in pc.unique(self.table["host"]).drop_null().to_pylist())

    def positive(self, column: str) -> int:
        """How many records have `column` > 0 (null and NaN are not)."""
        import pyarrow.compute as pc

        return int(pc.sum(pc.greater(self.table[column], 0)).as_py() or 0)

    # ---- blocks of rows ---------------------------------------------------------------------------
    def _keys(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """rank and step of rows [start, stop) as int64 (views without nulls) and which have both."""
        from ciuic_doctor.rundir.frames import whole_values

        rank, rank_ok = whole_values(self.table["rank"].slice(start, stop - start))
        step, step_ok = whole_values(self.table["step"].slice(start, stop - start))
        valid = rank_ok if step_ok is None else step_ok if rank_ok is None else rank_ok & step_ok
        return rank, step, valid

    def _blocks(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray | None]]:
        for start in range(0, self.rows, BLOCK_ROWS):
            yield start, *self._keys(start, min(start + BLOCK_ROWS, self.rows))

    @cached_property
    def _axes(self) -> tuple[np.ndarray, np.ndarray]:
        """The sorted ranks and steps of the rows that have both."""
        import numpy as np

        from ciuic_doctor.analysis.stats.grouped import distinct

        ranks, steps = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
        for _, rank, step, valid in self._blocks():
            ranks.append(distinct(rank if valid is None else rank[valid]))
            steps.append(distinct(step if valid is None else step[valid]))
        return np.unique(np.concatenate(ranks)), np.unique(np.concatenate(steps))

    def grid(self, column: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ranks, steps, ranks × steps values of `column`) of the rows with a rank and a step: NaN where a
        rank has no finite value; of duplicates (a restarted rank), the later row."""
        import numpy as np

        from ciuic_doctor.analysis.stats.grouped import places
        from ciuic_doctor.rundir.frames import float_values

        ranks, steps = self._axes
        values = self.table[column]
        if self._full and values.null_count < len(values):  # row i is (ranks[i // steps], steps[i % steps])
            grid = np.array(float_values(values), dtype=float).reshape(len(ranks), len(steps))  # a copy
            grid[~np.isfinite(grid)] = np.nan
            return ranks, steps, grid
        grid = np.full((len(ranks), len(steps)), np.nan)
        if values.null_count == len(values):
            return ranks, steps, grid
        for start, rank, step, valid in self._blocks():
            block = float_values(values.slice(start, len(rank)))
            keep = slice(None) if valid is None else valid
            grid[places(ranks, rank[keep]), places(steps, step[keep])] = block[keep]
        grid[~np.isfinite(grid)] = np.nan
        return ranks, steps, grid

    @cached_property
    def _full(self) -> bool:
        """Whether the rows are the whole ranks × steps grid in its order, once each (every rank recorded
        every step, the per-rank files in rank order): a grid is then the column itself, reshaped, where
        it was scattered into place a block at a time (0.3 s a column at 10,000 ranks × 1,000 steps)."""
        import numpy as np

        ranks, steps = self._axes
        if not len(steps) or self.rows != len(ranks) * len(steps):
            return False
        for start, rank, step, valid in self._blocks():
            at = np.arange(start, start + len(rank))
            if valid is not None or not (
                np.array_equal(rank, ranks[at // len(steps)]) and np.array_equal(step, steps[at % len(steps)])
            ):
                return False
        return True

    # ---- per-rank table ---------------------------------------------------------------------------
    @cached_property
    def _order(self) -> np.ndarray | None:
        """None when the rows are already in (rank, step) order, all with a rank and a step; else the row
        numbers of those that have both, stably sorted by (rank, step)."""
        import numpy as np

        rank, step, valid = self._keys(0, self.rows)
        if valid is None:
            same = rank[1:] == rank[:-1]
            if not (rank[1:] < rank[:-1]).any() and not ((step[1:] < step[:-1]) & same).any():
                return None
            del same
        rows = np.arange(self.rows) if valid is None else np.flatnonzero(valid)
        return rows[np.lexsort((step[rows], rank[rows]))]

    def _rank_blocks(self) -> Iterator[pa.Table]:
        """PER_RANK_COLUMNS of about BLOCK_ROWS rows at a time in (rank, step) order, each block whole
        ranks (a rank longer than a block is a block); one empty block when no row has a rank and a step."""
        import numpy as np

        from ciuic_doctor.analysis.stats.rank_blocks import block_bounds
        from ciuic_doctor.rundir.frames import whole_values

        table = self.table.select(list(PER_RANK_COLUMNS))
        order = self._order
        rank = whole_values(table["rank"])[0]
        if order is not None:
            rank = rank[order]
        starts = np.flatnonzero(rank[1:] != rank[:-1]) + 1  # where a rank's rows begin (but the first)
        rows = len(rank)
        del rank
        if not rows:
            yield table.slice(0, 0) if order is None else table.take(order)
        for start, stop in block_bounds(starts, rows, BLOCK_ROWS):
            yield table.slice(start, stop - start) if order is None else table.take(order[start:stop])

    def per_rank(self) -> pd.DataFrame:
        """summarise of every rank (one row each, by rank), a block of whole ranks at a time in numpy
        (`_summarised`): a pandas frame of each block, grouped, was 0.55 s at 10,000 ranks × 1,000 steps,
        on the path of the page's job section."""
        import pandas as pd

        return pd.concat([_summarised(block) for block in self._rank_blocks()], ignore_index=True)


def _summarised(block: pa.Table) -> pd.DataFrame:
    """`summarise` of a block of whole ranks in (rank, step) order, every row with a rank and a step: the
    same frame (NaN left out of the medians, maxima and last values as pandas leaves it)."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    from ciuic_doctor.analysis.stats.grouped import grouped_median
    from ciuic_doctor.rundir.frames import float_values, whole_values
    from ciuic_doctor.rundir.frames.assemble import plain_strings

    rank = whole_values(block["rank"])[0]
    if not len(rank):
        return summarise(plain_strings(block).to_pandas(split_blocks=True))
    new = np.r_[True, rank[1:] != rank[:-1]]
    starts, group = np.flatnonzero(new), np.cumsum(new) - 1
    rows = np.arange(len(rank))

    def last(valid: np.ndarray) -> np.ndarray:  # each rank's last row where `valid`, -1 where none
        return np.maximum.reduceat(np.where(valid, rows, -1), starts)

    def flags(column: pa.ChunkedArray) -> np.ndarray:
        return column.to_numpy(zero_copy_only=False).astype(bool)

    host_at = last(flags(block["host"].is_valid()))
    hosts = plain_strings(block.select(["host"]))["host"].take(pa.array(np.maximum(host_at, 0))).to_pylist()
    step_ms = float_values(block["step_time_s"]) * 1e3
    timed = ~np.isnan(step_ms)
    loss = float_values(block["loss"])
    loss_at = last(~np.isnan(loss))
    hosts = [h if at >= 0 else None for h, at in zip(hosts, host_at, strict=True)]
    skipped = flags(block["skipped"].fill_null(False)).astype(np.int64)
    return pd.DataFrame(
        {
            "rank": rank[starts].astype(np.int64),
            "host": pd.array(hosts, dtype="str"),
            "steps": np.add.reduceat(flags(block["step"].is_valid()).astype(np.int64), starts),
            "median_step_ms": grouped_median(group[timed], step_ms[timed], len(starts)),
            "max_step_ms": np.fmax.reduceat(step_ms, starts),
            "last_loss": np.where(loss_at >= 0, loss[np.maximum(loss_at, 0)], np.nan),
            "skipped_steps": np.add.reduceat(skipped, starts),
            "peak_rss_bytes": np.fmax.reduceat(float_values(block["rss"]), starts),
        }
    )


def summarise(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per rank: rank, host, steps, median_step_ms, max_step_ms, last_loss, skipped_steps,
    peak_rss_bytes, from rows that all have a rank and a step, in (rank, step) order (vectorised groupby;
    StepTable.per_rank hands it blocks of whole ranks)."""
    import pandas as pd

    step_ms = pd.to_numeric(frame["step_time_s"], errors="coerce") * 1e3
    grouped = frame.assign(step_ms=step_ms, skipped=frame["skipped"].fillna(False).astype(bool)).groupby(
        "rank"
    )
    table = pd.DataFrame(
        {
            "host": grouped["host"].last(),
            "steps": grouped["step"].count(),
            "median_step_ms": grouped["step_ms"].median(),
            "max_step_ms": grouped["step_ms"].max(),
            "last_loss": grouped["loss"].last(),
            "skipped_steps": grouped["skipped"].sum(),
            "peak_rss_bytes": grouped["rss"].max(),
        }
    )
    table.index = table.index.astype("int64")
    return table.reset_index()
