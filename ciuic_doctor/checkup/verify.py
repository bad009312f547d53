"""`checkup --verify`: after the report, try each recommended change on the job the checkup
ran (as `ciuic-doctor verify RUN` does), then write the report again with the statuses."""

from __future__ import annotations

import argparse
import time


def verify_phase(args: argparse.Namespace) -> int:
    """Verify the checkup in args.out; 0 when verification ran, whatever it found."""
    from ciuic_doctor.report import build_report
    from ciuic_doctor.rundir.store import RunDir
    from ciuic_doctor.verify import lines, options_from_args, verify_run

    run = RunDir.open(args.out)
    started = time.perf_counter()
    print(f"\ncheckup --verify: each recommended change on the job, within {args.budget:.0f} s", flush=True)
    data = verify_run(run, options_from_args(args), say=lambda text: print(text, flush=True))
    result = build_report(run, spec_path=args.spec, include_unverified=args.include_unverified)
    run.update_meta(
        checkup={"verify": {"seconds": round(time.perf_counter() - started, 1), "rounds": data["rounds"]}}
    )
    print(f"\nverified in {time.perf_counter() - started:.0f} s ({data['rounds']} round(s)):")
    print("\n".join(lines(data) or ["  no change to verify"]))
    print(f"report with the statuses: {result.paths['report.html']}")
    return 0
