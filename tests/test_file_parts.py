"""Each big stream file's part, left by its probe at exit (ciuic_doctor/rundir/frames/file_parts.py): a
watched rank and memwatch write theirs when they end, the report reads it instead of parsing the JSONL
with the same table, counts and findings, and a part that does not fit its file as it is now (grown,
planted, retyped, cut) is never read."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from ciuic_doctor.rundir import frames
from ciuic_doctor.rundir.frames import file_parts, part_writer, parts
from tests.conftest import run_cli
from tests.scalesynth import generate, gpu_plan

REPO = Path(__file__).resolve().parents[1]
STEPS = list(frames.STREAM_COLUMNS["steps"])
MEMWATCH = list(frames.STREAM_COLUMNS["memwatch"])
TRAIN = """
import torch
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(40):
    loss = (model(torch.randn(16, 8)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.fixture(autouse=True)
def _fresh_cache():
    frames.clear_cache()
    yield
    frames.clear_cache()


def _read(files: list[Path], columns: list[str], stream: str) -> frames.TableRead:
    frames.clear_cache()
    return frames.read_table(files, columns, stream)


def _same(a: frames.TableRead, b: frames.TableRead) -> None:
    assert a.table.equals(b.table)
    assert a.table.schema == b.table.schema
    assert (a.dropped_lines, a.nulled_values, a.invalid_reasons) == (
        b.dropped_lines,
        b.nulled_values,
        b.invalid_reasons,
    )


def _parsed(files: list[Path], columns: list[str], stream: str) -> frames.TableRead:
    """The same files read with every part moved away: the JSONL parsed."""
    held = files[0].parent / "columnar" / "_files"
    aside = held.with_name("_aside")
    held.rename(aside)
    try:
        read = _read(files, columns, stream)
    finally:
        aside.rename(held)
    assert read.part_files == 0
    return read


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> Path:
    """A real script run under `ciuic-doctor watch` to its end, a part asked for whatever the size."""
    tmp = tmp_path_factory.mktemp("parts")
    (tmp / "train.py").write_text(TRAIN)
    done = run_cli(
        "watch", "--out", str(tmp / "run"), "--", str(tmp / "train.py"), env={"CIUIC_COLUMNAR_MIN_BYTES": "0"}
    )
    assert done.returncode == 0, done.stderr
    return tmp / "run"


def test_a_watched_rank_leaves_its_part_and_the_reader_takes_it_instead_of_the_json(watched):
    steps = watched / "steps.rank0.jsonl"
    assert file_parts.part_path(steps).is_file()
    read = _read([steps], STEPS, "steps")
    assert read.part_files == 1
    assert read.rows == 40
    _same(read, _parsed([steps], STEPS, "steps"))
    fewer = _read([steps], ["rank", "step", "loss"], "steps")  # any of the stream's columns, from the part
    assert fewer.part_files == 1
    assert fewer.table.column("loss").equals(read.table.column("loss"))


def test_a_session_ended_by_its_atexit_handler_leaves_its_part_too(tmp_path):
    """`attach()` without `close()`: the session ends in an atexit handler, after concurrent.futures has
    shut down (a pool there cannot start threads: the one-file read must not need one)."""
    script = tmp_path / "attached.py"
    script.write_text(
        "import sys\nfrom pathlib import Path\nfrom ciuic_doctor.probes.watch.session import attach\n"
        "from ciuic_doctor.rundir.store import RunDir\n"
        "attach(run=RunDir.create(Path(sys.argv[1])), rank=0)\n" + TRAIN
    )
    env = {**os.environ, "CIUIC_COLUMNAR_MIN_BYTES": "0", "PYTHONPATH": str(REPO)}
    env.pop("CIUIC_RUN_DIR", None)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")], env=env, timeout=120, check=False
    )
    assert done.returncode == 0
    steps = tmp_path / "run" / "steps.rank0.jsonl"
    assert file_parts.part_path(steps).is_file()
    assert _read([steps], STEPS, "steps").part_files == 1


def test_no_part_below_the_size_a_columnar_copy_starts_at(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    done = run_cli("watch", "--out", str(tmp_path / "run"), "--", str(tmp_path / "train.py"))
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "run" / "columnar").exists()  # 40 steps of one rank: 22 KB, far below 32 MiB


def test_the_world_size_counts_toward_the_threshold(watched, tmp_path, monkeypatch):
    steps = tmp_path / "steps.rank0.jsonl"
    shutil.copy(watched / "steps.rank0.jsonl", steps)
    size = steps.stat().st_size
    monkeypatch.setenv("CIUIC_COLUMNAR_MIN_BYTES", str(size * 3 // 2))
    assert part_writer.write_at_exit(steps, "steps", copies=1) is None
    assert part_writer.write_at_exit(steps, "steps", copies=2) == file_parts.part_path(steps)
    file_parts.part_path(steps).unlink()
    monkeypatch.setattr(part_writer, "EXIT_MAX_BYTES", size - 1)  # too big to parse while the job ends
    assert part_writer.write_at_exit(steps, "steps", copies=2) is None
    monkeypatch.setenv("CIUIC_COLUMNAR_MIN_BYTES", "-1")  # copies turned off: no part either
    monkeypatch.setattr(part_writer, "EXIT_MAX_BYTES", size)
    assert part_writer.write_at_exit(steps, "steps", copies=10**6) is None


def test_a_part_is_read_only_while_its_file_is_unchanged(watched, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(watched, run)
    steps = run / "steps.rank0.jsonl"
    with steps.open("a") as fh:  # a resumed job appended a step after the part was written
        fh.write(steps.read_text().splitlines()[-1] + "\n")
    read = _read([steps], STEPS, "steps")
    assert read.part_files == 0
    assert read.rows == 41


def _tamper(part: Path, how: str, other: Path) -> None:
    if how == "symlink":  # a valid part of another file, planted by name
        part.unlink()
        part.symlink_to(other)
    elif how == "folder symlink":  # columnar/_files itself, pointing elsewhere
        elsewhere = other.parent / "elsewhere"
        part.parent.rename(elsewhere)
        part.parent.symlink_to(elsewhere, target_is_directory=True)
    elif how == "garbage":
        part.write_bytes(b"ARROW1\x00\x00" + os.urandom(4000))
    elif how == "cut":
        part.write_bytes(part.read_bytes()[:-100])
    else:
        with pa.ipc.open_file(pa.py_buffer(part.read_bytes())) as reader:
            table = reader.read_all()
        meta = json.loads(table.schema.metadata[file_parts.KEY])
        if how == "retyped":  # a float column stored as int, its metadata untouched
            at = table.column_names.index("loss")
            table = table.set_column(at, "loss", table.column("loss").cast(pa.int64(), safe=False))
        elif how == "rows":
            meta["rows"] += 1
        elif how == "counts":
            meta["nulled_values"] = {"loss": -3}
        elif how == "other source":
            meta["source"][1] += 1
        table = table.replace_schema_metadata({file_parts.KEY: json.dumps(meta).encode()})
        with pa.OSFile(str(part), "wb") as fh, pa.ipc.new_file(fh, table.schema) as writer:
            writer.write_table(table)


@pytest.mark.parametrize(
    "how", ["symlink", "folder symlink", "garbage", "cut", "retyped", "rows", "counts", "other source"]
)
def test_a_part_that_does_not_check_is_never_read(watched, tmp_path, how):
    run = tmp_path / "run"
    shutil.copytree(watched, run, symlinks=True)
    steps = run / "steps.rank0.jsonl"
    expected = _parsed([steps], STEPS, "steps")
    other = tmp_path / "other.arrow"
    shutil.copy(file_parts.part_path(steps), other)
    _tamper(file_parts.part_path(steps), how, other)
    read = _read([steps], STEPS, "steps")
    assert read.part_files == 0
    _same(read, expected)


def test_a_big_files_part_is_read_a_batch_at_a_time(tmp_path, monkeypatch):
    """memwatch.jsonl of a whole job: its part in record batches, copied into the table one at a time
    (BIG_FILE_BYTES and BATCH_ROWS made small, so that a test-sized file is big)."""
    run = generate(tmp_path / "run", gpu_plan(24, 30))
    memwatch = run / "memwatch.jsonl"
    monkeypatch.setattr(parts, "BIG_FILE_BYTES", 64 << 10)
    monkeypatch.setattr(file_parts, "BATCH_ROWS", 100)
    part_writer.write(memwatch)
    assert file_parts.probe(memwatch, "memwatch").batches > 3
    read = _read([memwatch], MEMWATCH, "memwatch")
    assert read.part_files == 1
    _same(read, _parsed([memwatch], MEMWATCH, "memwatch"))
    _tamper(file_parts.part_path(memwatch), "rows", tmp_path / "unused")  # its batches no longer add up
    again = _read([memwatch], MEMWATCH, "memwatch")
    assert again.part_files == 0
    _same(again, read)


def test_memwatch_leaves_its_part_when_it_ends(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        done = run_cli(
            "memwatch",
            *("--pid", str(sleeper.pid), "--interval", "0.1", "--duration", "1.5"),
            *("--out", str(tmp_path / "run")),
            env={"CIUIC_COLUMNAR_MIN_BYTES": "0"},
        )
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
    assert done.returncode == 0, done.stderr
    memwatch = tmp_path / "run" / "memwatch.jsonl"
    read = _read([memwatch], MEMWATCH, "memwatch")
    assert read.part_files == 1
    assert read.rows >= 5
    _same(read, _parsed([memwatch], MEMWATCH, "memwatch"))


def test_a_killed_rank_leaves_no_part_and_its_file_is_parsed(tmp_path):
    """kill -9 runs no exit code at all: the report parses that rank's JSONL as before."""
    (tmp_path / "train.py").write_text(TRAIN.replace("range(40)", "iter(int, 1)") + "\n")
    env = {**os.environ, "CIUIC_COLUMNAR_MIN_BYTES": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    argv = [sys.executable, "-m", "ciuic_doctor", "watch", "--out", str(tmp_path / "run"), "--"]
    job = subprocess.Popen([*argv, str(tmp_path / "train.py")], env=env, stderr=subprocess.DEVNULL)
    steps = tmp_path / "run" / "steps.rank0.jsonl"
    deadline = time.monotonic() + 120
    while not (steps.exists() and steps.stat().st_size > 20_000) and time.monotonic() < deadline:
        time.sleep(0.1)
    job.kill()
    job.wait()
    assert not file_parts.part_path(steps).exists()
    read = _read([steps], STEPS, "steps")
    assert read.part_files == 0
    assert read.rows > 30


def test_findings_are_the_same_whether_the_report_parses_or_reads_parts(tmp_path):
    """The whole report, twice on the same files: once parsing every JSONL file, once from the parts."""
    run = generate(tmp_path / "run", gpu_plan(32, 120))
    env = {"CIUIC_COLUMNAR_MIN_BYTES": "0", "PYTHONPATH": str(REPO)}
    parsed = run_cli("report", str(run), "--reanalyze", "--quiet", env=env, timeout=300)
    assert parsed.returncode in (0, 1), parsed.stderr
    findings = json.loads((run / "findings.json").read_text())["findings"]
    shutil.rmtree(run / "columnar")
    files = [run / "memwatch.jsonl", *sorted(run.glob("steps.rank*.jsonl"))]
    for path in files:
        assert part_writer.write(path) is not None
    assert _read(sorted(run.glob("steps.rank*.jsonl")), STEPS, "steps").part_files == 32
    again = run_cli("report", str(run), "--reanalyze", "--quiet", env=env, timeout=300)
    assert again.returncode == parsed.returncode, again.stderr
    assert json.loads((run / "findings.json").read_text())["findings"] == findings
    assert (run / "columnar" / "steps" / "manifest.json").is_file()  # the copy made from the parts
