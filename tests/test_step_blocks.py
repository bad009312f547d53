"""The steps analysis read in blocks gives what the per-record rules give, whatever the block size and the
row order: the ranks × steps grids (`steps.grid`: rows in any order, a (rank, step) recorded twice, rows
without a rank or step, missing and changing hosts, a host column dictionary-encoded or all null), the
judgement of every rank (`steps.crossrank`, `steps.pace`: blocks of ranks and steps), and rank_desync's
checksums from the table's columns (`steps.desync`) against the records."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ciuic_doctor.analysis import steps
from ciuic_doctor.analysis.steps import crossrank as _crossrank
from ciuic_doctor.analysis.steps import desync as _desync
from ciuic_doctor.analysis.steps import grid as _step_grid
from ciuic_doctor.analysis.steps import pace as _pace_stats
from ciuic_doctor.analysis.steps.grid import matrix_from_table
from ciuic_doctor.measures.ranks import differing_ranks
from ciuic_doctor.rundir.columnar_schema import schema_for

COLUMNS = ("rank", "step", "host", "step_time_s", "pre_backward_s", "weights_checksum", "desync_ranks")
CHECKSUMS = [5.0, 5.0, 5.0 + 1e-3, math.nan]


def _rows(seed: int) -> list[dict]:
    rnd = random.Random(seed)
    rows = []
    n_steps = rnd.choice([3, 6, 8, 40])
    for rank in range(rnd.randint(1, 9)):
        host = rnd.choice(["a", "b", "c", None])
        steps_run = list(range(1, n_steps + 1))
        if rnd.random() < 0.3:  # a restart: some steps recorded again, with other values
            steps_run += steps_run[-rnd.randint(1, 3) :]
        base = 0.3 * (1.5 if rnd.random() < 0.2 else 1.0)
        for i, step in enumerate(steps_run):
            if rnd.random() < 0.1:  # the rank moved (a restart on another node)
                host = rnd.choice(["a", "b", "c"])
            rows.append(
                {
                    "rank": rank if rnd.random() > 0.03 else None,
                    "step": step if rnd.random() > 0.03 else None,
                    "host": host if rnd.random() > 0.1 else None,
                    "step_time_s": rnd.choice([None, math.inf, math.nan])
                    if rnd.random() < 0.05
                    else base + i,
                    "pre_backward_s": None if rnd.random() < 0.05 else base * (1 + rnd.random() / 10),
                    "weights_checksum": rnd.choice([5.0, 5.0, 5.0 + 1e-3, math.nan])
                    if step % 3 == 0
                    else None,
                    "desync_ranks": [rank] if step % 3 == 0 and rnd.random() < 0.03 else None,
                }
            )
    if rnd.random() < 0.5:
        rnd.shuffle(rows)
    return rows


def _table(rows: list[dict], *, dictionary: bool = False) -> pa.Table:
    table = pa.Table.from_pylist(rows, schema=schema_for(COLUMNS))
    if dictionary:
        table = table.set_column(2, "host", table.column("host").dictionary_encode())
    return table


def _oracle(rows: list[dict]) -> dict:
    """The matrix rules one record at a time."""
    kept = [r for r in rows if isinstance(r["rank"], int) and isinstance(r["step"], int)]
    all_steps = sorted({r["step"] for r in kept})
    steady = [s for s in all_steps if s > steps.WARMUP_STEPS]
    used = steady if len(steady) >= steps.MIN_STEADY_STEPS else all_steps
    kept = [r for r in kept if r["step"] in set(used)]
    ranks = sorted({r["rank"] for r in kept})
    grids = {c: np.full((len(ranks), len(used)), np.nan) for c in _step_grid.TIMES}
    hosts: dict[int, str] = {}
    for r in kept:  # in record order: the later one wins
        for c, grid in grids.items():
            value = r[c]
            grid[ranks.index(r["rank"]), used.index(r["step"])] = (
                value if value is not None and math.isfinite(value) else np.nan
            )
        if r["host"] is not None:
            hosts[r["rank"]] = r["host"]
    pace = grids["pre_backward_s"]
    has_pace = bool(np.isfinite(pace).any(axis=1).all())
    return {
        "ranks": ranks,
        "steps": used,
        "hosts": [hosts.get(r) for r in ranks],
        "step_time_s": grids["step_time_s"],
        "pace_s": pace if has_pace else grids["step_time_s"],
    }


def _assert_matrix(matrix, want: dict) -> None:
    assert matrix.ranks.tolist() == want["ranks"]
    assert matrix.steps.tolist() == want["steps"]
    assert matrix.hosts == want["hosts"]
    assert np.array_equal(matrix.step_time_s, want["step_time_s"], equal_nan=True)
    assert np.array_equal(matrix.pace_s, want["pace_s"], equal_nan=True)


@pytest.mark.parametrize("block_rows", [1, 7, 1 << 18])
@pytest.mark.parametrize("seed", range(25))
def test_grid_in_blocks_equals_the_per_record_rules(seed, block_rows, monkeypatch):
    monkeypatch.setattr(_step_grid, "BLOCK_ROWS", block_rows)
    rows = _rows(seed)
    want = _oracle(rows)
    matrix = matrix_from_table(_table(rows, dictionary=seed % 2 == 1), warmup_steps=2, min_steady_steps=5)
    if not want["ranks"]:
        assert matrix is None
        return
    _assert_matrix(matrix, want)
    # records (the row reader's dicts) take the same path through a frame
    _assert_matrix(steps._matrix(rows), want)


def test_host_column_all_null_in_repeated_chunks_and_no_pace_column():
    rows = [{"rank": r, "step": s, "step_time_s": 0.1 * (r + 1)} for r in range(3) for s in range(1, 9)]
    table = pa.Table.from_pylist(rows, schema=schema_for(("rank", "step", "step_time_s")))
    nulls = pa.chunked_array([pa.nulls(8, pa.string())] * 3)  # one shared all-null chunk, repeated
    table = table.append_column("host", nulls)
    matrix = matrix_from_table(table, warmup_steps=2, min_steady_steps=5)
    assert matrix.hosts == [None, None, None]
    assert matrix.pace_metric == "step_time_s"
    assert matrix.pace_s is matrix.step_time_s
    assert matrix.steps.tolist() == [3, 4, 5, 6, 7, 8]


def _pace_findings(table: pa.Table) -> list[dict]:
    return [f.to_dict() for f in steps.check_pace(table.select(["rank", "step", "host", *_step_grid.TIMES]))]


def test_findings_same_for_shuffled_rows_and_small_blocks(monkeypatch):
    rnd = np.random.default_rng(5)
    pace = 0.3 * (1 + rnd.normal(0, 0.02, (40, 60)))
    pace[7, 30:] *= 1.3  # an onset
    pace[11] *= 1.2  # chronic
    pace[3, 17] *= 3  # one-off
    rows = [
        {"rank": r, "step": s + 1, "host": f"h{r // 8}", "step_time_s": 0.5, "pre_backward_s": pace[r, s]}
        for r in range(40)
        for s in range(60)
    ]
    ordered = _pace_findings(_table(rows))
    random.Random(1).shuffle(rows)
    assert _pace_findings(_table(rows)) == ordered
    for module, name, value in (
        (_step_grid, "BLOCK_ROWS", 13),
        (_crossrank, "RANK_BLOCK", 3),
        (_pace_stats, "RANK_BLOCK", 3),
        (_pace_stats, "STEP_BLOCK", 7),
    ):
        monkeypatch.setattr(module, name, value)
    assert _pace_findings(_table(rows)) == ordered
    kinds = {
        d["rank"]: d["kind"] for d in ordered[0]["evidence"]["chronic"] + ordered[1]["evidence"]["changed"]
    }
    assert kinds == {11: "chronic", 7: "onset"}


@pytest.mark.parametrize("seed", range(6))
def test_classify_in_blocks_equals_one_block(seed, monkeypatch):
    rnd = np.random.default_rng(seed)
    pace = 0.3 * (1 + rnd.normal(0, 0.03, (50, 120)))
    pace[rnd.random(pace.shape) < 0.02] = np.nan
    pace[5, 60:] *= 1.4
    pace[9:17] *= 1.25  # a slow host: the second pass's median leaves them out
    pace[20] = np.nan  # a rank without a value
    matrix = _crossrank.StepMatrix(
        ranks=np.arange(50),
        steps=np.arange(1, 121),
        hosts=[f"h{r // 8}" for r in range(50)],
        step_time_s=pace + 0.1,
        pace_s=pace,
        pace_metric="pre_backward_s",
    )
    whole = json.dumps([p.to_dict() for p in _crossrank.classify(matrix)])  # NaN level: a rank without pace
    for module, name, value in ((_crossrank, "RANK_BLOCK", 4), (_pace_stats, "RANK_BLOCK", 4)):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(_pace_stats, "STEP_BLOCK", 9)
    assert json.dumps([p.to_dict() for p in _crossrank.classify(matrix)]) == whole


@pytest.mark.parametrize("columns", [1, 2, 7, 599, 600, 601, 1000])
def test_row_medians_equal_nanmedian(columns):
    rnd = np.random.default_rng(columns)
    for share in (0.0, 0.01, 0.5, 1.0):
        values = np.round(rnd.normal(1, 0.1, (300, columns)), 2)  # ties
        values[rnd.random(values.shape) < share] = np.nan
        values[rnd.random(values.shape) < 0.01] = np.inf
        with _pace_stats.quiet_nan():
            want = np.nanmedian(values, axis=1)
        assert np.array_equal(_pace_stats.row_medians(values), want, equal_nan=True)


@pytest.mark.parametrize("seed", range(25))
def test_desync_from_the_table_equals_the_records(seed):
    rows = _rows(seed)
    if seed % 5 == 4:  # no checksum at all, a report only or not even that
        rows = [{**row, "weights_checksum": None} for row in rows if seed % 2 or not row["desync_ranks"]]
    if seed % 3 == 0:  # checksums that differ from a step on
        for row in rows:
            if row["weights_checksum"] is not None and row["rank"] == 1 and (row["step"] or 0) > 20:
                row["weights_checksum"] = 6.0
    want = json.dumps(steps.check_rank_desync(rows).to_dict())  # a NaN checksum: equal as text
    for table in (_table(rows), _table(rows, dictionary=True)):
        assert json.dumps(steps.rank_desync_finding(_desync.from_table(table)).to_dict()) == want


def test_desync_differing_equals_differing_ranks():
    rnd = random.Random(3)
    for _ in range(300):
        values = [rnd.choice([1.0, 1.0 + 1e-9, 1.5, 1e12, math.nan, math.inf, -math.inf]) for _ in range(6)]
        check = _desync.StepChecks(step=1, ranks=np.arange(6), checksums=np.array(values))
        assert check.differing() == set(differing_ranks(values, list(range(6))))


def test_records_frame_keeps_the_pandas_rules():
    """Ranks and steps written as floats or text in imported records: whole numbers kept, others out."""
    rows = [
        {"rank": 0, "step": 3, "host": "a", "step_time_s": 0.1},
        {"rank": 1.0, "step": "4", "host": pd.NA, "step_time_s": 0.2},
        {"rank": "x", "step": 5, "host": "b", "step_time_s": 0.3},
    ]
    matrix = _crossrank.step_matrix(pd.DataFrame(rows), warmup_steps=2, min_steady_steps=1)
    assert matrix.ranks.tolist() == [0, 1]
    assert matrix.steps.tolist() == [3, 4]
    assert matrix.hosts == ["a", None]
