"""Benchmark the collectives a distributed job uses (all_reduce, all_gather, reduce_scatter, broadcast,
all_to_all) the way nccl-tests does, on the ranks you launch it on: under torchrun every rank runs it
(`torchrun --nproc-per-node 8 -m ciuic_doctor comm-bench`, multi-node with --rdzv-backend c10d);
outside torchrun it starts --nproc local ranks itself through torch's elastic launcher.

Rank 0 prints an nccl-tests-style table (time, algbw, busbw, #wrong per size) and writes one record per
(collective, algorithm, size, placement) to RUN/comm.jsonl. On NCCL, all_reduce runs once per --algos
entry (default ring,tree), each in a fresh communicator created under NCCL_ALGO. Exit code 1 when any
element is wrong, when a table's average busbw is below 0.9 x --min-busbw, or when a rank dies or hangs
(one message names it). Test hooks: CIUIC_COMM_FAULT=RANK:BYTES:exit|kill|hang, CIUIC_COMM_CORRUPT_RANK=R.
"""

from __future__ import annotations

import argparse

from ciuic_doctor.cli_args import add_out, non_negative_int, positive_float, positive_int

NAME = "comm-bench"
HELP = "nccl-tests-style collective benchmark (busbw, #wrong, ring vs tree) under torchrun"
ORDER = 20

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
ALGOS = ("ring", "tree", "nvls", "nvlstree", "collnetdirect", "collnetchain", "pat", "default")
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "float8_e4m3fn")
# Set for the ranks `launch_local` starts: they leave the one failure line to the parent, which reads
# it from meta.json, instead of printing it a second time.
PARENT_ENV = "CIUIC_COMM_PARENT_REPORTS"
PARENT = {PARENT_ENV: "1"}  # the ranks leave the final words to the launching process


def _parse_list(option: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    from ciuic_doctor.errors import UserError

    items = [item.strip().lower().replace("-", "_") for item in text.split(",") if item.strip()]
    if allowed is ALGOS:
        items = [item.replace("_", "") for item in items]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise UserError(
            f"{option}: unknown {', '.join(unknown) or 'empty list'}; choose from {','.join(allowed)}"
        )
    return list(dict.fromkeys(items))


def _parse(args: argparse.Namespace) -> None:
    """Sizes and lists are parsed here, not by argparse, so a mistake is one line (UserError), not a
    usage block."""
    from ciuic_doctor.errors import UserError
    from ciuic_doctor.units import parse_size

    for option in ("min_bytes", "max_bytes", "bucket_bytes"):
        flag = "--" + option.replace("_", "-")
        try:
            value = parse_size(getattr(args, option))
        except UserError as exc:
            raise UserError(f"{flag}: {exc}") from None
        if value < 1:
            raise UserError(f"{flag} must be at least 1 byte")
        setattr(args, option, value)
    args.collectives = _parse_list("--collectives", args.collectives, COLLECTIVES)
    args.algos = _parse_list("--algos", args.algos, ALGOS) if args.algos else None
    if args.dtype not in DTYPES:
        raise UserError(f"--dtype: unknown {args.dtype}; choose from {','.join(DTYPES)}")
    if args.min_bytes > args.max_bytes:
        raise UserError(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if args.step_factor <= 1 and args.min_bytes != args.max_bytes:
        raise UserError(f"--step-factor must be greater than 1, got {args.step_factor:g}")
    if args.warmup < 0:
        raise UserError(f"--warmup must not be negative, got {args.warmup}")
    if args.root < 0:
        raise UserError(f"--root must be a rank (0 or more), got {args.root}")
    if args.splits_from:  # refuse a run without routing before any rank starts
        from pathlib import Path

        from ciuic_doctor.rundir.store import RunDir

        path = Path(args.splits_from)
        try:
            run = RunDir.open(path)
        except UserError as exc:
            raise UserError(f"--splits-from {exc}") from None
        if not run.stream_files("moe"):
            raise UserError(
                f"--splits-from {path}: no MoE routing recorded there (moe.rank<R>.jsonl); record it with "
                "ciuic-doctor job, or watch on an MoE model"
            )
        args.splits_from = str(path.resolve())


def check_fits(max_bytes: int, world: int, local_ranks: int) -> None:
    """Refuse a size whose buffers cannot fit this host's memory (on CPU, where gloo puts them).

    A rank holds about (world + 2) x the size at once (all_gather's output is world x the input, plus
    input and a check copy); `-e 1000T` grew to 8.5 GB before it died. On GPUs the buffers are
    on the device; NCCL reports its own out-of-memory.
    """
    import torch

    from ciuic_doctor.errors import UserError
    from ciuic_doctor.units import format_bytes

    if torch.cuda.is_available():
        return
    try:
        import psutil

        available = psutil.virtual_memory().available
    except (ImportError, OSError):
        return
    need = max_bytes * (world + 2) * local_ranks
    if need > available:
        raise UserError(
            f"--max-bytes {format_bytes(max_bytes)}: {local_ranks} rank(s) would need about "
            f"{format_bytes(need)} of host memory ({world} + 2 buffers each); {format_bytes(available)} is "
            "available"
        )


def check_splits_fit(splits_from: str, world: int, local_ranks: int, dtype: str) -> None:
    """Refuse recorded routing whose all_to_all buffers cannot fit, before any rank allocates them.

    The split sizes come from a run directory (data): counts of 10^15 or hidden_size 10^12 asked for
    terabytes and failed as a measurement (exit 1). Host memory bounds CPU ranks (gloo); on a GPU, the
    device's memory bounds one rank.
    """
    import torch

    from ciuic_doctor.errors import UserError
    from ciuic_doctor.probes.comm.collectives import elem_bytes
    from ciuic_doctor.probes.comm.splits import bytes_per_rank, plan_from_run
    from ciuic_doctor.units import format_bytes

    need = bytes_per_rank(plan_from_run(splits_from, world), elem_bytes(dtype))
    if torch.cuda.is_available():
        have, where, ranks = torch.cuda.get_device_properties(0).total_memory, "device memory", 1
    else:
        try:
            import psutil

            have, where, ranks = psutil.virtual_memory().available, "host memory", local_ranks
        except (ImportError, OSError):
            return
    if need * ranks > have:
        raise UserError(
            f"--splits-from {splits_from}: the recorded routing needs {format_bytes(need)} of all_to_all "
            f"buffers per rank ({ranks} rank(s) here); {format_bytes(have)} of {where} is available"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sizes = parser.add_argument_group("sizes (K/M/G are powers of 1024, as in nccl-tests)")
    sizes.add_argument("-b", "--min-bytes", default="1K", metavar="SIZE", help="default 1K")
    sizes.add_argument("-e", "--max-bytes", default="64M", metavar="SIZE", help="default 64M")
    sizes.add_argument(
        "-f",
        "--step-factor",
        type=positive_float,
        default=2.0,
        metavar="F",
        help="size multiplier (default 2)",
    )
    what = parser.add_argument_group("what to measure")
    what.add_argument(
        "--collectives",
        default=",".join(COLLECTIVES),
        metavar="LIST",
        help=f"comma list (default all: {','.join(COLLECTIVES)})",
    )
    what.add_argument(
        "-d", "--dtype", default="float32", help=f"one of {', '.join(DTYPES)} (default float32)"
    )
    what.add_argument(
        "--algos",
        default=None,
        metavar="LIST",
        help="NCCL_ALGO values to compare for all_reduce, each in a fresh communicator "
        "(default ring,tree on NCCL; 'default' = NCCL's own choice; gloo has one algorithm)",
    )
    what.add_argument("--root", type=non_negative_int, default=0, help="broadcast root rank (default 0)")
    what.add_argument(
        "--splits-from",
        metavar="RUN",
        help="instead of the size sweep: all_to_all with the split sizes a job's recorded MoE routing "
        "produced (RUN/moe.rank<R>.jsonl from watch or job; experts placed on ranks as expert "
        "parallelism does), beside equal splits of the same volume, per layer",
    )
    timing = parser.add_argument_group("timing")
    timing.add_argument(
        "-w",
        "--warmup",
        type=non_negative_int,
        default=2,
        metavar="N",
        help="warm-up calls per size (default 2)",
    )
    timing.add_argument(
        "-n",
        "--iters",
        type=positive_int,
        default=None,
        metavar="N",
        help="timed calls per size (default: --time-budget)",
    )
    timing.add_argument(
        "--time-budget",
        type=positive_float,
        default=0.15,
        metavar="S",
        help="without --iters: time about S seconds per size and placement, 5 to 1000 calls (default 0.15)",
    )
    checks = parser.add_argument_group("checks and limits")
    checks.add_argument(
        "--min-busbw",
        type=positive_float,
        default=None,
        metavar="GBPS",
        help="fail when a table's average busbw is below 0.9 x GBPS (nccl-tests' convention)",
    )
    checks.add_argument(
        "--timeout",
        type=positive_float,
        default=120.0,
        metavar="S",
        help="process-group timeout: a dead or hung rank ends the run within it (default 120)",
    )
    checks.add_argument(
        "--bucket-bytes",
        default="25M",
        metavar="SIZE",
        help="the job's gradient-bucket size, where ring vs tree is judged (default 25M: DDP's default)",
    )
    launch = parser.add_argument_group("launch (outside torchrun)")
    launch.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        metavar="N",
        help="local ranks to start (default: one per GPU, else 2; in a Slurm allocation: ranks per "
        "node, default one per GPU, else 1); ignored under torchrun",
    )
    launch.add_argument(
        "--slurm",
        action="store_true",
        help="span every node of the Slurm allocation (the default where SLURM_JOB_ID is set): one srun "
        "step starting torchrun on each node, rendezvous on the first",
    )
    add_out(parser)


def _forwarded_argv(args: argparse.Namespace) -> list[str]:
    """The same options, spelled out, for the ranks `launch_local` starts."""
    argv = [
        NAME,
        f"--min-bytes={args.min_bytes}",
        f"--max-bytes={args.max_bytes}",
        f"--step-factor={args.step_factor!r}",
        f"--collectives={','.join(args.collectives)}",
        f"--dtype={args.dtype}",
        f"--root={args.root}",
        f"--warmup={args.warmup}",
        f"--time-budget={args.time_budget!r}",
        f"--timeout={args.timeout!r}",
        f"--bucket-bytes={args.bucket_bytes}",
    ]
    if args.algos:
        argv.append(f"--algos={','.join(args.algos)}")
    if args.iters:
        argv.append(f"--iters={args.iters}")
    if args.min_busbw is not None:
        argv.append(f"--min-busbw={args.min_busbw!r}")
    if args.splits_from:
        argv.append(f"--splits-from={args.splits_from}")
    return argv


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.launch import allocation_spread, in_torchrun

    _parse(args)
    if in_torchrun():
        return _run_rank(args)
    spread = allocation_spread(args.nproc, force=getattr(args, "slurm", False))
    if spread is not None:
        return _run_nodes(args, spread)
    return _run_local(args)


def _run_nodes(args: argparse.Namespace, spread) -> int:  # spread: cluster.spread.Spread
    """Every node of the allocation: one run directory, one torchrun per node (launch.launch_nodes)."""
    from ciuic_doctor.errors import UserError
    from ciuic_doctor.launch import launch_nodes
    from ciuic_doctor.rundir.store import RunDir, default_run_path

    if args.root >= spread.world:
        raise UserError(f"--root {args.root} is not a rank of a {spread.world}-rank run")
    run = RunDir.create(default_run_path(NAME, args.out))
    print(f"comm-bench: {spread.world} ranks on {spread.describe()} -> {run.path}", flush=True)
    return _launched(run, lambda: launch_nodes(spread, _forwarded_argv(args), run_dir=run.path, env=PARENT))


def _run_rank(args: argparse.Namespace) -> int:
    import os
    import sys

    from ciuic_doctor.errors import ProbeFailed, UserError
    from ciuic_doctor.probes.comm.bench import BenchConfig, run_bench

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.root >= world:
        raise UserError(f"--root {args.root} is not a rank of this {world}-rank job")
    check_fits(args.max_bytes, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if args.splits_from:
        check_splits_fit(args.splits_from, world, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), args.dtype)
    cfg = BenchConfig(
        collectives=args.collectives,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        step_factor=args.step_factor,
        dtype=args.dtype,
        warmup=args.warmup,
        iters=args.iters,
        time_budget_s=args.time_budget,
        algos=args.algos,
        timeout_s=args.timeout,
        min_busbw_gbps=args.min_busbw,
        bucket_bytes=args.bucket_bytes,
        root=args.root,
        out=args.out,
        argv=sys.argv[1:],
        splits_from=args.splits_from,
    )
    try:
        if args.splits_from:  # all_to_all with a job's recorded routing
            from ciuic_doctor.probes.comm.splits_bench import SplitsBench

            return run_bench(cfg, SplitsBench)
        return run_bench(cfg)
    except ProbeFailed:
        if os.environ.get(PARENT_ENV):
            return 1
        raise


def _run_local(args: argparse.Namespace) -> int:
    from ciuic_doctor.launch import check_nproc, launch_local
    from ciuic_doctor.rundir.store import RunDir, default_run_path

    nproc = args.nproc or _default_nproc()
    check_nproc(nproc)
    if args.root >= nproc:
        from ciuic_doctor.errors import UserError

        raise UserError(f"--root {args.root} is not a rank of a {nproc}-rank run")
    check_fits(args.max_bytes, nproc, nproc)
    if args.splits_from:
        check_splits_fit(args.splits_from, nproc, nproc, args.dtype)
    run = RunDir.create(default_run_path(NAME, args.out))
    return _launched(run, lambda: launch_local(nproc, _forwarded_argv(args), run_dir=run.path, env=PARENT))


def _launched(run, launch) -> int:  # run: RunDir; launch: starts the ranks and waits for them
    """Run `launch`; a failure is said in the ranks' own words (wrong elements, a dead rank: they wrote
    them to meta.json), which say more than the launcher's "rank 0 failed (exit code 1)"."""
    from ciuic_doctor.errors import ProbeFailed

    try:
        launch()
    except ProbeFailed:
        entry = run.read_meta().get("probes", {}).get(NAME, {})
        if entry.get("message"):
            raise ProbeFailed(f"{entry['message']}; records in {run.path / 'comm.jsonl'}") from None
        raise
    print(f"comm-bench: results in {run.path} (records: comm.jsonl; next: ciuic-doctor analyze {run.path})")
    return 0


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2
