"""Measure what a checkpoint of the job costs and whether a run resumed from it continues the same run.
It trains the embedded job (or the one --spec describes) on --nproc local ranks (default 2), or on the
ranks torchrun started. Cost: the job's save (rank 0 writes, every rank waits at a barrier) and two loads
side by side, every rank reading the file with torch.load(weights_only=True) and the seed article's rank 0
read + broadcast_object_list, --repeats times each; per rank the save and load times, the size, the
others' barrier wait and the peak host memory during the load. The longest wait is judged against the
spec's process-group timeout; the measurement itself runs under a generous timeout, so a save longer
than yours is measured, not fatal. Resume fidelity: after --steps-before steps and the checkpoint, the run
goes on --steps-after steps; a fresh Trainer restarted from the checkpoint runs the same steps. Losses
must match step by step (bit-identical on CPU), and so must a fingerprint of weights, optimizer state,
LR, GradScaler, Python/NumPy/torch/CUDA RNG states and data position, which names the state a checkpoint
lacks even when the loss does not show it yet. Records go to RUN/checkpoint.jsonl. Your own checkpoint
code is measured the same way with --save MOD:FN, a save(state: dict, path: str) called on rank 0 with
the job's full checkpoint dict, and --load MOD:FN, a load(path: str) returning that dict (MOD may be a
module or path/file.py); whatever your format leaves out shows up as missing state. --drop LIST (a
demonstration and test aid; repeatable) also resumes from a copy of the checkpoint without those
components (optimizer, scheduler, scaler, rng, sampler), to show what each omission does. --inspect CKPT
examines any checkpoint file without training: whether weights_only=True can read it (a file that needs
arbitrary pickle is a finding and is never unpickled) and which kinds of state it lacks. Exit code 0 when
measured, whatever was found (--strict: 1 when any check failed); 1 when the probe itself failed (a rank
died, your function raised); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ciuic_doctor.cli_args import add_out, positive_int
from ciuic_doctor.rundir.store import RunDir

NAME = "checkpoint-check"
HELP = "checkpoint save/load cost, barrier wait vs timeout, resume fidelity, unsafe pickle"
ORDER = 65
DEFAULT_NPROC = 2  # enough for a barrier wait and a broadcast; more local ranks add little on one host
# Set for the ranks `launch_local` starts: the parent prints the one failure line, not every rank.
PARENT_ENV = "CIUIC_CHECKPOINT_PARENT_REPORTS"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", metavar="FILE", help="job spec TOML merged over the default (jobs/default.toml)"
    )
    parser.add_argument(
        "--nproc", type=positive_int, help=f"local ranks when not under torchrun (default {DEFAULT_NPROC})"
    )
    parser.add_argument(
        "--steps-before", type=positive_int, default=4, metavar="N", help="steps before the checkpoint (4)"
    )
    parser.add_argument(
        "--steps-after", type=positive_int, default=4, metavar="M", help="steps compared after it (4)"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=3, metavar="R", help="saves and loads timed (3)"
    )
    parser.add_argument("--save", metavar="MOD:FN", help="your save(state: dict, path: str), on rank 0")
    parser.add_argument("--load", metavar="MOD:FN", help="your load(path: str) -> dict")
    parser.add_argument(
        "--drop",
        metavar="LIST",
        action="append",
        default=[],
        help="demonstration: also resume from a copy without these (optimizer,scheduler,scaler,rng,sampler)",
    )
    parser.add_argument("--inspect", metavar="CKPT", help="examine this checkpoint file only (no training)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any check failed")
    add_out(parser)


def _validate(args: argparse.Namespace) -> None:
    """Every user mistake as one line before any rank starts."""
    from ciuic_doctor.errors import UserError

    if args.inspect:
        extra = [flag for flag in ("save", "load", "spec") if getattr(args, flag)] + (
            ["drop"] if args.drop else []
        )
        if extra:
            raise UserError(f"--inspect examines a file only; it takes no --{', --'.join(extra)}")
        path = Path(args.inspect)
        if not path.is_file():
            raise UserError(
                f"--inspect {path}: no such file" if not path.exists() else f"--inspect {path}: not a file"
            )
        return
    from ciuic_doctor.jobs.spec import load_spec
    from ciuic_doctor.probes.checkpoint.options import parse_drops, resolve_callable

    parse_drops(args.drop)
    load_spec(args.spec)
    for option, text, arity in (("--save", args.save, 2), ("--load", args.load, 1)):
        if text:
            resolve_callable(text, option, arity)


def _config(args: argparse.Namespace, argv: list[str]):  # -> CheckConfig
    from ciuic_doctor.probes.checkpoint.check import CheckConfig

    return CheckConfig(
        spec_path=args.spec,
        steps_before=args.steps_before,
        steps_after=args.steps_after,
        repeats=args.repeats,
        save=args.save,
        load=args.load,
        drops=list(args.drop),
        strict=args.strict,
        out=args.out,
        argv=argv,
    )


def _absolute_callable(text: str | None) -> str | None:
    """file.py:fn with an absolute path, so the ranks find the file wherever they start."""
    if not text:
        return text
    target, _, name = text.rpartition(":")
    return f"{Path(target).resolve()}:{name}" if target.endswith(".py") else text


def _child_argv(args: argparse.Namespace, run_path: Path) -> list[str]:
    argv = [NAME, "--out", str(run_path), "--steps-before", str(args.steps_before)]
    argv += ["--steps-after", str(args.steps_after), "--repeats", str(args.repeats)]
    if args.spec:
        argv += ["--spec", str(Path(args.spec).resolve())]
    for flag, value in (("--save", args.save), ("--load", args.load)):
        if value:
            argv += [flag, _absolute_callable(value)]
    for item in args.drop:
        argv += ["--drop", item]
    return argv  # --strict is the parent's to apply: a rank's exit 1 would read as a dead rank


def summarize(run: RunDir, *, strict: bool = False) -> int:
    """Print the checkpoint findings; 1 with `strict` when any failed."""
    from ciuic_doctor.analysis import checkpoint

    findings = checkpoint.analyze(run)
    print()
    for line in checkpoint.summary_lines(findings):
        print(line)
    print(f"records: {run.stream_path('checkpoint')}; next: ciuic-doctor report {run.path}", flush=True)
    return 1 if strict and any(f.verdict == "fail" for f in findings) else 0


def run(args: argparse.Namespace) -> int:
    import sys

    from ciuic_doctor.errors import ProbeFailed
    from ciuic_doctor.launch import in_torchrun

    _validate(args)
    if args.inspect:
        from ciuic_doctor.probes.checkpoint.check import run_inspect

        return summarize(run_inspect(Path(args.inspect), args.out), strict=args.strict)
    if in_torchrun() or (args.nproc or DEFAULT_NPROC) == 1:
        from ciuic_doctor.probes.checkpoint.check import run_check

        try:
            run_dir = run_check(_config(args, sys.argv[1:]))
            return summarize(run_dir, strict=args.strict) if run_dir is not None else 0
        except ProbeFailed:
            if os.environ.get(PARENT_ENV):
                return 1
            raise

    from ciuic_doctor.launch import check_nproc, launch_local
    from ciuic_doctor.rundir.store import RunDir, default_run_path

    nproc = args.nproc or DEFAULT_NPROC
    check_nproc(nproc)  # refused before the banner and the folder
    run_dir = RunDir.create(default_run_path(NAME, args.out))
    print(f"launching {nproc} local ranks -> {run_dir.path}", flush=True)
    try:
        launch_local(
            nproc, _child_argv(args, run_dir.path.resolve()), run_dir=run_dir.path, env={PARENT_ENV: "1"}
        )
    except ProbeFailed:
        entry = run_dir.read_meta().get("probes", {}).get(NAME, {})
        if entry.get("message"):
            raise ProbeFailed(entry["message"]) from None
        raise
    if args.strict:
        from ciuic_doctor.analysis import checkpoint

        return 1 if any(f.verdict == "fail" for f in checkpoint.analyze(run_dir)) else 0
    return 0
