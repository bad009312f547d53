"""Our steps stream read two ways must give one StepLog: the row reader (`ours.load`, pandas frames of
float columns) and the columnar one many-rank runs use (`ours_columnar.load`: numpy views of the cached
pyarrow table, int64 steps and ranks, intervals grouped in numpy). Both feed `ours.to_steplog`, whose
lean paths for integers (normalize) and for rows grouped by rank (`rank_intervals`) must give what the
general float / groupby paths give, restarts, repeats and unsorted rows included."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ciuic_doctor.importers import _grouped_intervals, intervals, normalize, rank_intervals

# ---- the lean paths against the general ones ------------------------------------------------------

EDGES = [0, 1, -1, 3, 2**15 - 1, 2**15, 2**31 - 1, 2**31, 2**52, 2**53, 2**53 + 1, 2**62 - 1, 2**62,
         -(2**53) - 1, -(2**62), 2**63 - 1, -(2**63)]  # fmt: skip


@pytest.mark.parametrize("seed", range(30))
def test_normalize_reads_integers_as_their_float_values(seed):
    """normalize's integer path (no float copy) gives the table the float path gives for the same values,
    out-of-range values (which take the float path) included."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    columns = {}
    for name in ("step", "rank", "skipped", "nonfinite", "interval_steps", "series"):
        if rng.random() < 0.2:
            continue
        small = rng.integers(-2, 50, n)
        wild = rng.choice(np.array(EDGES, dtype=np.int64), n)
        columns[name] = np.where(rng.random(n) < (0.15 if seed % 3 else 0.0), wild, small).astype(np.int64)
    columns.setdefault("step", np.arange(n, dtype=np.int64))
    floats = {k: v.astype(np.float64) for k, v in columns.items()}
    with np.errstate(invalid="ignore"):
        pd.testing.assert_frame_equal(normalize(columns), normalize(floats), check_exact=True)


def test_normalize_keeps_float_and_fitting_int_columns_without_a_copy():
    """At 10,000 ranks × 1,000 steps a column is 80 MB: a float64 column, and an int64 one that needs no
    clipping, is the table's column itself; the absent float columns share one read-only NaN array."""
    n = 1000
    step, rank, loss = np.arange(1, n + 1), np.arange(n) // 100, np.linspace(5.0, 2.0, n)
    table = normalize({"step": step, "rank": rank, "loss": loss, "interval_steps": np.ones(n, dtype=int)})
    assert np.shares_memory(table["step"].to_numpy(), step)
    assert np.shares_memory(table["rank"].array.to_numpy(), rank)
    assert np.shares_memory(table["loss"].to_numpy(), loss)
    missing = table["lr"].to_numpy()
    assert np.shares_memory(missing, table["t"].to_numpy())  # (not a placeholder column: no np.where)
    assert np.isnan(missing).all()
    assert not missing.flags.writeable
    shifted = normalize({"step": step, "rank": rank - 1})  # rank -1 is missing: a new array, step kept
    assert shifted["rank"].isna().sum() == 100
    assert not np.shares_memory(shifted["rank"].array.to_numpy(), rank)


def _intervals_case(rng: np.random.Generator, sorted_ranks: bool):
    n = int(rng.integers(1, 60))
    rank = np.sort(rng.integers(0, 4, n)) if sorted_ranks else rng.integers(0, 4, n)
    step = np.cumsum(rng.integers(1, 4, n)) + int(rng.integers(-5, 5))
    for at in rng.integers(0, n, int(rng.integers(0, 4))):  # restarts and repeats
        step[at:] -= int(rng.integers(0, 12))
    return step.astype(np.int64), rank.astype(np.int64)


@pytest.mark.parametrize("seed", range(300))
def test_grouped_intervals_are_pandas_intervals(seed):
    rng = np.random.default_rng(seed)
    step, rank = _intervals_case(rng, sorted_ranks=True)
    general = intervals(pd.Series(step), pd.Series(rank)).to_numpy()
    fast = _grouped_intervals(step, rank)
    assert fast is not None
    assert fast.dtype == np.int64
    np.testing.assert_array_equal(fast, general)
    np.testing.assert_array_equal(_grouped_intervals(step, None), intervals(pd.Series(step)).to_numpy())


@pytest.mark.parametrize("seed", range(60))
def test_rank_intervals_of_rows_not_grouped_take_the_general_path(seed):
    rng = np.random.default_rng(seed)
    step, rank = _intervals_case(rng, sorted_ranks=False)
    general = intervals(pd.Series(step), pd.Series(rank)).to_numpy()
    if not (rank[1:] >= rank[:-1]).all():
        assert _grouped_intervals(step, rank) is None
    np.testing.assert_array_equal(rank_intervals(step, rank), general)
    missing = np.where(rng.random(len(rank)) < 0.3, np.nan, rank)  # ranks with nulls: float, NaN
    assert _grouped_intervals(step, missing) is None
    want = intervals(pd.Series(step), pd.Series(missing)).to_numpy()
    np.testing.assert_array_equal(rank_intervals(step, missing), want)
    huge = step + 2**60  # beyond 2**52: float differences are not exact, the general path decides
    assert _grouped_intervals(huge, rank) is None
