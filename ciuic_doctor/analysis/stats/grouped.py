"""Grouped numpy passes the analyses share: whether rows are already in a sort order (one vectorised
pass), the median of each group (throughput's per-rank rules), and the median of each row of a matrix
without NaN (the trend fits; the steps analysis's pace medians for rows without gaps).

Why: the steps table comes rank by rank and, within a rank, in step and time order, so the lexsorts
that put rows in (rank, t) or (rank, segment, step) order, and the lexsort of each median, mostly
reordered rows that were in order: most of throughput's 2.7 s at 3,000 ranks × 1,000 steps under
cProfile (grouped_median alone 1.1 s). A check costs a comparison per row; rows out of order are sorted
as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

BLOCK_VALUES = 1 << 20  # member_nanmedians: values of a block of groups (8 MB of float64 a temporary)


def in_order(*keys: np.ndarray) -> bool:
    """Whether np.lexsort(keys) (the last key first, ties in row order) would leave the rows where they
    are. A NaN compares as out of order (lexsort puts it last): the caller sorts."""
    import numpy as np

    if len(keys[0]) < 2:
        return True
    ordered = np.ones(len(keys[0]) - 1, bool)  # row i ≤ row i + 1 on the keys seen so far
    for key in keys:  # the least significant first, as lexsort takes them
        ordered = (key[:-1] < key[1:]) | ((key[:-1] == key[1:]) & ordered)
    return bool(ordered.all())


def distinct(values: np.ndarray) -> np.ndarray:
    """np.unique of whole numbers; by a count over their range when it is narrow (a block's ranks and
    steps: np.unique's hash took 0.5 s of the steps analysis at 3,000 ranks × 1,000 steps, and its sort
    0.38 s of the page's step axes at 10,000 ranks).

    >>> import numpy as np
    >>> distinct(np.array([7, 3, 3, 5])).tolist(), distinct(np.array([10**12, 1])).tolist()
    ([3, 5, 7], [1, 1000000000000])
    """
    import numpy as np

    if not len(values):
        return values
    lo, hi = int(values.min()), int(values.max())
    if hi - lo > 4 * len(values) + 1024:
        return np.unique(values)
    return np.flatnonzero(np.bincount(values - lo)) + lo


def places(axis: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Where each of `values` sits on `axis` (sorted, unique); a value not on it gets some place in range
    whose axis value differs from it (a caller that may hold such values checks `axis[place] == value`).
    Ranks and steps are nearly always a run of consecutive integers, and then the place is an offset,
    not a binary search (10 M step rows on 10,000 ranks: ~0.5 s searched).

    >>> import numpy as np
    >>> places(np.array([3, 4, 5]), np.array([5, 3, 9])).tolist()
    [2, 0, 2]
    >>> places(np.array([1, 7, 9]), np.array([9, 7, 0])).tolist()
    [2, 1, 0]
    """
    import numpy as np

    if not len(axis):
        return np.zeros(len(values), np.int64)
    if axis[-1] - axis[0] == len(axis) - 1:
        return np.clip(values - axis[0], 0, len(axis) - 1)
    return np.minimum(np.searchsorted(axis, values), len(axis) - 1)


def grouped_median(group: np.ndarray, values: np.ndarray, count: int) -> np.ndarray:
    """statistics.median of `values` per group id (0..count-1); NaN for a group with none. Groups that
    come together (ids not decreasing) are partitioned in place of a sort, all groups of one size at once;
    the middle values are the same (a NaN is the largest in both)."""
    import numpy as np

    sizes = np.bincount(group, minlength=count)
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    out = np.full(count, np.nan)
    if not in_order(group):
        order = np.lexsort((values, group))
        v = values[order]
        has = sizes > 0
        lo = starts[has] + (sizes[has] - 1) // 2
        hi = starts[has] + sizes[has] // 2
        out[has] = np.where(lo == hi, v[lo], (v[lo] + v[hi]) / 2)
        return out
    for size in np.unique(sizes[sizes > 0]).tolist():
        which = np.flatnonzero(sizes == size)
        lower, upper = middle_pair(values[starts[which, None] + np.arange(size)])
        out[which] = upper if size % 2 else (lower + upper) / 2
    return out


def middle_pair(a: np.ndarray, *, in_place: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `a` (n columns): the order statistics (n - 1) // 2 and n // 2, NaN as the largest
    value. One partition at n // 2 and the largest value left of it: the same two numbers as a partition
    at both, which numpy does ~5.6x slower (50 rows of 19,900 pairwise slopes: 13.5 ms vs 2.4 ms).
    `in_place`: partition `a` itself (its values stay, their order does not), not a copy of it.

    >>> import numpy as np
    >>> [v.tolist() for v in middle_pair(np.array([[3.0, 1.0, 2.0, 10.0], [5.0, 4.0, 6.0, np.nan]]))]
    [[2.0, 5.0], [3.0, 6.0]]
    """
    import numpy as np

    n = a.shape[1]
    half = n // 2
    if in_place:
        a.partition(half, axis=1)
        part = a
    else:
        part = np.partition(a, half, axis=1)
    upper = part[:, half].copy() if in_place else part[:, half]
    return (upper if n % 2 else part[:, :half].max(axis=1)), upper


def finite_row_medians(a: np.ndarray, *, in_place: bool = False) -> np.ndarray:
    """np.median(a, axis=1) of a matrix without NaN, without np.median's NaN check (a third of its time
    on the trend fits): one partition, the middle value or the mean of the middle two.

    >>> import numpy as np
    >>> finite_row_medians(np.array([[3.0, 1.0, 2.0, 10.0], [5.0, 4.0, 6.0, 7.0]])).tolist()
    [2.5, 5.5]
    """
    lower, upper = middle_pair(a, in_place=in_place)
    return upper if a.shape[1] % 2 else (lower + upper) / 2


def member_nanmedians(matrix: np.ndarray, members: list[list[int]]) -> np.ndarray:
    """np.nanmedian(matrix[rows], axis=0) for each list of rows in `members` (a host's ranks), as one
    (len(members), columns) array: groups of one size are sorted together along their rows (NaN last)
    and their middle values taken, where np.nanmedian on a few rows went through numpy's masked arrays
    (~370 us a call; 25,000 calls, 9 s, for 12,500 hosts of 8 ranks). NaN where a column has no value.

    >>> import numpy as np
    >>> m = np.array([[1.0, np.nan], [3.0, 2.0], [2.0, np.nan], [9.0, 4.0]])
    >>> member_nanmedians(m, [[0, 1, 2], [1, 3]]).tolist()
    [[2.0, 2.0], [6.0, 3.0]]
    """
    import numpy as np

    out = np.full((len(members), matrix.shape[1]), np.nan)
    sizes: dict[int, list[int]] = {}
    for g, rows in enumerate(members):
        sizes.setdefault(len(rows), []).append(g)
    per_block = max(1, BLOCK_VALUES // max(1, matrix.shape[1]))  # rows a block: its temporaries stay small
    for size, of_size in sizes.items():
        step = max(1, per_block // max(1, size))
        for at in range(0, len(of_size) if size else 0, step):
            groups = of_size[at : at + step]
            out[groups] = _block_nanmedians(matrix[np.array([members[g] for g in groups])])
    return out


def _block_nanmedians(block: np.ndarray) -> np.ndarray:
    """np.nanmedian(block, axis=1) of a (groups, size, columns) block."""
    import numpy as np

    ordered = np.sort(block, axis=1)
    count = np.count_nonzero(~np.isnan(block), axis=1)
    lo, hi = np.maximum(count - 1, 0) // 2, count // 2  # hi <= size // 2: always a row of the block
    lower = np.take_along_axis(ordered, lo[:, None, :], axis=1)[:, 0]
    upper = np.take_along_axis(ordered, hi[:, None, :], axis=1)[:, 0]
    with np.errstate(invalid="ignore", over="ignore"):
        middle = np.where(lo == hi, lower, (lower + upper) / 2)
    return np.where(count > 0, middle, np.nan)
