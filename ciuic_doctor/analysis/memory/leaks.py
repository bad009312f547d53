"""`memory_leak`: does a rank's host or device memory grow steadily enough to run out?

A robust trend (Theil–Sen) after the warm-up, against steps where the run has them, judged by the shared
growth test (`_grows`: Mann–Kendall z ≥ 3, R² ≥ 0.5, growth ≥ max(16 MiB, 0.5 % of the level)); one jump
between flat levels is a level shift, not a leak. A leak fails when its projection runs out of headroom
within 24 h (FAIL_HORIZON_S), else warns; ranks on one host share its available memory. One finding per
kind (host | device) over the job, the leaking ranks worst first. Split from `memory.py`, whose docstring
holds the evidence contract.
"""

from __future__ import annotations

import math
from typing import Any

from ciuic_doctor.analysis.memory.data import (
    LEAK_MIN_BYTES,
    MIB,
    MIN_POINTS,
    PROBE,
    WARMUP_STEPS,
    Series,
    _Data,
    _grows,
    _not_run,
    _slope_evidence,
    _warm,
)
from ciuic_doctor.analysis.stats.trend import Trend, level_shift, robust_trend
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import as_float

FAIL_HORIZON_S = 24 * 3600.0
# Growth over fewer steady steps (after the warm-up) is not judged a leak: a short checkup (12-16 steps, 8-12
# steady) got a memory_leak FAIL from start-up growth projected to an OOM within 24 h. 20 steady steps is
# half the embedded job's default 40; a real leak keeps growing, and 20 steps tell it from a settling level.
LEAK_MIN_SPAN_STEPS = 20
# anon (RSS − file-backed − shmem) first: a leak grows it, while USS also rises when forked workers
# un-share pages (copy-on-read) and RSS when a process reads a memory-mapped dataset (reclaimable)
HOST_METRICS = ("anon", "uss", "rss")


def _level_shift_finding(series: Series, trend: Trend, label: str, fields: dict[str, Any]) -> Finding | None:
    """pass (or not_run) when the growth is one jump between flat levels: a level shift is not a leak."""
    warm = _warm(series)
    shift = level_shift(warm.x, warm.y, trend)
    if shift is None:
        return None
    after = [(x, y) for x, y in zip(warm.x, warm.y, strict=True) if x >= shift.at_x]
    said = f"one-time level shift of {shift.jump / MIB:+.1f} MiB at {series.x_unit} {shift.at_x:g}"
    evidence = {**fields, "level_shift_bytes": round(shift.jump), "level_shift_at": shift.at_x}
    if len({x for x, _ in after}) < MIN_POINTS:
        summary = f"{label}: {said}; too few points after it (< {MIN_POINTS}) to judge a leak"
        return _not_run("memory_leak", summary, **evidence)
    later = robust_trend([x for x, _ in after], [y for _, y in after])
    if later is not None and _grows(later, LEAK_MIN_BYTES):
        return None  # it jumped and still grows: judged as a leak below
    return Finding(
        probe=PROBE,
        check="memory_leak",
        verdict="pass",
        summary=f"{label} ({series.metric}): {said}, flat after it: not a leak",
        evidence=evidence,
    )


def _memwatch_series(data: _Data, rank: int, samples: list[dict[str, Any]], metric: str) -> Series:
    points = [(s["t"], s[metric]) for s in samples if s.get(metric) is not None]
    start = _first_step_t(data, rank)
    if start is not None:  # start-up (imports, data, model build) is not a trend: from the first step on
        points = [(t, y) for t, y in points if t >= start]
    times = [t for t, _ in points]
    steps = data.step_of(rank, times)
    if steps is not None and sum(not math.isnan(x) for x in steps) >= MIN_POINTS:
        keep = [(x, y) for x, (_, y) in zip(steps, points, strict=True) if not math.isnan(x)]
        x, y, unit = [k[0] for k in keep], [k[1] for k in keep], "step"
    else:
        x, y, unit = [t - times[0] for t in times] if times else [], [p[1] for p in points], "s"
    pid = samples[0]["pid"] if samples else None
    host = samples[0].get("host") if samples else None
    return Series(x=x, y=y, x_unit=unit, metric=metric, source="memwatch", pid=pid, host=host)


def _first_step_t(data: _Data, rank: int) -> float | None:
    """When `rank`'s first optimizer step ended (its first step record's t); None without step records.
    nanoGPT under checkup grew 71 -> 225 MB in the 3 s before its first step, then held 237-240 MB: a
    leak fit over the samples from process start called that 41.5 MiB/s."""
    import numpy as np

    t = data.steps.column(rank, "t")
    t = t[np.isfinite(t)]
    return float(t.min()) if len(t) else None


def _steps_recorded(data: _Data, rank: int) -> int:
    """How many step records `rank` has (0: a process memwatch saw without steps)."""
    import numpy as np

    return int(np.isfinite(data.steps.column(rank, "step")).sum())


def _host_series(data: _Data, rank: int) -> Series | None:
    """memwatch's samples when there are enough after warm-up, else the steps' own rss (every step)
    — a short job watched at 1 s has fewer samples than steps."""
    candidates = []
    samples = data.rank_samples(rank)
    for metric in HOST_METRICS:
        if sum(s.get(metric) is not None for s in samples) >= MIN_POINTS:
            candidates.append(_memwatch_series(data, rank, samples, metric))
            break
    for metric in ("uss", "rss"):
        x, y = data.steps_field(rank, metric)
        if len(x) >= MIN_POINTS:
            host = data.steps.host(rank)
            candidates.append(Series(x=x, y=y, x_unit="step", metric=metric, source="steps", host=host))
            break
    usable = [s for s in candidates if len(_warm(s).x) >= MIN_POINTS]
    return (usable or candidates or [None])[0]


def _device_series(data: _Data, rank: int) -> Series | None:
    x, y = data.steps_field(rank, "mem_allocated")
    if len(x) >= MIN_POINTS:
        host = data.steps.host(rank)
        return Series(x=x, y=y, x_unit="step", metric="mem_allocated", source="steps", host=host)
    samples = data.rank_samples(rank)
    if sum(s.get("gpu_bytes") is not None for s in samples) >= MIN_POINTS:
        return _memwatch_series(data, rank, samples, "gpu_bytes")
    return None


def _device_limit(data: _Data, rank: int) -> tuple[int | None, float | None]:
    """(device total, bytes the rank holds now) from NVML samples, else meta and the steps."""
    samples = data.rank_samples(rank)
    totals = [s["gpu_total_bytes"] for s in samples if s.get("gpu_total_bytes")]
    total = totals[-1] if totals else (min(data.device_totals) if data.device_totals else None)
    held = [s["gpu_bytes"] for s in samples if s.get("gpu_bytes") is not None]
    if not held:
        held = data.steps_field(rank, "mem_reserved")[1] or data.steps_field(rank, "mem_allocated")[1]
    return total, (held[-1] if held else None)


def leak_findings(data: _Data) -> list[Finding]:
    """One memory_leak finding per kind. Every rank's series is fitted in one grouped pass
    (`memory.batch`); a finding of its own is built only for a rank that grows (it may still be a
    level shift) and for the steepest one, which the pass summary names — the others are counted."""
    from ciuic_doctor.analysis.memory.batch import device_fits, host_fits

    findings: list[Finding] = []
    for kind, make in (("host", host_fits), ("device", device_fits)):
        fits = make(data)
        if not fits.has.any():
            why = (
                "no per-rank host memory series (needs memwatch samples or steps with rss/uss)"
                if kind == "host"
                else "no device memory series: steps carry no mem_allocated (a CPU run?) and NVML gave no "
                f"per-process figures ({data.gpu_absent_reason()})"
            )
            findings.append(_not_run("memory_leak", why, kind=kind))
            continue
        findings.append(_one_leak_finding(kind, _judged(data, kind, fits)))
    return findings


def _judged(data: _Data, kind: str, fits) -> list[Finding]:
    """Per-rank findings of the ranks that grow and of the steepest; a stand-in (verdict and slope only)
    for every other rank, enough for `_one_leak_finding` to count it."""
    import numpy as np

    trends = fits.trends
    grows = fits.grows(LEAK_MIN_BYTES) & fits.has
    leaking = np.flatnonzero(grows).tolist()
    # ranks on one host share its available memory: they run it out together
    shared_slope: dict[tuple[str | None, str], float] = {}
    for i in leaking:
        key = (fits.host[i], "step" if fits.step_unit[i] else "s")
        shared_slope[key] = shared_slope.get(key, 0.0) + float(trends.slope[i])

    def full(i: int) -> Finding:
        return _leak_finding(
            data,
            kind=kind,
            rank=fits.ranks[i],
            series=fits.series(i),
            trend=trends.trend(i),
            shared_slope=shared_slope,
        )

    built = {i: full(i) for i in leaking}
    judged = fits.has & trends.valid & ~grows
    for i, finding in built.items():
        judged[i] = finding.verdict != "not_run"
    if judged.any():  # the steepest judged rank by its evidence's slope (rounded to 0.1), first on ties
        candidates = np.flatnonzero(judged)
        rounded = [round(float(v), 1) for v in trends.slope[candidates]]  # as the evidence rounds it
        steepest = int(candidates[int(np.argmax(rounded))])
        if steepest not in built:
            built[steepest] = full(steepest)
    out = []
    for i in np.flatnonzero(fits.has).tolist():
        if i in built:
            out.append(built[i])
        else:
            verdict = "pass" if judged[i] else "not_run"
            slope_key = "slope_bytes_per_step" if fits.step_unit[i] else "slope_bytes_per_s"
            slope = round(float(trends.slope[i]), 1) if judged[i] else None
            out.append(
                Finding(
                    probe=PROBE,
                    check="memory_leak",
                    verdict=verdict,
                    summary="",
                    evidence={slope_key: slope},
                    where={"rank": fits.ranks[i]},
                )
            )
    return out


MAX_NAMED = 32  # leaking ranks listed one by one in the evidence; the rest are counted


def _growth_per_unit(finding: Finding) -> float:
    ev = finding.evidence
    return as_float(ev.get("slope_bytes_per_step", ev.get("slope_bytes_per_s"))) or 0.0


def _one_leak_finding(kind: str, per_rank: list[Finding]) -> Finding:
    """The job's one memory_leak finding of `kind`: the leaking ranks, worst (fail, then steepest) first.

    Its flat evidence is the worst rank's (the contract in the module docstring); `ranks` lists each
    leaking rank's slope and projection, `ranks_checked` how many ranks had a series to judge."""
    judged = [f for f in per_rank if f.verdict != "not_run"]
    leaking = sorted(
        (f for f in judged if f.verdict in ("warn", "fail")),
        key=lambda f: (f.verdict != "fail", -_growth_per_unit(f)),
    )
    not_judged = sorted(f.where["rank"] for f in per_rank if f.verdict == "not_run")
    counts = {"ranks_checked": len(judged), "ranks_not_run": not_judged[:MAX_NAMED]}
    if not judged:
        short = next((f.summary for f in per_rank if "run more steps" in f.summary), None)
        return _not_run(
            "memory_leak",
            f"{kind} memory: too few points after warm-up on every one of {len(per_rank)} rank(s)"
            + (f" ({short})" if short else ""),  # growth seen, over too few steps to judge
            kind=kind,
            **counts,
        )
    if not leaking:
        steepest = max(judged, key=_growth_per_unit)
        ev = steepest.evidence
        unit = "step" if "slope_bytes_per_step" in ev else "s"
        shift = f" ({steepest.summary})" if "level_shift_bytes" in ev else ""  # why a steep line is no leak
        return Finding(
            probe=PROBE,
            check="memory_leak",
            verdict="pass",
            summary=f"{kind} memory ({ev['metric']}) shows no leak on any of {len(judged)} rank(s): the "
            f"steepest, rank {steepest.where['rank']}, {_growth_per_unit(steepest) / MIB:+.3f} MiB/{unit}, "
            f"R² {ev['r2']:.2f}, trend z {ev['mann_kendall_z']:.1f}{shift}",
            evidence={**ev, **counts, "steepest_rank": steepest.where["rank"], "leaking_ranks": 0},
        )
    worst = leaking[0]
    ranks = [f.where["rank"] for f in leaking]
    hosts = list(dict.fromkeys(f.where["host"] for f in leaking if f.where.get("host")))
    named = []
    for f in leaking[:MAX_NAMED]:
        ev = f.evidence
        entry = {"rank": f.where["rank"], "host": f.where.get("host"), "verdict": f.verdict}
        for key in ("growth_mb_per_step", "growth_mb_per_s", "r2", "projected_oom_step", "projected_oom_s"):
            if key in ev:
                entry[key] = ev[key]
        named.append(entry)
    more = f"; {len(leaking) - 1} more rank(s) leak too" if len(leaking) > 1 else ""
    where: dict[str, Any] = {"rank": ranks[0], "ranks": ranks, **({"hosts": hosts} if hosts else {})}
    if worst.where.get("host"):
        where["host"] = worst.where["host"]
    return Finding(
        probe=PROBE,
        check="memory_leak",
        verdict=worst.verdict,
        summary=f"{worst.summary}{more} (of {len(judged)} ranks checked)",
        evidence={**worst.evidence, **counts, "leaking_ranks": len(leaking), "ranks": named},
        where=where,
    )


def _steps_made(data: _Data, rank: int) -> int | None:
    """Optimizer steps rank `rank` recorded; None when the run has no steps stream for it (memwatch on
    a job it knows nothing else of: then time alone is judged)."""
    if rank not in data.steps:
        return None
    import numpy as np

    steps = data.steps.column(rank, "step")
    return len(np.unique(steps[np.isfinite(steps)]))


def _leak_finding(
    data: _Data,
    *,
    kind: str,
    rank: int,
    series: Series,
    trend: Trend | None,
    shared_slope: dict[tuple[str | None, str], float],
) -> Finding:
    where = {"rank": rank, **({"host": series.host} if series.host else {})}
    base = {"kind": kind, "metric": series.metric, "source": series.source, "pid": series.pid}
    unit = series.x_unit
    if trend is None:
        return _not_run(
            "memory_leak", f"too few points after warm-up on rank {rank} ({kind})", where=where, **base
        )
    evidence = {
        **base,
        **_slope_evidence(trend, unit),
        "level_start_bytes": round(trend.y_start),
        "level_end_bytes": round(trend.y_end),
        f"{'steps' if unit == 'step' else 'seconds'}_observed": round(trend.x_last - trend.x_first, 2),
    }
    observed = trend.x_last - trend.x_first
    stepped = _steps_recorded(data, rank)
    if _grows(trend, LEAK_MIN_BYTES) and unit == "s" and stepped:
        # The rank trains in steps, yet its samples could not be placed on them: they lie outside the
        # steps (start-up, an evaluation, a crash after step 1). Growth there is no per-step leak.
        return _not_run(
            "memory_leak",
            f"rank {rank} {kind} memory grew {trend.slope / MIB:.1f} MiB/s outside its {stepped} recorded "
            f"step(s) (start-up, evaluation or the way to a crash, not training): a leak is judged over "
            f"at least {LEAK_MIN_SPAN_STEPS} steady steps, so run more steps to tell",
            where=where,
            **evidence,
        )
    if _grows(trend, LEAK_MIN_BYTES) and unit == "step" and observed < LEAK_MIN_SPAN_STEPS:
        return _not_run(  # a short run's growth is start-up as often as a leak: no verdict, the reason
            "memory_leak",
            f"rank {rank} {kind} memory grew {trend.slope / MIB:.3f} MiB/step over only {observed:.0f} "
            f"steady steps; a leak is judged over at least {LEAK_MIN_SPAN_STEPS} (the allocator and page "
            "cache still grow that early), so run more steps to tell",
            where=where,
            **evidence,
        )
    made = _steps_made(data, rank) if unit != "step" else None
    if _grows(trend, LEAK_MIN_BYTES) and made is not None and made < LEAK_MIN_SPAN_STEPS + WARMUP_STEPS:
        return _not_run(  # sampled in time, but the job's own steps say how far past start-up it got
            "memory_leak",
            f"rank {rank} {kind} memory grew {trend.slope / MIB:.3f} MiB/s while the job made only {made} "
            f"step(s); a leak is judged over at least {LEAK_MIN_SPAN_STEPS} steady steps (start-up grows "
            "memory), so run more steps to tell",
            where=where,
            **evidence,
        )
    if _grows(trend, LEAK_MIN_BYTES) and (
        shifted := _level_shift_finding(series, trend, f"rank {rank} {kind} memory", evidence)
    ):
        shifted.where = where
        return shifted
    if not _grows(trend, LEAK_MIN_BYTES):
        return Finding(
            probe=PROBE,
            check="memory_leak",
            verdict="pass",
            summary=f"rank {rank} {kind} memory ({series.metric}) shows no leak: "
            f"{trend.slope / MIB:+.3f} MiB/{unit}, R² {trend.r2:.2f}, trend z {trend.z:.1f}",
            evidence=evidence,
            where=where,
        )
    if kind == "host":
        samples = data.rank_samples(rank)
        available = [s["sys_available_bytes"] for s in samples if s.get("sys_available_bytes")]
        limit = available[-1] if available else None
        headroom = limit
        slope = shared_slope.get((series.host, unit), trend.slope)
    else:
        limit, held = _device_limit(data, rank)
        headroom = None if limit is None or held is None else max(0.0, limit - held)
        slope = trend.slope
    evidence["limit_bytes"] = limit
    evidence["headroom_bytes"] = None if headroom is None else round(headroom)
    left = None if headroom is None else headroom / slope
    seconds_left = left if unit == "s" else None
    if unit == "step":
        evidence["projected_oom_step"] = None if left is None else math.floor(trend.x_last + left)
        step_s = data.step_time_s(rank)
        seconds_left = None if left is None or step_s is None else left * step_s
    evidence["projected_oom_s"] = None if seconds_left is None else round(seconds_left, 1)
    verdict = "fail" if seconds_left is not None and seconds_left <= FAIL_HORIZON_S else "warn"
    when = "" if seconds_left is None else f"; runs out in about {seconds_left / 3600:.1f} h"
    if unit == "step" and left is not None:
        when += f" (step {evidence['projected_oom_step']})"
    return Finding(
        probe=PROBE,
        check="memory_leak",
        verdict=verdict,
        summary=f"rank {rank} {kind} memory ({series.metric}) grows {trend.slope / MIB:.3f} MiB/{unit} "
        f"(R² {trend.r2:.2f}){when}",
        evidence=evidence,
        where=where,
    )
