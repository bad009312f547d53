"""How `ciuic-doctor report` (analyses included) scales with ranks, on what watch, memwatch and comm-bench
write on a GPU job — in one run, side by side.

Goals (issue 25), on a 2-core machine stated with its load: 1,024 ranks × 2,000 steps ≤ 30 s wall, ≤ 2 GB
peak RSS, report.html ≤ 3 MB, the straggler, the leaking rank and the reserved-memory grower each named
in one finding and nothing else flagged; 10,000 ranks × 1,000 steps ≤ 120 s, ≤ 4 GB, the page readable
in headless Chromium; cost growing no faster than linearly in records.

Each row's run is generated with tests/scalesynth.py's `gpu_plan` (every field watch writes on a CUDA
rank, 8 ranks a host, memwatch's samples of every agent and rank each second with NVML figures, a
comm-bench table; a straggler from mid-run, a rank whose host memory leaks 1 MiB/step, a rank whose
reserved bytes grow 0.5 MiB/step — visible from ~800 steps on, where its growth clears the floor of 0.5 % of
its ~63 GB; not timed), then `python -m ciuic_doctor report RUN --reanalyze
--quiet` runs in a fresh process. Per row: wall and CPU seconds (user + system of that process, from
wait4: the machine is shared, so wall time counts others' work too and the load average is printed
with each row), peak RSS, report.html size, and which planted problem one finding names ("named": in
exactly one warn/fail finding's where.ranks), with every other flagged check listed. The last
columns: CPU µs per record (step records + memwatch samples) and each row's CPU growth over the
previous row's, divided by its growth in records (≤ 1.00: no faster than linear).

    .venv/bin/python benchmarks/report_scale.py --sizes 8x2000,64x2000,256x2000,1024x2000 --root /tmp/rs
    .venv/bin/python benchmarks/report_scale.py --sizes 1024x2000,10000x1000 --root /tmp/rs --browser
    .venv/bin/python benchmarks/report_scale.py --sizes 1024x2000 --profile-hang   # hang's share, cProfile
    .venv/bin/python benchmarks/report_scale.py --cpu-only    # the issue-15 generator (no GPU fields)
    .venv/bin/python benchmarks/report_scale.py --sizes 100000x100 --root /tmp/rs --keep --browser

Each size is reported four times: `json` parses the JSONL (no copy of any kind: a killed job's run, or
an imported one) and writes the columnar copy; `first` is a run's first report as a watched job leaves it:
each steps and memwatch file's part, written by its probe at exit (rundir/frames/part_writer.py; here two
processes write them all, timed apart and shown per rank), read instead of parsed, and the copy written;
`second` reads the copy (no JSON parsed), analyses again (`--reanalyze`); `again` is a plain `report` of
the unchanged run (its findings are current: only the page is built, from the copy). Every row must name
the same findings as `json`. Goals: 10,000 × 1,000 first ≤ 60 s, second ≤ 20 s, ≤ 3 GB; 100,000 × 100
(100,000 step files: the file-count cost) ≤ 120 s, ≤ 4 GB, report.html ≤ 5 MB.

Runs are written under --root (default: a temporary folder; use /tmp, not the repository: 10,000 ranks
is ~10 GB) and deleted after their row unless --keep; --reuse takes a run kept under --root before
(same name, rRANKSxSTEPS) instead of generating it again.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (ranks, which report) -> wall s, peak RSS bytes, html bytes. The first report parses the JSONL and
# writes the columnar copy (ciuic_doctor/rundir/columnar); the second reads the copy.
GOALS = {
    (1024, "json"): (30.0, 2e9, 3 * 2**20),
    (1024, "first"): (30.0, 2e9, 3 * 2**20),
    (10000, "json"): (60.0, 3e9, None),
    (10000, "first"): (60.0, 3e9, None),
    (10000, "second"): (20.0, 3e9, None),
    (100000, "json"): (120.0, 4e9, 5 * 2**20),
    (100000, "first"): (120.0, 4e9, 5 * 2**20),
    (100000, "second"): (120.0, 4e9, 5 * 2**20),
}
GROWER_VISIBLE_STEPS = 800
SIZES = ((8, 2000), (64, 2000), (256, 2000), (1024, 2000), (10000, 1000))


def report(
    run: Path, profile: Path | None = None, extra: list[str] | None = None, reanalyze: bool = True
) -> tuple[float, float, int]:
    """(wall s, CPU s, peak RSS bytes) of one `ciuic-doctor report` process (the whole process tree: a
    report's worker processes are waited for by it, so wait4's usage counts them)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    head = [sys.executable, "-m", "cProfile", "-o", str(profile)] if profile else [sys.executable]
    again = ["--reanalyze"] if reanalyze else []
    argv = [*head, "-m", "ciuic_doctor", "report", str(run), *again, "--quiet", *(extra or [])]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        raise SystemExit(f"report failed on {run}:\n{stderr[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def named(run: Path, plan) -> dict[str, object]:
    """Which planted problems exactly one flagged finding names, and which other checks were flagged."""
    findings = json.loads((run / "findings.json").read_text())["findings"]
    flagged = [f for f in findings if f["verdict"] in ("warn", "fail")]

    def names(value: object, key: str = "ranks") -> tuple[bool | None, set[str]]:
        if value is None:
            return None, set()  # not planted
        hits = [f for f in flagged if value in (f["where"].get(key) or [])]
        return len(hits) == 1, {f["check"] for f in hits}

    seen = {
        "straggler": names(plan.straggler_rank),
        "leak": names(plan.leak_rank),
        # the grower's 0.5 MiB/step clears the 0.5 % floor of its ~63 GB only from ~800 steps: "n/a" before
        "grower": names(plan.grower_rank if plan.steps >= GROWER_VISIBLE_STEPS else None),
        "slow_host": names(plan.slow_host_name, "hosts"),
    }
    expected = set().union(*(checks for _, checks in seen.values()))
    return {
        "findings": len(findings),
        **{k: v[0] for k, v in seen.items()},
        "others": sorted({f["check"] for f in flagged} - expected),
    }


def records_of(run: Path) -> int:
    """Step records and memwatch samples: the lines of the streams that grow with ranks × time."""
    total = 0
    for path in [*run.glob("steps.rank*.jsonl"), run / "memwatch.jsonl"]:
        if path.is_file():
            with open(path, "rb") as fh:
                total += sum(chunk.count(b"\n") for chunk in iter(lambda fh=fh: fh.read(1 << 24), b""))
    return total


def hang_share(profile: Path) -> str:
    stats = pstats.Stats(str(profile))
    total = max(v[3] for v in stats.stats.values())  # the outermost call's cumulative time
    hang = [
        v[3]
        for (file, _, name), v in stats.stats.items()
        if file.endswith("analysis/hang.py") and name == "analyze"
    ]
    spent = sum(hang)
    return f"hang analysis under cProfile: {spent:.4f} s of {total:.1f} s ({100 * spent / total:.3f} %)"


def browser(run: Path) -> str:
    """Open report.html in headless Chromium: its DOM, and anything the page logged."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        return "chromium: not installed (scripts/ensure-browser.sh installs Debian's)"
    with tempfile.TemporaryDirectory() as profile:
        t0 = time.perf_counter()
        done = subprocess.run(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--dump-dom",
             (run / "report.html").as_uri()],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        wall = time.perf_counter() - t0
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    plots = done.stdout.count('class="plot"')
    return (
        f"chromium: exit {done.returncode}, DOM {len(done.stdout) / 2**20:.2f} MiB in {wall:.1f} s, "
        f"{plots} plot elements, {len(console)} console line(s)" + (f": {console[:3]}" if console else "")
    )


def _write_part(path: str) -> tuple[float, int]:
    """(CPU s, bytes) of one file's part, as its probe writes it at exit (frames.file_parts)."""
    from ciuic_doctor.rundir.frames import part_writer

    t0 = time.process_time()
    part = part_writer.write(Path(path))
    return time.process_time() - t0, part.stat().st_size if part else 0


def exit_parts(run: Path, *, reused: bool) -> str:
    """Each steps and memwatch file's part, written as watch and memwatch write them when they end (here
    two processes write them all; on a job, each rank and node writes its own). A reused run's parts
    that still fit their files are kept."""
    from concurrent.futures import ProcessPoolExecutor

    from ciuic_doctor.rundir.frames import file_parts
    from ciuic_doctor.rundir.schemas import stream_of

    files = [*run.glob("memwatch.jsonl"), *run.glob("memwatch.rank*.jsonl"), *run.glob("steps.rank*.jsonl")]
    if reused:
        fresh = file_parts.available(files)
        files = [f for f in files if not (str(f) in fresh and file_parts.probe(f, stream_of(f.name)))]
    if not files:
        return "exit parts: every file's part kept from before"
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(_write_part, map(str, files), chunksize=64))
    steps = [cpu for f, (cpu, _) in zip(files, done, strict=True) if f.name.startswith("steps.")]
    others = [cpu for f, (cpu, _) in zip(files, done, strict=True) if not f.name.startswith("steps.")]
    per_rank = f"{1e3 * sum(steps) / len(steps):.1f} ms CPU a rank's steps file" if steps else ""
    memwatch = f", memwatch {sum(others):.1f} s CPU" if others else ""
    return (
        f"exit parts: {len(files)} files in {time.perf_counter() - t0:.0f} s on 2 processes ({per_rank}"
        f"{memwatch}; {sum(b for _, b in done) / 2**20:.0f} MiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", help="RANKSxSTEPS,... (default: 8x2000,64x2000,256x2000,1024x2000,10000x1000)"
    )
    parser.add_argument("--root", help="where to generate the runs (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep each generated run")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="use a run already under --root (rRANKSxSTEPS, from an earlier --keep) instead of generating "
        "it again, and keep it",
    )
    parser.add_argument("--cpu-only", action="store_true", help="the issue-15 generator: no GPU fields")
    parser.add_argument("--browser", action="store_true", help="open each report.html in headless Chromium")
    parser.add_argument(
        "--profile-hang", action="store_true", help="run each report once more under cProfile"
    )
    parser.add_argument(
        "--first-only",
        action="store_true",
        help="only the first report (JSONL parsed, columnar copy written), not the later ones (copy read)",
    )
    parser.add_argument(
        "--report-args", default="", help="more arguments for each report, e.g. '--jobs 1' (one string)"
    )
    args = parser.parse_args()
    from tests import scalesynth

    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes.split(",")] if args.sizes else SIZES
    root = Path(args.root or tempfile.mkdtemp(prefix="ciuic-report-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} CPUs; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    print(
        f"{'ranks × steps':>14} {'records':>9} {'streams':>9} {'report':>6} {'load':>5} {'wall s':>7} "
        f"{'CPU s':>6} "
        f"{'peak RSS':>9} {'html':>8} {'findings':>8}  straggler  leak grower slow-host  others  "
        f"{'CPU µs/rec':>10} {'growth':>6}",
        flush=True,
    )
    previous: tuple[float, int] | None = None
    for ranks, steps in sizes:
        plan = (
            scalesynth.Plan(ranks=ranks, steps=steps) if args.cpu_only else scalesynth.gpu_plan(ranks, steps)
        )
        run = root / f"r{ranks}x{steps}"
        reused = args.reuse and (run / "meta.json").is_file()
        t0 = time.perf_counter()
        if not reused:
            scalesynth.generate(run, plan)
        made = "reused" if reused else f"generated in {time.perf_counter() - t0:.0f} s"
        stream_bytes = sum(p.stat().st_size for p in run.glob("*.jsonl"))
        records = records_of(run)
        extra = args.report_args.split()
        for which in ("json", "first") if args.first_only else ("json", "first", "second", "again"):
            if which == "json":  # no copy of any kind: the JSONL parsed (a killed job, an imported run)
                shutil.rmtree(run / "columnar", ignore_errors=True)
            if which == "first":  # as after a watched job: each file's part left by its probe at exit
                print(f"    {exit_parts(run, reused=reused)}", flush=True)
                for stream in ("steps", "memwatch"):
                    shutil.rmtree(run / "columnar" / stream, ignore_errors=True)
            load = os.getloadavg()[0]
            wall, cpu, rss = report(run, extra=extra, reanalyze=which != "again")
            html = (run / "report.html").stat().st_size
            seen = named(run, plan)
            growth = ""
            if which == "json":
                growth = "" if previous is None else f"{(cpu / previous[0]) / (records / previous[1]):.2f}"
                previous = (cpu, records)
            yes = {True: "named", False: "MISSED", None: "n/a"}
            print(
                f"{ranks:>6} × {steps:<5} {records:>9} {stream_bytes / 2**20:6.0f} Mi {which:>6} {load:5.1f} "
                f"{wall:7.1f} {cpu:6.1f} {rss / 2**20:6.0f} Mi {html / 2**20:5.2f} Mi {seen['findings']:8d}  "
                f"{yes[seen['straggler']]:>9} {yes[seen['leak']]:>5} {yes[seen['grower']]:>6} "
                f"{yes[seen['slow_host']]:>9}  {','.join(seen['others']) or '-':>6}  "
                f"{1e6 * cpu / records:10.2f} {growth:>6}",
                flush=True,
            )
            if (ranks, which) in GOALS:
                goal_wall, goal_rss, goal_html = GOALS[ranks, which]
                html_part = "" if goal_html is None else f", report.html {html / goal_html:.2f}"
                print(
                    f"    of the goal: wall {wall / goal_wall:.2f}, CPU {cpu / goal_wall:.2f}, "
                    f"peak RSS {rss / goal_rss:.2f}{html_part}"
                )
            findings = json.loads((run / "findings.json").read_text())["findings"]
            if which == "json":
                first_findings = findings
            elif findings != first_findings:
                print("    THESE FINDINGS DIFFER FROM THE JSONL REPORT'S", flush=True)
            else:
                print("    findings identical to the JSONL report's", flush=True)
        if args.browser:
            print(f"    {browser(run)}", flush=True)
        if args.profile_hang:
            profile = root / f"r{ranks}x{steps}.prof"
            report(run, profile)
            print(f"    {hang_share(profile)}", flush=True)
        print(f"    run {run}: {made}", flush=True)
        if not (args.keep or args.reuse):
            shutil.rmtree(run)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    if not args.root and not (args.keep or args.reuse):
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
