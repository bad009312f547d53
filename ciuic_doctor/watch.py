"""Record every optimizer step from inside a training script: the explicit form of `ciuic-doctor watch`.

    import ciuic_doctor.watch

    with ciuic_doctor.watch.attach(out="reports/my-run"):
        train()                      # unchanged: records go to reports/my-run/steps.rank<R>.jsonl

or `session = ciuic_doctor.watch.attach()` ... `session.close()`. Attach before the model is wrapped in
DistributedDataParallel, so the cross-rank weight checksum knows which parameters must agree. The hooks,
the record schema and the overhead are exactly those of `ciuic-doctor watch -- script.py`, which calls this.

This module imports torch only inside `attach`, so importing it costs nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ciuic_doctor.rundir.store import RunDir, default_run_path

if TYPE_CHECKING:
    from ciuic_doctor.probes.watch.session import WatchSession


def attach(
    out: str | Path | None = None,
    *,
    run: RunDir | None = None,
    rank: int | None = None,
    checksum_every: int = 10,
    uss_every: int = 10,
    grad_norm: bool = True,
    checksum: bool = True,
    snapshot_on_leak: bool = False,
    agree_timeout_s: float = 60.0,
    follow_children: bool = True,
    moe: bool = True,
    moe_every: int = 10,
    child: bool = False,
    probe: str = "watch",
    probe_fields: dict[str, Any] | None = None,
) -> WatchSession:
    """Start recording this process's optimizer steps; returns the session (a context manager).

    `out` (or an open `run`) is the run directory: default $CIUIC_RUN_DIR, under torchrun
    reports/watch-<run id>, else reports/<time>-watch. `rank` defaults to $RANK (else 0). `child`: a rank
    the watched script started itself: its rank is the process group's, learnt at its first step, and it
    leaves meta.json to the launching process. If a session is already recording in this process, that
    one is returned (and this attach changes nothing).
    """
    from ciuic_doctor.probes.watch import session as probe_watch

    active = probe_watch.current()
    if active is not None:
        return probe_watch.attach(run=active.run)
    if run is None:
        run = RunDir.create(default_run_path("watch", out))
    if rank is None and not child:
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and not child:
        run.record_environment()
        run.record_probe(probe, status="running", **(probe_fields or {}))
    config = probe_watch.WatchConfig(
        checksum_every=checksum_every,
        uss_every=uss_every,
        grad_norm=grad_norm,
        checksum=checksum,
        snapshot_on_leak=snapshot_on_leak,
        agree_timeout_s=agree_timeout_s,
        follow_children=follow_children,
        moe=moe,
        moe_every=moe_every,
    )
    return probe_watch.attach(run=run, rank=rank, config=config)


def current() -> WatchSession | None:
    """The session recording in this process, or None (without importing torch if none was started)."""
    import sys

    module = sys.modules.get("ciuic_doctor.probes.watch.session")
    return module.current() if module is not None else None
