"""Findings over several series (engines in one log, separate runs) and the import's own finding.

A job reads as one page: each check gives one finding over every series, naming them worst first, with
each series' evidence under `evidence["series"]`; checks that report events (a spike, a storm) keep one
finding per event, their summary prefixed with the series' name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ciuic_doctor.rundir.findings import Finding

if TYPE_CHECKING:
    from ciuic_doctor.importers import StepLog

PROBE = "stability"
EVENT_CHECKS = ("loss_spike", "grad_norm_spike", "overflow_storm")
_RANK = {"fail": 0, "warn": 1, "pass": 2, "not_run": 3}


def merge_series(per_series: dict[str, list[Finding]]) -> list[Finding]:
    """One finding per check (one per event for EVENT_CHECKS) over the series in `per_series`."""
    by_check: dict[str, list[tuple[str, Finding]]] = {}
    for name, findings in per_series.items():
        for finding in findings:
            by_check.setdefault(finding.check, []).append((name, finding))
    merged: list[Finding] = []
    for check, pairs in by_check.items():
        raised = [(n, f) for n, f in pairs if f.verdict in ("warn", "fail")]
        if check in EVENT_CHECKS and raised:
            for name, finding in raised:
                merged.append(_named(name, finding))
            continue
        pairs.sort(key=lambda pair: _RANK.get(pair[1].verdict, 9))
        worst = pairs[0][1]
        summary = "; ".join(f"{name}: {f.summary}" for name, f in pairs)
        evidence = {**worst.evidence, "series": {name: f.evidence for name, f in pairs}}
        where = dict(worst.where)
        where["series"] = [name for name, f in pairs if f.verdict == worst.verdict]
        merged.append(
            Finding(
                probe=PROBE,
                check=check,
                verdict=worst.verdict,
                summary=summary,
                evidence=evidence,
                where=where,
            )
        )
    return merged


def _named(name: str, finding: Finding) -> Finding:
    return Finding(
        probe=finding.probe,
        check=finding.check,
        verdict=finding.verdict,
        summary=f"{name}: {finding.summary}",
        evidence={**finding.evidence, "series": name},
        where={**finding.where, "series": [name]},
    )


def import_finding(log: StepLog) -> Finding | None:
    """What was read, for logs of other frameworks and imported runs (None for our own steps stream)."""
    kinds = set(log.formats.values())
    if not kinds or (kinds == {"ours"} and not log.notes and not log.series_names):
        return None
    summary = log.summary()
    evidence = {k: v for k, v in summary.items() if k != "events"}
    steps = f"steps {summary['first_step']}..{summary['last_step']}"
    text = (
        f"read {summary['rows']} rows ({', '.join(sorted(kinds))}; {steps}); {summary['unread_lines']} of "
        f"{summary['read_lines']} lines were not step records"
    )
    if log.engines > 1:
        text += f"; {log.engines} engines ({', '.join(log.series_names)}), judged apart"
    separate = [n for n in log.notes if "separate run" in n]
    if separate:
        text += "; " + "; ".join(separate)
    verdict = "warn" if separate else "pass"
    return Finding(probe=PROBE, check="log_import", verdict=verdict, summary=text, evidence=evidence)
