"""DataLoader throughput sweep: measured num_workers / prefetch_factor (/ pin_memory) for one rank's CPUs.

No widely used tuner exists for these settings (PyTorch and Lightning only warn by CPU count, and neither
counts a cgroup quota), so this measures them on the user's dataset and node. The grid is
num_workers × prefetch_factor (× pin_memory where an accelerator exists); every configuration is a
real DataLoader measured in a watched child process (`loader_measure`).

Within the time budget the sweep does not run the whole grid at full length: it uses successive halving
(Jamieson & Talwalkar 2016). Round 0 measures every configuration in a short time slot; each round keeps
the best 1/eta (eta = 3) by rate, plus the cheapest configuration within noise of the leader (the one
the analysis would recommend; `measures.loader_pool.halving_keep`), and measures the survivors again with a
slot eta times longer. Measurements of one configuration pool across rounds. A slot covers the whole
measurement (worker start-up and warm-up included, which differ between configurations and are unknown
beforehand), so the schedule is planned in slots from the remaining budget and what earlier slots
overran; no measurement starts after the budget is spent.

Records (stream `loader`, one line each, flushed as made): `kind=sweep` (the header: dataset, CPU budget,
grid, current settings, /dev/shm), `kind=measure` (one per configuration per round, with its `round`),
`kind=round` (who was kept and dropped), `kind=end`.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.measures.loader_pool import halving_keep, pool
from ciuic_doctor.probes.loader.measure import LoaderConfig, Plan, measure
from ciuic_doctor.rundir.store import RunDir

PROBE = "loader-sweep"
WORKER_LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DEFAULT_PREFETCH = (2, 4)  # PyTorch's default 2, and 4 for bursty per-sample costs
ETA = 3  # keep a third per round: three rounds cover up to 27 configurations
MIN_SLOT_S = 0.3  # a slot shorter than this is mostly start-up and warm-up: nothing left to rank by
OVERRUN_GUESS_S = 0.1  # fork, reap, and windows ending on whole groups, until measurements say otherwise
BUDGET_USE = 0.9  # plan for 90 % of the budget: windows end on whole groups, which overshoots a little


def default_workers(cpu_budget_per_rank: int) -> list[int]:
    """0, 1, 2, 3, 4, 6, 8, 12, ... up to the budget, and the budget itself.

    >>> default_workers(5)
    [0, 1, 2, 3, 4, 5]
    >>> default_workers(16)
    [0, 1, 2, 3, 4, 6, 8, 12, 16]
    """
    return sorted({w for w in WORKER_LADDER if w <= cpu_budget_per_rank} | {max(0, cpu_budget_per_rank)})


def lightning_rule(affinity: int, local_world_size: int) -> int:
    """Lightning's suggestion, max(1, cpus // local_world_size - 1) (cpus from sched_getaffinity)."""
    return max(1, affinity // local_world_size - 1)


def rounds_needed(n: int, eta: int = ETA) -> int:
    """Rounds until one configuration is left when each keeps ceil(n / eta).

    >>> [rounds_needed(n) for n in (1, 2, 3, 4, 9, 10, 27)]
    [0, 1, 1, 2, 2, 3, 3]
    """
    return 0 if n <= 1 else 1 + rounds_needed(math.ceil(n / eta), eta)


def plan_slot(remaining_s: float, n: int, overrun_s: float, eta: int = ETA) -> float:
    """The slot of the next round so the rest of the halving schedule fits `remaining_s`: round k (from
    now) measures ceil(n / eta^k) configurations in slots of slot × eta^k seconds, each overrunning its
    slot by `overrun_s`."""
    counts = [n]
    while math.ceil(counts[-1] / eta) > 1:
        counts.append(math.ceil(counts[-1] / eta))
    weight = sum(c * eta**i for i, c in enumerate(counts))
    return (remaining_s * BUDGET_USE - overrun_s * sum(counts)) / weight


@dataclass(kw_only=True)
class SweepSettings:
    batch_size: int
    workers: list[int]
    prefetch: list[int] = field(default_factory=lambda: list(DEFAULT_PREFETCH))
    pin_options: tuple[bool, ...] = (False,)
    budget_s: float = 60.0
    timeout_s: float = 60.0
    step_ms: float = 0.0
    cpu_budget_per_rank: int = 1
    local_world_size: int = 1
    explicit_workers: bool = False  # --workers given: counts above the budget were asked for
    current: LoaderConfig | None = None
    strategy: str = "halving"  # or "grid": every configuration once (window `grid_window_s` if given)
    grid_window_s: float | None = None
    eta: int = ETA
    min_groups: int = 3
    device: str | None = None
    seed: int = 0

    def eligible(self, cfg: LoaderConfig) -> bool:
        """May be recommended: inside the CPU budget, or a worker count the user asked for by name."""
        asked = self.explicit_workers and cfg.num_workers in self.workers
        return cfg.num_workers <= self.cpu_budget_per_rank or asked


@dataclass(kw_only=True)
class SweepResult:
    sweep: str
    elapsed_s: float
    measurements: int
    stopped: str
    finalists: list[str]
    records: list[dict[str, Any]] = field(default_factory=list)


def candidates(settings: SweepSettings) -> list[LoaderConfig]:
    """The grid plus the job's current configuration, cheapest first."""
    grid = {
        LoaderConfig(num_workers=w, prefetch_factor=p if w else None, pin_memory=pin)
        for w in settings.workers
        for p in settings.prefetch
        for pin in settings.pin_options
    }
    if settings.current is not None:
        grid.add(settings.current)
    return sorted(grid, key=lambda c: (c.num_workers, c.prefetch_factor or 0, c.pin_memory))


def shm_usage(path: str = "/dev/shm") -> tuple[int | None, int | None]:
    """(free, total) bytes of the shared-memory filesystem DataLoader workers pass batches through."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None, None
    return usage.free, usage.total


class Sweep:
    """One sweep over one dataset; `run()` measures and writes every record as it is made."""

    def __init__(
        self,
        run: RunDir,
        dataset: Any,
        settings: SweepSettings,
        *,
        header: dict[str, Any],
        progress: Callable[[str], None] = print,
    ) -> None:
        self.run_dir = run
        self.dataset = dataset
        self.settings = settings
        self.header = header
        self.progress = progress
        self.sweep_id = f"{int(time.time() * 1000):x}-{os.getpid()}"
        self.records: list[dict[str, Any]] = []
        self.t0 = 0.0

    def _write(self, writer: Any, record: dict[str, Any]) -> None:
        record = {"sweep": self.sweep_id, **record}
        writer.write(record)
        self.records.append(record)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def run(self) -> SweepResult:
        s = self.settings
        configs = candidates(s)
        self.t0 = time.perf_counter()
        total_rounds = 1 if s.strategy == "grid" else max(1, rounds_needed(len(configs), s.eta))
        if s.strategy == "grid":
            slot = max(MIN_SLOT_S, s.budget_s * BUDGET_USE / len(configs) - OVERRUN_GUESS_S)
        else:
            slot = max(MIN_SLOT_S, plan_slot(s.budget_s, len(configs), OVERRUN_GUESS_S, s.eta))
        stopped, survivors, round_no = "done", configs, 0
        with self.run_dir.writer("loader") as writer:
            self._write(
                writer,
                {
                    "kind": "sweep",
                    **self.header,
                    "strategy": s.strategy,
                    "eta": s.eta,
                    "configs": [c.id for c in configs],
                    "first_slot_s": round(slot, 4),
                },
            )
            try:
                while True:
                    measured = self._round(writer, survivors, round_no, total_rounds, slot)
                    if s.strategy == "grid":
                        break
                    measured_ids = {c.id for c in measured}
                    alive = [p for p in pool(self._measures()).values() if p.config in measured_ids]
                    # Over-budget configurations (the job's current one) are measured once, never kept.
                    eligible = [p for p in alive if p.eligible]
                    if len(eligible) <= 1:
                        survivors = [c for c in measured if any(p.config == c.id for p in eligible)]
                        break
                    keep = {p.config for p in halving_keep(eligible, s.eta)}
                    survivors = [c for c in configs if c.id in keep]
                    slot_next = self._next_slot(len(survivors), slot) if len(keep) > 1 else 0.0
                    self._write(
                        writer,
                        {
                            "kind": "round",
                            "round": round_no,
                            "slot_s": round(slot, 4),
                            "kept": sorted(keep),
                            "dropped": [c.id for c in measured if c.id not in keep],
                            "next_slot_s": round(slot_next, 4),
                        },
                    )
                    if len(keep) <= 1:
                        self.progress(f"round {round_no + 1} done: {next(iter(keep))} is left")
                        break
                    self.progress(
                        f"round {round_no + 1} done: kept {', '.join(sorted(keep))} "
                        f"({len(keep)} of {len(measured)}); next slot {slot_next:.2f} s"
                    )
                    if slot_next < MIN_SLOT_S or self.elapsed() >= s.budget_s:
                        stopped = "budget"
                        break
                    slot, round_no = slot_next, round_no + 1
            except KeyboardInterrupt:
                stopped = "interrupted"
                raise
            finally:
                finalists = [c.id for c in survivors]
                self._write(
                    writer,
                    {
                        "kind": "end",
                        "elapsed_s": round(self.elapsed(), 3),
                        "stopped": stopped,
                        "measurements": len(self._measures()),
                        "rounds": round_no + 1,
                        "finalists": finalists,
                    },
                )
        return SweepResult(
            sweep=self.sweep_id,
            elapsed_s=self.elapsed(),
            measurements=len(self._measures()),
            stopped=stopped,
            finalists=finalists,
            records=self.records,
        )

    def _measures(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == "measure"]

    def _next_slot(self, n: int, slot: float) -> float:
        """Plan the rest from the remaining budget and how far measurements overran their slots."""
        overruns = [
            max(0.0, float(r["wall_s"]) - float(r["slot_s"]))
            for r in self._measures()
            if r.get("status") == "ok" and r.get("slot_s")
        ]
        overrun = statistics.median(overruns) if overruns else OVERRUN_GUESS_S
        planned = plan_slot(self.settings.budget_s - self.elapsed(), n, overrun, self.settings.eta)
        return min(planned, slot * self.settings.eta)

    def _round(
        self, writer: Any, configs: list[LoaderConfig], round_no: int, total_rounds: int, slot: float
    ) -> list[LoaderConfig]:
        s = self.settings
        measured = []
        fixed_window = s.strategy == "grid" and s.grid_window_s is not None
        # A shuffled order, so a load that drifts during a round does not always favour the same end
        # of the grid (on a shared node it drifts by 2x within a minute).
        order = list(configs)
        random.Random(s.seed * 1000 + round_no).shuffle(order)
        for index, cfg in enumerate(order, 1):
            base = {
                "kind": "measure",
                "round": round_no,
                **cfg.as_record(),
                "over_budget": cfg.num_workers > s.cpu_budget_per_rank,
                "eligible": s.eligible(cfg),
                "is_current": cfg == s.current,
                "slot_s": None if fixed_window else round(slot, 4),
                "started_s": round(self.elapsed(), 4),
            }
            if self.elapsed() >= s.budget_s:
                self._write(writer, {**base, "status": "skipped", "error": "time budget spent"})
                continue
            plan = Plan(
                batch_size=s.batch_size,
                window_s=s.grid_window_s if fixed_window else None,
                slot_s=None if fixed_window else slot,
                min_groups=s.min_groups,
                timeout_s=s.timeout_s,
                step_ms=s.step_ms,
                device=s.device,
                seed=s.seed + round_no,
            )
            result = measure(self.dataset, cfg, plan)
            self._write(writer, {**base, **result})
            self.progress(
                self._line(result, cfg, round_no=round_no, rounds=total_rounds, i=index, n=len(configs))
            )
            if result["status"] == "ok":
                measured.append(cfg)
        return measured

    def _line(
        self, r: dict[str, Any], cfg: LoaderConfig, *, round_no: int, rounds: int, i: int, n: int
    ) -> str:
        used = min(1.0, self.elapsed() / self.settings.budget_s)
        bar = "#" * round(10 * used) + "." * (10 - round(10 * used))
        budget = f"/{self.settings.budget_s:g}" if self.settings.strategy != "grid" else ""  # a grid has none
        head = f"[{bar}] {self.elapsed():5.1f}{budget} s  round {round_no + 1}/{rounds}"
        head += f"  {i}/{n}  {cfg.id:<12}"
        if r["status"] != "ok":
            return f"{head} {r['status'].upper()}: {r.get('error')}"
        return (
            f"{head} {r['samples_per_s']:9.1f} samples/s  wait p50 {r['batch_latency_p50_ms']:.1f} "
            f"p99 {r['batch_latency_p99_ms']:.1f} ms  epoch start {r['epoch_start_s']:.2f} s"
        )
