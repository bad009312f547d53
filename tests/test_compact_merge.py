"""compact (JSONL -> Parquet, lossless) and merge (per-node run directories -> one run), round trip on the
recorded GPU run (tests/data/report_gpu) with a NaN loss, an inf loss and a torn last line planted; and
the columnar reader's handling of bad content (dropped lines and nulled values are counted)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ciuic_doctor.analysis import run_all
from ciuic_doctor.rundir import frames
from ciuic_doctor.rundir.parquet_store import fresh_parquet, parquet_records
from ciuic_doctor.rundir.store import RunDir, read_jsonl
from tests.conftest import run_cli

DATA = Path(__file__).parent / "data" / "report_gpu"


@pytest.fixture
def run(tmp_path):
    path = tmp_path / "run"
    shutil.copytree(DATA, path, ignore=shutil.ignore_patterns("make.py", "findings.json"))
    file = path / "steps.rank2.jsonl"
    rows = [json.loads(line) for line in file.read_text().splitlines()]
    rows[10]["loss"], rows[11]["loss"], rows[12]["skipped"] = "nan", "inf", None
    rows[13]["note"] = {"nested": [1, 2.5, None]}  # a field only one record has, of a JSON type of its own
    file.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"rank":2,"st')
    frames.clear_cache()
    return path


def test_compact_is_lossless_and_readers_prefer_the_fresh_copy(run):
    done = run_cli("compact", str(run), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "1 torn line(s) skipped" in done.stdout
    jsonl = sorted(run.glob("*.jsonl"))
    assert len(jsonl) == 12
    for path in jsonl:
        parquet = fresh_parquet(path)
        assert parquet is not None, path
        assert json.dumps(parquet_records(parquet)) == json.dumps(read_jsonl(path).records), path
    columns = frames.STREAM_COLUMNS["steps"]
    from_parquet = frames.read_table(RunDir(run).stream_files("steps"), columns)
    assert from_parquet.parquet_files == 8
    assert from_parquet.dropped_lines == 1  # the torn line still counts
    # a second run is a no-op
    again = run_cli("compact", str(run), timeout=120)
    assert "compacted 0 file(s) (12 already up to date)" in again.stdout


def test_a_stream_that_grew_after_compaction_is_read_from_its_jsonl(run):
    assert run_cli("compact", str(run), "--stream", "steps", timeout=120).returncode == 0
    file = run / "steps.rank0.jsonl"
    before = frames.read_table([file], ("rank", "step")).rows
    with open(file, "a") as fh:
        fh.write(json.dumps({"rank": 0, "step": 81, "step_time_s": 0.9}) + "\n")
    assert fresh_parquet(file) is None
    read = frames.read_table([file], ("rank", "step"))
    assert (read.rows, read.parquet_files) == (before + 1, 0)


def test_compact_refuses_what_is_not_a_run(tmp_path):
    done = run_cli("compact", str(tmp_path / "nope"), timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "no such run directory" in done.stderr


def test_merge_of_per_node_directories_gives_the_same_findings(run, tmp_path):
    nodes = []
    for name, ranks in (("node-a", range(4)), ("node-b", range(4, 8))):
        node = tmp_path / name
        node.mkdir()
        for rank in ranks:
            shutil.copy(run / f"steps.rank{rank}.jsonl", node)
        shutil.copy(run / "meta.json", node)
        nodes.append(node)
    # memwatch sampled on node-a and died mid-line; comm only on node-b
    memwatch = (run / "memwatch.jsonl").read_text()
    (nodes[0] / "memwatch.jsonl").write_text(memwatch + '{"pid": 4001, "rss": 12')
    shutil.copy(run / "comm.jsonl", nodes[1])
    shutil.copy(run / "steps.rank3.jsonl", nodes[1])  # the same file copied twice: fine
    out = tmp_path / "merged"
    done = run_cli("merge", *map(str, nodes), "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "8 per-rank file(s) (8 ranks)" in done.stdout
    assert "1 torn line(s) dropped" in done.stdout
    for rank in range(8):
        name = f"steps.rank{rank}.jsonl"
        assert (out / name).read_bytes() == (run / name).read_bytes()
    assert (out / "memwatch.jsonl").read_text() == memwatch
    meta = json.loads((out / "meta.json").read_text())
    assert [m["path"] for m in meta["merged_from"]] == [str(n) for n in nodes]
    reference = tmp_path / "reference"
    reference.mkdir()
    for name in [*(f"steps.rank{r}.jsonl" for r in range(8)), "memwatch.jsonl", "comm.jsonl", "meta.json"]:
        shutil.copy(run / name, reference)
    frames.clear_cache()

    def judged(path):
        return sorted((f.probe, f.check, f.verdict, json.dumps(f.where)) for f in run_all(RunDir.open(path)))

    assert judged(out) == judged(reference)


def test_merge_refuses_one_rank_from_two_nodes(run, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for node in (a, b):
        node.mkdir()
        shutil.copy(run / "meta.json", node)
    shutil.copy(run / "steps.rank0.jsonl", a)
    shutil.copy(run / "steps.rank1.jsonl", b / "steps.rank0.jsonl")
    done = run_cli("merge", str(a), str(b), "--out", str(tmp_path / "out"), timeout=60)
    assert done.returncode == 2
    assert "steps.rank0.jsonl is in several inputs with different records" in done.stderr
    assert "Traceback" not in done.stderr
    full = tmp_path / "full"
    full.mkdir()
    (full / "x.jsonl").write_text("{}\n")
    assert run_cli("merge", str(a), str(a), "--out", str(full), timeout=60).returncode == 2


def test_a_compacted_file_still_counts_the_off_schema_records_it_left_out(run):
    file = run / "steps.rank1.jsonl"
    rows = [json.loads(line) for line in file.read_text().splitlines()]
    rows[5]["step"] = "six"  # off the steps schema: every reader drops it and says why
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_jsonl = frames.read_table([file], ("rank", "step"))
    assert from_jsonl.invalid_reasons == {"step: expected int, got str": 1}
    assert run_cli("compact", str(run), "--stream", "steps", timeout=120).returncode == 0
    from_parquet = frames.read_table([file], ("rank", "step"))
    assert from_parquet.parquet_files == 1
    assert (from_parquet.rows, from_parquet.invalid_reasons) == (from_jsonl.rows, from_jsonl.invalid_reasons)
    assert from_parquet.problems() == from_jsonl.problems()


def test_columnar_reader_drops_torn_lines_and_off_schema_records(tmp_path):
    """As the row reader does (issue 25): a record off the steps schema is dropped and counted with its
    reason, not kept with the bad value nulled; a free field's wrong value is nulled and counted."""
    file = tmp_path / "steps.rank0.jsonl"
    lines = [
        {"rank": 0, "step": 1, "step_time_s": 0.5, "host": "h", "free": 2.5},
        {"rank": 0, "step": "two", "step_time_s": 0.5, "host": "h"},  # a string where an int belongs
        {"rank": 0, "step": 3, "step_time_s": [0.5], "host": 7},  # a list and a number, wrong
        {"rank": 0, "step": 4.0, "step_time_s": "inf", "host": "h"},  # 4.0 is a float, not a step number
        {"rank": 0, "step": 5, "step_time_s": "inf", "host": "h", "free": "x"},  # no duration (issue 22)
        {"rank": 0, "step": 6, "step_time_s": 0.25, "host": "h", "free": "x"},
    ]
    file.write_text("".join(json.dumps(r) + "\n" for r in lines) + "[1, 2]\n" + '{"rank": 0, "ste')
    read = frames.read_table([file], ("rank", "step", "step_time_s", "host", "free"))
    assert read.table.column("step").to_pylist() == [1, 6]
    assert read.table.column("step_time_s").to_pylist() == [0.5, 0.25]
    assert read.table.column("free").to_pylist() == [2.5, None]
    assert read.dropped_lines == 2  # a JSON array is not a record; the torn line is not JSON
    assert read.invalid_records == 4
    assert read.invalid_reasons == {
        "step: expected int, got str": 1,
        "step_time_s: expected null or number, got list": 1,
        "step: expected int, got number": 1,
        "step_time_s: not finite": 1,
    }
    assert read.nulled_values == {"free": 1}


def test_columnar_reader_keeps_file_order_across_threads(tmp_path):
    files = []
    for rank in range(40):
        file = tmp_path / f"steps.rank{rank}.jsonl"
        file.write_text("".join(json.dumps({"rank": rank, "step": s}) + "\n" for s in range(1, 51)))
        files.append(file)
    read = frames.read_table(files, ("rank", "step"))
    ranks = read.table.column("rank").to_pylist()
    assert ranks == sorted(ranks)
    assert read.rows == 40 * 50


def test_a_stream_of_many_distinct_keys_compacts_losslessly_in_bounded_columns(tmp_path):
    """2,000 records of 50 keys each, all distinct (100,000 names): a column a name cost columns x
    records and ran past 60 s. Past MAX_COLUMNS the rarest keys ride in one JSON column; every record
    comes back as it was, key order included."""

    import pyarrow.parquet as pq

    from ciuic_doctor.rundir.parquet_store import MAX_COLUMNS, REST_COLUMN, compact_file, parquet_records

    path = tmp_path / "notes.jsonl"
    records = []
    for i in range(2000):
        record = {"step": i + 1, "t": 1000.0 + i}
        record.update({f"k{i}_{j}": (j if j % 3 else f"v{j}") for j in range(50)})
        records.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = compact_file(path)
    assert result.records == 2000
    names = pq.ParquetFile(path.with_suffix(".parquet")).schema_arrow.names
    assert len(names) <= MAX_COLUMNS + 2
    assert REST_COLUMN in names
    assert {"step", "t"} <= set(names)  # the keys every record has stay columns
    back = parquet_records(path.with_suffix(".parquet"))
    assert json.dumps(back) == json.dumps(records)
