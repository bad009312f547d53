"""What the report shows of memwatch's samples, computed column-wise: one summary row per watched process
(collapsed to the ones that matter beyond TABLE_ROWS) and the few processes the plot draws.

A 1,024-rank job sampled every second for half an hour is ~2 M samples; the report made each a dict and
grouped them in Python, and listed every process in its table (1,152 rows). Here the samples are read
with `frames.read_stream` (the same cached table the memory analysis read), summarised per process with
one pandas groupby, and handed to the page as `MemwatchSamples`: as a list, the samples of the
PLOT_PROCESSES processes the plot draws (what `plots.memwatch_plot` reads); `.processes`, the table rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ciuic_doctor.findings import Finding

if TYPE_CHECKING:
    from ciuic_doctor.store import RunDir

COLUMNS = ("t", "pid", "role", "rss", "uss")
PLOT_PROCESSES = 12  # lines the plot draws (sorted by name), as plots.memwatch_plot did
TABLE_ROWS = 16


class MemwatchSamples(list):
    """As a list: the samples the plot draws. `processes`: per process (role), samples, first / last / peak
    RSS and last USS; `key`: the quantity the plot shows (USS when any process has it, else RSS)."""

    def __init__(self, records: Sequence[dict[str, Any]], processes: list[dict[str, Any]], key: str) -> None:
        super().__init__(records)
        self.processes = processes
        self.key = key


def load(run: RunDir) -> MemwatchSamples:
    import pandas as pd

    from ciuic_doctor.frames import read_stream

    if not run.has_stream("memwatch"):
        return MemwatchSamples([], [], "rss")
    frame = read_stream(run, "memwatch", COLUMNS).frame()
    if frame.empty:
        return MemwatchSamples([], [], "rss")
    # the row code named a process by its role, else its PID
    name = frame["role"].astype(object)
    unnamed = name.isna()
    if unnamed.any():  # rare: a sample without a role is named by its PID
        name[unnamed] = [("?" if math.isnan(p) else str(int(p))) for p in frame["pid"][unnamed]]
    frame["process"] = name.astype(str)
    key = "uss" if (frame["uss"].fillna(0) > 0).any() else "rss"
    grouped = frame.groupby("process", sort=True)
    rss = frame.dropna(subset=["rss"]).groupby("process", sort=True)["rss"]
    uss = frame.dropna(subset=["uss"]).groupby("process", sort=True)["uss"]
    summary = pd.DataFrame(
        {
            "samples": grouped.size(),
            "first_rss": rss.first(),
            "last_rss": rss.last(),
            "peak_rss": rss.max(),
            "last_uss": uss.last(),
        }
    )
    processes = [
        {"process": process, **{k: (None if pd.isna(v) else v) for k, v in row.items()}}
        for process, row in summary.iterrows()
    ]
    drawn = sorted(frame["process"].unique())[:PLOT_PROCESSES]
    plot = frame[frame["process"].isin(drawn) & frame["t"].notna()]
    records = [
        {"t": float(t), "role": p, key: (None if math.isnan(v) else float(v))}
        for t, p, v in zip(
            plot["t"].to_numpy(), plot["process"].to_numpy(), plot[key].to_numpy(), strict=True
        )
    ]
    return MemwatchSamples(records, processes, key)


def table_rows(processes: list[dict[str, Any]], findings: Sequence[Finding]) -> tuple[list[dict], str | None]:
    """The processes to list: all of them up to TABLE_ROWS; beyond, the ranks the memory findings name,
    then the largest peak RSS, with one line saying how many were left out and their spread."""
    if len(processes) <= TABLE_ROWS:
        return processes, None
    named: list[str] = []
    for f in findings:
        if f.probe == "memory" and f.verdict in ("warn", "fail"):
            for rank in f.where.get("ranks") or ([f.where["rank"]] if "rank" in f.where else []):
                if f"rank {rank}" not in named:
                    named.append(f"rank {rank}")
    by_name = {p["process"]: p for p in processes}
    chosen = [by_name[n] for n in named if n in by_name][:TABLE_ROWS]
    for p in sorted(processes, key=lambda p: -(p["peak_rss"] or 0)):
        if len(chosen) >= TABLE_ROWS:
            break
        if p not in chosen:
            chosen.append(p)
    peaks = sorted(p["peak_rss"] for p in processes if p["peak_rss"] is not None)
    spread = None
    if peaks:
        from ciuic_doctor.units import format_bytes

        p50 = peaks[len(peaks) // 2]
        spread = (
            f"{len(processes) - len(chosen)} more processes not listed; peak RSS over all "
            f"{len(processes)}: min {format_bytes(peaks[0])}, median {format_bytes(p50)}, "
            f"max {format_bytes(peaks[-1])}"
        )
    return chosen, spread
