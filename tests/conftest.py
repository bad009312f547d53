"""Shared fixtures: run the real CLI in a real subprocess, the way a user or torchrun would."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str


def run_cli(
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = False,
) -> Completed:
    """`python -m ciuic_doctor <args>` in a fresh process; returns code and output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("CIUIC_RUN_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "ciuic_doctor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
        check=False,
    )
    result = Completed(proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return result


def torchrun(
    *args: str, nproc: int = 2, timeout: float = 180, env: dict[str, str] | None = None
) -> Completed:
    """`torchrun --standalone --nproc-per-node N -m ciuic_doctor <args>` as a user would type it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("CIUIC_RUN_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "ciuic_doctor", *args],
        capture_output=True, text=True, timeout=timeout, env=full_env, check=False,
    )  # fmt: skip
    return Completed(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def sleeper():
    """A real child process that idles (up to 120 s) until the test ends; it is killed afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    proc.stdout.readline()
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def run_path(tmp_path: Path) -> Path:
    """A not-yet-existing run directory path inside the test's temp dir."""
    return tmp_path / "run"
