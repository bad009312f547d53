"""The CUDA side of the memory analysis: fragmentation, non-PyTorch device memory, empty_cache.

Split from `memory.py` (which owns the contract in its docstring; the data layer is `_memory_data`) to
keep each module readable in one sitting. Facts (reference/memory.md): there is no single fragmentation
key — the signals are reserved − allocated, inactive_split_bytes, and num_alloc_retries > 0 (the allocator
freed its cache and retried a failed cudaMalloc); the OOM message itself advises
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` when reserved-but-unallocated is large; the NVML
per-process figure is always ≥ reserved and the difference is memory PyTorch cannot see (CUDA
context ~0.3–1 GB, cuBLAS workspaces, NCCL buffers); and empty_cache() "does not increase the amount of
GPU memory available for PyTorch" (PyTorch docs) — it returns cached blocks to the driver.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

from ciuic_doctor.analysis._memory_data import (
    MIB,
    MIN_POINTS,
    PROBE,
    WARMUP_STEPS,
    Series,
    _Data,
    _grows,
    _not_run,
    _slope_evidence,
    _trend,
)
from ciuic_doctor.analysis._memory_ranks import one_per_job
from ciuic_doctor.analysis._trend import robust_trend
from ciuic_doctor.findings import Finding
from ciuic_doctor.store import as_float

EXPANDABLE = "expandable_segments:True"
NON_PYTORCH_MIN_BYTES = 64 * MIB  # NCCL grows in whole buffers (4 MiB default per channel and peer)
UNUSED_CACHE_FRACTION = 0.25
UNUSED_CACHE_MIN_BYTES = 2**30


def _steady(data: _Data, rank: int) -> list[dict[str, Any]]:
    """The rank's step records after warm-up that carry CUDA allocator fields."""
    records = [r for r in data.steps.get(rank, []) if as_float(r.get("mem_reserved")) is not None]
    if not records:
        return []
    first = min(float(r["step"]) for r in records)
    return [r for r in records if float(r["step"]) >= first + WARMUP_STEPS] or records


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [v for r in records if (v := as_float(r.get(key))) is not None]
    return statistics.median(values) if values else None


def _retries(records: list[dict[str, Any]]) -> int:
    """num_alloc_retries is a counter since process start: its last value when it never decreases,
    else (a per-step figure) the sum."""
    values = [int(v) for r in records if (v := as_float(r.get("alloc_retries"))) is not None]
    if not values:
        return 0
    monotone = all(b >= a for a, b in itertools.pairwise(values))
    return values[-1] if monotone else sum(values)


def _fragmentation(data: _Data, rank: int) -> tuple[Finding, dict[str, Any]]:
    records = _steady(data, rank)
    reserved, allocated = _median(records, "mem_reserved"), _median(records, "mem_allocated")
    peak = _median(records, "mem_active_peak")
    unused = None if peak is None or reserved is None else max(0.0, reserved - peak)
    retries = _retries(data.steps.get(rank, []))
    evidence = {
        "reserved_minus_allocated_bytes": None if allocated is None else round(reserved - allocated),
        "reserved_minus_peak_bytes": None if unused is None else round(unused),
        "inactive_split_bytes": _median(records, "inactive_split_bytes"),
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
    host = data.steps.host(rank)
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


def _non_pytorch_series(data: _Data, rank: int) -> Series | None:
    """NVML bytes − reserved at each memwatch sample, reserved from the rank's last step before it."""
    import bisect

    steps = [r for r in data.steps.get(rank, []) if as_float(r.get("mem_reserved")) is not None]
    samples = [s for s in data.rank_samples(rank) if s.get("gpu_bytes") is not None]
    if len(steps) < 2 or not samples:
        return None
    step_t = [float(r["t"]) for r in steps]
    times, diffs = [], []
    for sample in samples:
        index = bisect.bisect_right(step_t, sample["t"]) - 1
        if index >= 0:  # a sample after the last step maps to NaN below and is dropped
            times.append(sample["t"])
            diffs.append(sample["gpu_bytes"] - float(steps[index]["mem_reserved"]))
    x = data.step_of(rank, times) or []
    keep = [(a, b) for a, b in zip(x, diffs, strict=False) if not math.isnan(a)]  # NaN: after the last step
    return Series(
        x=[a for a, _ in keep],
        y=[b for _, b in keep],
        x_unit="step",
        metric="nvml_minus_reserved_bytes",
        source="memwatch+steps",
        pid=samples[0]["pid"],
        host=samples[0].get("host"),
    )


def _non_pytorch(data: _Data) -> tuple[Finding, list[int]]:
    """The job's one non_pytorch_device_memory finding (growing ranks first, steepest first) and the
    growing ranks in rank order."""
    has_gpu = any(s.get("gpu_bytes") is not None for s in data.samples)
    if not has_gpu:
        why = f"no per-process GPU memory from NVML ({data.gpu_absent_reason()})"
        return _not_run("non_pytorch_device_memory", why), []
    findings, growing = [], []
    for rank in data.ranks():
        series = _non_pytorch_series(data, rank)
        if series is None or len(series.x) < MIN_POINTS:
            why = f"rank {rank}: needs NVML samples and watch's steps (mem_reserved) in the same RUN"
            findings.append(_not_run("non_pytorch_device_memory", why, where={"rank": rank}))
            continue
        trend = _trend(series)
        if trend is None:
            why = f"rank {rank}: too few steps after warm-up"
            findings.append(_not_run("non_pytorch_device_memory", why, where={"rank": rank}))
            continue
        grows = _grows(trend, NON_PYTORCH_MIN_BYTES)
        level = statistics.median(series.y)
        evidence = {
            "bytes": round(level),
            "bytes_end": round(series.y[-1]),
            "growing": grows,
            "slope": round(trend.slope, 1),
            "slope_unit": "bytes_per_step",
            **_slope_evidence(trend, "step"),
        }
        if grows:
            growing.append(rank)
            summary = (
                f"rank {rank}: memory outside PyTorch's allocator grows {trend.slope / MIB:.2f} MiB/step "
                f"(now {series.y[-1] / MIB:.0f} MiB): the NCCL-buffer claim holds here; empty_cache cannot "
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


def _reserved_growing(data: _Data, rank: int) -> bool:
    x, y = data.steps_field(rank, "mem_reserved")
    ax, ay = data.steps_field(rank, "mem_allocated")
    reserved = _trend(Series(x=x, y=y, x_unit="step", metric="mem_reserved", source="steps"))
    allocated = robust_trend(ax, ay) if len(ax) >= MIN_POINTS else None
    return (
        reserved is not None
        and _grows(reserved, NON_PYTORCH_MIN_BYTES)
        and (allocated is None or allocated.slope < 0.5 * reserved.slope)
    )


def _empty_cache(data: _Data, frag: dict[int, dict[str, Any]], nonpt_growing: list[int]) -> Finding:
    if not frag:
        return _not_run(
            "empty_cache",
            "no CUDA allocator fields in the steps (mem_reserved): empty_cache only affects the CUDA cache",
        )
    retries = sum(e["alloc_retries"] for e in frag.values())
    unused = max((e["reserved_minus_peak_bytes"] or 0) for e in frag.values())
    reserved_growing = [rank for rank in frag if _reserved_growing(data, rank)]
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
    return Finding(probe=PROBE, check="empty_cache", verdict=verdict, summary=summary, evidence=evidence)


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
    for rank in sorted(data.steps.ranks_with("mem_reserved")):  # not every rank's records: 2 M at scale
        if _steady(data, rank):
            finding, frag[rank] = _fragmentation(data, rank)
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
