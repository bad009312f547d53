"""The grouped tokens/s and goodput (analysis/throughput/columns.py) give the per-record rules' figures
(throughput.tokens_per_s, throughput.goodput) on fuzzed ranks: skipped steps, a second optimizer,
rollbacks that repeat a step, missing tokens, segments, zero and null step times, a NaN value; and the
same figures, in the same order, read in blocks of ranks of any size, from rows rank by rank or
interleaved."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pytest

from ciuic_doctor.analysis.stats import rank_blocks as _rank_blocks
from ciuic_doctor.analysis.stats.grouped import grouped_median, in_order
from ciuic_doctor.analysis.throughput import goodput, tokens_per_s
from ciuic_doctor.analysis.throughput.columns import COLUMNS, per_rank
from ciuic_doctor.rundir.columnar_schema import schema_for


def _records(seed: int) -> list[dict]:
    rnd = random.Random(seed)
    rows = []
    for rank in range(rnd.randint(1, 12)):
        t = 100.0 + rnd.random()
        optimizers = rnd.choice([(None,), (0,), (0, 1), (1, 0)])
        steps = list(range(1, rnd.randint(1, 30)))
        if rnd.random() < 0.2 and len(steps) > 4:  # a rollback repeats steps
            steps += steps[-3:]
        for step in steps:
            step_s = rnd.choice([0.5, 0.5, 0.6, 2.5, 0.0, None, 0.45 + rnd.random() / 10])
            t += step_s or 0.3
            for optimizer in optimizers:
                rows.append(
                    {
                        "rank": rank if rnd.random() > 0.02 else None,
                        "step": step,
                        "t": t if rnd.random() > 0.03 else None,
                        "step_time_s": step_s,
                        "tokens": rnd.choice([4096, 4096, 0, None]) if rnd.random() > 0.1 else 2048,
                        "skipped": rnd.random() < 0.1,
                        "segment": rnd.choice([None, None, 0, 1, 2]),
                        "optimizer": optimizer,
                    }
                )
    if rnd.random() < 0.2 and rows:
        rnd.choice(rows)["step_time_s"] = float("nan")
    return rows


def _per_record(rows: list[dict], created) -> tuple[dict, dict]:
    by_rank: dict[int, list[dict]] = {}
    for row in rows:
        rank = row.get("rank")
        by_rank.setdefault(rank if isinstance(rank, int) else 0, []).append(dict(row))
    rates = {r: v for r, rs in by_rank.items() if (v := tokens_per_s(rs)) is not None}
    good = {r: g for r, rs in by_rank.items() if (g := goodput(rs, created)) is not None}
    return rates, good


@pytest.mark.parametrize("seed", range(60))
def test_grouped_figures_equal_the_per_record_rules(seed):
    rows = _records(seed)
    created = random.Random(seed).choice([None, 50.0, 1e9])
    table = pa.Table.from_pylist(rows, schema=schema_for(COLUMNS))
    rates, good = per_rank(table, created, tokens_per_s, goodput)
    want_rates, want_good = _per_record(rows, created)
    assert rates.keys() == want_rates.keys()
    assert good.keys() == want_good.keys()
    for rank, value in want_rates.items():
        assert rates[rank] == pytest.approx(value, rel=1e-12, nan_ok=True)
    for rank, figures in want_good.items():
        assert good[rank] == pytest.approx(figures, rel=1e-9, abs=1e-9, nan_ok=True)


# ---- blocks of whole ranks (analysis/stats/rank_blocks.py) and the sorts skipped
# (analysis/stats/grouped.py) --------
def _figures(rows: list[dict], created, block_rows: int, monkeypatch) -> str:
    """per_rank's dicts, order included (ties between ranks are broken in it), as text (NaN compares)."""
    monkeypatch.setattr(_rank_blocks, "BLOCK_ROWS", block_rows)
    table = pa.Table.from_pylist(rows, schema=schema_for(COLUMNS))
    rates, good = per_rank(table, created, tokens_per_s, goodput)
    return json.dumps([list(rates.items()), list(good.items())])


def _by_rank(rows: list[dict], sign: int = 1) -> list[dict]:
    """The rows rank by rank (a null rank is rank 0; the highest first with sign -1), in their order
    within a rank: as the reader concatenates the per-rank files."""
    return sorted(rows, key=lambda row: sign * (row["rank"] if isinstance(row["rank"], int) else 0))


def _interleaved(rows: list[dict]) -> list[dict]:
    """The rows round-robin over the ranks, the highest rank first, each rank's in their order."""
    seen: dict[int, int] = {}
    keyed = []
    for row in rows:
        rank = row["rank"] if isinstance(row["rank"], int) else 0
        seen[rank] = seen.get(rank, -1) + 1
        keyed.append((seen[rank], -rank, row))
    return [row for *_, row in sorted(keyed, key=lambda k: k[:2])]


@pytest.mark.parametrize("block_rows", [1, 5, 64])
@pytest.mark.parametrize("seed", range(40))
def test_blocks_of_ranks_give_the_one_block_figures(seed, block_rows, monkeypatch):
    rows = _records(seed)
    created = random.Random(seed).choice([None, 50.0, 1e9])
    # one run per rank (blocks are slices), then ranks interleaved (blocks are filtered out of the table)
    whole = _figures(rows, created, 1 << 30, monkeypatch)
    for layout in (_by_rank(rows), _by_rank(rows, -1), _interleaved(rows)):
        assert _figures(layout, created, block_rows, monkeypatch) == whole


def test_rank_blocks_hold_each_rank_once_in_table_order(monkeypatch):
    monkeypatch.setattr(_rank_blocks, "BLOCK_ROWS", 4)
    ranks = [3, 3, 3, 1, 1, None, 0, 2, 2, 2, 2, 2, 2, 5]
    grouped = pa.table({"rank": pa.array(ranks, pa.int64()), "i": pa.array(range(len(ranks)))})
    interleaved = grouped.take(pa.array([0, 3, 1, 5, 7, 2, 4, 6, 8, 9, 13, 10, 11, 12]))
    assert _rank_blocks.run_starts(grouped) == [0, 3, 5, 7, 13]  # null, then 0: one run of rank 0
    assert _rank_blocks.run_starts(interleaved) is None
    for table in (grouped, interleaved):
        seen: dict[int, list[int]] = {}
        for block in _rank_blocks.rank_blocks(table):
            key = _rank_blocks.rank_of(block).tolist()
            assert not set(key) & set(seen)  # a rank in one block only
            for rank, i in zip(key, block.column("i").to_pylist(), strict=True):
                seen.setdefault(rank, []).append(i)
        want: dict[int, list[int]] = {}
        for rank, i in zip(table.column("rank").to_pylist(), table.column("i").to_pylist(), strict=True):
            want.setdefault(rank or 0, []).append(i)
        assert seen == want


def test_all_null_columns_in_repeated_chunks_read_as_plain_nulls():
    rows = [r for r in _by_rank(_records(7)) if isinstance(r["rank"], int)]
    table = pa.Table.from_pylist(rows, schema=schema_for(COLUMNS))
    for name in ("tokens", "segment", "optimizer"):  # the reader may share one null chunk between columns
        chunks = pa.chunked_array([pa.nulls(1, table.schema.field(name).type)] * len(rows))
        table = table.set_column(table.schema.get_field_index(name), name, chunks)
    plain = pa.Table.from_pylist(
        [{**r, "tokens": None, "segment": None, "optimizer": None} for r in rows], schema=schema_for(COLUMNS)
    )
    assert per_rank(table, None, tokens_per_s, goodput) == per_rank(plain, None, tokens_per_s, goodput)


@pytest.mark.parametrize("seed", range(200))
def test_grouped_median_and_in_order_equal_the_lexsort(seed):
    rnd = np.random.default_rng(seed)
    count = int(rnd.integers(1, 20))
    sizes = rnd.integers(0, 9, count) if seed % 2 else np.full(count, rnd.integers(0, 9))
    group = np.repeat(np.arange(count), sizes)
    values = np.round(rnd.normal(size=len(group)), int(seed % 3))  # ties
    values[rnd.random(len(values)) < (0.2 if seed % 5 == 0 else 0)] = np.nan
    values[rnd.random(len(values)) < (0.2 if seed % 7 == 0 else 0)] = np.inf
    if seed % 4 == 0:
        group = rnd.permutation(group)
    order = np.lexsort((values, group))
    want = np.full(count, np.nan)
    for g in range(count):  # statistics.median of each group, NaN as the largest value (as lexsort puts it)
        v = values[order][group[order] == g]
        if len(v):
            want[g] = v[(len(v) - 1) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    assert np.array_equal(grouped_median(group, values, count), want, equal_nan=True)
    keys = [rnd.integers(0, 3, 12).astype(float) for _ in range(int(rnd.integers(1, 4)))]
    if seed % 2:
        keys = [np.sort(k) for k in keys]
    identity = np.array_equal(np.lexsort(keys), np.arange(12))
    assert in_order(*keys) == identity


def test_goodput_evidence_keeps_the_worst_ranks_not_every_rank():
    from ciuic_doctor.analysis.throughput import goodput_finding
    from ciuic_doctor.rundir.findings import EVIDENCE_RANKS

    figures = dict.fromkeys(("wall_s", "productive_s", "startup_s", "skipped_s", "over_typical_s"), 1.0)
    good = {
        rank: {**figures, "goodput": 0.9, "goodput_after_startup": 0.99 - rank / 1e6, "typical_step_s": 1.0,
               "steps": 100}
        for rank in range(5000)
    }  # fmt: skip
    finding = goodput_finding(good)
    kept = finding.evidence["ranks"]
    assert len(kept) == EVIDENCE_RANKS < len(good)
    assert list(kept)[:2] == ["4999", "4998"]  # worst first
    assert finding.evidence["ranks_judged"] == 5000
    assert len(json.dumps(finding.to_dict())) < 64 * 400


@pytest.mark.parametrize("seed", range(60))
def test_member_nanmedians_equal_nanmedian_group_by_group(seed, monkeypatch):
    """The hosts' median pace (steps.crossrank.host_paces): every group's np.nanmedian over its rows, for
    groups of mixed sizes, ties, NaN and inf, in blocks of any size."""
    import warnings

    from ciuic_doctor.analysis.stats import grouped

    rnd = np.random.default_rng(seed)
    monkeypatch.setattr(grouped, "BLOCK_VALUES", int(rnd.choice([1, 7, 1 << 20])))
    rows, columns = int(rnd.integers(2, 40)), int(rnd.integers(1, 30))
    matrix = np.round(rnd.normal(size=(rows, columns)), int(seed % 3))
    matrix[rnd.random(matrix.shape) < 0.3] = np.nan
    matrix[rnd.random(matrix.shape) < (0.1 if seed % 7 == 0 else 0)] = np.inf
    order, members = list(rnd.permutation(rows)), []
    while order:
        size = int(rnd.integers(1, 9))
        members.append([int(i) for i in order[:size]])
        order = order[size:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column: nanmedian warns, gives NaN
        want = np.vstack([np.nanmedian(matrix[rows_of], axis=0) for rows_of in members])
    assert np.array_equal(grouped.member_nanmedians(matrix, members), want, equal_nan=True)
