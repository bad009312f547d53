"""The whole checkup of a training job in one command, into one run directory. On the embedded
DeepSeek-V3 job by default (or the job --spec describes; `-- train.py [args]` checks your own script
under watch and memwatch; see README, "Your own script"), each phase runs as a `python -m ciuic_doctor`
subprocess writing into the same RUN, in this order: comm-bench on --nproc local ranks (a small size range;
with CUDA up to twice the gradient bucket, so Ring vs Tree is judged where the job's all-reduces are);
loader-sweep within --loader-budget seconds; the job itself under watch, with memwatch attached to it by
PID; checkpoint-check when this build has it; then the analyses, the recommendations, the seed-tip check,
report.html and summary.md. A line per phase shows its time, and the summary is printed at the end. A phase
that fails, times out or is missing is recorded in meta.json with the reason and the checkup goes on: the
report shows that section as not run, or shows the records it left with a warning. Each phase's output is
kept in RUN/checkup-<phase>.log (secrets scrubbed). Exit code 0 when the checkup completed, whatever it
found (with --strict, 1 when any check failed); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ciuic_doctor.checkup.phases import CPU_MAX_BYTES, MEMWATCH_INTERVAL_S, Checkup, parse_skip
from ciuic_doctor.cli_args import (
    add_out,
    add_parallel,
    add_set,
    parallel_from_args,
    positive_float,
    positive_int,
)
from ciuic_doctor.commands.verify import add_budget

NAME = "checkup"
HELP = "measure the job end to end (collectives, loader, steps, memory) and write the report"
ORDER = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", metavar="JOB.TOML", help="the job to check (default: the embedded DeepSeek-V3 job)"
    )
    add_out(parser)
    parser.add_argument(
        "--nproc",
        type=positive_int,
        help="local ranks (default: the spec's procs_per_node; for a script 1, more runs it under torchrun)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        help="training steps of the job (default: the spec's); a script is stopped cleanly after N "
        "optimizer steps",
    )
    parser.add_argument(
        "--loader-budget", type=positive_float, default=20.0, metavar="S", help="loader-sweep budget (20 s)"
    )
    parser.add_argument(
        "--skip", default="", metavar="LIST", help="phases to leave out, e.g. comm-bench,loader-sweep"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when any check failed")
    parser.add_argument(
        "--baseline",
        metavar="RUN",
        help="an earlier checkup to compare with (apply and verify: checkup, apply the recommendations, "
        "checkup --baseline <first run>)",
    )
    add_set(
        parser,
        "check the job with this setting changed: any spec key for the embedded job, the `watch --set` keys "
        "for a script",
    )
    verify = parser.add_argument_group("try the recommendations on the job: checkup --verify")
    verify.add_argument(
        "--verify",
        action="store_true",
        help="then try each recommended change on the job, interleaved A/B, and keep only what helps "
        "(as `ciuic-doctor verify RUN`)",
    )
    add_budget(verify)
    verify.add_argument(
        "--include-unverified",
        action="store_true",
        help="recommended.env/.toml: add the changes that did not help or were not tried, commented out",
    )
    add_parallel(parser)
    script = parser.add_argument_group("your own script: checkup [options] -- train.py [args]")
    script.add_argument(
        "--dataset",
        metavar="MODULE:CALLABLE",
        help="rebuilds the script's dataset for loader-sweep (else loader-sweep is not run)",
    )
    script.add_argument(
        "--timeout",
        type=positive_float,
        default=1800.0,
        metavar="S",
        help="the script's time limit under watch (default 1800 s; --steps N keeps it short)",
    )
    script.add_argument(
        "script_argv",  # not "command": the CLI front keeps the sub-command's name there
        nargs=argparse.REMAINDER,
        metavar="-- script.py [args] | -- -m module [args]",
        help="check your own training script instead of the embedded job, e.g. "
        "`ciuic-doctor checkup --nproc 2 --steps 50 -- train.py --config tiny.yaml`",
    )


def run(args: argparse.Namespace) -> int:
    with parallel_from_args(args):  # a --scheduler that does not answer is refused before any phase
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ciuic_doctor.checkup import script as checkup_script
    from ciuic_doctor.rundir.store import default_run_path

    args.out = str(default_run_path("checkup", args.out))  # one folder for the checkup and its verify
    if script := checkup_script.script_argv(args):  # the user's own script
        from ciuic_doctor.probes.watch.overrides import parse

        parse(args.set_items)  # a bad --set is refused before anything runs
        if args.dataset:
            check_dataset_arg(args.dataset)
        code = checkup_script.run(args, script)
    else:
        code = _run_embedded(args)
    if args.verify:
        from ciuic_doctor.checkup.verify import verify_phase

        return verify_phase(args) or code
    return code


def _embedded_spec(args: argparse.Namespace) -> object:
    """The job spec: --spec, then --set (a bad value blamed on --set, before anything runs)."""
    from ciuic_doctor.errors import UserError
    from ciuic_doctor.jobs.options import parse_set_value
    from ciuic_doctor.jobs.spec import load_spec, with_updates

    spec = load_spec(args.spec)
    updates = {}
    for item in args.set_items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set dataloader.num_workers=4")
        updates[key.strip()] = parse_set_value(value.strip())
    if updates:
        spec = with_updates(spec, updates, origin="--set " + ", ".join(updates))
    return spec


def check_dataset_arg(text: str) -> None:
    """--dataset module:callable, checked before the script runs: the loader phase comes after it
    (minutes), and a name that cannot be found was only found out then. The module is located, not
    imported: importing runs user code, which the loader-sweep phase does in its own process."""
    import importlib.util
    import os
    import sys

    from ciuic_doctor.errors import UserError

    module, sep, attr = text.partition(":")
    if not sep or not module or not attr:
        raise UserError(f"--dataset {text!r}: expected module:callable, e.g. mydata:build")
    if os.getcwd() not in sys.path:  # loader-sweep imports it from here, as `python -m` would
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise UserError(f"--dataset {text}: cannot find module {module!r} ({exc})") from None
    if found is None:
        raise UserError(f"--dataset {text}: no module {module!r} here (run from the folder that holds it)")


def _run_embedded(args: argparse.Namespace) -> int:
    from ciuic_doctor.errors import UserError

    if args.dataset:
        raise UserError("--dataset rebuilds a script's dataset: give the script, `checkup ... -- train.py`")
    from ciuic_doctor.launch import check_nproc
    from ciuic_doctor.rundir.store import RunDir, default_run_path
    from ciuic_doctor.units import format_size_short

    skip = parse_skip(args.skip, ("comm-bench", "loader-sweep", "job", "memwatch", "checkpoint-check"))
    spec = _embedded_spec(args)
    baseline = RunDir.open(args.baseline) if args.baseline else None  # a wrong path fails before measuring
    nproc = args.nproc or spec.job.procs_per_node
    from ciuic_doctor.launch import allocation_spread

    spread = allocation_spread(nproc)  # in a Slurm allocation: the job and comm-bench span its nodes
    if spread is None:
        check_nproc(nproc, "--nproc" if args.nproc else "the spec's [job] procs_per_node =")
    run_dir = RunDir.create(default_run_path("checkup", args.out))
    out = str(run_dir.path)
    if args.set_items:  # every phase (and the report) runs the job as --set changed it
        from ciuic_doctor.jobs.spec import dump_spec

        args.spec = str(run_dir.write_text("checkup-spec.toml", dump_spec(spec)).resolve())
    spec_args = ["--spec", str(Path(args.spec).resolve())] if args.spec else []
    started = time.perf_counter()
    run_dir.record_environment()
    run_dir.update_meta(spec=spec.to_dict(), spec_source=spec.source, checkup={"phases": []})
    where = f"{nproc} local rank(s)" if spread is None else f"{spread.world} ranks on {spread.describe()}"
    print(f"checkup of {spec.job.name}: {where}, run directory {out}", flush=True)

    bucket = int(spec.distributed.bucket_cap_mb * 2**20)
    cuda = run_dir.read_meta()["env"].get("cuda_available")
    max_bytes = format_size_short(1 << (2 * bucket - 1).bit_length()) if cuda else CPU_MAX_BYTES
    job_argv = ["job", "--nproc", str(nproc), "--out", out, *spec_args]
    if args.steps:
        job_argv += ["--steps", str(args.steps)]
    comm_argv = ["comm-bench", "--nproc", str(nproc), "--out", out, "-b", "1K", "-e", max_bytes, "-f", "4"]
    comm_argv += ["--time-budget", "0.05", "--timeout", "60", "--bucket-bytes", str(bucket)]
    loader_argv = ["loader-sweep", *spec_args, "--budget", f"{args.loader_budget:g}"]
    loader_argv += ["--local-world-size", str(nproc), "--out", out]
    plan = [
        ("comm-bench", comm_argv, 180.0),
        ("loader-sweep", loader_argv, args.loader_budget + 90.0),
        ("job", job_argv, 300.0),
        ("memwatch", [], 0.0),  # attached to the job, see below
        ("checkpoint-check", ["checkpoint-check", *spec_args, "--nproc", str(nproc), "--out", out], 180.0),
    ]
    checkup = Checkup(run_dir, total=len(plan) + 1)
    for name, argv, timeout_s in plan:
        if name == "memwatch":
            continue  # recorded together with the job
        if name in skip:
            checkup.skip(name, "left out with --skip")
            if name == "job":
                checkup.skip("memwatch", "no job to attach to (job left out with --skip)")
            continue
        if name != "job":
            checkup.run_phase(name, argv, timeout_s)
            continue
        if spread is not None:  # memwatch once per node, beside the job's step there
            job, job_proc, watcher, watch_proc = _start_on_nodes(checkup, spread, argv, out, skip)
        else:
            job, job_proc = checkup.start("job", argv)
            watcher, watch_proc = (None, None)
        if spread is None and job_proc is not None and "memwatch" not in skip:
            watch_argv = ["memwatch", "--pid", str(job_proc.pid), "--interval", MEMWATCH_INTERVAL_S]
            watcher, watch_proc = checkup.start("memwatch", [*watch_argv, "--out", out])
        checkup.finish(job, job_proc, timeout_s)
        if watcher is not None:
            checkup.finish(watcher, watch_proc, 30.0)  # it ends when the job's process tree does
        else:
            checkup.skip("memwatch", "left out with --skip" if "memwatch" in skip else "no job to attach to")

    return checkup.report(args, started, baseline=baseline)


def _start_on_nodes(checkup: Checkup, spread, job_argv: list[str], out: str, skip: set[str]):
    """The job as one step over the allocation's nodes, and memwatch as a second step with one task per
    node (sharing the CPUs: --overlap) that finds its node's part of the job by the step's name. Each
    node writes its own memwatch file (memwatch.rank<node index>.jsonl)."""
    import sys

    from ciuic_doctor.cluster import STEP_NAME_ENV

    name = spread.new_name("job")
    job, job_proc = checkup.start("job", job_argv, env={STEP_NAME_ENV: name})
    if job_proc is None or "memwatch" in skip:
        return job, job_proc, None, None
    alloc = spread.alloc
    srun = ["srun", f"--jobid={alloc.job_id}", f"--nodes={spread.nnodes}", f"--ntasks={spread.nnodes}"]
    srun += ["--ntasks-per-node=1", "--overlap", f"--job-name={spread.new_name('memwatch')}", sys.executable]
    watch_argv = ["memwatch", "--step", name, "--interval", MEMWATCH_INTERVAL_S, "--out", out]
    watcher, watch_proc = checkup.start("memwatch", watch_argv, launcher=srun)
    return job, job_proc, watcher, watch_proc
