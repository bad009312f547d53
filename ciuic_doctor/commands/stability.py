"""Judge training stability from a run directory or from Megatron-LM, DeepSpeed, HF Trainer, Lightning,
torchtitan, llm.c, nanoGPT, modded-nanogpt or word_language_model logs.

Finds loss and grad-norm spikes (where, how big, whether and when the loss recovered, whether grad norm
spiked first), divergence, NaN/inf losses, overflow storms and collapse of the fp16 loss scale, and says what
to change: init_scale from the scale the run settled at, bf16 when fp16 keeps overflowing (judged against
the scaler's own window and hysteresis, as the log prints them or as its skip pattern shows), the LR when
overflows follow its peak, clip max_norm from the grad norms of healthy steps.

PATH is a run directory (its steps stream), a Megatron or DeepSpeed text log, a trainer_state.json, a
metrics.csv, a torchtitan log, llm.c's main.log, a modded-nanogpt record, or nanoGPT / word_language_model
stdout; several PATHs are read as one run when each resumes
the one before (a resumed run's later log wins on repeated steps), else each is judged as a run of its own
and the log_import finding warns. Exit code 1 when a check failed (divergence, unrecovered spike, scale
collapse, a run that ends in NaN).

With --out RUN an imported log becomes a run directory (RUN/steps.jsonl + meta.json["source"]), so
`ciuic-doctor report RUN` draws its loss / grad-norm / scale / LR with the findings marked, titled after
the log, and `analyze RUN` gives the same findings again; without --spec the report recommends nothing
from the embedded job's default spec (the log does not describe that job).

Examples:
    ciuic-doctor stability train.log                       # Megatron or DeepSpeed stdout, sniffed
    ciuic-doctor stability run1/trainer_state.json --json  # findings + the import summary as JSON
    ciuic-doctor stability part1.log part2.log --out reports/imported && ciuic-doctor report reports/imported
"""

from __future__ import annotations

import argparse
import json

from ciuic_doctor.cli_args import positive_float

NAME = "stability"
HELP = "loss spikes, divergence, overflow storms and loss-scale collapse, from our steps or framework logs"
ORDER = 55
FORMAT_CHOICES = (
    "auto, ours, megatron, deepspeed, hf, lightning, nanogpt, wordlm, torchtitan, llmc, modded-nanogpt"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", metavar="PATH", nargs="+", help="run directory or log file(s)")
    parser.add_argument(
        "--format", default="auto", metavar="F", help=f"log format: {FORMAT_CHOICES} (default: auto, sniffed)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the findings as JSON (as `analyze --json`; the log_import finding carries the import "
        "summary: formats, rows, unread lines, engines, series)",
    )
    parser.add_argument(
        "--clip",
        type=positive_float,
        metavar="MAX_NORM",
        help="the clip_grad_norm_ max_norm the run used (default: from RUN/meta.json or the step records)",
    )
    parser.add_argument(
        "--out",
        metavar="RUN",
        help="also write RUN as a run directory: the imported steps, meta.json and the findings merged "
        "into RUN/findings.json (a watched run's own steps are kept)",
    )


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.analysis.stability import analyze_log, write_findings
    from ciuic_doctor.importers import check_format, load
    from ciuic_doctor.render_text import findings_table
    from ciuic_doctor.rundir.findings import overall_verdict, sort_findings

    log = load(args.paths, check_format(args.format))
    if args.clip is not None:  # kept in RUN/meta.json with --out: `analyze RUN` judges clipping the same way
        log.clip_max_norm = args.clip
    findings = sort_findings(analyze_log(log, clip_max_norm=args.clip))
    wrote_steps = False
    if args.out:
        from ciuic_doctor.importers._run import write_run
        from ciuic_doctor.rundir.store import RunDir

        out = RunDir.create(args.out)
        _refuse_a_recorded_run(out, args.paths)
        wrote_steps = write_run(out, log, args.paths)
        write_findings(out, findings)
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        kinds = ", ".join(sorted(set(log.formats.values())))
        steps = log.table["step"]
        print(
            f"read {log.rows} rows ({kinds}; steps {steps.min()}..{steps.max()}); "
            f"{log.unread_lines} of {log.read_lines} lines were not step records"
        )
        for note in log.notes:
            print(f"note: {note}")
        print(findings_table(findings))
        if args.out:
            if wrote_steps:
                print(f"\nrun directory written: {args.out} (steps.jsonl, meta.json, findings.json)")
                print(f"  ciuic-doctor report {args.out}")
            else:
                print(f"\nfindings merged into {args.out}/findings.json")
    return 1 if overall_verdict(findings) == "fail" else 0


def _refuse_a_recorded_run(out, paths: list[str]) -> None:  # out: RunDir
    """A log imported into a run that holds a recorded job's own steps: its findings would sit in
    findings.json only until the next `analyze` or `report --reanalyze`, which judges the job's steps
    and drops them. One line, exit 2, nothing written. (RUN's own steps, `stability RUN --out RUN`, are
    judged and merged as before.)"""
    from pathlib import Path

    from ciuic_doctor.errors import UserError
    from ciuic_doctor.importers._run import STREAM, is_import

    if out.path.resolve() in {Path(p).resolve() for p in paths}:
        return
    if out.has_stream(STREAM) and not is_import(out):
        raise UserError(
            f"--out {out.path}: holds a recorded job's own steps; an imported log's findings there would "
            "be replaced by the job's at the next analyze or report --reanalyze: give another --out"
        )
