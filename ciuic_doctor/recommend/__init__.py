"""Job spec + findings -> recommended settings, each with the measurement behind it.

The rule of the house (GUIDE): no measurement, no recommendation. A rule whose probe did not run returns
nothing; where the measurements cannot separate two options (Ring vs Tree inside the noise) the answer is
"leave the default". The one exception is the learning rate, which is arithmetic on the job's own settings;
it says so in its `evidence` and carries low confidence until a stability probe has seen the job train.

A recommendation's `setting` says where it goes:
    NCCL_ALGO, PYTORCH_CUDA_ALLOC_CONF, ...   environment variables -> recommended.env and [distributed.env]
    dataloader.num_workers, optim.clip_max_norm, ...   job-spec keys -> recommended.toml
    anything else ("memory leak", "seed per rank", ...)   advice for a person; no file changes
A finding that names no change (a straggler rank, a slow host) is not a recommendation: the report shows
it among the findings to look at.
An environment recommendation whose `value` is None means "leave it unset" (remove it where it is set).

Some rules also judge the job's *current* settings against measurements (a 30 s process-group timeout next
to a 90 s checkpoint save); those verdicts come back as findings of probe "settings" for the verdict table.

Rules live by area (comm.py, training.py, memory.py); each is `rule(ctx, plan)` and adds to the plan only
what its findings support. A new rule is one function added to RULES.
"""

from __future__ import annotations

from typing import Any

from ciuic_doctor.jobs.observed import ResolvedSpec
from ciuic_doctor.jobs.spec import JobSpec
from ciuic_doctor.recommend import comm, memory, training
from ciuic_doctor.recommend.comm import longest_waits
from ciuic_doctor.recommend.core import (
    EXPANDABLE,
    FLIGHT_RECORDER_ENV,
    GRADSCALER_GROWTH_INTERVAL,
    GRADSCALER_INIT_SCALE,
    NCCL_PER_COLLECTIVE_SINCE,
    ONECYCLE_DEFAULT_PCT_START,
    TIMEOUT_SAFETY_FACTOR,
    Context,
    Plan,
    Rule,
    environment_of,
    is_change,
    nccl_algo_value,
    parse_version,
    setting_kind,
)
from ciuic_doctor.rundir.findings import Finding

__all__ = [
    "EXPANDABLE",
    "FLIGHT_RECORDER_ENV",
    "GRADSCALER_GROWTH_INTERVAL",
    "GRADSCALER_INIT_SCALE",
    "NCCL_PER_COLLECTIVE_SINCE",
    "ONECYCLE_DEFAULT_PCT_START",
    "RULES",
    "TIMEOUT_SAFETY_FACTOR",
    "Context",
    "Plan",
    "environment_of",
    "is_change",
    "longest_waits",
    "nccl_algo_value",
    "parse_version",
    "recommend",
    "setting_kind",
]

RULES: tuple[Rule, ...] = (
    comm.rule_nccl_algo,
    comm.rule_nccl_algo_global,
    comm.rule_pg_timeout,
    comm.rule_flight_recorder,
    training.rule_dataloader,
    training.rule_learning_rate,
    training.rule_clipping,
    training.rule_loss_scaler,
    training.rule_desync,
    memory.rule_allocator,
    memory.rule_memory_findings,
    memory.rule_checkpoint,
)


def recommend(
    spec: JobSpec,
    findings: list[Finding],
    meta: dict[str, Any] | None = None,
    *,
    resolved: ResolvedSpec | None = None,
) -> Plan:
    """Every rule on the findings of one run; rules whose measurements are absent add nothing.

    For an observed job (`resolved` from meta.json's `observed`), a spec setting the job did not expose
    (no DataLoader, a key watch did not see) gets no recommendation: its "current" would be a default.
    """
    ctx = Context(spec=spec, findings=list(findings), meta=meta or {}, resolved=resolved)
    plan = Plan()
    for rule in RULES:
        rule(ctx, plan)
    plan.recommendations = [r for r in plan.recommendations if _job_exposes(ctx, r.setting)]
    return plan


def _job_exposes(ctx: Context, setting: str) -> bool:
    kind = setting_kind(setting)
    if kind == "spec":
        return ctx.exposed(setting)
    if kind == "env" and setting.startswith(("NCCL_", "TORCH_NCCL_")) and ctx.observed:
        # A single-process job runs no collective: its NCCL settings change nothing.
        return not (ctx.exposed("job.procs_per_node") and ctx.spec.world_size == 1)
    return True
