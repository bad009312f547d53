"""The embedded job's options and the small types its modules share: what `ciuic-doctor job` and
`python -m ciuic_doctor.jobs.train` both parse, the world a rank trains in, and the view of a trainer that
progress and checkpoint code need.

This module sits below train.py, progress.py and checkpoint.py so that none of them imports another's
types, and below commands/ so that the job never reaches back up into the CLI. It imports no torch:
`ciuic-doctor job --help` stays cheap.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ciuic_doctor.cli_args import add_out, positive_float, positive_int
from ciuic_doctor.jobs.inject import Injections


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


@dataclass(kw_only=True)
class World:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: a single process without a process group
    device: Any = field(default_factory=_cpu)  # a torch.device


@dataclass(kw_only=True)
class JobOptions:
    injections: Injections = field(default_factory=Injections)
    resume: Path | None = None
    watch: bool = True
    out: str | None = None
    moe_every: int = 10  # steps between MoE expert-load samples
    peak_tflops: float | None = None  # the device's peak for MFU, when the table lacks it


def median_step_s(times: list[float]) -> float | None:
    """Median step time without the first step (DataLoader start-up, allocator warm-up)."""
    steady = times[1:] or times
    return statistics.median(steady) if steady else None


class TrainerView(Protocol):
    """What progress reporting and checkpointing read of a `train.Trainer` (one rank's training state)."""

    rank: int
    step: int
    lr: float
    global_batch: int
    step_times_s: list[float]
    last_loss: Any  # a 0-d tensor, read lazily (no device sync per step)

    @property
    def parameter_count(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ---- the command line (`ciuic-doctor job`, `python -m ciuic_doctor.jobs.train`) ----------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", metavar="FILE", help="job spec TOML merged over the default (jobs/default.toml)"
    )
    parser.add_argument("--steps", type=positive_int, help="optimizer steps (default: the spec's job.steps)")
    parser.add_argument(
        "--nproc",
        type=positive_int,
        help="local ranks to launch when not under torchrun (default: spec); in a Slurm allocation, ranks "
        "per node",
    )
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="train on every node of the Slurm allocation (the default where SLURM_JOB_ID is set): one "
        "srun step starting torchrun on each node",
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
    parser.add_argument(
        "--moe-every",
        type=positive_int,
        default=10,
        metavar="N",
        help="record the MoE routers' expert load every N steps, and at step 1 (default 10)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=positive_float,
        metavar="T",
        help="the device's dense peak TFLOP/s for MFU when the built-in table lacks it (a CPU run)",
    )


def parse_set_value(text: str) -> Any:
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

    spec = load_spec(args.spec)
    updates: dict[str, Any] = {}
    set_keys = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set batch.per_process=4")
        updates[key.strip()] = parse_set_value(value.strip())
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
        moe_every=args.moe_every,
        peak_tflops=args.peak_tflops,
    )
    return spec, options


def child_argv(args: argparse.Namespace, run_path: Path) -> list[str]:
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
    argv += ["--moe-every", str(args.moe_every)]
    if args.peak_tflops:
        argv += ["--peak-tflops", repr(args.peak_tflops)]
    return argv
