"""The training job's section and the memory-over-steps plot, for any number of ranks: step time and pace
as cross-rank bands with the ranks the findings name drawn on top, a host × rank heat-map on multi-host
runs, and the per-rank table collapsed to the ranks that matter (every rank in steps_per_rank.csv).

Split from `sections.py` (which owns the section list; Section and Table are in `blocks`); the grids and
the per-rank table come from `step_table` (the stream's columns, never a frame of every row), the bands
from `rank_view`, the drawing from `band_plots`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from ciuic_doctor.report.blocks import Section, Table, _cell, bytes_cell
from ciuic_doctor.report.rank_view import (
    COLUMNS,
    MAX_OUTLIERS,
    MEMORY_COLUMNS,
    PER_RANK_LINES,
    TABLE_ROWS,
    bands,
    chosen_rows,
    csv_text,
    distribution_cells,
    named_ranks,
    outlier_lines,
    table_band,
)
from ciuic_doctor.report.step_table import StepTable
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import as_float
from ciuic_doctor.units import format_bytes

STEP_CHECKS = ("step_time", "straggler_onset", "slow_host", "stall", "intermittent")


def step_table_of(steps: Sequence[dict[str, Any]]) -> StepTable:
    """Every rank's report columns: the table `load_streams` read, or one made from plain records."""
    table = getattr(steps, "table", None)
    return table if table is not None else StepTable.from_records(steps, COLUMNS + MEMORY_COLUMNS)


def job_content(
    section: Section,
    steps: Sequence[dict[str, Any]],
    findings: Sequence[Finding] = (),
    *,
    heatmap_beside: bool = False,
) -> None:
    """Step time and pace as cross-rank bands with the named ranks drawn on top; a host × rank
    heat-map on multi-host runs; the per-rank table collapsed to the ranks that matter (+ CSV).
    `heatmap_beside`: the heat-map is drawn in a worker forked for it while the bands are drawn here
    (the job section of a 10,000-rank report: 1.4 of its 3.4 s, most of it matplotlib's)."""
    import numpy as np

    from ciuic_doctor.analysis.steps.crossrank import normalised, quiet_nan
    from ciuic_doctor.report.band_plots import band_plot, host_heatmap

    columns = step_table_of(steps)
    if not columns.has_steps():
        return
    named = named_ranks(findings, STEP_CHECKS, per_host=True)
    table = columns.per_rank()  # first: its blocks are never held beside a grid
    hosts = dict(zip(table["rank"].tolist(), table["host"].tolist(), strict=True))
    # The pace (pre_backward_s; else the step time, as in other tools' logs) gives each rank's level and
    # the lines drawn. One ranks × steps grid at a time: 23 MiB at 3,000 × 1,000, and the level's
    # normalised copy and its sort take three more.
    ranks, step_ids, grid = columns.grid("pre_backward_s")
    has_pace = bool(np.isfinite(grid).any())
    if not has_pace:
        grid = columns.grid("step_time_s")[2]
    with quiet_nan():
        level = np.nanmedian(normalised(grid), axis=1)
    heatmap = None
    if len(ranks) >= TABLE_ROWS and table["host"].nunique() >= 2:
        # a rank whose records name no host has NaN here: None, which the heat-map leaves out
        by_rank = table.set_index("rank").reindex(ranks)
        heatmap = _drawn(
            partial(
                host_heatmap,
                [h if isinstance(h, str) else None for h in by_rank["host"]],
                ranks.tolist(),
                {
                    "pace vs the typical rank (1 = typical)": level,
                    "peak RSS (GiB)": by_rank["peak_rss_bytes"].to_numpy(dtype=float) / 2**30,
                },
                name="host × rank heat-map of pace and memory",
            ),
            beside=heatmap_beside,
        )
    slowest = [int(ranks[i]) for i in np.argsort(-np.nan_to_num(level, nan=-1.0))[:2]]
    chosen = ranks.tolist() if len(ranks) <= PER_RANK_LINES else (named or slowest[:1])
    chosen = list(dict.fromkeys(chosen))
    limit = max(PER_RANK_LINES, MAX_OUTLIERS)  # a small run: every rank
    labels = {r: f"rank {r} ({hosts[r]})" for r in chosen if isinstance(hosts.get(r), str)}
    lines = outlier_lines(ranks, step_ids, grid, chosen, scale=1e3, labels=labels, limit=limit)
    if has_pace:
        band = bands(step_ids, grid, unit="ms", scale=1e3)
    else:  # the grid is the step time's: the band the overview picture draws too
        band = table_band(columns, "step_time_s", unit="ms", scale=1e3, grid=(step_ids, grid))
    del grid
    step_panel = {"frame": band, "unit": "ms", "ylabel": "step time (ms)", "lines": lines}
    panels = [step_panel]
    if has_pace:  # under DDP every rank's step ends together: the outliers show in the pace, not here
        step_band = table_band(columns, "step_time_s", unit="ms", scale=1e3)
        panels = [
            {**step_panel, "frame": step_band, "lines": []},
            {"frame": band, "unit": "ms", "ylabel": "before backward (ms)", "lines": lines},
        ]
    svg = band_plot(panels, name="step time per step across ranks", ranks=len(ranks))
    if svg:
        section.plots.append(svg)
    if heatmap is not None and (svg := heatmap()):
        section.plots.append(svg)
    _per_rank_table(section, table, named)


def _drawn(draw: Callable[[], str | None], *, beside: bool) -> Callable[[], str | None]:
    """draw() now, or in a worker forked now (`beside`, where this process can fork); the callable
    returned gives its SVG."""
    from ciuic_doctor.parallel import forked

    if beside and forked.can_fork():
        return forked.beside(draw)
    svg = draw()
    return lambda: svg


def _per_rank_table(section: Section, table, named: Sequence[int]) -> None:
    headers = ["rank", "host", "steps", "median step ms", "max step ms", "last loss", "skipped", "peak RSS"]
    columns = ["steps", "median_step_ms", "max_step_ms", "last_loss", "skipped_steps", "peak_rss_bytes"]
    shown = chosen_rows(table, named, sort_by="median_step_ms")
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
        cells = distribution_cells(table, columns, fmt)
        hosts = table["host"].nunique()
        rows.append([(f"all {len(table)}", ""), (f"{hosts} hosts", ""), *((c, "") for c in cells)])
        csv = "steps_per_rank.csv"
        title = (
            f"Per rank: the {len(shown)} ranks the findings name or that are slowest, of {len(table)}; the "
            "last line is min / p50 / p99 / max over every rank (all ranks in the CSV)"
        )
    section.files["steps_per_rank.csv"] = csv_text(table)
    section.tables.append(
        Table(title=title, headers=headers, rows=rows, numeric=[0, 2, 3, 4, 5, 6, 7], csv=csv)
    )


def _finite_or_none(value: Any) -> float | None:
    number = as_float(value)
    return number if number is not None and math.isfinite(number) else None


MEMORY_LABEL = {"mem_allocated": "CUDA allocated", "uss": "USS", "rss": "RSS"}


def memory_key(columns: StepTable) -> str | None:
    """The memory column drawn over steps: CUDA allocated, else USS where most records have it, else RSS."""
    if not columns.rows:
        return None
    coverage = {k: columns.positive(k) for k in MEMORY_LABEL}
    if coverage["mem_allocated"]:
        return "mem_allocated"
    if coverage["uss"] and coverage["uss"] >= 0.8 * coverage["rss"]:
        return "uss"
    if coverage["rss"] or coverage["uss"]:
        return "rss" if coverage["rss"] else "uss"
    return None


def step_memory_svg(steps: Sequence[dict[str, Any]], leaks: Sequence[Finding]) -> str | None:
    """Memory over steps as a cross-rank band, the leaking ranks drawn on top with their fitted line."""
    import numpy as np

    from ciuic_doctor.report.band_plots import band_plot

    columns = step_table_of(steps)
    key = memory_key(columns)
    if key is None:
        return None
    kind = "device" if key == "mem_allocated" else "host"
    leaks = [f for f in leaks if f.evidence.get("kind", kind) == kind]
    ranks, step_ids, grid = columns.grid(key)
    named = named_ranks(leaks, ("memory_leak",))
    chosen = ranks.tolist() if len(ranks) <= PER_RANK_LINES else named
    limit = max(PER_RANK_LINES, MAX_OUTLIERS)
    lines = outlier_lines(ranks, step_ids, grid, chosen, scale=1 / 2**20, limit=limit)
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
        "frame": table_band(columns, key, unit="mib", scale=1 / 2**20, grid=(step_ids, grid)),
        "unit": "mib",
        "ylabel": f"{MEMORY_LABEL[key]} (MiB)",
        "lines": lines,
        "fits": fits,
    }
    return band_plot([panel], name=f"memory ({MEMORY_LABEL[key]}) over steps across ranks", ranks=len(ranks))
