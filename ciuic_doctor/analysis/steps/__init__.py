"""Judge the per-step records of `watch` / `job` (stream `steps`): do the replicas agree, and which rank
sets the pace.

- `rank_desync`: DDP keeps replicas identical only if they start identical and every update is the same;
  a per-rank seed without the initial broadcast (the seed article's `manual_seed(42 + rank)` on a custom
  wrapper), a rank that skipped a step, or a non-deterministic update makes them drift apart silently.
  watch records a float64 sum of every rank's parameters (all_gathered at step 1 and every K steps): any
  difference from rank 0 is a fail. Evidence: step (the first desynced check), ranks, checksums.
- `step_time`: chronic stragglers. Under DDP all ranks finish a step together (the gradient all-reduce
  waits for the last one), so equal step times say nothing about who is slow. The rank's own pace is its
  time *before* backward (data, forward; no collective when the buffers are not broadcast per forward),
  which watch records as pre_backward_s. Each rank's pace at each step is divided by the typical rank's
  at that step (`steps.crossrank`); a rank ≥ 10 % slower over the whole run is chronic. slowdown_pct = how
  much longer a step is than it would be if the slowest rank kept the others' pace. One-off slow steps
  are listed in the evidence (`one_off`) and do not warn.
- `straggler_onset`: a rank that *becomes* slow at step k (or recovers at k): a change point in its
  normalised pace. A median over the whole run hides a rank that turns 15 % slower half-way.
- `slow_host`: ≥ 75 % of one host's ranks slow together: a host problem. Those ranks are named here and
  not again as rank stragglers.
- `stall`: a rank whose pace is ≥ 2× the typical rank's for ≥ 2 steps in a row (a data-loader stall, a
  slow read): every rank waited for it. A single such step (a GC pause) is a one-off and does not warn.
- `intermittent`: a rank slow on a recurring few steps (every n-th), on at most INTERMITTENT_MAX_SHARE
  of the ranks: where many ranks do it (unsynchronised GC everywhere), it is how the job runs.

One finding per check for the whole job; `where.ranks` lists the ranks concerned, worst first, and
`where.hosts` their hosts. Evidence lists at most MAX_NAMED ranks by name and counts the rest.

Pure functions of records: no torch.
"""

from __future__ import annotations

import itertools
from typing import Any

from ciuic_doctor.analysis.steps import desync as _desync
from ciuic_doctor.analysis.steps.crossrank import (
    MIN_SLOW_FRACTION,
    SLOW_FRACTION,
    RankPace,
    StepMatrix,
    classify,
    row_medians,
    slow_hosts,
    step_matrix,
)
from ciuic_doctor.analysis.steps.grid import TIMES, matrix_from_table
from ciuic_doctor.measures.ranks import CHECKSUM_RTOL, differing_ranks  # noqa: F401 - part of this module's API
from ciuic_doctor.rundir.findings import Finding, some_ranks
from ciuic_doctor.rundir.store import RunDir, as_float

STREAMS = ("steps",)
SECONDS_PER_MILLION_STEP_ROWS = 0.21  # 2.14 s at 10,000 ranks × 1,000 steps (side by side: longest first)
PROBE = "steps"
WARMUP_STEPS = 2  # step 1 has no step time; step 2 still warms allocator and DataLoader
MIN_STEADY_STEPS = 5  # keep the warm-up steps when fewer than this many would remain
STRAGGLER_MIN_PCT = (
    100 * SLOW_FRACTION
)  # a slowest rank costing < 10 % of the step time is not worth acting on


COLUMNS = ("rank", "step", "host", "step_time_s", "pre_backward_s", "weights_checksum", "desync_ranks")


def analyze(run: RunDir) -> list[Finding]:
    """Read only the columns the checks use, every rank's file in parallel (frames.read_stream)."""
    from ciuic_doctor.rundir.frames import read_stream

    table = read_stream(run, "steps", COLUMNS).table
    # the table itself, not a pandas copy or dicts of its rows: both checks read its columns (`steps.desync`,
    # `steps.grid`)
    return [
        rank_desync_finding(_desync.from_table(table)),
        *check_pace(table.select(["rank", "step", "host", *TIMES])),
    ]


# ---- rank_desync -------------------------------------------------------------------------------
def check_rank_desync(records: list[dict[str, Any]]) -> Finding:
    return rank_desync_finding(_desync.from_records(records))


def rank_desync_finding(checks: list[_desync.StepChecks]) -> Finding:
    """The first check step where a rank's weights differ (fail), else pass; not_run without checks."""
    import numpy as np

    if not checks:
        return Finding(
            probe=PROBE,
            check="rank_desync",
            verdict="not_run",
            summary="no weight checksums recorded (one rank, no DDP module seen, or --no-checksum)",
        )
    for check in checks:
        bad = check.differing()
        if bad:
            ranks = sorted(bad)
            reference = int(check.ranks[0]) if len(check.ranks) else 0
            return Finding(
                probe=PROBE,
                check="rank_desync",
                verdict="fail",
                summary=(
                    f"weights differ across ranks from step {check.step}: rank(s) {ranks} differ from rank "
                    f"{reference}. The replicas train different models from here on; look for a per-rank "
                    "seed without DDP's initial broadcast, a rank that skipped or repeated a step, or "
                    "weights changed outside the optimizer."
                ),
                evidence={
                    "step": check.step,
                    "ranks": ranks,
                    "checksums": _reference_and(check.values(), ranks),
                    "ranks_checked": len(check.ranks),
                    "checked_steps": len(checks),
                    "desynced_checks": sum(1 for c in checks if c.differing()),
                },
                where={"step": check.step, "rank": ranks[0]},
            )
    ranks_seen = np.unique(np.concatenate([c.ranks for c in checks]))
    last = checks[-1]
    return Finding(
        probe=PROBE,
        check="rank_desync",
        verdict="pass",
        summary=(
            f"weights identical on all {len(ranks_seen)} ranks at every one of {len(checks)} checks "
            f"(last at step {last.step})"
        ),
        evidence={
            "step": last.step,
            "ranks": [],
            "checksums": some_ranks(last.values()),  # all equal: a few stand for them
            "ranks_checked": len(last.ranks),
            "checked_steps": len(checks),
        },
    )


def _reference_and(values: dict[str, float], ranks: list[int]) -> dict[str, float]:
    """The reference rank's checksum (the first) and the differing ranks', at most EVIDENCE_RANKS."""
    keys = list(values)
    if not keys:  # a step only desync reports name: no checksum to show
        return {}
    by_rank = {int(float(key)): key for key in keys}
    return some_ranks(values, [keys[0], *(by_rank[r] for r in ranks if r in by_rank)])


# ---- pace: step_time (chronic), straggler_onset (from step k), slow_host -----------------------------
MAX_NAMED = 32  # ranks listed by name in a finding's evidence; the rest are counted


def _matrix(data: Any) -> StepMatrix | None:
    """A StepMatrix from records (a list of dicts, as the row reader gives them), a DataFrame or the
    steps' arrow table."""
    import pandas as pd
    import pyarrow as pa

    if isinstance(data, StepMatrix) or data is None:
        return data
    if isinstance(data, pa.Table):
        return matrix_from_table(data, warmup_steps=WARMUP_STEPS, min_steady_steps=MIN_STEADY_STEPS)
    frame = data if isinstance(data, pd.DataFrame) else pd.DataFrame.from_records(data)
    for column in ("step_time_s", "pre_backward_s"):
        if column in frame and frame[column].dtype == object:
            frame[column] = frame[column].map(as_float)
    return step_matrix(frame, warmup_steps=WARMUP_STEPS, min_steady_steps=MIN_STEADY_STEPS)


def pct(value: float) -> str:
    """A percentage as a finding says it: one decimal below 10 (5.8 %), whole above (23 %).

    >>> pct(5.84), pct(23.4)
    ('5.8', '23')
    """
    return f"{value:.1f}" if abs(value) < 10 else f"{value:.0f}"


def _hosts_of(paces: list[RankPace]) -> list[str]:
    return list(dict.fromkeys(p.host for p in paces if p.host))


def _where(paces: list[RankPace], **extra: Any) -> dict[str, Any]:
    where: dict[str, Any] = {"rank": paces[0].rank, "ranks": [p.rank for p in paces]}
    hosts = _hosts_of(paces)
    if hosts:
        where["hosts"] = hosts
    return {**where, **extra}


def _named(paces: list[RankPace]) -> list[dict[str, Any]]:
    return [p.to_dict() for p in paces[:MAX_NAMED]]


def _distribution(values: Any) -> dict[str, float]:
    """min / p50 / p99 / max of finite values (for evidence that summarises every rank)."""
    import numpy as np

    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if not len(values):
        return {}
    q = np.percentile(values, [0, 50, 99, 100])
    return {"min": float(q[0]), "p50": float(q[1]), "p99": float(q[2]), "max": float(q[3])}


def check_pace(data: Any) -> list[Finding]:
    """step_time, straggler_onset and slow_host over all ranks at once (one finding per check)."""
    matrix = _matrix(data)
    if matrix is None or not np_any_finite(matrix.step_time_s):
        why = "no step times recorded (one step only?)"
        return [_pace_not_run(check, why) for check in PACE_CHECKS]
    if len(matrix.ranks) < 2:
        import numpy as np

        median = float(np.nanmedian(matrix.step_time_s))
        why = f"one rank only (median step {median:.3f} s): no other rank to compare with"
        return [
            _pace_not_run(
                "step_time",
                why,
                slowest_rank=int(matrix.ranks[0]),
                slowdown_pct=0.0,
                median_step_time_s={str(int(matrix.ranks[0])): median},
            ),
            *(_pace_not_run(check, why) for check in PACE_CHECKS[1:]),
        ]
    paces = classify(matrix)
    hosts, n_hosts = slow_hosts(paces, matrix)
    on_slow_host = {rank for h in hosts for rank in h.ranks}
    own = [p for p in paces if p.rank not in on_slow_host]
    return [
        _step_time(matrix, paces, own),
        _onset(matrix, own),
        _slow_host(matrix, paces, hosts, n_hosts),
        _stall(matrix, paces),
        _intermittent(matrix, paces),
    ]


PACE_CHECKS = ("step_time", "straggler_onset", "slow_host", "stall", "intermittent")
INTERMITTENT_MAX_SHARE = 0.01  # ranks (at least 2) with recurring slow steps before it is the job's way


def _stall(matrix: StepMatrix, paces: list[RankPace]) -> Finding:
    """Ranks whose pace was >= 2x the typical rank's for >= 2 steps in a row."""
    stalled = sorted(
        (p for p in paces if p.stall_steps), key=lambda p: -len(p.stall_steps) * (p.stall_ratio or 0)
    )
    evidence: dict[str, Any] = {"ranks_checked": len(paces), "steps_used": len(matrix.steps)}
    evidence["stalled"] = [
        {
            "rank": p.rank,
            "host": p.host,
            "steps": [p.stall_steps[0], p.stall_steps[-1]],
            "ratio": p.stall_ratio,
        }
        for p in stalled[:MAX_NAMED]
    ]
    evidence["stalled_ranks"] = len(stalled)
    if not stalled:
        return Finding(
            probe=PROBE,
            check="stall",
            verdict="pass",
            summary=f"no rank stalled ({len(paces)} ranks; a stall is >= 2 steps in a row at >= 2x the "
            "typical pace; single slow steps, such as a GC pause, are one-offs)",
            evidence=evidence,
        )
    worst = stalled[0]
    first, last = worst.stall_steps[0], worst.stall_steps[-1]
    more = f" ({len(stalled) - 1} more rank(s) stalled too)" if len(stalled) > 1 else ""
    return Finding(
        probe=PROBE,
        check="stall",
        verdict="warn",
        summary=(
            f"rank {worst.rank}{f' on {worst.host}' if worst.host else ''} stalled at steps {first}-{last}: "
            f"{worst.stall_ratio:g}x the typical rank's time before backward, and every rank waited for it "
            f"in the all-reduce{more}: a data-loader stall (a slow read, a worker restarting) or a blocked "
            "process"
        ),
        evidence=evidence,
        where=_where(stalled, step=first),
    )


def _intermittent(matrix: StepMatrix, paces: list[RankPace]) -> Finding:
    """A few ranks slow on a recurring handful of steps (every n-th step), not a job-wide pattern."""
    recurring = sorted((p for p in paces if p.intermittent_steps), key=lambda p: -len(p.intermittent_steps))
    limit = max(2, int(INTERMITTENT_MAX_SHARE * len(paces)))
    evidence: dict[str, Any] = {
        "ranks_checked": len(paces),
        "ranks_recurring": len(recurring),
        "recurring": [{"rank": p.rank, "host": p.host, "steps": p.intermittent_steps[:10],
                       "count": len(p.intermittent_steps)} for p in recurring[:MAX_NAMED]],
    }  # fmt: skip
    if not recurring or len(recurring) > limit:
        why = (
            f"{len(recurring)} ranks have recurring slow steps: the job's own pattern (e.g. unsynchronised "
            "GC), not one rank's"
            if recurring
            else "no rank is slow on a recurring few steps"
        )
        return Finding(probe=PROBE, check="intermittent", verdict="pass", summary=why, evidence=evidence)
    worst = recurring[0]
    gaps = sorted({b - a for a, b in itertools.pairwise(worst.intermittent_steps)})
    every = f", every {gaps[0]} steps" if len(gaps) == 1 else ""
    return Finding(
        probe=PROBE,
        check="intermittent",
        verdict="warn",
        summary=(
            f"rank {worst.rank}{f' on {worst.host}' if worst.host else ''} is slow now and then: "
            f"{len(worst.intermittent_steps)} of {len(matrix.steps)} steps at >= 1.5x the typical "
            f"pace{every}, its other steps at pace: a periodic task on its host, throttling cycles, a flaky "
            "link"
        ),
        evidence=evidence,
        where=_where(recurring, step=worst.intermittent_steps[0]),
    )


def np_any_finite(values: Any) -> bool:
    import numpy as np

    return bool(np.isfinite(values).any())


def _pace_not_run(check: str, why: str, **evidence: Any) -> Finding:
    return Finding(probe=PROBE, check=check, verdict="not_run", summary=why, evidence=evidence)


def _step_time(matrix: StepMatrix, paces: list[RankPace], own: list[RankPace]) -> Finding:
    """Chronic stragglers: ranks slower than the others over the whole run (not explained by their host)."""
    import numpy as np

    step_medians, pace_medians = row_medians(matrix.step_time_s), row_medians(matrix.pace_s)
    index = {rank: i for i, rank in enumerate(matrix.ranks.tolist())}
    chronic = sorted((p for p in own if p.kind == "chronic"), key=lambda p: -p.level)
    slowest = chronic[0] if chronic else max(own or paces, key=lambda p: p.level)
    i = index[slowest.rank]
    others = np.delete(pace_medians, i)
    excess_s = float(pace_medians[i] - np.nanmedian(others))
    step_median = float(np.nanmedian(step_medians))
    if matrix.pace_metric == "pre_backward_s":
        # The others wait for the slowest rank inside backward: without its excess, steps would be shorter.
        slowdown_pct = 100.0 * excess_s / max(step_median - excess_s, 1e-9)
    else:
        slowdown_pct = 100.0 * excess_s / max(float(np.nanmedian(others)), 1e-9)
    named = {p.rank for p in chronic[:MAX_NAMED]} | {slowest.rank}
    shown = sorted(named) if len(matrix.ranks) > MAX_NAMED else matrix.ranks.tolist()
    one_off = sorted((p for p in own if p.kind == "one_off"), key=lambda p: -len(p.one_off_steps))
    evidence: dict[str, Any] = {
        "slowest_rank": slowest.rank,
        "slowdown_pct": round(slowdown_pct, 2),
        "pace_metric": matrix.pace_metric,
        "excess_s": excess_s,
        "ranks_checked": len(paces),
        "steps_used": len(matrix.steps),
        "chronic": _named(chronic),
        "chronic_ranks": len(chronic),
        "one_off": _named(one_off),
        "one_off_ranks": len(one_off),
        "median_step_time_s": {str(r): float(step_medians[index[r]]) for r in shown},
        "median_pace_s": {str(r): float(pace_medians[index[r]]) for r in shown},
        "normalised_pace_distribution": _distribution([p.level for p in paces]),
    }
    if chronic and slowdown_pct >= STRAGGLER_MIN_PCT:
        worst = chronic[0]
        more = f" and {len(chronic) - 1} more rank(s)" if len(chronic) > 1 else ""
        summary = (
            f"rank {worst.rank}{f' on {worst.host}' if worst.host else ''}{more} slow the whole run: "
            f"{pct(worst.excess_pct)} % more time per step before backward than the typical rank; the others "
            f"wait for it in the gradient all-reduce, so steps take {slowdown_pct:.0f} % longer (median "
            f"step {step_median:.3f} s)"
            if matrix.pace_metric == "pre_backward_s"
            else f"rank {worst.rank}{more} steps {slowdown_pct:.0f} % slower than the others all run"
        )
        return Finding(
            probe=PROBE,
            check="step_time",
            verdict="warn",
            summary=summary,
            evidence=evidence,
            where=_where(chronic),
        )
    spikes = f"; {len(one_off)} rank(s) had one-off slow steps only" if one_off else ""
    return Finding(
        probe=PROBE,
        check="step_time",
        verdict="pass",
        summary=(
            f"{len(own)} of {len(paces)} ranks keep the same pace over the run: median step "
            f"{step_median:.3f} s; the slowest (rank {slowest.rank}) is {slowest.excess_pct:+.0f} % "
            f"(warn from {STRAGGLER_MIN_PCT:.0f} %, above the noise){spikes}"
            if len(own) < len(paces)
            else f"{len(paces)} ranks keep the same pace: median step {step_median:.3f} s; the slowest "
            f"(rank {slowest.rank}) costs {max(slowdown_pct, 0.0):.0f} % (warn from "
            f"{STRAGGLER_MIN_PCT:.0f} %, and above the noise){spikes}"
        ),
        evidence=evidence,
    )


def _onset(matrix: StepMatrix, own: list[RankPace]) -> Finding:
    """Ranks that change pace during the run: slow from step k (onset) or until step k (recovered)."""
    changed = sorted((p for p in own if p.kind in ("onset", "recovered")), key=lambda p: -p.excess_pct)
    evidence = {"ranks_checked": len(own), "steps_used": len(matrix.steps), "changed": _named(changed)}
    evidence["changed_ranks"] = len(changed)
    if changed:
        worst = changed[0]
        evidence.update(slowest_rank=worst.rank, change_step=worst.change_step, excess_pct=worst.excess_pct)
        how = "from" if worst.kind == "onset" else "until"
        more = f" ({len(changed) - 1} more rank(s) changed pace too)" if len(changed) > 1 else ""
        return Finding(
            probe=PROBE,
            check="straggler_onset",
            verdict="warn",
            summary=(
                f"rank {worst.rank}{f' on {worst.host}' if worst.host else ''} is {pct(worst.excess_pct)} % "
                f"slower than its peers {how} step {worst.change_step} (a median over the whole run "
                f"would hide it){more}: look at what changed on that rank then (thermal throttling, a "
                "neighbour process, a degraded link)"
            ),
            evidence=evidence,
            where=_where(changed, step=worst.change_step),
        )
    return Finding(
        probe=PROBE,
        check="straggler_onset",
        verdict="pass",
        summary=f"no rank changed pace during the run ({len(own)} ranks over {len(matrix.steps)} steps; "
        f"a change counts from {100 * MIN_SLOW_FRACTION:.0f}-{100 * SLOW_FRACTION:.0f} % (by how alike the "
        "ranks are) and above the noise)",
        evidence=evidence,
    )


def _slow_host(matrix: StepMatrix, paces: list[RankPace], hosts: list, n_hosts: int) -> Finding:
    """All (≥ 75 %) ranks of a host slow together: the host (CPU, PCIe, NIC, cooling) is the problem."""
    if n_hosts < 2:
        why = "the step records name one host only" if n_hosts else "the step records name no host"
        return _pace_not_run("slow_host", f"{why}: no host to compare with another")
    evidence: dict[str, Any] = {
        "excess_pct": hosts[0].excess_pct if hosts else 0.0,
        "hosts_checked": n_hosts,
        "slow_hosts": [
            {
                "host": h.host,
                "ranks": h.ranks,
                "slow_ranks": len(h.flagged),
                "excess_pct": h.excess_pct,
                "change_step": h.change_step,
                "judged_as_unit": h.as_unit,
            }
            for h in hosts[:MAX_NAMED]
        ],
    }
    if not hosts:
        return Finding(
            probe=PROBE,
            check="slow_host",
            verdict="pass",
            summary=f"no host is slow as a whole ({n_hosts} hosts, {len(paces)} ranks)",
            evidence=evidence,
        )
    worst = hosts[0]
    ranks = [r for h in hosts for r in h.flagged]
    when = f" from step {worst.change_step}" if worst.change_step is not None else ""
    more = f" ({len(hosts) - 1} more host(s) too)" if len(hosts) > 1 else ""
    which = (
        f"its {len(worst.ranks)} ranks together (their median pace) are"
        if worst.as_unit
        else f"{len(worst.flagged)} of its {len(worst.ranks)} ranks are"
    )
    return Finding(
        probe=PROBE,
        check="slow_host",
        verdict="warn",
        summary=(
            f"host {worst.host}: {which} {pct(worst.excess_pct)} % slower than the typical host's{when}"
            f"{more}: a host problem (CPU frequency, thermal throttling, PCIe/NIC, a noisy neighbour), not "
            "a rank problem"
        ),
        evidence=evidence,
        where={"host": worst.host, "hosts": [h.host for h in hosts], "rank": ranks[0], "ranks": ranks},
    )


def check_step_time(data: Any) -> Finding:
    """The chronic-straggler check alone (records, a DataFrame or a StepMatrix)."""
    return check_pace(data)[0]
