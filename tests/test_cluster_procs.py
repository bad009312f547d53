"""A job step's processes on a node, found from outside by their environment (cluster/procs.py): what
checkup's per-node memwatch and `hang --pid` rely on. Real processes; no Slurm needed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ciuic_doctor.cluster import STEP_NAME_ENV
from ciuic_doctor.cluster.procs import node_of, step_roots, wait_for_step


def _task(node: str, name: str, job: str = "77") -> subprocess.Popen[bytes]:
    """A 'task' as slurmstepd starts it: the step's variables, and a child below it (a rank)."""
    env = {
        **os.environ,
        STEP_NAME_ENV: name,
        "SLURM_STEP_ID": "3",
        "SLURM_JOB_ID": job,
        "SLURMD_NODENAME": node,
    }
    child = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    return subprocess.Popen([sys.executable, "-c", child], env=env)


def test_each_node_finds_only_its_own_task_of_the_step(monkeypatch) -> None:
    name = f"ciuic-job-test{os.getpid()}"
    n1, n2 = _task("n1", name), _task("n2", name)
    other = _task("n1", name, job="78")  # another allocation's step of the same name
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        monkeypatch.setenv("SLURMD_NODENAME", "n1")
        assert wait_for_step(name, timeout_s=30) == n1.pid
        time.sleep(1.0)  # the child (a rank) has started by now: still only the top process
        assert step_roots(name) == [n1.pid]
        assert step_roots(name, node="n2") == [n2.pid]
        assert node_of(n2.pid) == "n2"
        assert step_roots("ciuic-job-none") == []
    finally:
        import psutil

        for proc in (n1, n2, other):
            for child in psutil.Process(proc.pid).children():
                child.kill()
            proc.kill()
            proc.wait()
