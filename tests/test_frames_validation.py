"""The columnar reader (frames) against the row reader (store.read_jsonl) on the same fuzzed runs: the same
records kept, the same lines dropped, the same off-schema records counted with the same reasons — and a
clean GPU run read on the fast path (pyarrow's parse validates column-wise; no file read record by
record)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from ciuic_doctor.rundir import frames
from ciuic_doctor.rundir.schemas import SCHEMAS
from ciuic_doctor.rundir.store import RunDir
from tests import fuzzkit, scalesynth

STREAMS = ("steps", "memwatch", "memwatch_events", "checkpoint", "comm", "loader")


def _columns(stream: str) -> list[str]:
    return [name for name in SCHEMAS[stream] if frames.COLUMN_TYPES.get(name, "float64") != "list<int64>"]


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def assert_same_reads(run: RunDir) -> None:
    for stream in STREAMS:
        files = run.stream_files(stream)
        if not files:
            continue
        rows = run.read(stream)
        columns = _columns(stream)
        table = frames.read_table(files, columns, stream)
        assert table.dropped_lines == rows.skipped_lines, stream
        assert table.invalid_records == rows.invalid_records, stream
        assert table.invalid_reasons == rows.invalid_reasons, stream
        assert table.problems() == rows.problems(), stream
        assert table.rows == len(rows.records), stream
        got = table.table.to_pylist()
        for want, have in zip(rows.records, got, strict=True):
            for column in columns:
                expected, _ = frames._coerce(want.get(column), frames.COLUMN_TYPES.get(column, "float64"))
                assert _same(expected, have[column]), (stream, column, want.get(column), have[column])


def _corrupt_lines(folder, rng: random.Random) -> None:
    """Line-level damage the row reader skips and pyarrow might not: two records on one line, a torn
    last line, a duplicate key, a line that is not an object, a blank line, a deep nest in a free field."""
    files = sorted(folder.glob("*.jsonl"))
    for path in rng.sample(files, k=min(3, len(files))):
        lines = path.read_text().splitlines()
        if len(lines) < 3:
            continue
        how = rng.randrange(6)
        i = rng.randrange(len(lines) - 1)
        if how == 0:
            lines[i] = lines[i] + lines[i + 1]
        elif how == 1:
            path.write_text("\n".join(lines) + "\n" + lines[i][: len(lines[i]) // 2])
            continue
        elif how == 2:
            lines[i] = lines[i][:-1] + ',"t":"dup"}'
        elif how == 3:
            lines[i] = json.dumps([1, 2])
        elif how == 4:
            lines.insert(i, "   ")
        else:
            lines[i] = lines[i][:-1] + ',"free":' + "[" * 50 + "]" * 50 + "}"
        path.write_text("\n".join(lines) + "\n")


def _fuzzed_run(folder, seed: int) -> RunDir:
    """A run with seeded bad values, and on odd seeds damaged lines too."""
    rng = random.Random(seed)
    fuzzkit.write_run(folder, fuzzkit.random_mutations(rng))
    if seed % 2:
        _corrupt_lines(folder, rng)
    frames.clear_cache()
    return RunDir.open(folder)


@pytest.mark.parametrize("seed", range(40))
def test_row_and_columnar_readers_agree_on_a_fuzzed_run(tmp_path, seed):
    assert_same_reads(_fuzzed_run(tmp_path / "run", seed))


TARGETED = [
    ("steps.rank1.jsonl", "step", fuzzkit.DELETE),  # a required field missing ...
    ("steps.rank1.jsonl", "step", None),  # ... or null: two different reasons
    ("steps.rank1.jsonl", "t", None),  # a field that may be absent but never null
    ("steps.rank1.jsonl", "skipped", 1.5),  # a field of two JSON types (bool or int), a third one
    ("steps.rank1.jsonl", "skipped", 3),  # ... and an allowed second one (an imported log's count)
    ("steps.rank1.jsonl", "desync_ranks", [1.5]),
    ("steps.rank1.jsonl", "host", 5),
    ("steps.rank1.jsonl", "loss", "nan"),  # valid, but pyarrow's float column refuses it
    ("memwatch.jsonl", "pid", fuzzkit.DELETE),
    ("memwatch.jsonl", "role", None),
    ("memwatch.jsonl", "gpu_devices", "x"),
    ("memwatch.jsonl", "rank", 2**70),
    ("memwatch_events.jsonl", "kind", 3),
    # the bounds the column-wise check takes from one min_max a column
    ("steps.rank1.jsonl", "step_time_s", -0.5),  # a measurement that cannot be negative
    ("steps.rank1.jsonl", "tokens", -3),  # ... as a whole number
    ("steps.rank1.jsonl", "loss", 1e151),  # a finite number past ±1e150
    ("steps.rank1.jsonl", "grad_norm", -1e151),
    ("steps.rank1.jsonl", "step", 2**53 + 1),  # a whole number past ±2**53
    ("steps.rank1.jsonl", "rank", -(2**63) + 1),
    ("memwatch.jsonl", "rss", 1e200),
]


@pytest.mark.parametrize(("name", "field", "value"), TARGETED)
def test_row_and_columnar_readers_agree_on_each_kind_of_bad_value(tmp_path, name, field, value):
    folder = tmp_path / "run"
    fuzzkit.write_run(folder, [(name, 3, field, value)])
    frames.clear_cache()
    assert_same_reads(RunDir.open(folder))


def test_read_stream_names_what_it_skipped_as_the_row_reader_does(tmp_path):
    folder = tmp_path / "run"
    fuzzkit.write_run(folder, [("steps.rank1.jsonl", 2, "step", "3"), ("steps.rank2.jsonl", 4, "loss", [])])
    with open(folder / "steps.rank3.jsonl", "a") as fh:
        fh.write('{"rank":3,"st')
    frames.clear_cache()
    columnar, rows = RunDir.open(folder), RunDir.open(folder)
    frames.read_stream(columnar, "steps", ("rank", "step"))
    rows.read("steps")
    assert columnar.read_problems["steps"] == rows.read_problems["steps"]
    assert "2 record(s) off schema" in columnar.read_problems["steps"]
    assert "1 unparsable line(s)" in columnar.read_problems["steps"]


def test_a_clean_gpu_run_is_validated_column_wise(tmp_path, monkeypatch):
    plan = scalesynth.Plan(ranks=16, steps=40, gpu=True, reserved_grower=True, memwatch=True, comm=True)
    run = RunDir.open(scalesynth.generate(tmp_path / "run", plan))
    slow: list[str] = []
    alone: list[str] = []
    real, real_one = frames._read_rows, frames._read_jsonl
    monkeypatch.setattr(frames, "_read_rows", lambda path, *a: slow.append(path.name) or real(path, *a))
    monkeypatch.setattr(frames, "_read_jsonl", lambda path, *a: alone.append(path.name) or real_one(path, *a))
    frames.clear_cache()
    for stream in ("steps", "memwatch", "memwatch_events"):
        frames.read_table(run.stream_files(stream), _columns(stream), stream)
    assert slow == []
    assert not [name for name in alone if name.startswith("steps.")]  # the ranks' files parsed together
    monkeypatch.setattr(frames, "_read_jsonl", real_one)
    assert_same_reads(run)


@pytest.fixture
def small_pieces(monkeypatch):
    """Every file over 2 KiB cut in ~300-byte pieces (a 10,000-rank memwatch.jsonl: 4.4 GB in 32 MiB
    pieces); the pieces parsed are counted, so a test sees the piecewise path was taken."""
    from ciuic_doctor.rundir.frames import parts as frames_parts

    monkeypatch.setattr(frames_parts, "BIG_FILE_BYTES", 2048)
    monkeypatch.setattr(frames_parts, "RANGE_BYTES", 300)
    pieces: list[tuple[int, int]] = []
    real = frames._read_range
    monkeypatch.setattr(frames, "_read_range", lambda p, a, b, *r: pieces.append((a, b)) or real(p, a, b, *r))
    return pieces


@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_a_big_file_read_in_pieces_reads_as_the_row_reader_does(tmp_path, seed, small_pieces):
    """A torn last line, two records on one line, a bad record in any piece: the file is judged whole."""
    assert_same_reads(_fuzzed_run(tmp_path / "run", seed))
    assert small_pieces  # the piecewise path ran


def test_a_clean_big_file_is_parsed_in_pieces_on_the_fast_path(tmp_path, monkeypatch, small_pieces):
    plan = scalesynth.Plan(ranks=16, steps=40, gpu=True, memwatch=True)
    run = RunDir.open(scalesynth.generate(tmp_path / "run", plan))
    with open(run.path / "memwatch.jsonl", "ab") as fh:
        fh.write(b'{"schema":1,"t":5.0,"pid":7,"ro')  # a crash's torn last line: read apart
    slow: list[str] = []
    real = frames._read_rows
    monkeypatch.setattr(frames, "_read_rows", lambda path, *a: slow.append(path.name) or real(path, *a))
    frames.clear_cache()
    read = frames.read_table(run.stream_files("memwatch"), _columns("memwatch"), "memwatch")
    size = (run.path / "memwatch.jsonl").stat().st_size
    assert slow == []
    assert len(small_pieces) > 10
    assert small_pieces[0][0] == 0
    assert small_pieces[-1][1] < size  # the torn line is no piece
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(small_pieces))
    assert read.dropped_lines == 1
    assert read.rows == len(run.read("memwatch").records)
