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

import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import UserError
from ciuic_doctor.jobs.spec import JobSpec, load_spec, with_updates
from ciuic_doctor.rundir import safe_io

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


# Keys whose observed null is a value, not a gap: a loader without workers has no prefetch_factor, and a
# script that never calls clip_grad_norm_ does not clip (the spec writes that as 0).
OBSERVED_NONE = {"prefetch_factor": None, "clip_max_norm": 0.0}
RANK_FILE = re.compile(r"^observed\.rank(\d+)\.json$")
RANK_FILE_MAX_BYTES = 1 << 20
SETTING_SECTIONS = ("batch", "optim", "precision", "dataloader", "distributed", "model")
MAX_DISAGREEMENTS = 20


def merge_ranks(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """meta.json with the other ranks' records (RUN/observed.rank<R>.json, which every rank but 0 writes)
    merged into `observed`: rank 0's settings stand, and `observed.ranks` says which ranks recorded and
    where they disagree ({"dataloader.num_workers": {"2": [0], "4": [1, 3]}}). With no rank 0 record
    (rank 0 died before its first step), the lowest rank's record stands."""
    others: dict[int, dict[str, Any]] = {}
    try:
        names = sorted(p.name for p in path.iterdir() if RANK_FILE.match(p.name))
    except OSError:
        return meta
    for name in names:
        record = safe_io.read_json(path / name, max_bytes=RANK_FILE_MAX_BYTES)
        if isinstance(record, dict) and isinstance(record.get("job"), dict):
            others[int(RANK_FILE.match(name).group(1))] = record  # type: ignore[union-attr]
    if not others:
        return meta
    observed = meta.get("observed") if has_observed(meta) else None
    records = dict(others)
    if observed is not None:
        records[0] = observed
    else:
        observed = records[min(records)]
    flat = {rank: _settings(record) for rank, record in records.items()}
    disagree: dict[str, dict[str, list[int]]] = {}
    for key in sorted({k for values in flat.values() for k in values}):
        seen: dict[str, list[int]] = {}
        for rank in sorted(flat):
            seen.setdefault(json.dumps(flat[rank].get(key), sort_keys=True), []).append(rank)
        if len(seen) > 1 and len(disagree) < MAX_DISAGREEMENTS:
            disagree[key] = seen
    observed = {**observed, "ranks": {"recorded": sorted(records), "disagree": disagree}}
    return {**meta, "observed": observed}


def _settings(record: dict[str, Any]) -> dict[str, Any]:
    """A record's settings as dotted keys (the per-rank facts a job may set differently on purpose, such
    as the steps each rank ran, stay out)."""
    out = {}
    for section in SETTING_SECTIONS:
        values = record.get(section)
        if isinstance(values, dict):
            for key, value in values.items():
                if key not in ("lr_ran", "env", "loaders"):
                    out[f"{section}.{key}"] = value
    return out


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
            if key in seen and seen[key] is None and key in OBSERVED_NONE:
                updates[f"{section}.{key}"] = OBSERVED_NONE[key]  # seen as absent: the spec's word for it
            elif key in seen and seen[key] is not None:
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
    ranks = observed.get("ranks") if isinstance(observed.get("ranks"), dict) else {}
    if ranks.get("recorded"):
        said = f"{len(ranks['recorded'])} recorded their settings; rank {min(ranks['recorded'])}'s are shown"
        for key, values in (ranks.get("disagree") or {}).items():
            said += f"; {key} differs: " + ", ".join(f"{v} on ranks {r}" for v, r in values.items())
        rows.append(("ranks", said))
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
