"""The GPU part of the large-run generator: the step records watch writes on a CUDA job, memwatch's
samples of every rank (NVML figures included) and a comm-bench table.

Split from `scalesynth.py` (which owns the plan, the DDP timing model and the CPU-only records). What a
CUDA run fills, from probes/watch/session.py (RECORD_KEYS, in that order after the writer's schema, t,
host) and probes/watch/values.py: `mem_allocated` / `mem_reserved` / `mem_active_peak` /
`alloc_retries` from torch.cuda.memory_stats, `rss` every step, `uss` only every 10th step (watch's
uss_every), a `weights_checksum` every 10 steps (checksum_every), `loss_scale` null (bf16: no
GradScaler), one optimizer. memwatch (probes/memwatch/sampler.py) samples the torchrun agent and every
rank of a host each second: rss, anon, vms, cpu_percent, threads, USS every k-th sample, NVML's
per-process bytes (the allocator's reserved bytes plus ~0.5 GiB of CUDA context, cuBLAS and NCCL) and
the host's available memory.

Planted (each optional, on top of scalesynth's straggler): a rank whose host memory grows (`leak`:
rss, anon and uss grow together) and a rank whose allocator cache grows while allocated stays flat
(`reserved_grower`: what fragmentation looks like from outside — reserved creeps up segment by segment).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from tests.scalesynth import Plan

MIB = 2**20
GIB = 2**30
USS_EVERY = 10  # watch reads USS every 10th step (its smaps_rollup walk is costly on a big process)
CHECKSUM_EVERY_GPU = 10  # watch's checksum_every default
ALLOCATED_BYTES = 38 * GIB  # weights, grads and optimizer state of a DeepSeek-class shard at step end
PEAK_EXTRA_BYTES = 24 * GIB  # activations at the step's peak (mem_active_peak is since process start)
RESERVED_SLACK_BYTES = 600 * MIB  # the cache held beyond the peak on a healthy rank
CONTEXT_BYTES = 520 * MIB  # NVML − reserved: CUDA context, cuBLAS workspace, NCCL buffers
DEVICE_TOTAL_BYTES = 80 * GIB
HOST_TOTAL_BYTES = 2 * 1024 * GIB
SHM_TOTAL_BYTES = 512 * GIB


def step_lines(plan: Plan, rank: int, columns: dict[str, np.ndarray], rng: np.random.Generator) -> str:
    """One rank's steps file: every field watch writes on a CUDA rank, in watch's key order."""
    import numpy as np

    n = plan.steps
    steps = np.arange(1, n + 1)
    allocated = ALLOCATED_BYTES + rank * 4096 + rng.integers(0, 4, n) * 2 * MIB  # step-end views vary
    peak = np.full(n, ALLOCATED_BYTES + PEAK_EXTRA_BYTES + rank * 4096)
    peak[0] = ALLOCATED_BYTES + PEAK_EXTRA_BYTES // 2  # the first step is smaller (no optimizer state yet)
    # the cache grows in 20 MiB segments now and then, and is reused: a flat, noisy level
    reserved = peak + RESERVED_SLACK_BYTES + rng.integers(0, 8, n) * 20 * MIB
    if rank == plan.grower_rank:
        reserved = reserved + (plan.grower_mib_per_step * MIB * steps).astype(np.int64)
    peak = np.maximum.accumulate(peak)
    rss, uss = columns["rss"], columns["uss"]
    checksum_every = CHECKSUM_EVERY_GPU
    out = []
    t, step_time, pace = columns["t"], columns["step_time_s"], columns["pre_backward_s"]
    loss, lr, grad = columns["loss"], columns["lr"], columns["grad_norm"]
    for i, step in enumerate(steps.tolist()):
        checksum = f"{1234.5 + step * 0.25!r}" if step == 1 or (step - 1) % checksum_every == 0 else "null"
        uss_value = str(int(uss[i])) if (step - 1) % USS_EVERY == 0 else "null"
        out.append(
            f'{{"schema":1,"t":{t[i]:.4f},"host":"{plan.host_of(rank)}","rank":{rank},"step":{step},'
            f'"step_time_s":{step_time[i]:.5f},"pre_backward_s":{pace[i]:.5f},"loss":{loss[i]:.5f},'
            f'"lr":{lr[i]:.6g},"grad_norm":{grad[i]:.4f},"grad_norm_source":"clip_grad_norm_",'
            f'"clip_max_norm":1.0,"loss_scale":null,"skipped":false,"backward_calls":1,'
            f'"mem_allocated":{int(allocated[i])},"mem_reserved":{int(reserved[i])},'
            f'"mem_active_peak":{int(peak[i])},"alloc_retries":0,"rss":{int(rss[i])},'
            f'"uss":{uss_value},"weights_checksum":{checksum},"desync_ranks":null,"optimizer":0,'
            f'"optimizer_class":"AdamW","loss_scale_next":null,"segment":0}}\n'
        )
    return "".join(out)


def reserved_of(plan: Plan, rank: int, step: np.ndarray) -> np.ndarray:
    """The rank's reserved bytes at (fractional) steps, without the per-step cache noise."""
    base = ALLOCATED_BYTES + PEAK_EXTRA_BYTES + rank * 4096 + RESERVED_SLACK_BYTES + 70 * MIB
    grow = plan.grower_mib_per_step * MIB * step if rank == plan.grower_rank else 0.0
    return base + grow


def memwatch_lines(plan: Plan, host_index: int, ends: np.ndarray, rss_of, rng: np.random.Generator):
    """memwatch's samples of one host (agent + its ranks), one per second over the job, as lines with
    their times (the caller merges every host's lines in time order into one memwatch.jsonl)."""
    import numpy as np

    first_rank = host_index * plan.ranks_per_host
    ranks = list(range(first_rank, min(plan.ranks, first_rank + plan.ranks_per_host)))
    host = plan.host_of(first_rank)
    start, stop = float(ends[0]) - 1.0, float(ends[-1])
    times = np.arange(start, stop, plan.memwatch_interval_s) + host_index * 1e-3
    samples = len(times)
    steps = np.interp(times, ends, np.arange(1, len(ends) + 1), left=0.0)
    available = HOST_TOTAL_BYTES - 600 * GIB - rng.uniform(0, 2 * GIB, samples)
    shm_used = 40 * GIB + rng.uniform(0, GIB, samples)
    system = [
        f'"sys_available_bytes":{int(a)},"sys_total_bytes":{HOST_TOTAL_BYTES},'
        f'"shm_used_bytes":{int(u)},"shm_free_bytes":{SHM_TOTAL_BYTES - int(u)}'
        for a, u in zip(available, shm_used, strict=True)
    ]
    procs = [("agent", None, 900_000 + host_index)] + [(f"rank {r}", r, 1_000_000 + r) for r in ranks]
    columns = []
    for role, rank, pid in procs:
        if rank is None:
            rss = 1.2 * GIB + rng.uniform(0, 4 * MIB, samples)
            gpu = None
        else:
            rss = rss_of(rank, steps) + rng.uniform(0, 8 * MIB, samples)
            gpu = reserved_of(plan, rank, steps) + CONTEXT_BYTES + rng.integers(0, 3, samples) * 2 * MIB
        columns.append((role, rank, pid, rss, gpu))
    lines = []
    for i in range(samples):
        t = times[i]
        for role, rank, pid, rss, gpu in columns:
            anon = int(rss[i] - 0.9 * GIB)
            full = (i + pid) % 5 == 0  # USS/PSS every 5th sample (memwatch's budget on a big rank)
            uss = f"{anon - 200 * MIB}" if full else "null"
            pss = f"{anon + 100 * MIB}" if full else "null"
            swap = "0" if full else "null"
            gpu_part = (
                f'"gpu_bytes":{int(gpu[i])},"gpu_devices":[{rank % plan.ranks_per_host}],'
                f'"gpu_total_bytes":{DEVICE_TOTAL_BYTES}'
                if gpu is not None
                else '"gpu_bytes":null,"gpu_devices":[],"gpu_total_bytes":null'
            )
            lines.append(
                f'{{"schema":1,"t":{t:.3f},"host":"{host}","rss":{int(rss[i])},"anon":{anon},'
                f'"vms":{int(rss[i]) * 3},"cpu_percent":{99.0 + (i % 7) * 0.1:.1f},"threads":{48},'
                f'"uss":{uss},"pss":{pss},"swap":{swap},"pid":{pid},"role":"{role}",'
                f'"rank":{"null" if rank is None else rank},"uss_every":5,{gpu_part},"sample":{i},'
                f"{system[i]}}}\n"
            )
    return times, lines, procs


def memwatch_events(plan: Plan, host_procs: list[tuple[str, int | None, int]], t0: float) -> str:
    lines = [
        json.dumps(
            {"schema": 1, "t": t0, "host": None, "kind": "start", "interval_s": plan.memwatch_interval_s}
        )
    ]
    for role, rank, pid in host_procs:
        lines.append(
            json.dumps(
                {
                    "schema": 1,
                    "t": t0,
                    "host": None if rank is None else plan.host_of(rank),
                    "kind": "process",
                    "pid": pid,
                    "role": role,
                    "name": "python",
                    "cmdline": "python train.py",
                }
            )
        )
    return "\n".join(lines) + "\n"


def comm_lines(plan: Plan, rng: np.random.Generator) -> str:
    """A comm-bench table of the job's world: all_reduce and all_gather, 1 MiB–1 GiB, ring and tree,
    NVLink-class bandwidth within a few percent, every element correct, no rank slower than the rest."""
    sizes = [2**k for k in range(20, 31, 2)]
    lines = []
    world = plan.ranks
    for collective, factor in (("all_reduce", 2 * (world - 1) / world), ("all_gather", (world - 1) / world)):
        for algo in ("ring", "tree") if collective == "all_reduce" else ("ring",):
            for size in sizes:
                busbw = 180.0 * (1 - 0.5 * 2**20 / size) * (1 + rng.normal(0, 0.01))
                time_us = size * factor / (busbw * 1e3)
                per_rank = (time_us * (1 + rng.normal(0, 0.003, world))).round(2).tolist()
                record = {
                    "schema": 1, "t": 0.0, "host": plan.host_of(0), "rank": 0,
                    "collective": collective, "algo": algo, "backend": "nccl", "dtype": "bfloat16",
                    "world_size": world, "status": "ok", "inplace": False, "bytes": size,
                    "count": size // 2, "iters": 20, "time_us": round(time_us, 2),
                    "time_us_min": min(per_rank), "time_us_max": max(per_rank),
                    "algbw_gbps": round(size / time_us / 1e3, 2), "busbw_gbps": round(busbw, 2),
                    "busbw_factor": factor, "wrong": 0, "slowest_rank": None,
                    "rank_time_us": per_rank,
                }  # fmt: skip
                lines.append(json.dumps(record, separators=(",", ":")))
    return "\n".join(lines) + "\n"


def _keyed(times, host_index: int, width: int, lines: list[str]):
    return ((float(times[i // width]), host_index, i, line) for i, line in enumerate(lines))


def write_streams(path: Path, plan: Plan, ends_by_rank, rss_of, rng) -> None:
    """memwatch.jsonl (every host merged in time order), memwatch_events.jsonl and comm.jsonl."""
    import heapq

    import numpy as np

    if plan.memwatch:
        hosts = -(-plan.ranks // plan.ranks_per_host)
        procs_all = []
        per_host = []
        for h in range(hosts):
            times, lines, procs = memwatch_lines(plan, h, ends_by_rank(h * plan.ranks_per_host), rss_of, rng)
            per_host.append(_keyed(times, h, len(procs), lines))
            procs_all += procs
        with open(path / "memwatch.jsonl", "w") as fh:
            for _, _, _, line in heapq.merge(*per_host):
                fh.write(line)
        first = float(ends_by_rank(0)[0]) - 1.0
        (path / "memwatch_events.jsonl").write_text(memwatch_events(plan, procs_all, first))
    if plan.comm:
        (path / "comm.jsonl").write_text(comm_lines(plan, np.random.default_rng(plan.seed + 1)))
