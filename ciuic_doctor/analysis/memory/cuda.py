"""The CUDA side of the memory analysis: fragmentation, non-PyTorch device memory, empty_cache.

Split from `memory.py` (which owns the contract in its docstring; the data layer is `memory.data`) to
keep each module readable in one sitting. Facts (reference/memory.md): there is no single fragmentation
key — the signals are reserved − allocated, inactive_split_bytes, and num_alloc_retries > 0 (the allocator
freed its cache and retried a failed cudaMalloc); the OOM message itself advises
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` when reserved-but-unallocated is large; the NVML
per-process figure is always ≥ reserved and the difference is memory PyTorch cannot see (CUDA
context ~0.3–1 GB, cuBLAS workspaces, NCCL buffers); and empty_cache() "does not increase the amount of
GPU memory available for PyTorch" (PyTorch docs) — it returns cached blocks to the driver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ciuic_doctor.analysis.memory.batch import steps_fits
from ciuic_doctor.analysis.memory.cuda_figures import Fragmentation, fragmentation_figures, non_pytorch_fits
from ciuic_doctor.analysis.memory.data import (
    MIB,
    MIN_POINTS,
    PROBE,
    _Data,
    _not_run,
    _slope_evidence,
)
from ciuic_doctor.analysis.memory.ranks import one_per_job
from ciuic_doctor.analysis.stats.trend import robust_trend
from ciuic_doctor.rundir.findings import Finding

EXPANDABLE = "expandable_segments:True"


@dataclass(kw_only=True)
class _Last:
    """What a non-PyTorch finding says of a rank's series: its last value and host."""

    y_end: float
    host: str | None


NON_PYTORCH_MIN_BYTES = 64 * MIB  # NCCL grows in whole buffers (4 MiB default per channel and peer)
UNUSED_CACHE_FRACTION = 0.25
UNUSED_CACHE_MIN_BYTES = 2**30


def _num(value: float) -> float | None:
    """A grouped median as the row code had it: None where the rank had no value."""
    return None if math.isnan(value) else float(value)


def _fragmentation(figures: Fragmentation, i: int, host: str | None) -> tuple[Finding, dict[str, Any]]:
    """One rank's fragmentation judgement from its grouped figures (`fragmentation_figures`)."""
    rank = figures.ranks[i]
    reserved = float(figures.reserved[i])
    allocated, peak = _num(figures.allocated[i]), _num(figures.peak[i])
    unused = None if peak is None else max(0.0, reserved - peak)
    retries = int(figures.retries[i])
    evidence = {
        "reserved_minus_allocated_bytes": None if allocated is None else round(reserved - allocated),
        "reserved_minus_peak_bytes": None if unused is None else round(unused),
        "inactive_split_bytes": _num(figures.inactive_split[i]),
        "alloc_retries": retries,
        "reserved_bytes": round(reserved),
        "allocated_bytes": None if allocated is None else round(allocated),
        "peak_bytes": None if peak is None else round(peak),
        "suggested_alloc_conf": None,
    }
    problems = []
    if retries:
        problems.append(f"{retries} allocator retries (cache flushed after a failed cudaMalloc)")
    if unused is not None and unused >= UNUSED_CACHE_MIN_BYTES and unused >= UNUSED_CACHE_FRACTION * reserved:
        problems.append(f"{unused / 2**30:.1f} GiB reserved beyond the step's peak ({unused / reserved:.0%})")
    where = {"rank": rank, **({"host": host} if host else {})}
    if problems:
        evidence["suggested_alloc_conf"] = EXPANDABLE
        summary = f"rank {rank}: {'; '.join(problems)}: try PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}"
        return Finding(
            probe=PROBE,
            check="fragmentation",
            verdict="warn",
            summary=summary,
            evidence=evidence,
            where=where,
        ), evidence
    gap = "" if unused is None else f", {unused / MIB:.0f} MiB reserved beyond the peak"
    summary = f"rank {rank}: no allocator retries{gap}"
    return Finding(
        probe=PROBE, check="fragmentation", verdict="pass", summary=summary, evidence=evidence, where=where
    ), evidence


def _non_pytorch(data: _Data) -> tuple[Finding, list[int]]:
    """The job's one non_pytorch_device_memory finding (growing ranks first, steepest first) and the
    growing ranks in rank order. Every rank's NVML − reserved series is built and fitted in one grouped
    pass (`memory.batch.non_pytorch_fits`)."""
    if not data.memwatch.has("gpu_bytes"):
        why = f"no per-process GPU memory from NVML ({data.gpu_absent_reason()})"
        return _not_run("non_pytorch_device_memory", why), []
    batch = non_pytorch_fits(data)
    fits = batch.fits
    grows_all = fits.grows(NON_PYTORCH_MIN_BYTES)
    findings, growing = [], []
    for i, rank in enumerate(fits.ranks):
        if batch.points[i] < MIN_POINTS:
            why = f"rank {rank}: needs NVML samples and watch's steps (mem_reserved) in the same RUN"
            findings.append(_not_run("non_pytorch_device_memory", why, where={"rank": rank}))
            continue
        trend = fits.trends.trend(i)
        if trend is None:
            why = f"rank {rank}: too few steps after warm-up"
            findings.append(_not_run("non_pytorch_device_memory", why, where={"rank": rank}))
            continue
        series = _Last(y_end=float(batch.last[i]), host=fits.host[i])
        grows = bool(grows_all[i])
        level = float(batch.level[i])
        evidence = {
            "bytes": round(level),
            "bytes_end": round(series.y_end),
            "growing": grows,
            "slope": round(trend.slope, 1),
            "slope_unit": "bytes_per_step",
            **_slope_evidence(trend, "step"),
        }
        if grows:
            growing.append(rank)
            summary = (
                f"rank {rank}: memory outside PyTorch's allocator grows {trend.slope / MIB:.2f} MiB/step "
                f"(now {series.y_end / MIB:.0f} MiB): the NCCL-buffer claim holds here; empty_cache cannot "
                "free it"
            )
        else:
            summary = (
                f"rank {rank}: {level / MIB:.0f} MiB outside PyTorch's allocator (CUDA context, cuBLAS, "
                "NCCL), stable: no NCCL buffer growth here"
            )
        findings.append(
            Finding(
                probe=PROBE,
                check="non_pytorch_device_memory",
                verdict="warn" if grows else "pass",
                summary=summary,
                evidence=evidence,
                where={"rank": rank, **({"host": series.host} if series.host else {})},
            )
        )
    one = one_per_job(
        "non_pytorch_device_memory",
        findings,
        severity=lambda f: (f.evidence["slope"], f.evidence["bytes"]),
        keys=("bytes", "bytes_end", "growing", "slope"),
        what="growth of memory outside PyTorch's allocator",
    )
    return one, growing


def _reserved_growing(data: _Data, ranks: list[int]) -> list[int]:
    """Ranks (of `ranks`) whose reserved bytes grow (the shared growth test, 64 MiB floor) while their
    allocated bytes grow less than half as fast: the cache fragments. Reserved is fitted for every rank
    in one grouped pass; allocated only for the ranks whose reserved grows."""
    # every rank's fit (a pass `memory.analyze` runs ahead with the others), then only `ranks`: a rank
    # with a finite reserved value has fragmentation figures, so the fit of `ranks` alone is the same
    fits = steps_fits(data, "mem_reserved")
    out = []
    wanted = set(ranks)
    for i in fits.grows(NON_PYTORCH_MIN_BYTES).nonzero()[0].tolist():
        if fits.ranks[i] not in wanted:
            continue
        rank, reserved = fits.ranks[i], fits.trends.trend(i)
        ax, ay = data.steps_field(rank, "mem_allocated")
        allocated = robust_trend(ax, ay) if len(ax) >= MIN_POINTS else None
        if allocated is None or allocated.slope < 0.5 * reserved.slope:
            out.append(rank)
    return out


def _empty_cache(data: _Data, frag: dict[int, dict[str, Any]], nonpt_growing: list[int]) -> Finding:
    if not frag:
        return _not_run(
            "empty_cache",
            "no CUDA allocator fields in the steps (mem_reserved): empty_cache only affects the CUDA cache",
        )
    retries = sum(e["alloc_retries"] for e in frag.values())
    unused = max((e["reserved_minus_peak_bytes"] or 0) for e in frag.values())
    reserved_growing = _reserved_growing(data, sorted(frag))
    evidence = {
        "recommend_periodic_empty_cache": False,
        "alloc_retries": retries,
        "reserved_growing_ranks": reserved_growing,
        "non_pytorch_growing_ranks": nonpt_growing,
        "unused_cache_bytes": round(unused),
    }
    if nonpt_growing:
        verdict = "warn"
        summary = (
            f"memory outside PyTorch grows on ranks {nonpt_growing}: empty_cache cannot free it; at best it "
            f"hands back {unused / MIB:.0f} MiB of cache and delays the OOM — find the growth instead"
        )
        evidence["recommend_periodic_empty_cache"] = unused >= UNUSED_CACHE_MIN_BYTES  # a stopgap only
    elif reserved_growing:
        verdict = "warn"
        summary = (
            f"reserved grows faster than allocated on ranks {reserved_growing} (the cache fragments): "
            f"empty_cache would trim it at the cost of re-allocating; PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} "
            "addresses the cause"
        )
    elif retries:
        verdict = "warn"
        summary = (
            f"the allocator already flushes its cache and retries on a failed cudaMalloc ({retries} times "
            "here): a periodic empty_cache adds nothing; the device is nearly full"
        )
    else:
        verdict = "pass"
        summary = (
            "no call for empty_cache: reserved is stable and the allocator never retried; calling it "
            "periodically only makes the next steps cudaMalloc the same blocks again"
        )
    # the ranks the warning is about, as every per-job finding names them (the report lists them)
    named = nonpt_growing or (reserved_growing if verdict == "warn" else [])
    where = {"rank": named[0], "ranks": named} if named else {}
    return Finding(
        probe=PROBE, check="empty_cache", verdict=verdict, summary=summary, evidence=evidence, where=where
    )


def _frag_severity(finding: Finding) -> tuple[float, float]:
    """Retries first (a near-OOM sign), then the cache held beyond the step's peak."""
    ev = finding.evidence
    return float(ev["alloc_retries"]), float(ev["reserved_minus_peak_bytes"] or 0)


FRAG_KEYS = (
    "alloc_retries",
    "reserved_minus_peak_bytes",
    "reserved_minus_allocated_bytes",
    "inactive_split_bytes",
    "reserved_bytes",
)


def cuda_findings(data: _Data) -> list[Finding]:
    """One fragmentation finding, one non-PyTorch device memory finding (each over every rank, worst
    rank first), and the empty_cache verdict."""
    findings: list[Finding] = []
    frag: dict[int, dict[str, Any]] = {}
    per_rank: list[Finding] = []
    figures = fragmentation_figures(data)  # every rank's medians in one grouped pass
    for i, rank in enumerate(figures.ranks):
        finding, frag[rank] = _fragmentation(figures, i, data.steps.host(rank))
        per_rank.append(finding)
    if not frag:
        findings.append(
            _not_run("fragmentation", "no CUDA allocator fields in the steps (mem_reserved/mem_allocated)")
        )
    else:
        findings.append(
            one_per_job(
                "fragmentation", per_rank, severity=_frag_severity, keys=FRAG_KEYS, what="fragmentation"
            )
        )
    nonpt, growing = _non_pytorch(data)
    findings.append(nonpt)
    findings.append(_empty_cache(data, frag, growing))
    return findings
