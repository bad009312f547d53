"""Shared fixtures: run the real CLI in a real subprocess, the way a user or torchrun would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The Ctrl-C tests send SIGINT to the commands they start, as a terminal would. A suite started from a
# non-interactive shell's background job (`make test &`, a CI runner) inherits SIGINT *ignored*; an ignored
# signal stays ignored across exec, and Python then installs no KeyboardInterrupt handler, so the command
# rightly keeps ignoring it (nohup semantics) and the test times out. A Python-level handler here is reset
# to the default on exec, so every process a test starts gets the terminal's SIGINT again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str


def _run(argv: list[str], *, timeout: float, env: dict[str, str], cwd: Path | None = None) -> Completed:
    """Run `argv` to the end; past `timeout`, kill it *and every descendant* and fail with its output.

    subprocess.run's timeout kills only the launcher: its ranks and their DataLoader workers would live
    on, orphaned, and slow or break every later test.
    """
    import psutil

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [proc]
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += psutil.Process(proc.pid).children(recursive=True)
        for member in tree:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                member.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout} s: {' '.join(argv)}\nstdout:\n{stdout}\nstderr:\n{stderr}"
        ) from None
    return Completed(proc.returncode, stdout, stderr)


def run_cli(
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = False,
) -> Completed:
    """`python -m ciuic_doctor <args>` in a fresh process; returns code and output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("CIUIC_RUN_DIR", None)
    result = _run([sys.executable, "-m", "ciuic_doctor", *args], timeout=timeout, env=full_env, cwd=cwd)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def torchrun(
    *args: str, nproc: int = 2, timeout: float = 180, env: dict[str, str] | None = None
) -> Completed:
    """`torchrun --standalone --nproc-per-node N -m ciuic_doctor <args>` as a user would type it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("CIUIC_RUN_DIR", None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return _run([*argv, "-m", "ciuic_doctor", *args], timeout=timeout, env=full_env)


@pytest.fixture
def sleeper():
    """A real child process that idles (up to 120 s) until the test ends; it is killed afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    proc.stdout.readline()
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def run_path(tmp_path: Path) -> Path:
    """A not-yet-existing run directory path inside the test's temp dir."""
    return tmp_path / "run"


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real two-node Slurm (tests/slurm_cluster.py: slurmctld, slurmd n1 and n2, partition p), one per
    session (worker), up in about a second. Skipped, with the daemons' log tail, where Slurm cannot run.
    """
    from tests.slurm_cluster import ClusterUnavailable, processes_of, start_cluster, stop_cluster

    try:
        cluster = start_cluster()
    except ClusterUnavailable as error:
        pytest.skip(f"no test Slurm cluster: {error}")
    yield cluster
    stop_cluster(cluster)
    left = processes_of(cluster.root)
    assert not left, f"the test Slurm cluster left processes running: {left}"


# `make test` runs the suite on 2 workers (pytest-xdist, --dist loadfile: a file's tests stay on one
# worker, so a module's shared job runs once). A long file handed out last leaves the other worker idle
# for minutes (measured: an 8-minute tail of one worker, test_stability_job.py alone). So the files that
# took longest go first: seconds per file (the sum of its tests in the slowest 60) on 2 workers at load
# ~20, 2026-12-05, stability_job after its batch was cut. A stale list only costs time, never a result.
LONGEST_FIRST = (
    "test_verify.py",  # 442 s
    "test_slurm_nodes.py",  # 405 s (checkup, verify and comm-bench on the two-node Slurm)
    "test_checkup.py",  # 341 s
    "test_parallel_report.py",  # whole reports on one core, two, Dask and Dask on the test Slurm
    "test_watch_frameworks.py",  # 274 s
    "test_job.py",  # 238 s
    "test_healthy_jobs.py",  # 235 s
    "test_stability_job.py",  # 178 s
    "test_moe.py",  # 149 s
    "test_compare.py",  # 145 s
    "test_fuzz_records.py",  # 144 s
    "test_observed_frameworks.py",  # 122 s
    "test_checkup_script.py",  # 113 s
    "test_watch_patterns.py",  # 113 s
    "test_hang.py",  # 77 s in its slowest two; 17 tests
    "test_columnar_copy.py",  # reports of a 2,100-rank run's copy
    "test_live_waits.py",  # a torchrun job with a stuck rank
    "test_comm_bench.py",  # 18 tests of torchrun
    "test_checkpoint_check.py",
    "test_hardening_processes.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # xdist (3.x) sorts the files by their number of tests unless told not to, which put the one-test
    # test_stability_job.py last whatever the order below: keep the collection order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order is kept
