"""Judge training stability from a run directory or from Megatron-LM, DeepSpeed, HF Trainer or Lightning logs.

Finds loss and grad-norm spikes (where, how big, whether and when the loss recovered, whether grad norm
spiked first), divergence, NaN/inf losses, overflow storms and collapse of the fp16 loss scale, and says what
to change: init_scale from the scale the run settled at, bf16 when fp16 keeps overflowing, the LR when
overflows follow its peak, clip max_norm from the grad norms of healthy steps.

PATH is a run directory (its steps stream), a Megatron or DeepSpeed text log, a trainer_state.json or a
metrics.csv; several PATHs are read as one run (a resumed run's later log wins on repeated steps). Exit code
1 when a check failed (divergence, unrecovered spike, scale collapse, a run that ends in NaN).
"""

from __future__ import annotations

import argparse
import json

from ciuic_doctor.commands._common import positive_float

NAME = "stability"
HELP = "loss spikes, divergence, overflow storms and loss-scale collapse, from our steps or framework logs"
ORDER = 55
FORMAT_CHOICES = "auto, ours, megatron, deepspeed, hf, lightning"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", metavar="PATH", nargs="+", help="run directory or log file(s)")
    parser.add_argument(
        "--format", default="auto", metavar="F", help=f"log format: {FORMAT_CHOICES} (default: auto, sniffed)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the findings as JSON (as `analyze --json`)"
    )
    parser.add_argument(
        "--clip",
        type=positive_float,
        metavar="MAX_NORM",
        help="the clip_grad_norm_ max_norm the run used (default: from RUN/meta.json or the step records)",
    )
    parser.add_argument(
        "--out", metavar="RUN", help="also merge the findings into RUN/findings.json (created if missing)"
    )


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.analysis.stability import analyze_log, write_findings
    from ciuic_doctor.findings import overall_verdict, sort_findings
    from ciuic_doctor.importers import check_format, load
    from ciuic_doctor.render_text import findings_table

    log = load(args.paths, check_format(args.format))
    findings = sort_findings(analyze_log(log, clip_max_norm=args.clip))
    if args.out:
        from ciuic_doctor.store import RunDir

        write_findings(RunDir.create(args.out), findings)
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        kinds = ", ".join(sorted(set(log.formats.values())))
        steps = log.table["step"]
        print(
            f"read {log.rows} rows ({kinds}; steps {steps.min()}..{steps.max()}); "
            f"{log.unread_lines} of {log.read_lines} lines were not step records"
        )
        print(findings_table(findings))
        if args.out:
            print(f"\nfindings merged into {args.out}/findings.json")
    return 1 if overall_verdict(findings) == "fail" else 0
