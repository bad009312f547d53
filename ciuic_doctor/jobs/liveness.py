"""A dead or hung rank of the job named in one line, within the process-group timeout plus seconds.

Before this, a SIGSTOPped rank left the survivor blocked until the gloo timeout (the spec's 1800 s by
default), then printing a raw gloo traceback, and the summary said "killed by SIGKILL". The
job now runs comm-bench's heartbeat watch (probes/comm/faults.py): each step is a row; when a
collective fails, the survivors read the heartbeats and the first one to decide says which rank died or
is not responding, and on which host.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ciuic_doctor.probes.comm.faults import Terminated

__all__ = ["PARENT_ENV", "Terminated", "is_peer_failure", "parent_reports", "report", "start_watch"]

# Set by the launching `ciuic-doctor job` for its ranks: they record the one message in meta.json and
# leave the printing to it, instead of each printing it.
PARENT_ENV = "CIUIC_JOB_PARENT_REPORTS"
_DISTRIBUTED_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "broken pipe", "peer")


def start_watch(rank: int, world: int, timeout_s: float) -> Any | None:
    """The heartbeat watch of this rank (None for a world of one, or without a reachable store)."""
    import torch.distributed as dist

    from ciuic_doctor.probes.comm.faults import Watch, default_store

    if world < 2 or not dist.is_initialized():
        return None
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    watch = Watch(
        store=default_store(),
        rank=rank,
        world_size=world,
        hosts=[str(h) for h in hosts],
        timeout_s=timeout_s,
        stall_watchdog=False,  # gloo's own timeout catches a hung step; start-up is not a step
        command="job",
    )
    watch.start()
    watch.step("start-up")
    return watch


def is_peer_failure(exc: BaseException) -> bool:
    """A collective that failed because of another rank (not a bug of this one), or SIGTERM."""
    import torch.distributed as dist

    if isinstance(exc, Terminated):
        return True
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _DISTRIBUTED_WORDS)


def report(watch: Any, exc: BaseException) -> str | None:
    """Diagnose once across the ranks; the message when this rank is the one to say it."""
    from ciuic_doctor.probes.comm.faults import first_line

    return watch.report(first_line(exc))


def parent_reports() -> bool:
    return bool(os.environ.get(PARENT_ENV))
