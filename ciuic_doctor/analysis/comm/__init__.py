"""Judge comm-bench records (stream `comm`): correctness, bandwidth, ring vs tree, stragglers, floors.

Checks (probe "comm"):
  correctness         fail when any element of any row was wrong
  busbw               one per collective: average and peak busbw (warn at world size 1: busbw is 0 there)
  algo_choice         all_reduce ring vs tree at the job's gradient-bucket sizes -> recommended_nccl_algo,
                      or null (leave NCCL_ALGO unset) when they are within noise; not_run on gloo
  straggler           a rank whose own time is the longest (or >= 5 % over the row's median) in most
                      rows; other ranks as slow are named with it (a slow link slows both its ends)
  busbw_floor         each table's average busbw against --min-busbw (fails below 0.9 x, as nccl-tests)
  collective_support  not_run for each collective the backend could not run

Pure functions of the records (and the probe's config in meta.json), so they are tested on recorded
records without torch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from ciuic_doctor.machine import nccl
from ciuic_doctor.measures.ranks import (  # noqa: F401 - part of this module's API
    STRAGGLER_MIN_ROWS,
    STRAGGLER_PCT,
    STRAGGLER_SHARE,
    slowest_rank,
)
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir, as_float
from ciuic_doctor.units import format_bytes

STREAMS = ("comm",)
PROBE = "comm"
COMMAND = "comm-bench"
DEFAULT_BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb default
# Two timings closer than this are not told apart: repeated nccl-tests runs on a quiet cluster already
# differ by a few percent, and a recommendation inside that band would be folklore again.
NOISE_PCT = 5.0
FLOOR_FRACTION = 0.9  # nccl-tests fails a run whose average busbw is below 0.9 x the floor


def analyze(run: RunDir) -> list[Finding]:
    from ciuic_doctor.rundir.frames import read_records

    probe = run.read_meta().get("probes", {}).get(COMMAND, {})
    config = probe.get("config") or {}
    return analyze_records(
        read_records(run, "comm"),
        bucket_bytes=int(config.get("bucket_bytes") or DEFAULT_BUCKET_BYTES),
        min_busbw_gbps=as_float(config.get("min_busbw_gbps")),
    )


def analyze_records(
    records: list[dict[str, Any]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    min_busbw_gbps: float | None = None,
) -> list[Finding]:
    ok = [r for r in records if r.get("status", "ok") == "ok" and "collective" in r]
    skipped = [r for r in records if r.get("status") == "not_run"]
    findings = [correctness(ok)]
    findings += busbw(ok)
    findings.append(algo_choice(ok, bucket_bytes=bucket_bytes))
    findings.append(straggler(ok))
    findings.append(busbw_floor(ok, min_busbw_gbps))
    findings += collective_support(ok, skipped)
    return findings


def _label(r: dict[str, Any]) -> str:
    where = "in-place" if r.get("inplace") else "out-of-place"
    return f"{r['collective']} {format_bytes(r['bytes'])} {where} (algo {r.get('algo', 'default')})"


def correctness(rows: list[dict[str, Any]]) -> Finding:
    if not rows:
        return Finding(probe=PROBE, check="correctness", verdict="not_run", summary="no measured rows")
    bad = [r for r in rows if int(r.get("wrong") or 0) > 0]
    total = sum(int(r["wrong"]) for r in bad)
    evidence = {
        "rows_checked": len(rows),
        "total_wrong": total,
        "wrong_rows": [
            {k: r.get(k) for k in ("collective", "algo", "bytes", "inplace", "wrong")} for r in bad[:20]
        ],
    }
    if bad:
        return Finding(
            probe=PROBE,
            check="correctness",
            verdict="fail",
            evidence=evidence,
            summary=f"{total} wrong elements in {len(bad)} of {len(rows)} rows, first {_label(bad[0])}: "
            "a collective returned a wrong result (bad link, GPU or library)",
        )
    return Finding(
        probe=PROBE,
        check="correctness",
        verdict="pass",
        evidence=evidence,
        summary=f"all {len(rows)} rows exact (inputs chosen so any reduction order gives the same result)",
    )


def _avg(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def busbw(rows: list[dict[str, Any]]) -> list[Finding]:
    by_collective: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_collective[r["collective"]].append(r)
    findings = []
    for collective in sorted(
        by_collective, key=lambda c: nccl.COLLECTIVES.index(c) if c in nccl.COLLECTIVES else 99
    ):
        group = by_collective[collective]
        per_algo: dict[str, dict[str, float]] = {}
        for algo in sorted({r.get("algo", "default") for r in group}):
            values = [as_float(r["busbw_gbps"]) or 0.0 for r in group if r.get("algo", "default") == algo]
            per_algo[algo] = {
                "avg_busbw_gbps": _avg(values),
                "peak_busbw_gbps": max(values),
                "rows": len(values),
            }
        best_algo = max(per_algo, key=lambda a: per_algo[a]["avg_busbw_gbps"])
        peak_row = max(group, key=lambda r: as_float(r["busbw_gbps"]) or 0.0)
        world = int(group[0].get("world_size") or 0)
        evidence = {
            "collective": collective,
            "backend": group[0].get("backend"),
            "world_size": world,
            "dtype": group[0].get("dtype"),
            "algo": best_algo,
            "avg_busbw_gbps": per_algo[best_algo]["avg_busbw_gbps"],
            "peak_busbw_gbps": as_float(peak_row["busbw_gbps"]),
            "peak_bytes": peak_row["bytes"],
            "max_time_us": max(as_float(r["time_us"]) or 0.0 for r in group),
            "sizes": len({r["bytes"] for r in group}),
            "per_algo": per_algo,
        }
        summary = (
            f"{collective}: average busbw {evidence['avg_busbw_gbps']:.3g} GB/s, peak "
            f"{evidence['peak_busbw_gbps']:.3g} GB/s at {format_bytes(peak_row['bytes'])} "
            f"({world} ranks, {evidence['backend']}" + (f", algo {best_algo})" if len(per_algo) > 1 else ")")
        )
        verdict = "pass"
        if world == 1:
            verdict = "warn"
            summary += "; world size 1: busbw is 0 by definition, launch several ranks to measure a bus"
        findings.append(
            Finding(
                probe=PROBE,
                check="busbw",
                verdict=verdict,
                summary=summary,
                evidence=evidence,
                where={"collective": collective},
            )
        )
    return findings


def _near_bucket(sizes: list[int], bucket_bytes: int) -> tuple[list[int], bool]:
    """Measured sizes within a factor 2 of the bucket size; else the nearest one (and False)."""
    near = [s for s in sizes if bucket_bytes / 2 <= s <= bucket_bytes * 2]
    if near:
        return near, True
    nearest = min(sizes, key=lambda s: abs(math.log(s / bucket_bytes)))
    return [nearest], False


def algo_choice(rows: list[dict[str, Any]], *, bucket_bytes: int) -> Finding:
    reduce_rows = [r for r in rows if r["collective"] == "all_reduce"]
    backend = reduce_rows[0].get("backend") if reduce_rows else (rows[0].get("backend") if rows else None)
    version = next((r.get("nccl_version") for r in reduce_rows if r.get("nccl_version")), None)
    evidence: dict[str, Any] = {
        "backend": backend,
        "nccl_version": version,
        "per_size": [],
        "bucket_bytes": bucket_bytes,
        "recommended_nccl_algo": None,
        "noise_pct": NOISE_PCT,
    }

    def not_run(reason: str) -> Finding:
        evidence["reason"] = reason
        return Finding(probe=PROBE, check="algo_choice", verdict="not_run", summary=reason, evidence=evidence)

    if backend != "nccl":
        return not_run(f"{backend or 'this backend'} has one all_reduce algorithm: ring vs tree needs NCCL")
    if int(reduce_rows[0].get("world_size") or 1) < 2:
        return not_run("one rank: no algorithm moves any data, so ring and tree cannot differ")
    ring = {r["bytes"]: r for r in reduce_rows if r.get("algo") == "ring"}
    tree = {r["bytes"]: r for r in reduce_rows if r.get("algo") == "tree"}
    sizes = sorted(set(ring) & set(tree))
    if not sizes:
        return not_run("all_reduce was not measured with both ring and tree (--algos ring,tree)")
    for size in sizes:
        rt, tt = as_float(ring[size]["time_us"]) or 0.0, as_float(tree[size]["time_us"]) or 0.0
        diff_pct = abs(rt - tt) / min(rt, tt) * 100 if min(rt, tt) > 0 else 0.0
        evidence["per_size"].append(
            {
                "bytes": size,
                "ring_time_us": rt,
                "tree_time_us": tt,
                "ring_busbw_gbps": as_float(ring[size]["busbw_gbps"]),
                "tree_busbw_gbps": as_float(tree[size]["busbw_gbps"]),
                "faster": "ring" if rt <= tt else "tree",
                "difference_pct": diff_pct,
                "within_noise": diff_pct < NOISE_PCT,
                "ring_algo_used": ring[size].get("algo_used"),
                "tree_algo_used": tree[size].get("algo_used"),
            }
        )
    judged, in_range = _near_bucket(sizes, bucket_bytes)
    evidence["judged_bytes"] = judged
    at_bucket = [p for p in evidence["per_size"] if p["bytes"] in judged]
    winners = {p["faster"] for p in at_bucket if not p["within_noise"]}
    nearest = "the" if in_range else "the measured size nearest the"
    where = f"at {nearest} {format_bytes(bucket_bytes)} bucket size"
    # The TUNING log (NCCL >= 2.23.4) says what NCCL really ran; a forced algorithm it did not honour
    # makes the comparison moot at that size.
    ignored = [
        {"bytes": p["bytes"], "forced": algo, "used": p[f"{algo}_algo_used"]}
        for p in evidence["per_size"]
        for algo in ("ring", "tree")
        if p[f"{algo}_algo_used"] not in (None, algo)
    ]
    if any(i["bytes"] in judged for i in ignored):
        evidence["reason"] = (
            f"NCCL's TUNING log shows it did not run the forced algorithm {where}, so the comparison does "
            "not hold there: leave NCCL_ALGO unset"
        )
        verdict, summary = "pass", f"all_reduce: {evidence['reason']}"
    elif len(winners) == 1 and all(not p["within_noise"] for p in at_bucket):
        winner = winners.pop()
        value = nccl.nccl_algo_env(winner, nccl.parse_version(version))
        gain = min(p["difference_pct"] for p in at_bucket)
        evidence["recommended_nccl_algo"] = value
        evidence["reason"] = (
            f"{winner} is faster by at least {gain:.0f}% {where} "
            f"({', '.join(format_bytes(b) for b in judged)})"
        )
        verdict, summary = "warn", f"all_reduce: set NCCL_ALGO={value}: {evidence['reason']}"
    else:
        evidence["reason"] = (
            f"ring and tree are within {NOISE_PCT:g}% of each other or trade places {where}: leave NCCL_ALGO "
            "unset and let NCCL's tuner choose per size"
        )
        verdict, summary = "pass", f"all_reduce: {evidence['reason']}"
    if ignored:
        evidence["not_honoured"] = ignored
        summary += f"; NCCL's TUNING log shows the forced algorithm was not used in {len(ignored)} row(s)"
    return Finding(probe=PROBE, check="algo_choice", verdict=verdict, summary=summary, evidence=evidence)


def straggler(rows: list[dict[str, Any]]) -> Finding:
    """The rank that is slowest in most rows, by a margin over the median of the other ranks."""
    slow = slowest_rank(rows)
    if slow is None:
        return Finding(
            probe=PROBE,
            check="straggler",
            verdict="not_run",
            summary="needs per-rank times from at least 2 ranks",
        )
    rank, count, slowdown, hosts = slow.rank, slow.rows_slowest, slow.slowdown_pct, slow.hosts
    evidence = {
        "rank": rank,
        "host": hosts.get(rank),
        "slowdown_pct": slowdown,
        "rows_slowest": count,
        "rows": slow.rows,
        "threshold_pct": STRAGGLER_PCT,
    }
    if slow.is_straggler:
        where = {"rank": rank, "host": hosts.get(rank)}
        summary = (
            f"rank {rank} on {hosts.get(rank) or '?'} is slow in {max(count, slow.rows_slow)} of {slow.rows} "
            f"rows, by {slowdown:.0f}% (median) over the other ranks"
        )
        if slow.peers:  # two ranks slow alike: the link between them (or what they share)
            where["ranks"] = [rank, *slow.peers]
            evidence["peers"] = slow.peers
            summary += (
                f", and so are rank(s) {', '.join(map(str, slow.peers))}: a slow link between them, or a "
                "switch or NIC they share"
            )
        return Finding(
            probe=PROBE, check="straggler", verdict="warn", evidence=evidence, where=where, summary=summary
        )
    return Finding(
        probe=PROBE,
        check="straggler",
        verdict="pass",
        evidence={**evidence, "rank": None, "host": None},
        summary=f"no rank is consistently slower (most often slowest: rank {rank}, {count} of "
        f"{slow.rows} rows, median {slowdown:.1f}%)",
    )


def busbw_floor(rows: list[dict[str, Any]], min_busbw_gbps: float | None) -> Finding:
    if min_busbw_gbps is None:
        return Finding(
            probe=PROBE, check="busbw_floor", verdict="not_run", summary="no --min-busbw floor was given"
        )
    tables: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        tables[f"{r['collective']} (algo {r.get('algo', 'default')})"].append(
            as_float(r["busbw_gbps"]) or 0.0
        )
    averages = {name: _avg(values) for name, values in tables.items()}
    threshold = FLOOR_FRACTION * min_busbw_gbps
    below = {name: avg for name, avg in averages.items() if avg < threshold}
    evidence = {
        "min_busbw_gbps": min_busbw_gbps,
        "threshold_gbps": threshold,
        "tables": averages,
        "below": sorted(below),
    }
    if not averages:
        return Finding(
            probe=PROBE, check="busbw_floor", verdict="not_run", summary="no measured rows", evidence=evidence
        )
    if below:
        listed = ", ".join(f"{name} {avg:.3g}" for name, avg in below.items())
        return Finding(
            probe=PROBE,
            check="busbw_floor",
            verdict="fail",
            evidence=evidence,
            summary=f"average busbw below {threshold:.3g} GB/s (0.9 x {min_busbw_gbps:g}): {listed}",
        )
    return Finding(
        probe=PROBE,
        check="busbw_floor",
        verdict="pass",
        evidence=evidence,
        summary=f"every table averages at least {threshold:.3g} GB/s (0.9 x {min_busbw_gbps:g})",
    )


def collective_support(rows: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> list[Finding]:
    findings = []
    seen = set()
    for r in skipped:
        key = (r.get("collective"), r.get("backend"))
        if key in seen:
            continue
        seen.add(key)
        findings.append(
            Finding(
                probe=PROBE,
                check="collective_support",
                verdict="not_run",
                summary=f"{r.get('collective')} not run on {r.get('backend')}: {r.get('reason')}",
                evidence={
                    "collective": r.get("collective"),
                    "backend": r.get("backend"),
                    "reason": r.get("reason"),
                },
                where={"collective": r.get("collective")},
            )
        )
    ran = sorted({r["collective"] for r in rows})
    if ran and not findings:
        backend = rows[0].get("backend")
        findings.append(
            Finding(
                probe=PROBE,
                check="collective_support",
                verdict="pass",
                summary=f"every requested collective ran on {backend}: {', '.join(ran)}",
                evidence={"backend": backend, "collectives": ran},
            )
        )
    return findings
