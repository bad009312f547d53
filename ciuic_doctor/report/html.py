"""report.html: one self-contained offline file rendered with Jinja2 (autoescape on).

Everything that came from a log, a host name or the environment is untrusted and reaches the page only
through Jinja's escaping; the plots are SVG that matplotlib escaped itself; the data block is JSON with
`<`, `>` and `&` written as \\u escapes, so no string in it can close the <script> element. CSS and JS are
inlined from static/ (no CDN: the report must open offline and in an air-gapped cluster).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from importlib import resources
from typing import Any

from ciuic_doctor import __version__
from ciuic_doctor.jobs.observed import ResolvedSpec, describe_observed
from ciuic_doctor.jobs.spec import JobSpec
from ciuic_doctor.machine.envinfo import redact_env, scrub
from ciuic_doctor.recommend import Plan, environment_of, is_change, setting_kind
from ciuic_doctor.recommend.tips.seed import Tip
from ciuic_doctor.report.blocks import Section
from ciuic_doctor.rundir.findings import Finding, overall_verdict, sort_findings

VERDICT_LABEL = {"pass": "pass", "warn": "warn", "fail": "fail", "not_run": "not run"}


def json_for_script(data: Any) -> str:
    """JSON safe inside <script type="application/json">: no `</script>`, `<!--` or `&` can appear raw.

    >>> json_for_script({"log": "</script><b>"})
    '{"log": "\\\\u003c/script\\\\u003e\\\\u003cb\\\\u003e"}'
    """
    text = json.dumps(data, default=str, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def show_value(value: Any, setting: str = "") -> str:
    """A recommendation's value as a person reads it."""
    if value is None:
        return "leave unset" if setting_kind(setting) == "env" else "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={show_value(v)}" for k, v in value.items())
    return str(value)


def provenance(
    meta: dict[str, Any], streams: dict[str, list[dict[str, Any]]], spec: JobSpec
) -> dict[str, Any]:
    """Where and when the measurements were made (footer): versions, world size, hosts, times."""
    env = environment_of(meta)
    hosts = sorted(
        {str(r["host"]) for recs in streams.values() for r in recs[:5000] if r.get("host")}
        | ({str(env["host"])} if env.get("host") else set())
    )
    steps = streams.get("steps", [])
    hosts = sorted({*hosts, *getattr(steps, "hosts", [])})  # rank_view.StepRecords: every rank's hosts
    world = [r.get("world_size") for r in streams.get("comm", []) if isinstance(r.get("world_size"), int)]
    ranks = set(
        getattr(steps, "ranks", None) or {r.get("rank") for r in steps if isinstance(r.get("rank"), int)}
    )
    world_size = (
        max(world) if world else (len(ranks) if ranks else (env.get("world") or {}).get("world_size"))
    )
    created = meta.get("created")
    return {
        "tool": f"ciuic-doctor {(meta.get('tool') or {}).get('version', __version__)}",
        "report_tool": f"ciuic-doctor {__version__}",
        "torch": env.get("torch") or (env.get("packages") or {}).get("torch"),
        "cuda": env.get("cuda"),
        "nccl": env.get("nccl"),
        "python": env.get("python"),
        "os": env.get("os"),
        "world_size": world_size,
        "hosts": hosts,
        "run": meta.get("run"),
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(created)) if created else None,
        "reported": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "spec": spec.source,
    }


def environment_rows(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """The captured environment, redacted again (names with TOKEN/KEY/SECRET/...; URL credentials)."""
    env = environment_of(meta)
    rows: list[tuple[str, str]] = []
    for key in ("host", "os", "python", "torch", "cuda", "nccl", "cudnn", "cuda_available", "executable"):
        if env.get(key) is not None:
            rows.append((key, scrub(str(env[key]))))
    cpu = env.get("cpu")
    if isinstance(cpu, dict):
        rows.append(("cpu", ", ".join(f"{k} {v}" for k, v in cpu.items())))
    for device in env.get("devices") or []:
        if isinstance(device, dict):
            rows.append((f"device {device.get('index')}", scrub(str(device.get("name")))))
    variables = env.get("env") if isinstance(env.get("env"), dict) else {}
    for name, value in sorted(redact_env({str(k): str(v) for k, v in variables.items()}).items()):
        rows.append((name, scrub(value)))
    for path, entries in (env.get("nccl_conf") or {}).items():
        if isinstance(entries, dict):
            for name, value in redact_env({str(k): str(v) for k, v in entries.items()}).items():
                rows.append((f"{path}: {name}", scrub(value)))
    return rows


WHERE_LIST_ITEMS = 8  # a finding's where.ranks of a 1,024-rank job: the first few, then a count


def where_text(where: dict[str, Any] | None) -> str:
    """A finding's `where` on one line; long lists (ranks, hosts) show their first items and a count.

    >>> where_text({"rank": 3, "ranks": list(range(3, 20))})
    'rank=3 ranks=3, 4, 5, 6, 7, 8, 9, 10 … (+9)'
    """
    parts = []
    for key, value in (where or {}).items():
        text = str(value)
        if isinstance(value, list):
            more = f" … (+{len(value) - WHERE_LIST_ITEMS})" if len(value) > WHERE_LIST_ITEMS else ""
            text = ", ".join(str(v) for v in value[:WHERE_LIST_ITEMS]) + more
        parts.append(f"{key}={text}")
    return " ".join(parts)


def _template_env():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("ciuic_doctor.report", "templates"),
        autoescape=True,  # every template, whatever its name: log lines and host names are untrusted
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["verdict_label"] = lambda v: VERDICT_LABEL.get(v, v)
    env.filters["where"] = where_text
    return env


def _static(name: str) -> str:
    return resources.files("ciuic_doctor.report").joinpath("static", name).read_text()


def render(
    *,
    spec: JobSpec,
    findings: Sequence[Finding],
    plan: Plan,
    tips: Sequence[Tip],
    sections: Sequence[Section],
    meta: dict[str, Any],
    streams: dict[str, list[dict[str, Any]]],
    env_text: str,
    toml_changes: str,
    resolved: ResolvedSpec | None = None,
    first: Any = None,
    overview: str | None = None,
) -> str:
    """The whole page as one string (the caller writes it through the store, which scrubs secrets)."""
    import markupsafe

    from ciuic_doctor.report.verify_section import status_text

    everything = sort_findings([*findings, *plan.findings])
    not_run = [s for s in sections if not s.ran]
    overall = overall_verdict(everything)
    if overall == "pass" and not_run:
        overall_note = "pass for the checks that ran; some probes did not run"
    else:
        overall_note = ""
    counts = {v: sum(1 for f in everything if f.verdict == v) for v in ("fail", "warn", "pass", "not_run")}
    counts["not_run"] += len(not_run)
    checked = sorted({f"{f.probe}/{f.check}" for f in everything if f.verdict != "not_run"})
    recs = [
        {
            **r.to_dict(),
            "kind": setting_kind(r.setting),
            "shown": show_value(r.value, r.setting),
            "current_shown": show_value(r.current) if r.current is not None else "—",
            "change": is_change(r),
            "verified": status_text(r.evidence),  # what `verify` found on the job
        }
        for r in plan.recommendations
    ]
    prov = provenance(meta, streams, spec)
    data = {
        "schema": 1,
        "run": meta.get("run"),
        "overall": overall,
        "findings": [f.to_dict() for f in everything],
        "not_run": [{"section": s.id, "command": s.command, "reason": s.reason} for s in not_run],
        "recommendations": recs,
        "seed_tips": [t.to_dict() for t in tips],
        "provenance": prov,
        "first_screen": first.to_dict() if first is not None else None,
    }
    template = _template_env().get_template("report.html.j2")
    return template.render(
        job=spec.job.name,
        spec_kind=resolved.kind if resolved is not None else "file",
        spec_note=resolved.note if resolved is not None else "",
        observed_rows=describe_observed(resolved.observed) if resolved is not None else [],
        overall=overall,
        overall_note=overall_note,
        counts=counts,
        checked=checked,
        findings=everything,
        not_run=not_run,
        recs=recs,
        env_text=env_text,
        toml_changes=toml_changes,
        tips=[{**asdict(t), "status": t.status} for t in tips],
        sections=sections,
        provenance=prov,
        environment=environment_rows(meta),
        css=markupsafe.Markup(_static("report.css")),
        js=markupsafe.Markup(_static("report.js")),
        data_json=markupsafe.Markup(json_for_script(data)),
        markup=markupsafe.Markup,
        first=first,
        overview=markupsafe.Markup(overview) if overview else None,
        # the verdict table's rows a reader needs first; pass and not-run collapse to counts
        flagged=[f for f in everything if f.verdict in ("fail", "warn")],
        passed=[f for f in everything if f.verdict == "pass"],
        unmeasured=[f for f in everything if f.verdict == "not_run"],
    )
