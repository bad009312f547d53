"""How `ciuic-doctor report` (analyses included) scales with ranks — in one run, side by side.

Goals (issue 15), at 1,024 ranks × 2,000 steps: report wall ≤ 30 s, peak RSS ≤ 2 GB, report.html ≤ 3 MB;
a straggler planted from the middle of the run, a whole slow host and a leaking rank each named; cost
growing no faster than linearly in ranks × steps.

For N = 8, 64, 256, 1024 ranks × 2,000 steps and 4,096 ranks × 500 steps, a run is generated with
tests/scalesynth.py (watch's step records, DDP timing, 8 ranks a host; the generation is not timed),
then `python -m ciuic_doctor report RUN --reanalyze --quiet` runs in a fresh process. Measured per row:
wall and CPU seconds (user + system of that process, from wait4: on a machine shared with others the
wall time also counts their work, so the load average is printed too), peak RSS, report.html size,
findings, and whether each planted problem is named (in one finding, by rank or host) with nothing else
flagged. The last columns divide CPU by rank-steps, and compare each row's CPU growth with its
rank-step growth over the previous row (≤ 1.00: no faster than linear). `--compact` adds a row per size
with the run compacted to Parquet first (`ciuic-doctor compact`; not timed).

    .venv/bin/python benchmarks/report_scale.py                  # ~6 minutes on 2 idle cores
    .venv/bin/python benchmarks/report_scale.py --sizes 8x2000,256x2000 --compact
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

GOAL_WALL_S, GOAL_RSS_BYTES, GOAL_HTML_BYTES = 30.0, 2e9, 3 * 2**20
SIZES = ((8, 2000), (64, 2000), (256, 2000), (1024, 2000), (4096, 500))


def report(run: Path) -> tuple[float, float, int]:
    """(wall s, CPU s, peak RSS bytes) of one `ciuic-doctor report` process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    argv = [sys.executable, "-m", "ciuic_doctor", "report", str(run), "--reanalyze", "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        raise SystemExit(f"report failed on {run}:\n{stderr[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def named(run: Path, plan) -> dict[str, object]:
    """Which planted problems one finding names, and what else was flagged."""
    findings = json.loads((run / "findings.json").read_text())["findings"]
    flagged = [f for f in findings if f["verdict"] in ("warn", "fail")]

    def names(check: str, key: str, value: object) -> bool | None:
        if value is None:
            return None  # not planted (one or two hosts have no "other hosts" to compare with)
        hits = [f for f in flagged if f["check"] == check and value in (f["where"].get(key) or [])]
        return len(hits) == 1

    expected = {"straggler_onset", "slow_host", "memory_leak"}
    return {
        "findings": len(findings),
        "straggler": names("straggler_onset", "ranks", plan.straggler_rank),
        "slow_host": names("slow_host", "hosts", plan.slow_host_name),
        "leak": names("memory_leak", "ranks", plan.leak_rank),
        "others": sorted({f["check"] for f in flagged} - expected),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", help="RANKSxSTEPS,... (default: 8x2000,64x2000,256x2000,1024x2000,4096x500)"
    )
    parser.add_argument("--compact", action="store_true", help="also report on each run compacted to Parquet")
    parser.add_argument("--keep", metavar="DIR", help="generate the runs here and keep them")
    args = parser.parse_args()
    import scalesynth

    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes.split(",")] if args.sizes else SIZES
    root = Path(args.keep or tempfile.mkdtemp(prefix="ciuic-report-scale-"))
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    header = (
        f"{'ranks × steps':>13} {'streams':>9} {'wall s':>7} {'CPU s':>6} {'peak RSS':>9} {'html':>8} "
        f"{'findings':>8}  straggler slow-host leak  others  {'CPU µs/rank-step':>16} {'growth':>6}"
    )
    print(header)
    previous: tuple[float, int] | None = None
    rows = []
    for ranks, steps in sizes:
        plan = scalesynth.Plan(ranks=ranks, steps=steps)
        run = scalesynth.generate(root / f"r{ranks}x{steps}", plan)
        stream_bytes = sum(p.stat().st_size for p in run.glob("*.jsonl"))
        variants = [("jsonl", run)]
        if args.compact:
            variants.append(("parquet", run))
        for variant, path in variants:
            if variant == "parquet":
                done = subprocess.run(
                    [sys.executable, "-m", "ciuic_doctor", "compact", str(path), "--quiet"],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if done.returncode != 0:
                    raise SystemExit(done.stderr)
            wall, cpu, rss = report(path)
            html = (path / "report.html").stat().st_size
            seen = named(path, plan)
            cells = ranks * steps
            growth = (
                ""
                if previous is None or variant != "jsonl"
                else f"{(cpu / previous[0]) / (cells / previous[1]):.2f}"
            )
            if variant == "jsonl":
                previous = (cpu, cells)
            label = f"{ranks} × {steps}" + (" pq" if variant == "parquet" else "")
            yes = {True: "named", False: "MISSED", None: "n/a"}
            print(
                f"{label:>13} {stream_bytes / 2**20:7.0f} Mi {wall:7.1f} {cpu:6.1f} {rss / 2**20:6.0f} Mi "
                f"{html / 2**20:5.2f} Mi {seen['findings']:8d}  {yes[seen['straggler']]:>9} "
                f"{yes[seen['slow_host']]:>9} {yes[seen['leak']]:>5}  {','.join(seen['others']) or '-':>6}  "
                f"{1e6 * cpu / cells:16.2f} {growth:>6}",
                flush=True,
            )
            rows.append((ranks, steps, variant, wall, cpu, rss, html, seen))
        if not args.keep:
            shutil.rmtree(run)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    for ranks, steps, variant, wall, _, rss, html, _ in rows:
        if (ranks, steps, variant) == (1024, 2000, "jsonl"):
            print(
                f"goals at 1,024 ranks: wall {wall / GOAL_WALL_S:.2f}, peak RSS {rss / GOAL_RSS_BYTES:.2f}, "
                f"report.html {html / GOAL_HTML_BYTES:.2f} of the goal"
            )
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
