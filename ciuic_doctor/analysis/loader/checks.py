"""The pitfall checks of the loader analysis: shared memory, worker growth, CPU budget, failures.

Kept apart from `loader.py` (throughput and the recommendation) to keep each module readable; the
leading underscore keeps it out of the analysis discovery. Facts behind the rules:
reference/dataloader-and-report.md ("Pitfalls to check").
"""

from __future__ import annotations

from typing import Any

from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import as_float
from ciuic_doctor.units import format_bytes

PROBE = "loader"
DEFAULT_PREFETCH = 2  # PyTorch's default prefetch_factor when num_workers > 0
SHM_WARN_FRACTION = 0.5  # in-flight shared memory above half of /dev/shm free leaves no headroom
WORKER_GROWTH_WARN_BYTES = 16 << 20  # per worker per window, beyond the batches it may hold in flight
BUS_ERROR = "Bus error"  # "DataLoader worker (pid X) is killed by signal: Bus error" = /dev/shm too small


def _prefetch(num_workers: int, prefetch: int | None) -> int:
    return 0 if num_workers == 0 else (prefetch or DEFAULT_PREFETCH)


def shm_need(num_workers: int, prefetch: int | None, batch_bytes: int) -> int:
    """Bytes of batches in flight through shared memory for one rank: workers × prefetch × batch."""
    return num_workers * _prefetch(num_workers, prefetch) * batch_bytes


def shm_finding(
    header: dict[str, Any], records: list[dict[str, Any]], pooled: dict, recommended: Any
) -> Finding:
    free = header.get("shm_free_bytes")
    lws = int(header.get("local_world_size") or 1)
    batch_bytes = max([int(r.get("batch_bytes") or 0) for r in records if r.get("kind") == "measure"] or [0])
    bus = sorted({str(r.get("config")) for r in records if BUS_ERROR in str(r.get("error") or "")})
    evidence: dict[str, Any] = {
        "shm_free_bytes": free,
        "shm_total_bytes": header.get("shm_total_bytes"),
        "batch_bytes": batch_bytes,
        "local_world_size": lws,
        "bus_error_configs": bus,
    }
    settings = {"current": header.get("current") or {}}
    if recommended is not None:
        settings["recommended"] = {
            "num_workers": recommended.num_workers,
            "prefetch_factor": recommended.prefetch_factor,
        }
    for name, cfg in settings.items():
        if "num_workers" not in cfg:
            continue
        need = shm_need(int(cfg["num_workers"]), cfg.get("prefetch_factor"), batch_bytes)
        evidence[name] = {**cfg, "need_bytes_per_rank": need, "need_bytes_node": need * lws}
    if bus:
        return Finding(
            probe=PROBE,
            check="loader_shm",
            verdict="fail",
            evidence=evidence,
            summary=f"workers died of SIGBUS in {', '.join(bus)}: /dev/shm is too small "
            "(docker: --shm-size, Kubernetes: an emptyDir with medium Memory on /dev/shm)",
        )
    if free is None or not batch_bytes:
        return Finding(
            probe=PROBE,
            check="loader_shm",
            verdict="not_run",
            evidence=evidence,
            summary="no /dev/shm reading or no batch measured",
        )
    worst_name, worst = max(
        ((n, evidence[n]["need_bytes_node"]) for n in settings if n in evidence),
        key=lambda x: x[1],
        default=("", 0),
    )
    text = (
        f"{worst_name or 'in-flight'} batches need {format_bytes(worst)} of /dev/shm per node "
        f"({lws} rank(s) × workers × prefetch × {format_bytes(batch_bytes)}); {format_bytes(free)} free"
    )
    if worst > free:
        return Finding(
            probe=PROBE,
            check="loader_shm",
            verdict="fail",
            evidence=evidence,
            summary=text + ": workers will die with 'Bus error'",
        )
    verdict = "warn" if worst > SHM_WARN_FRACTION * free else "pass"
    return Finding(probe=PROBE, check="loader_shm", verdict=verdict, summary=text, evidence=evidence)


def growth_finding(header: dict[str, Any], records: list[dict[str, Any]]) -> Finding:
    """The measurement whose workers grew most (USS) beyond the batches they may hold in flight."""
    measured = [
        r
        for r in records
        if r.get("kind") == "measure"
        and r.get("status") == "ok"
        and int(r.get("num_workers") or 0) > 0
        and r.get("worker_uss_growth_bytes") is not None
    ]
    if not measured:
        return Finding(
            probe=PROBE,
            check="loader_worker_growth",
            verdict="not_run",
            summary="no configuration with workers was measured",
        )

    def excess(r: dict[str, Any]) -> float:
        return float(r["worker_uss_growth_bytes"]) - _allowance(r)

    worst = max(measured, key=excess)
    evidence = {
        "config": worst.get("config"),
        "round": worst.get("round"),
        "num_workers": worst.get("num_workers"),
        "uss_growth_bytes_per_worker": worst.get("worker_uss_growth_bytes"),
        "pss_growth_bytes_per_worker": worst.get("worker_pss_growth_bytes"),
        "rss_growth_bytes_per_worker": worst.get("worker_rss_growth_bytes"),
        "worker_uss_bytes": worst.get("worker_uss_bytes"),
        "window_samples": worst.get("samples"),
        "in_flight_allowance_bytes": _allowance(worst),
        "threshold_bytes": WORKER_GROWTH_WARN_BYTES,
        "dataset_length": (header.get("dataset") or {}).get("length"),
    }
    growth = float(worst["worker_uss_growth_bytes"])
    rss = as_float(worst.get("worker_rss_growth_bytes")) or 0.0
    text = (
        f"workers of {worst.get('config')} grew {format_bytes(growth)} USS each over {worst.get('samples')} "
        f"samples (RSS {format_bytes(rss)})"
    )
    if excess(worst) >= WORKER_GROWTH_WARN_BYTES:
        hint = "; RSS hides it: copy-on-read of Python objects" if growth > 2 * max(rss, 1.0) else ""
        return Finding(
            probe=PROBE,
            check="loader_worker_growth",
            verdict="warn",
            evidence=evidence,
            summary=f"{text}{hint}; keep per-sample data in numpy/torch arrays, not Python lists/dicts",
        )
    return Finding(probe=PROBE, check="loader_worker_growth", verdict="pass", summary=text, evidence=evidence)


def _allowance(r: dict[str, Any]) -> float:
    """A worker may hold `prefetch` collated batches in shared memory it mapped itself (counted in USS)."""
    return float(_prefetch(int(r["num_workers"]), r.get("prefetch_factor")) * int(r.get("batch_bytes") or 0))


def budget_finding(header: dict[str, Any], pooled: dict, recommended: Any) -> Finding:
    budget = header.get("cpu_budget_per_rank")
    lws = int(header.get("local_world_size") or 1)
    current = header.get("current") or {}
    evidence = {
        "cpu_budget_per_rank": budget,
        "cpu": header.get("cpu"),
        "local_world_size": lws,
        "current_num_workers": current.get("num_workers"),
        "recommended_num_workers": recommended.num_workers if recommended is not None else None,
        "max_swept_workers": max((p.num_workers for p in pooled.values()), default=None),
        "lightning_rule_workers": header.get("lightning_rule_workers"),
    }
    if budget is None:
        return Finding(
            probe=PROBE,
            check="loader_budget",
            verdict="not_run",
            evidence=evidence,
            summary="the sweep recorded no CPU budget",
        )
    over = {
        name: w
        for name, w in (
            ("current", current.get("num_workers")),
            ("recommended", evidence["recommended_num_workers"]),
        )
        if w is not None and w > budget
    }
    basis = f"CPU budget {budget} per rank ({lws} local rank(s))"
    if over:
        parts = ", ".join(f"{name} num_workers={w}" for name, w in over.items())
        procs = lws * (1 + max(over.values()))
        return Finding(
            probe=PROBE,
            check="loader_budget",
            verdict="warn",
            evidence=evidence,
            summary=f"{parts} exceeds the {basis}: {procs} processes per node compete for "
            f"{(header.get('cpu') or {}).get('usable', '?')} CPUs",
        )
    return Finding(
        probe=PROBE,
        check="loader_budget",
        verdict="pass",
        evidence=evidence,
        summary=f"worker counts fit the {basis}",
    )


def errors_finding(failures: list[dict[str, Any]], records: list[dict[str, Any]]) -> Finding:
    measured = [r for r in records if r.get("kind") == "measure"]
    ok = sum(1 for r in measured if r.get("status") == "ok")
    skipped = sum(1 for r in measured if r.get("status") == "skipped")
    evidence = {
        "failures": [{**f, "error": str(f.get("error") or "")[:300]} for f in failures],
        "ok_measurements": ok,
        "skipped_for_budget": skipped,
    }
    if failures:
        first = failures[0]
        return Finding(
            probe=PROBE,
            check="loader_errors",
            verdict="fail",
            evidence=evidence,
            summary=f"{len(failures)} measurement(s) failed; {first['config']}: {first['status']}: "
            f"{str(first.get('error') or '')[:160]}",
        )
    if not measured:
        return Finding(
            probe=PROBE,
            check="loader_errors",
            verdict="not_run",
            evidence=evidence,
            summary="no measurement records",
        )
    return Finding(
        probe=PROBE,
        check="loader_errors",
        verdict="pass",
        evidence=evidence,
        summary=f"{ok} measurement(s) completed, none crashed or hung",
    )
