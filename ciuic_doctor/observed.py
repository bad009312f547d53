"""meta.json's `observed` (what a watched script configured) -> the JobSpec the report judges.

Each spec key takes the observed value; a key nothing observed keeps the default and is listed as
assumed, so the report can say which of the "current" values it did not see. The model section is the
observed one only (never the embedded DeepSeek config), and the job's name is the script's.

>>> observed = {"job": {"name": "train.py", "nodes": 1, "procs_per_node": 1},
...             "optim": {"name": "adamw", "base_lr": 3e-4, "lr_scaling": "none"},
...             "dataloader": {}, "model": {"parameters": 1234}}
>>> result = spec_from_observed(observed)
>>> result.spec.job.name, result.spec.optim.base_lr, result.spec.model
('train.py', 0.0003, {'parameters': 1234})
>>> "dataloader.num_workers" in result.assumed, "optim.base_lr" in result.assumed
(True, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from ciuic_doctor.errors import UserError
from ciuic_doctor.jobs.spec import JobSpec, load_spec, with_updates

SOURCE = "observed (what the script configured, recorded by watch)"


@dataclass(kw_only=True)
class ResolvedSpec:
    """The spec a report judges, and how much of it is the job's own."""

    spec: JobSpec
    kind: str  # file (--spec) | recorded (the embedded job's own) | observed (watch) | fallback (default)
    assumed: list[str] = field(default_factory=list)  # dotted keys filled from the defaults
    observed: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # the sentence the report shows at the top when the spec is not all the job's own

    def exposed(self, section: str) -> bool:
        """False when the job showed nothing of `section` (e.g. no DataLoader): no recommendation there."""
        keys = self.observed.get(section)
        return self.kind != "observed" or bool(isinstance(keys, dict) and keys)


def has_observed(meta: dict[str, Any]) -> bool:
    observed = meta.get("observed")
    return isinstance(observed, dict) and isinstance(observed.get("job"), dict)


def spec_from_observed(observed: dict[str, Any]) -> ResolvedSpec:
    """The observed job as a JobSpec; what was not observed comes from the defaults, marked assumed."""
    base = load_spec()
    updates: dict[str, Any] = {}
    assumed: list[str] = []
    for section_field in fields(JobSpec):
        section = section_field.name
        if section in ("source", "model"):
            continue
        seen = observed.get(section) if isinstance(observed.get(section), dict) else {}
        for key in (f.name for f in fields(type(getattr(base, section)))):
            if key in seen and (seen[key] is not None or key == "prefetch_factor"):
                updates[f"{section}.{key}"] = seen[key]
            else:
                assumed.append(f"{section}.{key}")
    model = observed.get("model")
    updates["model"] = dict(model) if isinstance(model, dict) else {}
    spec = base
    for dotted, value in updates.items():  # one by one: a value the spec cannot hold stays assumed
        try:
            spec = with_updates(spec, {dotted: value})
        except (UserError, TypeError, ValueError):
            assumed.append(dotted)
    spec = replace(spec, source=SOURCE)
    note = ""
    if assumed:
        note = (
            f"The job spec is what {spec.job.name} configured, as watch observed it; "
            f"{len(assumed)} setting(s) were not observed and hold ciuic-doctor's defaults (assumed): "
            + ", ".join(assumed)
            + "."
        )
    return ResolvedSpec(spec=spec, kind="observed", assumed=assumed, observed=observed, note=note)


def fallback(reason: str) -> ResolvedSpec:
    """The embedded default spec, standing in for a job this run did not describe."""
    spec = load_spec()
    note = (
        f"This report judges the embedded default job ({spec.job.name}), not the job that ran: {reason}. "
        "Its “current” settings and recommended.toml are that job's; pass --spec JOB.TOML, or record "
        "the job with `ciuic-doctor watch -- train.py`."
    )
    return ResolvedSpec(spec=spec, kind="fallback", note=note)


def describe_observed(observed: dict[str, Any]) -> list[tuple[str, str]]:
    """(setting, value) rows of what the script configured, for the report's job section."""
    rows: list[tuple[str, str]] = []
    job = observed.get("job") or {}
    if job.get("argv"):
        rows.append(("script", " ".join(str(a) for a in job["argv"])))
    for section in ("job", "batch", "optim", "precision", "dataloader", "distributed", "model"):
        values = observed.get(section)
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if section == "job" and key in ("argv", "script", "name"):
                continue
            if value is None or value in ({}, []):
                continue
            rows.append((f"{section}.{key}", _short(value)))
    return rows


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_short(v)}" for k, v in value.items() if v is not None)
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return "; ".join(f"({_short(v)})" for v in value)  # param groups: one (...) each
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)
