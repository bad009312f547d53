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
from pathlib import Path
from typing import Any

from ciuic_doctor.commands._common import add_out, positive_int

NAME = "job"
HELP = "train the embedded DeepSeek-V3 job (tiny by default) and record every step"
ORDER = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", metavar="FILE", help="job spec TOML merged over the default (jobs/default.toml)"
    )
    parser.add_argument("--steps", type=positive_int, help="optimizer steps (default: the spec's job.steps)")
    parser.add_argument(
        "--nproc", type=positive_int, help="local ranks to launch when not under torchrun (default: spec)"
    )
    add_out(parser)
    parser.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), help="override precision.mode (fp16 uses GradScaler)"
    )
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one spec value, e.g. --set dataloader.num_workers=0 (TOML value; repeatable)",
    )
    parser.add_argument(
        "--inject",
        metavar="FAULT",
        action="append",
        default=[],
        help="inject a fault on purpose (see above; repeatable or comma-separated)",
    )
    parser.add_argument("--resume", metavar="CKPT", help="resume from a checkpoint file, or a run's latest")
    parser.add_argument(
        "--no-watch", action="store_true", help="do not record steps (for measuring watch's own overhead)"
    )


def _parse_value(text: str) -> Any:
    """A TOML value (`3`, `1e-4`, `true`, `"x"`, `[0.9, 0.95]`), else the bare text as a string."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def resolve(args: argparse.Namespace) -> tuple[Any, Any]:
    """(JobSpec, JobOptions) from the command line: --spec, then --set, --precision and --steps."""
    from ciuic_doctor.errors import UserError
    from ciuic_doctor.jobs.inject import parse_injections
    from ciuic_doctor.jobs.spec import load_spec, with_updates
    from ciuic_doctor.jobs.train import JobOptions

    spec = load_spec(args.spec)
    updates: dict[str, Any] = {}
    set_keys = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set batch.per_process=4")
        updates[key.strip()] = _parse_value(value.strip())
        set_keys.append(key.strip())
    if updates:  # --set values first, on their own, so a bad one is blamed on --set, not on the spec
        spec = with_updates(spec, updates, origin="--set " + ", ".join(set_keys))
        updates = {}
    if args.precision:
        updates["precision.mode"] = args.precision
    if args.steps:
        updates["job.steps"] = args.steps
    if updates:
        spec = with_updates(spec, updates)
    options = JobOptions(
        injections=parse_injections(args.inject),
        resume=Path(args.resume) if args.resume else None,
        watch=not args.no_watch,
        out=args.out,
    )
    return spec, options


def _child_argv(args: argparse.Namespace, run_path: Path) -> list[str]:
    """The same job for every launched rank, writing into one run directory."""
    argv = ["job", "--out", str(run_path)]
    for flag, value in (("--spec", args.spec), ("--steps", args.steps), ("--precision", args.precision)):
        if value is not None:
            argv += [flag, str(value)]
    if args.resume:
        argv += ["--resume", str(Path(args.resume).resolve())]
    for item in args.set:
        argv += ["--set", item]
    for item in args.inject:
        argv += ["--inject", item]
    if args.no_watch:
        argv.append("--no-watch")
    return argv


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.launch import check_nproc, in_torchrun

    spec, options = resolve(args)
    if in_torchrun():
        from ciuic_doctor.jobs.train import run_job

        return run_job(spec, options)
    nproc = args.nproc or spec.job.procs_per_node
    check_nproc(nproc, "--nproc" if args.nproc else "the spec's [job] procs_per_node =")
    options.injections.check(world=nproc, precision=spec.precision.mode)
    if nproc == 1:
        from ciuic_doctor.jobs.train import run_job

        return run_job(spec, options)

    from ciuic_doctor.jobs.checkpoint import resolve_resume
    from ciuic_doctor.jobs.model import model_config
    from ciuic_doctor.launch import launch_local
    from ciuic_doctor.store import RunDir, default_run_path

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
        launch_local(nproc, _child_argv(args, run_dir.path.resolve()), run_dir=run_dir.path, env=env)
    except ProbeFailed:
        # A survivor named the dead or hung rank in meta.json; its words say more than the launcher's
        # "rank 1 failed (killed by signal SIGKILL)" about a rank it had to kill.
        entry = run_dir.read_meta().get("probes", {}).get("job", {})
        run_dir.record_probe("job", **{**entry, "status": "failed", "nproc": nproc})
        if entry.get("message"):
            raise ProbeFailed(f"{entry['message']}; records in {run_dir.path}") from None
        raise
    except BaseException:
        run_dir.record_probe("job", status="failed", nproc=nproc)
        raise
    return 0
