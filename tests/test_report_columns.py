"""The report reads the memwatch stream column-wise, a block of rows at a time (report/memwatch_view.py):
what it shows must be what the pandas code it replaced (a frame of every sample, grouped) gave, on
samples in any order, with roles missing or dictionary-encoded."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ciuic_doctor.frames import TableRead
from ciuic_doctor.report import memwatch_view
from ciuic_doctor.report.plots import memwatch_plot


def _plain(table: pa.Table) -> pd.DataFrame:
    """The table as the report made it pandas before (string columns as strings)."""
    columns = {
        c: table[c].cast(table[c].type.value_type) if pa.types.is_dictionary(table[c].type) else table[c]
        for c in table.column_names
    }
    return pa.table(columns).to_pandas(split_blocks=True)


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
    processes = [
        {"process": process, **{k: (None if pd.isna(v) else v) for k, v in row.items()}}
        for process, row in summary.iterrows()
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
        "ciuic_doctor.frames.read_stream", lambda run, stream, columns: TableRead(table=table)
    )
    got = memwatch_view.load(_Run())
    processes, records, key = _old_memwatch(_plain(table))
    assert got.key == key
    assert got.processes == processes
    # the same numpy types: the table prints what pandas gave ("884.0" samples)
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
