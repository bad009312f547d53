"""The ranks' side of `comm-bench --splits-from RUN`: time all_to_all_single with the recorded routing's
split sizes and with equal splits of the same volume (plans from probes/comm/splits.py), layer by layer,
even and routed alternating, and write one comm record per (layer, splits) from rank 0.

Records: collective "all_to_all", `splits` "routed" | "even", `layer`, `bytes` (the mean bytes a rank
sends), `max_send_bytes` / `max_recv_bytes` (the busiest rank), time_us (mean over ranks of loop time /
iters, as nccl-tests), time_us_max, p50 / p99 over iterations of the slowest rank, algbw / busbw on the
mean bytes, #wrong.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from ciuic_doctor.measures.student import paired_ratio
from ciuic_doctor.probes.comm.bench import Bench
from ciuic_doctor.probes.comm.collectives import DTYPES, elem_bytes
from ciuic_doctor.probes.comm.measure import RankResult, sync, time_op, timing_figures
from ciuic_doctor.probes.comm.splits import SplitPlan, plan_from_run

ROUNDS = 4  # timed loops per splits mode and layer (after one warm-up round), even and routed alternating


class SplitsBench(Bench):
    """comm-bench's rank, sweeping recorded MoE dispatch splits instead of message sizes."""

    ratios: dict[int, tuple[float, float, float] | None]

    def sweep(self) -> None:
        self.ratios = {}
        plans: list[Any] = [None]
        if self.rank == 0:
            plans[0] = [p.to_dict() for p in plan_from_run(self.cfg.splits_from, self.world)]
        dist.broadcast_object_list(plans, src=0, group=self.control)
        layers = [SplitPlan(**p) for p in plans[0]]
        if layers and layers[0].hidden_source != "recorded":
            self.say(f"# token size: {layers[0].hidden_source}")
        self.say(
            f"# comm-bench --splits-from {self.cfg.splits_from}: all_to_all_single on {self.world} ranks "
            f"({self.backend}, {self.cfg.dtype}), {len(layers)} MoE layer(s), experts placed on ranks in "
            f"contiguous blocks; records -> {self.path / 'comm.jsonl'}"
        )
        if not layers:
            self.not_run["all_to_all"] = f"no recorded layer has at least {self.world} experts"
            self.say(f"# nothing to measure: {self.not_run['all_to_all']}")
            return
        self.say(
            f"# {'layer':>5} {'router':<28} {'MB/rank':>8} {'even p50 us':>11} {'routed p50 us':>13} "
            f"{'ratio':>6} {'95 % CI':>13}"
        )
        for plan in layers:
            results: dict[str, list[RankResult]] = {"even": [], "routed": []}
            for round_no in range(ROUNDS + 1):  # interleaved, the order flipping: drift hits both alike
                for mode in ("even", "routed") if round_no % 2 == 0 else ("routed", "even"):
                    result = self.time_mode(plan, mode)
                    if round_no:  # round 0 warms up the pairs' connections and buffers
                        results[mode].append(result)
            figures = {mode: self.record(plan, mode, results[mode]) for mode in ("even", "routed")}
            if self.rank != 0:
                continue
            # medians of the iterations: a shared machine's stalls land in the means, not in the medians
            even, routed = figures["even"], figures["routed"]
            paired = paired_ratio(even["round_p50_us"], routed["round_p50_us"])
            self.ratios[plan.layer] = paired
            shown = f"{paired[0]:>6.2f} {paired[1]:>6.2f}–{paired[2]:<6.2f}" if paired else f"{'—':>6}"
            self.say(
                f"  {plan.layer:>5} {plan.name[-28:]:<28} {routed['bytes'] / 2**20:>8.2f} "
                f"{even['time_us_p50']:>11.1f} {routed['time_us_p50']:>13.1f} {shown}"
            )

    def time_mode(self, plan: SplitPlan, mode: str) -> RankResult:
        """One timed loop of `mode`'s splits on this rank."""
        self.watch.step(f"all_to_all layer {plan.layer} {mode} splits")
        return _time_splits(
            plan.routed if mode == "routed" else plan.even, rank=self.rank, world=self.world,
            dtype=self.cfg.dtype, device=self.device, group=None, control=self.control, bench=self,
        )  # fmt: skip

    def record(self, plan: SplitPlan, mode: str, rounds: list[RankResult]) -> dict[str, Any]:
        """Every round of `mode` on this rank as one result, gathered to rank 0 and written there."""
        matrix = plan.routed if mode == "routed" else plan.even
        mine = RankResult(
            time_s=sum(r.time_s for r in rounds),
            iters=sum(r.iters for r in rounds),
            durations_us=[d for r in rounds for d in r.durations_us],
            wrong=sum(r.wrong for r in rounds),
        )
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self.control)
        # each round's median on this rank; the round's time is its slowest rank's (all wait for it)
        per_round = [statistics.median(r.durations_us) if r.durations_us else None for r in rounds]
        rounds_gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(per_round, rounds_gathered, dst=0, group=self.control)
        self.rows += 1
        if gathered is None:
            return {}
        size = elem_bytes(self.cfg.dtype)
        record = _figures(gathered, matrix, size, self.hosts)
        record.update(
            collective="all_to_all", algo="default", backend=self.backend, dtype=self.cfg.dtype,
            world_size=self.world, status="ok", inplace=False, splits=mode, layer=plan.layer,
            router=plan.name, experts=plan.experts, hidden=plan.hidden, imbalance=plan.imbalance,
            hidden_source=plan.hidden_source, round_p50_us=_slowest_per_round(rounds_gathered or []),
        )  # fmt: skip
        self.writer.write(record)
        self.records.append(record)
        self.wrong_total += record["wrong"]
        return record

    def summary(self) -> str:
        line = f"# {self.rows} rows, {self.wrong_total} wrong elements, in {self.path / 'comm.jsonl'}"
        judged = {layer: r for layer, r in self.ratios.items() if r is not None}
        costly = {layer: r for layer, r in judged.items() if r[1] > 1.0}  # the whole interval above 1
        if costly:
            layer, (ratio, low, high) = max(costly.items(), key=lambda kv: kv[1][1])
            line += (
                f"\n# the recorded routing costs layer {layer} {ratio:.2f}x the time of equal splits "
                f"(95 % CI {low:.2f}–{high:.2f}x over {ROUNDS} paired rounds)"
            )
        elif judged:
            widest = max(max(high, 1 / low) for _, low, high in judged.values())
            line += (
                f"\n# no measurable cost of the recorded routing: every layer's 95 % interval holds 1.00x "
                f"(the rounds exclude only changes beyond {widest:.2f}x; more rounds would tell)"
            )
        return line


def _time_splits(
    matrix: list[list[int]], *, rank: int, world: int, dtype: str, device: torch.device, group: Any,
    control: Any, bench: Bench,
) -> RankResult:  # fmt: skip
    send = [matrix[rank][d] for d in range(world)]
    recv = [matrix[s][rank] for s in range(world)]
    kind = DTYPES[dtype]
    source = torch.full((sum(send),), float(rank), dtype=torch.float32, device=device).to(kind)
    out = torch.empty(sum(recv), dtype=kind, device=device)

    def op() -> None:
        dist.all_to_all_single(out, source, output_split_sizes=recv, input_split_sizes=send, group=group)

    iters, elapsed, marks = time_op(
        op, timing=bench.timing, device=device, control=control, tick=bench.watch.tick, min_warmup=1
    )
    out.fill_(-1)
    op()
    sync(device)
    wrong = 0
    for s, block in enumerate(out.to(torch.float32).split(recv)):
        wrong += int((block != float(s)).sum())
    return RankResult(time_s=elapsed, iters=iters, durations_us=marks.durations_us(), wrong=wrong)


def _slowest_per_round(gathered: list[Any]) -> list[float]:
    """Per round, the slowest rank's median iteration (µs): what the collective took that round."""
    rounds = [r for r in gathered if isinstance(r, list)]
    if not rounds:
        return []
    return [max(v for v in column if v is not None) for column in zip(*rounds, strict=False) if any(column)]


def _figures(
    results: list[RankResult], matrix: list[list[int]], elem: int, hosts: list[str]
) -> dict[str, Any]:
    n = len(results)
    send = [sum(row) * elem for row in matrix]
    recv = [sum(matrix[s][d] for s in range(n)) * elem for d in range(n)]
    mean_bytes = sum(send) // n
    return {
        "bytes": mean_bytes,
        "count": mean_bytes // elem,
        "max_send_bytes": max(send),
        "max_recv_bytes": max(recv),
        **timing_figures(results, mean_bytes, (n - 1) / n, hosts),
    }
