"""`report` and `analyze` on a terminal: a status line names each stage as it starts (each analysis, then
the page) and is cleared at the end; through a pipe or into a log they write nothing more than before."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time

import pytest

from tests import scalesynth
from tests.conftest import run_cli

TIMEOUT_S = 300  # seconds alone; generous for a loaded 2-core machine


@pytest.fixture(scope="module")
def run_path(tmp_path_factory):
    return scalesynth.generate(tmp_path_factory.mktemp("progress") / "run", scalesynth.gpu_plan(8, 120))


def _on_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run `python -m ciuic_doctor ARGS` with stderr on a pseudo-terminal: (exit, stdout, the terminal's).
    stdout goes to a file: a pipe nobody reads while the terminal is read could fill and stall the child."""
    controller, terminal = os.openpty()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    out = tempfile.TemporaryFile()  # noqa: SIM115 (read and closed below)
    argv = [sys.executable, "-m", "ciuic_doctor", *args]
    proc = subprocess.Popen(argv, stdout=out, stderr=terminal, env=env)
    os.close(terminal)
    seen, deadline = b"", time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if not select.select([controller], [], [], 1.0)[0]:
            continue
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    else:
        proc.kill()
    os.close(controller)
    code = proc.wait(timeout=TIMEOUT_S)
    with out:
        out.seek(0)
        return code, out.read().decode(), seen.decode()


@pytest.mark.parametrize("command", ["report", "analyze"])
def test_a_terminal_sees_each_stage_and_the_line_is_cleared(run_path, command):
    extra = ["--reanalyze", "--quiet"] if command == "report" else []
    code, stdout, terminal = _on_a_terminal(command, str(run_path), *extra)
    assert code in (0, 1), terminal
    stages = [part.split(" · ")[0] for part in terminal.split("\r\x1b[K") if part]
    analyses = [s for s in stages if s.startswith(f"{command}: analysing ")]
    assert f"{command}: analysing memory" in " ".join(analyses)
    count = len(analyses)
    assert analyses[-1].endswith(f"({count}/{count})")  # numbered, every applicable analysis once
    assert (f"{command}: building the page" in stages) == (command == "report")
    assert terminal.endswith("\r\x1b[K")  # the line is gone when the command ends
    assert "\x1b" not in stdout  # the findings and paths go to stdout as they did


def test_through_a_pipe_nothing_is_added(run_path):
    done = run_cli("report", str(run_path), "--reanalyze", "--quiet", timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "report.html" in done.stdout
