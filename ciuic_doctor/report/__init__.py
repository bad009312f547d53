"""Findings + job spec -> every output a person reads: report.html, recommended.env, recommended.toml,
recommendations.json and summary.md, all written into the run directory through the store (which scrubs
secret values from every byte).

    from ciuic_doctor.report import build_report
    result = build_report(RunDir.open("reports/run"), spec_path=None)

`build_report` runs the analyses first when findings.json is missing or older than a stream (so
`ciuic-doctor report RUN` works on a run directory straight from the probes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import UserError
from ciuic_doctor.jobs.observed import ResolvedSpec, fallback, has_observed, merge_ranks, spec_from_observed
from ciuic_doctor.jobs.spec import JobSpec, load_spec, with_updates
from ciuic_doctor.rundir.findings import Finding, overall_verdict, sort_findings
from ciuic_doctor.rundir.store import RunDir

OUTPUTS = ("report.html", "recommended.env", "recommended.toml", "recommendations.json", "summary.md")


@dataclass(kw_only=True)
class ReportResult:
    paths: dict[str, Path] = field(default_factory=dict)
    overall: str = "not_run"
    summary: str = ""
    analysed: bool = False  # True when this call ran the analyses
    findings: list[Finding] = field(default_factory=list)
    first: Any = None  # report.first_screen.FirstScreen: what `checkup` and `report` end with

    def closing_line(self) -> str:
        return self.first.closing_line() if self.first is not None else ""


def needs_analysis(run: RunDir) -> bool:
    """findings.json is missing, or some stream was written after it."""
    from ciuic_doctor.analysis import FINDINGS_FILE

    findings = run.path / FINDINGS_FILE
    if not findings.is_file():
        return True
    try:
        json.loads(findings.read_text())
    except (OSError, ValueError):  # torn or tampered: analyse again rather than report nothing
        return True
    newest = max((p.stat().st_mtime for p in run.path.glob("*.jsonl")), default=0.0)
    return newest > findings.stat().st_mtime


def spec_for_run(meta: dict[str, Any], path: str | Path | None) -> JobSpec:
    """The job spec the report judges (see resolve_spec)."""
    return resolve_spec(meta, path).spec


def resolve_spec(meta: dict[str, Any], path: str | Path | None) -> ResolvedSpec:
    """--spec when given; else the spec the embedded job recorded; else what a watched script configured
    (meta.json `observed`); else the embedded default, marked as a fallback with the reason."""
    if path is not None:
        return ResolvedSpec(spec=load_spec(path), kind="file")
    # The job records the spec it trained with (--spec and --set resolved), after checkup's own record.
    recorded = meta.get("spec") if isinstance(meta.get("spec"), dict) and "optim" in meta["spec"] else None
    spec = load_spec()
    if recorded is not None:
        sections = {k: v for k, v in recorded.items() if k in spec.to_dict() and isinstance(v, dict)}
        try:
            spec = replace(with_updates(spec, sections), source="meta.json (recorded by the job)")
            return ResolvedSpec(spec=spec, kind="recorded")
        except UserError:  # a spec from another version of the tool: fall back, don't fail
            if not has_observed(meta):
                return fallback("the job spec in meta.json is from another version of ciuic-doctor")
    if has_observed(meta):  # after the embedded job's own spec: that one is exact, `observed` a reading
        return spec_from_observed(meta["observed"])
    probes = meta.get("probes") if isinstance(meta.get("probes"), dict) else {}
    if "watch" in probes:
        return fallback("watch recorded the steps but not the script's settings")
    if meta.get("source"):
        return fallback("the records were imported from a log, which does not give the job's settings")
    return fallback("this run recorded neither the script's settings (watch) nor a job spec")


def build_report(
    run: RunDir,
    *,
    spec_path: str | Path | None = None,
    analyze: bool | None = None,
    baseline: RunDir | None = None,
    include_unverified: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ReportResult:
    """`_build_report` on one snapshot of the run's streams (`frames.one_snapshot`): the analyses and the
    page read each stream once, as it was then."""
    from ciuic_doctor.rundir import frames

    with frames.one_snapshot():
        return _build_report(
            run,
            spec_path=spec_path,
            analyze=analyze,
            baseline=baseline,
            include_unverified=include_unverified,
            progress=progress,
        )


def _build_report(
    run: RunDir,
    *,
    spec_path: str | Path | None,
    analyze: bool | None,
    baseline: RunDir | None,
    include_unverified: bool,
    progress: Callable[[str], None] | None,
) -> ReportResult:
    """Analyse (always with analyze=True, never with False, else when needed), recommend, check the seed
    tips, and write every output file; with `baseline`, add the comparison section (and comparison.json).

    Issue 21: RUN/verification.json (`ciuic-doctor verify`) gives each change a status; the files carry
    only changes that help or are facts, `include_unverified` adds the rest as comments. `progress` is
    told each stage as it starts (each analysis, then the page)."""
    from ciuic_doctor.analysis import load_findings, run_all
    from ciuic_doctor.recommend import Context, recommend
    from ciuic_doctor.recommend.tips.seed import evaluate_tips
    from ciuic_doctor.report import files, html, imported, plots, sections
    from ciuic_doctor.rundir.store import as_float

    meta = merge_ranks(run.path, run.read_meta())  # every rank's `observed`, disagreements noted
    resolved = resolve_spec(meta, spec_path)
    spec = resolved.spec
    result = ReportResult()
    preloaded = {}
    if analyze or (analyze is None and needs_analysis(run)):
        # memwatch is let go after the memory analysis, before the steps analyses: the page's view of it
        # is taken then, while the stream is held; the steps stay for the page
        def memwatch_view() -> None:
            preloaded["memwatch"] = sections.memwatch_view.load(run)

        findings = run_all(run, progress, keep=("steps",), before_letting_go={"memwatch": memwatch_view})
        result.analysed = True
    else:
        findings = load_findings(run)
    if progress is not None:
        progress("building the page")
    streams = sections.load_streams(run, preloaded)
    # first: on a big job the job section's plots are made in a worker, beside all that follows
    parts, finish_parts = sections.start_sections(streams, findings, meta)
    plan = recommend(spec, findings, meta, resolved=resolved)
    from ciuic_doctor.recommend import verified

    verification = verified.load(run)  # what `verify` found, change by change
    plan = verified.apply(plan, verification)
    file_plan, unverified = verified.for_files(plan)
    steps = streams.get("steps") or []
    first_rank = min((rank for r in steps if (rank := plots.rank_of(r)) is not None), default=0)
    grad_norms = [
        g for r in steps if plots.rank_of(r) == first_rank and (g := as_float(r.get("grad_norm"))) is not None
    ]
    context = Context(spec=spec, findings=findings, meta=meta, resolved=resolved)
    tips = evaluate_tips(context, grad_norms=grad_norms)
    # an imported log without a job spec of its own is not judged as the embedded job.
    unknown = imported.spec_unknown(meta, resolved.kind)
    if unknown is not None:
        plan, tips = imported.gate_plan(plan, unknown), imported.gate_tips(tips, unknown)
        resolved = replace(resolved, kind="imported", note=imported.spec_note(meta))
    title = imported.log_title(meta)
    shown = replace(spec, job=replace(spec.job, name=title)) if title else spec  # the report's title
    if baseline is not None:
        from ciuic_doctor.report.compare_section import write_comparison

        parts.append(write_comparison(baseline, run))
    if verification is not None:
        from ciuic_doctor.report.verify_section import verify_section

        parts.append(verify_section(verification))
    not_run = [{"section": s.id, "command": s.command, "reason": s.reason} for s in parts if not s.ran]
    # A probe that ended badly but left records: its section shows them, and the verdicts say so.
    findings = [
        *findings,
        *(
            Finding(
                probe="checkup",
                check=s.command,
                verdict="warn",
                summary=f"{s.command} {problem}; its records may be partial",
            )
            for s in parts
            if s.ran and (problem := sections.phase_problem(meta, s.command))
        ),
    ]
    prov = html.provenance(meta, streams, spec)
    run_name = str(meta.get("run") or run.path.name)
    commented = unverified if include_unverified else []
    env_text = files.env_text(
        file_plan, job=shown.job.name, run=run_name, left_out=unverified, commented=commented
    )
    changes = files.toml_changes(spec, file_plan)
    result.summary = files.summary_md(
        spec=shown, plan=plan, findings=findings, tips=tips, not_run=not_run, provenance=prov
    )
    from ciuic_doctor.report import first_screen, overview

    everything = [*findings, *plan.findings]
    step_s, steps_run = _median_step(streams["steps"])
    first = first_screen.build(
        overall=overall_verdict(everything),
        findings=sort_findings(everything),
        plan=plan,
        sections=parts,
        meta=meta,
        run_path=str(run.path),
        step_s=step_s,
        steps_run=steps_run,
    )
    picture = overview.job_overview(
        streams["steps"],
        everything,
        first_screen.anchors_of(parts),
        imported=imported.import_summary(meta) is not None,
    )
    finish_parts()
    beside = {name: run.write_text(name, text) for s in parts for name, text in s.files.items()}  # CSVs
    page = html.render(
        spec=shown,
        findings=findings,
        plan=plan,
        tips=tips,
        sections=parts,
        meta=meta,
        streams=streams,
        env_text=env_text,
        toml_changes=changes,
        resolved=resolved,
        first=first,
        overview=picture,
    )
    result.paths = {
        "recommendations.json": run.write_json(
            "recommendations.json", files.recommendations_json(plan, findings, tips, not_run, spec)
        ),
        "recommended.env": run.write_text("recommended.env", env_text),
        "recommended.toml": run.write_text(
            "recommended.toml",
            _toml_header(resolved)
            + files.spec_toml(
                spec,
                file_plan,
                run=run_name,
                omit=_unobserved_optim(resolved, file_plan),
                left_out=unverified,
                commented=commented,
            ),
        ),
        "summary.md": run.write_text("summary.md", result.summary),
        "report.html": run.write_text("report.html", page),
        **beside,
    }
    if baseline is not None:
        result.paths["comparison.json"] = run.path / "comparison.json"
    result.first = first
    result.findings = [*findings, *plan.findings]
    result.overall = overall_verdict(result.findings)
    return result


def _median_step(steps: Any) -> tuple[float | None, int]:
    """(the job's median step time in s over ranks and steps, how many steps it ran), from the step-time
    band the job section computed; (None, 0) without step times."""
    import math

    table = getattr(steps, "table", None)
    if table is None or not table.has_steps():
        return None, 0
    from ciuic_doctor.report.rank_view import table_band

    band = table_band(table, "step_time_s", unit="ms", scale=1e3)
    values = sorted(v for v in band["p50_ms"].tolist() if math.isfinite(v))
    if not values:
        return None, 0
    steps_run = int(band["step"].max() - band["step"].min()) + 1
    return values[len(values) // 2] / 1e3, steps_run


def _unobserved_optim(resolved: ResolvedSpec, plan: Any) -> list[str]:
    """An observed job's optimizer keys that nobody observed and no recommendation sets: left out of
    recommended.toml, whose defaults (AdamW's betas and weight decay) would describe another optimizer."""
    if resolved.kind != "observed":
        return []
    recommended = {r.setting for r in plan.recommendations}
    return [k for k in resolved.assumed if k.startswith("optim.") and k not in recommended]


def _toml_header(resolved: ResolvedSpec) -> str:
    """recommended.toml says where its values came from when they are not all the job's own."""
    if resolved.kind == "observed":
        lines = [f"# {resolved.spec.job.name} as watch observed it, with the recommended changes applied."]
        if resolved.assumed:
            lines.append("# Not observed (ciuic-doctor's defaults, assumed): " + ", ".join(resolved.assumed))
        return "\n".join(_wrap_comment(line) for line in lines) + "\n"
    if resolved.kind == "fallback":
        return _wrap_comment("# FALLBACK: " + resolved.note) + "\n"
    if resolved.kind == "imported":
        return (
            _wrap_comment("# NOT THE LOG'S JOB: the embedded default spec, unchanged. " + resolved.note)
            + "\n"
        )
    return ""


def _wrap_comment(line: str) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(line, width=110, subsequent_indent="#   "))
