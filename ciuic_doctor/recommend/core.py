"""What every recommendation rule shares: the context it reads (spec, findings, meta.json), the plan it
adds to, PyTorch's and NCCL's defaults by name, and where a setting goes (env / spec / advice)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.jobs.observed import ResolvedSpec
from ciuic_doctor.jobs.spec import JobSpec
from ciuic_doctor.rundir.findings import Confidence, Finding, Recommendation

# PyTorch's defaults, named wherever a rule compares with them.
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


def nice_seconds(seconds: float) -> float:
    """Round a timeout up to a value a person would type (60, 120, 300, 600, 900, 1200, 1800, 3600...)."""
    for nice in (60, 120, 300, 600, 900, 1200, 1800, 2700, 3600, 5400, 7200):
        if seconds <= nice:
            return float(nice)
    if not math.isfinite(seconds) or seconds > 1e9:  # an "inf" or 1e308 record: the CLI's own bound
        return 1e9
    return float(math.ceil(seconds / 3600) * 3600)


def fmt_number(x: float) -> str:
    return f"{x:.3g}"


def environment_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The environment capture in meta.json (`RunDir.record_environment` writes it under "env")."""
    env = meta.get("env")
    return env if isinstance(env, dict) else {}


@dataclass(kw_only=True)
class Context:
    """What every rule sees: the job's current settings, the findings, and meta.json."""

    spec: JobSpec
    findings: list[Finding]
    meta: dict[str, Any] = field(default_factory=dict)
    resolved: ResolvedSpec | None = None  # where the spec came from; None: a spec the caller built

    @property
    def observed(self) -> dict[str, Any]:
        """What the watched script configured (meta.json `observed`), {} for any other spec."""
        return self.resolved.observed if self.resolved is not None else {}

    def assumed(self, setting: str) -> bool:
        """True when `setting` (a dotted spec key) is a default standing in for a value nobody observed."""
        return self.resolved is not None and setting in self.resolved.assumed

    def exposed(self, setting: str) -> bool:
        """False for a setting of an observed job that the job did not expose (its section was never
        seen, e.g. no DataLoader, or the key itself was not observed): no recommendation is made there."""
        if self.resolved is None or self.resolved.kind != "observed":
            return True
        return self.resolved.exposed(setting.split(".", 1)[0]) and not self.assumed(setting)

    def first(self, check: str) -> Finding | None:
        return next((f for f in self.findings if f.check == check), None)

    def all(self, check: str) -> list[Finding]:
        return [f for f in self.findings if f.check == check]

    def measured(self, check: str) -> Finding | None:
        """The finding for `check` if its check ran (verdict other than not_run)."""
        found = self.first(check)
        return found if found is not None and found.verdict != "not_run" else None

    def resume_as_saved(self) -> Finding | None:
        """The resume comparison of the checkpoint as the job saves it, not a `--drop` demonstration
        (checkpoint-check records one resume_mismatch finding per variant)."""
        found = [f for f in self.all("resume_mismatch") if not f.evidence.get("dropped_on_purpose")]
        return found[0] if found else None

    @property
    def environment(self) -> dict[str, Any]:
        return environment_of(self.meta)

    @property
    def backend(self) -> str | None:
        """The backend that was measured (comm-bench, checkpoint-check), else the spec's when it names one,
        else what `auto` picks on the measured machine (nccl with CUDA, gloo without)."""
        for check in ("algo_choice", "busbw", "timeout_risk"):
            for finding in self.all(check):
                if finding.evidence.get("backend"):
                    return str(finding.evidence["backend"])
        if self.spec.distributed.backend != "auto":
            return self.spec.distributed.backend
        cuda = self.environment.get("cuda_available")
        return None if cuda is None else ("nccl" if cuda else "gloo")

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


def add(
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
    """Append one recommendation; `evidence` and keyword extras merge into its evidence."""
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
