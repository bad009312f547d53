"""A run directory made from someone's log (`stability LOG --out RUN`) is a report about *that log*.

    log_title(meta)            "train.log (megatron)": the report's title instead of the embedded job's name
    spec_unknown(meta, kind)   why nothing may be judged against a job spec (None when there is one)
    gate_plan / gate_tips      the recommendations and seed-tip verdicts that rest on a job spec, not run
    job_content(section, ...)  the job section built from the log's rows: what it covers and what it prints

The gate is on meta.json `source.import` (written by importers/_run.write_run) and the spec the report
resolved: with --spec, or a spec the job itself recorded, everything is judged as before. Without one, the
embedded default job (global batch 16, OneCycleLR, fp32) would stand in for a job the log says nothing of,
and "global batch 16 = 8 per rank × 2 ranks" would be advice about a run nobody made. What the log prints
of its own settings (Megatron's arguments block, DeepSpeed's config dump) is shown, not judged: those are
the job's arguments in another framework's terms, not a ciuic-doctor spec.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ciuic_doctor.recommend import Plan
from ciuic_doctor.recommend.tips.base import UNMEASURED, Claim, Tip
from ciuic_doctor.report.blocks import Section, Table, _cell
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import as_float

SPEC_KINDS = ("file", "recorded")  # a spec the report may judge the job by


def import_summary(meta: dict[str, Any]) -> dict[str, Any] | None:
    """meta.json["source"]["import"] of an imported log (StepLog.summary()), else None."""
    source = meta.get("source")
    if isinstance(source, dict) and isinstance(source.get("import"), dict):
        return source["import"]
    return None


def log_title(meta: dict[str, Any]) -> str | None:
    """The log's file name(s) and format(s), e.g. "train.log (megatron)"; None for a run we recorded."""
    summary = import_summary(meta)
    if summary is None:
        return None
    formats = summary.get("formats") if isinstance(summary.get("formats"), dict) else {}
    names = [Path(str(p)).name or str(p) for p in formats] or ["imported log"]
    kinds = sorted({str(k) for k in formats.values()})
    shown = " + ".join(names[:3]) + (f" + {len(names) - 3} more" if len(names) > 3 else "")
    return _plain(f"{shown} ({', '.join(kinds)})" if kinds else shown)


def _plain(text: str, most: int = 160) -> str:
    """A file name as one printable line: it becomes recommended.env's comment (a file a shell sources),
    summary.md's heading and the page title, so a newline or escape in a name must not start a new line."""
    clean = "".join(c if c.isprintable() else "?" for c in text).replace("`", "'")
    return clean if len(clean) <= most else clean[: most - 1] + "…"


def spec_unknown(meta: dict[str, Any], kind: str) -> str | None:
    """The reason no rule may judge a job spec: an imported log and no spec of the job's own."""
    if import_summary(meta) is None or kind in SPEC_KINDS:
        return None
    title = log_title(meta) or "the log"
    return (
        f"the imported log {title} gives no ciuic-doctor job spec: the settings rules and the seed-tip "
        "claims that rest on one are not run (pass --spec JOB.TOML to judge them)"
    )


def spec_note(meta: dict[str, Any]) -> str:
    settings = (import_summary(meta) or {}).get("settings") or {}
    shown = ""
    if isinstance(settings, dict) and settings:
        shown = " The log prints: " + ", ".join(f"{k} {v}" for k, v in list(settings.items())[:8]) + "."
    title = log_title(meta) or "an imported log"
    return (
        f"This report is about {title}, a log another framework wrote, not about a job ciuic-doctor ran. It "
        "gives no ciuic-doctor job spec, so the settings rules and the seed-tip claims that rest on one are "
        f"not run (pass --spec JOB.TOML to judge them).{shown}"
    )


def gate_plan(plan: Plan, reason: str) -> Plan:
    """No recommendation and no verdict on "current" settings: one not_run finding says why."""
    note = Finding(probe="recommend", check="job_settings", verdict="not_run", summary=reason)
    return Plan(recommendations=[], findings=[note])


def gate_tips(tips: Sequence[Tip], reason: str) -> list[Tip]:
    """Every measured claim becomes "not measured" with the reason; a documented fact (PyTorch's default
    timeout is 30 min, not 30 s) is about no job in particular and stays as it is."""
    why = f"not judged: {reason}"
    out = []
    for tip in tips:
        claims = [
            c if c.basis != "measured" else Claim(text=c.text, status=UNMEASURED, evidence=why, basis=c.basis)
            for c in tip.claims
        ]
        out.append(replace(tip, claims=claims))
    return out


def job_content(section: Section, meta: dict[str, Any], steps: Sequence[dict[str, Any]]) -> None:
    """What the log covers (rows, steps, logging interval, loss first / best / last, eval loss) and the
    settings it prints, as one table; the plots are the stability section's."""
    summary = import_summary(meta) or {}
    rows: list[tuple[str, Any]] = [("log", log_title(meta)), ("framework", summary.get("framework"))]
    rows.append(("rows read", f"{summary.get('rows')} of {summary.get('read_lines')} lines"))
    rows.append(("steps", f"{summary.get('first_step')} .. {summary.get('last_step')}"))
    intervals = sorted(int(r.get("interval_steps") or 1) for r in steps)
    if intervals:
        rows.append(("logging interval (steps, median)", intervals[len(intervals) // 2]))
    kind = summary.get("loss_kind")
    if kind:
        rows.append(("a row's loss", "one step's" if kind == "sample" else "the mean over its interval"))
    losses = [(r.get("step"), v) for r in steps if (v := as_float(r.get("loss"))) is not None]
    losses = [(s, v) for s, v in losses if math.isfinite(v)]
    if losses:
        best = min(losses, key=lambda p: p[1])
        rows.append(("loss first / best / last", f"{losses[0][1]:.4g} / {best[1]:.4g} (step {best[0]}) / "
                     f"{losses[-1][1]:.4g}"))  # fmt: skip
    evals = [p for p in summary.get("eval_loss") or [] if isinstance(p, list) and len(p) == 2]
    values = [(p[0], v) for p in evals if (v := as_float(p[1])) is not None and math.isfinite(v)]
    if values:
        best = min(values, key=lambda p: p[1])
        rows.append(("eval loss points / best / last", f"{len(values)} / {best[1]:.4g} (step {best[0]}) / "
                     f"{values[-1][1]:.4g}"))  # fmt: skip
    if summary.get("vocab_size"):
        vocab = int(summary["vocab_size"])
        rows.append(("vocabulary (uniform guess)", f"{vocab} (ln = {math.log(vocab):.3g} nats)"))
    if summary.get("precision"):
        rows.append(("precision", summary["precision"]))
    settings = summary.get("settings") if isinstance(summary.get("settings"), dict) else {}
    rows += [(f"printed: {key}", value) for key, value in settings.items()]
    rows += [("note", note) for note in summary.get("notes") or []]
    section.title = "Training job (from the imported log)"
    section.intro = "What the log covers and what it prints of its job; the curves are in Training stability."
    section.tables.append(
        Table(title="The log", headers=["what", "value"], rows=[[_cell(k), _cell(v)] for k, v in rows])
    )
