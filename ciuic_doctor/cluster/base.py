"""The scheduler interface: what ciuic-doctor needs of Slurm (or Kubernetes, torchx) and nothing more.

An allocation is a set of nodes held for one job; a step is a command run on some of its nodes (one
task per node here: a torchrun, a memwatch); a batch job is a script queued for an allocation of its
own. Queue time is kept apart from run time everywhere: on a busy cluster a run may wait longer than it
runs, and a budget that counted the wait would try fewer changes for no fault of the job.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(kw_only=True)
class Allocation:
    """A running allocation: its job id and its nodes in the scheduler's order (the first hosts the
    rendezvous, by torchrun's documented convention)."""

    job_id: str
    nodes: list[str]
    partition: str | None = None


@dataclass(kw_only=True)
class BatchOptions:
    """What `sbatch` is given from verify's --partition/--time/--account/--nodes (None: the site's)."""

    nodes: int
    partition: str | None = None
    time: str | None = None
    account: str | None = None


@dataclass(kw_only=True)
class StepResult:
    """How one step or batch job ended: exit code (None: stopped at its timeout), seconds waiting for
    resources, seconds running, and the scheduler's id for it."""

    exit_code: int | None
    queue_s: float = 0.0
    run_s: float = 0.0
    ids: list[str] = field(default_factory=list)


class Scheduler(Protocol):
    """A workload manager, driven through its own commands."""

    name: str

    def allocation(self) -> Allocation | None:
        """The allocation this process runs in, or None (a login node)."""

    def address(self, node: str) -> str:
        """The address other nodes reach `node` at (its NodeAddr), for a rendezvous endpoint."""

    def start_step(
        self,
        alloc: Allocation,
        argv: list[str],
        *,
        name: str,
        env: dict[str, str],
        log: object,
        nodes: int | None = None,
        overlap: bool = False,
        cwd: str | None = None,
    ) -> subprocess.Popen:
        """Start `argv` once on each of `nodes` (default all) nodes of `alloc`, as one step named `name`."""

    def submit_batch(
        self, script: Path, options: BatchOptions, *, name: str, env: dict[str, str], log: object
    ) -> subprocess.Popen:
        """Queue `script` as a batch job and return the process that waits for its end."""

    def ids_named(self, name: str, job_id: str | None = None) -> list[str]:
        """The scheduler's ids of our running steps or jobs named `name` (for cancelling, and tests)."""

    def running_since(self, name: str, job_id: str | None = None) -> bool:
        """Whether the step or job named `name` holds its resources now (left the queue)."""

    def cancel(self, ids: list[str]) -> None:
        """End these steps or jobs (and every task of them) now."""
