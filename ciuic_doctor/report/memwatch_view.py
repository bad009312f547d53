"""What the report shows of memwatch's samples, computed column-wise: one summary row per watched process
(collapsed to the ones that matter beyond TABLE_ROWS) and the few processes the plot draws.

A 1,024-rank job sampled every second for half an hour is ~2 M samples; the report made each a dict and
grouped them in Python, and listed every process in its table (1,152 rows). Here the samples are read
with `frames.read_stream` (the same cached table the memory analysis read) and summarised per process
with numpy on its columns, a block of samples at a time: a pandas frame of them, grouped, cost 540 MiB at
3,000 ranks (3 M samples) over the cached table. They reach the page as `MemwatchSamples`: as a list,
the samples of the PLOT_PROCESSES processes the plot draws (what `plots.memwatch_plot` reads), thinned as
it thins them; `.processes`, the table rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ciuic_doctor.rundir.findings import Finding

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

    from ciuic_doctor.rundir.store import RunDir

COLUMNS = ("t", "pid", "role", "rss", "uss")
PLOT_PROCESSES = 12  # lines the plot draws (sorted by name), as plots.memwatch_plot did
TABLE_ROWS = 16
BLOCK_ROWS = 1 << 18  # samples summarised at a time: 2 MiB a float column, ~10 MiB of temporaries
ROW_SPAN = 1 << 31  # above any row number: a place × ROW_SPAN + row orders by place and keeps the row


class MemwatchSamples(list):
    """As a list: the samples the plot draws. `processes`: per process (role), samples, first / last / peak
    RSS and last USS; `key`: the quantity the plot shows (USS when any process has it, else RSS)."""

    def __init__(self, records: Sequence[dict[str, Any]], processes: list[dict[str, Any]], key: str) -> None:
        super().__init__(records)
        self.processes = processes
        self.key = key


def load(run: RunDir) -> MemwatchSamples:
    from ciuic_doctor.rundir.frames import read_stream

    if not run.has_stream("memwatch"):
        return MemwatchSamples([], [], "rss")
    # role: codes, not 120 MB of strings; the rows as the columnar copy holds them (the memory analysis's
    # table): where they are not in the stream's order, `places` is where each sits in it
    read = read_stream(run, "memwatch", COLUMNS, encoded=True, any_order=True)
    table, places = read.table, read.stream_rows
    if not table.num_rows:
        return MemwatchSamples([], [], "rss")
    names, codes = _process_codes(table)
    key = "uss" if _any_positive(table["uss"]) else "rss"
    return MemwatchSamples(
        _plot_samples(table, names, codes, key, places), _summaries(table, names, codes, places), key
    )


def _process_codes(table: pa.Table) -> tuple[list[str], np.ndarray]:
    """The processes in name order, and each sample's index into them: a sample is named by its role,
    else by its PID ("?" without one). Through the role column's dictionary (3,001 names for 3 M samples
    at 3,000 ranks) instead of a Python string per sample."""
    import numpy as np
    import pyarrow as pa

    role = table["role"]
    if not pa.types.is_dictionary(role.type):
        role = role.dictionary_encode()
    role = role.unify_dictionaries()  # one dictionary for every chunk
    entries = role.chunk(0).dictionary.to_pylist() if role.num_chunks else []
    # a view of the indices when they are one chunk without nulls (12 MiB at 3 M samples)
    indices = [c.indices.fill_null(-1) if c.null_count else c.indices for c in role.chunks]
    entry = indices[0].to_numpy() if len(indices) == 1 else pa.chunked_array(indices, pa.int32()).to_numpy()
    del indices
    unnamed = entry < 0
    if unnamed.any():  # rare: samples without a role, named by their PID
        pids = table["pid"].filter(pa.array(unnamed)).cast(pa.string()).fill_null("?").dictionary_encode()
        pids = pids.unify_dictionaries()
        entry = entry.copy()
        entry[unnamed] = len(entries) + np.concatenate([c.indices.to_numpy() for c in pids.chunks])
        entries += pids.chunk(0).dictionary.to_pylist()
    del unnamed
    used = np.bincount(entry, minlength=len(entries)) > 0  # a dictionary may hold names no sample has
    names = sorted({entries[i] for i in np.flatnonzero(used)})
    position = {name: i for i, name in enumerate(names)}
    lookup = np.array([position.get(name, -1) for name in entries], dtype=np.int32)
    codes = lookup[entry]
    del role, entry
    pa.default_memory_pool().release_unused()  # the encoding's 27 MiB at 3 M samples, else kept cached
    return names, codes


def _any_positive(column: pa.ChunkedArray) -> bool:
    import pyarrow.compute as pc

    return bool(pc.any(pc.greater(column, 0)).as_py())


def _summaries(
    table: pa.Table, names: list[str], codes: np.ndarray, places: np.ndarray | None = None
) -> list[dict[str, Any]]:
    """Per process: samples, first / last / peak RSS and last USS over the samples where they are known
    (null or NaN left out), BLOCK_ROWS samples at a time. Sizes are floats (bytes) and the sample count
    an int, as the row summary (`sections._processes`) gives them (the table showed "884.0" samples).
    First and last are by place in the stream: `places` (each row's), where the rows are not in its order."""
    import numpy as np

    from ciuic_doctor.rundir.frames import float_values

    def order(at: np.ndarray) -> np.ndarray:
        """What orders rows `at` as the stream does: the row number, or (rows not in the stream's order) the
        place, with the row below it (`% ROW_SPAN` gives it back; no job-wide inverse of the places)."""
        return at if places is None else places[at].astype(np.int64) * ROW_SPAN + at

    count = len(names)
    first = np.full(count, np.iinfo(np.int64).max)
    last, last_uss = np.full(count, -1), np.full(count, -1)
    peak = np.full(count, -np.inf)
    for start in range(0, len(codes), BLOCK_ROWS):
        group = codes[start : start + BLOCK_ROWS]
        rss = float_values(table["rss"].slice(start, len(group)))
        at = np.flatnonzero(~np.isnan(rss))
        np.maximum.at(peak, group[at], rss[at])
        at += start
        np.minimum.at(first, codes[at], order(at))
        np.maximum.at(last, codes[at], order(at))
        uss = float_values(table["uss"].slice(start, len(group)))
        at = np.flatnonzero(~np.isnan(uss)) + start
        np.maximum.at(last_uss, codes[at], order(at))
    has = last >= 0
    first = np.where(has, first, -1)
    if places is not None:  # the rows below the places
        first, last, last_uss = (np.where(key >= 0, key % ROW_SPAN, -1) for key in (first, last, last_uss))
    figures = {
        "samples": np.bincount(codes, minlength=count).tolist(),
        "first_rss": _at(table["rss"], first).tolist(),
        "last_rss": _at(table["rss"], last).tolist(),
        "peak_rss": np.where(has, peak, np.nan).tolist(),
        "last_uss": _at(table["uss"], last_uss).tolist(),
    }
    return [
        {"process": name, **{k: (None if math.isnan(v[i]) else v[i]) for k, v in figures.items()}}
        for i, name in enumerate(names)
    ]


def _at(column: pa.ChunkedArray, rows: np.ndarray) -> np.ndarray:
    """column[rows] as floats, NaN where a row is -1."""
    import numpy as np
    import pyarrow as pa

    from ciuic_doctor.rundir.frames import float_values

    return np.where(rows >= 0, float_values(column.take(pa.array(np.maximum(rows, 0)))), np.nan)


def _plot_samples(
    table: pa.Table, names: list[str], codes: np.ndarray, key: str, places: np.ndarray | None = None
) -> list[dict[str, Any]]:
    """The samples `plots.memwatch_plot` draws of the PLOT_PROCESSES first processes by name, as records:
    each of its lines already sorted and thinned to MAX_POINTS as the plot does it (so it keeps them all),
    and the earliest sample, from which the plot counts time. At 3,000 ranks the agents of 375 hosts
    share one role: 331,500 samples were made into dicts for a line of 600 points. Ties go by place in
    the stream (`places`, each row's, where the rows are not in its order)."""
    import numpy as np
    import pyarrow as pa

    from ciuic_doctor.report.plots import MAX_POINTS, memwatch_series
    from ciuic_doctor.rundir.frames import float_values

    drawn = names[:PLOT_PROCESSES]
    rows = np.flatnonzero(codes < len(drawn))  # the codes count processes in name order
    taken = pa.array(rows)
    t, value = float_values(table["t"].take(taken)), float_values(table[key].take(taken))
    group = codes[rows]
    place = rows if places is None else places[rows]  # rows ascend in the table; places, in the stream
    known = np.isfinite(t)
    if not known.any():  # no time to draw against (the plot draws nothing), yet samples were taken
        seen = np.flatnonzero(~np.isnan(t))
        seen = seen[np.argsort(place[seen])[:1]]
        return [{"t": float(t[i]), "role": drawn[group[i]], key: None} for i in seen]
    earliest = np.flatnonzero(known & (t == np.min(t[known])))
    start = int(earliest[np.argmin(place[earliest])])
    samples = [{"t": float(t[start]), "role": drawn[group[start]], key: None}]
    lines = [memwatch_series({"role": name}) for name in drawn]
    for line in sorted(set(lines)):
        members = [i for i, name in enumerate(lines) if name == line]
        picked = np.flatnonzero(np.isin(group, members) & known & np.isfinite(value))
        # the plot's (x, y) order, ties in the stream's
        order = np.lexsort((place[picked], value[picked] / 2**20, t[picked] - t[start]))
        for i in picked[order[:: max(1, len(order) // MAX_POINTS)]]:
            samples.append({"t": float(t[i]), "role": drawn[group[i]], key: float(value[i])})
    return samples


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
