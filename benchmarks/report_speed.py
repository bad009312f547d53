"""How fast the report is written, how big it gets, and how long the whole checkup takes — in one run.

Goals (issue 7): report from a full run directory <= 5 s, report.html <= 3 MB; checkup on this 2-core
machine <= 3 minutes.

1. checkup: `ciuic-doctor checkup` on the embedded job with its defaults (2 ranks, the spec's 40 steps),
   wall time from the outside, as a user would measure it. Its run directory is a real full run.
2. report on that real run: `ciuic-doctor report RUN` in a fresh process (imports included), once with the
   analyses (`--reanalyze`) and once on the stored findings.
3. report on a large run: the recorded 2-node run of tests/data/report_gpu scaled to 8 ranks × 2000 steps
   and 12000 memwatch samples (what a long job leaves), same two timings.

    .venv/bin/python benchmarks/report_speed.py                # about 2 minutes on 2 cores
    .venv/bin/python benchmarks/report_speed.py --no-checkup   # the report timings only
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_REPORT_S = 5.0
GOAL_SIZE_BYTES = 3 * 2**20
GOAL_CHECKUP_S = 180.0


def cli(*args: str) -> tuple[float, float]:
    """(wall, CPU) seconds of `python -m ciuic_doctor <args>` in a fresh process (CPU: user + system of
    the process and its children — on a shared machine the wall time also counts other people's work)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ciuic_doctor", *args], check=False, capture_output=True, text=True, env=env
    )
    wall_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    return wall_s, cpu_s


def large_run(path: Path, *, ranks: int, steps: int) -> Path:
    """The recorded GPU run, regenerated with more ranks and steps by its own generator."""
    source = REPO / "tests" / "data" / "report_gpu"
    shutil.copytree(source, path, ignore=shutil.ignore_patterns("make.py", "steps.rank*.jsonl"))
    spec = importlib.util.spec_from_file_location("report_gpu_make", source / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    make.HERE, make.STEPS, make.WORLD = path, steps, ranks
    rng = make.random.Random(7)
    for rank in range(ranks):
        make.write_jsonl(f"steps.rank{rank}.jsonl", make.step_rows(rng, rank))
    samples = [dict(r, t=r["t"] + 80.0 * block) for block in range(50) for r in make.memwatch_rows(rng)]
    make.write_jsonl("memwatch.jsonl", samples)
    return path


def report_timings(run: Path, label: str) -> dict[str, float]:
    with_analysis, with_analysis_cpu = cli("report", str(run), "--reanalyze", "--quiet")
    stored, stored_cpu = cli("report", str(run), "--quiet")
    size = (run / "report.html").stat().st_size
    stream_bytes = sum(p.stat().st_size for p in run.glob("*.jsonl"))
    print(
        f"{label}: streams {stream_bytes / 2**20:.1f} MiB\n"
        f"  report with analyses  {with_analysis:5.2f} s wall ({with_analysis / GOAL_REPORT_S:.2f} of goal), "
        f"{with_analysis_cpu:5.2f} s CPU\n"
        f"  report, stored findings {stored:5.2f} s wall ({stored / GOAL_REPORT_S:.2f} of goal), "
        f"{stored_cpu:5.2f} s CPU\n"
        f"  report.html {size / 2**20:5.2f} MiB ({size / GOAL_SIZE_BYTES:.2f} of goal)",
        flush=True,
    )
    return {"with_analysis_s": with_analysis, "stored_s": stored, "size_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-checkup", action="store_true", help="skip the checkup timing")
    parser.add_argument("--steps", type=int, default=2000, help="steps per rank of the large run (2000)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ciuic-report-speed-") as tmp:
        tmp_path = Path(tmp)
        if not args.no_checkup:
            checkup_s, checkup_cpu = cli("checkup", "--out", str(tmp_path / "checkup"))
            ratio = checkup_s / GOAL_CHECKUP_S
            print(f"checkup (2 ranks, default job): {checkup_s:.1f} s wall ({ratio:.2f} of goal), ", end="")
            print(f"{checkup_cpu:.1f} s CPU")
            report_timings(tmp_path / "checkup", "report on the checkup's run")
        large = large_run(tmp_path / "large", ranks=8, steps=args.steps)
        report_timings(large, f"report on 8 ranks × {args.steps} steps")


if __name__ == "__main__":
    main()
