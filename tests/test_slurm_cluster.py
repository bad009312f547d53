"""The test Slurm cluster (tests/slurm_cluster.py) is a real one: two nodes, srun/sbatch/squeue/scancel work,
and stopping it leaves nothing of it running."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tests import slurm_cluster as cluster_module
from tests.slurm_cluster import (
    ClusterUnavailable,
    SlurmCluster,
    client_env,
    processes_of,
    start_cluster,
    stop_cluster,
)

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout_s: float = 30, every_s: float = 0.1) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def ok(answer: subprocess.CompletedProcess[str]) -> str:
    assert answer.returncode == 0, f"exit {answer.returncode}\n{answer.stdout}\n{answer.stderr}"
    return answer.stdout


def job_id_named(cluster: SlurmCluster, name: str) -> str:
    return ok(cluster.run("squeue", "-h", "-n", name, "-o", "%i")).strip()


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""  # ended meanwhile


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sinfo_shows_both_nodes_idle(slurm_cluster: SlurmCluster) -> None:
    wait_for("both nodes idle", lambda: slurm_cluster.node_states() == {"n1": "idle", "n2": "idle"}, 10)
    lines = ok(slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %P %t %c")).split("\n")
    assert sorted(filter(None, lines)) == ["n1 p* idle 1", "n2 p* idle 1"]
    assert slurm_cluster.partition == "p"
    assert slurm_cluster.nodes == ("n1", "n2")


def test_srun_puts_one_task_on_each_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = ok(
        slurm_cluster.run(
            "srun", "-N", "2", "-n", "2", "bash", "-c", "echo $SLURM_NODEID $SLURMD_NODENAME", cwd=tmp_path
        )
    )
    assert sorted(out.splitlines()) == ["0 n1", "1 n2"]


def test_sbatch_wait_runs_a_two_node_batch_script(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=2 --ntasks-per-node=1 --output=out-%j.txt\n"
        'echo "batch on $SLURMD_NODENAME nodes=$SLURM_JOB_NUM_NODES list=$SLURM_JOB_NODELIST'
        ' partition=$SLURM_JOB_PARTITION"\n'
        "srun bash -c 'echo task $SLURM_PROCID node $SLURM_NODEID on $SLURMD_NODENAME'\n"
    )
    answer = slurm_cluster.run("sbatch", "--wait", "--parsable", str(script), cwd=tmp_path, timeout=60)
    job = ok(answer).strip().split(";")[0]
    assert job.isdigit(), answer.stdout
    lines = (tmp_path / f"out-{job}.txt").read_text().splitlines()
    assert lines[0] == "batch on n1 nodes=2 list=n[1-2] partition=p"
    assert sorted(lines[1:]) == ["task 0 node 0 on n1", "task 1 node 1 on n2"]


def test_sbatch_wait_exits_with_the_jobs_exit_code(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "fails.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2 --output=/dev/null\nexit 3\n")
    answer = slurm_cluster.run("sbatch", "--wait", str(script), cwd=tmp_path, timeout=60)
    assert answer.returncode == 3, answer


def test_a_running_step_shows_in_squeue_and_scancel_ends_it(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    srun = slurm_cluster.popen(
        "srun", "-N", "2", "-n", "2", "--job-name=ciuic-sleeper", "sleep", "300", cwd=tmp_path
    )
    try:
        job = wait_for("the job", lambda: job_id_named(slurm_cluster, "ciuic-sleeper"))
        step = wait_for(
            "its step in squeue --steps",
            lambda: ok(slurm_cluster.run("squeue", "-h", "--steps", "-j", job, "-o", "%i %N")).strip(),
        )
        assert step == f"{job}.0 n[1-2]"

        # The tasks are real processes, under a slurmstepd per node.
        def sleep_tasks() -> list[int]:
            return [
                pid
                for pid in processes_of(slurm_cluster.root, name="slurmstepd")
                if command_name(pid) == "sleep"
            ]

        tasks = wait_for("both sleep tasks", lambda: len(found := sleep_tasks()) == 2 and found)

        began = time.monotonic()
        ok(slurm_cluster.run("scancel", job))
        wait_for(
            "the step to leave squeue",
            lambda: not ok(slurm_cluster.run("squeue", "-h", "--steps", "-j", job, "-o", "%i")).strip(),
            timeout_s=10,
        )
        wait_for("srun to end", lambda: srun.poll() is not None, timeout_s=10 - (time.monotonic() - began))
        assert time.monotonic() - began < 10
        wait_for("the tasks to end", lambda: not any(map(alive, tasks)), timeout_s=5)
        assert srun.returncode != 0
        assert "CANCELLED" in srun.stderr.read()
    finally:
        if srun.poll() is None:
            srun.kill()
        srun.wait()


def test_stop_cluster_leaves_nothing_of_its_own_running(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """On a second, short-lived cluster (it starts in about a second): a step still running when it stops
    is cancelled, every daemon is gone, and the session's cluster is untouched."""
    try:
        other = start_cluster()
    except ClusterUnavailable as error:
        pytest.fail(f"the session's cluster started, a second one did not: {error}")
    srun = other.popen("srun", "-N", "2", "-n", "2", "--job-name=left-over", "sleep", "300", cwd=tmp_path)
    try:
        assert other.ctld_port != slurm_cluster.ctld_port
        wait_for("the left-over step", lambda: job_id_named(other, "left-over") and len(processes_of(
            other.root, name="slurmstepd")) >= 4)  # fmt: skip
        ours = processes_of(other.root)
        daemons = {name: proc.pid for name, proc in other.processes.items()}
        assert set(daemons) == {"munged", "slurmctld", "slurmd.n1", "slurmd.n2"}
        assert set(daemons.values()) <= set(ours)
        assert len(ours) >= 4 + 4  # the daemons, and a slurmstepd and a sleep per node
    finally:
        began = time.monotonic()
        stop_cluster(other)
        stopped_s = time.monotonic() - began
        srun.wait(timeout=10)
    assert stopped_s < 15
    assert not other.root.exists()
    assert processes_of(other.root) == []
    assert not [pid for pid in ours if alive(pid)]
    assert all(proc.returncode is not None for proc in other.processes.values())
    assert slurm_cluster.node_states() == {"n1": "idle", "n2": "idle"}


def test_a_daemon_that_cannot_start_gives_its_log_tail_and_leaves_nothing(
    slurm_cluster: SlurmCluster,
) -> None:
    """What the fixture's skip reason is made of: one line naming the daemon and what its log says."""
    with pytest.raises(ClusterUnavailable) as failed:
        start_cluster(timeout_s=20, extra_conf="NoSuchSlurmKey=1\n")
    reason = str(failed.value)
    assert "\n" not in reason
    assert "slurmctld exited" in reason, reason
    assert "NoSuchSlurmKey" in reason, reason
    assert failed.value.root is not None
    assert not failed.value.root.exists()
    assert processes_of(failed.value.root) == []


def test_a_port_taken_before_its_daemon_binds_it_is_retried_with_others(
    slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ports are chosen free, but something may bind one before the daemon does: start again, elsewhere."""
    real, chosen = cluster_module.free_ports, []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()

        def first_one_taken(count: int) -> list[int]:
            ports = real(count)
            if not chosen:
                ports[1] = taken.getsockname()[1]  # n1's slurmd port: it gives up at once
            chosen.append(ports)
            return ports

        monkeypatch.setattr(cluster_module, "free_ports", first_one_taken)
        other = start_cluster()
        try:
            assert len(chosen) == 2
            assert other.node_ports["n1"] == chosen[1][1] != taken.getsockname()[1]
            assert other.node_states() == {"n1": "idle", "n2": "idle"}
        finally:
            stop_cluster(other)


def test_client_env_drops_an_enclosing_jobs_slurm_settings(tmp_path: Path) -> None:
    """A suite run inside a Slurm job must not send its test jobs to that job's cluster."""
    env = client_env(
        tmp_path / "slurm.conf",
        {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "77", "SLURM_CONF": "/etc/slurm/slurm.conf",
         "SBATCH_PARTITION": "gpu", "SLURMD_NODENAME": "gnode1"},
    )  # fmt: skip
    assert env == {"PATH": os.environ["PATH"], "SLURM_CONF": str(tmp_path / "slurm.conf")}
