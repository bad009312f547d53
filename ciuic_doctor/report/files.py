"""The text outputs next to report.html: recommended.env, recommended.toml, recommendations.json, summary.md.

recommended.env holds only environment settings, each preceded by a comment saying why, and only those
with a measurement behind them (an unmeasured "leave unset" stays a comment). It is meant to be sourced
(`source RUN/recommended.env`) before torchrun, so every value is shell-quoted and no comment can break
out of its line.
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap
import time
from collections.abc import Sequence
from typing import Any

from ciuic_doctor.jobs.spec import JobSpec, dump_spec, with_updates
from ciuic_doctor.recommend import Plan, is_change, setting_kind
from ciuic_doctor.recommend.tips.seed import Tip
from ciuic_doctor.report.html import show_value
from ciuic_doctor.rundir.findings import Finding, Recommendation, overall_verdict, sort_findings


def _comment(text: str, width: int = 100) -> list[str]:
    flat = " ".join(_one_line(text).split())  # no newline or control character can end the comment early
    return ["# " + line for line in textwrap.wrap(flat, width - 2)] or ["#"]


# A shell variable name (POSIX): anything else cannot follow `export` and is refused, not quoted.
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BARE_TOML_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes (\\", \\\\, \\n, \\uXXXX) are TOML's too, so no value can
    end its line or its quotes (a newline in a name made recommended.toml invalid)."""
    return json.dumps(value)


def _toml_key(key: str) -> str:
    return key if _BARE_TOML_KEY.match(key) else _toml_string(key)


def _one_line(text: object) -> str:
    """Text for a comment: every newline and control character becomes a space."""
    return "".join(ch if ch.isprintable() else " " for ch in str(text))


# Markdown that turns text into markup or HTML: escaped with a backslash (CommonMark: any ASCII
# punctuation may be), so a host, file or function name from a log renders as the text it is.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|&])")


def md_text(text: object) -> str:
    """Plain text for summary.md: one line, every Markdown or HTML special character escaped.

    >>> md_text("<img src=x onerror=alert(1)> **b** [x](y)")
    '\\\\<img src=x onerror=alert(1)\\\\> \\\\*\\\\*b\\\\*\\\\* \\\\[x\\\\](y)'
    """
    return _MD_SPECIAL.sub(r"\\\1", _one_line(text))


def md_code(text: object, *, cell: bool = False) -> str:
    """An inline code span holding `text` as it is: one line, fenced with more backticks than it holds;
    in a table `cell`, `|` escaped (a pipe ends a GFM table cell even inside code)."""
    flat = _one_line(text)
    flat = flat.replace("|", "\\|") if cell else flat
    fence = "`" * (max((len(run) for run in re.findall(r"`+", flat)), default=0) + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def applied(plan: Plan) -> Plan:
    """The recommendations that change files: measured ones only (an unmeasured 'leave unset' is advice)."""
    return Plan(recommendations=[r for r in plan.recommendations if r.evidence.get("measured") is not False])


def _status(rec: Recommendation) -> str:
    found = rec.evidence.get("verification") or {}
    return f"{found.get('status', 'not verified')}: {found.get('reason', '')}".rstrip(": ")


def _left_out_note(left_out: Sequence[Recommendation], kinds: tuple[str, ...]) -> list[str]:
    """Issue 21: the changes the file leaves out because nothing showed they help on this job."""
    names = [r.setting for r in left_out if setting_kind(r.setting) in kinds]
    if not names:
        return []
    return _comment(
        f"Left out, not shown to help on this job ({len(names)}): {', '.join(names)}. Only changes that "
        "`ciuic-doctor verify` found to help, or arithmetic / documented facts, are applied here; "
        "`--include-unverified` adds the rest as comments."
    )


def _commented_env(rec: Recommendation) -> list[str]:
    out = _comment(f"NOT VERIFIED ({_status(rec)}). {rec.setting} = {rec.value}: {rec.why}")
    if rec.value is not None and _ENV_NAME.match(rec.setting):
        out.append(_one_line(f"# export {rec.setting}={shlex.quote(str(rec.value))}"))
    return out


def env_text(
    plan: Plan,
    *,
    job: str,
    run: str,
    left_out: Sequence[Recommendation] = (),
    commented: Sequence[Recommendation] = (),
) -> str:
    lines = [
        *_comment(f"ciuic-doctor: recommended environment for {job} (run {run})."),
        "# Source it before launching: `source recommended.env && torchrun ...`. Only settings with a",
        "# measurement behind them; each says why.",
    ]
    env_recs = [r for r in plan.recommendations if setting_kind(r.setting) == "env"]
    if not env_recs:
        lines += ["", "# No environment setting was recommended by this run's measurements."]
    for rec in env_recs:
        lines.append("")
        measured = rec.evidence.get("measured") is not False
        state = "leave unset" if rec.value is None else f"= {rec.value}"
        lines += _comment(f"{rec.setting} {state} (confidence {rec.confidence}): {rec.why}")
        if not measured:
            lines.append("# (advice only: nothing was measured that this could follow from)")
        elif not _ENV_NAME.match(rec.setting):  # never a live line from a name we cannot quote
            lines.append("# (not exported: the name is not a valid environment variable name)")
        elif rec.value is None:
            lines.append(f"unset {rec.setting}")
        else:
            lines.append(f"export {rec.setting}={shlex.quote(str(rec.value))}")
    if note := _left_out_note(left_out, ("env",)):
        lines += ["", *note]
    for rec in commented:
        if setting_kind(rec.setting) == "env":
            lines += ["", *_commented_env(rec)]
    return "\n".join(lines) + "\n"


def recommended_spec(spec: JobSpec, plan: Plan) -> JobSpec:
    return with_updates(spec, applied(plan).spec_updates(spec))


def toml_changes(spec: JobSpec, plan: Plan) -> str:
    """Only the spec keys that change, as TOML-ish lines under their section (for the copy block)."""
    by_section: dict[str, list[str]] = {}
    for rec in applied(plan).recommendations:
        if setting_kind(rec.setting) != "spec" or not is_change(rec):
            continue
        section, key = rec.setting.split(".", 1)
        value = rec.value
        if value is None:  # TOML has no null: the key goes (e.g. prefetch_factor with num_workers = 0)
            by_section.setdefault(section, []).append(
                f"# remove {_one_line(key)}   (was {_one_line(show_value(rec.current))})"
            )
            continue
        shown = (
            ("true" if value else "false")
            if isinstance(value, bool)
            else (
                _toml_string(value)
                if isinstance(value, str)
                else f"{value:g}"
                if isinstance(value, float)
                else str(value)
            )
        )
        by_section.setdefault(section, []).append(
            f"{_toml_key(key)} = {shown}   # was {_one_line(show_value(rec.current))}"
        )
    env = [
        f"{_toml_key(r.setting)} = {_toml_string(str(r.value))}"
        for r in applied(plan).recommendations
        if setting_kind(r.setting) == "env" and r.value is not None and is_change(r)
    ]
    removed = [
        r.setting
        for r in applied(plan).recommendations
        if setting_kind(r.setting) == "env" and r.value is None and r.setting in spec.distributed.env
    ]
    lines: list[str] = []
    for section, entries in by_section.items():
        lines += [f"[{section}]", *entries, ""]
    if env or removed:
        lines += ["[distributed.env]", *env, *[f"# remove {_one_line(name)}" for name in removed], ""]
    return "\n".join(lines).strip() + "\n" if lines else "# the job spec needs no change\n"


def recommendations_json(
    plan: Plan,
    findings: Sequence[Finding],
    tips: Sequence[Tip],
    not_run: Sequence[dict[str, Any]],
    spec: JobSpec,
) -> dict[str, Any]:
    return {
        "schema": 1,
        "created": time.time(),
        "spec_source": spec.source,
        "overall": overall_verdict([*findings, *plan.findings]),
        "recommendations": [
            {**r.to_dict(), "kind": setting_kind(r.setting), "change": is_change(r)}
            for r in plan.recommendations
        ],
        "settings_findings": [f.to_dict() for f in plan.findings],
        "seed_tips": [t.to_dict() for t in tips],
        "not_run": list(not_run),
    }


_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "not_run": "NOT RUN"}
_TIP_MARK = {"holds": "holds", "does not hold": "does not hold", "not measured": "not measured"}


def summary_md(
    *,
    spec: JobSpec,
    plan: Plan,
    findings: Sequence[Finding],
    tips: Sequence[Tip],
    not_run: Sequence[dict[str, Any]],
    provenance: dict[str, Any],
    max_items: int = 8,
) -> str:
    """Short and pasteable into an issue or a chat: verdict, the problems, the changes, the seed tips."""
    everything = sort_findings([*findings, *plan.findings])
    overall = overall_verdict(everything)
    counts = {v: sum(1 for f in everything if f.verdict == v) for v in ("fail", "warn", "pass", "not_run")}
    lines = [
        f"## ciuic-doctor: {md_text(spec.job.name)} — {_MARK[overall]}",
        "",
        f"run {md_code(provenance.get('run'))} · torch {md_text(provenance.get('torch') or '?')} · CUDA "
        f"{md_text(provenance.get('cuda') or 'none')} · NCCL {md_text(provenance.get('nccl') or 'none')} · "
        f"world size {md_text(provenance.get('world_size') or '?')} · "
        f"{md_text(provenance.get('created') or '')}",
        "",
        f"**Checks:** {counts['fail']} fail, {counts['warn']} warn, {counts['pass']} pass, "
        f"{counts['not_run'] + len(not_run)} not run (a pass covers only the checks that ran).",
    ]
    problems = [f for f in everything if f.verdict in ("fail", "warn")]
    for f in problems[:max_items]:
        lines.append(f"- {_MARK[f.verdict]} {md_code(f'{f.probe}/{f.check}')}: {md_text(f.summary)}")
    if len(problems) > max_items:
        lines.append(f"- … and {len(problems) - max_items} more in report.html")
    for item in not_run:
        lines.append(f"- NOT RUN {md_code(item['command'])}: {md_text(item['reason'])}")
    changes = [r for r in plan.recommendations if is_change(r)]
    lines += ["", "**Recommended changes**" if changes else "**Recommended changes:** none"]
    if changes:
        lines += [
            "",
            "| setting | current | recommended | confidence | verified on the job |",
            "|---|---|---|---|---|",
        ]
        for r in changes:
            current = md_code(show_value(r.current), cell=True) if r.current is not None else "—"
            shown = md_code(show_value(r.value, r.setting), cell=True)
            status = md_text((r.evidence.get("verification") or {}).get("status") or "—")
            setting = md_code(r.setting, cell=True)
            lines.append(f"| {setting} | {current} | {shown} | {md_text(r.confidence)} | {status} |")
    lines += ["", "**Seed tips:** " + " · ".join(f"{t.number} {_TIP_MARK[t.status]}" for t in tips)]
    lines += ["", "Files: report.html, recommended.env, recommended.toml, recommendations.json."]
    return "\n".join(lines) + "\n"


def spec_toml(
    spec: JobSpec,
    plan: Plan,
    *,
    run: str,
    omit: Sequence[str] = (),
    left_out: Sequence[Recommendation] = (),
    commented: Sequence[Recommendation] = (),
) -> str:
    """The spec with the plan applied, as TOML. `omit`: dotted keys left out (an observed job's optimizer
    settings nobody observed: the defaults are AdamW's, and the job may run LBFGS or SGD); `left_out`:
    changes not applied (verify did not find they help), named in a comment; `commented`: the same
    written out commented (--include-unverified)."""
    import tomli_w

    extra = _left_out_note(left_out, ("spec", "env"))
    for rec in commented:
        where = "[distributed.env] " if setting_kind(rec.setting) == "env" else ""
        extra += _comment(f"NOT VERIFIED ({_status(rec)}): {where}{rec.setting} = {show_value(rec.value)}")
    header = "\n".join(
        [
            *_comment(f"ciuic-doctor: {spec.job.name} with the recommended settings of run {run} applied."),
            "# Use it with `ciuic-doctor job --spec recommended.toml`; see recommendations.json for the why.",
            *extra,
            "",
            "",
        ]
    )
    if not omit:
        return header + dump_spec(recommended_spec(spec, plan))
    data = recommended_spec(spec, plan).to_dict()
    for dotted in omit:
        section, _, key = dotted.partition(".")
        if isinstance(data.get(section), dict):
            data[section].pop(key, None)
    note = _comment("Left out (not observed; the defaults would be another optimizer's): " + ", ".join(omit))
    body = tomli_w.dumps({k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in data.items()})
    return header + "\n".join(note) + "\n" + body
