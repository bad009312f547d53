"""Where the seed's rank-0 load + broadcast stops being a reasonable way to load: both load methods side
by side on 2 gloo ranks, for checkpoints of growing size, measured in one run with checkpoint-check's own
measuring code (probes/checkpoint/cost.py).

    .venv/bin/python benchmarks/checkpoint_cost.py [--sizes 16M,64M,256M] [--repeats 3]

Per size: rank 0 writes a state dict of fp32 tensors (torch.save, temp file + rename) while rank 1 waits
at the barrier; then, alternating which goes first, every rank reads the file with
torch.load(weights_only=True), and rank 0 reads it and broadcast_object_list sends it. Printed: medians of
the slowest rank's time, the ratio broadcast / every-rank, and the RSS each method added on its worst rank.
The ratios are what to read; absolute times depend on this machine's disk and page cache.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ciuic_doctor.probes.checkpoint.cost import (
    Methods,
    barrier,
    measure_broadcast_load,
    measure_every_rank_load,
)
from ciuic_doctor.units import format_bytes, parse_size

TENSORS = 32  # a state dict is many tensors, not one blob


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _state(total_bytes: int) -> dict[str, torch.Tensor]:
    per = max(1, total_bytes // TENSORS // 4)
    return {f"layer.{i}.weight": torch.randn(per) for i in range(TENSORS)}


def _rank(rank: int, cfg: dict) -> None:
    port, sizes, repeats, directory, out = (cfg[k] for k in ("port", "sizes", "repeats", "directory", "out"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    methods = Methods()
    rows = []
    for size in sizes:
        path = Path(directory) / f"bench-{size}.pt"
        times: dict[str, list[float]] = {"save": [], "wait": [], "every": [], "bcast": []}
        rss: dict[str, list[int]] = {"every": [], "bcast": []}
        for repeat in range(repeats):
            state = _state(size) if rank == 0 else None  # built before the barrier: not part of the wait
            barrier()
            if rank == 0:
                t0 = time.perf_counter()
                methods.write(state, path)
                times["save"].append(time.perf_counter() - t0)
            del state
            t0 = time.perf_counter()
            barrier()
            times["wait"].append(time.perf_counter() - t0)
            order = ("every", "bcast") if repeat % 2 == 0 else ("bcast", "every")
            for name in order:
                if name == "every":
                    rec = measure_every_rank_load(path, methods, repeat)
                else:
                    rec = measure_broadcast_load(path, methods, rank, repeat)
                times[name].append(rec["load_s"])
                rss[name].append(rec["rss_delta_bytes"])
        rows.append({"size": size, "times": times, "rss": rss})
    gathered: list = [None, None]
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        out["rows"] = gathered
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16M,64M,256M")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    manager = mp.Manager()
    out = manager.dict()
    port = 29_000 + os.getpid() % 1000
    with tempfile.TemporaryDirectory() as directory:
        cfg = {"port": port, "sizes": sizes, "repeats": args.repeats, "directory": directory, "out": out}
        mp.spawn(_rank, args=(cfg,), nprocs=2, join=True)
    ranks = out["rows"]
    print(f"2 gloo ranks, {args.repeats} repetitions per size, medians of the slowest rank")
    header = (
        f"{'size':>8} {'save s':>8} {'wait s':>8} {'every-rank s':>13} {'rank0+bcast s':>14} "
        f"{'ratio':>6} {'RSS every':>10} {'RSS bcast':>10}   (RSS: added on the worst rank)"
    )
    print(header)
    for index, size in enumerate(sizes):
        per_rank = [rows[index] for rows in ranks]

        def slowest(key: str, per_rank: list = per_rank) -> float:
            columns = [r["times"][key] for r in per_rank if r["times"][key]]
            return statistics.median(max(values) for values in zip(*columns, strict=True))

        def worst_rss(key: str, per_rank: list = per_rank) -> int:
            return max(max(r["rss"][key]) for r in per_rank)

        every, bcast = slowest("every"), slowest("bcast")
        print(
            f"{format_bytes(size):>8} {slowest('save'):8.3f} {slowest('wait'):8.3f} {every:13.3f} "
            f"{bcast:14.3f} {bcast / every:6.2f} {mib(worst_rss('every')):>10} {mib(worst_rss('bcast')):>10}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
