"""Turn a run directory into what a person reads: report.html (one offline file), recommended.env,
recommended.toml (the job spec with the recommended values applied), recommendations.json and summary.md.

Runs the analyses first when findings.json is missing or older than the streams. The recommendations
compare the job's current settings (--spec, else the spec the job recorded in meta.json, else the embedded
DeepSeek job's) with what was measured; no measurement, no recommendation.
"""

from __future__ import annotations

import argparse

from ciuic_doctor.cli_args import add_parallel, parallel_from_args

NAME = "report"
HELP = "write report.html, recommended.env/.toml, recommendations.json and summary.md for a run directory"
ORDER = 70


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="a run directory written by the probes or by checkup")
    parser.add_argument(
        "--spec", metavar="JOB.TOML", help="the job's spec (default: the one the run recorded)"
    )
    parser.add_argument(
        "--reanalyze", action="store_true", help="run the analyses again even when findings.json is current"
    )
    parser.add_argument(
        "--baseline",
        metavar="RUN_A",
        help="add a comparison with this earlier run (changes with 95 %% CIs, plots overlaid)",
    )
    parser.add_argument(
        "--include-unverified",
        action="store_true",
        help="recommended.env/.toml: add the changes not shown to help on the job (verify), commented out",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the paths, not the summary")
    add_parallel(parser)


def run(args: argparse.Namespace) -> int:
    import sys
    import time

    from ciuic_doctor.render_text import StageLine
    from ciuic_doctor.report import build_report
    from ciuic_doctor.rundir.store import RunDir

    start = time.perf_counter()
    baseline = RunDir.open(args.baseline) if args.baseline else None
    run_dir = RunDir.open(args.run)
    run_dir.claim_outputs()  # a folder of the user's own *.jsonl keeps its own summary.md
    # a 10,000-rank run takes about two minutes: a terminal sees which stage it is in
    with parallel_from_args(args):
        stage = StageLine("report", sys.stderr)
        try:
            result = build_report(
                run_dir,
                spec_path=args.spec,
                analyze=True if args.reanalyze else None,
                baseline=baseline,
                include_unverified=args.include_unverified,
                progress=stage,
            )
        finally:
            stage.done()
    if not args.quiet:
        print(result.summary)
    took = time.perf_counter() - start
    print(f"report written in {took:.1f} s{' (analyses run first)' if result.analysed else ''}:")
    for name, path in result.paths.items():
        print(f"  {name:22s} {path}")
    for note in run_dir.notes:
        print(f"  note: {note}", file=sys.stderr)
    if not args.quiet:
        print(result.closing_line())  # the last line: what is left to verify, and the command that does
    return 0
