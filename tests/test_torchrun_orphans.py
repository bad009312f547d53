"""A rank of the embedded job killed with -9 under plain torchrun takes its helpers with it.

torchrun ends the process groups of the ranks still alive, not of the one that died; that rank's
forkserver, its two DataLoader workers (children of the forkserver) and the multiprocessing resource
tracker lived on for good. Each worker now watches the rank itself (jobs/data.die_with_rank).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{proc.pid} {' '.join(proc.cmdline())[:100]}")
    return out


def _kill(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_under_torchrun_leaves_no_forkserver_workers_or_tracker(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    log = (tmp_path / "torchrun.err").open("w")  # a file, not a pipe: orphans holding it cannot stall us
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "ciuic_doctor", "job", "--steps", "400", "--out", str(out),
         "--set", "distributed.timeout_s=10", "--set", "checkpoint.every_steps=0",
         "--set", "dataloader.num_workers=2", "--set", 'dataloader.multiprocessing_context="forkserver"'],
        stdout=subprocess.DEVNULL, stderr=log, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    tree: list[psutil.Process] = []
    try:
        steps = out / "steps.rank1.jsonl"
        deadline = time.monotonic() + 180
        while not (steps.is_file() and steps.read_text().count("\n") >= 3):
            assert proc.poll() is None, (tmp_path / "torchrun.err").read_text()[-2000:]
            assert time.monotonic() < deadline, "rank 1 never recorded 3 steps"
            time.sleep(0.3)
        tree = psutil.Process(proc.pid).children(recursive=True)
        rank1 = next(p for p in tree if p.ppid() == proc.pid and p.environ().get("RANK") == "1")
        helpers = rank1.children(recursive=True)
        names = [" ".join(p.cmdline()) for p in helpers]
        assert sum("forkserver" in n for n in names) >= 3, names  # the server and its two workers
        assert any("resource_tracker" in n for n in names), names
        os.kill(rank1.pid, signal.SIGKILL)
        proc.wait(timeout=120)
        deadline = time.monotonic() + 15
        while _alive(helpers) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _alive(helpers) == [], "the killed rank's helpers lived on"
        assert _alive(tree) == []
    finally:
        _kill([psutil.Process(proc.pid)] if proc.poll() is None else [])
        _kill(tree)
        log.close()
