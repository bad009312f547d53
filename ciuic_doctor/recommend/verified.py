"""What `verify` found, applied to the recommendations: each change that was tried carries
its status and interval, and only what helps, or is arithmetic / a documented fact, reaches the files.

    helps                 kept; it goes into recommended.env / recommended.toml
    no measurable effect  when the interval lies inside the negligible margin (NEGLIGIBLE): "within
                          noise: yours is fine", the recommendation becomes the current value; when it
                          is wider, the runs could exclude only larger changes: the recommendation
                          stays, not verified, and the words say what was excluded
    hurts                 dropped: the current value stays, the interval shows why
    not verifiable here   kept as advice, marked not verified, with the reason

RUN/verification.json is written by `ciuic-doctor verify RUN` (ciuic_doctor/verify/); this module only
reads it, so the report never re-runs anything.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from ciuic_doctor.recommend.core import Plan, is_change, setting_kind
from ciuic_doctor.rundir.findings import Recommendation

HELPS, NO_EFFECT, HURTS, NOT_VERIFIABLE = "helps", "no measurable effect", "hurts", "not verifiable here"
STATUSES = (HELPS, NO_EFFECT, HURTS, NOT_VERIFIABLE)
NOT_VERIFIED = "not verified"
WITHIN_NOISE = (
    "within noise: yours is fine"  # no verification.json, or this change was not among the candidates
)
VERIFICATION_FILE = "verification.json"
# Smaller changes are negligible even when significant: 4 workers raised the main process's RSS by a
# steady 0.2 % (95 % CI +0.1 … +0.4 %), real and of no consequence; times move a few per cent with load.
NEGLIGIBLE = {"pre_backward": 0.02, "step_time": 0.02, "rss": 0.05}
METRIC_SCOPES = {"time before backward": "pre_backward", "step time": "step_time"}
# num_workers = 0 takes these with it (DataLoader refuses them without workers): they share its status.
WORKER_KEYS = ["dataloader.prefetch_factor", "dataloader.persistent_workers"]
# Changes that are arithmetic on the job's own settings or documented behaviour, not a measured guess:
# they go into the files without a trial (their evidence says which).
FACT_SETTINGS = {
    "optim.lr_scaling": "arithmetic on the job spec (the LR scaling rule for the global batch)",
    "optim.warmup_pct": "arithmetic on the job spec (OneCycleLR's warm-up)",
    "distributed.timeout_s": "arithmetic on a measured save time (longest legitimate wait × safety factor)",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "documented: turns on NCCL's Flight Recorder (diagnostics only)",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "documented: dumps the Flight Recorder on a timeout (diagnostics only)",
}


def spec_key(setting: str) -> str:
    return f"distributed.env.{setting}" if setting_kind(setting) == "env" else setting


def fact(rec: Recommendation) -> str:
    """Why `rec` needs no trial ("" when it does)."""
    return FACT_SETTINGS.get(rec.setting, "")


def apply(plan: Plan, verification: dict[str, Any] | None) -> Plan:
    """A copy of `plan` with every changing recommendation's verification in its evidence, and the
    changes that showed no effect or hurt turned into "keep yours"."""
    out = copy.deepcopy(plan)
    by_key: dict[str, dict[str, Any]] = {}
    for cand in (verification or {}).get("candidates") or []:
        if isinstance(cand, dict) and cand.get("source") == "recommendation":
            settings = cand.get("settings") if isinstance(cand.get("settings"), dict) else {}
            covers = cand.get("covers") or (
                WORKER_KEYS if settings.get("dataloader.num_workers") == 0 else []
            )
            for key in [*settings, *covers]:
                by_key.setdefault(key, cand)
    for rec in out.recommendations:
        if not is_change(rec):
            continue
        cand = by_key.get(spec_key(rec.setting))
        if cand is None:
            rec.evidence["verification"] = {
                "status": NOT_VERIFIED,
                "reason": _unverified_reason(verification),
            }
            continue
        rec.evidence["verification"] = {
            k: cand.get(k)
            for k in ("status", "reason", "target_metric", "ratio", "ci_low", "ci_high", "rounds")
        }
        status = cand.get("status")
        if spec_key(rec.setting) not in (cand.get("settings") or {}):
            rec.evidence["verification"]["follows"] = cand.get("label")  # a consequence of that change
        rec.evidence["verification"]["conclusive"] = status != NO_EFFECT or conclusive(cand)
        if status == NO_EFFECT and not conclusive(cand):
            # the runs could not tell: the change stays a recommendation, not verified, not "fine"
            rec.why = f"Tried {rec.setting} = {rec.value} on the job: {cand.get('reason')}. {rec.why}"
            continue
        if status in (NO_EFFECT, HURTS):
            tried = rec.value
            rec.evidence["verification"]["tried"] = tried
            rec.value = rec.current
            reason = str(cand.get("reason") or "")
            words = "it hurt the job, dropped: " if status == HURTS else ""
            if status == NO_EFFECT and WITHIN_NOISE not in reason:
                words = f"{WITHIN_NOISE}: "
            rec.why = f"Tried {rec.setting} = {tried} on the job: {words}{reason}. {rec.why}"
    return out


def inside_margin(low: float | None, high: float | None, margin: float) -> bool:
    """The whole interval of ratios lies within ±margin (in log terms): the runs rule out any change
    that would matter, which is what "yours is fine" claims."""
    if low is None or high is None or low <= 0:
        return False
    return math.log(high) <= math.log1p(margin) and -math.log(low) <= math.log1p(margin)


def no_effect_words(low: float | None, high: float | None, margin: float) -> tuple[str, bool]:
    """(the words for a change that was neither better nor worse, whether they clear the change).

    An interval inside the negligible margin clears it ("yours is fine"); a wider one says what the
    runs could exclude: with −54 … +107 % they rule out only changes past those bounds, nothing the
    user would call small."""
    if inside_margin(low, high, margin):
        return f"{WITHIN_NOISE} (every change beyond ±{margin:.0%} is excluded)", True
    if low is None or high is None or low <= 0:
        return "no interval from these runs: they cannot tell; more rounds would tell", False
    widest = max(1 - low, high - 1)
    return (
        f"the runs rule out only changes larger than {100 * widest:.0f} % either way; more rounds would tell",
        False,
    )


def conclusive(cand: dict[str, Any]) -> bool:
    """A "no measurable effect" candidate whose interval clears the change (verification.json written
    before `conclusive` was recorded: judged from its interval and target figure)."""
    if "conclusive" in cand:
        return bool(cand["conclusive"])
    scope = METRIC_SCOPES.get(str(cand.get("target_metric") or ""), "")
    return inside_margin(cand.get("ci_low"), cand.get("ci_high"), NEGLIGIBLE.get(scope, 0.0))


def _unverified_reason(verification: dict[str, Any] | None) -> str:
    if verification is None:
        return "not tried on the job (run `ciuic-doctor verify RUN` or `checkup --verify`)"
    return "not among the changes verify tried"


def status_of(rec: Recommendation) -> str:
    return str((rec.evidence.get("verification") or {}).get("status") or NOT_VERIFIED)


def for_files(plan: Plan) -> tuple[Plan, list[Recommendation]]:
    """(the plan whose changes go into recommended.env / .toml, the unverified rest).

    A change goes in when verify found it helps, or when it is a fact (FACT_SETTINGS); a
    recommendation that changes nothing (kept values, advice) stays as it is."""
    live: list[Recommendation] = []
    rest: list[Recommendation] = []
    for rec in plan.recommendations:
        keeps = not is_change(rec) or setting_kind(rec.setting) == "advice"
        if keeps or status_of(rec) == HELPS or fact(rec):
            live.append(rec)
        else:
            rest.append(rec)
    return Plan(recommendations=live, findings=plan.findings), rest


def load(run: Any) -> dict[str, Any] | None:
    """RUN/verification.json, or None (missing or unreadable: the report says "not verified")."""
    path = run.path / VERIFICATION_FILE
    if not path.is_file() or path.is_symlink() or path.stat().st_size > 16 * 2**20:
        return None
    try:
        data = run.read_json(VERIFICATION_FILE)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    for key in ("budget_s", "rounds", "warmup_steps", "steps_per_run"):  # figures the report formats
        if key in data and not _number(data[key]):
            data.pop(key)
    cands = data.get("candidates")
    data["candidates"] = (
        [_figures_checked(c) for c in cands if isinstance(c, dict)] if isinstance(cands, list) else []
    )
    return data


_INTERVAL = ("ratio", "ci_low", "ci_high")


def _figures_checked(cand: dict[str, Any]) -> dict[str, Any]:
    """A candidate whose interval is three finite positive numbers, or has none: the file is data (a
    planted `"ci_high": null` crashed the report), and a partial interval is no interval."""

    whole = all(_number(cand.get(k)) and cand[k] > 0 for k in _INTERVAL)
    out = {**cand, **({} if whole else dict.fromkeys(_INTERVAL))}
    if out.get("rounds") is not None and not (_number(out["rounds"]) and out["rounds"] >= 0):
        out["rounds"] = None
    return out


def _number(value: Any) -> bool:
    import math

    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past 1.8e308
        return False
