"""`ours.load`'s fast path (a chunk read as a `:`-separated table) must give what json gives line by line,
also for a line whose key columns line up with the layout's at both ends while a middle one does not."""

from __future__ import annotations

import json
import math

import pytest

from ciuic_doctor.importers import ours

FIELDS = ("loss", "lr", "grad_norm", "loss_scale")


def _record(step: int) -> dict:
    return {
        "rank": 0,
        "step": step,
        "t": 100.0 + step,
        "loss": 2.0 - step / 1000,
        "lr": 1e-3 * (1 + step % 7),
        "grad_norm": 0.5 + step % 3,
        "loss_scale": 65536.0,
        "skipped": False,
    }


def _odd(step: int, kind: str) -> dict:
    record = _record(step)
    if kind == "middle key gone, another in its place":  # same field count, same first and last key
        del record["loss"]
        keys = list(record)
        keys.insert(keys.index("grad_norm") + 1, "extra")
        record = {k: record.get(k, 99.0) for k in keys}
    elif kind == "two middle keys swapped":
        keys = list(record)
        at = keys.index("loss")
        keys[at], keys[at + 1] = keys[at + 1], keys[at]
        record = {k: record[k] for k in keys}
    elif kind == "middle key gone":
        del record["lr"]
    elif kind == "extra key at the end":
        record["extra"] = 5.0
    return record


@pytest.mark.parametrize(
    "kind",
    [
        "middle key gone, another in its place",
        "two middle keys swapped",
        "middle key gone",
        "extra key at the end",
    ],
)
def test_a_line_off_the_layout_reads_as_json_reads_it(tmp_path, kind):
    odd_steps = {10, 333, 1999}
    records = [_odd(s, kind) if s in odd_steps else _record(s) for s in range(2000)]
    path = tmp_path / "steps.rank0.jsonl"
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    table = ours.load(path).table.set_index("step")
    assert len(table) == len(records)
    for record in records:
        row = table.loc[record["step"]]
        for field in FIELDS:
            want = record.get(field)
            got = row[field]
            assert (want is None and math.isnan(got)) or got == pytest.approx(want), (record, field, got)
