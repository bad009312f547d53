"""Regenerate the recorded memory runs next to this file: `python tests/data/memory_make.py`.

There is no GPU on the build machine, so the CUDA run is recorded by hand to the record contracts:
watch's step records (rank, step, t, step_time_s, loss, ..., mem_allocated, mem_reserved,
mem_active_peak, alloc_retries, rss, uss) and memwatch's samples and events. Sizes are those of a
DeepSeek-class shard on an 80 GB H100 (NVML reports 81559 MiB). Each run plants problems with known
answers; the numbers are seeded, so the tests can assert them.

memory_cuda/  2 ranks, 150 steps of 0.5 s, memwatch at 1 Hz with NVML:
  rank 0  mem_allocated grows 2 MiB/step after the optimizer state appears at step 2 (a device leak);
          memory outside PyTorch flat at 1.2 GiB; two DataLoader workers whose USS grows 1 MiB/s while
          their RSS stays flat (copy-on-read)
  rank 1  mem_allocated flat; 12 GiB of its 44 GiB reserved never used even at the step's peak, and
          3 allocator retries (fragmentation); memory outside PyTorch grows 8 MiB/step (NCCL buffers)
memory_cpu/   2 ranks on CPU (no CUDA fields, no NVML), 120 steps of 0.5 s, memwatch at 1 Hz:
  rank 0  anonymous memory grows 1 MiB/step, i.e. 2 MiB per 1 Hz sample: the slope per step is right
          only if samples are aligned to steps by time
  rank 1  +2 GiB of optimizer state at step 2, flat after: not a leak once the warm-up is skipped
  the last line of memwatch.jsonl is torn, as after a kill -9
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
T0 = 1_760_000_000.0
HOST = "gpu-node-01"
MIB, GIB = 2**20, 2**30
H100_TOTAL = 81559 * MIB
STEP_S = 0.5
FIRST_STEP_T = T0 + 10.0


def write_jsonl(run: Path, name: str, rows: list[dict], *, torn: bool = False) -> None:
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)
    if torn:
        text += '{"schema":1,"t":' + str(rows[-1]["t"] + 1) + ',"pid":4001,"role":"ra'
    (run / name).write_text(text)


def step_at(t: float) -> float:
    """The step in progress at time t (steps end at FIRST_STEP_T + step × STEP_S)."""
    return (t - FIRST_STEP_T) / STEP_S


def cuda_steps(rng: random.Random, rank: int, steps: int) -> list[dict]:
    rows = []
    for step in range(1, steps + 1):
        optimizer = 0 if step < 2 else 10 * GIB  # Adam moments appear at the first optimizer step
        allocated = 20 * GIB + optimizer
        if rank == 0 and step >= 2:
            allocated += 2 * MIB * (step - 2)  # the leak: e.g. `total_loss += loss` keeps graphs alive
        allocated += rng.uniform(0, 1 * MIB)
        peak = allocated + (4 * GIB if rank == 0 else 2 * GIB)
        reserved = (36 * GIB if rank == 0 else 44 * GIB) if step >= 2 else 26 * GIB
        rows.append(
            {
                "schema": 1,
                "t": FIRST_STEP_T + step * STEP_S,
                "host": HOST,
                "rank": rank,
                "step": step,
                "step_time_s": round(STEP_S * (1 + rng.uniform(-0.02, 0.02)), 4),
                "loss": round(9.0 * math.exp(-step / 80) + 2.0 + rng.gauss(0, 0.03), 5),
                "lr": 3e-4,
                "grad_norm": round(1.5 + rng.gauss(0, 0.1), 4),
                "loss_scale": None,
                "skipped": False,
                "mem_allocated": int(allocated),
                "mem_reserved": int(reserved),
                "mem_active_peak": int(peak),
                "alloc_retries": (0 if step < 100 else 1 if step < 130 else 3) if rank == 1 else 0,
                "rss": int(14 * GIB + rng.uniform(0, 30 * MIB)),
                "uss": int(11 * GIB + rng.uniform(0, 30 * MIB)),
                **({"inactive_split_bytes": 3 * GIB} if rank == 1 else {}),
            }
        )
    return rows


def sample(t: float, index: int, pid: int, role: str, rank: int | None, **fields) -> dict:
    return {
        "schema": 1,
        "t": t,
        "host": HOST,
        "sample": index,
        "pid": pid,
        "role": role,
        "rank": rank,
        "cpu_percent": 95.0 if role.startswith("rank") else 20.0,
        "threads": 40 if role.startswith("rank") else 4,
        "uss_every": 1,
        "sys_total_bytes": 2048 * GIB,
        "shm_used_bytes": 2 * GIB,
        "shm_free_bytes": 1000 * GIB,
        "gpu_bytes": None,
        "gpu_devices": [],
        "gpu_total_bytes": None,
        **fields,
    }


def events(t_end: float, procs: list[tuple[int, str, int | None]], nvml_reason: str | None) -> list[dict]:
    rows = [
        {
            "schema": 1,
            "t": T0,
            "host": HOST,
            "kind": "start",
            "target_pid": 4000,
            "interval_s": 1.0,
            "duration_s": None,
            "nvml_available": nvml_reason is None,
            "nvml_reason": nvml_reason,
        }
    ]
    rows += [
        {
            "schema": 1,
            "t": T0,
            "host": HOST,
            "kind": "process",
            "pid": pid,
            "role": role,
            "rank": rank,
            "rank_source": "env" if rank is not None else "cmdline",
        }
        for pid, role, rank in procs
    ]
    rows.append({"schema": 1, "t": t_end, "host": HOST, "kind": "end", "reason": "target exited"})
    return rows


def make_cuda(run: Path) -> None:
    rng = random.Random(4)
    steps = {rank: cuda_steps(rng, rank, 150) for rank in (0, 1)}
    procs = [(4000, "agent", None), (4001, "rank 0", 0), (4002, "rank 1", 1)]
    procs += [(4003, "worker of rank 0", 0), (4004, "worker of rank 0", 0)]
    rows = []
    t, index = T0 + 9.0, 0
    while t < FIRST_STEP_T + 150 * STEP_S + 2:
        for pid, role, rank in procs:
            fields: dict = {}
            if role == "agent":
                fields = {"rss": 300 * MIB, "anon": 200 * MIB, "uss": 180 * MIB, "pss": 190 * MIB}
            elif role.startswith("rank"):
                done = [r for r in steps[rank] if r["t"] <= t]
                reserved = done[-1]["mem_reserved"] if done else 0
                outside = 1.2 * GIB + rng.uniform(-8, 8) * MIB
                if rank == 1 and done:
                    outside += 8 * MIB * done[-1]["step"]  # NCCL buffers accumulating
                fields = {
                    "rss": int(16 * GIB + rng.uniform(0, 40 * MIB)),
                    "anon": int(12 * GIB + rng.uniform(0, 40 * MIB)),
                    "uss": int(11 * GIB + rng.uniform(0, 40 * MIB)),
                    "pss": int(12 * GIB + rng.uniform(0, 40 * MIB)),
                    "gpu_bytes": int(reserved + outside) if done else int(outside),
                    "gpu_devices": [rank],
                    "gpu_total_bytes": H100_TOTAL,
                }
            else:
                age = t - T0
                fields = {
                    "rss": int(3 * GIB + rng.uniform(0, 5 * MIB)),
                    "anon": int(2.5 * GIB + rng.uniform(0, 5 * MIB)),
                    "uss": int(200 * MIB + MIB * age + rng.uniform(0, 2 * MIB)),
                    "pss": int(900 * MIB + 0.5 * MIB * age + rng.uniform(0, 2 * MIB)),
                }
            rows.append(sample(t, index, pid, role, rank, sys_available_bytes=1500 * GIB, **fields))
        t += 1.0
        index += 1
    run.mkdir(exist_ok=True)
    for rank, records in steps.items():
        write_jsonl(run, f"steps.rank{rank}.jsonl", records)
    write_jsonl(run, "memwatch.jsonl", rows)
    write_jsonl(run, "memwatch_events.jsonl", events(t, procs, None))
    devices = [
        {"index": i, "name": "NVIDIA H100 80GB HBM3", "total_memory_bytes": H100_TOTAL} for i in (0, 1)
    ]
    meta = {"schema": 1, "run": run.name, "created": T0, "env": {"devices": devices}}
    (run / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def make_cpu(run: Path) -> None:
    rng = random.Random(5)
    steps = {
        rank: [
            {
                "schema": 1,
                "t": FIRST_STEP_T + step * STEP_S,
                "host": HOST,
                "rank": rank,
                "step": step,
                "step_time_s": STEP_S,
                "loss": 3.0,
                "mem_allocated": None,
                "mem_reserved": None,
                "mem_active_peak": None,
                "alloc_retries": None,
                "rss": int(3 * GIB + (MIB * step if rank == 0 else 0) + rng.uniform(0, 4 * MIB)),
                "uss": None,
            }
            for step in range(1, 121)
        ]
        for rank in (0, 1)
    }
    procs = [(5000, "agent", None), (5001, "rank 0", 0), (5002, "rank 1", 1)]
    rows, t, index = [], T0 + 8.0, 0
    while t < FIRST_STEP_T + 120 * STEP_S + 3:
        step = min(max(step_at(t), 0.0), 120.0)
        for pid, role, rank in procs:
            if role == "agent":
                anon = 150 * MIB
            elif rank == 0:
                anon = 2 * GIB + MIB * step  # 1 MiB per step = 2 MiB per sample = 2 MiB/s
            else:
                anon = 1.5 * GIB + (2 * GIB if step >= 2 else 0)  # optimizer state, then flat
            anon += rng.uniform(0, 4 * MIB)
            growth = MIB * step
            rows.append(
                sample(
                    t,
                    index,
                    pid,
                    role,
                    rank,
                    rss=int(anon + 600 * MIB),
                    anon=int(anon),
                    uss=int(anon - 50 * MIB),
                    pss=int(anon),
                    sys_available_bytes=int(20 * GIB - growth),
                )
            )
        t += 1.0
        index += 1
    run.mkdir(exist_ok=True)
    for rank, records in steps.items():
        write_jsonl(run, f"steps.rank{rank}.jsonl", records)
    write_jsonl(run, "memwatch.jsonl", rows, torn=True)
    reason = "NVML could not start: NVML Shared Library Not Found (no NVIDIA driver on this machine?)"
    write_jsonl(run, "memwatch_events.jsonl", events(t, procs, reason))
    (run / "meta.json").write_text(json.dumps({"schema": 1, "run": run.name, "created": T0}, indent=2) + "\n")


if __name__ == "__main__":
    make_cuda(HERE / "memory_cuda")
    make_cpu(HERE / "memory_cpu")
