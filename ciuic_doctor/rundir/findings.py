"""The one schema every probe's judgement uses (GUIDE, "Findings and recommendations").

    finding:        {probe, check, verdict: pass|warn|fail|not_run, summary, evidence{...}, where{...}}
    recommendation: {setting, value, current?, why, evidence{...}, confidence: high|medium|low}

A verdict is scoped, as DCGM words it: "pass" covers only the checks that ran; a check that could not
run says `not_run` and gives the reason in `summary`.

>>> f = Finding(probe="comm", check="busbw_floor", verdict="pass", summary="ok")
>>> Finding.from_dict(f.to_dict()) == f
True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Verdict = Literal["pass", "warn", "fail", "not_run"]
Confidence = Literal["high", "medium", "low"]
VERDICTS: tuple[Verdict, ...] = ("fail", "warn", "pass", "not_run")  # worst first, for sorting
# Per-rank figures a finding's evidence keeps: findings.json and the report embed the evidence, and one
# entry per rank was 27 MB of a 100,000-rank report (its goodput); the rest is in steps_per_rank.csv.
EVIDENCE_RANKS = 64
CONFIDENCES: tuple[Confidence, ...] = ("high", "medium", "low")


@dataclass(kw_only=True)
class Finding:
    probe: str
    check: str
    verdict: Verdict
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    where: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, not {self.verdict!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(
            probe=data["probe"],
            check=data["check"],
            verdict=data["verdict"],
            summary=data.get("summary", ""),
            evidence=dict(data.get("evidence") or {}),
            where=dict(data.get("where") or {}),
        )


@dataclass(kw_only=True)
class Recommendation:
    setting: str
    value: Any
    why: str
    confidence: Confidence
    current: Any = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.confidence not in CONFIDENCES:
            raise ValueError(f"confidence must be one of {CONFIDENCES}, not {self.confidence!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recommendation:
        return cls(
            setting=data["setting"],
            value=data.get("value"),
            why=data.get("why", ""),
            confidence=data.get("confidence", "low"),
            current=data.get("current"),
            evidence=dict(data.get("evidence") or {}),
        )


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Worst verdict first, then by probe and check, so the top of any listing is what matters."""
    return sorted(findings, key=lambda f: (VERDICTS.index(f.verdict), f.probe, f.check))


def overall_verdict(findings: list[Finding]) -> Verdict:
    """fail if any check failed, else warn if any warned, else pass if any passed, else not_run."""
    present = {f.verdict for f in findings}
    for verdict in VERDICTS:
        if verdict in present:
            return verdict
    return "not_run"


def some_ranks(per_rank: dict[Any, Any], order: list[Any] | None = None) -> dict[str, Any]:
    """At most EVIDENCE_RANKS entries of a per-rank mapping, in `order` (worst first; default: its own),
    keyed by str(rank) as JSON keys are.

    >>> some_ranks({r: r * 2 for r in range(100)}, order=[99, 3])
    {'99': 198, '3': 6}
    >>> len(some_ranks({r: 0 for r in range(100)}))
    64
    """
    keys = list(per_rank) if order is None else order
    return {str(k): per_rank[k] for k in keys[:EVIDENCE_RANKS]}
