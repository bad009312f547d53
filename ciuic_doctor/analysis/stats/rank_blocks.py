"""The steps table in blocks of whole ranks, for per-rank rules that need all of a rank's rows and only
those (`throughput.columns`), so that their sorts and temporaries are a block's size, not the table's.

The reader concatenates the per-rank files in rank order, so a rank's rows are normally one run of
consecutive rows and a block is a zero-copy slice of the table. That is checked, not assumed (one pass
over the rank column, a block of it at a time): when a rank's rows come in more than one run (a shared
file holding rows of ranks that have files of their own, a table built another way), a block is the
rows of a range of ranks filtered out of the whole table, in their order there (a copy of the block,
and the rank of every row, 8 bytes a row, while the blocks are made).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import pyarrow

BLOCK_ROWS = 1 << 18  # rows in a block (whole ranks: a few more or fewer): 2 MiB a float64 array


def rank_of(table: pyarrow.Table) -> np.ndarray:
    """The table's ranks as int64 with a null (or no rank column) as 0: a record without a rank is
    rank 0."""
    import numpy as np

    from ciuic_doctor.rundir.frames import whole_values

    if "rank" not in table.column_names:
        return np.zeros(table.num_rows, np.int64)
    return whole_values(table.column("rank"))[0]


def _keys(table: pyarrow.Table) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rank_of) of BLOCK_ROWS rows at a time."""
    for lo in range(0, table.num_rows, BLOCK_ROWS):
        yield lo, rank_of(table.slice(lo, BLOCK_ROWS))


def run_starts(table: pyarrow.Table) -> list[int] | None:
    """Where each rank's run of rows starts, when every rank's rows are one run; else None."""
    import numpy as np

    starts: list[int] = []
    seen: set[int] = set()
    previous = None
    for lo, key in _keys(table):
        first = np.array([previous is None or key[0] != previous])
        change = np.flatnonzero(np.concatenate([first, key[1:] != key[:-1]]))
        new = key[change].tolist()
        if len(set(new)) < len(new) or seen.intersection(new):
            return None
        seen.update(new)
        starts.extend((lo + change).tolist())
        previous = key[-1]
    return starts


def rank_blocks(table: pyarrow.Table) -> Iterator[pyarrow.Table]:
    """The table as blocks of whole ranks of about BLOCK_ROWS rows, each rank in one block, its rows in
    table order."""
    import numpy as np

    starts = run_starts(table)
    if starts is None:
        yield from _filtered(table)
        return
    for lo, hi in block_bounds(np.asarray(starts, np.int64), table.num_rows, BLOCK_ROWS):
        yield table.slice(lo, hi - lo)


def block_bounds(starts: np.ndarray, rows: int, block_rows: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) row ranges of about `block_rows` rows that cut only where a rank's run of rows starts
    (`starts`, sorted): each rank whole in one block, a rank longer than a block a block of its own.

    >>> import numpy as np
    >>> list(block_bounds(np.array([0, 3, 5, 9]), 12, 4))
    [(0, 5), (5, 9), (9, 12)]
    """
    import numpy as np

    bounds = np.append(starts[starts > 0], rows)
    lo = 0
    while lo < rows:
        hi = int(bounds[min(np.searchsorted(bounds, lo + block_rows), len(bounds) - 1)])
        yield lo, hi
        lo = hi


def _filtered(table: pyarrow.Table) -> Iterator[pyarrow.Table]:
    """Blocks of consecutive ranks of about BLOCK_ROWS rows, each filtered out of the whole table."""
    import numpy as np
    import pyarrow as pa

    key = np.concatenate([k for _, k in _keys(table)])
    found = [
        np.unique(key[lo : lo + BLOCK_ROWS], return_counts=True) for lo in range(0, len(key), BLOCK_ROWS)
    ]
    ranks, where = np.unique(np.concatenate([u for u, _ in found]), return_inverse=True)
    rows = np.bincount(where, weights=np.concatenate([c for _, c in found]), minlength=len(ranks))
    block = (np.cumsum(rows) - rows) // BLOCK_ROWS  # the block of each rank: by the rows before it
    for b in np.unique(block).tolist():
        lo, hi = ranks[block == b][[0, -1]]
        yield table.filter(pa.array((key >= lo) & (key <= hi)))
