"""The report's per-block checks on one core, on two forked workers and on a Dask cluster of two worker
processes: findings.json identical (less its "created" time), with real processes throughout.

The run (600 ranks × 40 steps with GPU fields, memwatch and comm-bench: tests/scalesynth.py) is one
block on one core and two blocks of 300 ranks on two workers (`memory.blocks.block_size`), so the
comparison also crosses the whole-job pass and the blocked one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests import scalesynth

REPO = Path(__file__).resolve().parents[1]
RANKS, STEPS = 600, 40


def _cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    base.pop("CIUIC_RUN_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "ciuic_doctor", *argv],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**base, **(env or {})},
        timeout=timeout,
    )


def _findings(run: Path) -> bytes:
    """findings.json without its "created" time: the bytes two reports of the same run must share."""
    body = json.loads((run / "findings.json").read_text())
    body.pop("created")
    return json.dumps(body, sort_keys=True).encode()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return scalesynth.generate(tmp_path_factory.mktemp("parallel") / "run", scalesynth.gpu_plan(RANKS, STEPS))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scheduler(log) -> tuple[str, subprocess.Popen]:
    """A real `dask scheduler` on a free port of this machine: (its address, its process)."""
    pytest.importorskip("distributed", reason="Dask distributed is not installed (pip install '.[dask]')")
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "distributed.cli.dask_scheduler",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return f"tcp://127.0.0.1:{port}", subprocess.Popen([*argv, "--no-dashboard"], stdout=log, stderr=log)


def _worker_argv(address: str) -> list[str]:
    return [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1", "--no-dashboard",
            "--memory-limit", "0"]  # fmt: skip


def _wait_for_workers(address: str, count: int) -> None:
    from distributed import Client

    with Client(address, timeout=60, set_as_default=False) as client:
        client.wait_for_workers(count, timeout=120)


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory):
    """A real `dask scheduler` and two one-thread `dask worker` processes on this machine."""
    log = (tmp_path_factory.mktemp("dask") / "dask.log").open("w")
    address, scheduler = _scheduler(log)
    procs = [scheduler, *(subprocess.Popen(_worker_argv(address), stdout=log, stderr=log) for _ in range(2))]
    try:
        _wait_for_workers(address, 2)
        yield address
    finally:
        _stop(procs)


def _stop(procs) -> None:
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def one_core(run) -> bytes:
    """findings.json of the one-core report (less "created")."""
    result = _cli("report", str(run), "--reanalyze", "--quiet", "--jobs", "1")
    assert result.returncode == 0, result.stderr
    return _findings(run)


def _tasks_run(address: str) -> int:
    """Tasks the cluster's workers have finished since they started."""
    from distributed import Client

    def executed(dask_worker) -> int:
        return dask_worker.state.transition_counter

    with Client(address, timeout=30, set_as_default=False) as client:
        return sum(client.run(executed).values())


def test_findings_are_identical_on_one_core_and_two(run, one_core):
    assert b'"memory_leak"' in one_core
    assert b'"fragmentation"' in one_core
    two = _cli("report", str(run), "--reanalyze", "--quiet", "--jobs", "2")
    assert two.returncode == 0, two.stderr
    assert _findings(run) == one_core


def test_findings_are_identical_on_one_core_and_dask(run, one_core, dask_cluster):
    before = _tasks_run(dask_cluster)
    on_dask = _cli("report", str(run), "--reanalyze", "--quiet", "--scheduler", dask_cluster)
    assert on_dask.returncode == 0, on_dask.stderr
    assert _findings(run) == one_core
    assert _tasks_run(dask_cluster) > before  # the blocks did run on the cluster's workers


def test_dask_workers_started_by_srun_on_two_slurm_nodes(run, one_core, slurm_cluster, tmp_path):
    """`srun -N 2 dask worker ADDRESS` in the test Slurm: a worker on each node runs the blocks, and the
    findings are one core's."""
    from distributed import Client

    log = (tmp_path / "dask.log").open("w")
    address, scheduler = _scheduler(log)
    step = slurm_cluster.popen("srun", "-N", "2", "-n", "2", *_worker_argv(address), cwd=tmp_path)
    try:
        _wait_for_workers(address, 2)
        with Client(address, timeout=30, set_as_default=False) as client:
            nodes = client.run(lambda: os.environ.get("SLURMD_NODENAME"))
        assert sorted(nodes.values()) == ["n1", "n2"]
        result = _cli("report", str(run), "--reanalyze", "--quiet", "--scheduler", address)
        assert result.returncode == 0, result.stderr
        assert _findings(run) == one_core
    finally:
        _stop([scheduler, step])


def test_forked_workers_share_the_parent_memory_and_run_in_other_processes():
    """Two forked workers run the blocks (their PIDs are not this one's), read an object that cannot
    be pickled (a lock: inherited, never sent) and return results in item order; one block, one
    core or a nested job runs here."""
    from ciuic_doctor.parallel import map_blocks, using

    lock = threading.Lock()  # pickle refuses it: only a fork can hand it to a worker
    parent = os.getpid()

    def work(i: int) -> tuple[int, int, bool]:
        time.sleep(0.2)  # the workers overlap: each takes blocks
        return i * i, os.getpid(), lock.locked()

    with using(jobs=2):
        out = map_blocks(work, list(range(6)))
        assert [r[0] for r in out] == [i * i for i in range(6)]
        pids = {r[1] for r in out}
        assert parent not in pids
        assert len(pids) == 2
        assert map_blocks(work, [3])[0][1] == parent  # one block: nothing to share
        nested = map_blocks(lambda i: map_blocks(lambda j: os.getpid(), [0, 1]), [0, 1])
        assert all(len(set(pids)) == 1 for pids in nested)  # inside a worker: serial
    with using(jobs=1):
        assert {r[1] for r in map_blocks(work, list(range(3)))} == {parent}


def _worker_pid(block: object) -> int:
    return os.getpid()


def _pid_once_both_work(item: tuple[str, int]) -> int:
    """This worker's PID, once two workers have each taken an item (a worker waits here, so the other must
    take one): which workers ran a job is then not up to the scheduling of a loaded machine."""
    folder = Path(item[0])
    (folder / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(list(folder.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()


def _as_given(owner: object, item: object) -> object:
    return item


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Owner:
    """What an owner pool's workers inherit (a weak reference can point at it)."""


def test_an_owners_jobs_share_workers_forked_once_and_its_end_stops_them():
    """Jobs with the same owner (the memory analysis's five passes over one `_Data`) run in the same
    two forked workers; when the owner goes, so do they."""
    import gc

    from ciuic_doctor.parallel import Remote, forked, map_blocks, using

    owner = _Owner()
    remote = Remote(apply=_pid_once_both_work, payload=lambda item: item, owner=owner, local=_as_given)
    with using(jobs=2), tempfile.TemporaryDirectory() as one, tempfile.TemporaryDirectory() as two:
        first = set(map_blocks(_pid_once_both_work, [(one, i) for i in range(4)], remote=remote))
        second = set(map_blocks(_pid_once_both_work, [(two, i) for i in range(4)], remote=remote))
        assert os.getpid() not in first
        assert first == second
        assert len(first) <= 2
        pool = forked._POOLS[owner][0]
        workers = list(pool._processes.values())
        del owner, remote
        gc.collect()
        # asked of the system, not of `Process.is_alive`: the pool's own thread reaps its workers, and a
        # second waitpid of one it reaped leaves the Process object saying "alive" for ever
        deadline = time.monotonic() + 30
        while any(_running(w.pid) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(w.pid) for w in workers)


def test_a_scheduler_that_does_not_answer_is_one_line(run):
    closed = f"tcp://127.0.0.1:{_free_port()}"
    for address in (closed, "nonsense://here:1"):
        result = _cli("report", str(run), "--scheduler", address, timeout=120)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert f"--scheduler {address}" in lines[0], lines


def test_scheduler_without_distributed_says_what_to_install(run, tmp_path):
    """An interpreter where `import distributed` fails (a package that raises ImportError first on
    the path): one line naming the extra, exit 2; the default path never imports it."""
    fake = tmp_path / "site" / "distributed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('distributed is not installed')\n")
    env = {"PYTHONPATH": f"{fake.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = _cli("report", str(run), "--scheduler", "tcp://127.0.0.1:8786", env=env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ciuic-doctor report: error: --scheduler needs Dask distributed: pip install 'ciuic-doctor[dask]'"
    ]


def test_usable_cores_follow_a_cgroup_quota(tmp_path):
    from ciuic_doctor.parallel.cores import _v1_quota, _v2_quota, usable_cores

    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert _v2_quota(tmp_path / "cpu.max") == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _v2_quota(tmp_path / "cpu.max") is None
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert _v1_quota(tmp_path) is None
    (tmp_path / "cpu.cfs_quota_us").write_text("300000\n")
    assert _v1_quota(tmp_path) == 3.0
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))


# evaluated on the workers (a builtin and a string travel; this test module is not importable there)
ALLOCATOR_SET = "bool(__import__('ciuic_doctor.parallel.on_dask', fromlist=['_'])._ALLOCATOR)"
PANDAS_LOADED = "'pandas' in __import__('sys').modules"


def _on_workers(client, expression: str) -> list:
    return list(client.run(eval, expression).values())


def test_workers_are_warmed_up_as_the_report_connects(tmp_path):
    """A fresh worker has run nothing; once a report's session connects it is warmed up (allocator set,
    numpy and pandas imported) before any block is sent."""
    from distributed import Client

    from ciuic_doctor.parallel.on_dask import DaskSession

    log = (tmp_path / "dask.log").open("w")
    address, scheduler = _scheduler(log)
    worker = subprocess.Popen(_worker_argv(address), stdout=log, stderr=log)
    try:
        _wait_for_workers(address, 1)
        with Client(address, timeout=30, set_as_default=False) as client:
            assert _on_workers(client, ALLOCATOR_SET) == [False]
            session = DaskSession(address)
            try:
                deadline = time.monotonic() + 60
                while _on_workers(client, ALLOCATOR_SET) != [True] and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert _on_workers(client, ALLOCATOR_SET) == [True]
                assert _on_workers(client, PANDAS_LOADED) == [True]
            finally:
                session.close()
    finally:
        _stop([scheduler, worker])
