"""Memory and checkpoint rules: the allocator setting when fragmentation was seen, leaks with their projected
out-of-memory step, the empty_cache verdict, growing non-PyTorch memory, and what the checkpoint doctor
measured (missing state on resume, a save too slow for the timeout)."""

from __future__ import annotations

from ciuic_doctor.recommend.core import (
    EXPANDABLE,
    Context,
    Plan,
    add,
)
from ciuic_doctor.rundir.store import as_float


def rule_allocator(ctx: Context, plan: Plan) -> None:
    """expandable_segments when fragmentation was seen (the advice PyTorch's own OOM message gives)."""
    finding = ctx.first("fragmentation")
    if finding is None or finding.verdict not in ("warn", "fail"):
        return
    current = ctx.current_env("PYTORCH_CUDA_ALLOC_CONF")
    if current and "expandable_segments:true" in current.lower():
        return
    value = f"{current},{EXPANDABLE}" if current else EXPANDABLE
    ev = finding.evidence
    add(
        plan,
        "PYTORCH_CUDA_ALLOC_CONF",
        value,
        f"{finding.summary}. Expandable segments let the allocator grow a segment instead of splitting "
        "cached blocks, which is what PyTorch's OOM message suggests when reserved-but-unallocated is large.",
        confidence="medium",
        current=current,
        reserved_minus_allocated_bytes=ev.get("reserved_minus_allocated_bytes"),
        inactive_split_bytes=ev.get("inactive_split_bytes"),
        alloc_retries=ev.get("alloc_retries"),
    )


def rule_memory_findings(ctx: Context, plan: Plan) -> None:
    """Leaks (with the projected out-of-memory step), the empty_cache verdict, growing non-PyTorch memory."""
    for leak in ctx.all("memory_leak"):
        if leak.verdict not in ("warn", "fail"):
            continue
        ev = leak.evidence
        when = (
            f"out of memory at step ~{int(as_float(ev['projected_oom_step']) or 0)}"
            if as_float(ev.get("projected_oom_step"))
            else f"out of memory in ~{as_float(ev['projected_oom_s']) or 0:.0f} s"
            if as_float(ev.get("projected_oom_s"))
            else "no out-of-memory projection (no limit known)"
        )
        r2 = as_float(ev.get("r2"))
        per_step, per_s = as_float(ev.get("growth_mb_per_step")), as_float(ev.get("growth_mb_per_s"))
        rate = f"+{per_step:.3g} MB/step" if per_step is not None else f"+{per_s or 0:.3g} MB/s"
        add(
            plan,
            f"memory leak ({ev.get('kind', 'host')}, rank {leak.where.get('rank', '?')})",
            f"{rate}, {when}",
            f"{leak.summary}. Fix the cause (e.g. `total_loss += loss` keeps every graph alive; use "
            "loss.item()); empty_cache does not release memory that is still referenced.",
            confidence="high" if r2 is not None and r2 >= 0.9 else "medium",
            current=None,
            evidence=ev,
        )
    empty = ctx.measured("empty_cache")
    if empty is not None:
        helps = empty.evidence.get("recommend_periodic_empty_cache", empty.evidence.get("helps"))
        value = (
            "call it only where the finding shows it helps"
            if helps
            else "do not call it periodically"
            if helps is False or empty.verdict == "pass"
            else "see the finding"
        )
        add(
            plan,
            "torch.cuda.empty_cache()",
            value,
            f"{empty.summary}. empty_cache returns cached blocks to the driver; it never gives PyTorch more "
            "memory, and calling it every step costs re-allocation (PyTorch docs).",
            confidence="medium",
            current=None,
            evidence=empty.evidence,
        )
    for other in ctx.all("non_pytorch_device_memory"):
        if other.verdict in ("warn", "fail"):
            add(
                plan,
                "non-PyTorch device memory",
                "growing" if other.evidence.get("growing") else "large",
                f"{other.summary}. This is memory the caching allocator does not own (NCCL buffers, CUDA "
                "context, cuBLAS workspaces): empty_cache cannot release it.",
                confidence="medium",
                current=None,
                evidence=other.evidence,
            )


def rule_checkpoint(ctx: Context, plan: Plan) -> None:
    """What the checkpoint doctor measured: missing state on resume, and a save too slow for the timeout."""
    mismatch = ctx.resume_as_saved()
    if mismatch is not None and mismatch.verdict in ("warn", "fail"):
        missing = mismatch.evidence.get("missing") or []
        add(
            plan,
            "checkpoint contents",
            "also save: " + ", ".join(map(str, missing)) if missing else "see the finding",
            f"{mismatch.summary}. Resuming without them changes the run from the next step on.",
            confidence="high",
            current=None,
            missing=missing,
        )
    risk = ctx.first("timeout_risk")
    cost = ctx.first("checkpoint_cost")
    slow = [f for f in (risk, cost) if f is not None and f.verdict in ("warn", "fail")]
    if slow:
        add(
            plan,
            "checkpoint method",
            "torch.distributed.checkpoint (sharded, async_save)",
            f"{'; '.join(f.summary for f in slow)}. Rank-0 save + barrier makes every rank wait for one "
            "writer, and rank-0 load + broadcast puts a full copy in every rank's memory; sharded saves "
            "write in parallel and async_save overlaps the write with training.",
            confidence="medium",
            current=None,
            evidence={k: v for f in slow for k, v in f.evidence.items()},
        )
