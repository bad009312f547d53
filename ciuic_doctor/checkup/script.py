"""`ciuic-doctor checkup [options] -- train.py [args]` (or `-- -m module [args]`): the checkup of the
user's own script, into one run directory, with checkup's Phase log and progress lines:

1. comm-bench on --nproc local ranks (a one-process job runs no collective: skipped, with that reason);
2. the script under watch (under torchrun when --nproc > 1), memwatch attached to its process tree;
   `--steps N` stops it cleanly after N optimizer steps, every record kept;
3. loader-sweep on the script's own dataset when `--dataset module:callable` rebuilds it, starting from
   the DataLoader settings watch observed (else not run, with the reason);
4. the report, whose job spec is what the script configured (meta.json `observed`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ciuic_doctor.checkup.phases import CPU_MAX_BYTES, MEMWATCH_INTERVAL_S, Checkup, parse_skip

OBSERVED_SPEC = "checkup-observed.toml"  # the observed job as a spec file, for loader-sweep's --spec
PHASES = ("comm-bench", "job", "memwatch", "loader-sweep", "checkpoint-check")


def script_argv(args: argparse.Namespace) -> list[str]:
    from ciuic_doctor.probes.watch.target import strip_interpreter

    argv = list(getattr(args, "script_argv", None) or [])
    return strip_interpreter(argv[1:] if argv and argv[0] == "--" else argv)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from ciuic_doctor.probes.watch.target import check_target  # no torch: refuse a bad target first

    check_target(argv)
    from ciuic_doctor.launch import check_nproc
    from ciuic_doctor.rundir.store import RunDir, default_run_path

    skip = parse_skip(args.skip, PHASES)
    nproc = args.nproc or 1
    check_nproc(nproc, "--nproc")
    baseline = RunDir.open(args.baseline) if args.baseline else None  # a wrong path fails before measuring
    run_dir = RunDir.create(default_run_path("checkup", args.out))
    out = str(run_dir.path)
    started = time.perf_counter()
    run_dir.record_environment()
    run_dir.update_meta(checkup={"phases": [], "script": argv, "nproc": nproc})
    from ciuic_doctor.machine.envinfo import redact_argv
    from ciuic_doctor.render_text import terminal

    shown = terminal(" ".join(redact_argv(argv)))  # --hf-token X never reaches the terminal or a log
    print(f"checkup of {shown}: {nproc} local rank(s), run directory {out}", flush=True)
    checkup = Checkup(run_dir, total=len(PHASES) + 1)

    if "comm-bench" in skip:
        checkup.skip("comm-bench", "left out with --skip")
    elif nproc == 1:
        checkup.skip("comm-bench", "a one-process job runs no collective (give --nproc N for N ranks)")
    else:
        comm = ["comm-bench", "--nproc", str(nproc), "--out", out, "-b", "1K", "-e", CPU_MAX_BYTES]
        comm += ["-f", "4", "--time-budget", "0.05", "--timeout", "60"]
        checkup.run_phase("comm-bench", comm, 180.0)

    _watch_phase(checkup, args, argv, nproc=nproc, out=out, skip=skip)
    _loader_phase(checkup, args, run_dir, nproc=nproc, out=out, skip=skip)
    checkup.skip(
        "checkpoint-check",
        "checkpoint-check saves and resumes the embedded job; a script's own checkpoints are not reached",
    )

    return checkup.report(args, started, baseline=baseline)


def _watch_phase(
    checkup: Checkup, args: argparse.Namespace, argv: list[str], *, nproc: int, out: str, skip: set[str]
) -> None:
    """The script under watch ("job", the report's training-job section), memwatch on its process tree."""
    if "job" in skip:
        checkup.skip("job", "left out with --skip")
        checkup.skip("memwatch", "no job to attach to (job left out with --skip)")
        return
    watch = ["watch", "--out", out, *(["--steps", str(args.steps)] if args.steps else [])]
    watch += [x for item in getattr(args, "set_items", []) for x in ("--set", item)]
    watch += ["--", *argv]
    launcher = None
    if nproc > 1:  # torch's own launcher, as the user would run the script
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc-per-node", str(nproc)]
    job, job_proc = checkup.start("job", watch, launcher=launcher)
    watcher, watch_proc = None, None
    if job_proc is not None and "memwatch" not in skip:
        memwatch = ["memwatch", "--pid", str(job_proc.pid), "--interval", MEMWATCH_INTERVAL_S, "--out", out]
        watcher, watch_proc = checkup.start("memwatch", memwatch)
    checkup.finish(job, job_proc, args.timeout)
    if watcher is not None:
        checkup.finish(watcher, watch_proc, 30.0)  # it ends when the script's process tree does
    else:
        checkup.skip("memwatch", "left out with --skip" if "memwatch" in skip else "no job to attach to")


def _loader_phase(
    checkup: Checkup, args: argparse.Namespace, run_dir: Any, *, nproc: int, out: str, skip: set[str]
) -> None:
    """loader-sweep on the script's dataset, from the settings the script used (its `observed` spec)."""
    if "loader-sweep" in skip:
        checkup.skip("loader-sweep", "left out with --skip")
        return
    observed = run_dir.read_meta().get("observed") or {}
    if observed and not observed.get("dataloader"):
        checkup.skip("loader-sweep", "the script built no torch DataLoader: there is nothing to tune")
        return
    if not args.dataset:
        checkup.skip(
            "loader-sweep",
            "the script's dataset cannot be rebuilt outside the script: give --dataset module:callable",
        )
        return
    sweep = ["loader-sweep", "--dataset", args.dataset, "--budget", f"{args.loader_budget:g}"]
    sweep += ["--local-world-size", str(nproc), "--out", out]
    if observed:
        from ciuic_doctor.jobs.observed import spec_from_observed
        from ciuic_doctor.jobs.spec import dump_spec

        spec_path = run_dir.write_text(OBSERVED_SPEC, dump_spec(spec_from_observed(observed).spec))
        sweep += ["--spec", str(Path(spec_path).resolve())]
    checkup.run_phase("loader-sweep", sweep, args.loader_budget + 90.0)
