"""Which process groups comm-bench measures in, and how NCCL is told (and shown) the algorithm.

NCCL reads NCCL_ALGO with getenv at every communicator creation (not cached, unlike its integer
parameters), and PyTorch creates a group's communicator lazily at its first collective. So a forced
algorithm is: set NCCL_ALGO, create a new group, run one collective on it, restore the variable.
NCCL_ALGO only steers all_reduce here (per-collective syntax on NCCL ≥ 2.24.3; see ciuic_doctor.machine.nccl);
the other collectives run once under NCCL's own choice. gloo has one algorithm per collective.

NCCL's debug settings, in contrast, are read once per process at the first NCCL call: the TUNING log
that shows what NCCL really ran has to be switched on before the default process group exists.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ciuic_doctor.machine import nccl
from ciuic_doctor.probes.comm.collectives import DTYPES, PLACEMENTS, allocate, elem_bytes, launch, shape
from ciuic_doctor.probes.comm.faults import first_line

DEFAULT_NCCL_ALGOS = ("ring", "tree")
DEBUG_LOG = "nccl_debug.log"


@dataclass(kw_only=True)
class Phase:
    algo: str  # what was asked: ring, tree, ... or "default" (NCCL's own choice / gloo's only one)
    collectives: list[str]
    nccl_algo: str | None = None  # the NCCL_ALGO value set while the group's communicator is made


def plan_phases(
    backend: str, collectives: Sequence[str], algos: Sequence[str] | None, version: nccl.Version | None
) -> tuple[list[Phase], list[str]]:
    """The process groups to measure in, in order, and the notes to print once."""
    if backend != "nccl":
        if algos and list(algos) != ["default"]:
            note = f"{backend} has one algorithm per collective: --algos {','.join(algos)} ignored"
        else:
            note = f"{backend} has one algorithm per collective (NCCL_ALGO applies to NCCL only)"
        return [Phase(algo="default", collectives=list(collectives))], [note]
    phases, notes = [], []
    if "all_reduce" in collectives:
        for algo in algos or DEFAULT_NCCL_ALGOS:
            value = None if algo == "default" else nccl.nccl_algo_env(algo, version)
            phases.append(Phase(algo=algo, collectives=["all_reduce"], nccl_algo=value))
    others = [c for c in collectives if c != "all_reduce"]
    if others:
        phases.append(Phase(algo="default", collectives=others))
    if os.environ.get("NCCL_ALGO"):
        notes.append(f"NCCL_ALGO={os.environ['NCCL_ALGO']} is set: the algo=default tables run under it")
    return phases, notes


@contextlib.contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """Set `name` for the block (None: leave it) and restore the previous state afterwards."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def phase_group(backend: str, phase: Phase, device: torch.device) -> Iterator[Any]:
    """The group to measure `phase` in: the default group on gloo, a fresh NCCL group otherwise."""
    if backend != "nccl":
        yield None
        return
    with env_var("NCCL_ALGO", phase.nccl_algo):
        group = dist.new_group(backend="nccl")
        dist.all_reduce(torch.zeros(1, device=device), group=group)  # makes the communicator now
        torch.cuda.synchronize(device)
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def supported(
    collective: str,
    *,
    dtype: str,
    device: torch.device,
    rank: int,
    world_size: int,
    group: Any,
    control: Any,
    root: int,
) -> str | None:
    """None when every rank can run `collective` (each placement, this dtype), else the reason.

    Asked at run time because backends differ by version (gloo gained reduce_scatter late).
    """
    reason = ""
    try:
        size = elem_bytes(dtype)
        sh = shape(collective, world_size * size, size, world_size)
        for inplace in PLACEMENTS[collective]:
            buf = allocate(sh, inplace=inplace, dtype=DTYPES[dtype], device=device, rank=rank)
            launch(collective, buf, group, root)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        reason = first_line(exc)
    ok = torch.tensor([0 if reason else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=control)
    if int(ok.item()) == 1:
        return None
    return reason or "not supported on another rank"


def nccl_version() -> nccl.Version | None:
    if not torch.cuda.is_available():
        return None
    try:
        return nccl.parse_version(torch.cuda.nccl.version())
    except (RuntimeError, AttributeError):
        return None


def enable_tuning_log(run_path: Path, version: nccl.Version | None) -> nccl.TuningTail | None:
    """On rank 0 with NCCL ≥ 2.23.4: send NCCL's TUNING lines to RUN/nccl_debug.log (or the user's
    NCCL_DEBUG_FILE) and return a reader for them. Call before the process group exists."""
    if not torch.cuda.is_available() or not nccl.tuning_log_supported(version):
        return None
    os.environ.update(nccl.tuning_debug_env(dict(os.environ), str(run_path / DEBUG_LOG)))
    path = nccl.debug_file_path(os.environ["NCCL_DEBUG_FILE"], socket.gethostname(), os.getpid())
    return nccl.TuningTail(path)
