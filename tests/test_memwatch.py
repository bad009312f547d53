"""memwatch against real process trees: a job-like tree (agent, ranks, DataLoader-like workers, a rank
started after attaching, a worker that exits mid-watch), Ctrl-C, bad PIDs, and no torch import.

The tree is built by JOB below, without torch, so the whole module runs in a few seconds:
- parent (root, no RANK): becomes the "agent"; starts rank 0 and rank 1, and rank 2 when told "go";
- rank 0 grows by GROW_MIB_PER_S of touched memory every second (the leak whose slope must be found);
- rank 1 holds a random-sized buffer that changes every 50 ms (flat with noise: no leak), and forks
  two workers: one reads its parent's list of strings slowly (copy-on-read: USS grows, RSS does not),
  one that the test kills mid-watch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import run_cli

GROW_MIB_PER_S = 40
JOB_SECONDS_AFTER_GO = 4.5

JOB = textwrap.dedent(
    """
    import os, random, signal, subprocess, sys, time
    MIB = 2**20
    role = sys.argv[1]

    def ready(*extra):
        print("ready", *extra, flush=True)

    if role == "grow":  # touched memory rising at a known rate, measured against wall time
        rate, held, start = float(sys.argv[2]) * MIB, [], time.monotonic()
        ready()
        while time.monotonic() - start < 30:
            while len(held) * MIB < rate * (time.monotonic() - start):
                held.append(b"x" * MIB)
            time.sleep(0.01)
    elif role == "flat":  # flat with noise, plus two forked workers
        strings = [f"sample-{i:08d}" for i in range(800_000)]  # the "dataset" the workers read
        reader = os.fork()
        if reader == 0:  # copy-on-read: touching refcounts un-shares the pages, slice by slice
            chunk = len(strings) // 120
            for i in range(120):
                for s in strings[i * chunk:(i + 1) * chunk]:
                    pass
                time.sleep(0.05)
            time.sleep(30)
            os._exit(0)
        doomed = os.fork()
        if doomed == 0:
            time.sleep(60)
            os._exit(0)
        ready(reader, doomed)
        # unseeded: with a fixed seed every run replayed one series, sampled in step with this loop, and
        # under load its samples drifted up (Mann-Kendall z 3.25 of the leak rule's 3 on a loaded run)
        rng = random.Random()
        while True:
            noise = b"n" * rng.randrange(0, 32 * MIB)
            try:
                os.waitpid(-1, os.WNOHANG)  # reap the worker the test kills
            except ChildProcessError:
                pass
            time.sleep(0.05)
    elif role == "late":
        ready()
        time.sleep(60)
    else:  # parent
        def start(kind, rank, *args):
            env = dict(os.environ, RANK=str(rank))
            proc = subprocess.Popen([sys.executable, __file__, kind, *args], env=env, stdout=subprocess.PIPE,
                                    text=True)
            return proc, proc.stdout.readline().split()[1:]
        grow, _ = start("grow", 0, sys.argv[2])
        # a fixed mmap threshold: glibc's sliding one would move the noise onto a heap that ratchets up
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**16)
        flat, workers = start("flat", 1)
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
        print("ready", grow.pid, flat.pid, *workers, flush=True)
        sys.stdin.readline()  # "go": memwatch is attached
        late, _ = start("late", 2)
        print("late", late.pid, flush=True)
        time.sleep(float(sys.argv[3]))
        for proc in (grow, flat, late):
            proc.kill()
            proc.wait()
    """
)


def _wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    """Poll a condition that no pipe can signal (a file another process appends to)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _records(path: Path, kind: str = "sample") -> list[dict]:
    """memwatch's samples (kind "sample") or its events of one kind, read from the run directory."""
    stream = path if kind == "sample" else path.with_name("memwatch_events.jsonl")
    if not stream.exists():
        return []
    lines = [json.loads(line) for line in stream.read_text().splitlines() if line.strip()]
    return [r for r in lines if kind == "sample" or r.get("kind") == kind]


def _memwatch(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    return subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", "memwatch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture(scope="module")
def job_run(tmp_path_factory):
    """Watch the job tree from start to exit; returns what the test needs to check it."""
    tmp = tmp_path_factory.mktemp("memwatch-job")
    script = tmp / "job.py"
    script.write_text(JOB)
    run = tmp / "run"
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    parent = subprocess.Popen(
        [sys.executable, str(script), "parent", str(GROW_MIB_PER_S), str(JOB_SECONDS_AFTER_GO)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _, grow_pid, flat_pid, reader_pid, doomed_pid = parent.stdout.readline().split()
        watcher = _memwatch(
            "--pid", str(parent.pid), "--interval", "0.2", "--uss-budget", "5", "--out", str(run)
        )
        stream = run / "memwatch.jsonl"
        _wait_for(lambda: _records(stream, "sample"), what="memwatch's first sample")
        parent.stdin.write("go\n")
        parent.stdin.flush()
        late_pid = int(parent.stdout.readline().split()[1])
        _wait_for(
            lambda: any(r["pid"] == late_pid for r in _records(stream, "sample")),
            what="a sample of the rank started after attaching",
        )
        os.kill(int(doomed_pid), signal.SIGKILL)  # a worker exits mid-watch
        parent.wait(timeout=60)
        out, err = watcher.communicate(timeout=60)
    finally:
        parent.kill()
    return {
        "run": run,
        "returncode": watcher.returncode,
        "stdout": out,
        "stderr": err,
        "pids": {
            "agent": parent.pid,
            "grow": int(grow_pid),
            "flat": int(flat_pid),
            "reader": int(reader_pid),
            "doomed": int(doomed_pid),
            "late": late_pid,
        },
    }


@pytest.fixture(scope="module")
def job_findings(job_run):
    result = run_cli("analyze", str(job_run["run"]), "--json", timeout=60)
    assert result.returncode in {0, 1}, result.stderr
    return json.loads(result.stdout)


def test_follows_the_whole_tree_with_roles(job_run):
    assert job_run["returncode"] == 0, job_run["stderr"]
    pids = job_run["pids"]
    roles = {r["pid"]: r["role"] for r in _records(job_run["run"] / "memwatch.jsonl", "sample")}
    assert roles[pids["agent"]] == "agent"
    assert roles[pids["grow"]] == "rank 0"
    assert roles[pids["flat"]] == "rank 1"
    assert roles[pids["late"]] == "rank 2"  # started after memwatch attached
    assert roles[pids["reader"]] == "worker of rank 1"
    assert roles[pids["doomed"]] == "worker of rank 1"


def test_worker_exit_mid_watch_keeps_its_records_and_the_watch_goes_on(job_run):
    stream = job_run["run"] / "memwatch.jsonl"
    doomed = job_run["pids"]["doomed"]
    assert any(r["pid"] == doomed for r in _records(stream, "exit"))
    assert any(r["pid"] == doomed for r in _records(stream, "sample"))
    last_doomed = max(r["sample"] for r in _records(stream, "sample") if r["pid"] == doomed)
    assert max(r["sample"] for r in _records(stream, "sample")) > last_doomed + 5


def test_ends_cleanly_when_the_target_exits(job_run):
    stream = job_run["run"] / "memwatch.jsonl"
    end = _records(stream, "end")
    assert [e["reason"] for e in end] == ["target exited"]
    assert "ended: target exited" in job_run["stdout"]
    assert "worker of rank 1" in job_run["stdout"]  # the one-screen summary, per role
    start = _records(stream, "start")[0]
    assert start["nvml_available"] is False  # no driver here: recorded once, with the reason
    assert "NVML" in start["nvml_reason"]


def test_the_memory_analysis_says_why_no_device_series_in_memwatch_s_words(job_run):
    """The device leak check names the start event's reason (read column-wise from the events, a line
    per watched process) rather than a guess."""
    from ciuic_doctor.analysis.memory import analyze
    from ciuic_doctor.rundir.store import RunDir

    reason = _records(job_run["run"] / "memwatch.jsonl", "start")[0]["nvml_reason"]
    device = [f for f in analyze(RunDir.open(job_run["run"])) if f.evidence.get("kind") == "device"]
    assert [f.verdict for f in device] == ["not_run"]
    assert reason in device[0].summary


def test_sample_fields(job_run):
    sample = next(
        r
        for r in _records(job_run["run"] / "memwatch.jsonl", "sample")
        if r["pid"] == job_run["pids"]["grow"] and r["cpu_percent"] is not None and r["uss"]
    )
    for key in ("rss", "uss", "pss", "threads", "sys_available_bytes", "shm_free_bytes"):
        assert sample[key] > 0, key
    assert sample["rank"] == 0
    assert sample["gpu_bytes"] is None
    samples = _records(job_run["run"] / "memwatch.jsonl")
    assert all({"pid", "role", "rss"} <= set(r) for r in samples)  # the stream holds samples only


def _finding(findings, check, rank):
    return next(f for f in findings if f["check"] == check and f["where"].get("rank") == rank)


def test_growing_rank_slope_found_within_10_percent(job_findings):
    leak = _finding(job_findings, "memory_leak", 0)
    assert leak["verdict"] in {"warn", "fail"}
    assert leak["evidence"]["kind"] == "host"
    slope = leak["evidence"]["slope_bytes_per_s"]
    assert slope == pytest.approx(GROW_MIB_PER_S * 2**20, rel=0.10)
    assert leak["evidence"]["projected_oom_s"] > 0


def test_flat_noisy_rank_is_not_a_leak(job_findings):
    leak = next(f for f in job_findings if f["check"] == "memory_leak" and f["evidence"]["kind"] == "host")
    # one finding for the job, naming the growing rank only (on failure: each named rank's slope and R²)
    assert leak["where"]["ranks"] == [0], leak["evidence"]["ranks"]
    assert leak["evidence"]["ranks_checked"] >= 2


def test_copy_on_read_worker_growth_found(job_findings):
    (growth,) = [f for f in job_findings if f["check"] == "worker_memory_growth"]  # one for the job
    assert 1 in growth["where"]["ranks"]
    assert growth["verdict"] == "warn"
    assert growth["evidence"]["pattern"] == "copy_on_read"


NO_TORCH = textwrap.dedent(
    """
    import json, sys
    from ciuic_doctor.cli import main
    code = main(sys.argv[1:])
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "pandas", "matplotlib", "numpy"})
    print("HEAVY=" + json.dumps(heavy))
    sys.exit(code)
    """
)


def test_ctrl_c_ends_with_summary_and_never_imports_torch(sleeper, tmp_path):
    """The real CLI in one process: SIGINT ends it cleanly, and no heavy module was ever imported."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            NO_TORCH,
            "memwatch",
            "--pid",
            str(sleeper.pid),
            "--interval",
            "0.1",
            "--out",
            str(run),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: len(_records(run / "memwatch.jsonl", "sample")) >= 3, what="three samples")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err  # README: 130 interrupted, every record kept
    assert "ended: interrupted" in out
    assert json.loads(out.split("HEAVY=")[1]) == []
    assert [e["reason"] for e in _records(run / "memwatch.jsonl", "end")] == ["interrupted"]
    assert len(_records(run / "memwatch.jsonl", "sample")) >= 3


def test_nonexistent_pid_is_one_clear_line(tmp_path):
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    result = run_cli("memwatch", "--pid", str(pid_max + 1), "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"ciuic-doctor memwatch: error: no process with PID {pid_max + 1}"
    assert not (tmp_path / "run").exists()


def test_zombie_pid_is_one_clear_line(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        _wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, what="a zombie")
        result = run_cli("memwatch", "--pid", str(child.pid), "--out", str(tmp_path / "run"))
    finally:
        child.wait()
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "zombie" in result.stderr


def _watch_as_nobody(target_pid: int, out: Path) -> tuple[int, str]:
    """Fork, drop to user nobody, run the memwatch CLI in the child (modules pre-imported: nobody may not
    read root's Python), and return its exit code and stderr."""
    import ciuic_doctor.cli
    import ciuic_doctor.commands.memwatch
    import ciuic_doctor.launch
    import ciuic_doctor.machine.envinfo
    import ciuic_doctor.machine.nvml
    import ciuic_doctor.probes.memwatch.sampler
    import ciuic_doctor.render_text

    # the parser imports every command's module (the job command's imports statistics): run alone, this
    # file's child found none of them imported by other tests, and nobody cannot read root's stdlib
    ciuic_doctor.cli.build_parser()
    ciuic_doctor.machine.nvml.get()
    ciuic_doctor.machine.envinfo.capture(with_torch=False)
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code and the pipe
        try:
            sys.stderr = os.fdopen(err_w, "w", buffering=1)  # pytest has replaced sys.stderr
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = ciuic_doctor.cli.main(
                [
                    "memwatch",
                    "--pid",
                    str(target_pid),
                    "--interval",
                    "0.1",
                    "--duration",
                    "0.5",
                    "--out",
                    str(out),
                ]
            )
        except BaseException as exc:
            os.write(err_w, repr(exc).encode())
            code = 99
        os._exit(code)
    os.close(err_w)
    with os.fdopen(err_r) as fh:
        err = fh.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), err


def test_another_users_process_records_rss_only_with_one_note(sleeper, tmp_path):
    """AccessDenied provoked for real: memwatch as user nobody watching a root process."""
    if os.geteuid() != 0:
        if psutil.Process(1).uids().real == os.getuid():
            pytest.skip("PID 1 is ours and we cannot switch user: no AccessDenied to provoke")
        result = run_cli("memwatch", "--pid", "1", "--duration", "0.3", "--out", str(tmp_path / "run"))
        assert result.returncode == 0, result.stderr
        assert "PID 1 " in result.stderr
        assert "access denied" in result.stderr
        return
    shared = Path(tempfile.mkdtemp(prefix="ciuic-memwatch-nobody-"))  # pytest's tmp is root-only
    shared.chmod(0o777)
    try:
        code, err = _watch_as_nobody(sleeper.pid, shared / "run")
        samples = _records(shared / "run" / "memwatch.jsonl", "sample")
        process = _records(shared / "run" / "memwatch.jsonl", "process")[0]
    finally:
        shutil.rmtree(shared)
    assert code == 0, err
    notes = [line for line in err.splitlines() if "access denied" in line]
    assert len(notes) == 1
    assert "USS/PSS not readable" in notes[0]
    assert samples
    assert all(s["uss"] is None and s["rss"] > 0 for s in samples)
    assert process["environ_readable"] is False


def test_uss_reads_thin_out_when_they_cost_more_than_the_budget(sleeper, tmp_path):
    """memory_full_info of even a small process costs tens of µs of CPU; with a budget of 0.001 % of a
    core at 20 Hz (0.5 µs a sample) memwatch must read USS only every k-th sample and say so."""
    from ciuic_doctor.probes.memwatch.sampler import MemwatchConfig, watch

    config = MemwatchConfig(pid=sleeper.pid, interval_s=0.05, duration_s=0.6, full_info_budget=1e-5)
    result = watch(config, tmp_path / "run", progress=lambda line: None)
    samples = _records(tmp_path / "run" / "memwatch.jsonl", "sample")
    assert result.full_info_every > 1
    assert samples[0]["uss"] is not None  # the first read measures the cost
    assert any(s["uss"] is None for s in samples)
    assert max(s["uss_every"] for s in samples) == result.full_info_every


TORCHRUN_RANK = textwrap.dedent(
    """
    import os, sys, time
    worker = os.fork()  # a DataLoader-like worker: a forked child of the rank
    if worker == 0:
        time.sleep(float(sys.argv[1]) + 1)
        os._exit(0)
    # One write(2) per line: two ranks share the pipe, and print() under -u writes each field apart,
    # so their fields could interleave into a three-field line.
    os.write(1, f"rank {os.environ['RANK']} {os.getpid()} {worker}\\n".encode())
    time.sleep(float(sys.argv[1]))
    os.kill(worker, 9)
    """
)


def test_torchrun_agent_ranks_and_workers(tmp_path):
    """Attach to a real torchrun agent: ranks from their RANK, workers grouped under their rank."""
    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_RANK)
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "CIUIC_RUN_DIR"}}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    agent = subprocess.Popen(
        [*argv, str(script), "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    try:
        ranks: dict[int, tuple[int, int]] = {}
        while len(ranks) < 2:  # torchrun may print lines of its own; keep only the ranks'
            line = agent.stdout.readline()
            assert line, "torchrun exited before both ranks reported"
            if match := re.search(r"rank (\d+) (\d+) (\d+)$", line.strip()):
                rank, pid, worker = map(int, match.groups())
                ranks[rank] = (pid, worker)
        result = run_cli(
            "memwatch", "--pid", str(agent.pid), "--interval", "0.2", "--out", str(tmp_path / "run")
        )
        agent.wait(timeout=60)
    finally:
        agent.kill()
    assert result.returncode == 0, result.stderr
    assert "ended: target exited" in result.stdout
    roles = {r["pid"]: (r["role"], r["rank"]) for r in _records(tmp_path / "run" / "memwatch.jsonl")}
    assert roles[agent.pid] == ("agent", None)
    for rank, (pid, worker) in ranks.items():
        assert roles[pid] == (f"rank {rank}", rank)
        assert roles[worker] == (f"worker of rank {rank}", rank)
    sources = {e["pid"]: e["rank_source"] for e in _records(tmp_path / "run" / "memwatch.jsonl", "process")}
    assert sources[agent.pid] == "cmdline"
    assert {sources[pid] for pid, _ in ranks.values()} == {"env"}


UNREADABLE_TREE = textwrap.dedent(
    """
    import os, subprocess, sys, time
    CHILD = "import os, sys, time\\nif os.environ['RANK'] == '0' and os.fork() == 0:\\n    time.sleep(60)\\n"
    CHILD += "print('ready', flush=True)\\ntime.sleep(60)\\n"
    kids = []
    for rank in (0, 1):  # one after the other: start order is rank order
        kid = subprocess.Popen([sys.executable, "-c", CHILD], env={**os.environ, "RANK": str(rank)},
                               stdout=subprocess.PIPE, text=True)
        kid.stdout.readline()
        kids.append(kid)
    print("ready", *(k.pid for k in kids), flush=True)
    time.sleep(60)
    """
)


def test_ranks_by_start_order_when_the_environment_is_unreadable(tmp_path):
    """Another user's launcher: RANK cannot be read, so its children are ranked by start order."""
    if os.geteuid() != 0:
        pytest.skip("needs root to watch a tree as another user")
    parent = subprocess.Popen(
        [sys.executable, "-c", UNREADABLE_TREE, "torchrun"],  # a launcher by its command line
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    shared = Path(tempfile.mkdtemp(prefix="ciuic-memwatch-nobody-"))
    shared.chmod(0o777)
    try:
        _, rank0, rank1 = parent.stdout.readline().split()
        code, err = _watch_as_nobody(parent.pid, shared / "run")
        processes = _records(shared / "run" / "memwatch.jsonl", "process")
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        shutil.rmtree(shared)
    assert code == 0, err
    roles = {p["pid"]: (p["role"], p["rank_source"]) for p in processes}
    assert roles[parent.pid] == ("agent", "cmdline")
    assert roles[int(rank0)] == ("rank 0", "order")
    assert roles[int(rank1)] == ("rank 1", "order")
    workers = [role for pid, role in roles.items() if pid not in {parent.pid, int(rank0), int(rank1)}]
    assert workers == [("worker of rank 0", "parent")]


LEAKY_TRAINING = textwrap.dedent(
    """
    import sys, time
    import torch
    print("ready", flush=True)
    sys.stdin.readline()  # memwatch is attached
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    for step in range(60):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        kept.append(torch.ones(2 * 2**20 // 4))  # 2 MiB of touched host memory kept every step
        time.sleep(0.04)
    """
)


def test_samples_align_to_the_steps_of_watch(tmp_path):
    """memwatch beside `ciuic-doctor watch` in one RUN: the leak is measured per optimizer step."""
    script = tmp_path / "train.py"
    script.write_text(LEAKY_TRAINING)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "CIUIC_RUN_DIR"}}
    job = subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", "watch", "--out", str(run), "--", str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert job.stdout.readline().strip() == "ready"
        watcher = _memwatch("--pid", str(job.pid), "--interval", "0.1", "--out", str(run))
        _wait_for(lambda: _records(run / "memwatch.jsonl"), what="memwatch's first sample")
        job.stdin.write("go\n")
        job.stdin.flush()
        assert job.wait(timeout=120) == 0
        watcher.communicate(timeout=60)
    finally:
        job.kill()
    assert watcher.returncode == 0
    findings = json.loads(run_cli("analyze", str(run), "--json", timeout=60).stdout)
    leak = next(f for f in findings if f["check"] == "memory_leak" and f["evidence"].get("kind") == "host")
    assert leak["evidence"]["source"] == "memwatch"
    assert leak["evidence"]["slope_bytes_per_step"] == pytest.approx(2 * 2**20, rel=0.10)
    assert leak["verdict"] in {"warn", "fail"}
