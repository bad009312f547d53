"""resume_mismatch: compare each restarted variant with the reference run, step by step and by fingerprint.

On CPU the comparison is exact: a complete checkpoint gives bit-identical losses, weights, optimizer
state, LR, scaler state, RNG states and data position. On CUDA kernels are not bit-deterministic by
default (atomics in backward), so losses and the float64 sums of squares of weights and optimizer state are
compared within APPROX_RTOL instead of the byte hashes. A differing fingerprint field is traced to the
state it comes from (FIELD_KIND). Fields in LATENT do not change the loss until something uses them (an RNG
nothing drew from in M steps, a GradScaler growth tracker before its next growth or overflow): a mismatch
there alone is a warning; a different loss, weight, optimizer state, LR or data position is a fail.

Pure functions of records: no torch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.schemas import RESUME_REFERENCE
from ciuic_doctor.rundir.store import as_float

PROBE = "checkpoint"
REFERENCE = RESUME_REFERENCE
APPROX_RTOL = 1e-4
FIELD_KIND = {
    "params": "model",
    "optimizer": "optimizer",
    "lr": "scheduler",
    "scaler": "scaler",
    "rng.python": "rng.python",
    "rng.numpy": "rng.numpy",
    "rng.torch": "rng.torch",
    "rng.cuda": "rng.cuda",
    "data_position": "sampler",
    "step": "step",
}
LATENT = {"rng.python", "rng.numpy", "rng.torch", "rng.cuda", "scaler"}


def _close(a: Any, b: Any, exact: bool) -> bool:
    if exact:
        return a == b
    x, y = as_float(a), as_float(b)
    if x is None or y is None:
        return a == b
    return math.isclose(x, y, rel_tol=APPROX_RTOL, abs_tol=1e-12)


def fields_differing(reference: dict[str, Any], got: dict[str, Any], *, exact: bool) -> list[str]:
    """Fingerprint fields of `got` that differ from `reference`.

    >>> fields_differing({"params": {"sha256": "a", "sumsq": 2.0}, "lr": [0.1]},
    ...                  {"params": {"sha256": "b", "sumsq": 2.0}, "lr": [0.1]}, exact=True)
    ['params']
    >>> fields_differing({"params": {"sha256": "a", "sumsq": 2.0}}, {"params": {"sha256": "b", "sumsq": 2.0}},
    ...                  exact=False)
    []
    """
    differ = []
    for name in FIELD_KIND:
        ref, new = reference.get(name), got.get(name)
        if isinstance(ref, dict) and isinstance(new, dict):
            same = (
                ref.get("sha256") == new.get("sha256") if exact else _close(ref["sumsq"], new["sumsq"], False)
            )
        elif isinstance(ref, list) and isinstance(new, list) and len(ref) == len(new):
            same = all(_close(a, b, exact or isinstance(a, int)) for a, b in zip(ref, new, strict=True))
        else:
            same = ref == new
        if not same:
            differ.append(name)
    return differ


def loss_divergence(reference: list[Any], got: list[Any], *, exact: bool) -> tuple[int | None, float]:
    """(index of the first differing step or None, max |loss difference|) over the common steps.

    >>> loss_divergence([1.0, 2.0, 3.0], [1.0, 2.5, 3.0], exact=True)
    (1, 0.5)
    """
    first = None
    worst = 0.0
    for index, (a, b) in enumerate(zip(reference, got, strict=False)):
        x, y = as_float(a), as_float(b)
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
            same = str(a) == str(b)
            diff = 0.0 if same else math.inf
        else:
            same = x == y if exact else math.isclose(x, y, rel_tol=APPROX_RTOL)
            diff = abs(x - y)
        if not same and first is None:
            first = index
        worst = max(worst, diff)
    if len(got) != len(reference) and first is None:
        first = min(len(got), len(reference))
    return first, worst


def check_resume(records: list[dict[str, Any]], *, exact: bool) -> list[Finding]:
    """One resume_mismatch finding per restarted variant (the checkpoint as saved, then each --drop)."""
    resumes = [r for r in records if r.get("kind") == "resume"]
    skipped = next((r for r in records if r.get("kind") == "skipped"), None)
    references = {r.get("rank", 0): r for r in resumes if r.get("variant") == REFERENCE}
    by_variant: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in resumes:
        if r.get("variant") != REFERENCE:
            by_variant[str(r.get("variant"))][r.get("rank", 0)] = r
    if not by_variant:
        reason = (skipped or {}).get("reason") or "no restart was recorded (the probe ended before it)"
        return [
            Finding(probe=PROBE, check="resume_mismatch", verdict="not_run", summary=f"not run: {reason}")
        ]
    return [_judge(name, ranks, references, exact) for name, ranks in by_variant.items()]


def _judge(
    name: str, ranks: dict[int, dict[str, Any]], references: dict[int, dict[str, Any]], exact: bool
) -> Finding:
    lead = ranks[min(ranks)]
    dropped = list(lead.get("drop") or [])
    missing = list(lead.get("missing") or [])
    base = {
        "variant": name,
        "dropped_on_purpose": dropped,
        "missing": missing,
        "not_applicable": list(lead.get("not_applicable") or []),
        "steps_compared": len(lead.get("losses") or []),
        "ranks": sorted(ranks),
        "exact": exact,
    }
    absent_refs = sorted(set(ranks) - set(references))
    if absent_refs:
        return Finding(
            probe=PROBE,
            check="resume_mismatch",
            verdict="not_run",
            summary=f"{name}: no reference run recorded for rank(s) {absent_refs}",
            evidence=base,
        )
    first_index: int | None = None
    first_rank: int | None = None
    max_diff = 0.0
    differs: dict[int, list[str]] = {}
    for rank, record in sorted(ranks.items()):
        ref = references[rank]
        index, diff = loss_divergence(ref.get("losses") or [], record.get("losses") or [], exact=exact)
        max_diff = max(max_diff, diff)
        if index is not None and (first_index is None or index < first_index):
            first_index, first_rank = index, rank
        fields = fields_differing(ref.get("fingerprint") or {}, record.get("fingerprint") or {}, exact=exact)
        if fields:
            differs[rank] = fields
    fields_any = sorted({f for fields in differs.values() for f in fields}, key=list(FIELD_KIND).index)
    first_step = None if first_index is None else int(lead.get("first_step") or 1) + first_index
    evidence = {
        **base,
        "first_divergent_step": first_step,
        "max_abs_loss_diff": max_diff,
        "differs": fields_any,
        "differs_by_rank": {str(r): f for r, f in differs.items()},
        "state_behind_differences": sorted({FIELD_KIND[f] for f in fields_any}),
        "restore_s": as_float(lead.get("restore_s")),
    }
    if missing:
        evidence["hint"] = "also save: " + ", ".join(missing)
    label = "the checkpoint as saved" if not dropped else f"demonstration --drop {','.join(dropped)}"
    steps = base["steps_compared"]
    if first_step is None and not fields_any:
        if missing:
            return Finding(
                probe=PROBE,
                check="resume_mismatch",
                verdict="warn",
                summary=f"{label}: lacks {', '.join(missing)}, yet {steps} resumed steps matched the "
                "reference (nothing used it yet); a longer run or another job may diverge",
                evidence=evidence,
            )
        how = "bit-identical" if exact else f"identical within {APPROX_RTOL:g} relative"
        return Finding(
            probe=PROBE,
            check="resume_mismatch",
            verdict="pass",
            summary=f"{label}: {steps} resumed steps on {len(ranks)} rank(s) {how} to the run that never "
            "stopped (losses, weights, optimizer, LR, scaler, RNG, data position)",
            evidence=evidence,
        )
    parts = []
    if first_step is not None:
        parts.append(f"losses differ from step {first_step} (max |Δloss| {max_diff:.3g}, rank {first_rank})")
    if fields_any:
        parts.append(f"after {steps} steps these differ: {', '.join(fields_any)}")
    lacking = (
        f"; the checkpoint lacks {', '.join(missing)}" if missing else "; every kind of state is present"
    )
    latent_only = first_step is None and set(fields_any) <= LATENT
    if latent_only:
        parts.append("no effect on the loss yet")
        if any(f.startswith("rng.") for f in fields_any):
            parts.append(
                "nothing drew random numbers in these steps; dropout or random augmentation would diverge"
            )
        if "scaler" in fields_any:
            parts.append("the GradScaler's growth tracker restarted, so its next scale change comes late")
    return Finding(
        probe=PROBE,
        check="resume_mismatch",
        verdict="warn" if latent_only else "fail",
        summary=f"{label}: " + "; ".join(parts) + lacking,
        evidence=evidence,
        where={"step": first_step, "rank": first_rank} if first_step is not None else {},
    )
