"""A run directory never decides what runs: `verify` re-runs a command only when this user's `watch` or
`job` signed it (or the user says --yes), the environment a spec or run hands a job is allow-listed,
the exporter listens on loopback unless told, watch leaves the model picklable and copyable, and
verify's runs die with it. Real processes throughout; each job is a few steps."""

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

import pytest

from ciuic_doctor.rundir import trust
from tests.conftest import run_cli

SCRIPTS = Path(__file__).parent / "data" / "user_scripts"
SLEEPY = SCRIPTS / "sleepy_train.py"


@pytest.fixture(autouse=True)
def own_key(tmp_path_factory, monkeypatch):
    """Every process of these tests signs and checks with a key of the test session's own."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.getbasetemp() / "config"))


def _plant(run: Path, meta: dict) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "meta.json").write_text(json.dumps({"tool": {"name": "ciuic-doctor"}, **meta}))
    return run


def _marker_argv(marker: Path) -> list[str]:
    return ["-m", "timeit", "-n", "1", "-r", "1", f"open({str(marker)!r}, 'w').close()"]


# ---- the signature ------------------------------------------------------------------------------------
def test_the_key_is_private_and_refused_when_it_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    key = trust.load_key(create=True)
    path = tmp_path / "ciuic-doctor" / "key"
    assert len(key) == trust.KEY_BYTES
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    assert trust.load_key(create=True) == key  # made once
    path.chmod(0o644)
    with pytest.raises(trust.KeyRefused, match="lets others read"):
        trust.load_key()
    path.chmod(0o600)
    path.rename(tmp_path / "elsewhere")
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(trust.KeyRefused, match="symlink"):
        trust.load_key()
    values = {"argv": ["t.py"], "cwd": "/", "nproc": 1}
    assert trust.signature("watch", values) is None  # a refused key signs nothing


def test_a_planted_meta_json_never_runs_without_yes(tmp_path):
    """The issue's one-line meta.json: nothing starts, one line, exit 2; with --yes it runs."""
    marker = tmp_path / "marker"
    run = _plant(tmp_path / "run", {"probes": {"watch": {"argv": _marker_argv(marker)}}})
    done = run_cli("verify", str(run), "--try", "dataloader.num_workers=2", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "not signed by you" in done.stderr
    assert "--yes" in done.stderr
    assert "timeit" in done.stderr  # the exact command line is shown
    assert len(done.stderr.strip().splitlines()) == 1
    assert not marker.exists()
    assert not (run / "verify").exists()  # nothing written either
    trust.load_key(create=True)
    forged = {"watch": {"scheme": trust.SCHEME, "mac": "0" * 64}}
    (run / "meta.json").write_text(
        json.dumps({"tool": {"name": "ciuic-doctor"}, "probes": {"watch": {"argv": _marker_argv(marker)}},
                    "signatures": forged})
    )  # fmt: skip
    done = run_cli("verify", str(run), "--try", "dataloader.num_workers=2", timeout=120)
    assert done.returncode == 2, done.stderr
    assert "does not match" in done.stderr, done.stderr
    assert not marker.exists()


def test_on_a_terminal_it_asks_and_no_runs_nothing(tmp_path):
    """stdin and stdout a terminal: the command is shown, `run it? [y/N]` asked; `n` runs nothing."""
    import pty

    marker = tmp_path / "marker"
    run = _plant(tmp_path / "run", {"probes": {"watch": {"argv": _marker_argv(marker)}}})
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", "verify", str(run), "--try", "dataloader.num_workers=2"],
        stdin=child, stdout=child, stderr=child, close_fds=True,
    )  # fmt: skip
    os.close(child)
    seen = b""
    deadline = time.monotonic() + 60
    while b"[y/N]" not in seen and time.monotonic() < deadline:
        try:
            seen += os.read(main, 4096)
        except OSError:
            break
    os.write(main, b"n\n")
    code = proc.wait(timeout=60)
    with contextlib.suppress(OSError):
        seen += os.read(main, 4096)
    os.close(main)
    assert b"timeit" in seen, seen  # the command was shown before the question
    assert b"run it? [y/N]" in seen, seen
    assert code == 2, seen
    assert b"you said no" in seen, seen
    assert not marker.exists()
    assert not (run / "verify").exists()


@pytest.mark.slow
def test_yes_runs_what_it_showed(tmp_path):
    marker = tmp_path / "marker"
    watch = {"argv": _marker_argv(marker), "cwd": str(tmp_path)}
    run = _plant(tmp_path / "run", {"probes": {"watch": watch}})
    done = run_cli("verify", str(run), "--yes", "--try", "dataloader.num_workers=2", "--max-rounds", "1",
                   "--verify-steps", "1", timeout=300)  # fmt: skip
    assert "running it as you said (--yes)" in done.stdout, done.stdout + done.stderr
    assert marker.exists()
    assert json.loads((run / "verification.json").read_text())["confirmed"]


def test_a_planted_spec_env_never_runs(tmp_path):
    """An embedded-job run whose spec exports PYTHONPATH (a sitecustomize.py that writes a marker):
    verify refuses it unsigned, with one line, and never offers the recorded PYTHONPATH."""
    marker, evil = _evil(tmp_path)
    spec = {"optim": {}, "distributed": {"env": {"PYTHONPATH": str(evil), "NCCL_ALGO": "Ring"}}}
    run = _plant(tmp_path / "run", {"probes": {"job": {"status": "finished"}}, "spec": spec})
    done = run_cli("verify", str(run), "--try", "dataloader.num_workers=2", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "not signed" in done.stderr
    assert str(evil) not in done.stderr  # the recorded PYTHONPATH is not even offered
    assert not marker.exists()


def _evil(tmp_path: Path) -> tuple[Path, Path]:
    marker, evil = tmp_path / "marker", tmp_path / "evil"
    evil.mkdir()
    (evil / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return marker, evil


@pytest.mark.slow
def test_a_confirmed_spec_still_never_exports_pythonpath(tmp_path):
    """Even with --yes the job's ranks start without the spec's PYTHONPATH (each started process would
    have run the sitecustomize.py it points at)."""
    marker, evil = _evil(tmp_path)
    spec = {"optim": {}, "job": {"procs_per_node": 1}, "distributed": {"env": {"PYTHONPATH": str(evil)}}}
    run = _plant(tmp_path / "run", {"probes": {"job": {"status": "finished"}}, "spec": spec})
    done = run_cli("verify", str(run), "--yes", "--try", "dataloader.num_workers=0", "--max-rounds", "1",
                   "--verify-steps", "1", timeout=600)  # fmt: skip
    assert "[distributed.env]: not exported: PYTHONPATH" in done.stdout + done.stderr
    assert list(run.glob("verify/*/r01-A/steps.rank0.jsonl")), done.stdout + done.stderr  # it ran
    assert not marker.exists()


def test_a_spec_file_or_set_never_exports_a_refused_name(tmp_path, capsys):
    """`job --spec` / `checkup --spec` / `--set` build every spec in one place: a refused name is dropped
    and said once, in one line, however often the spec is rebuilt."""
    from ciuic_doctor.jobs.spec import load_spec, with_updates

    toml = tmp_path / "spec.toml"
    toml.write_text('[distributed.env]\nLD_PRELOAD = "/tmp/x.so"\nBASH_ENV = "/tmp/rc"\nNCCL_ALGO = "Ring"\n')
    spec = load_spec(toml)
    spec = with_updates(
        spec, {"distributed.env.PYTHONPATH": "/tmp/p", "distributed.env.OMP_NUM_THREADS": "2"}
    )
    spec = with_updates(spec, {"distributed.env.PYTHONPATH": "/tmp/p"})
    assert spec.distributed.env == {"NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "2"}
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        line
        for line in err
        if "not exported: BASH_ENV, LD_PRELOAD" in line or "not exported: PYTHONPATH" in line
    ]
    assert len(err) == 2, err


def test_report_never_hands_on_a_refused_variable(tmp_path):
    """A recorded spec holding LD_PRELOAD / PYTHONPATH / PROMPT_COMMAND: recommended.toml and .env carry
    none of them, and the report says so once."""
    env = {"LD_PRELOAD": "/tmp/x.so", "PYTHONPATH": "/tmp/p", "PROMPT_COMMAND": "id", "NCCL_ALGO": "Ring"}
    run = _plant(tmp_path / "run", {"spec": {"optim": {}, "distributed": {"env": env}}})
    steps = [{"schema": 1, "t": 1.0 + i, "rank": 0, "step": i, "loss": 1.0} for i in range(1, 6)]
    (run / "steps.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    done = run_cli("report", str(run), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    written = (run / "recommended.toml").read_text() + (run / "recommended.env").read_text()
    for name in ("LD_PRELOAD", "PYTHONPATH", "PROMPT_COMMAND"):
        assert name not in written
    assert done.stderr.count("not exported: LD_PRELOAD, PROMPT_COMMAND, PYTHONPATH") == 1, done.stderr


@pytest.mark.parametrize("nproc", ['"abc"', "Infinity", "0", "64", "-1", "true"])
def test_a_recorded_rank_count_is_checked(tmp_path, nproc):
    run = tmp_path / "run"
    run.mkdir()
    (run / "meta.json").write_text(
        '{"tool": {"name": "ciuic-doctor"}, '
        f'"probes": {{"watch": {{"argv": ["t.py"], "nproc": {nproc}}}}}}}'
    )
    done = run_cli("verify", str(run), "--yes", "--try", "dataloader.num_workers=2", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not (run / "verify").exists()


def test_verify_writes_nothing_through_a_planted_symlink(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    spec = {"optim": {}}
    run = _plant(tmp_path / "run", {"probes": {"job": {"status": "finished"}}, "spec": spec})
    (run / "verify").symlink_to(elsewhere)
    done = run_cli("verify", str(run), "--yes", "--try", "dataloader.num_workers=2", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "symlink" in done.stderr, done.stdout + done.stderr
    assert list(elsewhere.iterdir()) == []


def test_a_folder_others_may_write_is_refused(tmp_path):
    run = _plant(tmp_path / "run", {"probes": {"watch": {"argv": ["t.py"]}}})
    run.chmod(0o777)
    done = run_cli("verify", str(run), "--try", "dataloader.num_workers=2", timeout=120)
    assert done.returncode == 2, done.stderr
    assert "writable by group or others" in done.stderr, done.stderr


# ---- a signed run, re-run for real -------------------------------------------------------------------
@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> Path:
    """A run `watch` recorded for this user (with the key every process of the module uses)."""
    base = tmp_path_factory.getbasetemp()
    run = tmp_path_factory.mktemp("signed") / "run"
    env = {"XDG_CONFIG_HOME": str(base / "config")}
    done = run_cli("watch", "--steps", "3", "--out", str(run), "--", str(SLEEPY), "--sleep", "0.5",
                   env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return run


def _tree(pid: int) -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)} | {pid}
    except psutil.NoSuchProcess:
        return set()


def _alive(pids: set[int]) -> set[int]:
    import psutil

    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _verify_until_running(run: Path) -> tuple[subprocess.Popen, set[int]]:
    """Start `verify RUN` (stdin not a terminal: it cannot ask) and wait for its first run's steps."""
    before = set(run.glob("verify/*/r01-A/steps.rank0.jsonl"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", "verify", str(run), "--try", "dataloader.num_workers=0",
         "--verify-steps", "200", "--budget", "600"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if set(run.glob("verify/*/r01-A/steps.rank0.jsonl")) - before:
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("verify's first run recorded no step in 240 s")
    tree = _tree(proc.pid)
    assert len(tree) >= 3, tree  # verify, watch (the script), the sentinel
    return proc, tree


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signed_run_verifies_unasked_and_its_runs_die_with_verify(signed, sig):
    """No --yes, no terminal: a run this user's watch recorded starts at once. SIGTERM or kill -9 of
    verify then leaves no process of its tree (PR_SET_PDEATHSIG for the run, the sentinel follows)."""
    assert trust.check(json.loads((signed / "meta.json").read_text()), "watch") is None
    proc, tree = _verify_until_running(signed)
    proc.send_signal(sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _alive(tree)
    assert not left, [(p, Path(f"/proc/{p}/cmdline").read_bytes()) for p in left]


@pytest.mark.slow
def test_a_planted_recommendations_json_chooses_nothing(signed, tmp_path):
    """In a run this user signed, a recommendations.json someone put there (a variable that loads code, a
    setting of their choice) is replaced by verify's own report: neither is tried."""
    marker, evil = _evil(tmp_path)
    planted = [
        {"setting": "PYTHONPATH", "value": str(evil), "change": True, "evidence": {}},
        {"setting": "dataloader.num_workers", "value": 7, "change": True, "evidence": {}},
    ]
    (signed / "recommendations.json").write_text(json.dumps({"recommendations": planted}))
    done = run_cli("verify", str(signed), "--budget", "300", "--verify-steps", "1", "--max-rounds", "1",
                   timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    tried = json.loads((signed / "verification.json").read_text())["candidates"]
    labels = " ".join(c["label"] for c in tried)
    assert "PYTHONPATH" not in labels
    assert "num_workers=7" not in labels
    assert "PYTHONPATH" not in (signed / "recommendations.json").read_text()
    assert not marker.exists()


@pytest.mark.slow
def test_the_budget_holds_from_the_first_run(tmp_path):
    run = _plant(tmp_path / "run", {"probes": {"watch": {"argv": [str(SLEEPY), "--hang"]}}})
    began = time.monotonic()
    done = run_cli("verify", str(run), "--yes", "--budget", "20", "--try", "dataloader.num_workers=2",
                   timeout=200)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ran out before the first round ended" in done.stderr
    assert time.monotonic() - began < 60


@pytest.mark.slow
def test_a_failed_jobs_last_line_reaches_the_terminal_escaped(tmp_path):
    script = tmp_path / "noisy.py"
    # No newline: watch's closing line lands on the same line, so the escapes are in the last line.
    script.write_text("import sys\nsys.stdout.write('boom \\x1b[2J\\x1b]0;title\\x07 end')\nsys.exit(3)\n")
    run = _plant(tmp_path / "run", {"probes": {"watch": {"argv": [str(script)]}}})
    done = run_cli("verify", str(run), "--yes", "--try", "dataloader.num_workers=2", timeout=200)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "boom \\x1b[2J" in done.stderr
    assert "\x1b" not in done.stdout + done.stderr
    assert "\x07" not in done.stdout + done.stderr


# ---- watch leaves the model as it was ----------------------------------------------------------------
@pytest.mark.slow
def test_a_watched_moe_model_saves_pickles_and_deep_copies(tmp_path):
    done = run_cli("watch", "--out", str(tmp_path / "run"), "--", str(SCRIPTS / "moe_copies.py"), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "hooks on the model: 2" in out  # watch's hooks were there: embedding and router
    assert "torch.save ok" in out
    assert "torch.load ok, hooks on the loaded model: 0" in out
    assert "pickle ok, mentions ciuic: False" in out  # loads where ciuic_doctor is not installed
    assert "deepcopy + EMA update ok, hooks on the copy: 0" in out


# ---- the exporter ------------------------------------------------------------------------------------
def _other_address() -> str | None:
    try:
        text = subprocess.run(
            ["ip", "-4", "-o", "addr"], check=False, capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in text.splitlines():
        parts = line.split()
        if "inet" in parts:
            addr = parts[parts.index("inet") + 1].split("/")[0]
            if not addr.startswith("127."):
                return addr
    return None


def _answers(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=2):
            return True
    except OSError:
        return False


def test_export_answers_on_loopback_only(tmp_path):
    other = _other_address()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    exporter = subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", "export", "--pid", str(job.pid), "--port", str(port),
         "--duration", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _answers("127.0.0.1", port) and time.monotonic() < deadline:
            assert exporter.poll() is None, exporter.stdout.read()
            time.sleep(0.3)
        assert _answers("127.0.0.1", port)
        assert not _answers(other, port), f"the exporter answered on {other}"
    finally:
        exporter.terminate()
        job.kill()
        exporter.wait(timeout=30)
        job.wait()
