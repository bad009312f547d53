"""The hang doctor on real hung jobs: 2 gloo ranks under torchrun (+ watch), hanging on purpose.

Each case launches tests/data/hang_job.py with a 6 s process-group timeout; rank 1 misbehaves at step 4.
The judgement must name the culprit rank, the collective the other waits in, the kind, and the culprit's
own frame, within the process-group timeout + 30 s of the hang (the issue's bar).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import run_cli

from ciuic_doctor.analysis.hang import _expected, judge
from ciuic_doctor.rundir.hang.files import HangFiles, load, parse_faulthandler, py_spy_binary
from ciuic_doctor.rundir.store import RunDir

JOB = Path(__file__).parent / "data" / "hang_job.py"
PG_TIMEOUT_S = 4
GRAD_LINE = "hang_job.py:64"  # dist.all_reduce(flat): the gradient all_reduce
LOSS_LINE = "hang_job.py:66"  # dist.all_reduce(loss): the logged loss


def _launch(argv: list[str], env: dict[str, str] | None = None, nproc: int = 2) -> subprocess.Popen:
    full = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "HANG_PG_TIMEOUT": str(PG_TIMEOUT_S),
    }
    full.pop("CIUIC_RUN_DIR", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.Popen(
        [*launcher, *argv],
        env={**full, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _kill_tree(proc: subprocess.Popen) -> str:
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    proc.kill()
    return proc.communicate()[0]


def hung_job(tmp_path: Path, mode: str, *, hang_after: str | None = "2", nproc: int = 2) -> Path:
    """Run the job under watch until torchrun ends it (at most PG timeout + 60 s); the run directory."""
    run = tmp_path / mode
    options = ["--hang-after", hang_after] if hang_after else []
    proc = _launch(
        ["-m", "ciuic_doctor", "watch", "--out", str(run), *options, "--", str(JOB), mode], nproc=nproc
    )
    try:
        output = proc.communicate(timeout=PG_TIMEOUT_S + 60)[0]
    except subprocess.TimeoutExpired:
        output = _kill_tree(proc)
    assert proc.returncode != 0, output[-3000:]
    return run


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert path.exists(), f"{path} did not appear within {timeout_s} s"


def _hang(run: Path, *, cli: bool = False) -> dict:
    """The `hang` finding, in this process (the CLI's own path: load + judge) or through the CLI."""
    if not cli:
        return judge(load(RunDir.open(run)))[0].to_dict()
    done = run_cli("hang", str(run), "--json", timeout=120)
    assert done.returncode == 1, done.stderr
    return json.loads(done.stdout)[0]


def _within_bar(run: Path) -> None:
    """The culprit-naming dump (or faulthandler's stacks of an aborted rank) came within the process-group
    timeout + 30 s of the last step."""
    steps = RunDir.open(run).read("steps").records
    dumps = [json.loads(p.read_text())["t"] for p in run.glob("hang.rank*.json") if p.name.count(".") == 2]
    fatal = [p.stat().st_mtime for p in run.glob("hang.rank*.fatal.txt") if p.stat().st_size]
    assert dumps or fatal
    assert steps
    assert min(dumps + fatal) - max(s["t"] for s in steps) < PG_TIMEOUT_S + 30


@pytest.mark.slow
def test_rank_stuck_in_data_loading_of_4_is_a_stall_at_its_own_frame(tmp_path):
    # 4 ranks, the watchdog's default hang-after (0.8 x the process-group timeout); one finding names them all
    run = hung_job(tmp_path, "loader", hang_after=None, nproc=4)
    finding = _hang(run, cli=True)
    ev = finding["evidence"]
    assert (ev["kind"], ev["culprit_ranks"], ev["waiting_ranks"]) == ("stall", [1], [0, 2, 3]), finding[
        "summary"
    ]
    assert "load_batch at" in ev["culprit_frame"]
    assert "hang_job.py:35" in ev["culprit_frame"]
    collective = ev["collective"]
    assert (collective["op"], collective["sizes"], collective["dtypes"]) == ("all_reduce", [[68]], ["Float"])
    assert GRAD_LINE in collective["call_site"]
    armed_default = json.loads((run / "hang.rank1.json").read_text())["hang_after_s"]
    assert armed_default == pytest.approx(0.8 * PG_TIMEOUT_S)
    _within_bar(run)


def _judged(tmp_path: Path, mode: str, kind: str) -> tuple[dict, dict]:
    """Run `mode` until torchrun ends it; the finding must be `kind` with rank 1 the culprit, in time."""
    run = hung_job(tmp_path, mode)
    finding = _hang(run)
    assert (finding["evidence"]["kind"], finding["evidence"]["culprit_ranks"]) == (kind, [1]), finding[
        "summary"
    ]
    _within_bar(run)
    return finding, finding["evidence"]


@pytest.mark.slow
def test_rank_that_skips_an_all_reduce_is_a_desync(tmp_path):
    _, ev = _judged(tmp_path, "skip", "desync")
    assert LOSS_LINE in ev["culprit_frame"]  # rank 1 is already in the next collective
    assert GRAD_LINE in ev["collective"]["call_site"]


@pytest.mark.slow
def test_rank_that_all_reduces_a_different_size_is_a_mismatch(tmp_path):
    finding, ev = _judged(tmp_path, "size", "mismatch")
    assert "[[69]]" in finding["summary"], finding["summary"]
    assert "[[68]]" in finding["summary"], finding["summary"]
    assert GRAD_LINE in ev["culprit_frame"]


@pytest.mark.slow
def test_rank_killed_with_sigkill_is_dead(tmp_path):
    finding, ev = _judged(tmp_path, "kill", "dead")
    assert ev["waiting_ranks"] == [0]
    assert GRAD_LINE in ev["collective"]["call_site"]
    assert "its last step record: step 3" in finding["summary"]  # killed in step 4's load_batch


@pytest.mark.slow
def test_sigstopped_rank_is_a_stall_with_its_py_spy_frame_and_hang_pid_asks_the_watched_ranks(tmp_path):
    """rank 1 stops itself in save_checkpoint; rank 0's watchdog dumps (with py-spy's stack of its stopped
    peer); then `hang --pid` asks both ranks by SIGUSR1: rank 0 answers from its watchdog thread while
    its main thread is blocked in all_reduce, and rank 1, which cannot, is read with py-spy."""
    if py_spy_binary() is None:
        pytest.skip("py-spy is not installed")
    run = tmp_path / "stop"
    argv = ["-m", "ciuic_doctor", "watch", "--out", str(run), "--hang-after", "2", "--", str(JOB), "stop"]
    proc = _launch(argv, env={"HANG_PG_TIMEOUT": "60"})  # the job stays hung while we look
    try:
        _wait_for(run / "hang.rank0.json", 120)  # ~10 s alone; a loaded 2-core box took over 60
        finding = _hang(run)
        _within_bar(run)  # before the requests below overwrite the watchdog's own dump
        asked_at = time.time()
        done = run_cli("hang", "--pid", str(proc.pid), "--wait", "2", "--json", timeout=120)
        # --out elsewhere: the ranks still dump into their own run; their dumps are read from there
        elsewhere = tmp_path / "elsewhere"
        out = run_cli("hang", "--pid", str(proc.pid), "--out", str(elsewhere), "--json", timeout=120)
    finally:
        _kill_tree(proc)
    ev = finding["evidence"]
    assert (ev["kind"], ev["culprit_ranks"]) == ("stall", [1]), finding["summary"]
    assert "stopped" in finding["summary"]
    if ev["culprit_frame"] is None:
        pytest.skip("py-spy was refused access to the stopped rank (ptrace)")
    assert "save_checkpoint at" in ev["culprit_frame"]
    assert done.returncode == 1, done.stderr
    asked = json.loads(done.stdout)[0]["evidence"]
    assert (asked["kind"], asked["culprit_ranks"]) == ("stall", [1]), done.stdout
    assert "save_checkpoint at" in asked["culprit_frame"]
    answer = json.loads((run / "hang.rank0.json").read_text())
    assert (answer["reason"], answer["t"] > asked_at) == ("requested", True)
    sources = {row["rank"]: row["source"] for row in asked["ranks"]}
    assert sources == {0: "watchdog", 1: "py-spy"}
    assert out.returncode == 1, out.stdout + out.stderr  # main said PASS: it waited for dumps in --out
    there = json.loads(out.stdout)[0]["evidence"]
    assert (there["kind"], there["culprit_ranks"]) == ("stall", [1]), out.stdout
    assert {row["rank"]: row["source"] for row in there["ranks"]} == {0: "watchdog", 1: "py-spy"}
    copied = json.loads((elsewhere / "hang.rank0.json").read_text())
    assert copied["reason"] == "requested"
    # the rank had dumped before, so this dump's Flight Recorder file is rank0.<n>: copied under that name
    if copied.get("fr_file"):
        copies = sorted(p.name for p in (elsewhere / "hang.fr").iterdir())
        assert (elsewhere / copied["fr_file"]).is_file(), copies


@pytest.mark.slow
def test_hang_pid_on_a_job_started_without_watch_names_the_stuck_frame(tmp_path):
    if py_spy_binary() is None:
        pytest.skip("py-spy is not installed")
    proc = _launch([str(JOB), "loader"], env={"HANG_PG_TIMEOUT": "600"})
    try:
        # until rank 0 waits and rank 1 sleeps (observable: the judgement); 60 s ran out under two CPU
        # burners on the loaded 2-core box (load 27), so the bound is far past what a quiet run takes (~20 s)
        deadline, ev, done = time.monotonic() + 240, {}, None
        while time.monotonic() < deadline and ev.get("kind") != "stall":
            time.sleep(2)
            done = run_cli(
                "hang", "--pid", str(proc.pid), "--out", str(tmp_path / "pid"), "--json", timeout=120
            )
            if done.returncode == 2 and "ptrace" in done.stderr:
                pytest.skip(done.stderr.strip())
            if done.stdout.startswith("["):
                ev = json.loads(done.stdout)[0]["evidence"]
    finally:
        _kill_tree(proc)
    assert (ev.get("kind"), ev.get("culprit_ranks")) == ("stall", [1]), done and done.stdout + done.stderr
    assert "load_batch at" in ev["culprit_frame"]
    assert GRAD_LINE in ev["collective"]["call_site"]


# ---- the parts, on recorded data ---------------------------------------------------------------------
def test_history_pattern_says_which_collective_comes_next():
    history = [("all_reduce", "a", "[[68]]"), ("all_reduce", "b", "[[1]]")] * 3
    assert _expected(history, 7) == ("all_reduce", "a", "[[68]]")
    assert _expected(history, 8) == ("all_reduce", "b", "[[1]]")
    assert _expected(history[:1], 2) is None


def test_faulthandler_text_is_parsed_and_the_main_thread_found():
    text = (
        "Fatal Python error: Aborted\n\nThread 0x00007f25da7146c0 (most recent call first):\n"
        '  File "/x/watch_hang.py", line 289 in _wait\n'
        '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
        'Thread 0x00007f25fa1fdb80 (most recent call first):\n  File "train.py", line 62 in main\n'
        '  File "train.py", line 69 in <module>\n'
    )
    threads = parse_faulthandler(text)
    assert threads[0]["main"]
    assert threads[0]["frames"][0] == {"file": "train.py", "line": 62, "function": "main"}


def test_no_dumps_is_not_run_and_a_torn_dump_is_named(tmp_path):
    assert judge(HangFiles())[0].verdict == "not_run"
    run = RunDir.create(tmp_path / "run")
    (run.path / "hang.rank0.json").write_text('{"schema": 1, "ra')
    files = load(run)
    assert files.problems
    assert "hang.rank0.json" in files.problems[0]


def test_usage_errors_are_one_line(tmp_path):
    for argv in (["hang"], ["hang", str(tmp_path), "--pid", "1"], ["hang", str(tmp_path / "nope")]):
        done = run_cli(*argv, timeout=60)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = run_cli("hang", "--pid", "999999999", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_report_has_a_hang_section_only_when_the_job_hung(tmp_path):
    from ciuic_doctor.report.sections import build_sections
    from ciuic_doctor.rundir.findings import Finding

    row = {"rank": 1, "host": "h<1>", "source": "watchdog", "state": "running", "in_collective": False,
           "frame": "load_batch at train.py:88"}  # fmt: skip
    hung = Finding(probe="hang", check="hang", verdict="fail", summary="stall: rank 1",
                   evidence={"ranks": [row], "next": "look at load_batch"}, where={"rank": 1})  # fmt: skip
    quiet = Finding(probe="hang", check="hang", verdict="pass", summary="no hang")
    streams = {name: [] for name in ("comm", "steps", "memwatch", "loader", "checkpoint")}
    assert "hang" not in [s.id for s in build_sections(streams, [quiet], {})]
    section = next(s for s in build_sections(streams, [hung], {}) if s.id == "hang")
    assert section.findings == [hung]
    assert section.tables[0].rows[0][-1][0] == "load_batch at train.py:88"
    assert section.notes == ["Next: look at load_batch"]


def test_has_hang_dumps_ignores_an_armed_quiet_watchdog(tmp_path):
    from ciuic_doctor.rundir.hang.files import has_hang_dumps

    (tmp_path / "hang.rank0.armed.json").write_text("{}")
    (tmp_path / "hang.rank0.fatal.txt").write_text("")
    (tmp_path / "hang.rank0.last.json").write_text("{}")
    assert not has_hang_dumps(tmp_path)
    (tmp_path / "hang.rank0.fatal.txt").write_text("Fatal Python error: Aborted\n")
    assert has_hang_dumps(tmp_path)


# ---- judged on constructed dumps: the kinds gloo on one machine cannot produce ---------------------
def _entry(seq: int, line: int, sizes=((68,),), dtype="Float") -> dict:
    frames = [{"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 1},
              {"name": "main", "filename": "train.py", "line": line}]  # fmt: skip
    return {"collective_seq_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"), "is_p2p": False,
            "profiling_name": "nccl:all_reduce", "input_sizes": [list(s) for s in sizes],
            "input_dtypes": [dtype], "frames": frames}  # fmt: skip


def _files(per_rank: dict[int, tuple[list[dict], int]], reason: str = "no-progress") -> HangFiles:
    """rank -> (Flight Recorder entries, last completed seq), each with a watchdog dump."""
    files = HangFiles()
    for rank, (entries, completed) in per_rank.items():
        files.dumps[rank] = {"rank": rank, "host": f"node{rank // 2}", "reason": reason, "threads": [],
                             "pg_status": {"0": {"last_completed_collective": completed}}}  # fmt: skip
        files.fr_entries[rank] = entries
    return files


def test_every_rank_inside_the_same_collective_is_in_collective():
    history = [_entry(1, 60), _entry(2, 62)]
    files = _files({r: ([*history, _entry(3, 60)], 2) for r in range(4)})
    hang = judge(files)[0]
    assert (hang.evidence["kind"], hang.evidence["culprit_ranks"]) == ("in-collective", [])
    assert hang.evidence["waiting_ranks"] == [0, 1, 2, 3]
    assert "NCCL_DEBUG=INFO" in hang.evidence["next"]


def test_the_one_rank_of_four_in_another_collective_is_the_desync_culprit_and_its_host_is_named():
    history = [_entry(1, 60), _entry(2, 62)]
    per_rank = {r: ([*history, _entry(3, 60)], 2) for r in (0, 1, 3)}
    per_rank[2] = ([*history, _entry(3, 62, sizes=((1,),))], 2)
    hang = judge(_files(per_rank))[0]
    assert (hang.evidence["kind"], hang.evidence["culprit_ranks"]) == ("desync", [2]), hang.summary
    assert hang.where["hosts"] == ["node1"]
    assert hang.evidence["collective"]["call_site"] == "main at train.py:60"


def test_same_line_other_dtype_on_one_of_four_is_a_mismatch():
    per_rank = {r: ([_entry(1, 60), _entry(2, 60)], 1) for r in (0, 1, 2)}
    per_rank[3] = ([_entry(1, 60), _entry(2, 60, dtype="BFloat16")], 1)
    hang = judge(_files(per_rank))[0]
    assert (hang.evidence["kind"], hang.evidence["culprit_ranks"]) == ("mismatch", [3]), hang.summary


def test_dumps_asked_for_while_the_job_runs_are_not_a_hang():
    files = _files({r: ([_entry(1, 60)], 1) for r in range(2)}, reason="requested")
    hang = judge(files)[0]
    assert hang.verdict == "pass", hang.summary
    assert "requested" in hang.summary


def test_a_forked_child_sigtermed_leaves_the_rank_alone(tmp_path):
    """A DataLoader-style forked worker inherits the signal handlers: SIGTERM to it must kill it as
    before, and write no dump in the rank's name, nor wake the rank's watchdog. (A SIGTERM in the
    microseconds between fork() and Python's after-fork reset is lost, as with any Python SIGTERM handler.)"""
    script = tmp_path / "fork.py"
    script.write_text(
        "import multiprocessing as mp, os, signal, time, torch\n"
        "model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "def step():\n    model(torch.ones(1, 2)).sum().backward(); opt.step()\n"
        "step()\n"
        "child = mp.get_context('fork').Process(target=time.sleep, args=(60,)); child.start()\n"
        "time.sleep(0.5); os.kill(child.pid, signal.SIGTERM); child.join(30)\n"
        "time.sleep(1.5); step()\n"
        "print('child exitcode', child.exitcode)\n"
    )
    run = tmp_path / "run"
    done = run_cli("watch", "--out", str(run), "--", str(script), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "child exitcode -15" in done.stdout
    assert not (run / "hang.rank0.json").exists()
    assert (run / "hang.rank0.armed.json").exists()
