"""Seed tips 1-3, judged by what comm-bench, the checkpoint doctor and loader-sweep measured: the 30 s
process-group timeout and init_scale, the DataLoader settings, and NCCL_ALGO=Tree."""

from __future__ import annotations

from typing import Any

from ciuic_doctor.launch import PG_TIMEOUT_DEFAULT_S
from ciuic_doctor.recommend import (
    NCCL_PER_COLLECTIVE_SINCE,
    TIMEOUT_SAFETY_FACTOR,
    Context,
    longest_waits,
    parse_version,
)
from ciuic_doctor.recommend.tips.base import (
    FAILS,
    HOLDS,
    SEED_TIMEOUT_S,
    SEED_WORKERS,
    UNMEASURED,
    Tip,
    new_tip,
)
from ciuic_doctor.rundir.store import as_float


def fp16_scaler(ctx: Context) -> tuple[float | None, str]:
    """The scaler's steady scale when fp16 was measured, else (None, why not)."""
    if ctx.spec.precision.mode != "fp16":
        return None, f"this job runs {ctx.spec.precision.mode}: no GradScaler, nothing to scale"
    scaler = ctx.measured("loss_scaler")
    if scaler is None:
        return None, "no fp16 step records with a loss scale in this run"
    return as_float(scaler.evidence.get("steady_scale")), scaler.summary


def tip1(ctx: Context) -> Tip:
    tip = new_tip(1)
    defaults = PG_TIMEOUT_DEFAULT_S
    tip.add(
        "timeout=30 s is an increase",
        FAILS,
        f"PyTorch's default process-group timeout is {defaults['nccl']:.0f} s for NCCL and "
        f"{defaults['gloo']:.0f} s for gloo: 30 s is a {defaults['nccl'] / SEED_TIMEOUT_S:.0f}× "
        "reduction.",
        basis="documented fact",
    )
    waits = longest_waits(ctx)
    if waits:
        label, longest = waits[0]
        status = HOLDS if TIMEOUT_SAFETY_FACTOR * longest <= SEED_TIMEOUT_S else FAILS
        tip.add(
            "30 s is enough for this job",
            status,
            f"longest measured wait: {label}, {longest:.3g} s "
            f"({'within' if status == HOLDS else 'not within'} {TIMEOUT_SAFETY_FACTOR:g}× margin of 30 "
            "s).",
        )
    else:
        tip.add("30 s is enough for this job", UNMEASURED, "no collective or save was timed")
    steady, why = fp16_scaler(ctx)
    if steady is None:
        tip.add("raising init_scale prevents gradient underflow", UNMEASURED, why)
    else:
        init = ctx.spec.precision.init_scale
        status = HOLDS if steady > init else FAILS
        tip.add(
            "raising init_scale prevents gradient underflow",
            status,
            f"the scaler settled at {steady:g} from init_scale {init:g}: "
            + (
                "it had to grow, so a higher start saves growth steps."
                if status == HOLDS
                else "it backed off, so a higher start only adds skipped calibration steps "
                "(and the scaler grows by itself every growth_interval)."
            ),
        )
    return tip


def _matching(evidence: dict[str, Any], key: str, value: Any) -> dict[str, Any] | None:
    """The measured configuration with `key == value` that is the recommendation or within the noise of the
    best (the loader analysis lists every pooled configuration with the noise margin it used); else None."""
    recommended = evidence.get("recommended") or {}
    if recommended.get(key) == value:
        return recommended
    best = as_float((evidence.get("best") or {}).get("samples_per_s"))
    if not best:
        return None  # nothing was measured to be within the noise of
    margin = (as_float(evidence.get("noise_margin_pct")) or 0.0) / 100
    for config in evidence.get("configs") or []:
        rate = as_float(config.get("samples_per_s")) if isinstance(config, dict) else None
        if rate is not None and best is not None and config.get(key) == value and rate >= best * (1 - margin):
            return config
    return None


def _describe(config: dict[str, Any]) -> str:
    keys = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")
    rate = as_float(config.get("samples_per_s"))
    return " ".join(f"{k}={config.get(k)}" for k in keys if k in config) + (
        f" at {rate:.0f} samples/s" if rate is not None else ""
    )


def tip2(ctx: Context) -> Tip:
    tip = new_tip(2)
    loader = ctx.measured("loader_throughput")
    claims = ("num_workers=4", "pin_memory=True", "prefetch_factor=2", "persistent_workers=True")
    if loader is None or not ctx.exposed("dataloader"):
        why = "loader-sweep did not run"
        if not ctx.exposed("dataloader"):  # a watched script that feeds itself (nanoGPT's get_batch)
            why = "the job builds no torch DataLoader: these settings do not apply to it"
        for claim in claims:
            tip.add(claim, UNMEASURED, why)
        return tip
    ev = loader.evidence
    rec = ev.get("recommended") or {}
    budget = ev.get("cpu_budget_per_rank")
    if budget is not None and budget < SEED_WORKERS:
        status, text = (
            FAILS,
            f"4 workers exceed this rank's CPU budget of {budget} (affinity and cgroup quota)",
        )
    elif (match := _matching(ev, "num_workers", SEED_WORKERS)) is not None:
        status, text = (
            HOLDS,
            f"4 workers is the recommendation or within the noise of the best ({_describe(match)})",
        )
    else:
        status, text = FAILS, f"measured best setting uses {rec.get('num_workers')} workers"
    tip.add(claims[0], status, text + f" (sweep: {loader.summary}).")
    cuda = (ctx.environment or {}).get("cuda_available")
    if cuda is False:
        tip.add(
            claims[1],
            FAILS,
            "no accelerator here: pin_memory only helps host-to-device copies; PyTorch warns and "
            "disables it.",
        )
    elif "pin_memory" in rec:
        match = _matching(ev, "pin_memory", True)
        text = f"within the noise of the best: {_describe(match)}" if match else f"best: {_describe(rec)}"
        tip.add(claims[1], HOLDS if match else FAILS, f"measured; {text}.")
    else:
        tip.add(claims[1], UNMEASURED, "pin_memory was not swept")
    for key, value, claim in (
        ("prefetch_factor", 2, claims[2]),
        ("persistent_workers", True, claims[3]),
    ):
        if key not in rec:
            tip.add(claim, UNMEASURED, f"{key} was not swept")
            continue
        match = _matching(ev, key, value)
        text = (
            f"within the noise of the best: {_describe(match)}"
            if match
            else f"no measured configuration with {key}={value} came within the noise of the best; "
            f"recommended {_describe(rec)}"
        )
        tip.add(claim, HOLDS if match else FAILS, f"measured; {text}.")
    return tip


def tip3(ctx: Context) -> Tip:
    tip = new_tip(3)
    choice = ctx.first("algo_choice")
    if choice is None:
        tip.add("Tree is faster than Ring for this job", UNMEASURED, "comm-bench did not run")
    elif choice.verdict == "not_run":
        tip.add(
            "Tree is faster than Ring for this job",
            UNMEASURED,
            f"Ring vs Tree was not compared: {choice.summary}.",
        )
    else:
        algo = str(choice.evidence.get("recommended_nccl_algo") or "")
        status = HOLDS if "tree" in algo.lower() else FAILS
        verdict = (
            f"Tree won at the gradient-bucket sizes ({algo})"
            if status == HOLDS
            else "Ring won at the gradient-bucket sizes"
            if algo
            else "Ring and Tree are within the noise at the gradient-bucket sizes: leave NCCL_ALGO unset"
        )
        tip.add("Tree is faster than Ring for this job", status, f"{verdict}. {choice.summary}")
    version = parse_version(ctx.nccl_version)
    if version is None:
        tip.add("a plain global NCCL_ALGO=Tree is safe", UNMEASURED, "no NCCL version in this run")
    elif version >= NCCL_PER_COLLECTIVE_SINCE:
        tip.add(
            "a plain global NCCL_ALGO=Tree is safe",
            FAILS,
            f"NCCL {ctx.nccl_version} filters NCCL_ALGO strictly (since 2.24.3); Tree serves all-reduce "
            "only, "
            "so broadcast / all_gather / reduce_scatter fail. Use allreduce:tree.",
        )
    else:
        tip.add(
            "a plain global NCCL_ALGO=Tree is safe",
            HOLDS,
            f"NCCL {ctx.nccl_version} (< 2.24.3) falls back to Ring where Tree does not apply.",
        )
    nodes = ctx.spec.job.nodes
    tip.add(
        "it helps on more than 8 nodes",
        UNMEASURED,
        f"this run covers {nodes} node(s); the claim is about > 8 (measure on that cluster with comm-bench).",
    )
    return tip
