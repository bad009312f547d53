"""A live view of a running job, one line per rank, attached from outside (in the spirit of nvitop).

    ciuic-doctor top --pid PID        PID: the torchrun agent, any rank, or a script that mp.spawn'ed ranks
    ciuic-doctor top RUN              the job writing the watched run directory RUN
    ciuic-doctor top --pid PID --once     one frame as text (for scripts and logs), then exit
    ciuic-doctor top --pid PID > log      not a terminal: a text frame every interval until the job ends

Every rank is found from the process tree and /proc/<pid>/environ (RANK, LOCAL_RANK, WORLD_SIZE,
GROUP_RANK, TORCHELASTIC_RUN_ID), its DataLoader workers below it, its GPU from NVML by PID (else
CUDA_VISIBLE_DEVICES and LOCAL_RANK). Per rank: CPU %, RSS, USS, threads, I/O rates, workers, GPU
utilisation / memory / power; when the job runs under `ciuic-doctor watch`, also step, steps/s, seconds
since the last step (AGE), step time, time before backward, loss, grad norm, loss scale, skipped steps in
the window and tokens/s. STATUS is the live verdict: STALLED (stopped, or no step for 20 median steps and
30 s), waiting (blocked on a stalled rank), straggler (pace >= 10 % behind the typical rank), overflows
(>= 5 fp16 skips in 100 steps), mem-climb (RSS rising steadily), DOWN (exited).

Keys: s sort (status, rank, step, step_time, cpu, rss), p stacks of the worst ranks (py-spy, on demand
only), q quit. Past a screen, the ranks needing attention are shown and the rest are one distribution
line. It reads /proc, NVML and the run directory only; it sends no signal and never imports torch.
"""

from __future__ import annotations

import argparse

from ciuic_doctor.cli_args import positive_float, positive_int

NAME = "top"
HELP = "live view of a running job, one line per rank, attached by PID or run directory (no torch import)"
ORDER = 41


def add_target(parser: argparse.ArgumentParser, *, run_positional: bool) -> None:
    if run_positional:
        parser.add_argument("run", nargs="?", metavar="RUN", help="a watched run directory being written")
    parser.add_argument("--pid", type=positive_int, help="the torchrun agent's PID, or any rank's")
    parser.add_argument(
        "--interval", type=positive_float, default=1.0, metavar="S", help="seconds between samples (1.0)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser, run_positional=True)
    parser.add_argument(
        "--once",
        action="store_true",
        help="print one frame as text and exit (piped output: a frame per interval)",
    )
    parser.add_argument(
        "--sort", choices=("status", "rank", "step", "step_time", "cpu", "rss"), default="status",
        help="row order (status: stalled and slow ranks first)",
    )  # fmt: skip
    parser.add_argument(
        "--rows", type=positive_int, metavar="N", help="--once: at most N rank lines (default: all)"
    )


REDISCOVER_SAMPLES = 5  # the process tree is walked every 5th sample (every 5 s at the default 1 s)


def open_job(pid: int | None, run: str | None, interval_s: float = 1.0):  # -> live.view.LiveJob
    """The live view of the job named by --pid or RUN; a UserError in one line otherwise. The tree walk
    (psutil reads every process of the host) scales with --interval, as every other read does."""
    from pathlib import Path

    from ciuic_doctor.errors import UserError
    from ciuic_doctor.live.view import LiveJob
    from ciuic_doctor.machine import nvml

    if (pid is None) == (run is None):
        raise UserError(
            "give a running job's PID (--pid PID) or its watched run directory (RUN), one of them"
        )
    if pid is not None:
        from ciuic_doctor.probes.memwatch.tree import attach

        attach(pid)  # this command itself, init's tree, a process that is gone: one line, exit 2
    run_dir = None
    if run is not None:
        run_dir = Path(run)
        if not run_dir.is_dir():
            raise UserError(f"{run}: not a directory")
    job = LiveJob(pid=pid, run_dir=run_dir, nvml=nvml.get(), rediscover_s=REDISCOVER_SAMPLES * interval_s)
    if run_dir is not None and not job.discovery.roots:
        raise UserError(f"{run}: no running process is writing this run directory")
    return job


def run(args: argparse.Namespace) -> int:
    import time

    from ciuic_doctor.live.render import as_text
    from ciuic_doctor.live.top_app import run_interactive

    job = open_job(args.pid, args.run, args.interval)
    if args.once:
        job.update()  # the first sample has no rates: take a second one an interval later
        time.sleep(args.interval)
        frame = job.update()
        rows = args.rows or max(1, len(frame.rows))
        print(as_text(frame, sort=args.sort, max_rows=rows), end="")
        return 0
    import sys

    if not sys.stdout.isatty():  # piped or redirected: a text frame every interval, as `top -b` does
        while True:
            began = time.monotonic()
            frame = job.update()
            print(as_text(frame, sort=args.sort, max_rows=args.rows or max(1, len(frame.rows))), flush=True)
            if not frame.alive:
                return 0
            time.sleep(max(0.0, args.interval - (time.monotonic() - began)))
    return run_interactive(job, interval_s=args.interval, sort=args.sort)
