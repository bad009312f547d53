"""Training rules: DataLoader settings from loader-sweep, the learning rate (arithmetic on the spec), gradient
clipping and the GradScaler (or bf16) from the stability findings, and ranks whose weights differ."""

from __future__ import annotations

import math

from ciuic_doctor.recommend.core import (
    GRADSCALER_GROWTH_INTERVAL,
    GRADSCALER_INIT_SCALE,
    ONECYCLE_DEFAULT_PCT_START,
    Context,
    Plan,
    add,
)
from ciuic_doctor.rundir.findings import Confidence
from ciuic_doctor.rundir.store import as_float


def rule_dataloader(ctx: Context, plan: Plan) -> None:
    """num_workers / prefetch_factor / pin_memory / persistent_workers from loader-sweep."""
    finding = ctx.measured("loader_throughput")
    if finding is None:
        _workers_from_wait(ctx, plan)
        return
    recommended = finding.evidence.get("recommended") or {}
    best = finding.evidence.get("best") or {}
    if not recommended:
        return
    dl = ctx.spec.dataloader
    rate = as_float(recommended.get("samples_per_s"))
    best_rate = as_float(best.get("samples_per_s"))
    current_rate = as_float(finding.evidence.get("current_samples_per_s"))
    measured = f"{rate:.0f} samples/s" if rate else "measured"
    if best_rate and rate:
        measured += f" (best {best_rate:.0f}; the smallest setting within the noise of it)"
    if current_rate:
        measured += f"; current settings {current_rate:.0f} samples/s"
    workers = recommended.get("num_workers")
    for key in ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers"):
        if key not in recommended:
            continue
        value = recommended[key]
        if key in ("prefetch_factor", "persistent_workers") and workers == 0:
            value = None if key == "prefetch_factor" else False  # both need num_workers > 0
        current = getattr(dl, key)
        # Issue 21: the sweep judges the loader alone, so it is the pre-screen; what counts is the job's
        # time before backward, which `verify` measures with and without the change.
        why = (
            f"loader-sweep (pre-screen, the loader alone): {measured}. Judged on the job by its time before "
            "backward: `ciuic-doctor verify RUN` tries it and keeps it only if that improves."
        )
        if key == "num_workers":
            budget = finding.evidence.get("cpu_budget_per_rank")
            rule = finding.evidence.get("lightning_rule_workers")
            knee = finding.evidence.get("knee_workers")
            extra = [
                f"CPU budget per rank {budget}" if budget is not None else "",
                f"knee of the curve at {knee}" if knee is not None else "",
                f"Lightning's rule would say {rule}" if rule is not None else "",
            ]
            why += " " + ", ".join(e for e in extra if e) + "." if any(extra) else ""
        elif key == "pin_memory" and not value:
            why += " pin_memory helps only with an accelerator (PyTorch warns and disables it without one)."
        add(
            plan,
            f"dataloader.{key}",
            value,
            why,
            confidence="high" if finding.verdict == "pass" else "medium",
            current=current,
            samples_per_s=rate,
            pre_screen="loader-sweep",
            aims_at="time before backward",
            best=best,
            current_samples_per_s=current_rate,
        )
    shm = ctx.first("loader_shm")
    if shm is not None and shm.verdict in ("warn", "fail"):
        add(
            plan,
            "shared memory (/dev/shm)",
            "enlarge (docker --shm-size, or fewer workers × prefetch)",
            f"{shm.summary}. In-flight shared memory ≈ workers × prefetch_factor × batch bytes; a too-small "
            "/dev/shm kills workers with 'Bus error' (docker's default is 64 MB).",
            confidence="high" if shm.verdict == "fail" else "medium",
            current=None,
            evidence=shm.evidence,
        )


def _workers_from_wait(ctx: Context, plan: Plan) -> None:
    """num_workers from the data wait in a watched job's own steps (analysis.datawait), when no
    loader-sweep ran: the everyday path (watch + report) sees a loader-bound job too."""
    finding = ctx.first("data_wait")
    if finding is None or finding.verdict != "warn":
        return
    ev = finding.evidence
    value, current = ev.get("suggested_num_workers"), ev.get("num_workers")
    if not isinstance(value, int) or not isinstance(current, int) or value <= current:
        return
    add(
        plan,
        "dataloader.num_workers",
        value,
        f"{finding.summary} (from watch's step timings: {ev.get('basis')}). A pre-screen: `ciuic-doctor "
        "verify RUN` tries it on the job and keeps it only if the time before backward improves.",
        confidence="medium",
        current=current,
        aims_at="time before backward",
        pre_screen="watch step timings",
        data_wait_s=ev.get("data_wait_s"),
        data_wait_share=ev.get("data_wait_share"),
        cpu_budget_per_rank=ev.get("cpu_budget_per_rank"),
    )


def rule_learning_rate(ctx: Context, plan: Plan) -> None:
    """Effective LR for the global batch by the sqrt rule (Adam family) or the linear rule (SGD).

    Computed from the spec, not measured: the sqrt rule for adaptive optimisers (Malladi et al. 2022, "On the
    SDEs and Scaling Rules for Adaptive Gradient Algorithms") and the linear rule for SGD (Goyal et al.
    2017) both hold only up to a critical batch size. Confidence stays low unless the stability probe saw this
    job train at that LR without a spike or divergence.
    """
    spec = ctx.spec
    opt = spec.optim
    if ctx.assumed("batch.reference"):
        # An observed job: its LR is the one it ran, and the batch it was tuned for is unknown, so a
        # scaling rule has nothing to scale from (no measurement, no recommendation).
        return
    ratio = spec.global_batch / spec.batch.reference
    sqrt_lr = opt.base_lr * math.sqrt(ratio)
    linear_lr = opt.base_lr * ratio
    rule = "linear" if opt.name == "sgd" else "sqrt"
    lr = sqrt_lr if rule == "sqrt" else linear_lr
    current_lr = {"sqrt": sqrt_lr, "linear": linear_lr, "none": opt.base_lr}[opt.lr_scaling]
    arithmetic = (
        f"global batch {spec.global_batch} = {spec.batch.per_process} per rank × {spec.world_size} ranks × "
        f"{spec.batch.grad_accum} accumulation, reference {spec.batch.reference}: "
        f"sqrt rule {opt.base_lr:g} × √({spec.global_batch}/{spec.batch.reference}) = {sqrt_lr:.4g}; "
        f"linear rule {opt.base_lr:g} × {spec.global_batch}/{spec.batch.reference} = {linear_lr:.4g}"
    )
    spikes = [f for f in ctx.all("loss_spike") + ctx.all("divergence") if f.verdict in ("warn", "fail")]
    stability_ran = any(
        f.probe == "stability" or f.check in ("loss_spike", "divergence") for f in ctx.findings
    )
    confidence: Confidence = "medium" if stability_ran and not spikes else "low"
    seen = (
        " The stability probe saw this job train at this LR without a loss spike or divergence."
        if confidence == "medium"
        else ""
    )
    basis = "computed from the job spec (arithmetic, not measured)"
    add(
        plan,
        "optim.lr_scaling",
        rule,
        f"{opt.name} → {rule} rule ({'Adam family' if rule == 'sqrt' else 'SGD'}): {arithmetic}. "
        f"Effective LR {lr:.4g} (current setting gives {current_lr:.4g}).{seen}",
        confidence=confidence,
        current=opt.lr_scaling,
        basis=basis,
        effective_lr=lr,
        sqrt_rule_lr=sqrt_lr,
        linear_rule_lr=linear_lr,
        global_batch=spec.global_batch,
        reference_batch=spec.batch.reference,
        base_lr=opt.base_lr,
    )
    warmup_steps = max(1, round(opt.warmup_pct * spec.job.steps))
    pct = opt.warmup_pct
    why = (
        f"OneCycleLR(optimizer, max_lr={lr:.4g}, total_steps={spec.job.steps}, pct_start={pct:g}): "
        f"{warmup_steps} warm-up steps to the peak, then cosine annealing (PyTorch's default pct_start is "
        f"{ONECYCLE_DEFAULT_PCT_START})."
    )
    after_peak = [
        f
        for f in spikes
        if isinstance(f.where.get("step"), int | float)
        and warmup_steps <= f.where["step"] <= 2 * warmup_steps
    ]
    if after_peak and pct < ONECYCLE_DEFAULT_PCT_START:
        pct = min(ONECYCLE_DEFAULT_PCT_START, 2 * opt.warmup_pct)
        why += (
            f" A loss spike at step {after_peak[0].where['step']}, right after the LR peak, suggests a "
            "longer "
            f"warm-up: pct_start {pct:g}."
        )
    add(
        plan,
        "optim.warmup_pct",
        pct,
        why,
        confidence=confidence,
        current=opt.warmup_pct,
        basis=basis,
        onecycle={"max_lr": lr, "pct_start": pct, "total_steps": spec.job.steps},
    )


ADAM_FAMILY = ("adam", "adamw", "nadam", "radam", "adamax", "adafactor", "lamb", "lion", "sparseadam")
SGD_FAMILY = ("sgd",)


def clipping_effect(optimizer: str) -> str:
    """What clipping nearly every step does, for the optimizer family: its step is proportional to the
    gradient for SGD, so a clipped gradient is a smaller step (a smaller LR); an Adam-family step is
    m / (√v + eps), nearly invariant to a common scale of the gradients, so clipping mostly re-weights
    the steps inside the moment estimates and leaves the step size to the LR. Other optimizers: only what
    holds for all (it acts on every step, not on the outliers)."""
    name = optimizer.lower()
    if name.startswith("sgd") or name in SGD_FAMILY:
        return "for SGD the step is proportional to the gradient, so clipping every step acts as a smaller LR"
    if any(name.startswith(family) for family in ADAM_FAMILY):
        return (
            f"for {optimizer} (Adam family) the step is m / √v, nearly unchanged by a common scale of the "
            "gradients: clipping every step does not set the step size, it re-weights steps inside the "
            "moment estimates (clipped ones count less)"
        )
    return f"for {optimizer}, clipping every step acts on every step rather than on the outliers"


def rule_clipping(ctx: Context, plan: Plan) -> None:
    """Clip max_norm from the grad norms of healthy steps (stability's clipping check)."""
    finding = ctx.measured("clipping")
    if finding is None:
        return
    ev = finding.evidence
    suggested = as_float(ev.get("suggested_max_norm"))
    fraction = as_float(ev.get("clipped_fraction"))
    current = ctx.spec.optim.clip_max_norm
    if suggested is None:
        return
    p99, based = as_float(ev.get("healthy_p99")), ev.get("based_on")
    measured = f"healthy grad norms reach {p99:.4g} (p99, {based})" if p99 is not None else finding.summary
    share = f"{fraction:.0%} of steps clipped at {current:g}; " if fraction is not None and current else ""
    why = (
        f"{share}{measured}. A threshold above the healthy steps' norms clips the outliers only, which is "
        "what a clip threshold is for"
    )
    if fraction is not None and fraction > 0.5:
        why += f"; one below them clips nearly every step: {clipping_effect(ctx.spec.optim.name)}"
    add(
        plan,
        "optim.clip_max_norm",
        round(suggested, 3),
        why + ".",
        confidence="medium",
        current=current,
        clipped_fraction=fraction,
        suggested_max_norm=suggested,
    )


def rule_loss_scaler(ctx: Context, plan: Plan) -> None:
    """GradScaler init_scale / growth_interval, or bf16, from stability's loss_scaler check (fp16 only)."""
    finding = ctx.measured("loss_scaler")
    if finding is None:
        return
    ev = finding.evidence
    prec = ctx.spec.precision
    storms = [
        f for f in ctx.all("overflow_storm") + ctx.all("scale_collapse") if f.verdict in ("warn", "fail")
    ]
    if ev.get("suggest_bf16") or storms:
        add(
            plan,
            "precision.mode",
            "bf16",
            f"{'; '.join(f.summary for f in storms) or finding.summary}. bf16 has fp32's exponent range: no "
            "loss scaling, no skipped steps (needs Ampere-class GPUs or newer; works on CPU).",
            confidence="high" if storms else "medium",
            current=prec.mode,
            skipped_total=ev.get("skipped_total"),
            skipped_after_calibration=ev.get("skipped_after_calibration"),
        )
    suggested = as_float(ev.get("suggested_init_scale"))
    if suggested:
        add(
            plan,
            "precision.init_scale",
            suggested,
            f"The scaler settled at {as_float(ev.get('steady_scale')) or 0:g} after "
            f"{ev.get('calibration_steps')} "
            "calibration "
            f"steps ({ev.get('skipped_total')} skipped in all); starting there skips the calibration "
            f"overflows. GradScaler's default is 2**16 = {GRADSCALER_INIT_SCALE:g}.",
            confidence="medium",
            current=prec.init_scale,
            steady_scale=ev.get("steady_scale"),
            calibration_steps=ev.get("calibration_steps"),
        )
    after = ev.get("skipped_after_calibration") or 0
    if after and prec.growth_interval < GRADSCALER_GROWTH_INTERVAL:
        add(
            plan,
            "precision.growth_interval",
            GRADSCALER_GROWTH_INTERVAL,
            f"{after} steps were skipped after calibration: every growth attempt that overflows costs a "
            "step, "
            f"and {prec.growth_interval} clean steps between attempts is shorter than GradScaler's default "
            f"{GRADSCALER_GROWTH_INTERVAL}.",
            confidence="medium",
            current=prec.growth_interval,
            skipped_after_calibration=after,
        )


def rule_desync(ctx: Context, plan: Plan) -> None:
    """Ranks whose weights differ: the `manual_seed(42 + rank)` hazard without a broadcast."""
    finding = ctx.first("rank_desync")
    if finding is None or finding.verdict not in ("warn", "fail"):
        return
    add(
        plan,
        "seed per rank",
        "same seed for model init on every rank (or broadcast rank 0's weights)",
        f"{finding.summary}. Per-rank seeds are fine for data order and dropout, never for the weights: "
        "DDP broadcasts rank 0's weights at construction, FSDP only with sync_module_states=True.",
        confidence="high",
        current=None,
        evidence=finding.evidence,
    )
