"""The columnar copy (ciuic_doctor/rundir/columnar): the first report of a big run writes it, later reports
read it instead of the JSONL, with the same table, the same counts and the same findings; a copy that
does not match the files (grown, planted, hand-edited) is never used; other engines read the layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ciuic_doctor.rundir import columnar, frames
from ciuic_doctor.rundir.store import RunDir
from tests.scalesynth import generate, gpu_plan

REPO = Path(__file__).resolve().parents[1]
STEPS = ["rank", *frames.STREAM_COLUMNS["steps"]]


@pytest.fixture(autouse=True)
def _always_copy(monkeypatch):
    monkeypatch.setenv("CIUIC_COLUMNAR_MIN_BYTES", "0")  # a test run is small: copy it anyway
    frames.clear_cache()
    yield
    frames.clear_cache()


@pytest.fixture(scope="module")
def run_2100(tmp_path_factory) -> Path:
    """3 rank blocks (2,100 ranks × 6 steps), memwatch in one shared file with ranks interleaved."""
    return generate(tmp_path_factory.mktemp("col") / "run", gpu_plan(2100, 6))


@pytest.fixture(scope="module")
def run_small(tmp_path_factory) -> Path:
    """A run a report reads in seconds (the findings' equality; the blocks are tested in-process)."""
    return generate(tmp_path_factory.mktemp("col") / "run", gpu_plan(48, 60))


def _copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    subprocess.run(["cp", "-a", str(run), str(out)], check=True)
    subprocess.run(["rm", "-rf", str(out / "columnar")], check=True)
    return out


def _json_read(run: Path, stream: str, columns: list[str]) -> frames.TableRead:
    run_dir = RunDir.open(run)
    return frames.read_table(run_dir.stream_files(stream), columns, stream, encoded=True)


def _report(run: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CIUIC_COLUMNAR_MIN_BYTES": "0", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "ciuic_doctor", "report", str(run), "--reanalyze", "--quiet", *extra]
    return subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=600)


def _findings(run: Path) -> list:
    return json.loads((run / "findings.json").read_text())["findings"]


def test_first_report_writes_the_copy_and_the_second_reads_it_with_the_same_findings(run_small, tmp_path):
    run = _copy_of(run_small, tmp_path)
    first = _report(run)
    assert first.returncode in (0, 1), first.stderr
    manifest = json.loads((run / "columnar" / "steps" / "manifest.json").read_text())
    assert manifest["rows"] == 48 * 60
    assert manifest["ordered"] is True
    assert len(manifest["sources"]) == 48
    memwatch = json.loads((run / "columnar" / "memwatch" / "manifest.json").read_text())
    assert memwatch["ordered"] is False  # one shared file, ranks interleaved: parts carry _row
    findings = _findings(run)
    copies = {p: p.stat().st_mtime_ns for p in (run / "columnar").rglob("*.parquet")}

    second = _report(run)
    assert second.returncode == first.returncode, second.stderr
    assert _findings(run) == findings
    assert {p: p.stat().st_mtime_ns for p in (run / "columnar").rglob("*.parquet")} == copies  # not rewritten


def test_the_copy_gives_the_json_readers_table_in_its_order(run_2100, tmp_path, monkeypatch):
    run = _copy_of(run_2100, tmp_path)

    memwatch_columns = ["rank", *frames.STREAM_COLUMNS["memwatch"]]
    from_json = {s: _json_read(run, s, c) for s, c in (("steps", STEPS), ("memwatch", memwatch_columns))}
    written = RunDir.open(run)
    for stream, columns in (("steps", STEPS), ("memwatch", memwatch_columns)):
        assert frames.read_stream(written, stream, columns, encoded=True).copy_id is not None
    blocks = sorted(p.name for p in (run / "columnar" / "steps").iterdir() if p.is_dir())
    assert blocks == ["rank_block=0", "rank_block=1", "rank_block=2"]
    memwatch = json.loads((run / "columnar" / "memwatch" / "manifest.json").read_text())
    assert memwatch["ordered"] is False  # one shared file, ranks interleaved: its parts carry _row

    frames.clear_cache()

    def no_json(*args, **kwargs):
        raise AssertionError("the JSONL was parsed although a fresh copy exists")

    monkeypatch.setattr(frames, "read_table", no_json)
    again = RunDir.open(run)
    for stream, columns in (("steps", STEPS), ("memwatch", memwatch_columns)):
        read = frames.read_stream(again, stream, columns, encoded=True)
        assert read.table.cast(from_json[stream].table.schema).equals(from_json[stream].table)


def test_a_stream_that_grew_is_read_from_its_jsonl_and_its_copy_rewritten(run_2100, tmp_path):
    run = _copy_of(run_2100, tmp_path)
    frames.read_stream(RunDir.open(run), "steps", STEPS)
    first_id = columnar.layout.read_manifest(run, "steps").copy_id
    line = (run / "steps.rank7.jsonl").read_text().splitlines()[-1]
    record = json.loads(line)
    record["step"] += 1
    with open(run / "steps.rank7.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
    frames.clear_cache()
    read = frames.read_stream(RunDir.open(run), "steps", STEPS)
    assert read.rows == 2100 * 6 + 1
    manifest = columnar.layout.read_manifest(run, "steps")
    assert manifest.copy_id != first_id
    assert manifest.rows == 2100 * 6 + 1


def test_what_the_reader_dropped_is_counted_the_same_from_the_copy(tmp_path):
    run = generate(tmp_path / "run", gpu_plan(8, 12))
    with open(run / "steps.rank3.jsonl", "a") as fh:
        fh.write('{"rank": 3, "step": "not a step", "t": 1.0}\n')  # off the schema
        fh.write("not json\n")
        fh.write('{"rank": 3, "step": 99, "t": 2.0')  # torn last line
    before = frames.read_stream(RunDir.open(run), "steps", STEPS)
    frames.clear_cache()
    after = frames.read_stream(RunDir.open(run), "steps", STEPS)
    assert after.copy_id == before.copy_id  # read from the copy
    assert (after.dropped_lines, after.invalid_records) == (before.dropped_lines, before.invalid_records)
    assert after.dropped_lines == 2
    assert after.invalid_records == 1
    assert after.problems() == before.problems()


def test_a_planted_or_edited_copy_is_not_read(run_2100, tmp_path):
    run = _copy_of(run_2100, tmp_path)
    truth = frames.read_stream(RunDir.open(run), "steps", STEPS).table
    part = run / "columnar" / "steps" / "rank_block=1" / "part-0.parquet"
    outside = tmp_path / "outside.parquet"
    part.rename(outside)
    part.symlink_to(outside)  # a symlink in place of a part: never followed
    frames.clear_cache()
    read = frames.read_stream(RunDir.open(run), "steps", STEPS)
    assert read.table.equals(truth)
    assert not part.is_symlink()  # the copy was rewritten from the JSONL

    manifest_path = run / "columnar" / "steps" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["parts"][0]["rows"] += 1  # no longer adds up
    manifest_path.write_text(json.dumps(manifest))
    assert columnar.layout.read_manifest(run, "steps") is None
    frames.clear_cache()
    assert frames.read_stream(RunDir.open(run), "steps", STEPS).table.equals(truth)


@pytest.mark.parametrize("edit", ["a place twice", "past the end", "negative"])
def test_a_copy_whose_row_places_were_edited_is_not_read(run_2100, tmp_path, edit):
    """memwatch's parts put its rows back in order by `_row`: places that are not each row once (a
    duplicate, or one outside the stream, which numpy would wrap or refuse) mean the JSONL is read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = _copy_of(run_2100, tmp_path)
    columns = ["rank", *frames.STREAM_COLUMNS["memwatch"]]
    truth = frames.read_stream(RunDir.open(run), "memwatch", columns).table
    part = run / "columnar" / "memwatch" / "rank_block=1" / "part-0.parquet"
    table = pq.read_table(part)
    places = table.column("_row").to_numpy().copy()
    places[0] = {"a place twice": places[1], "past the end": truth.num_rows, "negative": -1}[edit]
    part.unlink()
    pq.write_table(table.set_column(table.column_names.index("_row"), "_row", pa.array(places)), part)
    frames.clear_cache()
    read = frames.read_stream(RunDir.open(run), "memwatch", columns)
    assert read.table.equals(truth)
    assert pq.read_table(part).column("_row").to_pylist() != places.tolist()  # rewritten from the JSONL


def test_a_symlinked_copy_folder_is_not_written_through_and_the_report_says_so(run_small, tmp_path):
    run = _copy_of(run_small, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "columnar").symlink_to(elsewhere)
    result = _report(run)
    assert result.returncode in (0, 1), result.stderr
    assert list(elsewhere.iterdir()) == []
    assert "no columnar copy of steps written" in result.stderr
    assert "Traceback" not in result.stderr


def test_one_block_is_read_alone_in_the_streams_order(run_2100, tmp_path):
    run = _copy_of(run_2100, tmp_path)
    memwatch_columns = ["rank", *frames.STREAM_COLUMNS["memwatch"]]
    for stream, columns in (("steps", STEPS), ("memwatch", memwatch_columns)):
        whole = frames.read_stream(RunDir.open(run), stream, columns, encoded=True)
        ranks = list(range(1024, 2048))
        block = columnar.read_ranks(run, stream, ranks, ["rank", "t"], copy_id=whole.copy_id)
        import pyarrow as pa
        import pyarrow.compute as pc

        expected = whole.table.filter(pc.is_in(whole.table["rank"], value_set=pa.array(ranks))).select(
            ["rank", "t"]
        )
        assert block.num_rows == expected.num_rows > 0
        assert block.equals(expected.combine_chunks())
        with pytest.raises(columnar.StaleCopy):
            columnar.read_ranks(run, stream, ranks, ["rank"], copy_id="not-this-copy")


def test_other_engines_read_the_layout_as_it_is(run_2100, tmp_path):
    import pyarrow.dataset as ds

    run = _copy_of(run_2100, tmp_path)
    frames.read_stream(RunDir.open(run), "steps", STEPS)
    dataset = ds.dataset(
        run / "columnar" / "steps", format="parquet", partitioning="hive", exclude_invalid_files=True
    )
    block = dataset.to_table(columns=["rank"], filter=ds.field("rank_block") == 2)
    assert block.num_rows == (2100 - 2048) * 6
    assert sorted(set(block.column("rank").to_pylist())) == list(range(2048, 2100))


def test_compact_writes_the_copy_so_even_the_first_report_parses_no_json(run_small, tmp_path, monkeypatch):
    run = _copy_of(run_small, tmp_path)
    monkeypatch.setenv("CIUIC_COLUMNAR_MIN_BYTES", str(2**40))  # a report would not copy a run this small
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "ciuic_doctor", "compact", str(run)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"columnar/steps: {48 * 60} records" in done.stdout
    assert (run / "columnar" / "memwatch" / "manifest.json").is_file()

    def no_json(*args, **kwargs):
        raise AssertionError("the JSONL was parsed although compact wrote a fresh copy")

    monkeypatch.setattr(frames, "read_table", no_json)
    assert frames.read_stream(RunDir.open(run), "steps", STEPS).rows == 48 * 60


def test_a_loss_that_went_nan_is_kept_as_nan(tmp_path):
    run = generate(tmp_path / "run", gpu_plan(4, 10))
    path = run / "steps.rank2.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[-1])
    record["loss"] = "nan"  # what the store writes for a non-finite float
    lines[-1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    first = frames.read_stream(RunDir.open(run), "steps", STEPS)
    frames.clear_cache()
    again = frames.read_stream(RunDir.open(run), "steps", STEPS)
    assert again.copy_id == first.copy_id  # from the copy
    rows = again.table.select(["rank", "step", "loss"]).to_pylist()
    last = max((r for r in rows if r["rank"] == 2), key=lambda r: r["step"])
    assert last["loss"] != last["loss"]  # NaN, as the JSONL reader read it
    assert sum(r["loss"] != r["loss"] for r in rows) == 1


def test_the_analyses_let_a_stream_go_after_its_last_reader_and_keep_what_the_page_reads(
    run_small, tmp_path, monkeypatch
):
    """run_all drops memwatch's cached table once the memory analysis (its only reader) is done, so the
    steps analyses' temporaries do not come on top of it; `keep` holds the steps for the page."""
    from ciuic_doctor.analysis import run_all

    run = RunDir.open(_copy_of(run_small, tmp_path))
    let_go: list[tuple[str, bool]] = []
    forget = frames.forget

    def spy(run_dir, stream):
        let_go.append((stream, any(key[1] == stream for key in frames._CACHE)))
        forget(run_dir, stream)

    monkeypatch.setattr(frames, "forget", spy)
    held_when_called = []

    def view() -> None:  # the report takes its page's memwatch view here
        held_when_called.append(any(key[1] == "memwatch" for key in frames._CACHE))

    findings = run_all(run, keep=("steps",), before_letting_go={"memwatch": view})
    assert ("memwatch", True) in let_go  # it was held, and then let go
    assert held_when_called == [True]
    assert {stream for _, stream in frames._CACHE} == {"steps"}

    frames.clear_cache()
    assert run_all(run) == findings  # the same findings whatever is kept
    assert not frames._CACHE


def test_a_part_that_reads_back_different_is_not_kept(tmp_path, monkeypatch):
    """Every part is read back (a column at a time) and compared with the rows it was written from: a
    writer that wrote other values leaves no copy, and says so in one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ciuic_doctor.rundir.columnar import layout, write

    written = pq.write_table

    def wrong_values(table, where, **options):
        return written(table.set_column(1, "loss", pa.array([9.5] * table.num_rows)), where, **options)

    table = pa.table({"rank": pa.array([0, 1, 1025], pa.int64()), "loss": pa.array([1.0, 2.0, 3.0])})
    monkeypatch.setattr(pq, "write_table", wrong_values)
    why = write.save(tmp_path, "steps", [], table, layout.Counts())
    assert why == (
        "no columnar copy of steps written: rank_block=0/part-0.parquet: read back differs from the "
        "records it was written from"
    )
    assert list((tmp_path / "columnar").iterdir()) == []
    monkeypatch.setattr(pq, "write_table", written)
    assert not isinstance(write.save(tmp_path, "steps", [], table, layout.Counts()), str)
    assert layout.read_manifest(tmp_path, "steps").rows == 3


@pytest.mark.parametrize("rows_at_a_time", [1, 3, 1 << 20])
def test_parts_of_ranks_in_order_are_found_a_block_of_rows_at_a_time(monkeypatch, rows_at_a_time):
    """Per-rank files read in rank order: the parts are slices, found a block of rows at a time (never the
    whole table's keys), the same wherever the blocks of rows and the table's chunks fall; ranks out of
    order or without a rank take the general path (rows' places)."""
    import pyarrow as pa

    from ciuic_doctor.rundir.columnar import write

    monkeypatch.setattr(write, "CUT_ROWS", rows_at_a_time)
    ranks = [0, 0, 5, 1023, 1024, 1024, 2047, 3000, 3000, 9000]
    table = pa.table({"rank": pa.chunked_array([ranks[:4], ranks[4:7], ranks[7:]], pa.int64())})
    assert write.cut(table) == ([(0, (0, 4)), (1, (4, 7)), (2, (7, 9)), (8, (9, 10))], True)
    shuffled = pa.table({"rank": pa.array([1024, 0, 1025], pa.int64())})
    parts, ordered = write.cut(shuffled)
    assert not ordered
    assert [(block, rows.tolist()) for block, rows in parts] == [(0, [1]), (1, [0, 2])]
    unranked = pa.table({"rank": pa.array([None, 0], pa.int64())})
    assert [block for block, _ in write.cut(unranked)[0]] == [None, 0]


def _cached_within(key: tuple[str, str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while key not in frames._CACHE and time.monotonic() < deadline:
        time.sleep(0.01)
    return key in frames._CACHE


def test_a_fresh_copy_is_read_beside_the_callers_read_and_nothing_else_is(run_2100, tmp_path):
    from ciuic_doctor.rundir.frames.beside import read_beside

    run = _copy_of(run_2100, tmp_path)
    key = (str(run.resolve()), "steps")
    with frames.one_snapshot(), read_beside(RunDir.open(run), "steps"):
        assert not _cached_within(key, 1.0)  # no copy yet: the caller parses it (and writes the copy)
    frames.read_stream(RunDir.open(run), "steps", STEPS)
    frames.clear_cache()

    with frames.one_snapshot(), read_beside(RunDir.open(run), "steps"):
        assert _cached_within(key, 60.0)  # read by the other thread while this one waits
    read = frames._CACHE[key][1]
    assert read.copy_id is not None
    expected = _json_read(run, "steps", STEPS).table
    assert read.select(STEPS, encoded=True).table.cast(expected.schema).equals(expected)

    with open(run / "steps.rank7.jsonl", "a") as fh:  # the copy is stale now: left to the caller
        fh.write((run / "steps.rank7.jsonl").read_text().splitlines()[-1] + "\n")
    frames.clear_cache()
    with frames.one_snapshot(), read_beside(RunDir.open(run), "steps"):
        assert not _cached_within(key, 1.0)


@pytest.mark.parametrize("spanning", [False, True])
def test_memwatch_read_as_its_parts_hold_it_gives_the_same_processes_and_page(
    run_2100, tmp_path, monkeypatch, spanning
):
    """The memory analysis and the page take memwatch's rows as the copy's parts hold them (rank block by
    rank block, each row's place in the stream beside): every process's samples, roles, hosts, first
    appearance and the page's view equal those of the JSONL's order. `spanning`: a process whose last
    samples name no rank has samples in two parts (the rank-less part, read first, and its rank's)."""
    import numpy as np

    from ciuic_doctor.analysis.memory.columns import NUMERIC, MemwatchColumns
    from ciuic_doctor.report import memwatch_view

    run = _copy_of(run_2100, tmp_path)
    if spanning:
        path = run / "memwatch.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        spans = [r for r in records if r.get("rank") == 1500][-2:]  # in the rank-less part, read first
        for record in spans:
            record["rank"] = None
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    def taken() -> tuple:
        frames.clear_cache()
        samples = MemwatchColumns(RunDir.open(run))
        view = memwatch_view.load(RunDir.open(run))
        columns = {name: samples.gather(name, slice(None)) for name in NUMERIC}
        order = (list(samples.bounds().items()), list(samples.roles.items()), samples._hosts)
        return order, columns, (list(view), view.processes, view.key)

    monkeypatch.setenv("CIUIC_COLUMNAR_MIN_BYTES", str(10**15))  # the JSONL, in the stream's order
    want = taken()
    assert not (run / "columnar" / "memwatch").exists()
    monkeypatch.setenv("CIUIC_COLUMNAR_MIN_BYTES", "0")
    frames.columnar_copy(RunDir.open(run), "memwatch")
    frames.clear_cache()
    read = frames.read_stream(RunDir.open(run), "memwatch", ["pid"], any_order=True)
    assert read.stream_rows is not None  # read as the parts hold it, not put in the stream's order
    assert not (np.diff(read.stream_rows) > 0).all()
    got = taken()
    assert got[0] == want[0]
    for name in NUMERIC:
        np.testing.assert_array_equal(got[1][name], want[1][name])
    assert got[2] == want[2]
    # a reader that asks for the stream's order gets it from the same cached read
    assert frames.read_stream(RunDir.open(run), "memwatch", ["pid"]).stream_rows is None
