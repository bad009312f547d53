"""loader-sweep with real DataLoader workers: a known best is found, budgets hold, failures never hang.

The datasets at the top are imported by the CLI under test (`--dataset test_loader_sweep:...`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, run_cli
from torch.utils.data import Dataset, get_worker_info

from ciuic_doctor.analysis.loader import checks as _loader_checks
from ciuic_doctor.cli import main
from ciuic_doctor.machine.envinfo import cpu_budget
from ciuic_doctor.probes.loader.datasets import SyntheticDataset
from ciuic_doctor.probes.loader.measure import LoaderConfig, Plan, measure
from ciuic_doctor.rundir.store import RunDir

TESTS = str(REPO / "tests")
PID_FILE_ENV = "LOADER_TEST_PID_FILE"


def _note_pid() -> None:
    with open(os.environ[PID_FILE_ENV], "a") as fh:
        fh.write(f"{os.getpid()}\n")


class BrokenDataset(Dataset):
    """Hangs forever in the main process (num_workers=0); kills its worker with SIGSEGV otherwise."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        _note_pid()
        if get_worker_info() is None:
            threading.Event().wait()  # a hang no exception can interrupt from outside
        os.kill(os.getpid(), signal.SIGSEGV)
        raise AssertionError("unreachable")


def broken_dataset() -> Dataset:
    return BrokenDataset()


def not_a_dataset() -> list[int]:
    return [1, 2, 3]


def tiny_dataset() -> Dataset:
    return SyntheticDataset(num_samples=3)


class HangInWorker(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        if get_worker_info() is not None:
            _note_pid()
            threading.Event().wait()
        return torch.zeros(4)


class PythonObjects(Dataset):
    """Samples index a big list of Python strings: reading them writes their refcounts, which copies
    the pages into each worker (copy-on-read): USS grows, RSS does not."""

    def __init__(self, chunk: int = 5000, chunks: int = 96) -> None:
        self.chunk = chunk
        self.items = [f"token-{i:08d}-payload" for i in range(chunk * chunks)]

    def __len__(self) -> int:
        return len(self.items) // self.chunk

    def __getitem__(self, index: int) -> torch.Tensor:
        part = self.items[index * self.chunk : (index + 1) * self.chunk]
        return torch.tensor([sum(len(s) for s in part)])


def spec_file(tmp_path: Path, num_workers: int = 0) -> str:
    path = tmp_path / "job.toml"
    prefetch = "" if num_workers == 0 else "prefetch_factor = 2\n"
    path.write_text(f"[dataloader]\nnum_workers = {num_workers}\n{prefetch}persistent_workers = false\n")
    return str(path)


def loader_records(run_path: Path) -> list[dict]:
    return RunDir.open(run_path).read("loader").records


def test_finds_that_one_worker_beats_none_within_both_budgets(tmp_path, run_path):
    """Samples cost 8 × 3 ms of CPU per batch and the modelled accelerator step waits 30 ms with the CPU
    free. Without workers loading and step add up; one worker overlaps them, which holds however slow a
    shared core makes the loading. With the local world size set to the CPU count, the CPU budget is
    exactly 1 worker per rank on any machine, so the best within budget is known: num_workers=1."""
    usable = cpu_budget()["usable"]
    budget_s = 6.0
    got = run_cli(
        "loader-sweep", "--sample-cost-ms", "3", "--sample-bytes", "16K", "--batch-size", "8",
        "--step-ms", "30", "--prefetch", "1,2,4", "--local-world-size", str(usable),
        "--budget", str(budget_s), "--spec", spec_file(tmp_path), "--out", str(run_path), timeout=120,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    records = loader_records(run_path)
    header = next(r for r in records if r["kind"] == "sweep")
    measures = [r for r in records if r["kind"] == "measure"]
    assert header["cpu_budget_per_rank"] == 1
    assert header["workers"] == [0, 1]
    assert {r["num_workers"] for r in measures} == {0, 1}  # the CPU budget per rank holds
    # Successive halving dropped configurations instead of measuring the whole grid every round.
    rounds = [r for r in records if r["kind"] == "round"]
    assert rounds[0]["dropped"]
    assert len(measures) < len(header["configs"]) * (len(rounds) + 1)
    # The time budget holds: no measurement starts after it is spent.
    assert all(r["started_s"] < budget_s for r in measures if r["status"] != "skipped")
    throughput = json.loads(
        run_cli("analyze", str(run_path), "--json", check=True).stdout,
    )
    found = next(f for f in throughput if f["check"] == "loader_throughput")
    assert found["evidence"]["recommended"]["num_workers"] == 1
    w0 = next(c for c in found["evidence"]["configs"] if c["config"] == "w0")
    assert w0["samples_per_s"] < 0.9 * found["evidence"]["recommended"]["samples_per_s"]
    assert "recommended" in got.stdout
    assert "round 1 done" in got.stdout


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_crashing_and_hanging_datasets_are_reported_not_hung_on(tmp_path, run_path):
    """num_workers=0 hangs in the measuring process itself (only the watchdog can end it); the worker of
    num_workers=1 dies of SIGSEGV (DataLoader's SIGCHLD handler reports it). Both become records, the
    command exits 1 with one FAILED line, and no process of theirs is left behind."""
    pid_file = tmp_path / "pids"
    got = run_cli(
        "loader-sweep", "--dataset", "test_loader_sweep:broken_dataset", "--workers", "0,1",
        "--prefetch", "2", "--timeout", "1", "--budget", "30", "--spec", spec_file(tmp_path),
        "--out", str(run_path), env={"PYTHONPATH": TESTS, PID_FILE_ENV: str(pid_file)}, timeout=90,
    )  # fmt: skip
    assert got.returncode == 1, got.stderr
    # (torch's segfault handler in the worker prints its own line, with a stray NUL, before ours)
    last = got.stderr.replace("\x00", "").strip().splitlines()[-1]
    assert last.startswith("ciuic-doctor loader-sweep: FAILED: 2 measurement")
    assert "Traceback" not in got.stderr
    status = {r["config"]: r for r in loader_records(run_path) if r["kind"] == "measure"}
    assert status["w0"]["status"] == "timeout"
    assert "watchdog" in status["w0"]["error"]
    assert status["w1-p2"]["status"] == "worker_crashed"
    pids = {int(line) for line in pid_file.read_text().split()}
    assert len(pids) >= 2
    assert all(_dead(pid) for pid in pids)


def test_a_hanging_worker_hits_the_dataloader_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv(PID_FILE_ENV, str(tmp_path / "pids"))
    result = measure(
        HangInWorker(),
        LoaderConfig(num_workers=1, prefetch_factor=2),
        Plan(batch_size=4, window_s=0.2, timeout_s=1),
    )
    assert result["status"] == "timeout"
    assert "DataLoader timed out after 1" in result["error"]
    assert all(_dead(int(pid)) for pid in (tmp_path / "pids").read_text().split())


def test_copy_on_read_growth_shows_in_uss_not_rss():
    """A real copy-on-read: the worker's USS grows by the strings it touched while RSS stays put; the
    growth check warns on that record and passes on a dataset of tensors."""
    objects = measure(
        PythonObjects(),
        LoaderConfig(num_workers=1, prefetch_factor=2),
        Plan(batch_size=4, window_s=0.1, min_groups=20),
    )
    assert objects["status"] == "ok", objects
    assert objects["worker_uss_growth_bytes"] > 16 << 20
    assert objects["worker_rss_growth_bytes"] < objects["worker_uss_growth_bytes"] / 2
    tensors = measure(
        SyntheticDataset(sample_bytes=4096),
        LoaderConfig(num_workers=1, prefetch_factor=2),
        Plan(batch_size=4, window_s=0.1, min_groups=20),
    )
    assert tensors["status"] == "ok", tensors
    assert tensors["worker_uss_growth_bytes"] < objects["worker_uss_growth_bytes"] / 4

    def check(result):
        record = {
            "kind": "measure",
            "status": "ok",
            "config": "w1-p2",
            "num_workers": 1,
            "prefetch_factor": 2,
            **result,
        }
        return _loader_checks.growth_finding({}, [record]).verdict

    assert check(objects) == "warn"
    assert check(tensors) == "pass"


def test_a_bad_dataset_path_is_one_line_and_exit_2(run_path):
    got = run_cli("loader-sweep", "--dataset", "no_such_module_xyz:build", "--out", str(run_path), timeout=60)
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        "ciuic-doctor loader-sweep: error: --dataset no_such_module_xyz:build: cannot import "
        "'no_such_module_xyz' (ModuleNotFoundError: No module named 'no_such_module_xyz')"
    ]
    assert not run_path.exists()  # nothing measured, nothing written


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dataset", "test_loader_sweep:not_a_dataset"], "returned list, not a torch.utils.data.Dataset"),
        (["--dataset", "test_loader_sweep:missing"], "has no attribute 'missing'"),
        (["--dataset", "test_loader_sweep"], "expected module:callable"),
        (["--dataset", "json:dumps"], "calling it raised TypeError"),
        (
            ["--dataset", "test_loader_sweep:tiny_dataset", "--batch-size", "8"],
            "3 samples, fewer than one batch",
        ),
        (["--dataset", "json:dumps", "--sample-cost-ms", "1"], "different datasets"),
        (["--workers", "1,x"], "--workers '1,x': expected whole numbers"),
        (["--prefetch", "0"], "values must be 1 or more"),
        (["--sample-bytes", "12X"], "malformed size"),
    ],
)
def test_bad_inputs_are_one_line(argv, message, run_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(TESTS)
    assert main(["loader-sweep", *argv, "--out", str(run_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert message in err[0]
    assert not run_path.exists()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_keeps_the_records_and_leaves_no_process(run_path, sig, code):
    """SIGINT (SIGTERM) once the first measurement is reported: exit 130 (143), the end record says
    interrupted, and the measuring child and its workers are gone. The budget is far beyond what the
    test waits for, so on a loaded machine the sweep cannot end before the signal lands (it did, at 20 s:
    exit 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", "loader-sweep", "--sample-cost-ms", "2", "--workers", "0,1,2",
         "--budget", "120", "--local-world-size", "1", "--out", str(run_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if "samples/s" in line:  # the first measurement is on disk; the second is running
                break
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert "kept" in err
    records = loader_records(run_path)
    assert records[-1]["kind"] == "end"
    assert records[-1]["stopped"] == "interrupted"
    assert any(r["kind"] == "measure" and r["status"] == "ok" for r in records)
    assert all(_dead(child.pid) for child in children)


def test_measure_survives_a_parent_that_ran_parallel_ops():
    """The measuring child is forked: if the parent's OpenMP pool had run (any matmul), the child's first
    parallel op (randperm of the sampler) deadlocked until the watchdog fired. Found by CI on a fresh clone,
    where earlier tests in the same process had multiplied matrices."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # a pool of at least 2, whatever this machine's core count
    try:
        x = torch.randn(512, 512)
        (x @ x).sum()
        result = measure(
            SyntheticDataset(sample_bytes=4096),
            LoaderConfig(num_workers=1, prefetch_factor=2),
            Plan(batch_size=4, window_s=0.1, min_groups=5, timeout_s=10),
        )
    finally:
        torch.set_num_threads(threads)
    assert result["status"] == "ok", result
