"""Shared pieces of the record fuzz (tests/test_fuzz_records.py, benchmarks/fuzz_soak.py).

The base run is the recorded 8-rank GPU sample (tests/data/report_gpu) plus memwatch events, trimmed so
one analysis takes tens of milliseconds. A mutation is (file, record index, field, value or DELETE).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from ciuic_doctor.rundir.schemas import SCHEMAS, stream_of, validate
from ciuic_doctor.rundir.store import RunDir, dumps

DATA = Path(__file__).parent / "data"
KEEP_PER_FILE = 12  # records kept per stream file: enough for every analysis to judge, fast to re-run
DELETE = object()
HOSTILE = [None, True, False, 0, -1, 2**70, -(2**70), 1e308, float("nan"), "nan", "inf", "", "x",
           "<script>", [], [None], {}, {"a": [1]}, 3.5]  # fmt: skip


def _base_records() -> dict[str, list[dict]]:
    files = {path.name: path for path in (DATA / "report_gpu").glob("*.jsonl")}
    files["memwatch_events.jsonl"] = DATA / "memory_cpu" / "memwatch_events.jsonl"
    out = {}
    for name, path in sorted(files.items()):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[name] = lines[:KEEP_PER_FILE]
    return out


BASE = _base_records()
BASE_META = json.loads((DATA / "report_gpu" / "meta.json").read_text())
FILES = sorted(BASE)


def stream_name(file_name: str) -> str:
    return stream_of(file_name)


def fields_of(name: str, index: int) -> list[str]:
    return sorted(set(BASE[name][index]) | set(SCHEMAS.get(stream_name(name), {})))


def random_mutations(rng: random.Random) -> list[tuple]:
    out = []
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(FILES)
        index = rng.randrange(len(BASE[name]))
        out.append((name, index, rng.choice(fields_of(name, index)), rng.choice([DELETE, *HOSTILE])))
    return out


def write_run(folder: Path, changes, meta=None) -> dict[str, int]:
    """The base run with `changes` applied; returns stream -> how many written records break the schema."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    records = {name: [dict(r) for r in rows] for name, rows in BASE.items()}
    for name, index, field, value in changes:
        if value is DELETE:
            records[name][index].pop(field, None)
        else:
            records[name][index][field] = value
    invalid: dict[str, int] = {}
    for name, rows in records.items():
        lines = [dumps(row) for row in rows]
        stream = stream_name(name)
        bad = sum(validate(stream, json.loads(line)) is not None for line in lines)
        if bad:
            invalid[stream] = invalid.get(stream, 0) + bad
        (folder / name).write_text("".join(line + "\n" for line in lines))
    (folder / "meta.json").write_text(json.dumps(BASE_META if meta is None else meta))
    return invalid


def assert_counted(run: RunDir, invalid: dict[str, int], findings) -> None:
    """Every off-schema record is counted by the reader, and the findings name its stream."""
    for stream, count in invalid.items():
        assert run.read(stream).invalid_records == count, stream
    crashed = [f.summary for f in findings if f.check == "analysis_error"]
    assert crashed == []
    if invalid:
        quality = [f for f in findings if f.probe == "store" and f.check == "records_readable"]
        assert len(quality) == 1
        for stream in invalid:
            assert f"{stream}:" in quality[0].summary
