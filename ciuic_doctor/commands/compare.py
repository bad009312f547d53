"""Compare two runs of a job: for every measurement both have, the change B / A with a 95 % confidence
interval, whether it is more than the runs' own noise, and the settings that differ between them.

    $ ciuic-doctor compare reports/base reports/slow
    settings: inject.slow_ranks.1 (unset) → 60
      warn     step_time      step time +51 % (95 % CI +14 … +100 %): worse, significant at 5 %
      warn     throughput     samples/s −34 % (95 % CI −50 … −12 %): worse, significant at 5 %

(each finding's summary in --json / comparison.json starts with the settings: "inject.slow_ranks.1
(unset) → 60: step time +51 % (95 % CI +14 … +100 %): worse, significant at 5 %")

Measurements: step time (after warm-up; overall and each rank's pace), throughput (samples/s, tokens/s),
loss at matched steps (bit-identical said as such; otherwise a tolerance from the runs' own step-to-step
noise), skipped steps, memory (levels, peaks, growth), loader-sweep throughput per configuration, comm-bench
busbw per collective and size, checkpoint save / load. Step times are autocorrelated, so their intervals
come from a circular block bootstrap; rows within one check are Holm-corrected.

Examples:
    ciuic-doctor compare reports/run1 reports/run2
    ciuic-doctor compare reports/run1 reports/run2 --json > comparison.json
    ciuic-doctor compare reports/run1 reports/run2 --out reports/run2   # writes comparison.json there
    ciuic-doctor report reports/run2 --baseline reports/run1              # the same, as a report section

Exit code 0 whatever changed (a comparison is not a test); 2 for a path that is not a run directory.
"""

from __future__ import annotations

import argparse

NAME = "compare"
HELP = "compare two runs: the change in every measurement, with a 95 %% CI and the settings that differ"
ORDER = 75
OUTPUT = "comparison.json"  # report --baseline writes the same file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", metavar="RUN_A", help="the baseline run directory")
    parser.add_argument("run_b", metavar="RUN_B", help="the run to judge against it")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON instead of text")
    parser.add_argument(
        "--out", metavar="RUN", help=f"also write {OUTPUT} into this run directory (created if missing)"
    )


def run(args: argparse.Namespace) -> int:
    import json

    from ciuic_doctor.compare import compare_runs
    from ciuic_doctor.rundir.store import RunDir, dumps

    result = compare_runs(RunDir.open(args.run_a), RunDir.open(args.run_b))
    if args.out:
        path = RunDir.create(args.out).write_json(OUTPUT, result.to_dict())
    if args.json:
        print(json.dumps(json.loads(dumps(result.to_dict())), indent=2))
    else:
        from ciuic_doctor.render_text import terminal

        print("\n".join(terminal(line) for line in result.lines()))  # names from runs: no escapes
        if args.out:
            print(f"written: {path}")
    return 0
