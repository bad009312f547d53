"""memwatch.jsonl of a generated GPU job, written a block of lines at a time (tests/synthtext.py).

What memwatch (probes/memwatch/sampler.py) writes on every host each second: the torchrun agent and each
rank, rss, anon, vms, cpu_percent, threads, USS/PSS every 5th sample, NVML's per-process bytes (the
allocator's reserved bytes plus ~0.5 GiB of CUDA context) and the host's available memory — every host's
samples merged in time order into one file. Same draws in the same order, same bytes as the per-line
f-strings it replaces (a 256 × 1,000 run's files diffed against the f-string writer's: identical).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tests.synthtext import fixed, integers, text

if TYPE_CHECKING:
    import numpy as np

    from tests.scalesynth import Plan

MIB = 2**20
GIB = 2**30
BLOCK_LINES = 1 << 20  # lines formatted at once (~0.5 GB of text)


def host_columns(plan: Plan, host_index: int, ends: np.ndarray, rss_of, rng: np.random.Generator) -> dict:
    """One host's samples as columns (line order: sample, then agent and its ranks); the draws are
    gpusynth's in its order: available, shm, then each process's rss (and NVML bytes for a rank)."""
    import numpy as np

    from tests.gpusynth import CONTEXT_BYTES, HOST_TOTAL_BYTES, reserved_of

    first_rank = host_index * plan.ranks_per_host
    ranks = list(range(first_rank, min(plan.ranks, first_rank + plan.ranks_per_host)))
    start, stop = float(ends[0]) - 1.0, float(ends[-1])
    times = np.arange(start, stop, plan.memwatch_interval_s) + host_index * 1e-3
    samples = len(times)
    steps = np.interp(times, ends, np.arange(1, len(ends) + 1), left=0.0)
    available = HOST_TOTAL_BYTES - 600 * GIB - rng.uniform(0, 2 * GIB, samples)
    shm_used = 40 * GIB + rng.uniform(0, GIB, samples)
    procs = [("agent", None, 900_000 + host_index)] + [(f"rank {r}", r, 1_000_000 + r) for r in ranks]
    rss, gpu = [], []
    for _, rank, _ in procs:
        if rank is None:
            rss.append(1.2 * GIB + rng.uniform(0, 4 * MIB, samples))
            gpu.append(np.full(samples, np.nan))
        else:
            rss.append(rss_of(rank, steps) + rng.uniform(0, 8 * MIB, samples))
            gpu.append(reserved_of(plan, rank, steps) + CONTEXT_BYTES + rng.integers(0, 3, samples) * 2 * MIB)
    width = len(procs)
    return {
        "times": times,
        "procs": procs,
        "host": np.full(samples * width, host_index),
        "sample": np.repeat(np.arange(samples), width),
        "proc": np.tile(np.arange(width), samples),
        "rss": np.stack(rss, axis=1).ravel(),  # (sample, proc) order
        "gpu": np.stack(gpu, axis=1).ravel(),
        "available": np.repeat(available, width),
        "shm_used": np.repeat(shm_used, width),
    }


def write(path: Path, plan: Plan, ends_by_rank, rss_of, rng: np.random.Generator) -> list:
    """memwatch.jsonl, every host's lines in (time, host, line) order — the order heapq.merge of the
    hosts' keyed lines gave; returns every host's processes (role, rank, pid) for the events file."""
    import numpy as np

    hosts = -(-plan.ranks // plan.ranks_per_host)
    per_host = [
        host_columns(plan, h, ends_by_rank(h * plan.ranks_per_host), rss_of, rng) for h in range(hosts)
    ]
    procs_all = [p for h in per_host for p in h["procs"]]
    width = np.array([len(h["procs"]) for h in per_host])
    base = np.r_[0, np.cumsum(width)[:-1]]  # each host's first process in procs_all
    cols = {k: np.concatenate([h[k] for h in per_host]) for k in per_host[0] if k not in ("times", "procs")}
    cols["t"] = np.concatenate([h["times"][h["sample"]] for h in per_host])
    line = np.concatenate([np.arange(len(h["sample"])) for h in per_host])
    del per_host
    order = np.lexsort((line, cols["host"], cols["t"]))
    del line
    pid = np.array([p for _, _, p in procs_all])
    rank = np.array([-1 if r is None else r for _, r, _ in procs_all])
    with open(path / "memwatch.jsonl", "wb") as fh:
        for at in range(0, len(order), BLOCK_LINES):
            pick = order[at : at + BLOCK_LINES]
            block = {k: v[pick] for k, v in cols.items()}
            who = base[block["host"]] + block["proc"]
            fh.write(_lines(plan, block, pid[who], rank[who]))
    return procs_all


def _lines(plan: Plan, block: dict, pid: np.ndarray, rank: np.ndarray) -> bytes:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from tests.gpusynth import DEVICE_TOTAL_BYTES, HOST_TOTAL_BYTES, SHM_TOTAL_BYTES
    from tests.synthtext import choose

    sample = block["sample"]
    rss = block["rss"]
    anon = (rss - 0.9 * GIB).astype(np.int64)
    full = (sample + pid) % 5 == 0
    is_rank = rank >= 0
    hosts = pa.array([plan.host_of(h * plan.ranks_per_host) for h in range(int(block["host"].max()) + 1)])
    cpu = pa.array([f"{99.0 + k * 0.1:.1f}" for k in range(7)])
    role = choose(is_rank, pc.binary_join_element_wise("rank ", integers(rank), ""), "agent")
    gpu_part = choose(
        is_rank,
        pc.binary_join_element_wise(
            '"gpu_bytes":', integers(np.nan_to_num(block["gpu"])), ',"gpu_devices":[',
            integers(rank % plan.ranks_per_host), f'],"gpu_total_bytes":{DEVICE_TOTAL_BYTES}', "",
        ),
        '"gpu_bytes":null,"gpu_devices":[],"gpu_total_bytes":null',
    )  # fmt: skip
    shm_used = block["shm_used"].astype(np.int64)
    return text(
        [
            b'{"schema":1,"t":', fixed(block["t"], 3), b',"host":"', pc.take(hosts, pa.array(block["host"])),
            b'","rss":', integers(rss), b',"anon":', integers(anon),
            b',"vms":', integers(rss.astype(np.int64) * 3),
            b',"cpu_percent":', pc.take(cpu, pa.array(sample % 7)), b',"threads":48,"uss":',
            choose(full, integers(anon - 200 * MIB), "null"), b',"pss":',
            choose(full, integers(anon + 100 * MIB), "null"), b',"swap":', choose(full, "0", "null"),
            b',"pid":', integers(pid), b',"role":"', role, b'","rank":',
            choose(is_rank, integers(rank), "null"), b',"uss_every":5,', gpu_part,
            b',"sample":', integers(sample),
            b',"sys_available_bytes":', integers(block["available"]),
            f',"sys_total_bytes":{HOST_TOTAL_BYTES},"shm_used_bytes":'.encode(), integers(shm_used),
            b',"shm_free_bytes":', integers(SHM_TOTAL_BYTES - shm_used), b"}\n",
        ]
    )  # fmt: skip
