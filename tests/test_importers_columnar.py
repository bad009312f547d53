"""Our steps stream read two ways must give one StepLog: the row reader (`ours.load`, pandas frames of
float columns) and the columnar one many-rank runs use (`ours_columnar.load`: numpy views of the cached
pyarrow table, int64 steps and ranks, intervals grouped in numpy). Both feed `ours.to_steplog`, whose
lean paths for integers (normalize) and for rows grouped by rank (`rank_intervals`) must give what the
general float / groupby paths give, restarts, repeats and unsorted rows included."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ciuic_doctor.importers import normalize

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
