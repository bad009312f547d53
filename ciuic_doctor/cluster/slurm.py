"""Slurm through the commands its users type: srun, sbatch, scancel, squeue, scontrol.

Facts used (reference/slurm.md, checked on Slurm 22.05): a task sees SLURM_JOB_ID, SLURM_JOB_NODELIST,
SLURMD_NODENAME, SLURM_NODEID; `scontrol show hostnames LIST` expands a node list in allocation order;
`srun --jobid=ID` attaches a step to a running allocation from anywhere, and `--overlap` lets it share
CPUs with steps already running; `squeue --steps` lists running steps (there may be no accounting
database, so no sacct); `sbatch --wait --parsable` prints the job id, then blocks until the job ends
and exits with its exit code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ciuic_doctor.cluster.base import Allocation, BatchOptions
from ciuic_doctor.errors import UserError
from ciuic_doctor.processes import die_with_parent

COMMANDS = ("srun", "sbatch", "scancel", "squeue", "scontrol")
QUERY_TIMEOUT_S = 30.0  # a controller that does not answer within this is down for our purposes


class Slurm:
    """The Slurm this process can reach (its SLURM_CONF or the site's)."""

    name = "slurm"

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = dict(os.environ if env is None else env)

    @classmethod
    def here(cls, require_allocation: bool = True) -> Slurm:
        """Slurm from this process's environment; a UserError when its commands are missing, or when
        `require_allocation` and this process runs in no allocation."""
        missing = [c for c in COMMANDS if shutil.which(c) is None]
        if missing:
            raise UserError(f"--slurm: Slurm's {', '.join(missing)} not found on PATH")
        slurm = cls()
        if require_allocation and slurm.allocation() is None:
            raise UserError("no Slurm allocation here (SLURM_JOB_ID is not set): run inside salloc or sbatch")
        return slurm

    def query(self, *argv: str) -> str:
        """One Slurm client command's stdout; a UserError with its own first line when it fails."""
        try:
            done = subprocess.run(
                list(argv), env=self.env, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=False
            )
        except FileNotFoundError:
            raise UserError(f"{argv[0]}: not installed") from None
        except subprocess.TimeoutExpired:
            raise UserError(f"{' '.join(argv[:3])}: no answer within {QUERY_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[0]
            raise UserError(f"{' '.join(argv[:3])}: {why}")
        return done.stdout

    def allocation(self) -> Allocation | None:
        job = self.env.get("SLURM_JOB_ID", "")
        if not job.isdigit():
            return None
        nodelist = self.env.get("SLURM_JOB_NODELIST") or _field(
            self.query("scontrol", "show", "job", job, "-o"), "NodeList"
        )
        nodes = self.query("scontrol", "show", "hostnames", nodelist).split()
        if not nodes:
            raise UserError(f"Slurm job {job}: no nodes in its node list {nodelist!r}")
        return Allocation(job_id=job, nodes=nodes, partition=self.env.get("SLURM_JOB_PARTITION"))

    def address(self, node: str) -> str:
        """NodeAddr of `node` (where its name does not resolve, as on a cluster of aliases)."""
        return _field(self.query("scontrol", "show", "node", node, "-o"), "NodeAddr") or node

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
        count = nodes or len(alloc.nodes)
        srun = ["srun", f"--jobid={alloc.job_id}", f"--nodes={count}", f"--ntasks={count}"]
        # --kill-on-bad-exit: a task that fails ends the step, as torchrun's own peers would wait otherwise
        srun += ["--ntasks-per-node=1", f"--job-name={name}", "--kill-on-bad-exit=1", "--export=ALL"]
        if overlap:
            srun.append("--overlap")
        return subprocess.Popen(
            [*srun, *argv],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a terminal's Ctrl-C reaches us, and we cancel the step ourselves
            # kill -9 of the caller (verify, checkup): srun gets SIGTERM and ends its step with it
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - one libc call, prepared before the fork
        )

    def submit_batch(
        self, script: Path, options: BatchOptions, *, name: str, env: dict[str, str], log: object
    ) -> subprocess.Popen:
        sbatch = ["sbatch", "--wait", "--parsable", f"--nodes={options.nodes}", f"--job-name={name}"]
        sbatch += ["--ntasks-per-node=1", f"--output={script.with_suffix('.log')}"]
        for flag, value in (
            ("--partition", options.partition),
            ("--time", options.time),
            ("--account", options.account),
        ):
            if value:
                sbatch.append(f"{flag}={value}")
        return subprocess.Popen(
            [*sbatch, str(script)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def ids_named(self, name: str, job_id: str | None = None) -> list[str]:
        if job_id:  # steps of that allocation: "JOB.STEP name"
            text = self.query("squeue", "-h", "--steps", "-j", job_id, "-o", "%i %j")
        else:
            text = self.query("squeue", "-h", "-o", "%i %j")
        return [
            ident
            for ident, _, step_name in (line.partition(" ") for line in text.splitlines())
            if step_name.strip() == name
        ]

    def running_since(self, name: str, job_id: str | None = None) -> bool:
        if job_id:  # a step is listed once it runs; while it waits for CPUs, srun holds it back
            return bool(self.ids_named(name, job_id))
        text = self.query("squeue", "-h", "-o", "%j %T")
        return any(line.split()[:2] == [name, "RUNNING"] for line in text.splitlines() if line.strip())

    def cancel(self, ids: list[str]) -> None:
        if ids:
            self.query("scancel", *ids)


def _field(text: str, key: str) -> str:
    """`Key=value` out of scontrol's one-line (-o) output."""
    for word in text.split():
        name, sep, value = word.partition("=")
        if sep and name == key:
            return value
    return ""
