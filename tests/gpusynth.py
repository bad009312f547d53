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

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from tests.synthtext import choose, fixed, integers, text

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
    return step_texts(plan, [step_columns(plan, rank, columns, rng)])[0].decode()


def step_columns(plan: Plan, rank: int, columns: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    """`columns` (scalesynth's timing, loss and host memory of the rank) with the CUDA allocator's
    figures drawn for it; formatted by `step_texts`, many ranks at a time."""
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
    return {**columns, "rank": rank, "allocated": allocated, "reserved": reserved, "peak": peak}


def step_texts(plan: Plan, ranks: list[dict]) -> list[bytes]:
    """Each rank's steps file (from `step_columns`), the ranks' lines formatted together."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = plan.steps

    def joined(name: str) -> np.ndarray:
        return np.concatenate([r[name] for r in ranks])

    shared = _shared_columns(n, ranks[0]["lr"].tobytes())
    every = np.arange(len(ranks) * n) % n
    prefix = pa.array([f',"host":"{plan.host_of(r["rank"])}","rank":{r["rank"]},"step":' for r in ranks])
    who = pc.take(prefix, pa.array(np.repeat(np.arange(len(ranks)), n)))
    uss_text = choose(shared["uss_due"][every], integers(joined("uss")), "null")
    body = text(
        [
            b'{"schema":1,"t":', fixed(joined("t"), 4), who, pc.take(shared["step"], pa.array(every)),
            b',"step_time_s":', fixed(joined("step_time_s"), 5),
            b',"pre_backward_s":', fixed(joined("pre_backward_s"), 5),
            b',"loss":', fixed(joined("loss"), 5), b',"lr":', pc.take(shared["lr"], pa.array(every)),
            b',"grad_norm":', fixed(joined("grad_norm"), 4),
            b',"grad_norm_source":"clip_grad_norm_","clip_max_norm":1.0,"loss_scale":null,"skipped":false,'
            b'"backward_calls":1,"mem_allocated":', integers(joined("allocated")),
            b',"mem_reserved":', integers(joined("reserved")),
            b',"mem_active_peak":', integers(joined("peak")),
            b',"alloc_retries":0,"rss":', integers(joined("rss")), b',"uss":', uss_text,
            b',"weights_checksum":', pc.take(shared["checksum"], pa.array(every)),
            b',"desync_ranks":null,"optimizer":0,"optimizer_class":"AdamW","loss_scale_next":null,'
            b'"segment":0}\n',
        ]
    )  # fmt: skip
    view = memoryview(body)
    cuts = np.flatnonzero(np.frombuffer(body, dtype=np.uint8) == 10)[n - 1 :: n] + 1
    starts = np.r_[0, cuts[:-1]]
    return [bytes(view[a:b]) for a, b in zip(starts.tolist(), cuts.tolist(), strict=True)]


@functools.lru_cache(maxsize=4)
def _shared_columns(n: int, lr_bytes: bytes) -> dict[str, object]:
    """The fields every rank writes alike (step, lr, checksum, whether USS was read), formatted once."""
    import numpy as np
    import pyarrow as pa

    steps = np.arange(1, n + 1).tolist()
    lr = np.frombuffer(lr_bytes, dtype=np.float64).tolist()
    checksum = [
        f"{1234.5 + step * 0.25!r}" if step == 1 or (step - 1) % CHECKSUM_EVERY_GPU == 0 else "null"
        for step in steps
    ]
    return {
        "step": pa.array([str(s) for s in steps]),
        "lr": pa.array([f"{v:.6g}" for v in lr]),
        "checksum": pa.array(checksum),
        "uss_due": np.array([(s - 1) % USS_EVERY == 0 for s in steps]),
    }


def reserved_of(plan: Plan, rank: int, step: np.ndarray) -> np.ndarray:
    """The rank's reserved bytes at (fractional) steps, without the per-step cache noise."""
    base = ALLOCATED_BYTES + PEAK_EXTRA_BYTES + rank * 4096 + RESERVED_SLACK_BYTES + 70 * MIB
    grow = plan.grower_mib_per_step * MIB * step if rank == plan.grower_rank else 0.0
    return base + grow


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


def write_streams(path: Path, plan: Plan, ends_by_rank, rss_of, rng) -> None:
    """memwatch.jsonl (every host merged in time order: tests/gpusynth_memwatch.py),
    memwatch_events.jsonl and comm.jsonl."""
    import numpy as np

    from tests import gpusynth_memwatch

    if plan.memwatch:
        procs_all = gpusynth_memwatch.write(path, plan, ends_by_rank, rss_of, rng)
        first = float(ends_by_rank(0)[0]) - 1.0
        (path / "memwatch_events.jsonl").write_text(memwatch_events(plan, procs_all, first))
    if plan.comm:
        (path / "comm.jsonl").write_text(comm_lines(plan, np.random.default_rng(plan.seed + 1)))
