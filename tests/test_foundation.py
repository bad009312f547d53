"""The run directory, units, redaction and the CLI front, with real files and real processes."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import run_cli

from ciuic_doctor.errors import UserError
from ciuic_doctor.machine import envinfo
from ciuic_doctor.rundir.findings import Finding, overall_verdict, sort_findings
from ciuic_doctor.rundir.store import RunDir, as_float
from ciuic_doctor.units import format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8", 8), ("1K", 1024), ("64M", 64 << 20), ("1G", 1 << 30), ("256KiB", 256 << 10), ("1.5k", 1536)],
)
def test_parse_size_powers_of_1024(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12X", "-1M", "M", "1.3", "ten"])
def test_parse_size_rejects_malformed(text):
    with pytest.raises(UserError, match="size"):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(64 << 20) == "64 MiB"


def test_stream_roundtrip_and_torn_last_line(tmp_path):
    run = RunDir.create(tmp_path / "r")
    # A stream without a schema (ciuic_doctor.rundir.schemas): any JSON object is a record.
    with run.writer("probe_x", rank=0) as w:
        for i in range(3):
            w.write({"i": i, "x": float("nan")})
    with open(run.stream_path("probe_x"), "a") as fh:
        fh.write('{"i": 3, "trunc')  # a crash mid-write
    got = run.read("probe_x")
    assert [r["i"] for r in got.records] == [0, 1, 2]
    assert got.skipped_lines == 1
    first = got.records[0]
    assert first["schema"] == 1
    assert first["rank"] == 0
    assert first["host"]
    assert first["t"] > 0
    assert first["x"] == "nan"
    assert as_float(first["x"]) != as_float(first["x"])


def test_non_finite_values_of_every_kind_are_stored_as_strings():
    """Python floats, NumPy scalars and 0-d tensors alike: NaN/inf never reach the file as bare NaN,
    which is not JSON, and finite values are written as numbers."""
    import numpy as np
    import torch

    from ciuic_doctor.rundir.store import dumps

    record = {"a": float("nan"), "b": [float("inf")], "c": np.float32("nan"), "d": torch.tensor(-math.inf)}
    assert json.loads(dumps(record)) == {"a": "nan", "b": ["inf"], "c": "nan", "d": "-inf"}
    assert json.loads(dumps({"x": np.int64(3), "y": torch.tensor(2.5)})) == {"x": 3, "y": 2.5}


def test_per_rank_files_are_read_in_rank_order(tmp_path):
    run = RunDir.create(tmp_path / "r")
    for rank in (10, 2, 0):
        with run.writer("steps", rank=rank, per_rank_file=True) as w:
            w.write({"step": 1})
    assert [r["rank"] for r in run.read("steps").records] == [0, 2, 10]


def test_records_survive_sigkill_of_the_writer(tmp_path):
    """A writer killed with SIGKILL mid-stream keeps every record it wrote: no buffering."""
    script = textwrap.dedent(f"""
        import time
        from ciuic_doctor.rundir.store import RunDir
        w = RunDir.create({str(tmp_path / "r")!r}).writer("steps")
        for i in range(10**6):
            w.write({{"step": i}})
            if i == 50:
                print("ready", flush=True)
            time.sleep(0.001)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    got = RunDir.open(tmp_path / "r").read("steps")
    steps = [r["step"] for r in got.records]
    assert len(steps) >= 51
    assert steps == list(range(len(steps)))
    assert got.skipped_lines <= 1


def test_meta_merges_updates(tmp_path):
    run = RunDir.create(tmp_path / "r")
    run.update_meta(env={"host": "a"})
    run.record_probe("comm-bench", status="ok")
    meta = run.update_meta(job={"steps": 5})
    assert meta["run"] == "r"
    assert meta["tool"]["name"] == "ciuic-doctor"
    assert meta["probes"]["comm-bench"]["status"] == "ok"
    assert meta["job"] == {"steps": 5}


def test_redaction_of_names_urls_and_values(monkeypatch):
    monkeypatch.setenv("MY_API_KEY", "sk-live-1234567890")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("TORCH_HUB_URL", "https://alice:pa55word@hub.example.com/x")
    envinfo._secret_values.cache_clear()
    captured = envinfo.capture(with_torch=False)
    text = json.dumps(captured)
    assert captured["env"]["NCCL_SOCKET_IFNAME"] == "eth0"
    assert "pa55word" not in text
    assert "alice" not in text
    assert envinfo.scrub("log line token=sk-live-1234567890") == "log line token=<redacted>"


def test_secret_never_reaches_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue")
    envinfo._secret_values.cache_clear()
    run = RunDir.create(tmp_path / "r")
    run.update_meta(argv=["--token", "hf_supersecretvalue"])
    with run.writer("steps") as w:
        w.write({"log": "auth with hf_supersecretvalue"})
    for path in run.path.iterdir():
        assert "hf_supersecretvalue" not in path.read_text()


def test_nccl_conf_file_is_captured(tmp_path, monkeypatch):
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_ALGO=Tree # forced by admin\nNCCL_IB_KEY=abc\n")
    monkeypatch.setenv("NCCL_CONF_FILE", str(conf))
    files = envinfo.nccl_conf_files()
    assert files[str(conf)] == {"NCCL_ALGO": "Tree", "NCCL_IB_KEY": "<redacted>"}


def test_cpu_budget_respects_affinity():
    budget = envinfo.cpu_budget()
    assert 1 <= budget["usable"] <= budget["affinity"] <= budget["logical"]


def test_findings_order_and_overall():
    fs = [
        Finding(probe="b", check="x", verdict="pass", summary=""),
        Finding(probe="a", check="y", verdict="fail", summary=""),
        Finding(probe="a", check="z", verdict="not_run", summary="no GPU"),
    ]
    assert [f.verdict for f in sort_findings(fs)] == ["fail", "pass", "not_run"]
    assert overall_verdict(fs) == "fail"
    assert overall_verdict([]) == "not_run"
    with pytest.raises(ValueError, match="verdict"):
        Finding(probe="a", check="b", verdict="ok", summary="")


def test_help_does_not_import_torch():
    code = (
        "import sys; from ciuic_doctor.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch','pandas','matplotlib','transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_help_lists_commands():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "analyze" in result.stdout


def test_user_errors_are_one_line_with_exit_2(tmp_path):
    result = run_cli("analyze", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "no such run directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_folder_that_is_no_run_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a run")
    result = run_cli("analyze", str(tmp_path))
    assert result.returncode == 2
    assert "not a run directory" in result.stderr
    assert not (tmp_path / "findings.json").exists()


def test_unknown_command_is_a_usage_error():
    result = run_cli("no-such-command")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_env_command_redacts(monkeypatch):
    result = run_cli("env", "--no-torch", env={"NCCL_TOKEN_X": "abcdefgh", "NCCL_DEBUG": "INFO"})
    data = json.loads(result.stdout)
    assert data["env"]["NCCL_TOKEN_X"] == "<redacted>"
    assert data["env"]["NCCL_DEBUG"] == "INFO"
    assert "abcdefgh" not in result.stdout
    assert os.environ.get("NCCL_TOKEN_X") is None


RANK_EXIT = textwrap.dedent(
    """
    import atexit, pathlib, sys
    from ciuic_doctor.launch import exit_rank_process, init_distributed

    if sys.argv[2] == "rank":
        init_distributed(60)
    atexit.register(lambda: pathlib.Path(sys.argv[1]).write_text("atexit ran"))
    sys.stdout.write("buffered line\\n")  # stdout is a pipe: block-buffered until flushed
    exit_rank_process(7)
    print("exit_rank_process returned")
    """
)


@pytest.mark.parametrize("role", ["rank", "plain"])
def test_a_rank_leaves_without_teardown_but_runs_atexit_and_flushes(tmp_path, role):
    """A process that made a process group ends inside exit_rank_process with the given code, its atexit
    handlers run and its buffered output kept; any other process gets control back."""
    marker = tmp_path / "marker"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0"}
    env.update(WORLD_SIZE="1", LOCAL_RANK="0")
    env.pop("PYTHONUNBUFFERED", None)
    argv = [sys.executable, "-c", RANK_EXIT, str(marker), role]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert "buffered line" in proc.stdout
    if role == "rank":
        assert proc.returncode == 7, proc.stderr
        assert marker.read_text() == "atexit ran"
        assert "returned" not in proc.stdout
    else:
        assert proc.returncode == 0, proc.stderr
        assert "exit_rank_process returned" in proc.stdout


COMMAND_EXIT = textwrap.dedent(
    """
    import atexit, pathlib, sys
    from ciuic_doctor import launch

    if sys.argv[2] != "no-arrow":
        import pyarrow.parquet  # noqa: F401  (a report's or compact's reads load it)
    if sys.argv[2] == "watch":
        launch.note_user_code()
    atexit.register(lambda: pathlib.Path(sys.argv[1]).write_text("atexit ran"))


    class Teardown:
        def __del__(self):  # a module global: finalized only by the interpreter's teardown
            print("torn down")


    kept = Teardown()
    sys.stdout.write("buffered line\\n")
    import threading, time

    def late():  # a thread that is not a daemon: Python's exit waits for it, so this one does too
        time.sleep(0.3)
        print("thread finished")

    threading.Thread(target=late).start()
    launch.exit_command_process(3)
    print("exit_command_process returned")
    """
)


@pytest.mark.parametrize("role", ["arrow", "no-arrow", "watch"])
def test_a_command_that_loaded_arrow_skips_the_teardown_its_thread_pools_abort_in(tmp_path, role):
    """A command process with pyarrow loaded ends in exit_command_process (atexit run, output flushed,
    no interpreter teardown, where Arrow's pools abort now and then); without pyarrow, or after running
    a user's script under watch, Python's own exit follows."""
    marker = tmp_path / "marker"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    argv = [sys.executable, "-c", COMMAND_EXIT, str(marker), role]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert "buffered line" in proc.stdout
    assert "thread finished" in proc.stdout
    assert proc.returncode == (3 if role == "arrow" else 0), proc.stderr
    if role == "arrow":
        assert marker.read_text() == "atexit ran"
        assert "returned" not in proc.stdout
        assert "torn down" not in proc.stdout
    else:
        assert "exit_command_process returned" in proc.stdout
        assert "torn down" in proc.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
