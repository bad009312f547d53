"""One measured change between two runs, and how it reads: "step time −12 % (95 % CI −15 … −9 %)".

A `Change` is one row of a comparison: the same measurement in run A (the baseline) and run B, the ratio
B / A with its interval, and whether the change is significant. Rows of one check form a family (every
rank, every collective size, every loader configuration): their p-values are adjusted together with Holm's
method, so a check that compares 24 sizes does not call one of them "significant" by chance alone.

>>> c = Change(check="step_time", metric="step time", scope="overall", unit="s", a=0.1, b=0.088,
...            ratio=0.88, ci_low=0.85, ci_high=0.91, p_value=0.001)
>>> judge_family([c]); c.text()
'step time −12 % (95 % CI −15 … −9 %)'
>>> c.direction
'better'
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ciuic_doctor.compare.stats import ALPHA, holm
from ciuic_doctor.rundir.findings import Finding

PROBE = "compare"
BETTER, WORSE, SAME, UNJUDGED = "better", "worse", "no significant change", "not judged"


@dataclass(kw_only=True)
class Change:
    check: str
    metric: str
    scope: str
    unit: str
    a: float | None = None
    b: float | None = None
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    p_value: float | None = None
    p_adjusted: float | None = None
    significant: bool | None = None
    lower_is_better: bool = True
    family: int = 1
    n_a: int | None = None
    n_b: int | None = None
    method: str = ""
    note: str = ""

    @property
    def direction(self) -> str:
        if self.significant is None or self.ratio is None:
            return UNJUDGED
        if not self.significant:
            return SAME
        return BETTER if (self.ratio < 1) == self.lower_is_better else WORSE

    def text(self) -> str:
        """The change as a person reads it; the interval only where there is one."""
        if self.ratio is None:
            return f"{self.metric}: {self.note or 'not compared'}"
        text = f"{self.metric} {percent(self.ratio)}"
        if self.ci_low is not None and self.ci_high is not None:
            text += f" (95 % CI {interval(self.ci_low, self.ci_high)})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "change": self.direction}


def percent(ratio: float) -> str:
    """A ratio as a signed change in per cent, with a true minus sign: 0.88 -> "−12 %".

    >>> percent(1.2), percent(0.996), percent(3.5)
    ('+20 %', '−0.4 %', '+250 %')
    """
    return f"{_signed(ratio)} %"


def interval(low: float, high: float) -> str:
    """An interval of ratios as changes in per cent, one unit sign at the end: "−15 … −9 %".

    >>> interval(0.85, 0.91), interval(0.995, 1.004)
    ('−15 … −9 %', '−0.5 … +0.4 %')
    """
    return f"{_signed(low)} … {_signed(high)} %"


def _signed(ratio: float) -> str:
    change = (ratio - 1.0) * 100.0
    digits = 1 if abs(change) < 2 else 0  # 0.4 % needs its decimal; 12.3 % reads better as 12 %
    text = f"{abs(change):.{digits}f}"
    if float(text) == 0:
        return "±0"
    return f"{'+' if change > 0 else '−'}{text}"


def judge_family(changes: list[Change], alpha: float = ALPHA) -> None:
    """Holm-adjust the p-values of one check's rows and mark each significant or not (in place)."""
    tested = [c for c in changes if c.p_value is not None]
    for change, adjusted in zip(tested, holm([c.p_value for c in tested]), strict=True):
        change.p_adjusted = adjusted
        change.family = len(tested)
        change.significant = adjusted < alpha


def family_words(changes: list[Change]) -> str:
    """How significance was judged, for the summary: "at 5 %" or "at 5 % after Holm's correction over 8"."""
    n = max((c.family for c in changes), default=1)
    return "at 5 %" if n <= 1 else f"at 5 % after Holm's correction over {n} comparisons"


def finding_for(
    check: str,
    changes: list[Change],
    *,
    prefix: str = "",
    what: str,
    evidence: dict[str, Any] | None = None,
    where: dict[str, Any] | None = None,
) -> Finding:
    """One finding for a check's family of rows: the headline is the worst significant row (a regression
    before an improvement), else the largest change; `evidence` carries every row.

    Verdict: `warn` when a row got significantly worse, `pass` otherwise (better, or no change beyond the
    noise), `not_run` when no row could be judged.
    """
    judged = [c for c in changes if c.significant is not None and c.ratio is not None]
    rows = [c.to_dict() for c in changes]
    if not judged:
        reasons = sorted({c.note for c in changes if c.note}) or [f"no {what} in both runs"]
        return Finding(
            probe=PROBE,
            check=check,
            verdict="not_run",
            summary=f"{what}: not compared ({'; '.join(reasons)})",
            evidence={"rows": rows, **(evidence or {})},
            where=where or {},
        )
    worse = sorted((c for c in judged if c.direction == WORSE), key=lambda c: -abs(math.log(c.ratio)))
    better = sorted((c for c in judged if c.direction == BETTER), key=lambda c: -abs(math.log(c.ratio)))
    head = (worse or better or sorted(judged, key=lambda c: -abs(math.log(c.ratio))))[0]
    scope = "" if head.scope == "overall" or len(changes) == 1 else f" ({head.scope})"
    if worse or better:
        counts = ", ".join(
            f"{len(group)} of {len(judged)} {label}"
            for group, label in ((worse, WORSE), (better, BETTER))
            if group
        )
        verdict_words = f"{head.direction}, significant {family_words(judged)}"
        if len(judged) > 1:
            verdict_words += f"; {counts}"
    else:
        verdict_words = f"{SAME} {family_words(judged)}" + (
            f" in any of {len(judged)}" if len(judged) > 1 else ""
        )
    return Finding(
        probe=PROBE,
        check=check,
        verdict="warn" if worse else "pass",
        summary=f"{prefix}{head.text()}{scope}: {verdict_words}",
        evidence={
            "ratio": head.ratio,
            "ci_low": head.ci_low,
            "ci_high": head.ci_high,
            "significant": bool(worse or better),
            "change": head.direction,
            "p_value": head.p_value,
            "p_adjusted": head.p_adjusted,
            "scope": head.scope,
            "family": len(judged),
            "rows": rows,
            **(evidence or {}),
        },
        where=where or {},
    )
