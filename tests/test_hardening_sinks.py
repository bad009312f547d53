"""Untrusted strings are made safe for the sink they reach, and checkup cleans up after itself (issue 22,
classes 5 and 7): escape sequences from a dump never reach the terminal, HTML and Markdown from a dump
never reach summary.md as markup, checkup's first line is redacted, a job stopped by checkup's own
--timeout "did not finish" (it is not "hung"), and kill -9 of checkup leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import run_cli

from ciuic_doctor.render_text import table, terminal
from ciuic_doctor.rundir.store import RunDir

EVIL_FILE = "train\x1b]0;owned\x07.py"
EVIL_FUNCTION = "load<img src=x onerror=alert(1)>[click](http://evil.example)\x1b[2J"


def _hostile_names_run(tmp_path: Path) -> Path:
    """Rank 1 stalled in a frame whose file and function names carry escapes, HTML and a link."""
    run = tmp_path / "run"
    RunDir.create(run).update_meta(probes={"watch": {"status": "failed"}})
    frames = [{"file": EVIL_FILE, "line": 7, "function": EVIL_FUNCTION}]
    waiting = [{"file": "/x/torch/distributed/distributed_c10d.py", "line": 1, "function": "all_reduce"},
               {"file": "train.py", "line": 9, "function": "main"}]  # fmt: skip
    for rank, stack in ((0, waiting), (1, frames)):
        thread = {"thread_id": 1, "name": "MainThread", "main": True, "frames": stack}
        dump = {"schema": 1, "t": 1.0, "rank": rank, "host": f"node\x1b[31m{rank}", "reason": "no-progress",
                "threads": [thread]}  # fmt: skip
        (run / f"hang.rank{rank}.json").write_text(json.dumps(dump))
        step = {"schema": 1, "t": 1.0, "host": "h", "rank": rank, "step": 1, "loss": 1.0}
        (run / f"steps.rank{rank}.jsonl").write_text(json.dumps(step) + "\n")
    return run


def test_escape_sequences_from_a_dump_never_reach_the_terminal_nor_markup_summary_md(tmp_path):
    run = _hostile_names_run(tmp_path)
    done = run_cli("hang", str(run), timeout=120)
    assert done.returncode == 1, done.stderr
    assert "\x1b" not in done.stdout
    assert "\x07" not in done.stdout
    assert "\\x1b]0;owned\\x07.py" in done.stdout  # shown, escaped
    done = run_cli("report", str(run), timeout=300)
    assert "Traceback" not in done.stderr, done.stderr
    assert "\x1b" not in done.stdout
    summary = (run / "summary.md").read_text()
    assert "load" in summary
    assert re.search(r"(?<!\\)<img", summary) is None  # only escaped: \<img renders as text
    assert "\\<img" in summary
    assert re.search(r"(?<!\\)\[click", summary) is None
    assert "\x1b" not in summary


def test_terminal_escapes_controls_and_bidi_overrides_and_tables_use_it():
    assert terminal("a\x1b[2Jb\u202ec\x9b") == "a\\x1b[2Jb\\u202ec\\x9b"
    assert terminal("plain ascii and ünïcode") == "plain ascii and ünïcode"
    assert "\x1b" not in table(["name"], [["x\x1b[31my"]])


SLOW = "import time\nwhile True:\n    time.sleep(0.2)\n"


def test_checkup_timeout_is_did_not_finish_and_its_first_line_is_redacted(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(SLOW)
    out = tmp_path / "run"
    done = run_cli(
        "checkup", "--skip", "comm-bench,memwatch,loader-sweep", "--timeout", "8", "--out", str(out),
        "--", str(script), "--api-key=SECRET123", "--hf-token", "hf_SECRET456",
        timeout=400,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("checkup of "), first
    assert "SECRET123" not in done.stdout
    assert "hf_SECRET456" not in done.stdout
    assert "--api-key=<redacted>" in first
    meta = json.loads((out / "meta.json").read_text())
    job = next(p for p in meta["checkup"]["phases"] if p["name"] == "job")
    assert job["status"] == "timeout", job
    assert meta["checkup"]["hung"] is False
    assert "did not finish" in done.stdout
    assert "the job hung" not in done.stdout


def _script_procs(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
    return found


@pytest.mark.slow
def test_kill_9_of_checkup_of_a_2_rank_script_leaves_no_process(tmp_path):
    script = tmp_path / "orphan_probe.py"  # a unique name: every process of this test carries it
    script.write_text(SLOW)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    checkup = subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", "checkup", "--nproc", "2", "--skip", "comm-bench,loader-sweep",
         "--out", str(tmp_path / "run"), "--", str(script)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        memwatch: list[psutil.Process] = []
        while time.monotonic() < deadline and (len(_script_procs(str(script))) < 3 or not memwatch):
            time.sleep(0.5)  # observable state: torchrun, both ranks and memwatch exist (no guessed time)
            memwatch = [p for p in checkup_children(checkup.pid) if "memwatch" in _cmdline(p)]
        started = _script_procs(str(script))
        assert len(started) >= 3, [p.info["cmdline"] for p in started]
        assert memwatch
        os.kill(checkup.pid, signal.SIGKILL)
        checkup.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (_script_procs(str(script)) or _alive(memwatch)):
            time.sleep(0.5)
        left = [" ".join(p.info["cmdline"] or []) for p in _script_procs(str(script))]
        assert not left, left
        assert not _alive(memwatch)
    finally:
        for proc in _script_procs(str(script)):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(ProcessLookupError):
            checkup.kill()


def checkup_children(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def _cmdline(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(proc.cmdline())
    return ""


def _alive(procs: list[psutil.Process]) -> bool:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


def test_memwatch_stopped_by_sigterm_exits_143_with_its_records(sleeper, tmp_path):
    """README: 128 + N when stopped by signal N; memwatch said 0 for SIGTERM (and for Ctrl-C)."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", "memwatch", "--pid", str(sleeper.pid), "--interval", "0.1",
         "--out", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _samples(run) < 3:  # observable: three samples on disk
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "ended: terminated" in out
    assert _samples(run) >= 3


def _samples(run: Path) -> int:
    try:
        lines = (run / "memwatch.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum(1 for line in lines if line.strip())  # every line of memwatch.jsonl is one sample


def test_report_never_replaces_a_users_own_summary_md_and_watch_refuses_a_shell_script(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "data.jsonl").write_text('{"mine": 1}\n')
    (folder / "summary.md").write_text("my own notes\n")
    for argv in (["report", str(folder)], ["analyze", str(folder)]):
        done = run_cli(*argv, timeout=120)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (folder / "summary.md").read_text() == "my own notes\n"
    assert sorted(p.name for p in folder.iterdir()) == ["data.jsonl", "summary.md"]
    script = tmp_path / "train.sh"  # no #! line: it was run as Python, a SyntaxError traceback
    script.write_text("echo training\n")
    done = run_cli("watch", "--out", str(tmp_path / "run"), "--", str(script), timeout=120)
    assert done.returncode == 2, done.stderr
    assert "not a Python script" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_model_whose_largest_weight_exceeds_host_memory_is_refused_up_front():
    from ciuic_doctor.jobs.spec_check import problems

    found = problems({"model": {"hidden_size": 10**9}})
    assert any("hidden_size" in p and "GiB" in p for p in found), found
    assert not problems({"model": {"hidden_size": 128}})


def test_ctrl_c_of_watch_is_one_line_and_130(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text("import time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.1)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", "watch", "--out", str(tmp_path / "run"), "--", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"  # observable: the script runs under watch
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert "interrupted (Ctrl-C) at" in err


def test_a_watched_script_that_execs_another_program_is_recorded_as_exec(tmp_path):
    """meta.json said `running` after os.execv: no finally or atexit runs when a process becomes another."""
    script = tmp_path / "become.py"
    script.write_text("import os, shutil\nos.execv(shutil.which('true'), ['true'])\n")
    run = tmp_path / "run"
    done = run_cli("watch", "--out", str(run), "--", str(script), timeout=180)
    assert done.returncode == 0, done.stderr
    watch = json.loads((run / "meta.json").read_text())["probes"]["watch"]
    assert watch["status"] == "exec", watch


CLOSES_FDS = """
import os, torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    if step == 1:
        os.closerange(3, 4096)  # a daemonising script: every inherited descriptor, watch's too
        keep = open(os.devnull, "w")  # and the lowest number is the script's own file now
    loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_watched_script_that_closes_inherited_fds_keeps_its_records(tmp_path):
    script = tmp_path / "closes.py"
    script.write_text(CLOSES_FDS)
    run = tmp_path / "run"
    done = run_cli("watch", "--out", str(run), "--", str(script), timeout=600)  # 100 s at load 22
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert len(RunDir.open(run).read("steps").records) == 3
