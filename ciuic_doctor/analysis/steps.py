"""Judge the per-step records of `watch` / `job` (stream `steps`): do the replicas agree, and which rank
sets the pace.

- `rank_desync`: DDP keeps replicas identical only if they start identical and every update is the same;
  a per-rank seed without the initial broadcast (the seed article's `manual_seed(42 + rank)` on a custom
  wrapper), a rank that skipped a step, or a non-deterministic update makes them drift apart silently.
  watch records a float64 sum of every rank's parameters (all_gathered at step 1 and every K steps): any
  difference from rank 0 is a fail. Evidence: step (the first desynced check), ranks, checksums.
- `step_time`: every rank's median step time, the slowest rank and how much it slows the job. Under DDP
  all ranks finish a step together (the gradient all-reduce waits for the last one), so equal step times
  say nothing about who is slow. The rank's own pace is its time *before* backward (data, forward; no
  collective when the buffers are not broadcast per forward), which watch records as pre_backward_s.
  slowdown_pct = how much longer a step is than it would be if the slowest rank kept the others' pace.

Pure functions of records: no torch.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from ciuic_doctor.findings import Finding
from ciuic_doctor.store import RunDir, as_float

STREAMS = ("steps",)
PROBE = "steps"
CHECKSUM_RTOL = 1e-12  # float64 sums of identical replicas are bit-identical; this absorbs JSON rounding
WARMUP_STEPS = 2  # step 1 has no step time; step 2 still warms allocator and DataLoader
MIN_STEADY_STEPS = 5  # keep the warm-up steps when fewer than this many would remain
STRAGGLER_MIN_PCT = 10.0  # a slowest rank costing < 10 % of the step time is not worth acting on
NOISE_MADS = 2.0  # the excess must exceed this many (scaled) MADs of the two ranks' paces


def differing_ranks(checksums: list[float], ranks: list[int]) -> list[int]:
    """Ranks whose checksum differs from the first rank's (DDP broadcasts from rank 0). NaN differs.

    >>> differing_ranks([1.5, 1.5, 1.25], [0, 1, 2])
    [2]
    """
    reference = checksums[0]
    tolerance = CHECKSUM_RTOL * max(1.0, abs(reference))
    return [
        rank
        for rank, value in zip(ranks, checksums, strict=True)
        if not abs(value - reference) <= tolerance  # written so that NaN counts as different
    ]


def analyze(run: RunDir) -> list[Finding]:
    records = run.read("steps").records
    return [check_rank_desync(records), check_step_time(records)]


# ---- rank_desync -------------------------------------------------------------------------------
def check_rank_desync(records: list[dict[str, Any]]) -> Finding:
    by_step: dict[int, dict[int, float]] = defaultdict(dict)
    reported: dict[int, set[int]] = defaultdict(set)
    for rec in records:
        step, rank = rec.get("step"), rec.get("rank")
        if not isinstance(step, int) or not isinstance(rank, int):
            continue
        value = as_float(rec.get("weights_checksum"))
        if value is not None:
            by_step[step][rank] = value
        if rec.get("desync_ranks"):
            reported[step].update(int(r) for r in rec["desync_ranks"])
    steps = sorted(set(by_step) | set(reported))
    if not steps:
        return Finding(
            probe=PROBE,
            check="rank_desync",
            verdict="not_run",
            summary="no weight checksums recorded (one rank, no DDP module seen, or --no-checksum)",
        )
    ranks_seen = sorted({rank for values in by_step.values() for rank in values})
    for step in steps:
        values = by_step.get(step, {})
        ordered = sorted(values)
        bad = set(differing_ranks([values[r] for r in ordered], ordered)) if len(ordered) > 1 else set()
        bad |= reported.get(step, set())
        if bad:
            ranks = sorted(bad)
            reference = ordered[0] if ordered else 0
            return Finding(
                probe=PROBE,
                check="rank_desync",
                verdict="fail",
                summary=(
                    f"weights differ across ranks from step {step}: rank(s) {ranks} differ from rank "
                    f"{reference}. The replicas train different models from here on; look for a per-rank "
                    "seed without DDP's initial broadcast, a rank that skipped or repeated a step, or "
                    "weights changed outside the optimizer."
                ),
                evidence={
                    "step": step,
                    "ranks": ranks,
                    "checksums": {str(r): values[r] for r in ordered},
                    "checked_steps": len(steps),
                    "desynced_checks": sum(
                        1 for s in steps if _desynced(by_step.get(s, {}), reported.get(s))
                    ),
                },
                where={"step": step, "rank": ranks[0]},
            )
    last = steps[-1]
    return Finding(
        probe=PROBE,
        check="rank_desync",
        verdict="pass",
        summary=(
            f"weights identical on all {len(ranks_seen)} ranks at every one of {len(steps)} checks "
            f"(last at step {last})"
        ),
        evidence={
            "step": last,
            "ranks": [],
            "checksums": {str(r): v for r, v in sorted(by_step.get(last, {}).items())},
            "checked_steps": len(steps),
        },
    )


def _desynced(values: dict[int, float], reported: set[int] | None) -> bool:
    ordered = sorted(values)
    if len(ordered) > 1 and differing_ranks([values[r] for r in ordered], ordered):
        return True
    return bool(reported)


# ---- step_time ---------------------------------------------------------------------------------
def _mad(values: list[float]) -> float:
    """Median absolute deviation scaled to a normal σ (× 1.4826): robust to the odd slow step."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - middle) for v in values)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _per_rank(records: list[dict[str, Any]], key: str) -> dict[int, list[float]]:
    """Finite values of `key` per rank, without the warm-up steps when enough steps remain."""
    raw: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for rec in records:
        value = as_float(rec.get(key))
        if isinstance(rec.get("rank"), int) and isinstance(rec.get("step"), int) and _finite(value):
            raw[rec["rank"]].append((rec["step"], value))
    out: dict[int, list[float]] = {}
    for rank, pairs in raw.items():
        steady = [v for step, v in pairs if step > WARMUP_STEPS]
        out[rank] = steady if len(steady) >= MIN_STEADY_STEPS else [v for _, v in pairs]
    return out


def check_step_time(records: list[dict[str, Any]]) -> Finding:
    step_times = _per_rank(records, "step_time_s")
    if not step_times:
        return Finding(
            probe=PROBE,
            check="step_time",
            verdict="not_run",
            summary="no step times recorded (one step only?)",
        )
    medians = {rank: statistics.median(v) for rank, v in sorted(step_times.items())}
    evidence: dict[str, Any] = {
        "median_step_time_s": {str(r): m for r, m in medians.items()},
        "steps_used": {str(r): len(v) for r, v in sorted(step_times.items())},
    }
    if len(medians) < 2:
        rank, median = next(iter(medians.items()))
        return Finding(
            probe=PROBE,
            check="step_time",
            verdict="not_run",
            summary=f"one rank only (median step {median:.3f} s): no other rank to compare with",
            evidence={**evidence, "slowest_rank": rank, "slowdown_pct": 0.0},
        )
    pace = _per_rank(records, "pre_backward_s")
    metric = "pre_backward_s" if set(pace) >= set(medians) else "step_time_s"
    pace = pace if metric == "pre_backward_s" else step_times
    pace_medians = {rank: statistics.median(pace[rank]) for rank in medians}
    slowest = max(pace_medians, key=lambda r: pace_medians[r])
    others = [pace_medians[r] for r in pace_medians if r != slowest]
    baseline = statistics.median(others)
    excess_s = pace_medians[slowest] - baseline
    step_median = statistics.median(medians.values())
    if metric == "pre_backward_s":
        # The others wait for the slowest rank inside backward: without its excess, steps would be shorter.
        slowdown_pct = 100.0 * excess_s / max(step_median - excess_s, 1e-9)
    else:
        slowdown_pct = 100.0 * excess_s / max(baseline, 1e-9)
    noise_s = NOISE_MADS * (
        _mad(pace[slowest]) + statistics.median(_mad(pace[r]) for r in medians if r != slowest)
    )
    significant = excess_s > noise_s
    evidence.update(
        slowest_rank=slowest,
        slowdown_pct=round(slowdown_pct, 2),
        pace_metric=metric,
        median_pace_s={str(r): m for r, m in pace_medians.items()},
        excess_s=excess_s,
        noise_s=noise_s,
    )
    if slowdown_pct >= STRAGGLER_MIN_PCT and significant:
        return Finding(
            probe=PROBE,
            check="step_time",
            verdict="warn",
            summary=(
                f"rank {slowest} is the straggler: {excess_s:.3f} s more per step before backward than the "
                f"other ranks, who wait for it in the gradient all-reduce; steps take {slowdown_pct:.0f} % "
                f"longer than they would at the others' pace (median step {step_median:.3f} s)"
                if metric == "pre_backward_s"
                else f"rank {slowest} steps {slowdown_pct:.0f} % slower than the others "
                f"({medians[slowest]:.3f} s vs {baseline:.3f} s median)"
            ),
            evidence=evidence,
            where={"rank": slowest},
        )
    return Finding(
        probe=PROBE,
        check="step_time",
        verdict="pass",
        summary=(
            f"{len(medians)} ranks keep the same pace: median step {step_median:.3f} s; the slowest "
            f"(rank {slowest}) costs {max(slowdown_pct, 0.0):.0f} % (warn from {STRAGGLER_MIN_PCT:.0f} %, "
            "and above the noise)"
        ),
        evidence=evidence,
    )
