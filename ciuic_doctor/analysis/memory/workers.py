"""`worker_memory_growth`: does each rank's DataLoader workers' memory grow while they run?

USS (memory only that worker holds) of each worker over time, judged with the memory analysis's growth
test (`_grows`, floor 16 MiB); USS rising while RSS stays put is copy-on-read: refcount writes un-share
the forked pages of the dataset's Python objects (pytorch/pytorch#13246). A rank warns when half its
workers or more grow. Judged per rank and reported as one finding over the job (`memory.ranks`).
Split from `memory.py` (the contract of the evidence is in its docstring).
"""

from __future__ import annotations

import statistics

from ciuic_doctor.analysis.memory.columns import pid_of
from ciuic_doctor.analysis.memory.data import MIB, MIN_POINTS, PROBE, Series, _Data, _grows, _not_run, _trend
from ciuic_doctor.analysis.memory.ranks import one_per_job
from ciuic_doctor.rundir.findings import Finding

WORKER_MIN_BYTES = 16 * MIB
WORKER_KEYS = ("workers", "growing_workers", "uss_growth_mb", "rss_growth_mb", "pattern")


def worker_findings(data: _Data) -> list[Finding]:
    """One finding over every rank: USS of each rank's DataLoader workers over time (copy-on-read shows
    as USS growth, flat RSS), the ranks whose workers grow named worst (largest median growth) first."""
    ranks = sorted({int(r.rsplit(" ", 1)[1]) for r in data.role_pids if r.startswith("worker of rank ")})
    if not ranks:
        return [_not_run("worker_memory_growth", "memwatch saw no DataLoader workers (no child of a rank)")]
    findings = [_rank_workers(data, rank) for rank in ranks]
    return [
        one_per_job(
            "worker_memory_growth",
            findings,
            severity=lambda f: f.evidence["uss_growth_mb"],
            keys=WORKER_KEYS,
            what="DataLoader worker memory growth",
        )
    ]


def _rank_workers(data: _Data, rank: int) -> Finding:
    pids = data.role_pids[f"worker of rank {rank}"]
    fits = []
    for pid in pids:
        samples = data.by_pid[pid]
        t0 = samples[0]["t"]
        trends = {}
        for metric in ("uss", "rss", "pss"):
            points = [(s["t"] - t0, s[metric]) for s in samples if s.get(metric) is not None]
            series = Series(
                x=[p[0] for p in points],
                y=[p[1] for p in points],
                x_unit="s",
                metric=metric,
                source="memwatch",
                pid=pid_of(pid),
            )
            trends[metric] = _trend(series)
        if trends["uss"] is not None:
            fits.append((pid, trends))
    host = next((h for pid in pids if (h := data.by_pid[pid][0].get("host"))), None)
    where = {"rank": rank, **({"host": host} if host else {})}
    if not fits:
        why = f"rank {rank}: workers' USS not readable or too few samples per worker (< {MIN_POINTS})"
        return _not_run("worker_memory_growth", why, where=where)
    growing = [pid for pid, t in fits if _grows(t["uss"], WORKER_MIN_BYTES)]

    def median_growth(metric: str, fits: list = fits) -> float | None:
        values = [t[metric].growth for _, t in fits if t[metric] is not None]
        return statistics.median(values) / MIB if values else None

    uss_mb, rss_mb = median_growth("uss"), median_growth("rss")
    copy_on_read = uss_mb > 0 and (rss_mb is None or rss_mb < 0.5 * uss_mb)
    evidence = {
        "workers": len(fits),
        "growing_workers": len(growing),
        "pids": [pid_of(pid) for pid, _ in fits],
        "uss_slope_bytes_per_s": round(statistics.median(t["uss"].slope for _, t in fits), 1),
        "uss_growth_mb": round(uss_mb, 2),
        "rss_growth_mb": None if rss_mb is None else round(rss_mb, 2),
        "pss_growth_mb": None if (pss := median_growth("pss")) is None else round(pss, 2),
        "total_uss_growth_mb": round(sum(t["uss"].growth for _, t in fits) / MIB, 2),
        "pattern": "copy_on_read" if copy_on_read else "private_growth",
    }
    if 2 * len(growing) >= len(fits):
        how = (
            "USS grows while RSS stays flat: copy-on-read of the dataset's Python objects (refcount "
            "writes un-share forked pages); keep them in numpy arrays, bytes or Arrow instead of lists "
            "of objects"
            if copy_on_read
            else "RSS grows with USS: the workers allocate (a cache in the Dataset?)"
        )
        verdict = "warn"
        summary = f"rank {rank}: {len(growing)} of {len(fits)} workers grow ~{uss_mb:.0f} MiB each: {how}"
    else:
        verdict = "pass"
        summary = f"rank {rank}: workers' USS flat (median {uss_mb:+.1f} MiB over the watch)"
    return Finding(
        probe=PROBE,
        check="worker_memory_growth",
        verdict=verdict,
        summary=summary,
        evidence=evidence,
        where=where,
    )
