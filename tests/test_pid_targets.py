"""What --pid may name: never this command itself, never init's whole tree, and `hang --pid --out` never
writes among another run's records. Each refusal is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest


def one_line(done) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_hang_without_a_run_or_a_pid_asks_for_one(cli):
    assert one_line(cli("hang")) == (
        "ciuic-doctor hang: error: give a run directory (hang RUN) or a running job (hang --pid PID)"
    )


@pytest.mark.skipif(
    any(word in " ".join(psutil.Process(1).cmdline()) for word in ("python", "torchrun")),
    reason="PID 1 here is a Python process (a container whose entrypoint is the job)",
)
@pytest.mark.parametrize("argv", [["hang", "--pid", "1"], ["top", "--pid", "1", "--once"]])
def test_init_is_not_taken_for_a_job(cli, argv):
    line = one_line(cli(*argv))
    assert "PID 1 (" in line
    assert "is the system's init process, not a training job" in line


def test_hang_of_its_own_pid_says_so_in_its_own_words():
    """`bash -c 'exec ciuic-doctor hang --pid $$'`: the shell's PID is the command's own."""
    env = {**os.environ}
    env.pop("CIUIC_RUN_DIR", None)
    done = subprocess.run(
        ["bash", "-c", f"exec {sys.executable} -m ciuic_doctor hang --pid $$"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    line = one_line(done)
    assert line.endswith("is this ciuic-doctor process itself, not a training job"), line
    assert "memwatch" not in line


def test_hang_pid_out_refuses_another_run_and_writes_nothing(tmp_path, cli, sleeper):
    from ciuic_doctor.rundir.store import RunDir

    other = RunDir.create(tmp_path / "other")
    other.update_meta(note="another job's run")
    writer = other.writer("steps", rank=0, per_rank_file=True)
    writer.write({"step": 1, "t": 1.0, "rank": 0})
    writer.close()
    before = {p.name: p.stat().st_mtime_ns for p in other.path.iterdir()}
    line = one_line(cli("hang", "--pid", str(sleeper.pid), "--out", str(other.path), timeout=90))
    assert line.startswith(f"ciuic-doctor hang: error: --out {other.path}: holds another run (meta.json, ")
    assert f"not the one the job at PID {sleeper.pid} writes" in line
    assert {p.name: p.stat().st_mtime_ns for p in other.path.iterdir()} == before
