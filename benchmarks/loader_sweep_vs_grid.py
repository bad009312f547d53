"""loader-sweep's successive halving against the exhaustive grid, measured side by side in one run.

Goal (issue 6): the sweep's pick within 5 % of the grid's best throughput, in <= 50 % of the grid's time.

The same synthetic dataset (real CPU work per sample, real bytes per sample) is swept twice:
1. `loader-sweep` as shipped (halving, eta 3) within --budget seconds;
2. the exhaustive grid: every configuration measured once, each for as long as the sweep measured its
   pick over all its rounds, so both answers rest on equally long measurements.

Time ratio: sweep wall time / grid wall time. Throughput ratio: the sweep's pick against the grid's
best, measured head to head afterwards in back-to-back pairs (order alternating), the median of the
per-pair ratios: on a machine shared with other work the load drifts by 2x within the minutes a grid
takes, so two numbers taken a minute apart compare the load as much as the configurations.

    .venv/bin/python benchmarks/loader_sweep_vs_grid.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from ciuic_doctor.analysis.loader import Pooled, choose, last_sweep, pool
from ciuic_doctor.commands.loader_sweep import parse_int_list
from ciuic_doctor.machine.envinfo import cpu_budget
from ciuic_doctor.probes.loader.datasets import SyntheticDataset
from ciuic_doctor.probes.loader.measure import LoaderConfig, Plan, measure
from ciuic_doctor.probes.loader.sweep import Sweep, SweepSettings
from ciuic_doctor.rundir.store import RunDir

HEAD_TO_HEAD_PAIRS = 6  # alternating windows: a drifting load hits both alike


def sweep(run: RunDir, dataset, settings: SweepSettings, label: str):
    print(f"--- {label}")
    header = {"batch_size": settings.batch_size, "cpu_budget_per_rank": settings.cpu_budget_per_rank,
              "local_world_size": 1, "current": {}}  # fmt: skip
    t0 = time.perf_counter()
    result = Sweep(run, dataset, settings, header=header, progress=lambda line: print(line, flush=True)).run()
    wall_s = time.perf_counter() - t0
    _, records = last_sweep(result.records)
    return wall_s, records, pool(records)


def head_to_head(dataset, a: Pooled, b: Pooled, batch_size: int, window_s: float) -> list[float]:
    """Rate of a over rate of b in back-to-back pairs, the order alternating (ab, ba, ab, ...) so a
    load that drifts during a pair favours neither; one ratio per pair."""
    ratios = []
    for i in range(HEAD_TO_HEAD_PAIRS):
        rates = {}
        for p in (a, b) if i % 2 == 0 else (b, a):
            cfg = LoaderConfig(num_workers=p.num_workers, prefetch_factor=p.prefetch_factor)
            r = measure(dataset, cfg, Plan(batch_size=batch_size, window_s=window_s))
            if r["status"] != "ok":
                raise SystemExit(f"{p.config}: {r['status']}: {r.get('error')}")
            rates[p.config] = r["samples_per_s"]
        ratios.append(rates[a.config] / rates[b.config])
        rate_a, rate_b = rates[a.config], rates[b.config]
        print(f"    pair {i + 1}: {a.config} {rate_a:7.1f}, {b.config} {rate_b:7.1f} samples/s, "
              f"ratio {ratios[-1]:.3f}", flush=True)  # fmt: skip
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=40.0, help="the sweep's time budget (s)")
    parser.add_argument("--sample-cost-ms", type=float, default=1.5, help="CPU ms per sample (decoding)")
    parser.add_argument("--sample-bytes", type=int, default=48 << 10, help="bytes per sample")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", default="0-4")
    parser.add_argument("--prefetch", default="1,2,4")
    args = parser.parse_args()

    dataset = SyntheticDataset(sample_cost_ms=args.sample_cost_ms, sample_bytes=args.sample_bytes)
    common = {
        "batch_size": args.batch_size,
        "workers": parse_int_list(args.workers, "--workers", 0),
        "prefetch": parse_int_list(args.prefetch, "--prefetch", 1),
        "cpu_budget_per_rank": cpu_budget()["usable"],
        "local_world_size": 1,
        "explicit_workers": True,  # the grid's worker counts are asked for: all may be picked
    }
    print(
        f"dataset: {args.sample_cost_ms} ms CPU and {args.sample_bytes} bytes per sample, batch "
        f"{args.batch_size}; {cpu_budget()['usable']} usable CPUs; load average {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        sweep_s, records, pooled = sweep(
            RunDir.create(Path(tmp) / "sweep"), dataset, SweepSettings(**common, budget_s=args.budget),
            "successive halving",
        )  # fmt: skip
        best, pick = choose(pooled)
        if pick is None or best is None:
            raise SystemExit("the sweep measured nothing")
        pick_window_s = sum(
            float(r["window_wall_s"])
            for r in records
            if r.get("kind") == "measure" and r.get("config") == pick.config and r.get("status") == "ok"
        )
        grid_s, _, grid = sweep(
            RunDir.create(Path(tmp) / "grid"), dataset,
            SweepSettings(**common, budget_s=1e9, strategy="grid", grid_window_s=pick_window_s),
            f"exhaustive grid, {pick_window_s:.2f} s per configuration",
        )  # fmt: skip
    grid_best = max(grid.values(), key=lambda p: p.samples_per_s)
    ratios = [1.0]
    if grid_best.config != pick.config:
        print(f"--- head to head: {pick.config} vs {grid_best.config}")
        ratios = head_to_head(dataset, pick, grid_best, args.batch_size, pick_window_s / 4)
    throughput_ratio = statistics.median(ratios)
    time_ratio = sweep_s / grid_s
    print("\n=== loader-sweep vs exhaustive grid")
    print(f"configurations          {len(grid)}")
    print(f"sweep pick              {pick.config} ({pick.samples_per_s:.1f} samples/s in the sweep, "
          f"{grid[pick.config].samples_per_s:.1f} in the grid)")  # fmt: skip
    print(f"grid best               {grid_best.config} ({grid_best.samples_per_s:.1f} samples/s in the grid)")
    print(f"head to head            {len(ratios)} pair(s), ratios {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"time                    sweep {sweep_s:.1f} s, grid {grid_s:.1f} s")
    print(f"throughput ratio        {throughput_ratio:.3f}  (median of the pairs; goal >= 0.95)")
    print(f"time ratio              {time_ratio:.3f}  (goal <= 0.50)")
    met = throughput_ratio >= 0.95 and time_ratio <= 0.5
    print(f"goal                    {'met' if met else 'NOT met'}")
    print(f"load average            {os.getloadavg()[0]:.1f} at the end (other processes share these CPUs)")


if __name__ == "__main__":
    main()
