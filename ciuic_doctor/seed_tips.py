"""The seven tips of the seed article ("分布式训练玄学：在Ciuic上调试DeepSeek的7个神操作"), checked against
this run's measurements.

Each tip is split into the claims it makes; each claim gets a status:
    holds          a measurement of this run agrees with it
    does not hold  a measurement (or a documented PyTorch/NCCL fact) contradicts it
    not measured   nothing in this run can tell (the probe did not run, or the claim needs another setup)
A tip does not hold when any of its claims does not; it holds when at least one claim was measured to hold
and none failed; otherwise it is not measured. The evidence for every status is a sentence with numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ciuic_doctor.recommend import (
    GRADSCALER_INIT_SCALE,
    NCCL_PER_COLLECTIVE_SINCE,
    PG_TIMEOUT_DEFAULT_S,
    TIMEOUT_SAFETY_FACTOR,
    Context,
    longest_waits,
    parse_version,
)
from ciuic_doctor.store import as_float
from ciuic_doctor.units import format_bytes

Status = Literal["holds", "does not hold", "not measured"]
HOLDS: Status = "holds"
FAILS: Status = "does not hold"
UNMEASURED: Status = "not measured"
SEED_TIMEOUT_S = 30.0
SEED_INIT_SCALE = 2.0**10
SEED_WORKERS = 4


@dataclass(kw_only=True)
class Claim:
    text: str
    status: Status
    evidence: str
    basis: str = "measured"  # measured | documented fact (a claim contradicted by PyTorch/NCCL's own docs)


@dataclass(kw_only=True)
class Tip:
    number: int
    title: str
    original: str  # the article's own heading
    advice: str  # what the article tells you to do, in one line
    claims: list[Claim] = field(default_factory=list)

    @property
    def status(self) -> Status:
        statuses = {c.status for c in self.claims}
        if FAILS in statuses:
            return FAILS
        return HOLDS if HOLDS in statuses else UNMEASURED

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def _claim(text: str, status: Status, evidence: str, basis: str = "measured") -> Claim:
    return Claim(text=text, status=status, evidence=evidence, basis=basis)


def _fp16_scaler(ctx: Context) -> tuple[float | None, str]:
    """The scaler's steady scale when fp16 was measured, else (None, why not)."""
    if ctx.spec.precision.mode != "fp16":
        return None, f"this job runs {ctx.spec.precision.mode}: no GradScaler, nothing to scale"
    scaler = ctx.measured("loss_scaler")
    if scaler is None:
        return None, "no fp16 step records with a loss scale in this run"
    return as_float(scaler.evidence.get("steady_scale")), scaler.summary


def tip1(ctx: Context) -> Tip:
    tip = Tip(
        number=1,
        title="Gradient-sync parameters",
        original="神操作一：梯度同步的魔法参数调整",
        advice="init_process_group(timeout=30 s) as an 'increase'; raise GradScaler's init_scale",
    )
    defaults = PG_TIMEOUT_DEFAULT_S
    tip.claims.append(
        _claim(
            "timeout=30 s is an increase",
            FAILS,
            f"PyTorch's default process-group timeout is {defaults['nccl']:.0f} s for NCCL and "
            f"{defaults['gloo']:.0f} s for gloo: 30 s is a {defaults['nccl'] / SEED_TIMEOUT_S:.0f}× "
            "reduction.",
            basis="documented fact",
        )
    )
    waits = longest_waits(ctx)
    if waits:
        label, longest = waits[0]
        status = HOLDS if TIMEOUT_SAFETY_FACTOR * longest <= SEED_TIMEOUT_S else FAILS
        tip.claims.append(
            _claim(
                "30 s is enough for this job",
                status,
                f"longest measured wait: {label}, {longest:.3g} s "
                f"({'within' if status == HOLDS else 'not within'} {TIMEOUT_SAFETY_FACTOR:g}× margin of 30 "
                "s).",
            )
        )
    else:
        tip.claims.append(
            _claim("30 s is enough for this job", UNMEASURED, "no collective or save was timed")
        )
    steady, why = _fp16_scaler(ctx)
    if steady is None:
        tip.claims.append(_claim("raising init_scale prevents gradient underflow", UNMEASURED, why))
    else:
        init = ctx.spec.precision.init_scale
        status = HOLDS if steady > init else FAILS
        tip.claims.append(
            _claim(
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
    tip = Tip(
        number=2,
        title="DataLoader settings",
        original="神操作二：数据加载的玄学优化",
        advice="num_workers=4, pin_memory=True, prefetch_factor=2, persistent_workers=True",
    )
    loader = ctx.measured("loader_throughput")
    claims = ("num_workers=4", "pin_memory=True", "prefetch_factor=2", "persistent_workers=True")
    if loader is None:
        tip.claims.extend(_claim(c, UNMEASURED, "loader-sweep did not run") for c in claims)
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
    tip.claims.append(_claim(claims[0], status, text + f" (sweep: {loader.summary})."))
    cuda = (ctx.environment or {}).get("cuda_available")
    if cuda is False:
        tip.claims.append(
            _claim(
                claims[1],
                FAILS,
                "no accelerator here: pin_memory only helps host-to-device copies; PyTorch warns and "
                "disables it.",
            )
        )
    elif "pin_memory" in rec:
        match = _matching(ev, "pin_memory", True)
        text = f"within the noise of the best: {_describe(match)}" if match else f"best: {_describe(rec)}"
        tip.claims.append(_claim(claims[1], HOLDS if match else FAILS, f"measured; {text}."))
    else:
        tip.claims.append(_claim(claims[1], UNMEASURED, "pin_memory was not swept"))
    for key, value, claim in (
        ("prefetch_factor", 2, claims[2]),
        ("persistent_workers", True, claims[3]),
    ):
        if key not in rec:
            tip.claims.append(_claim(claim, UNMEASURED, f"{key} was not swept"))
            continue
        match = _matching(ev, key, value)
        text = (
            f"within the noise of the best: {_describe(match)}"
            if match
            else f"no measured configuration with {key}={value} came within the noise of the best; "
            f"recommended {_describe(rec)}"
        )
        tip.claims.append(_claim(claim, HOLDS if match else FAILS, f"measured; {text}."))
    return tip


def tip3(ctx: Context) -> Tip:
    tip = Tip(
        number=3,
        title="NCCL_ALGO=Tree",
        original="神操作三：通信优化的隐藏技巧",
        advice="export NCCL_ALGO=Tree (better on large clusters, > 8 nodes)",
    )
    choice = ctx.first("algo_choice")
    if choice is None:
        tip.claims.append(
            _claim("Tree is faster than Ring for this job", UNMEASURED, "comm-bench did not run")
        )
    elif choice.verdict == "not_run":
        tip.claims.append(
            _claim(
                "Tree is faster than Ring for this job",
                UNMEASURED,
                f"Ring vs Tree was not compared: {choice.summary}.",
            )
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
        tip.claims.append(
            _claim("Tree is faster than Ring for this job", status, f"{verdict}. {choice.summary}")
        )
    version = parse_version(ctx.nccl_version)
    if version is None:
        tip.claims.append(
            _claim("a plain global NCCL_ALGO=Tree is safe", UNMEASURED, "no NCCL version in this run")
        )
    elif version >= NCCL_PER_COLLECTIVE_SINCE:
        tip.claims.append(
            _claim(
                "a plain global NCCL_ALGO=Tree is safe",
                FAILS,
                f"NCCL {ctx.nccl_version} filters NCCL_ALGO strictly (since 2.24.3); Tree serves all-reduce "
                "only, "
                "so broadcast / all_gather / reduce_scatter fail. Use allreduce:tree.",
            )
        )
    else:
        tip.claims.append(
            _claim(
                "a plain global NCCL_ALGO=Tree is safe",
                HOLDS,
                f"NCCL {ctx.nccl_version} (< 2.24.3) falls back to Ring where Tree does not apply.",
            )
        )
    nodes = ctx.spec.job.nodes
    tip.claims.append(
        _claim(
            "it helps on more than 8 nodes",
            UNMEASURED,
            f"this run covers {nodes} node(s); the claim is about > 8 (measure on that cluster with "
            "comm-bench).",
        )
    )
    return tip


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
    tip = Tip(
        number=4,
        title="LR scaling formula and warm-up",
        original="神操作四：学习率调整的神秘公式",
        advice="effective_lr = base_lr × sqrt(global_batch / reference_batch); OneCycleLR(pct_start=0.1)",
    )
    spec = ctx.spec
    ratio = spec.global_batch / spec.batch.reference
    sqrt_lr = spec.optim.base_lr * ratio**0.5
    linear_lr = spec.optim.base_lr * ratio
    arithmetic = (
        f"computed from the spec: sqrt rule {sqrt_lr:.4g}, linear rule {linear_lr:.4g} "
        f"(global batch {spec.global_batch}, reference {spec.batch.reference})"
    )
    clean, why = _stability_clean(ctx)
    if spec.optim.name == "sgd":
        tip.claims.append(
            _claim(
                "the sqrt rule fits this optimizer",
                UNMEASURED,
                f"{arithmetic}; SGD is usually scaled linearly (Goyal et al. 2017), sqrt is the Adam-family "
                "rule.",
            )
        )
    elif spec.optim.lr_scaling != "sqrt":
        tip.claims.append(
            _claim(
                "the sqrt rule fits this optimizer",
                UNMEASURED,
                f"{arithmetic}; the job runs lr_scaling={spec.optim.lr_scaling}, so this run did not train "
                "at the "
                "sqrt-scaled LR",
            )
        )
    elif clean is None:
        tip.claims.append(_claim("the sqrt rule fits this optimizer", UNMEASURED, f"{arithmetic}; {why}"))
    else:
        tip.claims.append(
            _claim(
                "the sqrt rule fits this optimizer",
                HOLDS if clean else FAILS,
                f"{arithmetic}; the job trained at the sqrt-scaled LR: {why}.",
            )
        )
    warmup = max(1, round(spec.optim.warmup_pct * spec.job.steps))
    if clean is None:
        tip.claims.append(_claim("OneCycleLR warm-up keeps the start stable", UNMEASURED, why))
    else:
        # The start is the warm-up and as many steps again after the LR peak.
        early = [
            f
            for f in ctx.findings
            if f.check in ("loss_spike", "divergence", "nonfinite_loss")
            and f.verdict in ("warn", "fail")
            and (not isinstance(f.where.get("step"), int | float) or f.where["step"] <= 2 * warmup)
        ]
        text = f"pct_start {spec.optim.warmup_pct:g} of {spec.job.steps} steps = {warmup} warm-up steps: "
        if early:
            text += "; ".join(f.summary for f in early[:2])
        elif clean:
            text += f"no spike or divergence ({why})"
        else:
            text += f"no spike in the first {2 * warmup} steps; later: {why}"
        tip.claims.append(
            _claim("OneCycleLR warm-up keeps the start stable", FAILS if early else HOLDS, text + ".")
        )
    return tip


def tip5(ctx: Context, grad_norms: Sequence[float] = ()) -> Tip:
    tip = Tip(
        number=5,
        title="Suppressing loss fluctuation",
        original="神操作五：损失波动的镇压术",
        advice="clip_grad_norm_(max_norm=1.0); manual_seed(42 + rank); GradScaler(init_scale=2**10), "
        "higher on multi-GPU",
    )
    finite = [g for g in grad_norms if math.isfinite(g)]
    clipping = ctx.measured("clipping")
    if finite:
        share = sum(g > 1.0 for g in finite) / len(finite)
        median = sorted(finite)[len(finite) // 2]
        status = HOLDS if share <= 0.5 else FAILS
        tip.claims.append(
            _claim(
                "max_norm=1.0 suits this job",
                status,
                f"{share:.0%} of {len(finite)} steps had a grad norm above 1.0 (median {median:.3g}): "
                + (
                    "1.0 clips only the outliers."
                    if status == HOLDS
                    else "1.0 rescales most steps, acting as a smaller LR rather than a spike guard."
                ),
            )
        )
    elif clipping is not None:
        suggested = as_float(clipping.evidence.get("suggested_max_norm"))
        ok = suggested is not None and 0.5 <= suggested <= 2.0
        tip.claims.append(_claim("max_norm=1.0 suits this job", HOLDS if ok else FAILS, clipping.summary))
    else:
        tip.claims.append(_claim("max_norm=1.0 suits this job", UNMEASURED, "no grad norms recorded"))
    desync = ctx.first("rank_desync")
    if desync is None or desync.verdict == "not_run":
        tip.claims.append(
            _claim("manual_seed(42 + rank) is safe", UNMEASURED, "no cross-rank weight checksum in this run")
        )
    else:
        ok = desync.verdict == "pass"
        tip.claims.append(
            _claim(
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
        )
    steady, why = _fp16_scaler(ctx)
    if steady is None:
        tip.claims.append(_claim("init_scale=2**10", UNMEASURED, why))
    else:
        ok = SEED_INIT_SCALE / 4 <= steady <= SEED_INIT_SCALE * 4
        tip.claims.append(
            _claim(
                "init_scale=2**10",
                HOLDS if ok else FAILS,
                f"the scaler settled at {steady:g} (2**10 = 1024; GradScaler's default "
                f"{GRADSCALER_INIT_SCALE:g}).",
            )
        )
    tip.claims.append(
        _claim(
            "init_scale should be higher on multi-GPU",
            FAILS,
            "2**10 is 64× lower than GradScaler's default 2**16, so the advice contradicts itself; and DDP "
            "averages gradients, so their magnitude (what the scale protects) does not grow with the GPU "
            "count.",
            basis="documented fact",
        )
    )
    return tip


def tip6(ctx: Context) -> Tip:
    tip = Tip(
        number=6,
        title="empty_cache against NCCL buffer growth",
        original="神操作六：内存泄漏的捉妖记",
        advice="NCCL buffers accumulate; call torch.cuda.empty_cache() periodically",
    )
    other = ctx.measured("non_pytorch_device_memory")
    if other is None:
        tip.claims.append(
            _claim("NCCL buffers accumulate", UNMEASURED, "no device memory from NVML in this run (no CUDA)")
        )
    else:
        growing = bool(other.evidence.get("growing"))
        tip.claims.append(
            _claim(
                "NCCL buffers accumulate",
                HOLDS if growing else FAILS,
                f"non-PyTorch device memory: {other.summary}",
            )
        )
    empty = ctx.measured("empty_cache")
    if empty is None:
        tip.claims.append(
            _claim(
                "periodic empty_cache() helps",
                UNMEASURED,
                "no empty_cache comparison in this run (needs CUDA)",
            )
        )
    else:
        helps = empty.evidence.get("recommend_periodic_empty_cache", empty.evidence.get("helps"))
        status = HOLDS if helps else FAILS
        tip.claims.append(
            _claim(
                "periodic empty_cache() helps",
                status,
                f"{empty.summary}. It only returns the caching allocator's free blocks; NCCL's buffers are "
                "not "
                "allocated through it.",
            )
        )
    leaks = [f for f in ctx.all("memory_leak") if f.verdict in ("warn", "fail")]
    if ctx.all("memory_leak"):
        tip.claims.append(
            _claim(
                "this job has a memory leak to catch",
                HOLDS if leaks else FAILS,
                "; ".join(f.summary for f in leaks) or "no leak: memory is flat after warm-up on every rank",
            )
        )
    return tip


def tip7(ctx: Context) -> Tip:
    tip = Tip(
        number=7,
        title="Checkpoint and resume",
        original="神操作七：断点续训的终极方案",
        advice=(
            "rank 0 saves then barrier; rank 0 loads then broadcast; also save optimizer and scheduler state"
        ),
    )
    cost = ctx.measured("checkpoint_cost")
    risk = ctx.measured("timeout_risk")
    if risk is not None:
        tip.claims.append(
            _claim(
                "rank-0 save + barrier is safe",
                HOLDS if risk.verdict == "pass" else FAILS,
                risk.summary,
            )
        )
    elif cost is not None:
        save = as_float(cost.evidence.get("save_s")) or 0.0
        timeout = float(ctx.spec.distributed.timeout_s)
        tip.claims.append(
            _claim(
                "rank-0 save + barrier is safe",
                HOLDS if save * TIMEOUT_SAFETY_FACTOR <= timeout else FAILS,
                f"save {save:.3g} s vs process-group timeout {timeout:g} s.",
            )
        )
    else:
        tip.claims.append(_claim("rank-0 save + barrier is safe", UNMEASURED, "no checkpoint was timed"))
    peak = as_float(cost.evidence.get("peak_load_rss_bytes")) if cost is not None else None
    if cost is not None and peak:
        tip.claims.append(
            _claim(
                "rank-0 load + broadcast is fine",
                HOLDS if cost.verdict == "pass" else FAILS,
                f"peak host memory during load {format_bytes(peak)} per rank: every rank holds a full copy, "
                "which grows with the model (sharded torch.distributed.checkpoint avoids it).",
            )
        )
    else:
        tip.claims.append(
            _claim("rank-0 load + broadcast is fine", UNMEASURED, "no checkpoint load was measured")
        )
    mismatch = ctx.first("resume_mismatch")
    if mismatch is None or mismatch.verdict == "not_run":
        tip.claims.append(
            _claim(
                "optimizer + scheduler state make resume exact",
                UNMEASURED,
                "no resume comparison in this run",
            )
        )
    else:
        missing = [str(m) for m in mismatch.evidence.get("missing") or []]
        extra = [m for m in missing if not any(k in m.lower() for k in ("optim", "sched"))]
        ok = mismatch.verdict == "pass"
        tip.claims.append(
            _claim(
                "optimizer + scheduler state make resume exact",
                HOLDS if ok else FAILS,
                mismatch.summary + (f" (also needed: {', '.join(extra)})" if extra else ""),
            )
        )
    return tip


def evaluate_tips(ctx: Context, *, grad_norms: Sequence[float] = ()) -> list[Tip]:
    """All seven tips, each claim judged by this run's findings (and grad norms from the step records)."""
    return [tip1(ctx), tip2(ctx), tip3(ctx), tip4(ctx), tip5(ctx, grad_norms), tip6(ctx), tip7(ctx)]
