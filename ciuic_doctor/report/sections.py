"""One report section per probe: did it run (and if not, why), its findings, plots and data tables.

A section whose probe did not run stays in the report and says "not run" with the reason (from the
checkup's phase log or meta.json's probe record), so an absent check is never mistaken for a pass.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.findings import Finding, sort_findings
from ciuic_doctor.report import plots, rank_view
from ciuic_doctor.store import RunDir, as_float
from ciuic_doctor.units import format_bytes, format_size_short


@dataclass(kw_only=True)
class Table:
    title: str
    headers: list[str]
    rows: list[list[tuple[str, Any]]]  # (shown text, sort key) per cell
    numeric: list[int] = field(default_factory=list)  # right-aligned columns
    csv: str = ""  # a file beside report.html with every row (when the table shows only some)


@dataclass(kw_only=True)
class Section:
    id: str
    title: str
    command: str
    probes: tuple[str, ...]
    streams: tuple[str, ...]
    intro: str = ""
    ran: bool = False
    reason: str = ""
    findings: list[Finding] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # name -> text, written beside report.html


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


def _cell(value: Any, fmt: str | None = None) -> tuple[str, Any]:
    if value is None:
        return ("—", "")
    if isinstance(value, bool):
        return (str(value).lower(), int(value))
    number = as_float(value) if isinstance(value, int | float | str) else None
    if number is not None and fmt and not isinstance(value, str):
        return (format(number, fmt), number)
    return (str(value), number if number is not None else str(value))


def _size_cell(n: Any) -> tuple[str, Any]:
    return (format_size_short(n), n) if isinstance(n, int) else _cell(n)


def bytes_cell(n: Any) -> tuple[str, Any]:
    value = as_float(n)
    return (format_bytes(value), value) if value is not None else ("—", "")


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


def comm_content(section: Section, records: list[dict[str, Any]]) -> None:
    svg = plots.busbw_plot(records)
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


STEP_CHECKS = ("step_time", "straggler_onset", "slow_host")


def _step_frame(steps: Sequence[dict[str, Any]]):  # -> pandas.DataFrame
    """Every rank's report columns: the frame `load_streams` read, or one made from plain records."""
    import pandas as pd

    frame = getattr(steps, "frame", None)
    if frame is not None:
        return frame
    frame = pd.DataFrame.from_records(list(steps))
    for column in rank_view.COLUMNS + rank_view.MEMORY_COLUMNS:
        if column not in frame:
            frame[column] = None
        elif column not in ("host", "skipped"):
            frame[column] = pd.to_numeric(frame[column].map(as_float), errors="coerce")
    return frame


def job_content(section: Section, steps: Sequence[dict[str, Any]], findings: Sequence[Finding] = ()) -> None:
    """Step time and pace as cross-rank bands with the named ranks drawn on top; a host × rank
    heat-map on multi-host runs; the per-rank table collapsed to the ranks that matter (+ CSV)."""
    import numpy as np

    from ciuic_doctor.analysis._crossrank import normalised, quiet_nan, rank_step_grid
    from ciuic_doctor.report import band_plots

    frame = _step_frame(steps)
    if frame.empty or frame["step"].isna().all():
        return
    named = rank_view.named_ranks(findings, STEP_CHECKS, per_host=True)
    ranks, step_ids, step_grid = rank_step_grid(frame, "step_time_s")
    _, _, pace_grid = rank_step_grid(frame, "pre_backward_s")
    with quiet_nan():
        level = np.nanmedian(normalised(pace_grid if np.isfinite(pace_grid).any() else step_grid), axis=1)
    slowest = [int(ranks[i]) for i in np.argsort(-np.nan_to_num(level, nan=-1.0))[:2]]
    chosen = ranks.tolist() if len(ranks) <= rank_view.PER_RANK_LINES else (named or slowest[:1])
    chosen = list(dict.fromkeys(chosen))
    has_pace = bool(np.isfinite(pace_grid).any())
    table = rank_view.per_rank(frame)
    hosts = dict(zip(table["rank"].tolist(), table["host"].tolist(), strict=True))
    labels = {r: f"rank {r} ({hosts[r]})" for r in chosen if isinstance(hosts.get(r), str)}
    # Under DDP every rank's step ends together: the outliers show in the pace, not in the step time.
    panels = [
        {
            "frame": rank_view.bands(step_ids, step_grid, unit="ms", scale=1e3),
            "unit": "ms",
            "ylabel": "step time (ms)",
            "lines": []
            if has_pace
            else rank_view.outlier_lines(ranks, step_ids, step_grid, chosen, scale=1e3, labels=labels),
        }
    ]
    if has_pace:
        panels.append(
            {
                "frame": rank_view.bands(step_ids, pace_grid, unit="ms", scale=1e3),
                "unit": "ms",
                "ylabel": "before backward (ms)",
                "lines": rank_view.outlier_lines(
                    ranks, step_ids, pace_grid, chosen, scale=1e3, labels=labels
                ),
            }
        )
    svg = band_plots.band_plot(panels, name="step time per step across ranks", ranks=len(ranks))
    if svg:
        section.plots.append(svg)
    if len(ranks) >= rank_view.TABLE_ROWS and table["host"].nunique() >= 2:
        hosts = table.set_index("rank").reindex(ranks)["host"].tolist()
        peak = table.set_index("rank").reindex(ranks)["peak_rss_bytes"].to_numpy(dtype=float) / 2**30
        svg = band_plots.host_heatmap(
            hosts,
            ranks.tolist(),
            {"pace vs the typical rank (1 = typical)": level, "peak RSS (GiB)": peak},
            name="host × rank heat-map of pace and memory",
        )
        if svg:
            section.plots.append(svg)
    _per_rank_table(section, table, named)


def _per_rank_table(section: Section, table, named: Sequence[int]) -> None:
    headers = ["rank", "host", "steps", "median step ms", "max step ms", "last loss", "skipped", "peak RSS"]
    columns = ["steps", "median_step_ms", "max_step_ms", "last_loss", "skipped_steps", "peak_rss_bytes"]
    shown = rank_view.chosen_rows(table, named, sort_by="median_step_ms")
    rows = [
        [
            _cell(int(r["rank"])),
            _cell(r["host"] if isinstance(r["host"], str) else None),
            _cell(int(r["steps"])),
            _cell(_finite_or_none(r["median_step_ms"]), ".1f"),
            _cell(_finite_or_none(r["max_step_ms"]), ".1f"),
            _cell(_finite_or_none(r["last_loss"]), ".4g"),
            _cell(int(r["skipped_steps"])),
            bytes_cell(_finite_or_none(r["peak_rss_bytes"])),
        ]
        for r in shown.to_dict("records")
    ]
    if not rows:
        return
    title, csv = "Per rank", ""
    if len(shown) < len(table):
        fmt = {
            "steps": lambda v: f"{v:.0f}",
            "median_step_ms": lambda v: f"{v:.1f}",
            "max_step_ms": lambda v: f"{v:.1f}",
            "last_loss": lambda v: f"{v:.4g}",
            "skipped_steps": lambda v: f"{v:.0f}",
            "peak_rss_bytes": format_bytes,
        }
        cells = rank_view.distribution_cells(table, columns, fmt)
        hosts = table["host"].nunique()
        rows.append([(f"all {len(table)}", ""), (f"{hosts} hosts", ""), *((c, "") for c in cells)])
        csv = "steps_per_rank.csv"
        title = (
            f"Per rank: the {len(shown)} ranks the findings name or that are slowest, of {len(table)}; the "
            "last line is min / p50 / p99 / max over every rank (all ranks in the CSV)"
        )
    section.files["steps_per_rank.csv"] = rank_view.csv_text(table)
    section.tables.append(
        Table(title=title, headers=headers, rows=rows, numeric=[0, 2, 3, 4, 5, 6, 7], csv=csv)
    )


def _finite_or_none(value: Any) -> float | None:
    number = as_float(value)
    return number if number is not None and math.isfinite(number) else None


MEMORY_LABEL = {"mem_allocated": "CUDA allocated", "uss": "USS", "rss": "RSS"}


def step_memory_svg(steps: Sequence[dict[str, Any]], leaks: Sequence[Finding]) -> str | None:
    """Memory over steps as a cross-rank band, the leaking ranks drawn on top with their fitted line."""
    import numpy as np

    from ciuic_doctor.analysis._crossrank import rank_step_grid
    from ciuic_doctor.report import band_plots

    frame = _step_frame(steps)
    if frame.empty:
        return None
    coverage = {k: int((frame[k] > 0).sum()) if k in frame else 0 for k in MEMORY_LABEL}
    if coverage["mem_allocated"]:
        key = "mem_allocated"
    elif coverage["uss"] and coverage["uss"] >= 0.8 * coverage["rss"]:
        key = "uss"
    elif coverage["rss"] or coverage["uss"]:
        key = "rss" if coverage["rss"] else "uss"
    else:
        return None
    kind = "device" if key == "mem_allocated" else "host"
    leaks = [f for f in leaks if f.evidence.get("kind", kind) == kind]
    ranks, step_ids, grid = rank_step_grid(frame, key)
    named = rank_view.named_ranks(leaks, ("memory_leak",))
    chosen = ranks.tolist() if len(ranks) <= rank_view.PER_RANK_LINES else named
    lines = rank_view.outlier_lines(ranks, step_ids, grid, chosen, scale=1 / 2**20)
    slopes: dict[int, float] = {}
    for leak in leaks:
        if (slope := as_float(leak.evidence.get("slope_bytes_per_step"))) is not None:
            slopes.setdefault(leak.where.get("rank"), slope)
        for entry in leak.evidence.get("ranks") or []:
            if (growth := as_float(entry.get("growth_mb_per_step"))) is not None:
                slopes.setdefault(entry.get("rank"), growth * 2**20)
    fits = []
    for label, xs, ys in lines:
        slope = slopes.get(int(label.split()[-1]))
        if slope is None or not xs:
            continue
        # Theil-Sen style intercept: the median of y - slope·x, so the line sits on the data.
        per_mib = slope / 2**20
        b = float(np.median(np.asarray(ys) - per_mib * np.asarray(xs)))
        fits.append(
            (
                f"leak fit {label}: {per_mib:+.3g} MiB/step",
                (xs[0], xs[-1]),
                (b + per_mib * xs[0], b + per_mib * xs[-1]),
            )
        )
    panel = {
        "frame": rank_view.bands(step_ids, grid, unit="mib", scale=1 / 2**20),
        "unit": "mib",
        "ylabel": f"{MEMORY_LABEL[key]} (MiB)",
        "lines": lines,
        "fits": fits,
    }
    return band_plots.band_plot(
        [panel], name=f"memory ({MEMORY_LABEL[key]}) over steps across ranks", ranks=len(ranks)
    )


def memory_content(
    section: Section, steps: list[dict[str, Any]], samples: list[dict[str, Any]], findings: Sequence[Finding]
) -> None:
    leaks = [f for f in findings if f.check == "memory_leak" and f.verdict in ("warn", "fail")]
    svg = step_memory_svg(steps, leaks)
    if svg:
        section.plots.append(svg)
    svg = plots.memwatch_plot(samples)
    if svg:
        section.plots.append(svg)
    by_role: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by_role[str(s.get("role") or s.get("pid") or "?")].append(s)
    rows = []
    for role, ss in sorted(by_role.items()):

        def series(key: str, ss: list[dict[str, Any]] = ss) -> list[float]:
            return [v for s in ss if (v := as_float(s.get(key))) is not None]

        rss, uss = series("rss"), series("uss")
        rows.append(
            [
                _cell(role),
                _cell(len(ss)),
                bytes_cell(rss[0] if rss else None),
                bytes_cell(rss[-1] if rss else None),
                bytes_cell(max(rss) if rss else None),
                bytes_cell(uss[-1] if uss else None),
            ]
        )
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


def loader_content(section: Section, records: list[dict[str, Any]], findings: Sequence[Finding]) -> None:
    best = next((f for f in findings if f.check == "loader_throughput"), None)
    recommended = (best.evidence.get("recommended") if best else None) or {}
    pooled = (best.evidence.get("configs") if best else None) or []
    # The analysis pools every window of a configuration; prefer its figures to the raw records.
    configs = plots.loader_configs(pooled or records)
    svg = plots.loader_plot(list(configs.values()), recommended)
    if svg:
        section.plots.append(svg)
    raw = plots.loader_configs(records)
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


def generic_content(section: Section, records: list[dict[str, Any]]) -> None:
    """A plain table of a stream's records (checkpoint records of no known kind), less bookkeeping."""
    skip = {"schema", "t"}
    keys: list[str] = []
    for r in records:
        keys.extend(k for k in r if k not in skip and k not in keys and not isinstance(r[k], dict | list))
    keys = keys[:10]
    if records and keys:
        section.tables.append(
            Table(
                title="Records",
                headers=keys,
                rows=[
                    [_cell(r.get(k), ".4g" if isinstance(r.get(k), float) else None) for k in keys]
                    for r in records[:200]
                ],
            )
        )


STREAMS = ("comm", "steps", "memwatch", "loader", "checkpoint")


def load_streams(run: RunDir) -> dict[str, list[dict[str, Any]]]:
    """The records of every stream the report draws (torn lines skipped by the store). `steps` is a
    rank_view.StepRecords: the lowest rank's records as a list, every rank's report columns as `.frame`
    (read column-wise: 2 M step records of a 1,024-rank run are never made into dicts)."""
    return {
        name: rank_view.load_steps(run) if name == "steps" else run.read(name).records for name in STREAMS
    }


def build_sections(
    streams: dict[str, list[dict[str, Any]]], findings: Sequence[Finding], meta: dict[str, Any]
) -> list[Section]:
    """Every probe's section, filled from its streams and findings; absent probes say why."""
    sections = _sections()
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
        elif section.id == "job":
            job_content(section, streams["steps"], section.findings)
        elif section.id == "stability":
            events = [
                f
                for f in findings
                if f.probe == "stability"
                and f.where.get("step") is not None
                and f.verdict in ("warn", "fail")
            ]
            svg = plots.stability_plot(streams["steps"], events)
            if svg:
                section.plots.append(svg)
        elif section.id == "memory":
            memory_content(section, streams["steps"], streams["memwatch"], findings)
        elif section.id == "loader":
            loader_content(section, streams["loader"], findings)
        elif section.id == "checkpoint":
            # Imported here: checkpoint_section builds on this module's Section and Table.
            from ciuic_doctor.report.checkpoint_section import checkpoint_content

            checkpoint_content(section, streams["checkpoint"], section.findings)
        else:
            generic_content(section, streams.get(section.streams[0], []))
    return sections
