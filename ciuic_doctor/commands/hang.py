"""Say which rank a hung (or timed-out) distributed job waits for, where it is, and why.

    ciuic-doctor hang RUN [--json]          judge the hang dumps a watched job wrote into RUN
    ciuic-doctor hang --pid PID             a running job: PID is the torchrun agent or any rank
    ciuic-doctor hang --pid PID --out RUN   ... and keep what was gathered in RUN

Under `ciuic-doctor watch` every rank dumps by itself (RUN/hang.rank<R>.json: its Flight Recorder trace
and every thread's stack) when no step and no collective completed for --hang-after seconds, or when a
collective fails. `kill -USR1 <rank pid>` asks one rank for the same dump at any time.

--pid asks every watched rank below PID for a dump (SIGUSR1) and takes every other rank's Python stack
with py-spy (`pip install 'ciuic-doctor[hang]'`; it needs ptrace permission on the ranks; two looks 2 s
apart: a rank still moving is not judged stuck), plus the
Flight Recorder dumps the job wrote where its TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE
point. Then it judges, as `hang RUN` does: the culprit rank(s) and host, the collective the others wait
in (op, sequence number, sizes, dtype, process group, call site), the kind of hang (desync, stall,
mismatch, in-collective, dead) and what to look at next. Exit code 1 when a hang was found.
"""

from __future__ import annotations

import argparse
import json
import sys

from ciuic_doctor.cli_args import positive_float

NAME = "hang"
HELP = "which rank a hung job waits for, where it is and why (from watch's dumps, or --pid with py-spy)"
ORDER = 62


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", metavar="RUN", help="a run directory with hang dumps (from watch)")
    parser.add_argument("--pid", type=int, help="a running job: the torchrun agent's PID or any rank's")
    parser.add_argument("--out", metavar="RUN", help="with --pid: where to keep the stacks (default: the "
                        "watched ranks' run directory, else reports/<time>-hang)")  # fmt: skip
    parser.add_argument(
        "--wait",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="with --pid: seconds to wait for watched ranks' own dumps before using py-spy (default 30)",
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.analysis.hang import judge, run_status
    from ciuic_doctor.errors import UserError
    from ciuic_doctor.render_text import findings_table, terminal
    from ciuic_doctor.rundir.hang.files import has_hang_dumps, load
    from ciuic_doctor.rundir.store import RunDir

    if args.run is None and args.pid is None:
        raise UserError("give a run directory (hang RUN) or a running job (hang --pid PID)")
    if args.run is not None and args.pid is not None:
        raise UserError("give a run directory (hang RUN) or a running job (hang --pid PID), not both")
    if args.pid is not None and args.pid <= 0:
        raise UserError(f"--pid {args.pid}: a process id is a positive number")
    if args.pid is not None:
        from ciuic_doctor.probes.hang.pid import gather

        run_dir = gather(args.pid, out=args.out, wait_s=args.wait)
    else:
        run_dir = RunDir.open(args.run)
        if not has_hang_dumps(run_dir.path):
            raise UserError(
                f"{run_dir.path}: no hang dumps (hang.rank<R>.json); the job did not hang under watch, or "
                "it ran without watch: use `ciuic-doctor hang --pid PID` while it hangs"
            )
    files = load(run_dir)
    status = run_status(run_dir.read_meta())
    findings = judge(files, run_status=status)
    if status not in (None, "running") and not args.json:  # how it ended comes first: finished is no hang
        from ciuic_doctor.rundir.watch_end import describe, watch_record

        print(f"the run {describe(watch_record(run_dir.read_meta()) or {})}.")
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        print(findings_table(findings))
        hang = findings[0]
        for row in hang.evidence.get("ranks", []):
            where = row.get("frame") or "?"
            seq = f" #{row['seq']}" if row.get("seq") is not None else ""
            inside = f"in {row['op']}{seq}" if row.get("in_collective") else "outside any collective"
            line = f"  rank {row['rank']}: {row['state'] or 'unseen'} ({row['source']}), {inside}, at {where}"
            print(terminal(line))  # names from dump files: no escape sequence reaches the terminal
            if row.get("kernel_wait"):  # hang --pid without C++ frames: the kernel's word for the wait
                print(terminal(f"    native: {row['kernel_wait']}"))
        if hang.evidence.get("next"):
            print(f"\nnext: {hang.evidence['next']}")
        for problem in files.problems:
            print(f"note: {terminal(problem)}", file=sys.stderr)
    return 1 if any(f.verdict == "fail" for f in findings) else 0
