"""One finding per memory check over the whole job, from the per-rank judgements (GUIDE.md, "Findings and
recommendations": a 1,024-rank job must read as one page).

Split from `memory.py`: `one_per_job` folds the per-rank findings of `fragmentation`,
`non_pytorch_device_memory` and `worker_memory_growth` into one — the worst rank's verdict and flat
evidence, the affected ranks worst first in `where.ranks`, and a compact `per_rank` table (string keys,
as JSON has them) of the affected ranks plus the worst few, so its size does not grow with the job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ciuic_doctor.rundir.findings import Finding

PROBE = "memory"
MAX_NAMED = 32  # affected ranks listed one by one in `per_rank`; the rest are counted
WORST_FEW = 3  # the most severe ranks also listed when none (or few) are affected


def one_per_job(
    check: str,
    per_rank: list[Finding],
    *,
    severity: Callable[[Finding], Any],
    keys: Sequence[str],
    what: str,
) -> Finding:
    """The job's one `check` finding. `severity` orders ranks (higher is worse), `keys` are the evidence
    fields kept per rank, `what` names the problem in the summary ("fragmentation on 2 of 8 ranks")."""
    judged = [f for f in per_rank if f.verdict != "not_run"]
    not_judged = sorted(f.where["rank"] for f in per_rank if f.verdict == "not_run" and "rank" in f.where)
    counts = {"ranks_checked": len(judged), "ranks_not_run": not_judged[:MAX_NAMED]}
    if not judged:
        first = next((f for f in per_rank if f.verdict == "not_run"), None)
        why = first.summary if first is not None else "no rank to judge"
        if len(per_rank) > 1:
            why = f"{why} (and on every other of {len(per_rank)} ranks)"
        return Finding(probe=PROBE, check=check, verdict="not_run", summary=why, evidence=counts)
    grade = {"fail": 2, "warn": 1}
    ordered = sorted(judged, key=lambda f: (grade.get(f.verdict, 0), severity(f)), reverse=True)
    affected = [f for f in ordered if f.verdict in ("warn", "fail")]
    worst = ordered[0]
    listed = {id(f): f for f in [*affected[:MAX_NAMED], *ordered[:WORST_FEW]]}.values()
    table = {
        str(f.where["rank"]): {
            "verdict": f.verdict,
            **{k: f.evidence.get(k) for k in keys if k in f.evidence},
        }
        for f in listed
    }
    evidence = {
        **worst.evidence,
        **counts,
        "affected_ranks": len(affected),
        "worst_rank": worst.where["rank"],
        "per_rank": table,
    }
    if not affected:
        return Finding(
            probe=PROBE,
            check=check,
            verdict="pass",
            summary=f"no {what} on any of {len(judged)} rank(s); closest {worst.summary}",
            evidence=evidence,
        )
    ranks = [f.where["rank"] for f in affected]
    hosts = list(dict.fromkeys(f.where["host"] for f in affected if f.where.get("host")))
    where: dict[str, Any] = {"rank": ranks[0], "ranks": ranks}
    if worst.where.get("host"):
        where["host"] = worst.where["host"]
    if hosts:
        where["hosts"] = hosts
    return Finding(
        probe=PROBE,
        check=check,
        verdict=worst.verdict,
        summary=f"{what} on {len(affected)} of {len(judged)} rank(s); worst {worst.summary}",
        evidence=evidence,
        where=where,
    )
