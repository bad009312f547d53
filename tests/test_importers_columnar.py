"""Our steps stream read two ways must give one StepLog: the row reader (`ours.load`, pandas frames of
float columns) and the columnar one many-rank runs use (`ours_columnar.load`: numpy views of the cached
pyarrow table, int64 steps and ranks, intervals grouped in numpy). Both feed `ours.to_steplog`, whose
lean paths for integers (normalize) and for rows grouped by rank (`rank_intervals`) must give what the
general float / groupby paths give, restarts, repeats and unsorted rows included."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ciuic_doctor.analysis.stability import analyze_log
from ciuic_doctor.importers import (
    intervals,
    normalize,
    ours,
    ours_columnar,
    rank_intervals,
)
from ciuic_doctor.importers._table import _grouped_intervals
from ciuic_doctor.rundir import frames
from ciuic_doctor.rundir.store import RunDir, dumps
from tests import scalesynth

FACTS = (
    "read_lines",
    "unread_lines",
    "framework",
    "precision",
    "clip_max_norm",
    "series_names",
    "adversarial",
)


def _records(rng: random.Random, rank: int | None, seed: int) -> list[dict]:
    """One rank's steps as watch writes them, with what a real run has now and then: restarts (the step
    goes back), a repeated step, a second optimizer, NaN/inf/null losses, null fields."""
    spacing = 1 + seed % 3
    steps = list(range(spacing, spacing * rng.randint(25, 45), spacing))
    if seed % 4 == 1 and rank in (0, 1):
        back = rng.randrange(5, len(steps) - 5)
        steps = steps[: back + 3] + steps[back:]  # a resumed run: three steps again
    if seed % 5 == 2 and rank == 0:
        steps.insert(7, steps[6])  # one step recorded twice
    optimizers = (0, 1) if seed % 6 == 3 else (None,)
    fp16 = seed % 2 == 0
    out = []
    for at, step in enumerate(steps):
        for optimizer in optimizers:
            record = {"schema": 1, "t": 1000.0 + at * 0.25 + (rank or 0) * 1e-3, "host": "h0"}
            if rank is not None:
                record["rank"] = rank
            loss = 6.0 - math.log(step + 1) + rng.gauss(0, 0.05) + (optimizer or 0)
            roll = rng.random()
            loss = float("nan") if roll < 0.03 else float("inf") if roll < 0.05 else loss
            record |= {"step": step, "loss": None if rng.random() < 0.04 else loss}
            record["lr"] = None if seed % 7 == 4 else 3e-4 * min(1.0, step / 20)
            record["grad_norm"] = rng.choice([0.0, None]) if rng.random() < 0.05 else rng.uniform(0.2, 3.0)
            record["skipped"] = fp16 and rng.random() < 0.06
            if fp16:
                record["loss_scale"] = 2.0 ** rng.randint(10, 16)
                if seed % 4 == 0:
                    update = record["loss_scale"] * rng.choice([0.5, 1.0, 2.0])
                    record["loss_scale_next"] = update if rng.random() < 0.8 else None
            if seed % 3 == 1:
                record["clip_max_norm"] = None if rng.random() < 0.3 else 1.0
            if optimizer is not None:
                record["optimizer"] = optimizer
            for key in ("lr", "grad_norm", "skipped"):
                if rng.random() < 0.03:
                    record[key] = None  # not measured (watch writes every key, in one order)
            out.append(record)
    return out


def _run(folder, seed: int) -> RunDir:
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    if seed % 2:  # a shared file first, without a rank (a single-process preface)
        lines = _records(rng, None, seed)
        (folder / "steps.jsonl").write_text("".join(dumps(r) + "\n" for r in lines))
    for rank in range(rng.randint(2, 5)):
        lines = _records(rng, rank, seed)
        (folder / f"steps.rank{rank}.jsonl").write_text("".join(dumps(r) + "\n" for r in lines))
    (folder / "meta.json").write_text(json.dumps({"schema": 1}))
    frames.clear_cache()
    return RunDir.open(folder)


@pytest.mark.parametrize("seed", range(36))
def test_columnar_and_row_readers_give_one_steplog(tmp_path, seed):
    run = _run(tmp_path / "run", seed)
    rows, columnar = ours.load(run.path), ours_columnar.load(run.path)
    assert rows.rows > 50
    pd.testing.assert_frame_equal(columnar.table, rows.table, check_exact=True)
    assert {f: getattr(columnar, f) for f in FACTS} == {f: getattr(rows, f) for f in FACTS}
    assert [f.to_dict() for f in analyze_log(columnar)] == [f.to_dict() for f in analyze_log(rows)]
    if seed % 6 == 3:  # two optimizers: a series each
        assert columnar.series_names == ["optimizer 0", "optimizer 1"]
        assert sorted(columnar.table["series"].unique()) == [0, 1]


def test_the_fuzzed_runs_hold_what_the_lean_paths_must_match():
    """The runs above exercise each case (else the comparison proves little): restarts, repeats, two
    optimizers, a scale update, NaN and null losses, rows without a rank, and the grouped intervals."""
    seen = {"restart": 0, "optimizers": 0, "next_scale": 0, "no_rank": 0, "nonfinite": 0, "grouped": 0}
    for seed in range(36):
        rng = random.Random(seed)
        records = [r for rank in (None, 0, 1) for r in _records(rng, rank, seed)]
        steps = [r["step"] for r in records if r.get("rank") == 0]
        seen["restart"] += any(b <= a for a, b in itertools.pairwise(steps))
        seen["optimizers"] += any(r.get("optimizer") == 1 for r in records)
        seen["next_scale"] += any(r.get("loss_scale_next") for r in records)
        seen["no_rank"] += seed % 2
        seen["nonfinite"] += any(
            isinstance(r["loss"], float) and not math.isfinite(r["loss"]) for r in records
        )
        seen["grouped"] += 1 - seed % 2  # every rank has its rank: int64 columns, `_grouped_intervals`
    assert all(seen.values()), seen


def test_columnar_steplog_takes_the_tables_columns_without_a_copy(tmp_path):
    """At 10,000 ranks × 1,000 steps a column is 80 MB: the StepLog's step, rank and float columns are
    the cached table's own buffers (read-only views), not copies."""
    run = RunDir.open(scalesynth.generate(tmp_path / "run", scalesynth.Plan(ranks=4, steps=30, gpu=True)))
    frames.clear_cache()
    table = frames.read_stream(run, "steps", ours_columnar.WANTED).table
    shared = ("step", "rank", "t", "loss", "lr", "grad_norm")
    for name in shared:
        assert table[name].null_count == 0, name
    log = ours_columnar.load(run.path)
    for name in shared:
        assert np.shares_memory(log.table[name].array.to_numpy(), table[name].to_numpy()), name
    assert log.rows == 4 * 30
    assert analyze_log(log)  # the checks read it as they read a table of their own


@pytest.mark.parametrize("seed", range(6))
def test_columnar_steplog_of_a_table_in_chunks_and_of_shared_null_chunks(tmp_path, seed):
    """The cached table may hold a column in several chunks, and a column of nulls only as one shared
    null chunk (frames' plans): the same StepLog as of the contiguous table."""
    run = _run(tmp_path / "run", seed)
    table = frames.read_stream(run, "steps", ours_columnar.WANTED).table
    want = ours_columnar.load(run.path).table
    chunked = pa.Table.from_batches(table.to_batches(max_chunksize=17))
    shared = {}
    columns = {}
    for name in chunked.column_names:
        column = chunked.column(name)
        if column.null_count == len(column):
            kind = shared.setdefault(column.type, pa.nulls(len(column), column.type))
            column = pa.chunked_array([kind])
        columns[name] = column
    variant = pa.table(columns)
    assert variant.column("step").num_chunks > 1
    assert any(c.null_count == len(c) for c in variant.columns)  # the seed has a column of nulls
    log = ours.to_steplog(ours_columnar._Columns(variant), read_lines=0, unread_lines=0, meta_dir=run.path,
                          name=run.path.name)  # fmt: skip
    pd.testing.assert_frame_equal(log.table, want, check_exact=True)


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


SOME_OPTIMIZERS = [[np.nan] * 3, [1.0] * 4, [0.0, -0.0, 0.0], [np.nan, 2.0, np.nan], [2.0, 2.5], [0.0, 1.0]]


@pytest.mark.parametrize("seed", range(40 + len(SOME_OPTIMIZERS)))
def test_optimizer_series_are_what_the_pandas_map_gave(seed):
    """The series of each optimizer, numpy on the column (a view), against the pandas map it replaced:
    an index found that no value equals (0.5 -> 0) and a missing optimizer are series 0."""
    rng = np.random.default_rng(seed)
    optimizer = rng.choice(np.array([0.0, 1.0, 2.0, np.nan, 0.5, 3.0, -0.0, 7.0]), int(rng.integers(1, 30)))
    if seed >= 40:  # one index or none (no hashing), or two that are one int (2.5 -> 2)
        optimizer = np.array(SOME_OPTIMIZERS[seed - 40])
    series, names = ours._optimizer_series({"optimizer": optimizer})
    values = pd.Series(optimizer)
    found = sorted(int(i) for i in values.dropna().unique())
    if len(found) < 2:
        assert series is None
        assert names == []
    else:
        want = values.map({i: n for n, i in enumerate(found)}).fillna(0)
        np.testing.assert_array_equal(series, want.to_numpy())
        assert names == [f"optimizer {i}" for i in found]
    assert ours._optimizer_series({"optimizer": optimizer, "series": np.zeros(len(optimizer))}) == (None, [])
