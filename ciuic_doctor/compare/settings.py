"""What differs between two runs' settings: the job spec, the settings a watched job reported
(meta.json `observed`, in the spec's section.key names), injected faults, the NCCL_* / TORCH_* / OMP_*
environment, and the versions that ran. This is the "num_workers 2 → 0" a comparison is read against.

>>> a = {"spec": {"dataloader": {"num_workers": 2}}, "env": {"env": {"NCCL_ALGO": "ring", "RANK": "0"}}}
>>> b = {"spec": {"dataloader": {"num_workers": 0}}, "env": {"env": {"RANK": "1"}}}
>>> [c.text() for c in settings_diff(a, b)]
['dataloader.num_workers 2 → 0', 'env NCCL_ALGO ring → (unset)']
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

# Set per process or per launch: they differ between any two runs and say nothing about the job.
VOLATILE_ENV = {
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "CIUIC_RUN_DIR",
}
VOLATILE_ENV_PREFIXES = ("TORCHELASTIC_",)
VERSION_KEYS = ("python", "torch", "cuda", "nccl", "cudnn")


@dataclass(kw_only=True)
class SettingChange:
    key: str
    a: Any
    b: Any
    source: str  # spec | observed | inject | env | version

    def text(self) -> str:
        name = f"env {self.key}" if self.source == "env" else self.key
        return f"{name} {_show(self.a)} → {_show(self.b)}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if not isinstance(data, dict):
        return {prefix: data} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        elif not (isinstance(value, dict) and not value):
            out[name] = value
    return out


def _env(meta: dict[str, Any]) -> dict[str, str]:
    env = (meta.get("env") or {}).get("env") or {}
    return {k: v for k, v in env.items() if k not in VOLATILE_ENV and not k.startswith(VOLATILE_ENV_PREFIXES)}


def _versions(meta: dict[str, Any]) -> dict[str, Any]:
    env = meta.get("env") or {}
    return {key: env.get(key) for key in VERSION_KEYS if env.get(key) is not None}


def _injections(meta: dict[str, Any]) -> dict[str, Any]:
    injected = (meta.get("job_run") or {}).get("injections") or {}
    return {k: v for k, v in flatten(injected).items() if v is not None}


def _observed(meta: dict[str, Any]) -> dict[str, Any]:
    observed = flatten(meta.get("observed") if isinstance(meta.get("observed"), dict) else {})
    return {k: _without_run_dir(v) if k.endswith("argv") else v for k, v in observed.items()}


def _without_run_dir(argv: Any) -> Any:
    """A command line less its `--out RUN`: every run writes to its own directory, so that part of the
    argv always differs and says nothing about the job.

    >>> _without_run_dir(["job", "--out", "reports/a", "--steps", "20", "--out=b"])
    ['job', '--steps', '20']
    """
    if not isinstance(argv, list):
        return argv
    kept, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--out":
            skip_next = True
        elif not (isinstance(arg, str) and arg.startswith("--out=")):
            kept.append(arg)
    return kept


def settings_diff(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> list[SettingChange]:
    """Every setting that differs, spec first (what the user changed), then what the job observed, the
    injected faults, the environment and the versions."""
    changes: list[SettingChange] = []
    sources = (
        ("spec", lambda m: flatten(m.get("spec") if isinstance(m.get("spec"), dict) else {})),
        ("observed", _observed),
        ("inject", lambda m: {f"inject.{k}": v for k, v in _injections(m).items()}),
        ("env", _env),
        ("version", lambda m: {f"version.{k}": v for k, v in _versions(m).items()}),
    )
    for source, read in sources:
        a, b = read(meta_a), read(meta_b)
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                changes.append(SettingChange(key=key, a=a.get(key), b=b.get(key), source=source))
    # A spec value the job also reports as observed: keep one line, the spec's. And the command line is
    # how spec and inject changes were made (`job --inject slow-rank=1:400`): its change is said only when
    # nothing else explains it (a script's `--lr 3e-4` → `--lr 1e-3`).
    spec_keys = {c.key for c in changes if c.source == "spec"}
    explained = any(c.source in ("spec", "inject") for c in changes)
    return [
        c
        for c in changes
        if not (c.source == "observed" and (c.key in spec_keys or (explained and c.key.endswith("argv"))))
    ]


def headline(changes: list[SettingChange], limit: int = 3) -> str:
    """The settings part of a summary: "dataloader.num_workers 2 → 0" (or "same settings")."""
    if not changes:
        return "same settings"
    shown = ", ".join(c.text() for c in changes[:limit])
    return shown + (f" and {len(changes) - limit} more" if len(changes) > limit else "")
