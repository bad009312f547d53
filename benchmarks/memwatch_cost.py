"""What memwatch costs the machine it watches, and how fast `ciuic-doctor --help` answers.

    .venv/bin/python benchmarks/memwatch_cost.py [--seconds 20] [--children 4]

1. The real CLI, `ciuic-doctor memwatch --interval 0.1`, watches a real tree: a parent and N children
   holding 64 MiB of touched memory each (so USS reads walk real page tables). Its own CPU share is
   measured in steady state (CPU time between second 3 and the end, over that wall time, so the
   interpreter's start-up is not counted) and its RSS at the end and at peak (getrusage of the child).
2. `ciuic-doctor --help` wall time, median of 10, next to a bare `python -c pass` measured in the same
   run, and the slowest imports of --help (python -X importtime) — what to look at if it is slow.

Goals (issue 4): sampler ≤ 80 MiB RSS, ≤ 2 % of one core at 10 Hz; --help ≤ 0.3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

GOAL_RSS_MIB = 80
GOAL_CPU_PCT = 2.0
GOAL_HELP_S = 0.3
CHILD = "import sys, time; held = b'x' * (64 << 20); print('up', flush=True); time.sleep(3600)"
PARENT = """
import subprocess, sys, time
argv = [sys.executable, "-c", sys.argv[1]]
kids = [subprocess.Popen(argv, stdout=subprocess.PIPE) for _ in range(int(sys.argv[2]))]
for kid in kids:
    kid.stdout.readline()
print("up", flush=True)
time.sleep(3600)
"""


def cli() -> list[str]:
    script = Path(sys.executable).with_name("ciuic-doctor")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ciuic_doctor"]


def sampler_cost(seconds: float, children: int) -> dict[str, float]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(children)], stdout=subprocess.PIPE)
    try:
        parent.stdout.readline()
        with tempfile.TemporaryDirectory() as tmp:
            argv = [*cli(), "memwatch", "--pid", str(parent.pid), "--interval", "0.1"]
            watcher = subprocess.Popen(
                [*argv, "--duration", str(seconds), "--out", f"{tmp}/run"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            proc = psutil.Process(watcher.pid)
            time.sleep(3.0)  # past start-up (imports, first tree walk, NVML init)
            cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
            time.sleep(seconds - 3.5)
            cpu1, t1 = sum(proc.cpu_times()[:2]), time.monotonic()
            rss_end = proc.memory_info().rss
            _, status, usage = os.wait4(watcher.pid, 0)
            watcher.returncode = os.waitstatus_to_exitcode(status)
            if watcher.returncode != 0:
                raise SystemExit(f"memwatch failed: {watcher.stderr.read().decode()}")
            samples = [
                json.loads(line) for line in Path(f"{tmp}/run/memwatch.jsonl").read_text().splitlines()
            ]
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()
    sample_ids = {s["sample"] for s in samples}
    return {
        "cpu_pct": 100 * (cpu1 - cpu0) / (t1 - t0),
        "rss_end_mib": rss_end / 2**20,
        "rss_peak_mib": usage.ru_maxrss / 1024,  # Linux reports KiB
        "samples_per_s": len(sample_ids) / seconds,
        "processes": len({s["pid"] for s in samples}),
        "uss_every_max": max(s["uss_every"] for s in samples),
        "machine_processes": len(psutil.pids()),
    }


def wall(argv: list[str], runs: int = 10) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest_imports(top: int = 5) -> list[tuple[float, str]]:
    """(cumulative ms, module) of the top-level imports that cost `--help` the most."""
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ciuic_doctor", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    rows = []
    for line in err.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit() and not parts[2].startswith("  "):
            rows.append((int(parts[1]) / 1000, parts[2].strip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--children", type=int, default=4)
    args = parser.parse_args()

    cost = sampler_cost(args.seconds, args.children)
    help_s = wall([*cli(), "--help"])
    python_s = wall([sys.executable, "-c", "pass"])
    print(
        f"memwatch at 10 Hz over a parent + {args.children} children ({cost['processes']} processes watched, "
        f"{cost['machine_processes']} on this machine), {args.seconds:g} s:"
    )
    cpu, rss_peak, rss_end = cost["cpu_pct"], cost["rss_peak_mib"], cost["rss_end_mib"]
    rows = [
        ("sampler CPU, steady state", f"{cpu:.2f} % of a core", f"<= {GOAL_CPU_PCT} %", cpu <= GOAL_CPU_PCT),
        ("sampler RSS, peak", f"{rss_peak:.1f} MiB", f"<= {GOAL_RSS_MIB} MiB", rss_peak <= GOAL_RSS_MIB),
        ("sampler RSS, at the end", f"{rss_end:.1f} MiB", f"<= {GOAL_RSS_MIB} MiB", rss_end <= GOAL_RSS_MIB),
        (
            "ciuic-doctor --help, median of 10",
            f"{help_s:.3f} s",
            f"<= {GOAL_HELP_S} s",
            help_s <= GOAL_HELP_S,
        ),
    ]
    width = max(len(r[0]) for r in rows)
    for name, measured, goal, ok in rows:
        print(f"  {name:<{width}}  {measured:>18}  goal {goal:<12} {'ok' if ok else 'MISSED'}")
    print(
        f"  samples/s {cost['samples_per_s']:.1f}; USS read down to every {cost['uss_every_max']} samples "
        "(their CPU budget: 0.5 % of a core)"
    )
    print(f"  --help vs bare python start ({python_s:.3f} s): {help_s / python_s:.1f}x")
    print("  slowest imports of --help (cumulative ms):")
    for ms, module in slowest_imports():
        print(f"    {ms:8.1f}  {module}")


if __name__ == "__main__":
    main()
