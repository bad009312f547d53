"""meta.json says how a watched run ended whatever the end (issue 22, class 5): a fatal signal in C code and
SIGKILL end the process before any Python runs, and the sentinel (probes/watch/sentinel.py) records them;
a `running` record whose process is gone reads as `ended_unrecorded`. analyze, hang and report say so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

from conftest import run_cli

from ciuic_doctor.rundir.store import RunDir
from ciuic_doctor.rundir.watch_end import process_start

TRAIN_THEN = """
import ctypes, os, signal, sys, torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("ready", flush=True)
how = sys.argv[1]
if how == "string_at":
    ctypes.string_at(0)  # a NULL read in C: SIGSEGV, no Python code runs after it
elif how == "kill":
    os.kill(os.getpid(), signal.SIGSEGV)
else:
    sys.stdin.read()  # waits for the test's SIGKILL
"""


def _watch(tmp_path, how):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_THEN)
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "ciuic_doctor", "watch", "--out", str(run), "--", str(script), how]
    return run, argv


def _watch_record(run):
    return json.loads((run / "meta.json").read_text())["probes"]["watch"]


def test_a_segfault_in_c_is_recorded_as_crashed_and_analyze_report_and_hang_say_so(tmp_path):
    run, argv = _watch(tmp_path, "string_at")
    done = subprocess.run(
        argv, check=False, capture_output=True, text=True, timeout=600
    )  # stderr closes after the sentinel
    assert done.returncode == -signal.SIGSEGV, done.stderr
    watch = _watch_record(run)
    assert watch["status"] == "crashed", watch
    assert (watch["signal"], watch["exit_code"], watch["seen_by"]) == ("SIGSEGV", 139, "faulthandler"), watch
    assert "crashed (SIGSEGV, exit 139)" in done.stderr
    analyzed = run_cli("analyze", str(run), timeout=300)
    assert analyzed.returncode == 1, analyzed.stdout + analyzed.stderr  # a crash fails a deploy gate
    assert "crashed (SIGSEGV, exit 139)" in analyzed.stdout
    assert "running" not in analyzed.stdout
    hang = run_cli("hang", str(run), timeout=300)
    assert "the run crashed (SIGSEGV, exit 139)." in hang.stdout, hang.stdout + hang.stderr
    report = run_cli("report", str(run), timeout=600)
    assert "Traceback" not in report.stderr, report.stderr
    assert "crashed (SIGSEGV, exit 139)" in (run / "summary.md").read_text()


def test_a_sigsegv_sent_to_itself_is_recorded_as_crashed(tmp_path):
    run, argv = _watch(tmp_path, "kill")
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGSEGV, done.stderr
    assert (_watch_record(run)["status"], _watch_record(run)["signal"]) == ("crashed", "SIGSEGV")


def test_sigkill_is_recorded_as_killed_from_the_zombie_status(tmp_path):
    """SIGKILL leaves no faulthandler text; the kernel keeps the wait status until the parent reaps it."""
    run, argv = _watch(tmp_path, "wait")
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"  # observable: three steps done under watch
        proc.kill()  # not reaped until communicate(): the sentinel reads the zombie's status
        _, err = proc.communicate(timeout=120)  # stderr closes when the sentinel has written meta.json
    finally:
        proc.kill()
    watch = _watch_record(run)
    assert (watch["status"], watch.get("signal"), watch.get("exit_code")) == ("killed", "SIGKILL", 137), watch
    assert "killed (SIGKILL, exit 137)" in err


def test_a_running_record_whose_process_is_gone_reads_as_ended_unrecorded(tmp_path):
    """No sentinel left (the OOM killer took the cgroup): readers on the same host see the PID gone."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    here = socket.gethostname()
    run = RunDir.create(tmp_path / "run")
    run.update_meta(probes={"watch": {"status": "running", "pid": gone.pid, "host": here, "pid_start": 1}})
    step = {"schema": 1, "t": 1.0, "host": here, "rank": 0, "step": 1, "loss": 1.0}
    (run.path / "steps.rank0.jsonl").write_text(json.dumps(step) + "\n")
    done = run_cli("analyze", str(run.path), timeout=300)
    assert "ended_unrecorded" in done.stdout, done.stdout + done.stderr
    # a live process (this one, its true start time) on this host is still running: nothing is said
    run.update_meta(probes={"watch": {"status": "running", "pid": os.getpid(), "host": here,
                                      "pid_start": process_start(os.getpid())}})  # fmt: skip
    done = run_cli("analyze", str(run.path), timeout=300)
    assert "run_end" not in done.stdout, done.stdout
    # the same PID with another start time was reused by another process: the run's own is gone
    run.update_meta(probes={"watch": {"status": "running", "pid": os.getpid(), "host": here, "pid_start": 1}})
    assert "ended_unrecorded" in run_cli("analyze", str(run.path), timeout=300).stdout
