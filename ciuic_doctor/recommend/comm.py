"""Communication rules: NCCL_ALGO from Ring vs Tree at the gradient-bucket sizes, the process-group timeout
against the longest measured wait, Flight Recorder for hang post-mortems. A straggler rank is a finding to
look at, not a setting: no rule here."""

from __future__ import annotations

import math

from ciuic_doctor.launch import default_pg_timeout_s
from ciuic_doctor.recommend.core import (
    FLIGHT_RECORDER_ENV,
    NCCL_PER_COLLECTIVE_SINCE,
    TIMEOUT_SAFETY_FACTOR,
    Context,
    Plan,
    add,
    fmt_number,
    nccl_algo_value,
    nice_seconds,
    parse_version,
)
from ciuic_doctor.rundir.findings import Confidence, Finding
from ciuic_doctor.rundir.store import as_float
from ciuic_doctor.units import format_bytes


def rule_nccl_algo(ctx: Context, plan: Plan) -> None:
    """NCCL_ALGO from comm-bench's Ring-vs-Tree comparison at the job's gradient-bucket sizes."""
    choice = ctx.first("algo_choice")
    if choice is None:
        return  # comm-bench did not run: nothing to say
    current = ctx.current_env("NCCL_ALGO")
    ev = choice.evidence
    if choice.verdict == "not_run":
        backend = ev.get("backend") or "a non-NCCL backend"
        why = (
            f"Ring vs Tree was not compared ({choice.summary}); nothing here supports setting NCCL_ALGO. "
            if backend == "nccl"
            else f"Only {backend} was measured; NCCL_ALGO does nothing there and nothing here supports "
            "setting it. "
        )
        add(
            plan,
            "NCCL_ALGO",
            None,
            why
            + "Leave it unset (NCCL's tuner chooses per size) until comm-bench has compared Ring and Tree "
            "on NCCL.",
            confidence="low",
            current=current,
            backend=ev.get("backend"),
            reason=choice.summary,
            measured=False,
        )
        return
    algo = ev.get("recommended_nccl_algo")
    per_size = ev.get("per_size") or []
    bucket = ev.get("bucket_bytes") or int(ctx.spec.distributed.bucket_cap_mb * 1024 * 1024)
    # The sizes comm's analysis judged: within a factor 2 of the bucket, else the nearest one measured.
    sized = [r for r in per_size if (r.get("bytes") or 0) > 0]
    judged = ev.get("judged_bytes")
    near = [r for r in sized if (r["bytes"] in judged if judged else bucket / 2 <= r["bytes"] <= bucket * 2)]
    if not near and sized:
        near = [min(sized, key=lambda r: abs(math.log(r["bytes"] / bucket)))]
    if algo:
        name = str(algo).split(":")[-1].split(",")[0].lstrip("^")
        value = nccl_algo_value(name, ctx.nccl_version)
        faster = [
            f"{format_bytes(r['bytes'])}: ring {fmt_number(r.get('ring_busbw_gbps') or 0)} vs tree "
            f"{fmt_number(r.get('tree_busbw_gbps') or 0)} GB/s"
            for r in near
        ]
        add(
            plan,
            "NCCL_ALGO",
            value,
            f"{name.capitalize()} was faster than the alternative beyond the noise at the job's "
            "gradient-bucket "
            f"sizes (~{format_bytes(bucket)}): {'; '.join(faster) or ev.get('reason', '')}. Per-collective "
            "form, so broadcast/all_gather/reduce_scatter keep NCCL's choice (a plain global Tree makes them "
            "fail on NCCL >= 2.24.3).",
            confidence="high" if near else "medium",
            current=current,
            nccl_version=ctx.nccl_version,
            bucket_bytes=bucket,
            per_size=near or per_size,
        )
        return
    add(
        plan,
        "NCCL_ALGO",
        None,
        f"Ring and Tree are within the measurement noise at the job's gradient-bucket sizes "
        f"(~{format_bytes(bucket)}); forcing either buys nothing and freezes NCCL's per-size choice. "
        f"{ev.get('reason') or ''}".strip(),
        confidence="high" if near else "medium",
        current=current,
        nccl_version=ctx.nccl_version,
        bucket_bytes=bucket,
        per_size=near or per_size,
    )


def rule_nccl_algo_global(ctx: Context, plan: Plan) -> None:
    """A plain NCCL_ALGO=Tree in the job on NCCL >= 2.24.3 breaks every collective but all-reduce."""
    current = ctx.current_env("NCCL_ALGO")
    version = parse_version(ctx.nccl_version)
    if not current or ":" in current or version is None or version < NCCL_PER_COLLECTIVE_SINCE:
        return
    algos = {a.strip().lower().lstrip("^") for a in current.split(",")}
    if algos <= {"tree", "nvlstree"}:
        plan.findings.append(
            Finding(
                probe="settings",
                check="nccl_algo_form",
                verdict="fail",
                summary=f"NCCL_ALGO={current} on NCCL {ctx.nccl_version}: Tree applies to all-reduce "
                "only and NCCL >= 2.24.3 filters strictly, so broadcast / all_gather / reduce_scatter error "
                "out; use the per-collective form (allreduce:tree) or leave it unset",
                evidence={"current": current, "nccl_version": ctx.nccl_version},
            )
        )


def longest_waits(ctx: Context) -> list[tuple[str, float]]:
    """Every measured wait a rank can spend inside one collective, in seconds, longest first."""
    waits: list[tuple[str, float]] = []
    for finding in ctx.all("busbw"):
        t_us = as_float(finding.evidence.get("max_time_us"))
        if t_us:
            waits.append((f"slowest {finding.evidence.get('collective', 'collective')}", t_us / 1e6))
    cost = ctx.measured("checkpoint_cost")
    if cost is not None:
        save = as_float(cost.evidence.get("save_s")) or 0.0
        barrier = as_float(cost.evidence.get("barrier_wait_s")) or 0.0
        if save or barrier:
            waits.append(
                ("checkpoint save + barrier (rank 0 saves while the others wait)", max(save, barrier))
            )
        load = as_float(cost.evidence.get("load_s"))
        if load:
            waits.append(("checkpoint load", load))
    risk = ctx.first("timeout_risk")
    if risk is not None:
        # the checkpoint doctor names the longest wait it saw (a save, the barrier, a broadcast load)
        longest = as_float(risk.evidence.get("longest_wait_s"))
        if longest:
            waits.append((f"checkpoint: {risk.evidence.get('longest_wait') or 'longest wait'}", longest))
        elif as_float(risk.evidence.get("save_s")):
            waits.append(("checkpoint save (timeout check)", as_float(risk.evidence["save_s"]) or 0.0))
    step = ctx.measured("step_time")
    if step is not None:
        medians = step.evidence.get("median_step_time_s") or step.evidence.get("step_time_s") or {}
        values = [as_float(v) for v in (medians.values() if isinstance(medians, dict) else medians)]
        values = [v for v in values if v]
        if values:
            waits.append(("slowest rank's median step", max(values)))
    return sorted(waits, key=lambda w: -w[1])


def rule_pg_timeout(ctx: Context, plan: Plan) -> None:
    """The process-group timeout against the longest measured wait (collective, checkpoint save, step)."""
    waits = longest_waits(ctx)
    if not waits:
        return
    label, longest = waits[0]
    backend = ctx.backend or "nccl"
    default_s = default_pg_timeout_s(backend)
    current = float(ctx.spec.distributed.timeout_s)
    needed = TIMEOUT_SAFETY_FACTOR * longest
    defaults = "PyTorch's default is 600 s for NCCL and 1800 s for gloo"
    checkpoint_measured = any("checkpoint" in w[0] for w in waits)
    confidence: Confidence = "high" if checkpoint_measured else "medium"
    evidence = {
        "longest_wait": label,
        "longest_wait_s": round(longest, 6),
        "waits_s": {w[0]: round(w[1], 6) for w in waits},
        "safety_factor": TIMEOUT_SAFETY_FACTOR,
        "pytorch_default_s": default_s,
        "backend": backend,
    }
    if not checkpoint_measured:
        evidence["note"] = "no checkpoint save was measured; a real save can be the longest wait"
    if current >= needed:
        add(
            plan,
            "distributed.timeout_s",
            current,
            f"Keep {current:g} s: it covers {TIMEOUT_SAFETY_FACTOR:g}× the longest measured wait ({label}, "
            f"{fmt_number(longest)} s). {defaults}.",
            confidence=confidence,
            current=current,
            evidence=evidence,
        )
        verdict = "pass"
        summary = (
            f"timeout {current:g} s ≥ {TIMEOUT_SAFETY_FACTOR:g}× the longest measured wait "
            f"({label}, {fmt_number(longest)} s)"
        )
    else:
        value = max(default_s, nice_seconds(needed))
        add(
            plan,
            "distributed.timeout_s",
            value,
            f"{current:g} s is less than {TIMEOUT_SAFETY_FACTOR:g}× the longest measured wait ({label}, "
            f"{fmt_number(longest)} s): the ranks waiting for it would be torn down as hung. {defaults}; "
            f"{value:g} s covers the wait and still ends a real hang.",
            confidence=confidence,
            current=current,
            evidence=evidence,
        )
        verdict = "fail" if current < longest else "warn"
        summary = (
            f"timeout {current:g} s vs {label} {fmt_number(longest)} s "
            f"(needs ≥ {fmt_number(needed)} s with margin)"
        )
    plan.findings.append(
        Finding(
            probe="settings",
            check="pg_timeout",
            verdict=verdict,
            summary=f"process-group {summary}",
            evidence={"timeout_s": current, **evidence},
        )
    )


def rule_flight_recorder(ctx: Context, plan: Plan) -> None:
    """Flight Recorder env for hang post-mortems; it exists in ProcessGroupNCCL only."""
    if ctx.backend != "nccl":
        return
    why = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "Flight Recorder: keep the last 2000 collectives of every rank in a "
        "ring buffer (little memory), so a hang can name the collective and the rank that never arrived.",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "Flight Recorder: on a timeout every rank dumps that buffer to "
        "/tmp/nccl_trace_rank_<r> (prefix TORCH_NCCL_DEBUG_INFO_TEMP_FILE); read the dumps with "
        "`python -m torch.distributed.flight_recorder`.",
    }
    for name, value in FLIGHT_RECORDER_ENV.items():
        add(
            plan,
            name,
            value,
            why[name],
            confidence="medium",
            current=ctx.current_env(name),
            backend=ctx.backend,
        )
