"""A fast generator of large runs: N ranks × S steps of watch's step records, with planted problems.

Used by the scale tests and by `benchmarks/report_scale.py`. Running 1,024 real ranks is out of reach on
a 2-core machine, so the records are written directly, to the same fields watch writes
(probes/watch/session.py):
`schema, t, host, rank, step, step_time_s, pre_backward_s, loss, lr, grad_norm, skipped, rss, uss`, and a
`weights_checksum` every CHECKSUM_EVERY steps.

The timing model is DDP's: a rank's own pace is its time before backward (`pre_backward_s`); every rank's
step then ends together, after the slowest rank's pace plus backward and the all-reduce, so `step_time_s`
is (almost) the same on every rank. Planted, each optional:

- `straggler`: one rank whose pace is `straggler_pct` % slower from the middle of the run on;
- `slow_host`: every rank of one host `slow_host_pct` % slower for the whole run (a host problem);
- `leak`: one rank whose RSS grows `leak_mib_per_step` MiB per step.

>>> plan = Plan(ranks=16, steps=40, ranks_per_host=8)
>>> plan.host_of(9), plan.straggler_rank, plan.leak_rank
('node-001', 11, 6)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MIB = 2**20
T0 = 1_760_000_000.0
CHECKSUM_EVERY = 50
STEP_BLOCK_RANKS = 64  # GPU ranks whose step lines are formatted in one go (~64 MB of text at 2,000 steps)


@dataclass(kw_only=True)
class Plan:
    ranks: int
    steps: int
    ranks_per_host: int = 8
    straggler: bool = True
    straggler_pct: float = 15.0
    slow_host: bool = True
    slow_host_pct: float = 20.0
    leak: bool = True
    leak_mib_per_step: float = 1.0
    pace_s: float = 0.30  # data + forward
    backward_s: float = 0.55  # backward + gradient all-reduce
    noise_pct: float = 2.0  # per-step jitter of a rank's pace (σ)
    seed: int = 7
    # what a CUDA job writes on top (tests/gpusynth.py): allocator fields, USS every 10th step, ...
    gpu: bool = False
    reserved_grower: bool = False  # one rank whose allocator cache grows while allocated stays flat
    grower_mib_per_step: float = 0.5
    memwatch: bool = False  # memwatch's samples of every host's agent and ranks, NVML figures included
    memwatch_interval_s: float = 1.0
    comm: bool = False  # a comm-bench table of the job's world

    def host_of(self, rank: int) -> str:
        return f"node-{rank // self.ranks_per_host:03d}"

    @property
    def straggler_rank(self) -> int | None:
        return (self.ranks * 2) // 3 + 1 if self.straggler else None

    @property
    def straggler_from_step(self) -> int:
        return self.steps // 2

    @property
    def slow_host_name(self) -> str | None:
        hosts = -(-self.ranks // self.ranks_per_host)
        return self.host_of((hosts // 2) * self.ranks_per_host) if self.slow_host and hosts > 2 else None

    @property
    def leak_rank(self) -> int | None:
        return self.ranks // 3 + 1 if self.leak else None

    @property
    def grower_rank(self) -> int | None:
        return (self.ranks * 5) // 6 + 1 if self.reserved_grower and self.gpu else None

    @property
    def slow_host_ranks(self) -> list[int]:
        name = self.slow_host_name
        return [r for r in range(self.ranks) if self.host_of(r) == name] if name else []


def gpu_plan(ranks: int, steps: int) -> Plan:
    """What watch, memwatch and comm-bench write on a CUDA job, with a straggler from mid-run, a leaking
    rank and a reserved-memory grower planted (no slow host: the issue 25 benchmark's job)."""
    return Plan(
        ranks=ranks, steps=steps, gpu=True, reserved_grower=True, memwatch=True, comm=True, slow_host=False
    )


def generate(path: Path, plan: Plan) -> Path:
    """Write steps.rank<R>.jsonl for every rank of `plan` (and a meta.json) into `path`."""
    import numpy as np

    from tests import gpusynth

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(plan.seed)
    steps = np.arange(1, plan.steps + 1)
    factor = np.ones((plan.ranks, plan.steps))
    if plan.straggler_rank is not None:
        factor[plan.straggler_rank, steps >= plan.straggler_from_step] *= 1 + plan.straggler_pct / 100
    for rank in plan.slow_host_ranks:
        factor[rank] *= 1 + plan.slow_host_pct / 100
    pace = plan.pace_s * factor * (1 + rng.normal(0, plan.noise_pct / 100, factor.shape))
    step_time = pace.max(axis=0) + plan.backward_s  # everyone waits for the slowest in the all-reduce
    loss = 10.8 * np.exp(-steps / (plan.steps / 4)) + 2.2
    lr = 3e-4 * np.minimum(1.0, steps / 100)
    pending: list[dict] = []  # ranks whose lines are formatted together (tests/synthtext.py)
    for rank in range(plan.ranks):
        host = plan.host_of(rank)
        t = T0 + np.cumsum(step_time) + rank * 1e-4
        jitter = rng.normal(0, 0.002, plan.steps)
        rss = 9e9 + rank * 1e5 + rng.uniform(0, 8 * MIB, plan.steps)
        if rank == plan.leak_rank:
            rss = rss + plan.leak_mib_per_step * MIB * steps
        uss = rss - 1.5e9
        rank_loss = loss + rng.normal(0, 0.02, plan.steps)
        grad = 1.1 + rng.normal(0, 0.05, plan.steps)
        if plan.gpu:
            columns = {
                "t": t, "step_time_s": step_time + jitter, "pre_backward_s": pace[rank], "loss": rank_loss,
                "lr": lr, "grad_norm": 0.5 * grad, "rss": rss, "uss": uss,  # below clip_max_norm 1.0
            }  # fmt: skip
            pending.append(gpusynth.step_columns(plan, rank, columns, rng))
            if len(pending) == STEP_BLOCK_RANKS or rank == plan.ranks - 1:
                for entry, body in zip(pending, gpusynth.step_texts(plan, pending), strict=True):
                    (path / f"steps.rank{entry['rank']}.jsonl").write_bytes(body)
                pending.clear()
            continue
        lines = []
        for i, step in enumerate(steps.tolist()):
            checksum = (
                f',"weights_checksum":{1234.5 + step * 0.25!r}'
                if step == 1 or step % CHECKSUM_EVERY == 0
                else ""
            )
            lines.append(
                f'{{"schema":1,"t":{t[i]:.4f},"host":"{host}","rank":{rank},"step":{step},'
                f'"step_time_s":{step_time[i] + jitter[i]:.5f},"pre_backward_s":{pace[rank, i]:.5f},'
                f'"loss":{rank_loss[i]:.5f},"lr":{lr[i]:.6g},"grad_norm":{grad[i]:.4f},'
                f'"grad_norm_source":"clip_grad_norm_","skipped":false,"backward_calls":1,'
                f'"rss":{int(rss[i])},"uss":{int(uss[i])}{checksum}}}\n'
            )
        (path / f"steps.rank{rank}.jsonl").write_text("".join(lines))

    def ends_of(rank: int) -> np.ndarray:
        return T0 + np.cumsum(step_time) + rank * 1e-4

    def rss_of(rank: int, step: np.ndarray) -> np.ndarray:
        leak = plan.leak_mib_per_step * MIB * step if rank == plan.leak_rank else 0.0
        return 9e9 + rank * 1e5 + 4 * MIB + leak

    gpusynth.write_streams(path, plan, ends_of, rss_of, rng)
    meta = {
        "schema": 1,
        "run": path.name,
        "created": T0,
        "tool": {"name": "ciuic-doctor", "version": "synthetic"},
        "source": "tests/scalesynth.py",
        "probes": {"watch": {"status": "ok"}},
    }
    if plan.gpu:
        meta["env"] = {"devices": [{"name": "H100", "total_memory_bytes": gpusynth.DEVICE_TOTAL_BYTES}]}
    if plan.memwatch:
        meta["probes"]["memwatch"] = {"status": "ok"}
    if plan.comm:
        meta["probes"]["comm-bench"] = {"status": "ok", "config": {}}
    (path / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path
