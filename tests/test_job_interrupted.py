"""Ctrl-C of `ciuic-doctor job` exits 130 and meta.json says `interrupted` (README's statuses), not
`failed`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.slow
def test_ctrl_c_of_job_records_interrupted(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", "job", "--nproc", "2", "--steps", "400", "--out", str(out),
         "--set", "checkpoint.every_steps=0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        steps = out / "steps.rank1.jsonl"
        deadline = time.monotonic() + 180
        while not (steps.is_file() and steps.read_text().count("\n") >= 3):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "rank 1 never recorded 3 steps"
            time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["probes"]["job"]["status"] == "interrupted"
