"""checkup, comm-bench and verify across the nodes of a real two-node Slurm allocation
(tests/slurm_cluster.py: slurmctld and slurmd n1, n2 on this machine, CPUs=1 each). Both nodes share one
host name here, so a rank's node must come from Slurm (SLURMD_NODENAME), never from the host name.

Kept small: 1 rank per node, a few steps, small sizes; the whole file runs in a few minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster

CLI = [sys.executable, "-m", "ciuic_doctor"]
DDP = Path(__file__).parent / "data" / "user_scripts" / "ddp_train.py"


def in_allocation(cluster: SlurmCluster, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`salloc -N 2 <argv>`: the command runs here with SLURM_JOB_ID set, as a user's would."""
    done = cluster.run("salloc", "-N", "2", "--job-name=ciuic-test", *argv, timeout=timeout)
    print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
    return done


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def our_steps(cluster: SlurmCluster, prefix: str) -> list[str]:
    """Running steps whose name starts with `prefix` ("JOB.STEP name" lines)."""
    out = cluster.run("squeue", "-h", "--steps", "-o", "%i %j", timeout=20).stdout
    return [line for line in out.splitlines() if line.split(" ", 1)[-1].startswith(prefix)]


def test_comm_bench_spans_both_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run = tmp_path / "cb"
    argv = [*CLI, "comm-bench", "-b", "1K", "-e", "16K", "-f", "4", "--collectives", "all_reduce,all_gather"]
    done = in_allocation(slurm_cluster, [*argv, "--time-budget", "0.01", "--out", str(run)], timeout=300)
    assert done.returncode == 0
    # torchrun's c10d rendezvous numbers the nodes in the order they join: rank 0 may be on n2
    assert "2 ranks on 2 nodes (n1, n2)" in done.stdout or "2 ranks on 2 nodes (n2, n1)" in done.stdout
    entry = json.loads((run / "meta.json").read_text())["probes"]["comm-bench"]
    assert entry["status"] == "ok"
    assert entry["world_size"] == 2
    assert sorted((n["node"], n["node_index"], n["hostname"]) for n in entry["nodes"]) == [
        ("n1", 0, socket.gethostname()),
        ("n2", 1, socket.gethostname()),
    ]
    assert sorted(n["rank"] for n in entry["nodes"]) == [0, 1]
    assert len({n["job_id"] for n in entry["nodes"]}) == 1  # one step of one allocation
    rows = [r for r in records(run / "comm.jsonl") if r.get("busbw_gbps") is not None]
    assert {r["collective"] for r in rows} == {"all_reduce", "all_gather"}
    assert len(rows) >= 6
    assert not list(tmp_path.glob("comm-bench*")), "one run directory, not one per node"
    report = subprocess.run(
        [*CLI, "report", str(run)], capture_output=True, text=True, timeout=300, check=False
    )
    assert report.returncode == 0, report.stderr
    html = (run / "report.html").read_text()
    assert "2 ranks on 2 nodes: n1 (rank " in html
    assert "; n2 (rank " in html


def test_checkup_runs_every_phase_on_the_allocation(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run = tmp_path / "ck"
    # every phase, checkpoint-check too (it runs on this node alone, as without Slurm: ~11 s on a quiet
    # machine, 61 s for the whole checkup; at load 15 on 2 cores it can pass its 180 s phase limit)
    argv = [*CLI, "checkup", "--nproc", "1", "--steps", "3", "--loader-budget", "2", "--out", str(run)]
    done = in_allocation(slurm_cluster, argv, timeout=900)
    assert done.returncode == 0
    meta = json.loads((run / "meta.json").read_text())
    phases = {p["name"]: p["status"] for p in meta["checkup"]["phases"]}
    every = ("comm-bench", "loader-sweep", "job", "memwatch", "checkpoint-check", "report")
    assert phases == dict.fromkeys(every, "ok"), phases
    # memwatch once per node, each into its own file: never two nodes appending to one
    files = sorted(p.name for p in run.glob("memwatch.*jsonl"))
    assert files == ["memwatch.rank0.jsonl", "memwatch.rank1.jsonl"]
    assert [{r["host"] for r in records(run / f)} for f in files] == [{"n1"}, {"n2"}]
    assert set(meta["memwatch_nodes"]) == {"n1", "n2"}
    steps = {r["host"] for f in run.glob("steps.rank*.jsonl") for r in records(f)}
    assert steps == {"n1", "n2"}
    assert sorted(n["node"] for n in meta["probes"]["comm-bench"]["nodes"]) == ["n1", "n2"]
    html = (run / "report.html").read_text()
    assert "n1" in html
    assert "n2" in html


@pytest.fixture(scope="module")
def two_node_watched_run(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ddp_train.py under watch, one torchrun per node started by srun, as a user runs it on Slurm."""
    run = tmp_path_factory.mktemp("slurm-verify") / "watched"
    script = (
        'addr=$(scontrol show node "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)" -o '
        "| tr ' ' '\\n' | sed -n 's/^NodeAddr=//p'); "
        f"srun --ntasks-per-node=1 {sys.executable} -m torch.distributed.run --nnodes 2 --nproc-per-node 1 "
        '--rdzv-backend c10d --rdzv-endpoint "$addr:$PORT" --rdzv-id "$SLURM_JOB_ID" '
        f"-m ciuic_doctor watch --steps 4 --out {run} -- {DDP}"
    )
    from ciuic_doctor.cluster.spread import free_port

    slurm_cluster.env["PORT"] = str(free_port())
    done = in_allocation(slurm_cluster, ["bash", "-c", script], timeout=300)
    assert done.returncode == 0
    return run


def test_verify_runs_a_and_b_as_steps_and_sigterm_cancels_them(
    slurm_cluster: SlurmCluster, two_node_watched_run: Path
) -> None:
    meta = json.loads((two_node_watched_run / "meta.json").read_text())
    assert meta["observed"]["job"]["nodes"] == 2
    assert meta["probes"]["watch"]["slurm"]["node"] in ("n1", "n2")  # rank 0's
    alloc = slurm_cluster.run("salloc", "-N", "2", "--no-shell", "--job-name=ciuic-verify-test", timeout=60)
    job_id = alloc.stderr.split("Granted job allocation")[1].split()[0]
    env = {**slurm_cluster.env, "SLURM_JOB_ID": job_id}  # as inside `salloc -N 2`
    verify = [*CLI, "verify", str(two_node_watched_run), "--verify-steps", "2", "--max-rounds", "1"]
    verify += ["--budget", "600", "--try", "dataloader.num_workers=0"]
    try:
        proc = subprocess.Popen(verify, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen: set[str] = set()
        while proc.poll() is None:  # every A and B run is a step of the allocation while it runs
            seen.update(line.split()[1] for line in our_steps(slurm_cluster, "ciuic-verify-"))
            time.sleep(0.3)
        out = proc.stdout.read()
        print(out)
        assert proc.returncode == 0
        assert any("-r01-A-" in name for name in seen), seen
        assert any("-r01-c1-" in name for name in seen), seen  # candidate c1, the --try
        data = json.loads((two_node_watched_run / "verification.json").read_text())
        assert [r["side"] for r in data["runs"]] == ["A", "c1"]
        assert data["candidates"][0]["status"] in data["statuses"]
        for run in data["runs"]:  # both runs spanned both nodes
            hosts = {r["host"] for f in Path(run["path"]).glob("steps.rank*.jsonl") for r in records(f)}
            assert hosts == {"n1", "n2"}, (run["side"], hosts)

        # SIGTERM while a run is on: its step is cancelled; nothing of verify stays in squeue
        proc = subprocess.Popen(verify, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 240
        while not our_steps(slurm_cluster, "ciuic-verify-") and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        assert our_steps(slurm_cluster, "ciuic-verify-"), "no verify step appeared"
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while our_steps(slurm_cluster, "ciuic-verify-") and time.monotonic() - sent < 10:
            time.sleep(0.2)
        left = our_steps(slurm_cluster, "ciuic-verify-")
        gone_s = time.monotonic() - sent
        assert not left, f"still in squeue {gone_s:.1f} s after SIGTERM: {left}"
        print(f"verify's steps gone from squeue {gone_s:.1f} s after SIGTERM")
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert "cancelled" in proc.stdout.read()
    finally:
        slurm_cluster.run("scancel", job_id, timeout=30)


def test_top_on_a_node_sees_that_nodes_ranks_and_names_it(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Both nodes' torchrun agents run on this one host with one run id; top --pid of n2's agent finds
    rank 1 only, and says n2."""
    from ciuic_doctor.cluster.procs import environ
    from ciuic_doctor.cluster.spread import free_port

    script = tmp_path / "idle.py"
    script.write_text(
        "import time, torch.distributed as dist\ndist.init_process_group('gloo')\ntime.sleep(300)\n"
    )
    line = (
        f"srun --ntasks-per-node=1 {sys.executable} -m torch.distributed.run --nnodes 2 --nproc-per-node 1 "
        f'--rdzv-backend c10d --rdzv-endpoint localhost:{free_port()} --rdzv-id "$SLURM_JOB_ID" {script}'
    )
    job = slurm_cluster.popen("salloc", "-N", "2", "--job-name=ciuic-top-test", "bash", "-c", line)
    try:
        agents: dict[str, int] = {}
        deadline = time.monotonic() + 180
        while len(agents) < 2 or not all(_has_rank_child(pid) for pid in agents.values()):
            assert time.monotonic() < deadline, "the two agents and their ranks did not start"
            assert job.poll() is None, job.communicate()
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    env = environ(int(entry.name))
                    args = _cmdline(int(entry.name))
                    if str(script) in args and "torch.distributed.run" in args and "SLURMD_NODENAME" in env:
                        agents[env["SLURMD_NODENAME"]] = int(entry.name)
            time.sleep(0.5)
        top = subprocess.run(
            [*CLI, "top", "--pid", str(agents["n2"]), "--once"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        print(top.stdout, top.stderr)
        assert top.returncode == 0
        assert "hosts n2" in top.stdout
        assert "n1" not in top.stdout.split("hosts", 1)[1].splitlines()[0]
        rows = [row.split() for row in top.stdout.splitlines() if row.strip()[:1].isdigit()]
        assert len(rows) == 1, top.stdout  # n2's rank only, though n1's agent shares host and run id
        assert environ(int(rows[0][1]))["SLURMD_NODENAME"] == "n2"  # (c10d may give n2 rank 0 or 1)
    finally:
        job.terminate()
        job.communicate(timeout=60)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _has_rank_child(pid: int) -> bool:
    """A worker (RANK in its environment) runs below the agent."""
    from ciuic_doctor.cluster.procs import environ

    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid and "RANK" in environ(int(entry.name)):
                return True
    return False


def test_a_batch_job_per_run_from_a_login_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """No allocation here: Spread queues `sbatch --wait` with the options passed through, torchrun on
    both nodes of the batch job's own allocation; the queue is counted apart; SIGTERM cancels the job."""
    from ciuic_doctor.cluster.base import BatchOptions
    from ciuic_doctor.cluster.slurm import Slurm
    from ciuic_doctor.cluster.spread import Cancelled, Spread

    script = tmp_path / "where.py"
    script.write_text(
        "import os, sys, time\n"
        "print('rank', os.environ['RANK'], 'on', os.environ['SLURMD_NODENAME'], flush=True)\n"
        "time.sleep(float(sys.argv[1]))\n"
    )
    slurm = Slurm(env=slurm_cluster.env)
    assert slurm.allocation() is None  # a login node
    batch = BatchOptions(nodes=2, partition=slurm_cluster.partition, time="5")
    spread = Spread(scheduler=slurm, alloc=None, nnodes=2, nproc_per_node=1, batch=batch)
    name = spread.new_name("batch-test")
    log = (tmp_path / "out.log").open("w+")
    result = spread.run(
        [str(script), "0"], name=name, env=slurm_cluster.env, log=log, timeout_s=120, batch_dir=tmp_path
    )
    assert result.exit_code == 0, (tmp_path / f"{name}.log").read_text()
    said = (tmp_path / f"{name}.log").read_text()
    assert "on n1" in said
    assert "on n2" in said
    assert result.run_s > 0
    assert result.queue_s >= 0

    # SIGTERM while the job runs: scancel, and nothing of it left in squeue
    def term_soon() -> None:
        deadline = time.monotonic() + 120
        while not slurm.running_since(name2):
            if time.monotonic() > deadline:
                return  # never started: the run below ends by itself, and the test fails
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)  # Spread.wait turns it into Cancelled while the job runs

    import threading

    name2 = spread.new_name("batch-test")
    threading.Thread(target=term_soon, daemon=True).start()
    sent = time.monotonic()
    with pytest.raises(Cancelled) as stopped:
        spread.run([str(script), "60"], name=name2, env=slurm_cluster.env, log=log, timeout_s=120,
                   batch_dir=tmp_path)  # fmt: skip
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    left = slurm_cluster.run("squeue", "-h", "-n", name2, "-o", "%i %T", timeout=20).stdout.strip()
    assert not left, f"still queued {time.monotonic() - sent:.1f} s after SIGTERM: {left}"


def test_a_batch_job_cancels_itself_when_the_process_waiting_for_it_is_killed_with_9(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """sbatch --wait does not cancel its job when killed, and kill -9 of verify runs no code of ours: the
    job's own watchdog sees the heartbeat file stop changing and cancels the job (STALE_S, 6 s here)."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(300)\n")
    starter = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from ciuic_doctor.cluster import spread as sp\n"
        "from ciuic_doctor.cluster.base import BatchOptions\n"
        "from ciuic_doctor.cluster.slurm import Slurm\n"
        "sp.STALE_S = 6\n"
        f"batch = BatchOptions(nodes=2, partition={slurm_cluster.partition!r}, time='5')\n"
        "spread = sp.Spread(scheduler=Slurm(env=dict(os.environ)), alloc=None, nnodes=2, nproc_per_node=1,"
        " batch=batch)\n"
        f"log = open({str(tmp_path / 'out.log')!r}, 'w')\n"
        f"spread.run([{str(script)!r}], name='ciuic-k9-batch', env=dict(os.environ), log=log, timeout_s=300,"
        f" batch_dir=Path({str(tmp_path)!r}))\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], env=slurm_cluster.env)

    def queued() -> str:
        return slurm_cluster.run(
            "squeue", "-h", "-n", "ciuic-k9-batch", "-o", "%i %T", timeout=20
        ).stdout.strip()

    try:
        deadline = time.monotonic() + 120
        while "RUNNING" not in queued() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "RUNNING" in queued(), "the batch job never ran"
        time.sleep(8)  # past STALE_S with a live submitter: the watchdog must not cancel it
        assert "RUNNING" in queued(), "cancelled while its submitter was alive"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        killed = time.monotonic()
        while queued() and time.monotonic() - killed < 40:
            time.sleep(0.5)
        assert not queued(), f"the batch job outlived its killed submitter by 40 s: {queued()}"
        print(f"batch job gone {time.monotonic() - killed:.1f} s after kill -9 of its submitter")
        said = (tmp_path / "ciuic-k9-batch.log").read_text()
        assert "the verify that started this run is gone (no heartbeat for 6 s): cancelling it" in said
    finally:
        parent.kill()
        for line in queued().splitlines():
            slurm_cluster.run("scancel", line.split()[0], timeout=20)


def test_under_srun_each_task_would_start_its_own_step_so_it_refuses(slurm_cluster: SlurmCluster) -> None:
    done = in_allocation(
        slurm_cluster, ["srun", "--ntasks-per-node=1", *CLI, "comm-bench", "-e", "4K"], timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.count("runs once per allocation") == 2  # one line from each task, no traceback
    assert "Traceback" not in done.stderr


def test_a_step_ends_when_the_process_that_started_it_is_killed_with_9(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """verify and checkup start their Slurm steps through srun; kill -9 of them runs no Python code to
    scancel, so srun itself is armed to get SIGTERM when its parent dies, and srun ends its step."""
    held = slurm_cluster.run("salloc", "-N", "2", "--no-shell", "--job-name=ciuic-k9", timeout=60)
    job = next(w for w in (held.stderr + held.stdout).split() if w.isdigit())
    env = {**slurm_cluster.env, "SLURM_JOB_ID": job}
    starter = (
        "import os, sys, time\n"
        "from ciuic_doctor.cluster.slurm import Slurm\n"
        "slurm = Slurm(env=dict(os.environ))\n"
        f"log = open({str(tmp_path / 'step.log')!r}, 'w')\n"
        "slurm.start_step(slurm.allocation(), ['sleep', '300'], name='ciuic-k9-step', env=dict(os.environ),"
        " log=log)\n"
        "print('started', flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 30
        while not our_steps(slurm_cluster, "ciuic-k9-step") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert our_steps(slurm_cluster, "ciuic-k9-step"), "the step never showed in squeue --steps"
        os.kill(parent.pid, signal.SIGKILL)
        killed = time.monotonic()
        while our_steps(slurm_cluster, "ciuic-k9-step") and time.monotonic() - killed < 10:
            time.sleep(0.5)
        assert not our_steps(slurm_cluster, "ciuic-k9-step"), "the step outlived its killed parent by 10 s"
    finally:
        parent.kill()
        slurm_cluster.run("scancel", job, timeout=20)


@pytest.mark.skipif(not all(map(shutil.which, ("sbatch", "srun", "scancel"))), reason="no Slurm commands")
def test_verify_nproc_is_ranks_per_node_on_a_job_that_spanned_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """verify --nproc on a two-node run: each batch job gets that many ranks a node (it was ignored: the
    recorded 4 a node ran whatever the user asked); without it, the recorded layout."""
    from ciuic_doctor.verify.nodes import SlurmChoice, spread_for

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # a login node: one batch job per run
    meta = {"observed": {"job": {"nodes": 2, "procs_per_node": 4}}}
    asked = spread_for(meta, SlurmChoice(force=True), "run", nproc=1)
    assert (asked.nnodes, asked.nproc_per_node, asked.batch.nodes) == (2, 1, 2)
    recorded = spread_for(meta, SlurmChoice(force=True), "run")
    assert (recorded.nnodes, recorded.nproc_per_node) == (2, 4)


@pytest.mark.skipif(not all(map(shutil.which, ("sbatch", "srun", "scancel"))), reason="no Slurm commands")
def test_verify_shows_what_runs_on_the_nodes_before_it_asks(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unsigned two-node run: the line verify shows before it runs anything is the command each node
    runs (under torchrun, 2 nodes x 4 ranks) and where (a batch job per run), not the one-host command."""
    from types import SimpleNamespace

    from ciuic_doctor.rundir.store import RunDir
    from ciuic_doctor.verify import _trusted
    from ciuic_doctor.verify.consent import Consent
    from ciuic_doctor.verify.nodes import SlurmChoice, spread_for
    from ciuic_doctor.verify.runner import JobCommand

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # a login node: one batch job per run
    run = RunDir.create(tmp_path / "run")
    meta = {"observed": {"job": {"nodes": 2, "procs_per_node": 4}}}
    command = JobCommand(kind="watch", base=["watch"], tail=["--", "train.py", "--lr", "3e-4"], cwd="/work")
    command.spread = spread_for(meta, SlurmChoice(force=True), str(run.path))
    said: list[str] = []
    why = _trusted(run, meta, command, SimpleNamespace(consent=Consent(yes=True)), said.append)
    assert why  # not signed: shown, then run because of --yes
    (line,) = said
    assert "-m torch.distributed.run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d" in line
    assert "-m ciuic_doctor watch --out" in line
    shown = "-- train.py --lr 3e-4` in /work with your own environment"
    assert line.endswith(f"{shown}, on 2 node(s) x 4 rank(s) of a Slurm batch job per run")
