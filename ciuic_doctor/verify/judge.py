"""Judge each candidate alone from the interleaved runs: helps, no measurable effect, hurts.

Per run, the job's own figures after warm-up (compare.steps.job_series: per step the median over
ranks, warm-up steps dropped): mean step time, mean time before backward, mean host RSS, skipped steps.
Per round, B / A of each figure from the two runs of that round: rounds are the independent units
(within a run, consecutive steps share the load), and pairing by round takes out load that drifted
between rounds. The interval is a t interval on the mean log ratio over the rounds (compare.stats.
t_interval, df = rounds − 1); skipped steps use compare.stats.count_test on the totals. The figures of
one candidate form one family, Holm-corrected (compare.change.judge_family), so "nothing significantly
worse" keeps its 5 % meaning across them. The loss at matched steps of the first round's pair must
stay within its tolerance (compare.loss: 4 σ of the runs' own step-to-step noise).

    helps                 the target figure is significantly better, nothing significantly worse,
                          the loss within its tolerance (a change under NEGLIGIBLE, 2 % of a time or
                          5 % of memory, counts as none)
    hurts                 any figure significantly worse, the loss outside its tolerance, or the job
                          failed with the change
    no measurable effect  neither; `conclusive` when the target's interval lies inside NEGLIGIBLE
                          ("yours is fine"), else the words say the largest change the runs exclude
    not verifiable here   the change cannot act in a short run here (plan.NOT_VERIFIABLE), watch
                          refused it, or too few rounds fitted the budget
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ciuic_doctor.compare.change import Change, judge_family
from ciuic_doctor.compare.stats import count_test, t_interval
from ciuic_doctor.recommend.verified import (
    HELPS,
    HURTS,
    NEGLIGIBLE,
    NO_EFFECT,
    NOT_VERIFIABLE,
    no_effect_words,
)
from ciuic_doctor.verify.figures import RunFigures
from ciuic_doctor.verify.plan import Candidate
from ciuic_doctor.verify.runner import RunResult

MIN_ROUNDS = 3  # a t interval from 2 rounds has 1 degree of freedom: 12.7 standard errors wide
FIGURES = {  # key -> (metric as the report names it, unit)
    "pre_backward": ("time before backward", "s"),
    "step_time": ("step time", "s"),
    "rss": ("host RSS (steady level)", "bytes"),
}


def _paired(key: str, pairs: list[tuple[RunFigures, RunFigures]]) -> Change:
    metric, unit = FIGURES[key]
    change = Change(check="verify", metric=metric, scope=key, unit=unit)
    logs, a_levels, b_levels = [], [], []
    for a, b in pairs:
        la, lb = a.level(key), b.level(key)
        if la and lb and la > 0 and lb > 0:
            logs.append(math.log(lb / la))
            a_levels.append(la)
            b_levels.append(lb)
    change.n_a = change.n_b = len(logs)
    if len(logs) < MIN_ROUNDS:
        change.note = f"{len(logs)} paired round(s) with this figure (need {MIN_ROUNDS})"
        return change
    mean = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(logs))
    low, high, p = t_interval(mean, se, len(logs) - 1, 0.05)
    change.a, change.b = statistics.fmean(a_levels), statistics.fmean(b_levels)
    change.ratio, change.ci_low, change.ci_high, change.p_value = (
        math.exp(mean),
        math.exp(low),
        math.exp(high),
        p,
    )
    change.method = f"t interval on the mean log ratio of {len(logs)} interleaved rounds (paired by round)"
    return change


def _skipped(pairs: list[tuple[RunFigures, RunFigures]]) -> Change:
    k_a, n_a = sum(a.skipped for a, _ in pairs), sum(a.steps for a, _ in pairs)
    k_b, n_b = sum(b.skipped for _, b in pairs), sum(b.steps for _, b in pairs)
    change = Change(check="verify", metric="skipped steps", scope="skipped", unit="steps", n_a=n_a, n_b=n_b)
    change.a, change.b = float(k_a), float(k_b)
    change.note = f"{k_a} of {n_a} → {k_b} of {n_b}"  # the counts, whatever the test says
    if not (n_a and n_b):
        change.note = "no steps recorded"
        return change
    if k_a == 0 and k_b == 0:
        change.note = "no step skipped on either side"
        change.ratio, change.p_value = 1.0, 1.0
        return change
    rate_a, rate_b = k_a / n_a, k_b / n_b
    change.p_value = count_test(k_a, n_a, k_b, n_b)
    change.ratio = rate_b / rate_a if rate_a else None  # from none skipped: no ratio, the test stands
    change.b_rate_higher = rate_b > rate_a  # type: ignore[attr-defined]
    change.method = "exact conditional binomial test of the two skip rates"
    return change


def _loss(pair: tuple[RunFigures, RunFigures]) -> dict[str, Any]:
    from ciuic_doctor.compare.loss import loss_finding

    finding, _ = loss_finding(pair[0].records or [], pair[1].records or [], "")
    ev = finding.evidence
    outside = int(ev.get("steps_outside") or 0)
    return {"verdict": finding.verdict, "summary": finding.summary, "steps_outside": outside}


def _worse(change: Change) -> bool:
    if change.scope == "skipped" and change.ratio is None:
        return bool(change.significant and getattr(change, "b_rate_higher", False))
    return change.direction == "worse" and _beyond(change)


def _beyond(change: Change) -> bool:
    """The change is larger than what counts as negligible for its figure (NEGLIGIBLE)."""
    margin = NEGLIGIBLE.get(change.scope, 0.0)
    return change.ratio is not None and abs(math.log(change.ratio)) > math.log1p(margin)


def judge(
    candidate: Candidate, results: list[RunResult], dropped: str | None, figures: dict[str, RunFigures]
) -> dict[str, Any]:
    """The candidate's status, the interval on its target figure, and every figure's row."""
    out: dict[str, Any] = {**candidate.to_dict(), "label": candidate.label}
    if candidate.unverifiable:
        return {**out, "status": NOT_VERIFIABLE, "reason": candidate.unverifiable}
    if dropped and dropped.startswith("refused"):
        return {**out, "status": NOT_VERIFIABLE, "reason": dropped}
    if dropped:
        return {**out, "status": HURTS, "reason": f"the job {dropped}"}
    a_runs = {r.round: r for r in results if r.side == "A" and r.ok}
    pairs = [
        (figures[a_runs[r.round].path], figures[r.path])
        for r in results
        if r.side == candidate.id and r.ok and r.round in a_runs
    ]
    out["rounds"] = len(pairs)
    if len(pairs) < MIN_ROUNDS:
        reason = (
            f"only {len(pairs)} round(s) fitted the budget (need {MIN_ROUNDS}): give verify more --budget"
        )
        return {**out, "status": NOT_VERIFIABLE, "reason": reason}
    rows = [_paired(key, pairs) for key in FIGURES]
    rows.append(_skipped(pairs))
    judge_family([c for c in rows if c.p_value is not None])
    target = next(c for c in rows if c.scope == candidate.target)
    loss = _loss(pairs[0])
    worse = [c for c in rows if _worse(c)]
    if worse or loss["steps_outside"]:
        status = HURTS
        reasons = [f"{c.text()}: significantly worse" for c in worse]
        if loss["steps_outside"]:
            reasons.append(f"loss outside its tolerance ({loss['summary']})")
        reason = "; ".join(reasons)
    elif target.direction == "better" and _beyond(target):
        status, reason = HELPS, f"{target.text()}: significantly better, nothing significantly worse"
    else:
        status = NO_EFFECT
        words, cleared = no_effect_words(target.ci_low, target.ci_high, NEGLIGIBLE.get(target.scope, 0.0))
        reason = f"{words} ({target.text()})"
        out["conclusive"] = cleared
    return {
        **out,
        "status": status,
        "reason": reason,
        "target_metric": target.metric,
        "ratio": target.ratio,
        "ci_low": target.ci_low,
        "ci_high": target.ci_high,
        "p_value": target.p_value,
        "figures": [c.to_dict() for c in rows],
        "loss": loss,
    }
