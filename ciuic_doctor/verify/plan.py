"""What `verify` tries: one candidate per recommended change (or `--try KEY=VALUE`), and why a change
that a short run cannot judge is left as "not verifiable here".

Each candidate is one change judged alone against the job as it is, so a harmful change cannot hide
behind a helpful one. The figure it is judged on is the one its rule aims at: time before backward for
the DataLoader (the loader's share of the step, as watch measures it), skipped steps for the GradScaler
and precision, step time for everything else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ciuic_doctor.recommend.core import setting_kind

TARGETS = {"dataloader": "pre_backward", "precision": "skipped"}
WORKERS = "dataloader.num_workers"
# Settings that act only with DataLoader workers (torch refuses prefetch_factor without them, and
# persistent_workers keeps nothing alive at 0): tried together with the worker count they need.
NEED_WORKERS = ("dataloader.prefetch_factor", "dataloader.persistent_workers")
# Changes whose effect a run of a few dozen steps cannot show, with the reason the report gives.
NOT_VERIFIABLE = {
    "optim.clip_max_norm": "a clip threshold guards against rare grad-norm spikes; a short run of healthy "
    "steps cannot show whether it helps (it acts only on the outliers it caps)",
    "distributed.timeout_s": "the process-group timeout acts only when a rank stops responding; a "
    "healthy run never reaches it",
    "optim.lr_scaling": "LR scaling matters at another world size or batch, and its effect is on "
    "convergence over the whole run, not on a few dozen steps",
    "optim.warmup_pct": "warm-up length acts on convergence over the whole run",
    "optim.base_lr": "the LR acts on convergence over the whole run",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "a diagnostics setting (Flight Recorder): it changes what a hang "
    "leaves behind, not how the job runs",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "a diagnostics setting (Flight Recorder): it acts only on a timeout",
}


@dataclass(kw_only=True)
class Candidate:
    """One change to try: its settings (one key, or a key with the ones it forces), the job's values."""

    id: str
    settings: dict[str, Any]
    current: dict[str, Any]
    target: str = "step_time"  # step_time | pre_backward | skipped
    source: str = "recommendation"  # recommendation | --try
    unverifiable: str = ""  # the reason a short run here cannot judge it ("" = it is tried)
    covers: list[str] = field(default_factory=list)  # recommendations that follow from this one

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={_show(v)}" for k, v in self.settings.items())

    def set_items(self) -> list[str]:
        """`--set KEY=VALUE` items for job / watch (TOML values)."""
        return [f"{k}={_toml(v)}" for k, v in self.settings.items()]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class JobKind:
    """What verify re-runs: the embedded job (`job`) or the script a run watched (`watch`)."""

    kind: str  # job | watch
    backend: str  # nccl | gloo | none: where NCCL settings act
    cuda: bool
    settable: set[str] | None = None  # watch: the keys --set can apply; None: every spec key
    argv: list[str] = field(default_factory=list)


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def _toml(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def spec_key(setting: str) -> str:
    """The `--set` key of a recommendation's setting: env variables live in [distributed.env]."""
    return f"distributed.env.{setting}" if setting_kind(setting) == "env" else setting


def why_not(setting: str, value: Any, job: JobKind) -> str:
    """The reason `setting` cannot be judged by short runs of this job here ("" when it can)."""
    kind = setting_kind(setting)
    if kind == "advice":
        return "advice for a person, not a setting a run can apply"
    if setting in NOT_VERIFIABLE:
        return NOT_VERIFIABLE[setting]
    if kind == "env" and setting.startswith(("NCCL_", "TORCH_NCCL_")) and job.backend != "nccl":
        return (
            f"the job runs {job.backend} here: NCCL settings change nothing it does (verify on the GPU nodes)"
        )
    if kind == "env" and setting == "PYTORCH_CUDA_ALLOC_CONF" and not job.cuda:
        return "a CUDA allocator setting: this machine has no CUDA device"
    if value is None and kind == "env":
        return "unsetting a variable cannot be applied by --set"
    if value is None:
        return "a removed key (a consequence of another change), not a change of its own"
    if job.settable is not None and spec_key(setting) not in job.settable and kind != "env":
        return "watch cannot apply this setting to a script (`watch --set` keys: see `watch --help`)"
    if setting.startswith(("job.", "model.", "batch.", "checkpoint.")):
        return "it changes what the job computes (its size, batch or checkpoints), not how fast it runs it"
    return ""


def candidates(
    recommendations: list[dict[str, Any]], tries: list[tuple[str, Any]], job: JobKind
) -> list[Candidate]:
    """A candidate per recommended change (each alone), then one per `--try` setting."""
    out: list[Candidate] = []
    seen: set[str] = set()
    joined = _joined_to_workers(recommendations)
    for rec in recommendations:
        evidence = rec.get("evidence") if isinstance(rec.get("evidence"), dict) else {}
        earlier = evidence.get("verification") if isinstance(evidence.get("verification"), dict) else {}
        setting, value = str(rec.get("setting") or ""), rec.get("value")
        if "tried" in earlier:  # an earlier verify turned it into "keep yours": try the change again
            value = earlier["tried"]
        elif not rec.get("change"):
            continue
        if not setting or evidence.get("measured") is False:
            continue
        key = spec_key(setting)
        if key in seen:
            continue
        seen.add(key)
        group = {key: value}
        current = {key: rec.get("current")}
        if key == WORKERS:
            for other in joined:
                group[spec_key(str(other.get("setting")))] = other.get("value")
                current[spec_key(str(other.get("setting")))] = other.get("current")
                seen.add(spec_key(str(other.get("setting"))))
        elif key in NEED_WORKERS and _workers_now(recommendations) == 0:
            # no worker count is recommended with it: at 0 workers it cannot act, so it is not tried
            reason = "it acts only with DataLoader workers, and the job runs num_workers=0"
            out.append(Candidate(id=f"c{len(out) + 1}", settings=group, current=current,
                                 target=TARGETS["dataloader"], unverifiable=reason))  # fmt: skip
            continue
        covers = []
        if key == "dataloader.num_workers" and value == 0:
            # prefetch_factor and persistent_workers need workers: their own recommendations (None /
            # false) are consequences of this one, not changes to judge apart.
            covers = ["dataloader.prefetch_factor", "dataloader.persistent_workers"]
            seen.update(covers)
        reason = why_not(setting, value, job)
        section = key.split(".", 1)[0]
        out.append(
            Candidate(
                id=f"c{len(out) + 1}",
                settings=group,
                current=current,
                target=TARGETS.get(section, "step_time"),
                unverifiable=reason,
                covers=covers,
            )
        )
    for key, value in tries:
        setting = key.removeprefix("distributed.env.")
        out.append(
            Candidate(
                id=f"c{len(out) + 1}",
                settings={key: value},
                current={key: None},
                target=TARGETS.get(key.split(".", 1)[0], "step_time"),
                source="--try",
                unverifiable=why_not(setting, value, job),
            )
        )
    return out


def _workers_now(recommendations: list[dict[str, Any]]) -> Any:
    """The job's current num_workers as the recommendations carry it (None when none names it)."""
    for rec in recommendations:
        if rec.get("setting") == WORKERS:
            return rec.get("current")
    return None


def _joined_to_workers(recommendations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The worker-dependent changes that go with a recommended move from 0 workers to some: at 0 they
    cannot act, so each is tried with the worker count it needs, as one change."""
    workers = next((r for r in recommendations if r.get("setting") == WORKERS), None)
    if workers is None or workers.get("current") != 0 or not workers.get("change"):
        return []
    if not isinstance(workers.get("value"), int) or workers["value"] <= 0:
        return []
    return [
        r
        for r in recommendations
        if r.get("setting") in NEED_WORKERS and r.get("change") and r.get("value") not in (None, False)
    ]
