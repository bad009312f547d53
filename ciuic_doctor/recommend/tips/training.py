"""Seed tips 4-7, judged by the stability checks, the cross-rank weight checksums, the memory analysis
and the checkpoint doctor: LR scaling and warm-up, clip / seed / init_scale, empty_cache, checkpoint and
resume."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ciuic_doctor.recommend import (
    GRADSCALER_INIT_SCALE,
    TIMEOUT_SAFETY_FACTOR,
    Context,
)
from ciuic_doctor.recommend.tips.base import (
    FAILS,
    HOLDS,
    SEED_INIT_SCALE,
    UNMEASURED,
    Tip,
    new_tip,
)
from ciuic_doctor.recommend.tips.comm import fp16_scaler
from ciuic_doctor.rundir.store import as_float
from ciuic_doctor.units import format_bytes


def _stability_clean(ctx: Context) -> tuple[bool | None, str]:
    """(True, why) when the stability checks ran and saw no spike or divergence, (False, why) when they saw
    one, (None, why) when they did not run."""
    ran = [f for f in ctx.findings if f.check in ("loss_spike", "divergence", "nonfinite_loss")]
    if not ran:
        return None, "the stability checks did not run on this run's step records"
    bad = [f for f in ran if f.verdict in ("warn", "fail")]
    if bad:
        return False, "; ".join(f.summary for f in bad[:3])
    return True, "; ".join(f.summary for f in ran[:2])


def tip4(ctx: Context) -> Tip:
    tip = new_tip(4)
    clean, why = _stability_clean(ctx)
    ran = ctx.observed.get("optim") or {}
    if ctx.observed and ran.get("lr_ran"):
        _sqrt_claim_observed(tip, ctx, ran)
    else:
        _sqrt_claim_spec(tip, ctx, clean, why)
    warmup, text = _warmup(ctx, ran)
    claim = "OneCycleLR warm-up keeps the start stable"
    if warmup is None:
        tip.add(claim, UNMEASURED, text)
        return tip
    if ctx.observed and (ran.get("scheduler") or {}).get("class") != "OneCycleLR":
        claim = "the job's warm-up keeps the start stable"
    if clean is None:
        tip.add(claim, UNMEASURED, why)
        return tip
    # The start is the warm-up and as many steps again after the LR peak.
    early = [
        f
        for f in ctx.findings
        if f.check in ("loss_spike", "divergence", "nonfinite_loss")
        and f.verdict in ("warn", "fail")
        and (not isinstance(f.where.get("step"), int | float) or f.where["step"] <= 2 * warmup)
    ]
    text += ": "
    if early:
        text += "; ".join(f.summary for f in early[:2])
    elif clean:
        text += f"no spike or divergence ({why})"
    else:
        text += f"no spike in the first {2 * warmup} steps; later: {why}"
    tip.add(claim, FAILS if early else HOLDS, text + ".")
    return tip


def _sqrt_claim_spec(tip: Tip, ctx: Context, clean: bool | None, why: str) -> None:
    """The sqrt rule judged on a spec's job: it trained at base_lr scaled by the spec's rule."""
    spec = ctx.spec
    ratio = spec.global_batch / spec.batch.reference
    sqrt_lr = spec.optim.base_lr * ratio**0.5
    linear_lr = spec.optim.base_lr * ratio
    arithmetic = (
        f"computed from the spec: sqrt rule {sqrt_lr:.4g}, linear rule {linear_lr:.4g} "
        f"(global batch {spec.global_batch}, reference {spec.batch.reference})"
    )
    claim = "the sqrt rule fits this optimizer"
    if spec.optim.name == "sgd":
        tip.add(
            claim,
            UNMEASURED,
            f"{arithmetic}; SGD is usually scaled linearly (Goyal et al. 2017), sqrt is the Adam-family "
            "rule.",
        )
    elif spec.optim.lr_scaling != "sqrt":
        tip.add(
            claim,
            UNMEASURED,
            f"{arithmetic}; the job runs lr_scaling={spec.optim.lr_scaling}, so this run did not train at "
            "the sqrt-scaled LR",
        )
    elif clean is None:
        tip.add(claim, UNMEASURED, f"{arithmetic}; {why}")
    else:
        tip.add(
            claim, HOLDS if clean else FAILS, f"{arithmetic}; the job trained at the sqrt-scaled LR: {why}."
        )


def _sqrt_claim_observed(tip: Tip, ctx: Context, ran: dict) -> None:
    """A watched script sets its own LR: say which one it ran; the rule itself was not exercised."""
    lr = ran["lr_ran"]
    scheduler = _scheduler_name(ran)
    batch = "global batch not observed (no DataLoader)"
    if not ctx.assumed("batch.per_process"):
        batch = f"global batch {ctx.spec.global_batch}"
    tip.add(
        "the sqrt rule fits this optimizer",
        UNMEASURED,
        f"the job ran its own LR, not a sqrt-scaled one: {ran.get('class', 'its optimizer')} from "
        f"{lr['first']:.4g} to a peak of {lr['peak']:.4g} at step {lr['peak_step']} "
        f"({scheduler}), {batch}; the batch that LR was tuned for is not "
        "known, so the rule was not tested by this run",
    )


def _scheduler_name(ran: dict) -> str:
    scheduler = ran.get("scheduler")
    if isinstance(scheduler, list):
        return " + ".join(str(s.get("class")) for s in scheduler if isinstance(s, dict))
    if isinstance(scheduler, dict):
        lam = scheduler.get("lr_lambda")
        if isinstance(lam, dict) and lam.get("function"):
            return f"{scheduler.get('class')}({lam['function']})"
        return str(scheduler.get("class"))
    return "no torch LR scheduler: the script sets the LR itself"


def _warmup(ctx: Context, ran: dict) -> tuple[int | None, str]:
    """(warm-up steps, what they are) for the job: the spec's OneCycleLR pct_start, or for a watched
    script its OneCycleLR's pct_start, else the steps its own LR took to reach the peak."""
    spec = ctx.spec
    scheduler = ran.get("scheduler") if isinstance(ran.get("scheduler"), dict) else {}
    if not ctx.observed or scheduler.get("class") == "OneCycleLR":
        warmup = max(1, round(spec.optim.warmup_pct * spec.job.steps))
        return (
            warmup,
            f"pct_start {spec.optim.warmup_pct:g} of {spec.job.steps} steps = {warmup} warm-up steps",
        )
    lr = ran.get("lr_ran") or {}
    if not lr:
        return None, "no LR was recorded for this job's steps"
    scheduler_name = _scheduler_name(ran)
    if lr["peak_step"] <= 1 or lr["peak"] <= lr["first"]:
        return None, (
            f"the job ran no OneCycleLR warm-up: its LR started at its peak {lr['peak']:.4g} "
            f"({scheduler_name})"
        )
    recorded = lr.get("steps") or lr["peak_step"]
    still = " (still rising when the records end)" if lr["peak_step"] >= recorded else ""
    return lr["peak_step"], (
        f"the job's own warm-up ({scheduler_name}, no OneCycleLR): LR {lr['first']:.4g} to "
        f"{lr['peak']:.4g} in {lr['peak_step']} steps{still}"
    )


def tip5(ctx: Context, grad_norms: Sequence[float] = ()) -> Tip:
    tip = new_tip(5)
    finite = [g for g in grad_norms if math.isfinite(g)]
    clipping = ctx.measured("clipping")
    if finite:
        share = sum(g > 1.0 for g in finite) / len(finite)
        median = sorted(finite)[len(finite) // 2]
        status = HOLDS if share <= 0.5 else FAILS
        tip.add(
            "max_norm=1.0 suits this job",
            status,
            f"{share:.0%} of {len(finite)} steps had a grad norm above 1.0 (median {median:.3g}): "
            + (
                "1.0 clips only the outliers."
                if status == HOLDS
                else "1.0 rescales most steps, acting as a smaller LR rather than a spike guard."
            ),
        )
    elif clipping is not None:
        suggested = as_float(clipping.evidence.get("suggested_max_norm"))
        ok = suggested is not None and 0.5 <= suggested <= 2.0
        tip.add("max_norm=1.0 suits this job", HOLDS if ok else FAILS, clipping.summary)
    else:
        tip.add("max_norm=1.0 suits this job", UNMEASURED, "no grad norms recorded")
    desync = ctx.first("rank_desync")
    if desync is None or desync.verdict == "not_run":
        tip.add("manual_seed(42 + rank) is safe", UNMEASURED, "no cross-rank weight checksum in this run")
    else:
        ok = desync.verdict == "pass"
        tip.add(
            "manual_seed(42 + rank) is safe",
            HOLDS if ok else FAILS,
            desync.summary
            + (
                ": DDP broadcasts rank 0's weights at construction, so the per-rank seed did the "
                "weights no "
                "harm; per-rank seeds are safe for data order and dropout only."
                if ok
                else ": the ranks train different weights."
            ),
        )
    steady, why = fp16_scaler(ctx)
    if steady is None:
        tip.add("init_scale=2**10", UNMEASURED, why)
    else:
        ok = SEED_INIT_SCALE / 4 <= steady <= SEED_INIT_SCALE * 4
        tip.add(
            "init_scale=2**10",
            HOLDS if ok else FAILS,
            f"the scaler settled at {steady:g} (2**10 = 1024; GradScaler's default "
            f"{GRADSCALER_INIT_SCALE:g}).",
        )
    tip.add(
        "init_scale should be higher on multi-GPU",
        FAILS,
        "2**10 is 64× lower than GradScaler's default 2**16, so the advice contradicts itself; and DDP "
        "averages gradients, so their magnitude (what the scale protects) does not grow with the GPU "
        "count.",
        basis="documented fact",
    )
    return tip


def tip6(ctx: Context) -> Tip:
    tip = new_tip(6)
    other = ctx.measured("non_pytorch_device_memory")
    if other is None:
        tip.add("NCCL buffers accumulate", UNMEASURED, "no device memory from NVML in this run (no CUDA)")
    else:
        growing = bool(other.evidence.get("growing"))
        tip.add(
            "NCCL buffers accumulate",
            HOLDS if growing else FAILS,
            f"non-PyTorch device memory: {other.summary}",
        )
    empty = ctx.measured("empty_cache")
    if empty is None:
        tip.add(
            "periodic empty_cache() helps", UNMEASURED, "no empty_cache comparison in this run (needs CUDA)"
        )
    else:
        helps = empty.evidence.get("recommend_periodic_empty_cache", empty.evidence.get("helps"))
        status = HOLDS if helps else FAILS
        tip.add(
            "periodic empty_cache() helps",
            status,
            f"{empty.summary}. It only returns the caching allocator's free blocks; NCCL's buffers are "
            "not "
            "allocated through it.",
        )
    leaks = [f for f in ctx.all("memory_leak") if f.verdict in ("warn", "fail")]
    if any(f.verdict != "not_run" for f in ctx.all("memory_leak")):
        tip.add(
            "this job has a memory leak to catch",
            HOLDS if leaks else FAILS,
            "; ".join(f.summary for f in leaks) or "no leak: memory is flat after warm-up on every rank",
        )
    return tip


def tip7(ctx: Context) -> Tip:
    tip = new_tip(7)
    cost = ctx.measured("checkpoint_cost")
    risk = ctx.measured("timeout_risk")
    if risk is not None:
        tip.add("rank-0 save + barrier is safe", HOLDS if risk.verdict == "pass" else FAILS, risk.summary)
    elif cost is not None:
        save = as_float(cost.evidence.get("save_s")) or 0.0
        timeout = float(ctx.spec.distributed.timeout_s)
        tip.add(
            "rank-0 save + barrier is safe",
            HOLDS if save * TIMEOUT_SAFETY_FACTOR <= timeout else FAILS,
            f"save {save:.3g} s vs process-group timeout {timeout:g} s.",
        )
    else:
        tip.add("rank-0 save + barrier is safe", UNMEASURED, "no checkpoint was timed")
    peak = as_float(cost.evidence.get("peak_load_rss_bytes")) if cost is not None else None
    if cost is not None and peak:
        tip.add(
            "rank-0 load + broadcast is fine",
            HOLDS if cost.verdict == "pass" else FAILS,
            f"peak host memory during load {format_bytes(peak)} per rank: every rank holds a full copy, "
            "which grows with the model (sharded torch.distributed.checkpoint avoids it).",
        )
    else:
        tip.add("rank-0 load + broadcast is fine", UNMEASURED, "no checkpoint load was measured")
    mismatch = ctx.resume_as_saved()
    if mismatch is None or mismatch.verdict == "not_run":
        tip.add(
            "optimizer + scheduler state make resume exact", UNMEASURED, "no resume comparison in this run"
        )
    else:
        missing = [str(m) for m in mismatch.evidence.get("missing") or []]
        extra = [m for m in missing if not any(k in m.lower() for k in ("optim", "sched"))]
        ok = mismatch.verdict == "pass"
        tip.add(
            "optimizer + scheduler state make resume exact",
            HOLDS if ok else FAILS,
            mismatch.summary + (f" (also needed: {', '.join(extra)})" if extra else ""),
        )
    return tip
