"""DataLoader throughput sweep: measured num_workers / prefetch_factor (/ pin_memory) for one rank's CPUs.

No widely used tuner exists for these settings (PyTorch and Lightning only warn by CPU count, and neither
counts a cgroup quota), so this measures them on the user's dataset and node. The grid is
num_workers × prefetch_factor (× pin_memory where an accelerator exists); every configuration is a
real DataLoader measured in a watched child process (`loader_measure`).

Within the time budget the sweep does not run the whole grid at full length: it uses successive halving
(Jamieson & Talwalkar 2016). Round 0 measures every configuration for a short window; each round keeps
the best 1/eta (eta = 3) by `analysis.loader.halving_order` — those within noise of the leader, cheapest
first — and measures the survivors again with a window eta times longer. Measurements of one
configuration pool across rounds. Windows are planned from the budget and the overheads measured so far;
no measurement starts after the budget is spent.

Records (stream `loader`, one line each, flushed as made): `kind=sweep` (the header: dataset, CPU budget,
grid, current settings, /dev/shm), `kind=measure` (one per configuration per round, with its `round`),
`kind=round` (who was kept and dropped), `kind=end`.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.probes.loader_measure import LoaderConfig, Plan, measure

from ciuic_doctor.analysis.loader import halving_order, pool
from ciuic_doctor.store import RunDir

PROBE = "loader-sweep"
WORKER_LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DEFAULT_PREFETCH = (2, 4)  # PyTorch's default 2, and 4 for bursty per-sample costs
ETA = 3  # keep a third per round: three rounds cover up to 27 configurations
MIN_WINDOW_S = 0.15  # below this a window holds too few batches to rank anything
OVERHEAD_GUESS_S = 0.3  # fork + worker start + warm-up, before the first measurement says otherwise
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


def plan_window(remaining_s: float, n: int, overhead_s: float, eta: int = ETA) -> float:
    """The window of the next round so the rest of the halving schedule fits `remaining_s`: round k
    (from now) measures ceil(n / eta^k) configurations for window × eta^k seconds each, plus the
    per-measurement overhead."""
    counts = [n]
    while math.ceil(counts[-1] / eta) > 1:
        counts.append(math.ceil(counts[-1] / eta))
    weight = sum(c * eta**i for i, c in enumerate(counts))
    return (remaining_s * BUDGET_USE - overhead_s * sum(counts)) / weight


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
    strategy: str = "halving"  # or "grid": every configuration once, window `grid_window_s`
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
            window = s.grid_window_s or max(
                MIN_WINDOW_S, s.budget_s * BUDGET_USE / len(configs) - OVERHEAD_GUESS_S
            )
        else:
            window = max(MIN_WINDOW_S, plan_window(s.budget_s, len(configs), OVERHEAD_GUESS_S, s.eta))
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
                    "first_window_s": round(window, 4),
                },
            )
            try:
                while True:
                    measured = self._round(writer, survivors, round_no, total_rounds, window)
                    if s.strategy == "grid":
                        break
                    alive = [
                        p
                        for p in halving_order(list(pool(self._measures()).values()))
                        if p.config in {c.id for c in measured}
                    ]
                    # Over-budget configurations (the job's current one) are measured once, never kept.
                    eligible = [p for p in alive if p.eligible]
                    if len(eligible) <= 1:
                        survivors = [c for c in measured if any(p.config == c.id for p in eligible)]
                        break
                    keep = {p.config for p in eligible[: math.ceil(len(eligible) / s.eta)]}
                    survivors = [c for c in configs if c.id in keep]
                    window_next = self._next_window(len(survivors), window) if len(keep) > 1 else 0.0
                    self._write(
                        writer,
                        {
                            "kind": "round",
                            "round": round_no,
                            "window_s": round(window, 4),
                            "kept": sorted(keep),
                            "dropped": [c.id for c in measured if c.id not in keep],
                            "next_window_s": round(window_next, 4),
                        },
                    )
                    if len(keep) <= 1:
                        self.progress(f"round {round_no + 1} done: {next(iter(keep))} is left")
                        break
                    self.progress(
                        f"round {round_no + 1} done: kept {', '.join(sorted(keep))} "
                        f"({len(keep)} of {len(measured)}); next window {window_next:.2f} s"
                    )
                    if window_next < MIN_WINDOW_S or self.elapsed() >= s.budget_s:
                        stopped = "budget"
                        break
                    window, round_no = window_next, round_no + 1
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

    def _next_window(self, n: int, window: float) -> float:
        """Plan from the overheads measured so far (child wall time minus its window)."""
        overheads = [
            float(r["wall_s"]) - float(r.get("window_wall_s") or 0.0)
            for r in self._measures()
            if r.get("status") == "ok"
        ]
        overhead = statistics.median(overheads) if overheads else OVERHEAD_GUESS_S
        planned = plan_window(self.settings.budget_s - self.elapsed(), n, overhead, self.settings.eta)
        return min(planned, window * self.settings.eta)

    def _round(
        self, writer: Any, configs: list[LoaderConfig], round_no: int, total_rounds: int, window: float
    ) -> list[LoaderConfig]:
        s = self.settings
        measured = []
        for index, cfg in enumerate(configs, 1):
            base = {
                "kind": "measure",
                "round": round_no,
                **cfg.as_record(),
                "over_budget": cfg.num_workers > s.cpu_budget_per_rank,
                "eligible": s.eligible(cfg),
                "is_current": cfg == s.current,
                "window_s": round(window, 4),
                "started_s": round(self.elapsed(), 4),
            }
            if self.elapsed() >= s.budget_s:
                self._write(writer, {**base, "status": "skipped", "error": "time budget spent"})
                continue
            plan = Plan(
                batch_size=s.batch_size,
                window_s=window,
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
        head = f"[{bar}] {self.elapsed():5.1f}/{self.settings.budget_s:g} s  round {round_no + 1}/{rounds}"
        head += f"  {i}/{n}  {cfg.id:<12}"
        if r["status"] != "ok":
            return f"{head} {r['status'].upper()}: {r.get('error')}"
        return (
            f"{head} {r['samples_per_s']:9.1f} samples/s  wait p50 {r['batch_latency_p50_ms']:.1f} "
            f"p99 {r['batch_latency_p99_ms']:.1f} ms  epoch start {r['epoch_start_s']:.2f} s"
        )
