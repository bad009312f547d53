"""stability's fold on a many-rank table without pandas' whole-column temporaries: the rows-in-order test
by comparisons only, the ranks counted from the sorted ranks, the per-step groups by the steps' index
(a Categorical) — each against the pandas expression it replaces, on random tables."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ciuic_doctor.analysis.stability import curve
from ciuic_doctor.importers import normalize


def _table(rng: np.random.Generator, *, in_order: bool, low: int = 0, high: int = 60):
    n = int(rng.integers(1, 80))
    rank = rng.integers(0, 5, n).astype(float)
    rank[rng.random(n) < 0.1] = np.nan  # a row without a rank
    step = rng.integers(low, high, n)
    if in_order:
        keys = sorted({(-1 if np.isnan(r) else int(r), int(s)) for r, s in zip(rank, step, strict=True)})
        rank = np.array([np.nan if r == -1 else r for r, _ in keys])
        step = np.array([s for _, s in keys], dtype=np.int64)
        n = len(step)
    loss = rng.normal(3.0, 1.0, n)
    loss[rng.random(n) < 0.1] = np.nan
    return normalize(
        {
            "rank": rank, "step": step, "loss": loss, "lr": rng.random(n), "grad_norm": rng.random(n) * 4,
            "loss_scale": rng.choice([np.nan, 1024.0, 2048.0], n), "skipped": rng.random(n) < 0.1,
            "nonfinite": rng.random(n) < 0.05, "interval_steps": rng.integers(1, 4, n),
        }
    )  # fmt: skip


def _reference_in_order(table) -> bool:
    rank = table["rank"].to_numpy(dtype=np.int64, na_value=-1)
    step = table["step"].to_numpy(dtype=np.int64)
    same = rank[1:] == rank[:-1]
    return bool((rank[1:] >= rank[:-1]).all() and (step[1:][same] > step[:-1][same]).all())


@pytest.mark.parametrize("seed", range(120))
def test_fold_parts_are_the_pandas_expressions_they_replace(seed):
    rng = np.random.default_rng(seed)
    low, high = [(0, 60), (1, 5), (-3, 40), (0, 2**40), (10**6, 10**6 + 50)][seed % 5]
    table = _table(rng, in_order=seed % 2 == 0, low=low, high=high)
    in_order = curve._unique_in_order(table)
    assert in_order == _reference_in_order(table)
    if seed % 2 == 0:
        assert in_order
    assert curve._ranks(table, in_order) == table["rank"].nunique()
    want = table.groupby("step", sort=True).agg(**curve.PER_STEP).reset_index()
    pd.testing.assert_frame_equal(curve._per_step(table), want, check_exact=True)


def test_per_step_groups_many_steps_by_their_index():
    """Steps from 0 to about the rows' count take the Categorical path, int32 codes past 32,767 steps."""
    rng = np.random.default_rng(0)
    n = 80_000
    step = np.concatenate([np.arange(40_000), np.arange(40_000)])
    table = normalize({"rank": np.repeat([0, 1], 40_000), "step": step, "loss": rng.normal(2.0, 0.5, n)})
    grouped = table.groupby("step", sort=True)
    pd.testing.assert_frame_equal(
        curve._per_step(table), grouped.agg(**curve.PER_STEP).reset_index(), check_exact=True
    )
    folded = curve.fold(table)
    assert folded.ranks == 2
    np.testing.assert_array_equal(folded.step, np.arange(40_000))
