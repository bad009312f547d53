"""The common step table every importer gives (COLUMNS, `normalize`) and the steps each row covers
(`intervals`; `rank_intervals` in numpy for rows grouped by rank). Split from importers/__init__.py,
which keeps the StepLog, the format sniffing and the loaders; it re-exports these names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

COLUMNS: tuple[str, ...] = (
    "step", "rank", "t", "loss", "lr", "grad_norm", "loss_scale", "attempted_scale", "skipped", "nonfinite",
    "interval_steps", "series", "source",
)  # fmt: skip
FLOAT_COLUMNS = ("t", "loss", "lr", "grad_norm", "loss_scale", "attempted_scale")

PLACEHOLDERS = ("loss_scale", "grad_norm", "attempted_scale")


def normalize(
    columns: dict[str, Any], *, source: str = "", placeholders: tuple[str, ...] = PLACEHOLDERS
) -> pd.DataFrame:
    """A DataFrame with exactly COLUMNS and their dtypes from whatever subset `columns` holds.

    Anything that is not a number becomes NaN (a row without a step is dropped); counts are clipped at 0,
    intervals at 1, and a rank must be a whole number ≥ 0; the `placeholders` columns' values ≤ 0 are NaN.

    A float64 column given is the table's column as it is (no copy: it may be a read-only view of the
    caller's, e.g. of a pyarrow table), and so is an int64 column whose values already fit; an absent
    float column is one shared read-only NaN array. Integers of at most 2**53 are judged as integers,
    which is what their float64 values give (exact), without the float copy; larger ones take the float
    path, so the table is the same either way (tests/test_importers_columnar.py).
    """
    import numpy as np
    import pandas as pd

    n = max((len(v) for v in columns.values() if hasattr(v, "__len__")), default=0)

    def given(name: str) -> np.ndarray | None:  # numbers as they are (int, float, bool), else float64
        value = columns.get(name)
        if value is None:
            return None
        array = np.asarray(value)
        if array.dtype.kind in "fiub":
            return array
        return pd.to_numeric(pd.Series(value, dtype=object), errors="coerce").to_numpy(
            np.float64, na_value=np.nan
        )

    def number(array: np.ndarray | None, fill: float) -> np.ndarray:
        if array is None:
            return np.full(n, fill, dtype=np.float64)
        return array.astype(np.float64, copy=False)

    step = given("step")
    if _exact_ints(step):  # every int of at most 2**53 is finite and below 2**62
        keep, every = None, True
    else:
        step = number(step, np.nan)
        keep = np.isfinite(step) & (np.abs(step) < 2**62)
        every = bool(keep.all())
    rows = len(step) if every else int(keep.sum())

    def kept(array: np.ndarray) -> np.ndarray:
        return array if every else array[keep]

    def whole(name: str, fill: float, low: int, high: int, dtype: Any) -> np.ndarray:
        """A count, interval or series: NaN/inf as `fill`, clipped to [low, high], as `dtype`."""
        array = given(name)
        if array is None and fill == 0:
            return np.zeros(rows, dtype=dtype)  # calloc'ed: no resident memory until written
        top = min(high, np.iinfo(dtype).max)
        if _exact_ints(array) and (not len(array) or (array.min() >= low and array.max() <= top)):
            return kept(array).astype(dtype, copy=False)  # nothing to clip (else the float path's clip)
        value = np.nan_to_num(kept(number(array, fill)), nan=fill, posinf=fill, neginf=fill)
        return np.clip(value, low, high).astype(dtype)

    rank = given("rank")
    if _exact_ints(rank):
        rank = kept(rank)
        if not len(rank) or (rank.min() >= 0 and rank.max() < 2**31):
            ranks = pd.arrays.IntegerArray(rank.astype(np.int64, copy=False), np.zeros(rows, dtype=bool))
        else:
            valid_rank = (rank >= 0) & (rank < 2**31)
            ranks = pd.arrays.IntegerArray(np.where(valid_rank, rank, 0).astype(np.int64), ~valid_rank)
    else:
        rank = kept(number(rank, np.nan))
        valid_rank = np.isfinite(rank) & (rank >= 0) & (rank == np.round(rank)) & (rank < 2**31)
        ranks = pd.arrays.IntegerArray(np.where(valid_rank, rank, 0).astype(np.int64), ~valid_rank)
    del rank
    missing = None  # one NaN array for every absent float column (read-only: the columns share it)
    floats = {}
    for name in FLOAT_COLUMNS:
        array = given(name)
        if array is None:
            if missing is None:
                missing = np.full(rows, np.nan)
                missing.flags.writeable = False
            floats[name] = missing
        else:
            floats[name] = kept(number(array, np.nan))
        del array
    with np.errstate(invalid="ignore"):
        for name in placeholders:  # a text log's placeholders (-1.0, 0.000): no values
            floats[name] = np.where(floats[name] > 0, floats[name], np.nan)
    # in COLUMNS' order, each column its own block (copy=False): pandas' default stacks the float columns
    # into one 2-D copy, and a reindex copied all of them again (3 copies at once: 1.2 GB at 10,000
    # ranks × 1,000 steps). Under copy-on-write a read-only column is a column like any other.
    return pd.DataFrame(
        {
            "step": kept(step).astype(np.int64, copy=False),
            "rank": ranks,
            **floats,
            "skipped": whole("skipped", 0.0, 0, 2**62, np.int64),
            "nonfinite": whole("nonfinite", 0.0, 0, 2**62, np.int64),
            "interval_steps": whole("interval_steps", 1.0, 1, 2**62, np.int64),
            "series": whole("series", 0.0, 0, 2**15, np.int16),
            "source": pd.Categorical.from_codes(np.zeros(rows, dtype=np.int8), [source]),
        },
        copy=False,
    )


def _exact_ints(array: Any) -> bool:
    """A signed-integer array whose values float64 holds exactly (|value| ≤ 2**53): integer arithmetic on
    it gives what the float path gives."""
    if array is None or array.dtype.kind != "i":
        return False
    return not len(array) or (int(array.min()) >= -(2**53) and int(array.max()) <= 2**53)


def intervals(step, rank=None):  # pandas Series -> Series of steps each row covers
    """Steps since the same rank's previous row; the first row takes the next row's spacing."""
    import pandas as pd

    key = rank.fillna(-1) if rank is not None else pd.Series(0, index=step.index)
    diff = step.groupby(key).diff()
    diff = diff.where(diff > 0)  # a restart (iteration going back) gives no spacing
    following = diff.groupby(key).bfill()
    out = diff.fillna(following).fillna(1)
    first = diff.isna() & step.notna()
    out = out.where(~first | (step >= out), step.clip(lower=1))
    return pd.to_numeric(out, errors="coerce").fillna(1)


def rank_intervals(step: Any, rank: Any = None) -> Any:
    """`intervals` of one step and one rank column (numpy arrays or Series; rank None: one rank), as a
    numpy array. Rows grouped by rank (ranks non-decreasing, watch's per-rank files in rank order) with
    integer steps are done in numpy, without pandas' groupby copies (~10 arrays of the table's length,
    which at 10,000 ranks × 1,000 steps are 80 MB each), with the same result; else `intervals` itself."""
    import numpy as np
    import pandas as pd

    fast = _grouped_intervals(np.asarray(step), None if rank is None else np.asarray(rank))
    if fast is not None:
        return fast
    step = step if isinstance(step, pd.Series) else pd.Series(step)
    rank = rank if rank is None or isinstance(rank, pd.Series) else pd.Series(rank, index=step.index)
    return intervals(step, rank).to_numpy()


def _grouped_intervals(step: Any, rank: Any) -> Any:
    """`intervals` as int64 numpy for integer steps (|step| ≤ 2**52, so that a difference is what float64
    gives) and integer ranks (or None) that never decrease, so each rank's rows are one run; None
    otherwise. A row's interval is its step minus the previous row's in the same run; where there is none
    (a rank's first row, a restart: the step did not grow), the next interval of that rank, else 1, and
    no more than the step itself (at least 1)."""
    import numpy as np

    if step.dtype.kind != "i" or (rank is not None and (rank.dtype.kind != "i" or len(rank) != len(step))):
        return None
    n = len(step)
    if not n:
        return np.zeros(0, dtype=np.int64)
    if int(step.min()) < -(2**52) or int(step.max()) > 2**52:
        return None
    if rank is not None and not (rank[1:] >= rank[:-1]).all():
        return None
    out = np.empty(n, dtype=np.int64)
    out[0] = 0
    np.subtract(step[1:], step[:-1], out=out[1:])
    gap = out <= 0  # no spacing: the first row, a restart
    if rank is not None:
        gap[1:] |= rank[1:] != rank[:-1]  # a rank's first row
    where = np.flatnonzero(gap)
    del gap
    # the next row with a spacing: past the run of consecutive gaps each gap is in
    breaks = np.flatnonzero(np.diff(where) != 1)
    ends = np.append(where[breaks], where[-1])
    runs = np.zeros(len(where), dtype=np.int64)
    runs[breaks + 1] = 1
    after = ends[np.cumsum(runs)] + 1
    inside = after < n
    after[~inside] = 0
    same = inside if rank is None else inside & (rank[after] == rank[where])
    value = np.where(same, out[after], 1)
    at = step[where]
    out[where] = np.where(at >= value, value, np.maximum(at, 1))
    return out
