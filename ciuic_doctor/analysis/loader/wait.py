"""Data wait of a watched job, from its own step records: is the DataLoader holding the steps back?

Check `data_wait` (stream `steps`, a watched script with a DataLoader in meta.json's `observed`):

A step as watch times it is [end of the last optimizer step → first backward) + [backward → optimizer
step]. The first part, `pre_backward_s`, holds fetching the batch and the forward pass; the second holds
backward and the optimizer. Backward costs about twice the forward (2 N FLOPs forward, 4 N backward per
token for a dense model; Kaplan et al. 2020, §2.1), so a forward alone is about half of the second part.
What `pre_backward_s` holds beyond that estimate is the time the step waited for its batch:

    wait   = median pre_backward − median (step − pre_backward) / 2
    share  = wait / median step time

`warn` when the wait is at least WAIT_SHARE of the step and more workers fit the CPU budget: workers load
the next batches while the step computes, so k workers hide about k × (step − wait) of loading a step, and
the suggestion is the fewest that hide the whole wait, within the CPU budget per local rank (usable CPUs
// local ranks, as loader-sweep counts it). It is a pre-screen from timings, like loader-sweep: `verify`
tries the suggestion on the job and keeps it only if its time before backward improves.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir

PROBE = "watch"  # measured by watch (its step timings), shown with the training job
CHECK = "data_wait"
COLUMNS = ("rank", "step", "step_time_s", "pre_backward_s")
WAIT_SHARE = 0.25  # a quarter of the step waiting for data: workers would give back at least 1.33×
WARMUP_STEPS = 2  # the first steps build caches and start workers
MIN_STEPS = 5  # steps with both timings after warm-up


def wait_findings(run: RunDir) -> list[Finding]:
    """The data_wait finding of a watched run with a DataLoader (none otherwise)."""
    if not run.has_stream("steps"):
        return []
    meta = run.read_meta()
    loader = ((meta.get("observed") or {}).get("dataloader")) or {}
    if not isinstance(loader, dict) or not loader:
        return []  # no DataLoader seen (or not a watched run): nothing to say about one
    from ciuic_doctor.rundir.frames import float_values, read_stream

    table = read_stream(run, "steps", COLUMNS).table
    steps = float_values(table.column("step")).tolist()
    step_times = float_values(table.column("step_time_s")).tolist()
    pre = float_values(table.column("pre_backward_s")).tolist()
    pairs = [
        (s, p)
        for n, s, p in zip(steps, step_times, pre, strict=True)
        if n > WARMUP_STEPS and math.isfinite(s) and math.isfinite(p) and 0 <= p <= s and s > 0
    ]
    return [data_wait_finding(pairs, loader, _budget(meta))]


def _budget(meta: dict[str, Any]) -> int | None:
    cpu = ((meta.get("env") or {}).get("cpu")) or {}
    usable = cpu.get("usable") if isinstance(cpu, dict) else None
    job = ((meta.get("observed") or {}).get("job")) or {}
    local = job.get("procs_per_node") if isinstance(job, dict) else None
    if not isinstance(usable, int) or usable < 1:
        return None
    local = local if isinstance(local, int) and local > 0 else 1
    return max(1, usable // local)


def data_wait_finding(
    pairs: list[tuple[float, float]], loader: dict[str, Any], budget: int | None
) -> Finding:
    """The finding from (step time, time before backward) pairs of the steps after warm-up."""
    workers = loader.get("num_workers")
    workers = workers if isinstance(workers, int) and workers >= 0 else None
    if len(pairs) < MIN_STEPS:
        return Finding(
            probe=PROBE,
            check=CHECK,
            verdict="not_run",
            summary=f"{len(pairs)} step(s) with both timings after warm-up (need {MIN_STEPS})",
            evidence={"steps": len(pairs), "num_workers": workers},
        )
    step = statistics.median(s for s, _ in pairs)
    pre = statistics.median(p for _, p in pairs)
    wait = max(0.0, pre - (step - pre) / 2)
    share = wait / step
    compute = max(step - wait, 1e-9)
    # Loading one batch takes `wait` in the main process; with w workers already, a loader-bound step
    # lasts about the loading time / w, so loading one batch takes about step × w.
    load = wait if not workers else step * workers
    needed = max(1, math.ceil(load / compute))
    suggested = min(budget, needed) if budget is not None else None
    evidence: dict[str, Any] = {
        "steps": len(pairs),
        "median_step_time_s": step,
        "median_pre_backward_s": pre,
        "data_wait_s": wait,
        "data_wait_share": share,
        "threshold_share": WAIT_SHARE,
        "num_workers": workers,
        "cpu_budget_per_rank": budget,
        "workers_to_hide_wait": needed,
        "suggested_num_workers": suggested,
        "basis": "time before backward beyond half the backward-and-optimizer time (forward ≈ backward / 2)",
    }
    words = (
        f"the steps wait ≈ {1e3 * wait:.1f} ms of {1e3 * step:.1f} ms ({share:.0%}) for data "
        f"with num_workers={workers if workers is not None else '?'}"
    )
    if share < WAIT_SHARE:
        return Finding(probe=PROBE, check=CHECK, verdict="pass", summary=words, evidence=evidence)
    if suggested is None or workers is None or suggested <= workers:
        room = f"the CPU budget is {budget} per rank" if budget is not None else "no CPU budget recorded"
        return Finding(
            probe=PROBE,
            check=CHECK,
            verdict="warn",
            summary=f"{words}; {room}: more workers do not fit (a faster dataset or fewer ranks per node)",
            evidence=evidence,
        )
    return Finding(
        probe=PROBE,
        check=CHECK,
        verdict="warn",
        summary=f"{words}: {suggested} worker(s) would load while the step computes "
        f"(CPU budget {budget} per rank)",
        evidence=evidence,
    )
