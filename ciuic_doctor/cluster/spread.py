"""One torchrun per node of an allocation, as one job step (or, from a login node, one batch job).

This is torchrun's documented multi-node pattern (reference/slurm.md): `srun --ntasks-per-node=1
torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID`, HOST
the first node of `scontrol show hostnames`. The rendezvous port is a fresh free one per run: two runs
of one allocation, or two nodes sharing one host (the test cluster), must never meet on one port.

`run` keeps the time waiting for resources apart from the time running; Ctrl-C or SIGTERM while a run
is on cancels its step or job (scancel) before the signal goes on: nothing of it stays in the queue.
kill -9 runs no code of ours: a step's srun is armed to end with its parent (cluster/slurm.py), and a
batch job, whose sbatch --wait does not cancel it, watches a heartbeat file the waiting process touches
every HEARTBEAT_S: unchanged for STALE_S (by the node's own clock), the job cancels itself.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ciuic_doctor.cluster.base import Allocation, BatchOptions, Scheduler, StepResult
from ciuic_doctor.errors import ProbeFailed

POLL_S = 0.5  # how often the queue is asked whether a run has started; ~1 squeue call a second at most
CANCEL_WAIT_S = 10.0  # srun/sbatch end within this after scancel (KillWait is 30 s by default, 5 s in tests)
HEARTBEAT_S = 2.0  # a batch run's heartbeat file is touched this often while its submitter waits
# a batch job whose heartbeat has not changed for this long cancels itself: past NFS's default attribute
# cache (acregmax 60 s), so a compute node that sees a change late never takes a live submitter for dead
STALE_S = 120


class Cancelled(ProbeFailed):
    """Stopped by a signal; the steps and jobs started are cancelled. Exit 128 + the signal's number."""

    def __init__(self, sig: int, ids: list[str]) -> None:
        what = f"; cancelled {', '.join(ids)}" if ids else ""
        super().__init__(f"stopped by {signal.Signals(sig).name}{what}; every record measured so far is kept")
        self.exit_code = 128 + int(sig)


def free_port() -> int:
    """A TCP port nothing on this host listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@dataclass(kw_only=True)
class Spread:
    """How to run a ciuic-doctor command on `nnodes` nodes x `nproc_per_node` ranks through `scheduler`:
    as steps of `alloc`, or (alloc None) as batch jobs with `batch`'s options."""

    scheduler: Scheduler
    alloc: Allocation | None
    nnodes: int
    nproc_per_node: int
    batch: BatchOptions | None = None
    overlap: bool = False  # share CPUs with steps already running (checkup's memwatch beside the job)

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    def describe(self) -> str:
        where = f"Slurm job {self.alloc.job_id}" if self.alloc else "a Slurm batch job per run"
        return f"{self.nnodes} node(s) x {self.nproc_per_node} rank(s) of {where}"

    def torchrun(self, endpoint: str, rdzv_id: str) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nnodes),
            "--nproc-per-node", str(self.nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
        ]  # fmt: skip

    def new_name(self, what: str) -> str:
        """A step or job name no other run has: how our runs are found in squeue and cancelled."""
        return f"ciuic-{what}-{uuid.uuid4().hex[:8]}"

    def run(
        self,
        tail: list[str],
        *,
        name: str,
        env: dict[str, str],
        log: Any,
        timeout_s: float,
        cwd: str | None = None,
        batch_dir: Path | None = None,
    ) -> StepResult:
        """`torchrun <tail>` on every node (tail: `-m ciuic_doctor job ...`); waits for its end."""
        if self.alloc is not None:
            endpoint = f"{self.scheduler.address(self.alloc.nodes[0])}:{free_port()}"
            argv = [*self.torchrun(endpoint, f"{self.alloc.job_id}-{name}"), *tail]
            proc = self.scheduler.start_step(
                self.alloc,
                argv,
                name=name,
                env=env,
                log=log,
                nodes=self.nnodes,
                overlap=self.overlap,
                cwd=cwd,
            )
            return self.wait(proc, name, timeout_s, job_id=self.alloc.job_id)
        if self.batch is None or batch_dir is None:
            raise ValueError("a batch run needs batch options and a folder for its script")
        script = write_batch_script(batch_dir / f"{name}.sh", self, tail, cwd=cwd)
        heartbeat = heartbeat_path(script)
        os.close(os.open(heartbeat, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))  # new
        try:
            proc = self.scheduler.submit_batch(script, self.batch, name=name, env=env, log=log)
            return self.wait(proc, name, timeout_s, job_id=None, heartbeat=heartbeat)
        finally:
            heartbeat.unlink(missing_ok=True)

    def wait(
        self,
        proc: subprocess.Popen,
        name: str,
        timeout_s: float,
        *,
        job_id: str | None,
        heartbeat: Path | None = None,
    ) -> StepResult:
        """Wait for `proc` (srun or sbatch --wait); `timeout_s` counts running time only. `heartbeat`:
        a batch run's file, touched every HEARTBEAT_S while we wait (the job's watchdog reads it).

        SIGTERM is turned into Cancelled while we wait (main thread only), so the step is cancelled on
        the way out exactly as on Ctrl-C.
        """
        queued = time.monotonic()
        started: float | None = None
        next_poll = next_beat = queued
        previous = _raise_on_sigterm()
        try:
            while True:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.1)
                    break
                now = time.monotonic()
                if heartbeat is not None and now >= next_beat:
                    next_beat = now + HEARTBEAT_S
                    with contextlib.suppress(OSError):
                        os.utime(heartbeat, follow_symlinks=False)
                if started is None and now >= next_poll:
                    next_poll = now + POLL_S
                    with contextlib.suppress(ProbeFailed, Exception):
                        if self.scheduler.running_since(name, job_id):
                            started = now
                if started is not None and now - started > timeout_s:
                    self._cancel(proc, name, job_id)
                    return StepResult(exit_code=None, queue_s=started - queued, run_s=now - started)
        except BaseException as exc:
            ids = self._cancel(proc, name, job_id)
            if isinstance(exc, _Term):
                raise Cancelled(signal.SIGTERM, ids) from None
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise
        finally:
            _restore(previous)
        ended = time.monotonic()
        begun = started if started is not None else queued
        return StepResult(exit_code=proc.returncode, queue_s=begun - queued, run_s=ended - begun)

    def _cancel(self, proc: subprocess.Popen, name: str, job_id: str | None) -> list[str]:
        """scancel our step or job, then wait for srun/sbatch to end (SIGKILL past CANCEL_WAIT_S)."""
        ids: list[str] = []
        with contextlib.suppress(Exception):
            ids = self.scheduler.ids_named(name, job_id)
            self.scheduler.cancel(ids)
        if proc.poll() is None and not ids:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()  # not queued yet: srun still asks for resources; it withdraws on SIGTERM
        deadline = time.monotonic() + CANCEL_WAIT_S
        try:
            proc.wait(timeout=CANCEL_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        # a cancelled job stays listed while its tasks end (COMPLETING): return once it has left the queue
        while ids and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if not self.scheduler.ids_named(name, job_id):
                    break
            time.sleep(0.2)
        return ids


class _Term(BaseException):
    """SIGTERM arrived while a step ran (a BaseException, so no `except Exception` swallows it)."""


def _raise_on_sigterm() -> Any:
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise _Term()

    return signal.signal(signal.SIGTERM, handler)


def _restore(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def heartbeat_path(script: Path) -> Path:
    return script.with_suffix(".alive")


def _watchdog(heartbeat: Path) -> list[str]:
    """Lines of the batch script: a background loop that cancels the job once `heartbeat`'s mtime has not
    changed for STALE_S of this node's clock (two hosts' clocks may differ); it ends with the script (a
    scheduler without cgroups would leave it running)."""
    return [
        "# the verify waiting for this run touches this file; killed (kill -9 runs none of its code), the",
        "# file stops changing and the run cancels itself",
        f"alive={shlex.quote(str(heartbeat))}",
        "(",
        "  last=; since=$SECONDS",
        "  while sleep 2 && kill -0 $$; do",
        '    now=$(stat -c %Y "$alive" 2>/dev/null || echo gone)',
        '    if [ "$now" != "$last" ]; then last=$now; since=$SECONDS',
        f"    elif [ $((SECONDS - since)) -ge {STALE_S} ]; then",
        f'      echo "ciuic-doctor: the verify that started this run is gone (no heartbeat for {STALE_S} s): '
        'cancelling it" >&2',
        '      scancel "$SLURM_JOB_ID"; exit 0',
        "    fi",
        "  done",
        ") &",
        "watchdog=$!",
        "trap 'kill $watchdog 2>/dev/null' EXIT",
    ]


def write_batch_script(path: Path, spread: Spread, tail: list[str], *, cwd: str | None) -> Path:
    """The batch script of one run: torchrun on every node of its own allocation, rendezvous on the first,
    and a watchdog that cancels the job when the process waiting for it is gone."""
    port = free_port()
    rdzv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(spread.nnodes),
        "--nproc-per-node", str(spread.nproc_per_node), "--rdzv-backend", "c10d",
    ]  # fmt: skip
    quoted = " ".join(shlex.quote(a) for a in rdzv)
    lines = [
        "#!/bin/bash",
        "# written by ciuic-doctor verify: one run of the job, one torchrun per node",
        "set -e",
        *_watchdog(heartbeat_path(path)),
        *([f"cd {shlex.quote(cwd)}"] if cwd else []),
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "addr=$(scontrol show node \"$head\" -o | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')",
        f'srun --ntasks-per-node=1 {quoted} --rdzv-endpoint "${{addr:-$head}}:{port}" '
        f'--rdzv-id "$SLURM_JOB_ID" {" ".join(shlex.quote(a) for a in tail)}',
    ]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o700)
    return path
