"""The grouped tokens/s and goodput (analysis/_throughput_columns.py) give the per-record rules' figures
(throughput.tokens_per_s, throughput.goodput) on fuzzed ranks: skipped steps, a second optimizer,
rollbacks that repeat a step, missing tokens, segments, zero and null step times, a NaN value."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from ciuic_doctor.analysis._throughput_columns import COLUMNS, per_rank
from ciuic_doctor.analysis.throughput import goodput, tokens_per_s
from ciuic_doctor.columnar_schema import schema_for


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
