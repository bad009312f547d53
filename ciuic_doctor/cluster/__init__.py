"""The machines a job runs on, as its scheduler sees them: the allocation, its nodes, job steps.

    from ciuic_doctor.cluster import current, node_name
    scheduler = current()            # None outside an allocation: everything runs on this host as before
    nodes = scheduler.nodes()        # ["n1", "n2"]: `scontrol show hostnames $SLURM_JOB_NODELIST`

One small interface (base.py) so that Kubernetes or torchx can follow Slurm (slurm.py, through the
commands users type: srun, sbatch, scancel, squeue, scontrol). spread.py runs one torchrun per node of
an allocation as one job step; procs.py finds a step's processes on this node. This package sits on the
floor: it imports nothing of ciuic_doctor above errors.py, and never torch.
"""

from __future__ import annotations

import os
import socket

from ciuic_doctor.cluster.base import Allocation, Scheduler, StepResult

__all__ = ["Allocation", "Scheduler", "StepResult", "current", "node_identity", "node_name"]

# The scheduler's name for this node. Several nodes may share one host name (the test cluster runs two
# slurmd on one machine; containers often report the same name), so the node is named by the scheduler.
NODE_ENV = "SLURMD_NODENAME"


def node_name() -> str:
    """This node as its scheduler names it (SLURMD_NODENAME in a Slurm task), else the host name.

    Every record's `host` is this name: the report, the straggler and slow-host checks then group ranks
    by node even where two nodes report one host name.
    """
    return os.environ.get(NODE_ENV) or socket.gethostname()


def node_identity() -> dict[str, str | int]:
    """What a rank records of where it ran: node, host and, in a Slurm task, the job, step and node index."""
    out: dict[str, str | int] = {"node": node_name(), "hostname": socket.gethostname()}
    for key, env in (
        ("job_id", "SLURM_JOB_ID"),
        ("step_id", "SLURM_STEP_ID"),
        ("node_index", "SLURM_NODEID"),
    ):
        value = os.environ.get(env, "")
        if value.isdigit():
            out[key] = int(value)
    return out


def current(force: bool = False) -> Scheduler | None:
    """The scheduler whose allocation this process runs in (SLURM_JOB_ID set), or None.

    `force` (--slurm): Slurm even without an allocation, for the batch-job path (sbatch from a login
    node); a UserError when Slurm's commands are not installed.
    """
    from ciuic_doctor.cluster.slurm import Slurm

    if force or os.environ.get("SLURM_JOB_ID", "").isdigit():
        return Slurm.here(require_allocation=False)
    return None


# The name of the job step a command runs as: set by a caller that must find the step again (checkup's
# memwatch on each node), inherited by every task of it.
STEP_NAME_ENV = "CIUIC_STEP_NAME"
