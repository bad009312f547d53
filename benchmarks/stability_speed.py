"""How fast `ciuic-doctor stability` reads a long run: 1,000,000-step Megatron text log and steps.jsonl.

Goals (issue 5): Megatron text ≤ 5 s, JSONL ≤ 2 s, peak RSS ≤ 1 GB, next to a line-by-line pure-Python
baseline measured in the same run. Each measurement runs in a fresh child process so that its peak RSS
(ru_maxrss) is its own; ciuic's is that process's plus its largest parse worker's (a big log is read by
one forked worker per usable CPU; CIUIC_IMPORT_WORKERS=1 reads it in one process). The time is measured
inside the child around the work only (interpreter start and imports excluded), best of --repeat; the
ciuic figure is import + every stability check, split into its two parts.

    .venv/bin/python benchmarks/stability_speed.py [--steps 1000000] [--repeat 2] [--keep DIR]
        [--against CHECKOUT]

--against CHECKOUT also measures another checkout of this repository (e.g. `git archive BASE | tar -x -C
/tmp/base`) on the same logs, its children alternating with ours, and prints both side by side: on a
shared machine whose load changes by the minute, only measurements taken in turn compare.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOALS = {"megatron": 5.0, "jsonl": 2.0}
RSS_GOAL_MB = 1024

# The record the watch probe writes (probes/watch/records.py RECORD_KEYS, behind JsonlWriter's schema/t/host).
JSONL_LINE = (
    '{{"schema":1,"t":{t:.6f},"host":"gpu-node-017","rank":{rank},"step":{step},"step_time_s":{st:.6f},'
    '"pre_backward_s":0.0312,"loss":{loss},"lr":{lr:.8g},"grad_norm":{gn:.6f},"grad_norm_source":"clip",'
    '"clip_max_norm":1.0,"loss_scale":{scale:.1f},"skipped":{skipped},"backward_calls":1,'
    '"mem_allocated":41234567168,"mem_reserved":52345678848,"mem_active_peak":45678901248,'
    '"alloc_retries":0,"rss":{rss},"uss":{uss},"weights_checksum":null,"desync_ranks":null}}\n'
)


def write_logs(folder: Path, steps: int) -> tuple[Path, Path]:
    rng = random.Random(0)
    megatron, jsonl = folder / "megatron.log", folder / "run" / "steps.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    with open(megatron, "w") as meg, open(jsonl, "w") as js:
        meg.write("using world size: 1024, data-parallel size: 64, tensor-model-parallel size: 8\n")
        for i in range(1, steps + 1):
            loss = 2.0 + 8.0 * math.exp(-i / 20000) + rng.gauss(0, 0.02)
            lr = 3e-4 * min(1.0, i / 2000)
            gn = 0.3 + rng.random() * 0.2
            skipped = int(i % 4999 == 0)
            sec = 1717000000 + i
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(sec))
            meg.write(
                f" [{stamp}] iteration {i:8d}/{steps:8d} | consumed samples: {i * 1024:12d} | elapsed time "
                f"per iteration (ms): 1254.3 | throughput per GPU (TFLOP/s/GPU): 181.2 | learning rate: "
                f"{lr:.6E} | global batch size:  1024 | lm loss: {loss:.6E} | loss scale: 65536.0 | "
                f"grad norm: {gn:.3f} | number of skipped iterations: {skipped:3d} | "
                "number of nan iterations:   0 |\n"
            )
            flag = "true" if skipped else "false"
            js.write(
                JSONL_LINE.format(t=sec + 0.5, rank=0, step=i, st=1.25, loss=f"{loss:.7g}", lr=lr, gn=gn,
                                  scale=65536.0, skipped=flag, rss=9 << 30, uss=8 << 30)
            )  # fmt: skip
    return megatron, jsonl


CHILD = r"""
import json, re, resource, sys, time
kind, path = sys.argv[1], sys.argv[2]
if kind in ("ours-megatron", "ours-jsonl"):
    from ciuic_doctor.importers import load
    from ciuic_doctor.analysis.stability import analyze_log
    import pandas, numpy  # imports are not what is timed
    t0 = time.perf_counter()
    log = load(path)
    t1 = time.perf_counter()
    findings = analyze_log(log)
    t2 = time.perf_counter()
    rows, extra = log.rows, {"import_s": t1 - t0, "analysis_s": t2 - t1, "findings": len(findings)}
elif kind == "baseline-megatron":
    field = re.compile(r" ([a-z][a-z ()/_-]*?): +([^ |]+) \|")
    head = re.compile(r"iteration\s+(\d+)/")
    t0 = time.perf_counter()
    rows = []
    with open(path, errors="replace") as fh:
        for line in fh:
            m = head.search(line)
            if not m:
                continue
            d = dict(field.findall(line))
            rows.append((int(m.group(1)), float(d.get("lm loss", "nan")),
                         float(d.get("learning rate", "nan")), float(d.get("grad norm", "nan")),
                         float(d.get("loss scale", "nan")), int(d.get("number of skipped iterations", 0))))
    t2 = time.perf_counter()
    rows, extra = len(rows), {}
else:  # baseline-jsonl: store.read_jsonl's way, one json.loads a line, keeping the fields we need
    t0 = time.perf_counter()
    rows = []
    with open(path, "rb") as fh:
        for line in fh:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            rows.append((r.get("rank"), r.get("step"), r.get("loss"), r.get("lr"), r.get("grad_norm"),
                         r.get("loss_scale"), r.get("skipped")))
    t2 = time.perf_counter()
    rows, extra = len(rows), {}
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
worker_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest parse worker
print(json.dumps({"seconds": t2 - t0, "rows": rows, "rss_mb": rss_mb + worker_mb, **extra}))
"""


def measure(kind: str, path: Path, repeat: int, repo: Path = REPO) -> dict:
    best: dict | None = None
    for _ in range(repeat):
        result = _child(kind, path, repo)
        print(f"  {kind:<18} {result['seconds']:6.2f} s  {result['rss_mb']:7.0f} MB  rows {result['rows']}")
        if best is None or result["seconds"] < best["seconds"]:
            best = result
    assert best is not None
    return best


def _child(kind: str, path: Path, repo: Path) -> dict:
    """One measurement in a fresh process importing ciuic_doctor from `repo` (its cwd comes first)."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(path)], capture_output=True, text=True, cwd=repo, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(other: Path, logs: dict[str, Path], repeat: int) -> None:
    """Ours and `other`'s ciuic figures on the same logs, measured in turn; best of `repeat` each."""
    print(f"\nside by side with {other} (measured in turn, best of {repeat}):")
    print(f"{'log':<9} {'this s':>8} {'(import':>8} {'+checks)':>9} {'other s':>8} {'(import':>8} "
          f"{'+checks)':>9} {'this/other':>11} {'RSS MB':>7} {'other':>7}")  # fmt: skip
    for name, path in logs.items():
        best: dict[str, dict] = {}
        for _ in range(repeat):
            for who, repo in (("this", REPO), ("other", other)):
                result = _child(f"ours-{name}", path, repo)
                if who not in best or result["seconds"] < best[who]["seconds"]:
                    best[who] = result
        a, b = best["this"], best["other"]
        print(
            f"{name:<9} {a['seconds']:8.2f} {a['import_s']:8.2f} {a['analysis_s']:9.2f} {b['seconds']:8.2f} "
            f"{b['import_s']:8.2f} {b['analysis_s']:9.2f} {a['seconds'] / b['seconds']:10.2f}× "
            f"{a['rss_mb']:7.0f} {b['rss_mb']:7.0f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--keep", metavar="DIR", help="write the logs here and keep them (reused if there)")
    parser.add_argument(
        "--against", metavar="CHECKOUT", type=Path, help="also measure this checkout, in turn with ours"
    )
    args = parser.parse_args()
    folder = Path(args.keep or tempfile.mkdtemp(prefix="stability-speed-"))
    folder.mkdir(parents=True, exist_ok=True)
    megatron, jsonl = folder / "megatron.log", folder / "run" / "steps.jsonl"
    if args.keep and megatron.exists() and jsonl.exists():
        print(f"reusing the logs in {folder}")
    else:
        print(f"writing {args.steps:,}-step logs into {folder} ...")
        megatron, jsonl = write_logs(folder, args.steps)
    print(
        f"  megatron.log {megatron.stat().st_size / 1e6:.0f} MB, "
        f"steps.jsonl {jsonl.stat().st_size / 1e6:.0f} MB"
    )
    cpus = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    print(f"measuring (best of {args.repeat}; {cpus} CPUs, load average {load:.1f}) ...")
    results = {}
    for name, path in (("megatron", megatron), ("jsonl", jsonl.parent)):
        ours = measure(f"ours-{name}", path, args.repeat)
        base = measure(f"baseline-{name}", path if name == "megatron" else jsonl, args.repeat)
        results[name] = (ours, base)
    print()
    print(f"{'log':<9} {'ciuic s':>8} {'(import':>8} {'+checks)':>9} {'goal s':>7} {'baseline s':>11} "
          f"{'speed-up':>9} {'peak RSS MB':>12} {'goal MB':>8}")  # fmt: skip
    print("  (speed-up: baseline parse time / ciuic import time; both only read the log)")
    ok = True
    for name, (ours, base) in results.items():
        ratio = base["seconds"] / ours["import_s"]
        passed = ours["seconds"] <= GOALS[name] and ours["rss_mb"] <= RSS_GOAL_MB
        ok &= passed
        print(
            f"{name:<9} {ours['seconds']:8.2f} {ours['import_s']:8.2f} {ours['analysis_s']:9.2f} "
            f"{GOALS[name]:7.1f} {base['seconds']:11.2f} {ratio:8.1f}× {ours['rss_mb']:12.0f} "
            f"{RSS_GOAL_MB:8d}  {'ok' if passed else 'MISSED'}"
        )
    if args.against:
        compare(args.against.resolve(), {"megatron": megatron, "jsonl": jsonl.parent}, args.repeat)
    if not args.keep:
        for path in (megatron, jsonl):
            path.unlink()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
