"""Run a training script unchanged, recording every optimizer step into RUN/steps.rank<R>.jsonl.

    ciuic-doctor watch [--out RUN] -- script.py [args]       as `python script.py [args]` would
    ciuic-doctor watch -- -m package.module [args]           as `python -m package.module [args]`
    ciuic-doctor watch -- project_dir/ [args]                 as `python project_dir/` (its __main__.py)
    torchrun --nproc-per-node N -m ciuic_doctor watch -- script.py [args]   one stream per rank

Per step: loss (the scalar backward() ran on, unscaled), LR, grad norm (clip_grad_norm_'s, else computed),
GradScaler scale (the one the step used, and the next) and skipped steps, step time, CUDA allocator
counters, RSS and USS, and a cross-rank weight checksum every --checksum-every steps. Every optimizer's
steps are recorded (`optimizer`: index in creation order, `optimizer_class`). Ranks the script starts
itself (torch.multiprocessing.spawn, a re-run of its own argv as Lightning devices=2 does) record their
own streams. No device sync per step. Records are on disk as they are made (kill -9 keeps every finished
step); the exit code is the script's; meta.json's probes.watch.status says how it ended: finished,
failed (exit_code), interrupted (Ctrl-C, 130), exited (os._exit), exec (os.exec*: it became another
program) or killed (SIGTERM, 143).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from ciuic_doctor.cli_args import add_out, add_set, positive_float, positive_int
from ciuic_doctor.cluster import NODE_ENV, node_identity
from ciuic_doctor.errors import UserError

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
    parser.add_argument(
        "--steps",
        type=positive_int,
        metavar="N",
        help="stop the script cleanly after N optimizer steps (SystemExit(0); every record is kept)",
    )
    parser.add_argument(
        "--agree-timeout",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="seconds step 1 waits for every rank to say it is watched before the weight checksum; "
        "past it the checksum is skipped (and meta.json says why), never waited for (default 60)",
    )
    parser.add_argument(
        "--no-follow",
        action="store_true",
        help="do not attach watch to the ranks the script starts itself (mp.spawn, a re-run of its argv)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a rank started by one
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
        "--metrics-port",
        type=positive_int,
        metavar="N",
        help="serve every rank of this node on a Prometheus endpoint at port N (`ciuic-doctor export`, "
        "started by local rank 0 in a process of its own; it ends with the job)",
    )
    parser.add_argument(
        "--bind",
        metavar="ADDR",
        default="127.0.0.1",
        help="with --metrics-port: the address the endpoint listens on (default 127.0.0.1; it is not "
        "authenticated: see `ciuic-doctor export --help`)",
    )
    parser.add_argument(  # probes/watch/moe.py
        "--moe-every",
        type=positive_int,
        default=10,
        metavar="N",
        help="record MoE expert load (tokens per expert per router) every N steps, and at step 1 "
        "(RUN/moe.rank<R>.jsonl; default 10)",
    )
    parser.add_argument(
        "--no-moe", action="store_true", help="no MoE expert-load or token counting hooks on the model"
    )
    parser.add_argument(
        "--peak-tflops",
        type=positive_float,
        metavar="T",
        help="the accelerator's dense peak TFLOP/s for MFU, when the built-in table does not know it (a CPU "
        "run, a new device); kept in meta.json for analyze",
    )
    add_set(
        parser,
        "run the script with this setting changed: dataloader.num_workers / prefetch_factor / pin_memory / "
        "persistent_workers, precision.init_scale / growth_interval, optim.clip_max_norm, "
        "distributed.timeout_s, distributed.env.NCCL_*|TORCH_*|GLOO_*; a key the script gives no hold to "
        "ends it with exit 2",
    )
    parser.add_argument(
        "script_argv",  # not "command": the CLI front keeps the sub-command's name there
        nargs=argparse.REMAINDER,
        metavar="-- script.py [args] | -- dir/ [args] | -- -m module [args]",
        help="the training script and its arguments",
    )


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.probes.watch.target import check_target, strip_interpreter  # no torch here

    argv = list(args.script_argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    argv = strip_interpreter(argv)  # `watch -- python train.py` as `watch -- train.py`
    check_target(argv)
    from ciuic_doctor.probes.watch import overrides as watch_overrides  # no torch here

    settings = watch_overrides.parse(args.set_items)  # unknown keys, bad values: exit 2 before running
    args.start_cwd = os.getcwd()  # the script may chdir; verify starts it where the user did

    import torch

    from ciuic_doctor.probes.watch import children as watch_children
    from ciuic_doctor.probes.watch import exit as watch_exit
    from ciuic_doctor.probes.watch import observe as watch_observe
    from ciuic_doctor.probes.watch.session import run_script
    from ciuic_doctor.rundir.watch_end import process_fields
    from ciuic_doctor.watch import attach

    if args.snapshot_on_leak and not torch.cuda.is_available() and not args.child:
        print("ciuic-doctor watch: --snapshot-on-leak needs CUDA; ignored on this machine", file=sys.stderr)
    watch_children.set_target(argv)
    watch_observe.stop_after(args.steps)
    session = attach(
        out=args.out,
        child=args.child,
        checksum_every=args.checksum_every,
        uss_every=args.uss_every,
        grad_norm=not args.no_grad_norm,
        checksum=not args.no_checksum,
        snapshot_on_leak=args.snapshot_on_leak,
        agree_timeout_s=args.agree_timeout,
        follow_children=not args.no_follow,
        moe=not args.no_moe,
        moe_every=args.moe_every,
        probe_fields={
            **process_fields(),  # a reader on this host can tell a run whose process is gone
            **_rerun_fields(args, argv),
        },
    )
    try:
        refuse_planted(session.run.path, session.rank or 0)
    except UserError:
        session.close()
        raise
    if session.rank == 0 and not args.child:  # verify re-runs it without asking only when signed
        _sign(session.run, args, argv)
    if session.rank == 0 and not args.child:  # records the end a fatal signal or SIGKILL leaves unsaid
        from ciuic_doctor.probes.watch import sentinel

        sentinel.start(session.run.path, session.rank)
    if args.peak_tflops and session.rank == 0 and not args.child:
        session.run.update_meta(mfu={"peak_tflops": args.peak_tflops, "source": "watch --peak-tflops"})
    started = time.time()
    if args.metrics_port and not args.child:  # one exporter per node, outside this process
        from ciuic_doctor.live.exporter import should_start, start_exporter

        if should_start():
            start_exporter(port=args.metrics_port, run_dir=session.run.path, bind=args.bind)

    def report(status: str, code: int) -> None:
        children = watch_children.children_started()
        _report(session, args, argv, code=code, status=status, children=children, since=started)

    def on_abrupt_end(status: str, code: int) -> None:  # os._exit or SIGTERM: no finally will run
        if status in ("exited", "exec"):  # os._exit / os.exec*, on the script's own thread: records flushed
            session.close()
        report(status, code)

    undo_exit = watch_exit.install(on_abrupt_end)
    code, status = 1, "failed"
    from ciuic_doctor.probes.watch.hang import HangConfig, arm  # before the script's process group

    hang = HangConfig(hang_after_s=args.hang_after, fr_buffer=args.fr_buffer)
    watch_children.set_hang({"hang_after_s": hang.hang_after_s, "fr_buffer": hang.fr_buffer})
    disarm = arm(session, hang)
    forced = watch_overrides.install(settings)  # outside watch's own hooks, so they see the value
    try:
        code = run_script(argv)
        if code == 0 and not forced.refused and (line := forced.refusal("known when it ended")):
            print(line, file=sys.stderr, flush=True)  # e.g. --steps ended it before the first-step check
            forced.refused, code = line, watch_overrides.REFUSED_EXIT
        status = {0: "finished", 130: "interrupted"}.get(code, "failed")
        status = "refused" if forced.refused else status  # a --set key it gives no hold to
    except BaseException:  # our own failure around the script: still say how it ended
        status = "failed"
        raise
    finally:
        forced.close()  # before watch's own hooks go
        undo_exit()
        disarm(code)
        session.close()
        watch_observe.write_meta()  # the final `observed`, every step record flushed
        report(status, code)
    return code


def _rerun_fields(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """What verify re-runs: argv, the folder it started in, its local rank count, the --set items.
    The rank count is torchrun's LOCAL_WORLD_SIZE (1 outside torchrun)."""
    try:
        nproc = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        nproc = 1
    fields: dict[str, Any] = {
        "argv": argv,
        "cwd": getattr(args, "start_cwd", None) or os.getcwd(),
        "nproc": nproc,
    }
    if args.set_items:
        fields["set"] = list(args.set_items)
    return fields


def _sign(run: Any, args: argparse.Namespace, argv: list[str]) -> None:
    """Sign the fields verify re-runs with this user's key (ciuic_doctor/rundir/trust.py)."""
    from ciuic_doctor.rundir import trust

    sig = trust.signature("watch", _rerun_fields(args, argv))
    if sig is not None:
        run.update_meta(signatures={"watch": sig})


def refuse_planted(run: Path, rank: int) -> None:
    """Refuse, before the script starts, a run directory where a file this rank writes is a symlink, a
    FIFO or a device (or a folder where a record file belongs).

    Such a file is never written through; found only when first written, a planted
    `hang.rank0.last.json` ended watch in a traceback before the script ran, and a planted steps stream
    stopped the recording at the first step, then said "no optimizer step was seen"."""
    import stat

    mine = f".rank{rank}."
    try:
        names = sorted(os.listdir(run))
    except OSError:
        return
    for name in names:
        if mine not in name and name != "hang.fr":
            continue
        try:
            mode = os.lstat(run / name).st_mode
        except OSError:
            continue
        record_file = name.endswith((".json", ".jsonl", ".txt"))
        if stat.S_ISREG(mode) or (stat.S_ISDIR(mode) and not record_file):
            continue
        from ciuic_doctor.rundir.safe_io import kind_of

        raise UserError(
            f"{run / name} is {kind_of(mode)}, and watch writes there only to a regular file of its "
            "own: remove it, or record into another --out"
        )


def _report(
    session: Any,
    args: argparse.Namespace,
    argv: list[str],
    *,
    code: int,
    status: str,
    children: int,
    since: float,
) -> None:
    """The closing line on stderr and, from the launching process, how the job ended in meta.json."""
    where = session.run.stream_path("steps", session.rank)
    if args.child:  # a rank the script started: the launching process records the job's status
        print(f"ciuic-doctor watch: rank {session.rank}: {session.steps_written} steps recorded in {where}",
              file=sys.stderr)  # fmt: skip
        return
    per_rank = _records_per_rank(session.run, since) if children else {}
    steps = per_rank.get(session.rank, session.steps_written) if children else session.steps_written
    fields = {"status": status, "exit_code": code, "steps": steps, "segment": session.segment}
    if children:
        fields.update(children=children, steps_all_processes=sum(per_rank.values()))
    fields.update(_rerun_fields(args, argv))  # verify re-runs the script from here, as it ran
    if session.checksum_note:
        fields["checksum"] = session.checksum_note
    if os.environ.get(NODE_ENV):  # a Slurm task: which node, job and step rank 0 ran in
        fields["slurm"] = node_identity()
    if session.rank == 0:
        session.run.record_probe("watch", **fields)
    line = f"ciuic-doctor watch: rank {session.rank}: {session.steps_written} steps recorded in {where}"
    if children and not session.steps_written:  # mp.spawn: the ranks are the children; say what each holds
        held = ", ".join(f"rank {r}: {n}" for r, n in sorted(per_rank.items())) or "none"
        line = (
            f"ciuic-doctor watch: {children} process(es) the script started recorded their steps in "
            f"{session.run.path} ({held} step records this run)"
        )
    elif children:
        others = sum(n for r, n in per_rank.items() if r != session.rank)
        line += f"; {children} process(es) the script started recorded {others} more"
    elif session.steps_written == 0 and code == 0:
        line += (
            " -- no optimizer step was seen: the script stepped no torch.optim optimizer in this process "
            "(see README, 'What watch understands')"
        )
    print(line, file=sys.stderr)


def _records_per_rank(run: Any, since: float) -> dict[int, int]:
    """Step records each rank's file holds from this run (t >= since: a re-run appends to a resumed one)."""
    counts: dict[int, int] = {}
    for record in run.read("steps").records:
        rank = record.get("rank")
        if isinstance(rank, int) and (record.get("t") or 0) >= since:
            counts[rank] = counts.get(rank, 0) + 1
    return counts
