"""Hangs, interrupts and orphans with real ranks (issue 11): a SIGSTOPped rank ends comm-bench and the
job within the timeout plus seconds, named as not responding with its host; Ctrl-C exits 130 without a
traceback; the ranks (and their DataLoader workers) die with a launcher killed by SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

TIMEOUT_S = 3  # comm-bench's process-group timeout here: the hang must be named within it + 10 s
# The job's: its ranks build the model and start DataLoader workers at different speeds on a loaded
# machine, and DDP's first broadcast waits for the slower one within this timeout.
JOB_TIMEOUT_S = 10
HOST = socket.gethostname()
QUICK = ("-b", "1K", "-e", "16K", "-f", "4", "--iters", "3", "--warmup", "1")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    return env


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_env(), **(env or {})},
        start_new_session=True,  # its own process group: Ctrl-C goes to it alone, as from a terminal
    )


def _wait_for_lines(path: Path, count: int, proc: subprocess.Popen, limit_s: float = 150) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().count("\n") >= count:
            return
        if proc.poll() is not None:
            raise AssertionError(f"ended early ({proc.returncode}): {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    _kill_group(proc)
    raise AssertionError(f"{path} never had {count} lines")


def _kill_group(proc: subprocess.Popen) -> None:
    with_children = [proc.pid]
    with contextlib.suppress(psutil.Error):
        with_children += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    for pid in with_children:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _finish(proc: subprocess.Popen, limit_s: float = 120) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        _, err = proc.communicate()
        raise AssertionError(f"still running after {limit_s} s:\n{err[-3000:]}") from None


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
def test_sigstopped_rank_ends_comm_bench_within_the_timeout(tmp_path):
    """The `stop` hook SIGSTOPs rank 1 itself, heartbeat thread and all, before its 4 KiB row."""
    out = tmp_path / "run"
    proc = _start(
        "comm-bench", "--nproc", "2", *QUICK, "--collectives", "all_reduce", "--timeout", str(TIMEOUT_S),
        "--out", str(out), env={"CIUIC_COMM_FAULT": "1:4096:stop"},
    )  # fmt: skip
    _, err = _finish(proc)
    ended = time.time()
    assert proc.returncode == 1, err[-2000:]
    assert f"rank 1 on {HOST} is not responding during all_reduce 4K" in err
    assert "stopped (SIGSTOP)" in err
    assert "died" not in err.splitlines()[-1]
    assert "Traceback" not in err
    rows = [json.loads(line) for line in (out / "comm.jsonl").read_text().splitlines()]
    stopped_after = max(r["t"] for r in rows)  # the last row finished before rank 1 froze
    assert ended - stopped_after < TIMEOUT_S + 10, f"took {ended - stopped_after:.1f} s after the hang"
    meta = json.loads((out / "meta.json").read_text())
    assert "not responding" in meta["probes"]["comm-bench"]["message"]


@pytest.mark.slow
def test_sigstopped_rank_ends_the_job_within_the_timeout_and_leaves_no_orphans(tmp_path):
    """`kill -STOP` of job rank 1 from outside, mid-training, DataLoader workers running."""
    out = tmp_path / "run"
    proc = _start(
        "job", "--nproc", "2", "--steps", "400", "--out", str(out),
        "--set", f"distributed.timeout_s={JOB_TIMEOUT_S}", "--set", "checkpoint.every_steps=0",
    )  # fmt: skip
    _wait_for_lines(out / "steps.rank1.jsonl", 3, proc)
    tree = psutil.Process(proc.pid).children(recursive=True)
    rank1 = next(p for p in tree if p.environ().get("RANK") == "1" and p.ppid() == proc.pid)
    rank1.suspend()
    stopped = time.time()
    _, err = _finish(proc)
    took = time.time() - stopped
    assert proc.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("ciuic-doctor job: FAILED: rank 1 on "), last
    assert f"rank 1 on {HOST} is not responding" in last
    assert "killed by signal" not in last
    assert "Traceback" not in err
    assert took < JOB_TIMEOUT_S + 10, f"took {took:.1f} s after SIGSTOP"
    meta = json.loads((out / "meta.json").read_text())
    assert "not responding" in meta["probes"]["job"]["message"]
    time.sleep(2)
    assert _alive(tree) == []  # the frozen rank, its forkserver and DataLoader workers: all gone


@pytest.mark.slow
def test_ctrl_c_on_comm_bench_exits_130_without_a_traceback(tmp_path):
    out = tmp_path / "run"
    proc = _start("comm-bench", "--nproc", "2", "-e", "64M", "--time-budget", "1", "--out", str(out))
    _wait_for_lines(out / "comm.jsonl", 2, proc)
    kept = (out / "comm.jsonl").read_text().count("\n")
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, err = _finish(proc, limit_s=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert "SignalException" not in err
    assert "interrupted; every record measured so far is kept" in err
    assert (out / "comm.jsonl").read_text().count("\n") >= kept


@pytest.mark.slow
def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path):
    out = tmp_path / "run"
    proc = _start("comm-bench", "--nproc", "2", "-e", "64M", "--time-budget", "1", "--out", str(out))
    _wait_for_lines(out / "comm.jsonl", 2, proc)
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 2
    proc.kill()
    _finish(proc, limit_s=30)
    deadline = time.monotonic() + 20
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _alive(tree) == [], "ranks lived on after their launcher was killed"
