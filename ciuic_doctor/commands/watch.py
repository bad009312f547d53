"""Run a training script unchanged, recording every optimizer step into RUN/steps.rank<R>.jsonl.

    ciuic-doctor watch [--out RUN] -- script.py [args]       as `python script.py [args]` would
    ciuic-doctor watch -- -m package.module [args]           as `python -m package.module [args]`
    torchrun --nproc-per-node N -m ciuic_doctor watch -- script.py [args]   one stream per rank

Per step: loss (the scalar backward() ran on, unscaled), LR, grad norm (clip_grad_norm_'s, else computed),
GradScaler scale and skipped steps, step time, CUDA allocator counters, RSS and USS, and a cross-rank
weight checksum every --checksum-every steps. No device sync per step. Records are on disk as they are
made (kill -9 keeps every finished step); the exit code is the script's.
"""

from __future__ import annotations

import argparse
import sys

from ciuic_doctor.commands._common import add_out, positive_float, positive_int

NAME = "watch"
HELP = "run a training script unchanged and record every optimizer step (loss, lr, grad norm, memory)"
ORDER = 31


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out(parser)
    parser.add_argument(
        "--checksum-every",
        type=positive_int,
        default=10,
        metavar="K",
        help="steps between cross-rank weight checksums, also taken at step 1 (default 10)",
    )
    parser.add_argument(
        "--uss-every",
        type=positive_int,
        default=10,
        metavar="K",
        help="fewest steps between USS reads; a read walks the page tables (~1 ms and up) (default 10)",
    )
    parser.add_argument(
        "--no-grad-norm",
        action="store_true",
        help="do not compute the gradient norm when the script does not clip",
    )
    parser.add_argument("--no-checksum", action="store_true", help="no cross-rank weight checksum")
    parser.add_argument(
        "--snapshot-on-leak",
        action="store_true",
        help="CUDA only: record allocation history and dump RUN/memory_snapshot.rank<R>.pickle "
        "(open at pytorch.org/memory_viz) when allocated memory keeps growing",
    )
    # issue 16 (hang doctor): the watchdog's two settings; the code is in probes/watch_hang.py
    parser.add_argument(
        "--hang-after",
        type=positive_float,
        metavar="S",
        help="seconds without an optimizer step or a completed collective that count as a hang: dump "
        "RUN/hang.rank<R>.* (default: 20 median steps, at least 30 s, at most 0.8 x the process-group "
        "timeout)",
    )
    parser.add_argument(
        "--fr-buffer",
        type=positive_int,
        default=2000,
        metavar="N",
        help="Flight Recorder entries kept per rank (TORCH_FR_BUFFER_SIZE; default 2000)",
    )
    parser.add_argument(
        "script_argv",  # not "command": the CLI front keeps the sub-command's name there
        nargs=argparse.REMAINDER,
        metavar="-- script.py [args] | -- -m module [args]",
        help="the training script and its arguments",
    )


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.probes.watch_target import check_target  # no torch: refuse bad targets fast

    argv = list(args.script_argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    check_target(argv)

    import torch

    from ciuic_doctor.probes.watch import run_script
    from ciuic_doctor.watch import attach

    if args.snapshot_on_leak and not torch.cuda.is_available():
        print("ciuic-doctor watch: --snapshot-on-leak needs CUDA; ignored on this machine", file=sys.stderr)

    session = attach(
        out=args.out,
        checksum_every=args.checksum_every,
        uss_every=args.uss_every,
        grad_norm=not args.no_grad_norm,
        checksum=not args.no_checksum,
        snapshot_on_leak=args.snapshot_on_leak,
        probe_fields={"argv": argv},
    )
    from ciuic_doctor.probes.watch_hang import HangConfig, arm  # issue 16: before the script's process group

    disarm = arm(session, HangConfig(hang_after_s=args.hang_after, fr_buffer=args.fr_buffer))  # issue 16
    code = 1
    try:
        code = run_script(argv)
    finally:
        disarm(code)  # issue 16
        session.close()
        if session.rank == 0:
            status = "finished" if code == 0 else "failed"
            session.run.record_probe("watch", status=status, exit_code=code, steps=session.steps_written)
        print(
            f"ciuic-doctor watch: rank {session.rank}: {session.steps_written} steps recorded in "
            f"{session.run.stream_path('steps', session.rank)}",
            file=sys.stderr,
        )
    return code
