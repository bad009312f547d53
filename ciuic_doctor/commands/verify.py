"""Try each change RUN recommends on the job RUN recorded, and say which ones help.

    ciuic-doctor verify RUN                         every changing recommendation of RUN, default budget
    ciuic-doctor verify RUN --budget 300 --steps 20
    ciuic-doctor verify RUN --try dataloader.num_workers=4     a change of your own (folklore), alone

For each change, the job (the embedded job with the spec it ran, or the script watch ran, with its
argv) runs as it is (A) and with the change (B), interleaved A B A B ... (runner.py), warm-up + N steps
a run, within --budget seconds, a progress line per run. Each change is judged alone on the job's own
figures: helps / no measurable effect / hurts / not verifiable here, with the interval on the figure
its rule aims at (ciuic_doctor/verify/judge.py). Writes RUN/verify/ (one run directory per run) and
RUN/verification.json, then the report again, so report.html, recommended.env and recommended.toml
carry only what helped (or is arithmetic / a documented fact). Exit 0 when verification ran (whatever
it found), 1 when the job failed unchanged, 2 for a usage error.

It re-runs a job without asking only when your own watch / job signed it (ciuic_doctor/rundir/trust.py);
a run recorded by someone else, edited or planted, or in a folder others own or may write, runs only
after the exact command is shown and you pass --yes (or answer y on a terminal).
"""

from __future__ import annotations

import argparse
import signal
import sys

from ciuic_doctor.cli_args import add_parallel, parallel_from_args, positive_float, positive_int

NAME = "verify"
HELP = "try each recommended change on the job, interleaved A/B, and keep only what helps"
ORDER = 72


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", metavar="RUN", help="a run directory that recorded the embedded job or a script"
    )
    add_budget(parser)
    parser.add_argument(
        "--try",
        dest="tries",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a change of your own to try alone (job-spec key as --set takes it; repeatable); with --try "
        "only these are tried unless --with-recommendations",
    )
    parser.add_argument(
        "--with-recommendations",
        action="store_true",
        help="with --try: try RUN's recommended changes as well",
    )
    from ciuic_doctor.verify.nodes import add_slurm_arguments

    add_slurm_arguments(parser)
    parser.add_argument(
        "--yes",
        action="store_true",
        help="run RUN's job even when you did not record it: a run not signed by your key (someone "
        "else's, edited or planted) or in a folder others own or may write; verify shows the exact "
        "command first (without --yes it asks on a terminal, elsewhere it stops with exit 2)",
    )
    parser.add_argument(
        "--nproc",
        type=positive_int,
        metavar="N",
        help="ranks to re-run the job on instead of the recorded count (which may not exceed the CPUs); "
        "for a job that spanned nodes, ranks per node",
    )
    parser.add_argument(
        "--include-unverified",
        action="store_true",
        help="recommended.env/.toml: add the changes that did not help or were not tried, commented out",
    )
    add_parallel(parser)


def add_budget(parser: argparse.ArgumentParser) -> None:
    """--budget, --verify-steps and --max-rounds (checkup --verify takes the same)."""
    parser.add_argument(
        "--budget",
        type=positive_float,
        default=480.0,
        metavar="S",
        help="seconds for all the runs (default 480: the embedded job in <= 10 minutes on 2 CPU cores); "
        "rounds go on while the next one fits",
    )
    parser.add_argument(
        "--verify-steps",
        type=positive_int,
        default=20,
        metavar="N",
        help="steps per run after the 2 warm-up steps (default 20)",
    )
    parser.add_argument(
        "--max-rounds", type=positive_int, default=12, metavar="R", help="most A/B rounds (default 12)"
    )


def run(args: argparse.Namespace) -> int:
    with parallel_from_args(args):  # a --scheduler that does not answer is refused before any run
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ciuic_doctor.report import build_report
    from ciuic_doctor.rundir.store import RunDir
    from ciuic_doctor.verify import lines, options_from_args, verify_run

    run_dir = RunDir.open(args.run)
    options = options_from_args(args)
    from ciuic_doctor.verify.nodes import choice_from_args

    options.slurm = choice_from_args(args)
    if not args.yes and sys.stdin.isatty() and sys.stdout.isatty():
        options.consent.ask = _ask
    _term_is_interrupt()
    data = verify_run(run_dir, options, say=lambda text: print(text, flush=True))
    result = build_report(run_dir, include_unverified=args.include_unverified)
    print(f"\nverified in {data['seconds']:.0f} s ({data['rounds']} round(s)):")
    print("\n".join(lines(data) or ["  no change to verify"]))
    print(f"written: {run_dir.path / 'verification.json'}; report {result.paths['report.html']}")
    return 0


def _ask(prompt: str) -> bool:
    try:
        return input(prompt).strip().lower() in ("y", "yes")
    except EOFError:
        return False


def _term_is_interrupt() -> None:
    """SIGTERM ends verify as Ctrl-C does: the run in progress is stopped with its whole process group
    (runner.run_once) before verify goes. kill -9 reaches the run through PR_SET_PDEATHSIG instead."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
