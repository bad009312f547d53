"""Job spec + findings -> recommended settings, each with the measurement behind it.

The rule of the house (GUIDE): no measurement, no recommendation. A rule whose probe did not run returns
nothing; where the measurements cannot separate two options (Ring vs Tree inside the noise) the answer is
"leave the default". The one exception is the learning rate, which is arithmetic on the job's own settings;
it says so in its `evidence` and carries low confidence until a stability probe has seen the job train.

A recommendation's `setting` says where it goes:
    NCCL_ALGO, PYTORCH_CUDA_ALLOC_CONF, ...   environment variables -> recommended.env and [distributed.env]
    dataloader.num_workers, optim.clip_max_norm, ...   job-spec keys -> recommended.toml
    anything else ("memory leak", "straggler", ...)    advice for a person; no file changes
An environment recommendation whose `value` is None means "leave it unset" (remove it where it is set).

Some rules also judge the job's *current* settings against measurements (a 30 s process-group timeout next
to a 90 s checkpoint save); those verdicts come back as findings of probe "settings" for the verdict table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.findings import Confidence, Finding, Recommendation
from ciuic_doctor.jobs.spec import JobSpec
from ciuic_doctor.store import as_float
from ciuic_doctor.units import format_bytes

# PyTorch's defaults, named wherever a rule compares with them.
PG_TIMEOUT_DEFAULT_S = {"nccl": 600.0, "gloo": 1800.0}  # torch.distributed: 10 min NCCL, 30 min others
GRADSCALER_INIT_SCALE = 2.0**16
GRADSCALER_GROWTH_INTERVAL = 2000
ONECYCLE_DEFAULT_PCT_START = 0.3
# A save measured once on this file system will vary (shared storage, page cache); the timeout must
# cover the longest legitimate wait with room to spare.
TIMEOUT_SAFETY_FACTOR = 3.0
# NCCL >= 2.24.3 filters NCCL_ALGO strictly and accepts the per-collective form `allreduce:tree`.
NCCL_PER_COLLECTIVE_SINCE = (2, 24, 3)
FLIGHT_RECORDER_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
EXPANDABLE = "expandable_segments:True"
SPEC_SECTIONS = ("job", "batch", "optim", "precision", "dataloader", "distributed", "checkpoint", "model")
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def setting_kind(setting: str) -> str:
    """'env' for an environment variable, 'spec' for a job-spec key, 'advice' for everything else."""
    if _ENV_NAME.match(setting):
        return "env"
    if "." in setting and setting.split(".", 1)[0] in SPEC_SECTIONS and " " not in setting:
        return "spec"
    return "advice"


def parse_version(text: Any) -> tuple[int, ...] | None:
    """(2, 21, 5) from "2.21.5" (or a list/tuple); None when unknown."""
    if text is None:
        return None
    if isinstance(text, list | tuple):
        return tuple(int(p) for p in text)
    parts = re.findall(r"\d+", str(text))
    return tuple(int(p) for p in parts[:3]) if parts else None


def nccl_algo_value(algo: str, nccl_version: Any) -> str:
    """The NCCL_ALGO value that selects `algo` for all-reduce only, in the form the NCCL version reads.

    >>> nccl_algo_value("tree", "2.26.2")
    'allreduce:tree'
    >>> nccl_algo_value("tree", "2.21.5")
    'Tree'
    """
    version = parse_version(nccl_version)
    if version is None or version >= NCCL_PER_COLLECTIVE_SINCE:
        return f"allreduce:{algo.lower()}"
    return algo.capitalize()


def _nice_seconds(seconds: float) -> float:
    """Round a timeout up to a value a person would type (60, 120, 300, 600, 900, 1200, 1800, 3600...)."""
    for nice in (60, 120, 300, 600, 900, 1200, 1800, 2700, 3600, 5400, 7200):
        if seconds <= nice:
            return float(nice)
    return float(math.ceil(seconds / 3600) * 3600)


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def environment_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The environment capture in meta.json. Probes write it under "env" or "environment" (with or without
    torch's view of CUDA/NCCL); merge both, a known value winning over a missing one."""
    merged: dict[str, Any] = {}
    for key in ("environment", "env"):
        part = meta.get(key)
        if isinstance(part, dict):
            merged.update({k: v for k, v in part.items() if v is not None or k not in merged})
    return merged


@dataclass(kw_only=True)
class Context:
    """What every rule sees: the job's current settings, the findings, and meta.json."""

    spec: JobSpec
    findings: list[Finding]
    meta: dict[str, Any] = field(default_factory=dict)

    def first(self, check: str) -> Finding | None:
        return next((f for f in self.findings if f.check == check), None)

    def all(self, check: str) -> list[Finding]:
        return [f for f in self.findings if f.check == check]

    def measured(self, check: str) -> Finding | None:
        """The finding for `check` if its check ran (verdict other than not_run)."""
        found = self.first(check)
        return found if found is not None and found.verdict != "not_run" else None

    @property
    def environment(self) -> dict[str, Any]:
        return environment_of(self.meta)

    @property
    def backend(self) -> str | None:
        """The backend that was measured (comm-bench), else the spec's when it names one."""
        for check in ("algo_choice", "busbw"):
            for finding in self.all(check):
                if finding.evidence.get("backend"):
                    return str(finding.evidence["backend"])
        return self.spec.distributed.backend if self.spec.distributed.backend != "auto" else None

    @property
    def nccl_version(self) -> Any:
        choice = self.first("algo_choice")
        if choice is not None and choice.evidence.get("nccl_version"):
            return choice.evidence["nccl_version"]
        return self.environment.get("nccl")

    def current_env(self, name: str) -> str | None:
        """The variable as the job sets it (spec [distributed.env]) or as the run's environment had it."""
        if name in self.spec.distributed.env:
            return self.spec.distributed.env[name]
        captured = self.environment.get("env") or {}
        return captured.get(name) if isinstance(captured, dict) else None


@dataclass(kw_only=True)
class Plan:
    """Everything the rules produced: settings to apply, and verdicts on the current settings."""

    recommendations: list[Recommendation] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    def spec_updates(self, spec: JobSpec) -> dict[str, Any]:
        """Dotted spec keys -> values for `with_updates`; env settings land in [distributed.env]."""
        updates: dict[str, Any] = {}
        env = dict(spec.distributed.env)
        env_changed = False
        for rec in self.recommendations:
            kind = setting_kind(rec.setting)
            if kind == "spec" and rec.value is not None:
                updates[rec.setting] = rec.value
            elif kind == "env":
                env_changed = True
                if rec.value is None:
                    env.pop(rec.setting, None)
                else:
                    env[rec.setting] = str(rec.value)
        if env_changed:
            updates["distributed.env"] = env
        return updates


Rule = Callable[[Context, Plan], None]


def _rec(
    plan: Plan,
    setting: str,
    value: Any,
    why: str,
    *,
    confidence: Confidence,
    current: Any = None,
    evidence: dict[str, Any] | None = None,
    **more: Any,
) -> None:
    plan.recommendations.append(
        Recommendation(
            setting=setting,
            value=value,
            why=why,
            confidence=confidence,
            current=current,
            evidence={**(evidence or {}), **more},
        )
    )


# ---- communication -------------------------------------------------------------------------------


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
        _rec(
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
            f"{format_bytes(r['bytes'])}: ring {_fmt(r.get('ring_busbw_gbps') or 0)} vs tree "
            f"{_fmt(r.get('tree_busbw_gbps') or 0)} GB/s"
            for r in near
        ]
        _rec(
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
    _rec(
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
    if risk is not None and as_float(risk.evidence.get("save_s")):
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
    default_s = PG_TIMEOUT_DEFAULT_S.get(backend, PG_TIMEOUT_DEFAULT_S["gloo"])
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
        _rec(
            plan,
            "distributed.timeout_s",
            current,
            f"Keep {current:g} s: it covers {TIMEOUT_SAFETY_FACTOR:g}× the longest measured wait ({label}, "
            f"{_fmt(longest)} s). {defaults}.",
            confidence=confidence,
            current=current,
            evidence=evidence,
        )
        verdict = "pass"
        summary = (
            f"timeout {current:g} s ≥ {TIMEOUT_SAFETY_FACTOR:g}× the longest measured wait "
            f"({label}, {_fmt(longest)} s)"
        )
    else:
        value = max(default_s, _nice_seconds(needed))
        _rec(
            plan,
            "distributed.timeout_s",
            value,
            f"{current:g} s is less than {TIMEOUT_SAFETY_FACTOR:g}× the longest measured wait ({label}, "
            f"{_fmt(longest)} s): the ranks waiting for it would be torn down as hung. {defaults}; "
            f"{value:g} s covers the wait and still ends a real hang.",
            confidence=confidence,
            current=current,
            evidence=evidence,
        )
        verdict = "fail" if current < longest else "warn"
        summary = f"timeout {current:g} s vs {label} {_fmt(longest)} s (needs ≥ {_fmt(needed)} s with margin)"
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
        _rec(
            plan,
            name,
            value,
            why[name],
            confidence="medium",
            current=ctx.current_env(name),
            backend=ctx.backend,
        )


def rule_stragglers(ctx: Context, plan: Plan) -> None:
    """Ranks consistently slower than the others, in collectives (comm-bench) or in step time (watch)."""
    for finding in ctx.all("straggler") + ctx.all("step_time"):
        if finding.verdict not in ("warn", "fail"):
            continue
        ev = finding.evidence
        rank = ev.get("rank", ev.get("slowest_rank", finding.where.get("rank")))
        host = ev.get("host") or finding.where.get("host")
        slowdown = as_float(ev.get("slowdown_pct"))
        what = "collectives" if finding.check == "straggler" else "step time"
        _rec(
            plan,
            f"straggler ({what})",
            f"rank {rank}"
            + (f" on {host}" if host else "")
            + (f" (+{slowdown:.0f} %)" if slowdown is not None else ""),
            f"{finding.summary}. Every collective waits for the slowest rank; check that host's clocks, "
            "thermal throttling, NIC/PCIe link and neighbours before tuning anything else.",
            confidence="high" if finding.verdict == "fail" else "medium",
            current=None,
            rank=rank,
            host=host,
            slowdown_pct=slowdown,
        )


# ---- data loading --------------------------------------------------------------------------------


def rule_dataloader(ctx: Context, plan: Plan) -> None:
    """num_workers / prefetch_factor / pin_memory / persistent_workers from loader-sweep."""
    finding = ctx.measured("loader_throughput")
    if finding is None:
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
        why = f"loader-sweep: {measured}."
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
        _rec(
            plan,
            f"dataloader.{key}",
            value,
            why,
            confidence="high" if finding.verdict == "pass" else "medium",
            current=current,
            samples_per_s=rate,
            best=best,
            current_samples_per_s=current_rate,
        )
    shm = ctx.first("loader_shm")
    if shm is not None and shm.verdict in ("warn", "fail"):
        _rec(
            plan,
            "shared memory (/dev/shm)",
            "enlarge (docker --shm-size, or fewer workers × prefetch)",
            f"{shm.summary}. In-flight shared memory ≈ workers × prefetch_factor × batch bytes; a too-small "
            "/dev/shm kills workers with 'Bus error' (docker's default is 64 MB).",
            confidence="high" if shm.verdict == "fail" else "medium",
            current=None,
            evidence=shm.evidence,
        )


# ---- optimisation (arithmetic on the spec, and stability findings) --------------------------------


def rule_learning_rate(ctx: Context, plan: Plan) -> None:
    """Effective LR for the global batch by the sqrt rule (Adam family) or the linear rule (SGD).

    Computed from the spec, not measured: the sqrt rule for adaptive optimisers (Malladi et al. 2022, "On the
    SDEs and Scaling Rules for Adaptive Gradient Algorithms") and the linear rule for SGD (Goyal et al.
    2017) both hold only up to a critical batch size. Confidence stays low unless the stability probe saw this
    job train at that LR without a spike or divergence.
    """
    spec = ctx.spec
    opt = spec.optim
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
    _rec(
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
    _rec(
        plan,
        "optim.warmup_pct",
        pct,
        why,
        confidence=confidence,
        current=opt.warmup_pct,
        basis=basis,
        onecycle={"max_lr": lr, "pct_start": pct, "total_steps": spec.job.steps},
    )


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
    share = f" ({fraction:.0%} of steps clipped at {current:g})" if fraction is not None else ""
    _rec(
        plan,
        "optim.clip_max_norm",
        round(suggested, 3),
        f"{finding.summary}{share}. A threshold from the healthy steps' grad norms clips the outliers only; "
        "one below the typical norm rescales every step, which acts as a smaller LR rather than a guard.",
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
        _rec(
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
        _rec(
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
        _rec(
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


# ---- memory --------------------------------------------------------------------------------------


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
    _rec(
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
        _rec(
            plan,
            f"memory leak ({ev.get('kind', 'host')}, rank {leak.where.get('rank', '?')})",
            f"+{as_float(ev.get('growth_mb_per_step')) or 0:.3g} MB/step, {when}",
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
        _rec(
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
            _rec(
                plan,
                "non-PyTorch device memory",
                "growing" if other.evidence.get("growing") else "large",
                f"{other.summary}. This is memory the caching allocator does not own (NCCL buffers, CUDA "
                "context, cuBLAS workspaces): empty_cache cannot release it.",
                confidence="medium",
                current=None,
                evidence=other.evidence,
            )


# ---- correctness and checkpoints -----------------------------------------------------------------


def rule_desync(ctx: Context, plan: Plan) -> None:
    """Ranks whose weights differ: the `manual_seed(42 + rank)` hazard without a broadcast."""
    finding = ctx.first("rank_desync")
    if finding is None or finding.verdict not in ("warn", "fail"):
        return
    _rec(
        plan,
        "seed per rank",
        "same seed for model init on every rank (or broadcast rank 0's weights)",
        f"{finding.summary}. Per-rank seeds are fine for data order and dropout, never for the weights: "
        "DDP broadcasts rank 0's weights at construction, FSDP only with sync_module_states=True.",
        confidence="high",
        current=None,
        evidence=finding.evidence,
    )


def rule_checkpoint(ctx: Context, plan: Plan) -> None:
    """What the checkpoint doctor measured: missing state on resume, and a save too slow for the timeout."""
    mismatch = ctx.first("resume_mismatch")
    if mismatch is not None and mismatch.verdict in ("warn", "fail"):
        missing = mismatch.evidence.get("missing") or []
        _rec(
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
        _rec(
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


RULES: tuple[Rule, ...] = (
    rule_nccl_algo,
    rule_nccl_algo_global,
    rule_pg_timeout,
    rule_flight_recorder,
    rule_stragglers,
    rule_dataloader,
    rule_learning_rate,
    rule_clipping,
    rule_loss_scaler,
    rule_allocator,
    rule_memory_findings,
    rule_desync,
    rule_checkpoint,
)


def recommend(spec: JobSpec, findings: list[Finding], meta: dict[str, Any] | None = None) -> Plan:
    """Every rule on the findings of one run; rules whose measurements are absent add nothing."""
    ctx = Context(spec=spec, findings=list(findings), meta=meta or {})
    plan = Plan()
    for rule in RULES:
        rule(ctx, plan)
    return plan


def is_change(rec: Recommendation) -> bool:
    """True when following the recommendation changes something (value differs from current).

    An unmeasured "leave unset" (evidence measured=False) is advice and changes nothing.
    """
    if rec.evidence.get("measured") is False:
        return False
    if setting_kind(rec.setting) == "advice":
        return True
    if rec.value is None:
        return rec.current is not None
    if isinstance(rec.value, float) and isinstance(rec.current, int | float):
        return not math.isclose(rec.value, float(rec.current), rel_tol=1e-9)
    return rec.value != rec.current
