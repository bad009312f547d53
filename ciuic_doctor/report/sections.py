"""One report section per probe: did it run (and if not, why), its findings, plots and data tables.

A section whose probe did not run stays in the report and says "not run" with the reason (from the
checkup's phase log or meta.json's probe record), so an absent check is never mistaken for a pass.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from ciuic_doctor.report import memwatch_view
from ciuic_doctor.report.blocks import Section, Table, _cell, _size_cell, bytes_cell, generic_content
from ciuic_doctor.report.checkpoint_section import checkpoint_content
from ciuic_doctor.report.hang_section import hang_sections
from ciuic_doctor.report.imported import import_summary
from ciuic_doctor.report.imported import job_content as imported_job_content
from ciuic_doctor.report.moe_section import model_sections, splits_table
from ciuic_doctor.report.plots import busbw_plot, loader_configs, loader_plot, memwatch_plot, stability_plot
from ciuic_doctor.report.rank_view import load_steps
from ciuic_doctor.report.steps_section import job_content, step_memory_svg
from ciuic_doctor.rundir.findings import Finding, sort_findings
from ciuic_doctor.rundir.frames import read_records
from ciuic_doctor.rundir.store import RunDir, as_float

BUSBW_NOTE = (
    "busbw (bus bandwidth) is nccl-tests' figure: algbw (bytes / time) times a factor per collective "
    "(all_reduce 2(n−1)/n; all_gather, reduce_scatter, all_to_all (n−1)/n; broadcast 1). It is what a flat "
    "ring of point-to-point links would need, which makes algorithms comparable — and it can exceed the link "
    "speed: Tree on two nodes sends half the traffic over the network, and NVLS / SHARP reduce inside the "
    "switch. Compare it with nccl-tests, not with the NIC's line rate."
)


def _sections() -> list[Section]:
    return [
        Section(
            id="comm",
            title="Collectives (comm-bench)",
            command="comm-bench",
            probes=("comm",),
            streams=("comm",),
            intro=BUSBW_NOTE,
        ),
        Section(
            id="job",
            title="Training job (job + watch)",
            command="job",
            probes=("steps", "watch", "job"),
            streams=("steps",),
        ),
        Section(
            id="stability",
            title="Training stability",
            command="stability",
            probes=("stability",),
            streams=(),
            intro="Loss, grad norm and loss scale per step of the lowest rank; dotted lines mark detected "
            "spikes, crosses mark steps the GradScaler skipped.",
        ),
        Section(
            id="memory",
            title="Memory (memwatch + step records)",
            command="memwatch",
            probes=("memory", "memwatch"),
            streams=("memwatch",),
        ),
        Section(
            id="loader",
            title="DataLoader (loader-sweep)",
            command="loader-sweep",
            probes=("loader",),
            streams=("loader",),
            intro="Samples per second for each num_workers × prefetch_factor (best over pin_memory and "
            "persistent_workers); the outlined cell is the recommendation: the smallest setting within the "
            "noise of the best.",
        ),
        Section(
            id="checkpoint",
            title="Checkpoint (checkpoint-check)",
            command="checkpoint-check",
            probes=("checkpoint",),
            streams=("checkpoint",),
        ),
    ]


def phase_problem(meta: dict[str, Any], command: str) -> str | None:
    """How the checkup phase of `command` ended when it did not end well (None when fine or absent)."""
    for phase in (meta.get("checkup") or {}).get("phases") or []:
        if (
            isinstance(phase, dict)
            and phase.get("name") == command
            and phase.get("status") not in ("ok", None)
        ):
            return f"{phase.get('status')}: {phase.get('reason') or 'no reason recorded'}"
    return None


def not_run_reason(meta: dict[str, Any], section: Section) -> str:
    """Why a section has no data: the checkup's phase log first, then meta.json's probe record."""
    phases = (meta.get("checkup") or {}).get("phases") or []
    for phase in phases:
        if isinstance(phase, dict) and phase.get("name") == section.command and phase.get("status") != "ok":
            return str(phase.get("reason") or phase.get("status") or "failed")
    probe = (meta.get("probes") or {}).get(section.command)
    if isinstance(probe, dict) and probe.get("status") not in (None, "ok"):
        return str(probe.get("reason") or probe.get("status"))
    if section.streams:
        return f"no {', '.join(section.streams)} records in this run directory"
    return "no step records to analyse in this run directory"


def nodes_note(entry: Any) -> str | None:
    """`2 ranks on 2 nodes: n1 (rank 1); n2 (rank 0)` from comm-bench's meta entry, when its ranks
    spanned several nodes (only rank 0 writes comm.jsonl, so its records name one node)."""
    nodes = entry.get("nodes") if isinstance(entry, dict) else None
    by_node: dict[str, list[int]] = {}
    for item in nodes if isinstance(nodes, list) else []:
        if isinstance(item, dict) and isinstance(item.get("node"), str) and isinstance(item.get("rank"), int):
            by_node.setdefault(item["node"], []).append(item["rank"])
    if len(by_node) < 2:
        return None
    shown = sorted(by_node.items())[:16]
    parts = [
        f"{node} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, sorted(r)[:8]))})" for node, r in shown
    ]
    more = f"; {len(by_node) - len(shown)} more" if len(by_node) > len(shown) else ""
    total = sum(len(r) for r in by_node.values())
    return f"{total} ranks on {len(by_node)} nodes: " + "; ".join(parts) + more


def comm_content(section: Section, records: list[dict[str, Any]]) -> None:
    routed = [r for r in records if r.get("splits")]  # comm-bench --splits-from
    records = [r for r in records if not r.get("splits")]
    svg = busbw_plot(records)
    if svg:
        section.plots.append(svg)
    rows = []
    for r in sorted(
        records, key=lambda r: (str(r.get("collective")), str(r.get("algo")), r.get("bytes") or 0)
    ):
        if r.get("bytes") is None:
            continue
        rows.append(
            [
                _cell(r.get("collective")),
                _cell(r.get("algo")),
                _cell(r.get("algo_used")),
                _cell("in" if r.get("inplace") else "out"),
                _size_cell(r.get("bytes")),
                _cell(r.get("time_us"), ".1f"),
                _cell(r.get("time_us_p99"), ".1f"),
                _cell(r.get("algbw_gbps"), ".3f"),
                _cell(r.get("busbw_gbps"), ".3f"),
                _cell(r.get("wrong")),
                _cell(r.get("slowest_rank")),
            ]
        )
    if rows:
        section.tables.append(
            Table(
                title="Every measured size (time averaged over ranks, as nccl-tests prints it)",
                headers=[
                    "collective",
                    "algo",
                    "algo used",
                    "place",
                    "size",
                    "time µs",
                    "p99 µs",
                    "algbw GB/s",
                    "busbw GB/s",
                    "#wrong",
                    "slowest rank",
                ],
                rows=rows,
                numeric=[4, 5, 6, 7, 8, 9, 10],
            )
        )
    if table := splits_table(routed):
        section.tables.append(table)


def memory_content(
    section: Section, steps: list[dict[str, Any]], samples: list[dict[str, Any]], findings: Sequence[Finding]
) -> None:
    leaks = [f for f in findings if f.check == "memory_leak" and f.verdict in ("warn", "fail")]
    svg = step_memory_svg(steps, leaks)
    if svg:
        section.plots.append(svg)
    svg = memwatch_plot(samples, key=getattr(samples, "key", None))
    if svg:
        section.plots.append(svg)
    processes = getattr(samples, "processes", None)
    if processes is None:  # plain records (a caller without the column-wise view)
        processes = _processes(samples)
    shown, more = memwatch_view.table_rows(processes, findings)
    rows = [
        [
            _cell(p["process"]),
            _cell(p["samples"]),
            bytes_cell(p["first_rss"]),
            bytes_cell(p["last_rss"]),
            bytes_cell(p["peak_rss"]),
            bytes_cell(p["last_uss"]),
        ]
        for p in shown
    ]
    if more:
        section.notes.append(more)
    if rows:
        section.tables.append(
            Table(
                title="Watched processes (memwatch samples)",
                headers=["process", "samples", "first RSS", "last RSS", "peak RSS", "last USS"],
                rows=rows,
                numeric=[1, 2, 3, 4, 5],
            )
        )
    if steps and not samples:
        section.notes.append(
            "memwatch did not sample this run; the plot uses the step records' memory fields."
        )


def _processes(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_role: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by_role[str(s.get("role") or s.get("pid") or "?")].append(s)
    out = []
    for role, ss in sorted(by_role.items()):
        rss = [v for s in ss if (v := as_float(s.get("rss"))) is not None]
        uss = [v for s in ss if (v := as_float(s.get("uss"))) is not None]
        out.append(
            {
                "process": role,
                "samples": len(ss),
                "first_rss": rss[0] if rss else None,
                "last_rss": rss[-1] if rss else None,
                "peak_rss": max(rss) if rss else None,
                "last_uss": uss[-1] if uss else None,
            }
        )
    return out


def loader_content(section: Section, records: list[dict[str, Any]], findings: Sequence[Finding]) -> None:
    best = next((f for f in findings if f.check == "loader_throughput"), None)
    recommended = (best.evidence.get("recommended") if best else None) or {}
    pooled = (best.evidence.get("configs") if best else None) or []
    # The analysis pools every window of a configuration; prefer its figures to the raw records.
    configs = loader_configs(pooled or records)
    svg = loader_plot(list(configs.values()), recommended)
    if svg:
        section.plots.append(svg)
    raw = loader_configs(records)
    rows = []
    for key, r in sorted(configs.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
        workers, prefetch, pin, persistent = key
        latency = raw.get(key, r)
        rows.append(
            [
                _cell(workers),
                _cell(prefetch),
                _cell(pin),
                _cell(persistent),
                _cell(r.get("samples_per_s"), ".1f"),
                _cell(r.get("rel_se_pct"), ".1f"),
                _cell(latency.get("batch_latency_p50_ms"), ".2f"),
                _cell(latency.get("batch_latency_p99_ms"), ".2f"),
            ]
        )
    if rows:
        section.tables.append(
            Table(
                title="Configurations measured",
                headers=[
                    "num_workers",
                    "prefetch",
                    "pin_memory",
                    "persistent",
                    "samples/s",
                    "± % (1 SE)",
                    "batch wait p50 ms",
                    "p99 ms",
                ],
                rows=rows,
                numeric=[0, 1, 4, 5, 6, 7],
            )
        )


STREAMS = ("comm", "steps", "memwatch", "loader", "checkpoint")


def load_streams(run: RunDir, preloaded: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
    """The records of every stream the report draws (torn lines skipped by the store). `steps` is a
    rank_view.StepRecords: the lowest rank's records as a list, every rank's report columns as `.frame`
    (read column-wise: 2 M step records of a 1,024-rank run are never made into dicts). `preloaded`: a
    stream's view the caller loaded already (memwatch's, before the analyses let the stream go)."""
    loaders = {"steps": load_steps, "memwatch": memwatch_view.load}
    streams: dict[str, Any] = dict(preloaded or {})
    for name in STREAMS:
        if name not in streams:
            streams[name] = loaders[name](run) if name in loaders else read_records(run, name)
    return streams


def build_sections(
    streams: dict[str, list[dict[str, Any]]], findings: Sequence[Finding], meta: dict[str, Any]
) -> list[Section]:
    """Every probe's section, filled from its streams and findings; absent probes say why."""
    sections, finish = start_sections(streams, findings, meta)
    finish()
    return sections


def start_sections(
    streams: dict[str, list[dict[str, Any]]], findings: Sequence[Finding], meta: dict[str, Any]
) -> tuple[list[Section], Callable[[], None]]:
    """`build_sections`, less the job section's plots, tables, notes and files on a big job: a forked
    worker makes them (`_job_beside`) while the caller goes on; `finish()` waits for them and puts them
    in. Every section's id, findings, ran and reason are set when it returns."""
    sections = _sections()
    job_later = _job_beside(sections, streams, findings, meta)
    for section in sections:
        section.findings = sort_findings([f for f in findings if f.probe in section.probes])
        has_data = any(streams.get(s) for s in section.streams)
        if section.id == "stability":
            has_data = bool(section.findings)
        section.ran = has_data or bool(section.findings)
        if not section.ran:
            section.reason = not_run_reason(meta, section)
            if section.id == "stability" and streams["steps"]:
                section.reason = "step records exist, but no stability analysis produced findings from them"
            continue
        problem = phase_problem(meta, section.command)
        if problem:
            section.notes.append(
                f"The {section.command} phase of the checkup {problem}; its records may be partial."
            )
        if section.id == "comm":
            comm_content(section, streams["comm"])
            if note := nodes_note((meta.get("probes") or {}).get("comm-bench")):
                section.notes.append(note)
        elif section.id == "job" and import_summary(meta) is not None:  # a report about the log
            imported_job_content(section, meta, streams["steps"])
        elif section.id == "job":
            if job_later is None:  # else a worker makes it (`finish`)
                job_content(section, streams["steps"], section.findings)
        elif section.id == "stability":
            events = [
                f
                for f in findings
                if f.probe == "stability"
                and f.where.get("step") is not None
                and f.verdict in ("warn", "fail")
            ]
            lr = import_summary(meta) is not None  # an imported log's LR schedule is all there is of its job
            svg = stability_plot(streams["steps"], events, lr=lr)
            if svg:
                section.plots.append(svg)
        elif section.id == "memory":
            memory_content(section, streams["steps"], streams["memwatch"], findings)
        elif section.id == "loader":
            loader_content(section, streams["loader"], findings)
        elif section.id == "checkpoint":
            checkpoint_content(section, streams["checkpoint"], section.findings)
        else:
            generic_content(section, streams.get(section.streams[0], []))

    def finish() -> None:
        if job_later is not None:
            job = next(s for s in sections if s.id == "job")
            plots, tables, notes, files = job_later()
            job.plots.extend(plots)
            job.tables.extend(tables)
            job.notes.extend(notes)
            job.files.update(files)

    return sections + model_sections(findings) + hang_sections(findings), finish


# step records from which the job section is made in a worker beside the rest of the page: at 10,000
# ranks x 1,000 steps it took 3.8 s of a 5.8 s page on one core (bands, grids, the heat-map, the
# per-rank table); the other sections, the overview picture and the files ~2 s more
JOB_BESIDE_MIN_ROWS = 1_000_000


def _job_beside(
    sections: list[Section], streams: dict[str, Any], findings: Sequence[Finding], meta: dict[str, Any]
) -> Callable[[], tuple[list[str], list[Table], list[str], dict[str, str]]] | None:
    """The job section's content (plots, tables, notes, files), made in a worker forked now that
    inherits the step table; the callable returned waits for it. None for a small or imported job, one
    core, or no fork: `build_sections` makes it in its turn."""
    from dataclasses import replace

    from ciuic_doctor import parallel

    steps = streams.get("steps")
    table = getattr(steps, "table", None)
    if table is None or table.rows < JOB_BESIDE_MIN_ROWS or import_summary(meta) is not None:
        return None
    if parallel.workers(2) < 2:
        return None
    from ciuic_doctor.parallel.forked import beside
    from ciuic_doctor.report.plots import _pyplot

    _pyplot()  # matplotlib imported once, here: the worker and its heat-map's inherit it (~1 s of CPU each)
    section = next(s for s in sections if s.id == "job")
    mine = sort_findings([f for f in findings if f.probe in section.probes])

    def make() -> tuple[list[str], list[Table], list[str], dict[str, str]]:
        work = replace(section, findings=mine, plots=[], tables=[], notes=[], files={})
        job_content(work, steps, mine, heatmap_beside=True)
        return work.plots, work.tables, work.notes, work.files

    return beside(make)
