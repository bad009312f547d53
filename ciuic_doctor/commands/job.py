"""Train the embedded DeepSeek-V3 job (MLA attention, MoE with shared and routed experts; ~1 M parameters
by default, any size from --spec) and record every optimizer step into RUN/steps.rank<R>.jsonl.

Under torchrun each rank trains; otherwise the job starts --nproc local ranks itself through torch's
elastic launcher (default: the spec's procs_per_node). The resolved spec goes into RUN/meta.json.

Fault injection (--inject, for demonstrations and tests; recorded in meta.json as such):
leak=<MB per step>, spike=<step>:<lr factor>, overflow=<step>[:<count>] (fp16), slow-rank=<rank>:<ms>,
desync=<step> (rank 1's weights drift after DDP's initial broadcast).
"""

from __future__ import annotations

import argparse

from ciuic_doctor.jobs.options import add_arguments, child_argv, resolve

__all__ = ["HELP", "NAME", "ORDER", "add_arguments", "run"]

NAME = "job"
HELP = "train the embedded DeepSeek-V3 job (tiny by default) and record every step"
ORDER = 30


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.launch import check_nproc, in_torchrun

    spec, options = resolve(args)
    if in_torchrun():
        from ciuic_doctor.jobs.train import run_job

        return run_job(spec, options)
    from ciuic_doctor.launch import allocation_spread

    spread = allocation_spread(args.nproc or spec.job.procs_per_node, force=getattr(args, "slurm", False))
    if spread is not None:
        return _run_nodes(args, spec, options, spread)
    nproc = args.nproc or spec.job.procs_per_node
    check_nproc(nproc, "--nproc" if args.nproc else "the spec's [job] procs_per_node =")
    options.injections.check(world=nproc, precision=spec.precision.mode)
    if nproc == 1:
        from ciuic_doctor.jobs.train import run_job

        return run_job(spec, options)

    from ciuic_doctor.jobs.checkpoint import resolve_resume
    from ciuic_doctor.jobs.model import model_config
    from ciuic_doctor.launch import launch_local
    from ciuic_doctor.rundir.store import RunDir, default_run_path

    # Mistakes every rank would make alike: one clear line here instead of one failed rank per process.
    model_config(spec)
    if options.resume:
        resolve_resume(options.resume)
    run_dir = RunDir.create(default_run_path("job", args.out))
    print(f"launching {nproc} local ranks -> {run_dir.path}", flush=True)
    from ciuic_doctor.errors import ProbeFailed
    from ciuic_doctor.jobs.liveness import PARENT_ENV

    env = {**spec.distributed.env, PARENT_ENV: "1"}
    try:
        launch_local(nproc, child_argv(args, run_dir.path.resolve()), run_dir=run_dir.path, env=env)
    except ProbeFailed:
        # A survivor named the dead or hung rank in meta.json; its words say more than the launcher's
        # "rank 1 failed (killed by signal SIGKILL)" about a rank it had to kill.
        entry = run_dir.read_meta().get("probes", {}).get("job", {})
        run_dir.record_probe("job", **{**entry, "status": "failed", "nproc": nproc})
        if entry.get("message"):
            raise ProbeFailed(f"{entry['message']}; records in {run_dir.path}") from None
        raise
    except KeyboardInterrupt:  # Ctrl-C: 130, every record kept (README's `interrupted`)
        run_dir.record_probe("job", status="interrupted", nproc=nproc)
        raise
    except BaseException:
        run_dir.record_probe("job", status="failed", nproc=nproc)
        raise
    return 0


def _run_nodes(args: argparse.Namespace, spec, options, spread) -> int:  # spread: cluster.spread.Spread
    """Every node of the Slurm allocation: one torchrun per node as one job step, one run directory."""
    from ciuic_doctor.errors import ProbeFailed
    from ciuic_doctor.jobs.liveness import PARENT_ENV
    from ciuic_doctor.jobs.model import model_config
    from ciuic_doctor.launch import launch_nodes
    from ciuic_doctor.rundir.store import RunDir, default_run_path

    options.injections.check(world=spread.world, precision=spec.precision.mode)
    model_config(spec)
    run_dir = RunDir.create(default_run_path("job", args.out))
    print(f"launching {spread.world} ranks on {spread.describe()} -> {run_dir.path}", flush=True)
    env = {**spec.distributed.env, PARENT_ENV: "1"}
    try:
        launch_nodes(spread, child_argv(args, run_dir.path.resolve()), run_dir=run_dir.path, env=env)
    except ProbeFailed:
        entry = run_dir.read_meta().get("probes", {}).get("job", {})
        run_dir.record_probe("job", **{**entry, "status": "failed", "nproc": spread.world})
        if entry.get("message"):
            raise ProbeFailed(f"{entry['message']}; records in {run_dir.path}") from None
        raise
    except BaseException:
        run_dir.record_probe("job", status="failed", nproc=spread.world)
        raise
    return 0
