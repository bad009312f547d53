"""Regenerate the recorded GPU-cluster run in this folder: `python tests/data/report_gpu/make.py`.

There is no GPU on the build machine, so this run is *recorded by hand* to the contracts of HELPERS.md
(record fields of each probe, finding check names and evidence keys): 2 nodes × 4 GPUs on NCCL 2.26.2,
the seed article's settings in the job spec (timeout 30 s, NCCL_ALGO=Tree, num_workers=4, pin_memory),
fp16 with a GradScaler, and planted problems with known answers: Tree faster than Ring at the 25 MiB
gradient buckets, a straggler on rank 5, a device-memory leak on rank 3, fragmentation, a loss spike at
step 52 led by grad norm, a 95 s checkpoint save against the 30 s timeout, and a resume missing state.
The numbers are deterministic (seeded), so tests can assert exact recommendations.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
T0 = 1_760_000_000.0
HOSTS = ("gpu-node-01", "gpu-node-02")
WORLD = 8
STEPS = 80
MIB = 2**20
FACTOR = {
    "all_reduce": 2 * (WORLD - 1) / WORLD,
    "all_gather": (WORLD - 1) / WORLD,
    "reduce_scatter": (WORLD - 1) / WORLD,
    "all_to_all": (WORLD - 1) / WORLD,
    "broadcast": 1.0,
}


def host(rank: int) -> str:
    return HOSTS[rank // 4]


def write_jsonl(name: str, rows: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def comm_rows(rng: random.Random) -> list[dict]:
    rows = []
    for collective, factor in FACTOR.items():
        algos = ("ring", "tree") if collective == "all_reduce" else ("default",)
        for algo in algos:
            for power in range(10, 29, 2):  # 1 KiB .. 256 MiB
                size = 2**power
                peak = {"ring": 170.0, "tree": 196.0, "default": 150.0}[algo]
                latency_us = {"ring": 28.0, "tree": 18.0, "default": 22.0}[algo]
                busbw_max = peak * size / (size + 4 * MIB)
                time_us = latency_us + size * factor / (busbw_max * 1e3 + 1e-9)
                algbw = size / time_us / 1e3
                for inplace in (False, True):
                    jitter = 1 + rng.uniform(-0.02, 0.02)
                    t = time_us * jitter
                    rows.append(
                        {
                            "schema": 1,
                            "t": T0 + len(rows) * 0.05,
                            "host": HOSTS[0],
                            "rank": 0,
                            "collective": collective,
                            "algo": algo,
                            "algo_used": algo.upper() if algo != "default" else "RING",
                            "dtype": "float32",
                            "bytes": size,
                            "count": size // 4,
                            "world_size": WORLD,
                            "inplace": inplace,
                            "time_us": round(t, 2),
                            "time_us_min": round(t * 0.97, 2),
                            "time_us_max": round(t * (1.15 if collective == "all_reduce" else 1.05), 2),
                            "time_us_p50": round(t, 2),
                            "time_us_p99": round(t * 1.2, 2),
                            "algbw_gbps": round(algbw / jitter, 3),
                            "busbw_gbps": round(algbw / jitter * factor, 3),
                            "wrong": 0,
                            "slowest_rank": 5,
                        }
                    )
    return rows


def step_rows(rng: random.Random, rank: int) -> list[dict]:
    rows, scale = [], 65536.0
    for step in range(1, STEPS + 1):
        skipped = step in (1, 2, 3, 40)
        if skipped:
            scale /= 2
        loss = 10.8 * math.exp(-step / 60) + 5.2 + rng.gauss(0, 0.05)
        grad = 2.2 + rng.gauss(0, 0.15)
        if step == 51:
            grad *= 4.5
        if 52 <= step <= 57:
            loss *= 1 + 0.6 * math.exp(-(step - 52) / 2)
        slow = 1.13 if rank == 5 else 1.0
        allocated = 30e9 + (8 * MIB * step if rank == 3 else 0) + rng.uniform(0, 4 * MIB)
        rows.append(
            {
                "schema": 1,
                "t": T0 + 100 + step * 0.9,
                "host": host(rank),
                "rank": rank,
                "step": step,
                "step_time_s": round(0.85 * slow * (1 + rng.uniform(-0.03, 0.03)), 4),
                "loss": round(loss, 5),
                "lr": 3e-4 * min(1.0, step / 8),
                "grad_norm": round(grad, 4),
                "loss_scale": scale * 2 if skipped else scale,
                "skipped": skipped,
                "mem_allocated": int(allocated),
                "mem_reserved": int(allocated + 6e9),
                "mem_active_peak": int(allocated + 9e9),
                "alloc_retries": 2 if step > 60 else 0,
                "rss": int(12e9 + rng.uniform(0, 50 * MIB)),
                "uss": int(9e9 + rng.uniform(0, 50 * MIB)),
            }
        )
    return rows


def memwatch_rows(rng: random.Random) -> list[dict]:
    rows = []
    roles = ["agent"] + [f"rank {r}" for r in range(4)] + ["worker of rank 0"]
    for i in range(40):
        for n, role in enumerate(roles):
            base = 0.4e9 if role == "agent" else 1.5e9 if role.startswith("worker") else 12e9
            rows.append(
                {
                    "schema": 1,
                    "t": T0 + 100 + i * 2.0,
                    "host": HOSTS[0],
                    "pid": 4000 + n,
                    "role": role,
                    "rss": int(base + rng.uniform(0, 40 * MIB)),
                    "uss": int(0.8 * base + rng.uniform(0, 40 * MIB)),
                    "cpu_percent": round(rng.uniform(80, 100), 1),
                    "threads": 24,
                    "gpu_memory_bytes": int(36e9 + (8 * MIB * i * 2 if role == "rank 3" else 0))
                    if role.startswith("rank")
                    else None,
                }
            )
    return rows


def loader_rows() -> tuple[list[dict], list[dict]]:
    rows, configs = [], []
    rate = {0: 410.0, 1: 890.0, 2: 1650.0, 4: 2820.0, 8: 2880.0}
    for workers, base in rate.items():
        for prefetch in (2, 4) if workers else (None,):
            for pin in (False, True):
                r = base * (1.0 + (0.01 if prefetch == 4 else 0)) * (1.02 if pin else 1.0)
                cfg = f"w{workers}-p{prefetch}-{'pin' if pin else 'nopin'}"
                settings = {
                    "num_workers": workers,
                    "prefetch_factor": prefetch,
                    "pin_memory": pin,
                    "persistent_workers": workers > 0,
                }
                rows.append(
                    {
                        "schema": 1,
                        "t": T0 + 20 + len(rows),
                        "host": HOSTS[0],
                        "kind": "measure",
                        "sweep": 1,
                        "status": "ok",
                        "config": cfg,
                        "round": 1,
                        "samples_per_s": round(r, 1),
                        "samples": 4096,
                        "elapsed_s": round(4096 / r, 4),
                        "group_s": [round(4096 / r / 8 * (1 + d), 5) for d in (-0.01, 0.0, 0.01, 0.005)] * 2,
                        "batch_bytes": 4 * 4096 * 8,
                        "eligible": workers <= 6,
                        "is_current": cfg == "w4-p2-pin",
                        "batch_latency_p50_ms": round(16000 / r, 2),
                        "batch_latency_p99_ms": round(30000 / r, 2),
                        **settings,
                    }
                )
                configs.append(
                    {
                        **settings,
                        "samples_per_s": round(r, 1),
                        "config": cfg,
                        "rel_se_pct": 1.1,
                        "rounds": [1],
                        "eligible": workers <= 4,
                    }
                )
    return rows, sorted(configs, key=lambda c: -c["samples_per_s"])


def finding(
    probe: str, check: str, verdict: str, summary: str, evidence: dict | None = None, **where
) -> dict:
    return {
        "probe": probe,
        "check": check,
        "verdict": verdict,
        "summary": summary,
        "evidence": evidence or {},
        "where": where,
    }


def findings(configs: list[dict]) -> list[dict]:
    per_size = [
        {
            "bytes": 2**p,
            "ring_time_us": rt,
            "tree_time_us": tt,
            "ring_busbw_gbps": rb,
            "tree_busbw_gbps": tb,
            "faster": "tree" if tt < rt * 0.97 else "ring" if rt < tt * 0.97 else None,
            "within_noise": abs(rt - tt) < 0.03 * rt,
        }
        for p, rt, tt, rb, tb in [
            (22, 65.1, 52.3, 112.7, 140.3),
            (24, 181.4, 155.6, 161.8, 188.6),
            (26, 690.2, 598.8, 170.1, 196.0),
        ]
    ]
    best = next(c for c in configs if c["num_workers"] == 8 and c["pin_memory"] and c["prefetch_factor"] == 4)
    rec = next(c for c in configs if c["num_workers"] == 4 and c["pin_memory"] and c["prefetch_factor"] == 2)
    keys = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers", "samples_per_s")
    return [
        finding("comm", "correctness", "pass", "0 wrong elements in 200 rows"),
        *[
            finding(
                "comm",
                "busbw",
                "pass",
                f"{c}: avg busbw {b:.1f} GB/s",
                {
                    "collective": c,
                    "backend": "nccl",
                    "world_size": WORLD,
                    "avg_busbw_gbps": b,
                    "peak_busbw_gbps": b * 1.8,
                    "max_time_us": mt,
                },
            )
            for c, b, mt in [
                ("all_reduce", 98.2, 2_400_000.0),
                ("all_gather", 77.5, 1_800_000.0),
                ("broadcast", 70.1, 1_900_000.0),
            ]
        ],
        finding(
            "comm",
            "algo_choice",
            "pass",
            "tree faster than ring by 13-24 % at 4-64 MiB",
            {
                "backend": "nccl",
                "nccl_version": "2.26.2",
                "per_size": per_size,
                "bucket_bytes": 25 * MIB,
                "recommended_nccl_algo": "allreduce:tree",
                "reason": "tree beats ring beyond the noise at every size near the 25 MiB buckets",
            },
        ),
        finding(
            "comm",
            "straggler",
            "warn",
            "rank 5 on gpu-node-02 is 14 % slower in all_reduce",
            {"rank": 5, "host": "gpu-node-02", "slowdown_pct": 14.2},
            rank=5,
            host="gpu-node-02",
        ),
        finding(
            "steps",
            "rank_desync",
            "pass",
            "weights agree on 8 ranks at steps 1, 20, 40, 60, 80",
            {"step": 80, "ranks": list(range(WORLD)), "checksums": {}},
        ),
        finding(
            "steps",
            "step_time",
            "warn",
            "rank 5 median step 13 % slower than the median rank",
            {
                "median_step_time_s": {str(r): 0.85 * (1.13 if r == 5 else 1.0) for r in range(WORLD)},
                "slowest_rank": 5,
                "slowdown_pct": 13.0,
            },
            rank=5,
        ),
        finding(
            "memory",
            "memory_leak",
            "fail",
            "rank 3 device memory grows 8.0 MiB/step; out of memory at step ~6000",
            {
                "kind": "device",
                "slope_bytes_per_step": 8 * MIB,
                "growth_mb_per_step": 8.0,
                "r2": 0.998,
                "projected_oom_step": 6020,
                "projected_oom_s": None,
                "limit_bytes": 80e9,
            },
            rank=3,
        ),
        finding(
            "memory",
            "memory_leak",
            "pass",
            "rank 0 device memory flat after warm-up",
            {"kind": "device", "slope_bytes_per_step": 1200.0, "growth_mb_per_step": 0.001, "r2": 0.02},
            rank=0,
        ),
        finding(
            "memory",
            "fragmentation",
            "warn",
            "rank 0: 6.0 GB reserved but unallocated, 2 alloc retries",
            {"reserved_minus_allocated_bytes": 6e9, "inactive_split_bytes": 2.1e9, "alloc_retries": 2},
            rank=0,
        ),
        finding(
            "memory",
            "non_pytorch_device_memory",
            "pass",
            "6.0 GB outside PyTorch, flat",
            {"bytes": 6e9, "growing": False, "slope": 0.0},
            rank=0,
        ),
        finding(
            "memory",
            "empty_cache",
            "pass",
            "no call for empty_cache: memory outside PyTorch is flat",
            {"recommend_periodic_empty_cache": False},
        ),
        finding(
            "stability",
            "loss_spike",
            "warn",
            "loss spike at step 52: 1.6× baseline, recovered after 6 steps",
            {
                "peak": 10.9,
                "baseline": 6.8,
                "magnitude": 1.6,
                "recovered_after_steps": 6,
                "grad_norm_led": True,
            },
            step=52,
        ),
        finding(
            "stability",
            "grad_norm_spike",
            "warn",
            "grad norm spike at step 51: 4.5× baseline",
            {"peak": 9.9, "baseline": 2.2, "magnitude": 4.5, "recovered_after_steps": 1},
            step=51,
        ),
        finding("stability", "divergence", "pass", "no divergence"),
        finding("stability", "nonfinite_loss", "pass", "no NaN/inf loss"),
        finding("stability", "overflow_storm", "pass", "1 skipped step after calibration"),
        finding("stability", "scale_collapse", "pass", "scale steady at 4096"),
        finding(
            "stability",
            "loss_scaler",
            "warn",
            "3 calibration skips from 65536 down to 8192, 1 later skip",
            {
                "precision": "fp16",
                "skipped_total": 4,
                "skipped_after_calibration": 1,
                "calibration_steps": 3,
                "steady_scale": 4096.0,
                "suggested_init_scale": 8192.0,
                "suggest_bf16": False,
            },
        ),
        finding(
            "stability",
            "clipping",
            "warn",
            "91 % of steps clipped at max_norm 1.0",
            {"clip_max_norm": 1.0, "clipped_fraction": 0.91, "suggested_max_norm": 3.1},
        ),
        finding(
            "loader",
            "loader_throughput",
            "pass",
            "recommend num_workers=4 prefetch_factor=2",
            {
                "best": {k: best[k] for k in keys},
                "recommended": {k: rec[k] for k in keys},
                "within_noise_of_best": True,
                "noise_margin_pct": 3.0,
                "knee_workers": 4,
                "current": {
                    "num_workers": 4,
                    "prefetch_factor": 2,
                    "pin_memory": True,
                    "persistent_workers": True,
                },
                "current_samples_per_s": rec["samples_per_s"],
                "lightning_rule_workers": 3,
                "cpu_budget_per_rank": 6,
                "local_world_size": 4,
                "configs": configs,
            },
        ),
        finding(
            "checkpoint",
            "checkpoint_cost",
            "warn",
            "rank-0 save 95 s, others wait 94 s at the barrier",
            {
                "save_s": 95.0,
                "load_s": 41.0,
                "size_bytes": 96e9,
                "barrier_wait_s": 94.0,
                "peak_load_rss_bytes": 101e9,
            },
        ),
        finding(
            "checkpoint",
            "timeout_risk",
            "fail",
            "save 95 s exceeds the process-group timeout 30 s",
            {"save_s": 95.0, "timeout_s": 30.0},
        ),
        finding(
            "checkpoint",
            "resume_mismatch",
            "fail",
            "losses differ from step 41 after resume",
            {"missing": ["GradScaler state", "RNG (torch CUDA)", "sampler epoch"]},
        ),
    ]


def main() -> None:
    rng = random.Random(7)
    spec = {
        "job": {"name": "deepseek-v3-16b", "nodes": 2, "procs_per_node": 4, "steps": 80, "seed": 42},
        "batch": {"per_process": 4, "grad_accum": 8, "reference": 256, "seq_len": 4096},
        "optim": {
            "name": "adamw",
            "base_lr": 3e-4,
            "lr_scaling": "none",
            "weight_decay": 0.1,
            "betas": [0.9, 0.95],
            "clip_max_norm": 1.0,
            "warmup_pct": 0.1,
        },
        "precision": {"mode": "fp16", "init_scale": 65536.0, "growth_interval": 500},
        "dataloader": {
            "num_workers": 4,
            "prefetch_factor": 2,
            "pin_memory": True,
            "persistent_workers": True,
        },
        "distributed": {
            "backend": "nccl",
            "timeout_s": 30.0,
            "bucket_cap_mb": 25.0,
            "env": {"NCCL_ALGO": "Tree"},
        },
        "checkpoint": {"every_steps": 20, "keep": 2},
    }
    meta = {
        "schema": 1,
        "run": "report-gpu-sample",
        "created": T0,
        "tool": {"name": "ciuic-doctor", "version": "0.1.0"},
        "env": {
            "host": HOSTS[0],
            "os": "Linux-5.15.0-x86_64-with-glibc2.35",
            "python": "3.11.9",
            "torch": "2.6.0+cu124",
            "cuda": "12.4",
            "nccl": "2.26.2",
            "cudnn": 90100,
            "cuda_available": True,
            "devices": [
                {"index": i, "name": "NVIDIA H100 80GB HBM3", "total_memory_bytes": 85_000_000_000}
                for i in range(4)
            ],
            "cpu": {"logical": 96, "affinity": 96, "cgroup_quota": 24.0, "usable": 24},
            "world": {"world_size": WORLD, "rank": 0, "local_rank": 0, "local_world_size": 4},
            "env": {
                "NCCL_ALGO": "Tree",
                "NCCL_DEBUG": "WARN",
                "HF_TOKEN": "<redacted>",
                "MASTER_ADDR": "gpu-node-01",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
            },
            "nccl_conf": {},
        },
        "spec": spec,
        "probes": {"comm-bench": {"status": "ok"}, "job": {"status": "ok"}},
    }
    (HERE / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    write_jsonl("comm.jsonl", comm_rows(rng))
    for rank in range(WORLD):
        write_jsonl(f"steps.rank{rank}.jsonl", step_rows(rng, rank))
    write_jsonl("memwatch.jsonl", memwatch_rows(rng))
    loader, configs = loader_rows()
    header = {
        "schema": 1,
        "t": T0 + 19,
        "host": HOSTS[0],
        "kind": "sweep",
        "sweep": 1,
        "batch_size": 4,
        "cpu_budget_per_rank": 6,
        "local_world_size": 4,
        "lightning_rule_workers": 3,
        "current": {"num_workers": 4, "prefetch_factor": 2, "pin_memory": True, "persistent_workers": True},
    }
    write_jsonl("loader.jsonl", [header, *loader])
    write_jsonl(
        "checkpoint.jsonl",
        [
            {
                "schema": 1,
                "t": T0 + 300,
                "host": HOSTS[0],
                "rank": 0,
                "step": 20,
                "save_s": 95.0,
                "load_s": 41.0,
                "size_bytes": 96_000_000_000,
                "barrier_wait_s": 94.0,
            }
        ],
    )
    (HERE / "findings.json").write_text(
        json.dumps(
            {"schema": 1, "created": T0 + 400, "analyses": ["recorded"], "findings": findings(configs)},
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
