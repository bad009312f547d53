"""Where verify's A and B runs go when the job ran on several nodes: steps of this Slurm allocation, or,
from a login node, one batch job each (sbatch --wait with --partition/--time/--account/--nodes).

A multi-node job's change can only be tried on as many nodes: inside one node NCCL uses rings and NVLink,
trees pay off between nodes, so a one-node re-run would judge a different job. Each run is the job's own
command (`watch ... -- train.py` or `job ...`) under one torchrun per node, as cluster/spread.py starts it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from ciuic_doctor.errors import UserError


@dataclass(kw_only=True)
class SlurmChoice:
    """verify's Slurm flags: --slurm and the batch job's options (None: the site's defaults)."""

    force: bool = False
    nodes: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None


def add_slurm_arguments(parser: argparse.ArgumentParser) -> None:
    from ciuic_doctor.cli_args import positive_int

    group = parser.add_argument_group(
        "on a Slurm cluster (a run that spanned nodes is re-run on as many: steps of this allocation, "
        "or from a login node one batch job per run)"
    )
    group.add_argument(
        "--slurm", action="store_true", help="run A and B through Slurm even for a one-node job"
    )
    group.add_argument("--nodes", type=positive_int, help="batch jobs: nodes per run (default: as recorded)")
    group.add_argument("--partition", help="batch jobs: sbatch --partition")
    group.add_argument("--time", metavar="LIMIT", help="batch jobs: sbatch --time (a run's time limit)")
    group.add_argument("--account", help="batch jobs: sbatch --account")


def choice_from_args(args: argparse.Namespace) -> SlurmChoice:
    return SlurmChoice(
        force=bool(getattr(args, "slurm", False)),
        nodes=getattr(args, "nodes", None),
        partition=getattr(args, "partition", None),
        time=getattr(args, "time", None),
        account=getattr(args, "account", None),
    )


def recorded_layout(meta: dict[str, Any]) -> tuple[int, int]:
    """(nodes, ranks per node) the run recorded: watch's observed job, else the embedded job's run."""
    observed = meta.get("observed") if isinstance(meta.get("observed"), dict) else {}
    job = observed.get("job") if isinstance(observed.get("job"), dict) else {}
    nodes, per = job.get("nodes"), job.get("procs_per_node")
    if isinstance(nodes, int) and isinstance(per, int) and nodes >= 1 and per >= 1:
        return nodes, per
    run = meta.get("job_run") if isinstance(meta.get("job_run"), dict) else {}
    nodes, per = run.get("nodes"), run.get("procs_per_node")
    if isinstance(nodes, int) and isinstance(per, int) and nodes >= 1 and per >= 1:
        return nodes, per
    return 1, 0


def spread_for(
    meta: dict[str, Any], choice: SlurmChoice | None, path: str, *, nproc: int | None = None
) -> Any:
    """A cluster.spread.Spread for every run, or None: the runs stay on this host as before. `nproc`
    (verify --nproc) is ranks per node here, as comm-bench's, job's and checkup's on an allocation."""
    choice = choice or SlurmChoice()
    nodes, per = recorded_layout(meta)
    if nodes <= 1 and not choice.force:
        return None
    from ciuic_doctor.cluster import current
    from ciuic_doctor.cluster.base import BatchOptions
    from ciuic_doctor.cluster.spread import Spread

    scheduler = current(force=choice.force)
    if scheduler is None:
        raise UserError(
            f"{path}: the job ran on {nodes} nodes; verify it on as many: inside an allocation (salloc -N "
            f"{nodes} ciuic-doctor verify ...), or from a login node with --slurm [--partition P --time T]"
        )
    per = nproc or per or 1
    alloc = scheduler.allocation()
    if alloc is not None:
        want = choice.nodes or nodes
        if len(alloc.nodes) < want:
            raise UserError(
                f"{path}: the job ran on {want} nodes; this allocation (Slurm job {alloc.job_id}) has "
                f"{len(alloc.nodes)}"
            )
        return Spread(scheduler=scheduler, alloc=alloc, nnodes=want, nproc_per_node=per)
    batch = BatchOptions(
        nodes=choice.nodes or nodes, partition=choice.partition, time=choice.time, account=choice.account
    )
    return Spread(scheduler=scheduler, alloc=None, nnodes=batch.nodes, nproc_per_node=per, batch=batch)


def run_on_nodes(
    command: Any, out: Any, set_items: list[str], timeout_s: float
) -> tuple[int | None, str, float]:
    """One A or B run as a step of the allocation (or a batch job): (exit code, None past `timeout_s`
    of running; its output; seconds it waited in the queue). Ctrl-C / SIGTERM cancel it (scancel)."""
    import os
    import tempfile

    spread = command.spread
    argv = command.argv(out, set_items)[len(command.launcher) :]  # -m ciuic_doctor <command> ...
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)  # every run gets --out explicitly
    name = spread.new_name(f"verify-{out.name}")
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        result = spread.run(
            argv, name=name, env=env, log=log, timeout_s=timeout_s, cwd=command.cwd, batch_dir=out.parent
        )
        log.seek(0)
        text = log.read()
    return result.exit_code, text, result.queue_s
