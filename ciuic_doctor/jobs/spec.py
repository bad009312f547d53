"""The job spec: a TOML file that describes a training job as the recommendations need it.

The tiny default ships with the package (`default.toml`); `--spec FILE` overrides any subset of it
(sections merge key by key, so a user's file may name only what differs). The recommendations read the
current settings from here, and write a copy with the recommended values applied (`with_updates`).

>>> spec = load_spec()
>>> spec.global_batch == spec.batch.per_process * spec.world_size * spec.batch.grad_accum
True
>>> with_updates(spec, {"dataloader.num_workers": 1}).dataloader.num_workers
1
"""

from __future__ import annotations

import copy
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_SPEC = "default.toml"


@dataclass(kw_only=True)
class JobSection:
    name: str = "deepseek-v3-tiny"
    nodes: int = 1
    procs_per_node: int = 2
    steps: int = 40
    seed: int = 1234


@dataclass(kw_only=True)
class BatchSection:
    per_process: int = 8
    grad_accum: int = 1
    reference: int = 256
    seq_len: int = 64


@dataclass(kw_only=True)
class OptimSection:
    name: str = "adamw"
    base_lr: float = 1e-2  # as jobs/default.toml
    lr_scaling: str = "sqrt"
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    clip_max_norm: float = 1.0
    warmup_pct: float = 0.1


@dataclass(kw_only=True)
class PrecisionSection:
    mode: str = "fp32"
    init_scale: float = 65536.0
    growth_interval: int = 2000


@dataclass(kw_only=True)
class DataLoaderSection:
    num_workers: int = 2
    prefetch_factor: int | None = 2
    pin_memory: bool = False
    persistent_workers: bool = True
    multiprocessing_context: str = "forkserver"  # as jobs/default.toml explains


@dataclass(kw_only=True)
class DistributedSection:
    backend: str = "auto"
    timeout_s: float = 1800.0
    bucket_cap_mb: float = 25.0
    env: dict[str, str] = field(default_factory=dict)


@dataclass(kw_only=True)
class CheckpointSection:
    every_steps: int = 20
    keep: int = 2


@dataclass(kw_only=True)
class JobSpec:
    job: JobSection = field(default_factory=JobSection)
    batch: BatchSection = field(default_factory=BatchSection)
    optim: OptimSection = field(default_factory=OptimSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    dataloader: DataLoaderSection = field(default_factory=DataLoaderSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    model: dict[str, Any] = field(default_factory=dict)
    source: str = "default"  # where the spec came from (not a TOML section)

    @property
    def world_size(self) -> int:
        return self.job.nodes * self.job.procs_per_node

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step across all ranks."""
        return self.batch.per_process * self.batch.grad_accum * self.world_size

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("source")
        return data


def _build(data: dict[str, Any], source: str) -> JobSpec:
    """The JobSpec of merged TOML data; every bad section, key and value is named in one UserError."""
    from ciuic_doctor.jobs.spec_check import problems

    bad: list[str] = []
    known_sections = {f.name for f in fields(JobSpec)} - {"source"}
    unknown_sections = set(data) - known_sections
    if unknown_sections:
        bad.append(f"unknown section(s): {', '.join(sorted(map(str, unknown_sections)))}")
    section_classes: dict[str, Any] = {}
    for spec_field in fields(JobSpec):
        name = spec_field.name
        if name == "source":
            continue
        value = data.get(name, {})
        if not isinstance(value, dict):
            bad.append(f"[{name}] must be a table")
            continue
        if name == "model":
            continue
        cls = spec_field.default_factory  # the section dataclass
        section_classes[name] = cls
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            bad.append(f"unknown key(s) in [{name}]: {', '.join(sorted(map(str, unknown)))}")
    bad += problems(data)
    if bad:
        count = f"{len(bad)} problems: " if len(bad) > 1 else ""
        raise UserError(f"{source}: {count}{'; '.join(bad)}")
    _allowed_env(data)
    sections: dict[str, Any] = {name: cls(**data.get(name, {})) for name, cls in section_classes.items()}
    sections["model"] = dict(data.get("model", {}))
    return JobSpec(**sections, source=source)


_SAID: set[str] = set()  # refused [distributed.env] names already said in this process


def _allowed_env(data: dict[str, Any]) -> None:
    """Drop the [distributed.env] names a job's environment never takes (PYTHONPATH, LD_*, PATH, ...:
    rundir/trust.py's allow-list), whether they come from a spec file, --set or a recorded run; each
    refused name is said once per process, in one line. Every spec is built here, so the job, verify,
    checkup and report's recommended.toml all see the same environment."""
    from ciuic_doctor.rundir.trust import allowed_env

    distributed = data.get("distributed")
    env = distributed.get("env") if isinstance(distributed, dict) else None
    if not env:
        return

    def say(line: str) -> None:
        if line not in _SAID:
            _SAID.add(line)
            print(line, file=sys.stderr)

    distributed["env"] = allowed_env(env, where="[distributed.env]", say=say)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def default_spec_data() -> dict[str, Any]:
    text = resources.files("ciuic_doctor.jobs").joinpath(DEFAULT_SPEC).read_text()
    return tomllib.loads(text)


def load_spec(path: str | Path | None = None) -> JobSpec:
    """The default spec, with the file at `path` (if any) merged over it. Bad files raise UserError."""
    data = default_spec_data()
    source = "default"
    if path is not None:
        path = Path(path)
        try:
            user = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"--spec {path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--spec {path}: cannot read ({exc})") from None
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"--spec {path}: not valid TOML ({exc})") from None
        data = _merge(data, user)
        source = str(path)
    return _build(data, source)


def with_updates(spec: JobSpec, updates: dict[str, Any], *, origin: str | None = None) -> JobSpec:
    """A copy of `spec` with dotted keys replaced, e.g. {"distributed.env.NCCL_ALGO": "allreduce:ring"}.

    `origin` is what a bad value is blamed on (`--set`); by default the spec's own source.
    """
    data = spec.to_dict()
    for dotted, value in updates.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserError(f"{origin or spec.source}: {dotted}: {part} is a value, not a table")
            node = child
        node[leaf] = value
    result = _build(data, origin or spec.source)
    return replace(result, source=spec.source) if origin else result


def dump_spec(spec: JobSpec) -> str:
    """The spec as TOML text (what `recommended.toml` holds)."""
    import tomli_w

    data = spec.to_dict()
    # TOML has no null: drop None values (e.g. prefetch_factor with num_workers = 0).
    return tomli_w.dumps({k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in data.items()})
