"""The report reads the steps and memwatch streams column-wise, a block of rows at a time
(report/step_table.py, report/memwatch_view.py): what it shows must be what the pandas code it replaced
(a frame of every row, sorted and grouped) gave, on rows in order (the fast path: slices of the table)
and on rows that are not (shuffled, a restarted rank, null keys: the general path), with columns
missing, one rank, and string columns dictionary-encoded."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ciuic_doctor.report import memwatch_view, step_table
from ciuic_doctor.report.plots import memwatch_plot
from ciuic_doctor.report.rank_view import COLUMNS, MEMORY_COLUMNS
from ciuic_doctor.report.step_table import StepTable, summarise
from ciuic_doctor.rundir.frames import TableRead, schema_for

STEP_COLUMNS = (*COLUMNS, *MEMORY_COLUMNS)
VARIANTS = ("in order", "shuffled", "restarted", "null keys", "one rank", "missing columns", "dictionary")


def rank_step_grid(frame: pd.DataFrame, column: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The report's grid before step_table (a pandas frame of every row), kept here as the reference:
    (ranks, steps, ranks × steps values of `column`) from rows with a whole-number rank and step; NaN
    where a rank has no finite value; of duplicates (a restarted rank), the later record."""
    rank = pd.to_numeric(frame["rank"], errors="coerce") if "rank" in frame else pd.Series(dtype=float)
    step = pd.to_numeric(frame["step"], errors="coerce") if "step" in frame else pd.Series(dtype=float)
    keep = (rank.notna() & step.notna()).to_numpy()
    frame = frame[keep].assign(rank=rank[keep].astype("int64"), step=step[keep].astype("int64"))
    ranks, steps = np.unique(frame["rank"].to_numpy()), np.unique(frame["step"].to_numpy())
    grid = np.full((len(ranks), len(steps)), np.nan)
    if column in frame:
        rows = np.searchsorted(ranks, frame["rank"].to_numpy())
        cols = np.searchsorted(steps, frame["step"].to_numpy())
        grid[rows, cols] = frame[column].to_numpy(dtype=float, na_value=np.nan)
        grid[~np.isfinite(grid)] = np.nan
    return ranks, steps, grid


def _steps(variant: str, ranks: int = 12, steps: int = 30) -> pa.Table:
    """A steps table as frames.read_stream gives it: per-rank files in rank order, each in step order."""
    rng = np.random.default_rng(5)
    ranks = 1 if variant == "one rank" else ranks
    rank = np.repeat(np.arange(ranks), steps)
    step = np.tile(np.arange(1, steps + 1), ranks)
    if variant == "restarted":  # rank 3 ran steps 10..20 again after step 30
        again = (rank == 3) & (step >= 10) & (step <= 20)
        rank, step = np.insert(rank, 4 * steps, rank[again]), np.insert(step, 4 * steps, step[again])
    n = len(rank)

    def floats(scale: float) -> pa.Array:
        values = rng.uniform(0.5, 1.5, n) * scale
        values[rng.random(n) < 0.05] = np.nan  # a "nan" the store wrote
        values[rng.random(n) < 0.01] = np.inf
        return pa.array(values, mask=rng.random(n) < 0.05)  # and nulls

    columns = {
        "rank": pa.array(rank),
        "step": pa.array(step),
        "host": pa.array([f"node-{r // 4}" for r in rank], mask=rng.random(n) < 0.1),
        "step_time_s": floats(0.8),
        "pre_backward_s": floats(0.3),
        "loss": floats(3.0),
        "skipped": pa.array(rng.random(n) < 0.1, mask=rng.random(n) < 0.1),
        "rss": floats(9e9),
        "uss": floats(7e9),
        "mem_allocated": floats(6e10),
    }
    if variant == "null keys":
        columns["rank"] = pa.array(rank, mask=rng.random(n) < 0.05)
        columns["step"] = pa.array(step, mask=rng.random(n) < 0.05)
    if variant == "missing columns":  # frames' all-null columns: repeats of one shared null chunk
        for name in ("host", "loss", "rss", "pre_backward_s"):
            kind = columns[name].type
            columns[name] = pa.chunked_array([pa.nulls(30, kind)] * (n // 30) + [pa.nulls(n % 30, kind)])
    if variant == "dictionary":
        columns["host"] = columns["host"].dictionary_encode()
    table = pa.table(columns)
    if variant == "shuffled":
        table = table.take(rng.permutation(n))
    return table


def _plain(table: pa.Table) -> pd.DataFrame:
    """The table as the report made it pandas before (string columns as strings)."""
    columns = {
        c: table[c].cast(table[c].type.value_type) if pa.types.is_dictionary(table[c].type) else table[c]
        for c in table.column_names
    }
    return pa.table(columns).to_pandas(split_blocks=True)


def _old_per_rank(frame: pd.DataFrame) -> pd.DataFrame:
    """What rank_view.per_rank computed: a stable sort of every row by (rank, step), then the groupby."""
    frame = frame[frame["rank"].notna() & frame["step"].notna()].sort_values(["rank", "step"], kind="stable")
    return summarise(frame)


@pytest.mark.parametrize("variant", VARIANTS)
def test_per_rank_table_is_the_sort_of_every_row(variant, monkeypatch):
    monkeypatch.setattr(step_table, "BLOCK_ROWS", 50)  # blocks of 1-2 ranks, one cut inside a rank
    table = _steps(variant)
    columns = StepTable(table)
    # the fast path is taken exactly when the rows are in order
    assert (columns._order is None) == (variant not in ("shuffled", "restarted", "null keys"))
    got, want = columns.per_rank(), _old_per_rank(_plain(table))
    pd.testing.assert_frame_equal(got, want)
    assert got.to_csv(index=False) == want.to_csv(index=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_grids_are_rank_step_grid(variant, monkeypatch):
    monkeypatch.setattr(step_table, "BLOCK_ROWS", 50)
    table = _steps(variant)
    frame = _plain(table)
    columns = StepTable(table)
    for column in ("step_time_s", "pre_backward_s", "rss", "mem_allocated"):
        got, want = columns.grid(column), rank_step_grid(frame, column)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    assert columns.ranks == sorted(int(r) for r in frame["rank"].dropna().unique())
    assert columns.hosts == sorted(str(h) for h in frame["host"].dropna().unique())
    for column in ("mem_allocated", "uss", "rss"):
        assert columns.positive(column) == int((frame[column] > 0).sum())


def test_plain_records_are_typed_as_the_columnar_reader_types_a_file():
    records = [
        {"rank": 1, "step": 2, "host": "a", "step_time_s": 1, "loss": "nan", "skipped": True},
        {"rank": 0, "step": 1.0, "host": 7, "step_time_s": "x", "rss": 5.5, "skipped": None},
        {"rank": True, "step": 3},
    ]
    table = StepTable.from_records(records, STEP_COLUMNS).table
    assert table.schema == schema_for(STEP_COLUMNS)
    assert table["rank"].to_pylist() == [1, 0, None]  # a bool is not a rank
    assert table["step"].to_pylist() == [2, 1, 3]
    assert table["host"].to_pylist() == ["a", None, None]
    assert table["step_time_s"].to_pylist() == [1.0, None, None]
    assert math.isnan(table["loss"][0].as_py())


# ---- memwatch ------------------------------------------------------------------------------------
def _samples(roles: str = "plain") -> pa.Table:
    """Samples of 20 ranks and of 60 hosts' agents (one role, 1,500 samples: more than twice the
    plot's 600 points), time-ordered, some of rank 0's without a role (named by its PID) or a PID, NaN
    and null memory figures; with `roles="dictionary"`, roles dictionary-encoded with unused entries."""
    rng = np.random.default_rng(9)
    rows = []
    for second in range(25):
        for host in range(60):
            rows.append((second + host * 1e-3, 100 + host, "agent"))
        for rank in range(20):
            rows.append((second + rank * 1e-3, 1000 + rank, f"rank {rank}"))
    rows.append((float("inf"), 5, "rank 0"))
    t, pid, role = (list(c) for c in zip(*rows, strict=True))
    n = len(t)
    no_role = (np.array(pid) == 1000) & (rng.random(n) < 0.5)  # some of rank 0's samples
    role = [None if gone else r for r, gone in zip(role, no_role, strict=True)]
    rss = rng.uniform(1e9, 9e9, n)
    rss[rng.random(n) < 0.05] = np.nan
    uss = rng.uniform(1e9, 8e9, n)
    table = pa.table(
        {
            "t": pa.array(t),
            "pid": pa.array(pid, mask=no_role & (rng.random(n) < 0.3)),
            "role": pa.array(role, pa.string()),
            "rss": pa.array(rss, mask=rng.random(n) < 0.05),
            "uss": pa.array(uss, mask=rng.random(n) < 0.1),
        }
    )
    if roles == "dictionary":
        names = pa.array(["unused", *sorted({r for r in role if r}), "never sampled"])
        index = {name: i for i, name in enumerate(names.to_pylist())}
        indices = pa.array([index.get(r) for r in role], pa.int32())
        table = table.set_column(2, "role", pa.DictionaryArray.from_arrays(indices, names))
    return table


def _old_memwatch(frame: pd.DataFrame) -> tuple[list[dict], list[dict], str]:
    """What memwatch_view.load computed with pandas: per-process rows, the plot's samples, the key."""
    name = frame["role"].astype(object)
    unnamed = name.isna()
    if unnamed.any():
        name[unnamed] = [("?" if math.isnan(p) else str(int(p))) for p in frame["pid"][unnamed]]
    frame["process"] = name.astype(str)
    key = "uss" if (frame["uss"].fillna(0) > 0).any() else "rss"
    grouped = frame.groupby("process", sort=True)
    rss = frame.dropna(subset=["rss"]).groupby("process", sort=True)["rss"]
    uss = frame.dropna(subset=["uss"]).groupby("process", sort=True)["uss"]
    summary = pd.DataFrame(
        {
            "samples": grouped.size(),
            "first_rss": rss.first(),
            "last_rss": rss.last(),
            "peak_rss": rss.max(),
            "last_uss": uss.last(),
        }
    )
    # a count is an int, as the row summary (sections._processes) has it; iterrows made it a float
    processes = [
        {"process": process, **{k: (None if pd.isna(v) else v) for k, v in row.items()}, "samples": int(n)}
        for (process, row), n in zip(summary.iterrows(), summary["samples"], strict=True)
    ]
    drawn = sorted(frame["process"].unique())[: memwatch_view.PLOT_PROCESSES]
    plot = frame[frame["process"].isin(drawn) & frame["t"].notna()]
    records = [
        {"t": float(t), "role": p, key: (None if math.isnan(v) else float(v))}
        for t, p, v in zip(plot["t"], plot["process"], plot[key], strict=True)
    ]
    return processes, records, key


class _Run:
    def has_stream(self, stream: str) -> bool:
        return True


@pytest.mark.parametrize("roles", ["plain", "dictionary", "shuffled"])
def test_memwatch_view_is_the_pandas_summary_and_draws_the_same_plot(roles, monkeypatch):
    table = _samples("dictionary" if roles == "dictionary" else "plain")
    if roles == "shuffled":
        table = table.take(np.random.default_rng(1).permutation(table.num_rows))
    monkeypatch.setattr(memwatch_view, "BLOCK_ROWS", 333)  # blocks that cut processes anywhere
    monkeypatch.setattr(
        "ciuic_doctor.rundir.frames.read_stream", lambda run, stream, columns, **_: TableRead(table=table)
    )
    got = memwatch_view.load(_Run())
    processes, records, key = _old_memwatch(_plain(table))
    assert got.key == key
    assert got.processes == processes
    # the same types: sizes as floats, the sample count as an int (the table printed "884.0" samples)
    assert [type(v) for p in got.processes for v in p.values()] == [
        type(v) for p in processes for v in p.values()
    ]
    agents = [r for r in records if r["role"] == "agent" and r[key] is not None]
    assert 1200 <= len(agents) < 1500
    drawn = [r for r in got if r["role"] == "agent" and r[key] is not None]
    assert len(drawn) == len(agents[::2])  # thinned as the plot thins
    assert memwatch_plot(got, key=got.key) == memwatch_plot(records, key=key)


def test_memwatch_view_of_one_process():
    table = pa.table(
        {"t": [2.0, 1.0], "pid": [7, 7], "role": [None, None], "rss": [3e9, 2e9], "uss": [None, None]}
    )
    processes, records, key = _old_memwatch(_plain(table))
    names, codes = memwatch_view._process_codes(table)
    assert names == ["7"]
    assert codes.tolist() == [0, 0]
    assert memwatch_view._summaries(table, names, codes) == processes
    assert memwatch_plot(memwatch_view._plot_samples(table, names, codes, key), key=key) == memwatch_plot(
        records, key=key
    )


def test_a_rank_without_a_host_leaves_it_out_of_the_heat_map():
    from ciuic_doctor.report.blocks import Section
    from ciuic_doctor.report.steps_section import job_content

    records = [
        {"rank": r, "step": s, "step_time_s": 0.5 + 0.01 * r, "pre_backward_s": 0.2, "rss": 1e9}
        | ({} if r == 5 else {"host": f"node-{r // 8}"})
        for r in range(16)
        for s in range(1, 6)
    ]
    section = Section(id="job", title="job", command="job", probes=("steps",), streams=("steps",))
    job_content(section, records)
    assert any("host × rank heat-map" in svg for svg in section.plots)
