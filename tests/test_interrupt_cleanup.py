"""Interrupted mid-way, compact and merge leave the run as it was (issue 22, class 6): SIGTERM of `compact`
exits 143 with no `.tmp` left and every stream readable with all its records; Ctrl-C of `merge` exits 130
and leaves no half-made --out. Real processes; each signal is sent once an observable state is reached
(a temp file in the run; merge's own line after its first copy), never after a guessed sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RANKS, STEPS = 12, 20_000


def _big_run(path: Path) -> Path:
    """RANKS per-rank steps files of STEPS records each (2.5 MiB a file): compact takes seconds."""
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"schema": 1, "run": path.name}))
    for rank in range(RANKS):
        lines = (
            f'{{"schema": 1, "t": {1000.0 + i}, "host": "h", "rank": {rank}, "step": {i}, "loss": 3.0, '
            f'"lr": 0.001, "grad_norm": 1.0, "step_time_s": 0.1}}\n'
            for i in range(1, STEPS + 1)
        )
        (path / f"steps.rank{rank}.jsonl").write_text("".join(lines))
    return path


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    return subprocess.Popen([sys.executable, *args], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kwargs)  # fmt: skip


def _wait(condition, proc: subprocess.Popen, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"ended (exit {proc.returncode}) before {what}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.005)


def test_sigterm_of_compact_exits_143_leaves_no_tmp_and_the_run_intact(tmp_path):
    run = _big_run(tmp_path / "run")
    before = {p.name: p.read_bytes() for p in run.glob("*.jsonl")}
    proc = _cli("-m", "ciuic_doctor", "compact", str(run), "--quiet")
    try:
        _wait(lambda: any(run.glob(".*.tmp")), proc, "a Parquet file being written")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "Traceback" not in err, err
    left = sorted(p.name for p in run.iterdir())
    assert not [name for name in left if name.endswith(".tmp")], left
    assert len(list(run.glob("*.parquet"))) < RANKS  # the files not started were left alone
    assert {p.name: p.read_bytes() for p in run.glob("*.jsonl")} == before
    from ciuic_doctor.rundir.store import RunDir

    read = RunDir.open(run).read("steps")  # Parquet where it was finished, JSONL elsewhere
    assert len(read.records) == RANKS * STEPS
    assert not read.invalid_records
    assert not read.skipped_lines


PAUSE_AFTER_FIRST_COPY = """
import sys
from ciuic_doctor.commands import merge
copy = merge._append
def paused(*args, **kwargs):
    torn = copy(*args, **kwargs)
    print("copied one", flush=True)  # --out now holds a part of the merge
    sys.stdin.read()  # wait here (for the test's Ctrl-C)
    return torn
merge._append = paused
from ciuic_doctor.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_of_merge_exits_130_and_leaves_no_half_made_out(tmp_path):
    a, b = _small(tmp_path / "a", rank=0), _small(tmp_path / "b", rank=1)  # two nodes of one job
    out = tmp_path / "merged"
    proc = _cli(
        "-c", PAUSE_AFTER_FIRST_COPY, "merge", str(a), str(b), "--out", str(out), stdin=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline().strip() == "copied one"
        assert any(out.iterdir())  # observable: a half-made --out
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    assert sorted(p.name for p in a.iterdir()) == ["meta.json", "steps.rank0.jsonl"]  # inputs untouched
    assert sorted(p.name for p in b.iterdir()) == ["meta.json", "steps.rank1.jsonl"]


def _small(path: Path, *, rank: int) -> Path:
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"schema": 1, "run": path.name}))
    record = {"schema": 1, "t": 1.0, "host": f"node{rank}", "rank": rank, "step": 1, "loss": 1.0}
    (path / f"steps.rank{rank}.jsonl").write_text(json.dumps(record) + "\n")
    return path
