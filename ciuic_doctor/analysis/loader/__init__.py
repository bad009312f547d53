"""loader-sweep records -> findings: which DataLoader settings to use on this node, and the pitfalls.

Checks (stream `loader`, the last sweep in the run directory):

- `loader_throughput`: the best configuration, the *smallest* one within the measurement noise of it
  (fewer workers = less memory, fewer processes, more CPU left to the rank), the knee of the
  throughput-vs-workers curve, the job's current settings and Lightning's rule side by side.
- `loader_shm`: in-flight shared memory ≈ workers × prefetch_factor × batch bytes per rank, × local ranks,
  against /dev/shm free (docker's default is 64 MB; too little shows as "killed by signal: Bus error").
- `loader_worker_growth`: worker USS growth during the measured window (copy-on-read of Python objects
  shows in USS/PSS, not RSS).
- `loader_budget`: worker counts against the CPU budget per local rank (min(affinity, cgroup quota) //
  local world size), which neither PyTorch's nor Lightning's warnings account for.
- `loader_errors`: configurations whose workers crashed, raised or hung (DataLoader timeout / watchdog).
- `data_wait` (stream `steps`, wait.py): how long a watched job's steps wait for their batch, from watch's
  own timings, and the workers that would hide it: the everyday path (watch + report) sees a loader-bound
  job without a sweep.

Pure functions of records: no torch, no pandas. The pooled estimate and the noise rule live in
measures/loader_pool.py, which the sweep uses too: it drops configurations by the rule the report judges by.
"""

from __future__ import annotations

from typing import Any

from ciuic_doctor.measures.loader_pool import (  # noqa: F401 - part of this module's API
    MAX_NOISE_MARGIN,
    NOISE_FLOOR,
    NOISE_SIGMAS,
    PERSISTENT_SAVING_MIN_S,
    Pooled,
    halving_keep,
    noise_margin,
    pool,
    raw_noise_margin,
    within_noise,
)
from ciuic_doctor.rundir.findings import Finding, Recommendation
from ciuic_doctor.rundir.store import RunDir

STREAMS = ("loader", "steps")
PROBE = "loader"

KNEE_FRACTION = 0.90  # the knee: the fewest workers that reach 90 % of the best rate
CONFIG_KEYS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")


def last_sweep(records: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header of the last sweep in the stream and that sweep's records (a rerun appends)."""
    headers = [r for r in records if r.get("kind") == "sweep"]
    if not headers:
        return {}, records
    header = headers[-1]
    return header, [r for r in records if r.get("sweep") == header.get("sweep") and r is not header]


def finalists(pooled: dict[str, Pooled]) -> list[Pooled]:
    """The eligible configurations measured in the deepest round: every round measured them alike, so
    they compare without the bias of unequal windows (short windows read high on a busy node: freshly
    started workers get CPU first)."""
    eligible = [p for p in pooled.values() if p.eligible] or list(pooled.values())
    if not eligible:
        return []
    deepest = max(max(p.rounds) for p in eligible)
    return [p for p in eligible if max(p.rounds) == deepest]


def choose(pooled: dict[str, Pooled]) -> tuple[Pooled | None, Pooled | None]:
    """(best, recommended) among the finalists: the highest rate, and the cheapest configuration within
    the noise of it."""
    group = finalists(pooled)
    if not group:
        return None, None
    best = max(group, key=lambda p: p.samples_per_s)
    return best, min((p for p in group if within_noise(p, best)), key=lambda p: p.cost)


def knee_workers(records: list[dict[str, Any]]) -> int | None:
    """The fewest workers whose best configuration reaches KNEE_FRACTION of the best rate, on round 0
    (the one round in which every configuration had the same window)."""
    per_workers: dict[int, float] = {}
    for p in pool([r for r in records if r.get("round", 0) == 0]).values():
        per_workers[p.num_workers] = max(per_workers.get(p.num_workers, 0.0), p.samples_per_s)
    if not per_workers:
        return None
    top = max(per_workers.values())
    return min(w for w, rate in per_workers.items() if rate >= KNEE_FRACTION * top)


def _current(header: dict[str, Any]) -> dict[str, Any]:
    return dict(header.get("current") or {})


def _failures(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "config": r.get("config"),
            "round": r.get("round"),
            "status": r.get("status"),
            "error": r.get("error"),
        }
        for r in records
        if r.get("kind") == "measure" and r.get("status") not in ("ok", "skipped")
    ]


def analyze(run: RunDir) -> list[Finding]:
    from ciuic_doctor.analysis.loader.wait import wait_findings
    from ciuic_doctor.rundir.frames import read_records

    findings = wait_findings(run)
    if run.has_stream("loader"):
        header, records = last_sweep(read_records(run, "loader"))
        findings = [*analyze_records(header, records), *findings]
    return findings


def analyze_records(header: dict[str, Any], records: list[dict[str, Any]]) -> list[Finding]:
    """All loader checks for one sweep: `header` is its kind=sweep record, `records` the rest."""
    from ciuic_doctor.analysis.loader import checks as loader_checks

    pooled = pool(records)
    best, recommended = choose(pooled)
    findings = [throughput_finding(header, records, pooled, best, recommended)]
    findings.append(loader_checks.shm_finding(header, records, pooled, recommended))
    findings.append(loader_checks.growth_finding(header, records))
    findings.append(loader_checks.budget_finding(header, pooled, recommended))
    findings.append(loader_checks.errors_finding(_failures(records), records))
    return findings


def throughput_finding(
    header: dict[str, Any],
    records: list[dict[str, Any]],
    pooled: dict[str, Pooled],
    best: Pooled | None,
    recommended: Pooled | None,
) -> Finding:
    current = _current(header)
    lws = int(header.get("local_world_size") or 1)
    evidence: dict[str, Any] = {
        "best": best.settings() if best else None,
        "recommended": recommended.settings() if recommended else None,
        "within_noise_of_best": bool(best and recommended and within_noise(recommended, best)),
        "noise_margin_pct": round(100 * noise_margin(recommended, best), 2) if best and recommended else None,
        "noisy": bool(best and recommended and raw_noise_margin(recommended, best) > MAX_NOISE_MARGIN),
        "knee_workers": knee_workers(records),
        "current": current or None,
        "current_samples_per_s": None,
        "lightning_rule_workers": header.get("lightning_rule_workers"),
        "lightning_rule_samples_per_s": None,
        "cpu_budget_per_rank": header.get("cpu_budget_per_rank"),
        "local_world_size": lws,
        "step_ms": header.get("step_ms"),
        "configs": sorted(
            (
                {
                    **p.settings(),
                    "config": p.config,
                    "rel_se_pct": round(100 * p.rel_se, 2),
                    "rounds": sorted(set(p.rounds)),
                    "eligible": p.eligible,
                }
                for p in pooled.values()
            ),
            key=lambda c: -c["samples_per_s"],
        ),
    }
    if best is None or recommended is None:
        return Finding(
            probe=PROBE,
            check="loader_throughput",
            verdict="not_run",
            evidence=evidence,
            summary="no DataLoader configuration completed a measurement (see loader_errors)",
        )
    current_pooled = next((p for p in pooled.values() if p.is_current), None)
    if current_pooled is not None:
        evidence["current_samples_per_s"] = round(current_pooled.samples_per_s, 2)
    rule = header.get("lightning_rule_workers")
    rule_rates = [p.samples_per_s for p in pooled.values() if p.num_workers == rule]
    if rule_rates:
        evidence["lightning_rule_samples_per_s"] = round(max(rule_rates), 2)
    rec = recommended.settings()
    text = (
        f"recommend num_workers={rec['num_workers']} prefetch_factor={rec['prefetch_factor']} "
        f"({rec['samples_per_s']:.0f} samples/s; best {best.config} {best.samples_per_s:.0f}, "
        f"noise ±{evidence['noise_margin_pct']}%); knee at {evidence['knee_workers']} workers; "
        f"Lightning's rule says {rule}"
    )
    verdict = "pass"
    if current_pooled is not None:
        text += f"; current {current_pooled.config} {current_pooled.samples_per_s:.0f} samples/s"
        if not within_noise(current_pooled, best):
            verdict = "warn"
            text += f", {100 * (1 - current_pooled.samples_per_s / best.samples_per_s):.0f}% below the best"
    if evidence["noisy"]:
        text += (
            f"; measurements scattered by more than ±{100 * MAX_NOISE_MARGIN:.0f}% (a busy node?): "
            "rerun with a longer --budget where nothing else runs"
        )
    return Finding(probe=PROBE, check="loader_throughput", verdict=verdict, summary=text, evidence=evidence)


def recommendations(findings: list[Finding]) -> list[Recommendation]:
    """dataloader.* settings from a loader_throughput finding; none where the current value already
    matches or nothing was measured (GUIDE: no recommendation without a measurement behind it)."""
    found = next((f for f in findings if f.check == "loader_throughput" and f.verdict != "not_run"), None)
    if found is None:
        return []
    ev = found.evidence
    rec, current = ev["recommended"], ev.get("current") or {}
    confidence = "high" if ev.get("noise_margin_pct", 100) <= 100 * NOISE_FLOOR * 2 else "medium"
    if ev.get("noisy"):
        confidence = "low"
    why = (
        f"smallest configuration within the measurement noise ({ev['noise_margin_pct']}%) of the best "
        f"({ev['best']['samples_per_s']} samples/s) on a CPU budget of {ev['cpu_budget_per_rank']} per rank"
    )
    out = []
    for key in CONFIG_KEYS:
        if key in current and current[key] == rec[key]:
            continue
        out.append(
            Recommendation(
                setting=f"dataloader.{key}",
                value=rec[key],
                current=current.get(key),
                why=why,
                confidence=confidence,
                evidence={
                    "recommended_samples_per_s": rec["samples_per_s"],
                    "current_samples_per_s": ev.get("current_samples_per_s"),
                },
            )
        )
    return out
