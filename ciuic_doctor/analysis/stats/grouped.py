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


def middle_pair(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `a` (n columns): the order statistics (n - 1) // 2 and n // 2, NaN as the largest
    value. One partition at n // 2 and the largest value left of it: the same two numbers as a partition
    at both, which numpy does ~5.6x slower (50 rows of 19,900 pairwise slopes: 13.5 ms vs 2.4 ms).

    >>> import numpy as np
    >>> [v.tolist() for v in middle_pair(np.array([[3.0, 1.0, 2.0, 10.0], [5.0, 4.0, 6.0, np.nan]]))]
    [[2.0, 5.0], [3.0, 6.0]]
    """
    import numpy as np

    n = a.shape[1]
    half = n // 2
    part = np.partition(a, half, axis=1)
    upper = part[:, half]
    return (upper if n % 2 else part[:, :half].max(axis=1)), upper


def finite_row_medians(a: np.ndarray) -> np.ndarray:
    """np.median(a, axis=1) of a matrix without NaN, without np.median's NaN check (a third of its time
    on the trend fits): one partition, the middle value or the mean of the middle two.

    >>> import numpy as np
    >>> finite_row_medians(np.array([[3.0, 1.0, 2.0, 10.0], [5.0, 4.0, 6.0, 7.0]])).tolist()
    [2.5, 5.5]
    """

    lower, upper = middle_pair(a)
    return upper if a.shape[1] % 2 else (lower + upper) / 2
