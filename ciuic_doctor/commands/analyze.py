"""Turn every stream in a run directory into findings (RUN/findings.json) and print them.

Exit code 1 when any check failed, so `ciuic-doctor analyze RUN && deploy` works in a script.
"""

from __future__ import annotations

import argparse
import json
import sys

from ciuic_doctor.cli_args import positive_float

NAME = "analyze"
HELP = "judge every stream in a run directory; write RUN/findings.json and print the findings"
ORDER = 60


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="a run directory written by any probe")
    parser.add_argument("--json", action="store_true", help="print findings.json instead of a table")
    parser.add_argument(
        "--peak-tflops",
        type=positive_float,
        metavar="T",
        help="the accelerator's dense peak TFLOP/s for MFU (a CPU run, a device the table lacks); "
        "kept in RUN/meta.json",
    )


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.analysis import run_all
    from ciuic_doctor.render_text import StageLine, findings_table
    from ciuic_doctor.rundir.findings import overall_verdict
    from ciuic_doctor.rundir.store import RunDir

    run_dir = RunDir.open(args.run)
    run_dir.claim_outputs()
    if args.peak_tflops:
        run_dir.update_meta(mfu={"peak_tflops": args.peak_tflops, "source": "analyze --peak-tflops"})
    stage = StageLine("analyze", sys.stderr)  # on a terminal: which analysis is running
    try:
        findings = run_all(run_dir, stage)
    finally:
        stage.done()
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        print(findings_table(findings))
        print(f"\nfindings written to {run_dir.path / 'findings.json'}")
    return 1 if overall_verdict(findings) == "fail" else 0
