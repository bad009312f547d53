"""The loader sweep's pooled estimate of each DataLoader configuration and its noise rule.

Shared by the sweep (probes/loader/sweep.py drops configurations between rounds of successive halving)
and the judgement (analysis/loader.py), so that the sweep drops exactly what the report would not
recommend. Pure functions of loader records: no torch, no pandas.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.rundir.store import as_float

# Two throughputs closer than 3 % are not told apart: repeated windows of one configuration on a shared
# node differ by a few per cent. Wider when the windows themselves scatter (2 standard errors).
NOISE_FLOOR = 0.03
NOISE_SIGMAS = 2.0
# Windows that scatter by more than this cannot rank anything (seen on 2 cores shared by busy
# neighbours): the margin is capped here, so a config 5x slower is never "within noise", and the finding
# says the measurement was noisy instead.
MAX_NOISE_MARGIN = 0.25
PERSISTENT_SAVING_MIN_S = 0.01  # a persistent-workers saving smaller than 10 ms per epoch is not worth it


@dataclass(kw_only=True)
class Pooled:
    """Every ok measurement of one configuration across rounds, pooled into one estimate."""

    config: str
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    eligible: bool = True
    over_budget: bool = False
    is_current: bool = False
    samples: int = 0
    elapsed_s: float = 0.0
    group_s: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    epoch_start_s: list[float] = field(default_factory=list)
    persistent_restart_s: list[float] = field(default_factory=list)
    batch_bytes: int = 0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def rel_se(self) -> float:
        """Relative standard error of the rate, from the scatter of the per-group durations."""
        if len(self.group_s) < 2:
            return 0.5  # one group says nothing about noise: treat it as very uncertain
        mean = statistics.fmean(self.group_s)
        return statistics.stdev(self.group_s) / (mean * math.sqrt(len(self.group_s))) if mean > 0 else 0.5

    @property
    def cost(self) -> tuple[int, int, bool]:
        """Smaller is cheaper: fewer worker processes first, then fewer batches held, then no pinning."""
        return (self.num_workers, self.prefetch_factor or 0, self.pin_memory)

    @property
    def persistent_workers(self) -> bool:
        """Recommended only when the measured epoch-restart saving is worth it (see `restart_saving_s`)."""
        saving = self.restart_saving_s
        return self.num_workers > 0 and saving is not None and saving >= PERSISTENT_SAVING_MIN_S

    @property
    def restart_saving_s(self) -> float | None:
        if not self.epoch_start_s or not self.persistent_restart_s:
            return None
        return statistics.median(self.epoch_start_s) - statistics.median(self.persistent_restart_s)

    def settings(self) -> dict[str, Any]:
        return {
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
            "samples_per_s": round(self.samples_per_s, 2),
        }


def pool(records: list[dict[str, Any]]) -> dict[str, Pooled]:
    """Ok measurements grouped by configuration (failed ones are judged by `loader_errors`)."""
    pooled: dict[str, Pooled] = {}
    for r in records:
        if r.get("kind") != "measure" or r.get("status") != "ok":
            continue
        p = pooled.setdefault(
            r["config"],
            Pooled(
                config=r["config"],
                num_workers=int(r["num_workers"]),
                prefetch_factor=r.get("prefetch_factor"),
                pin_memory=bool(r.get("pin_memory")),
                eligible=bool(r.get("eligible", True)),
                over_budget=bool(r.get("over_budget", False)),
                is_current=bool(r.get("is_current", False)),
            ),
        )
        p.samples += int(r.get("samples") or 0)
        p.elapsed_s += as_float(r.get("elapsed_s")) or 0.0
        p.group_s.extend(float(x) for x in r.get("group_s") or [])
        p.rounds.append(int(r.get("round", 0)))
        p.batch_bytes = max(p.batch_bytes, int(r.get("batch_bytes") or 0))
        for key in ("epoch_start_s", "persistent_restart_s"):
            value = as_float(r.get(key))
            if value is not None:
                getattr(p, key).append(value)
    return pooled


def raw_noise_margin(a: Pooled, b: Pooled) -> float:
    return max(NOISE_FLOOR, NOISE_SIGMAS * math.hypot(a.rel_se, b.rel_se))


def noise_margin(a: Pooled, b: Pooled) -> float:
    """Relative difference below which a and b are not told apart (capped, see MAX_NOISE_MARGIN)."""
    return min(MAX_NOISE_MARGIN, raw_noise_margin(a, b))


def within_noise(candidate: Pooled, best: Pooled) -> bool:
    return candidate.samples_per_s >= best.samples_per_s * (1.0 - noise_margin(candidate, best))


def halving_keep(candidates: list[Pooled], eta: int) -> list[Pooled]:
    """Who survives a round of successive halving: the best ceil(n / eta) by rate, plus the cheapest
    configuration within noise of the leader when rate alone would drop it. Among configurations the
    sweep cannot tell apart it will recommend the cheapest, so that one must reach the last round too
    (one extra measurement a round at most, and never one that would keep the round from shrinking)."""
    if not candidates:
        return []
    ranked = sorted(candidates, key=lambda p: -p.samples_per_s)
    kept = ranked[: math.ceil(len(ranked) / eta)]
    cheapest = min((p for p in ranked if within_noise(p, ranked[0])), key=lambda p: p.cost)
    if cheapest in kept or len(kept) + 1 >= len(ranked):  # the last round compares them all anyway
        return kept
    return [*kept, cheapest]
