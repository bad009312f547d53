"""What the report shows of a many-rank run: cross-rank bands per step, per-rank tables collapsed to the
ranks that matter, and the full table as a CSV file beside report.html.

The report used to hand every step record to the plots, which drew one line per rank (28 MB of SVG and
171 s at 1,024 ranks × 2,000 steps). Here the steps stream is read column-wise once (frames.read_stream)
and reduced to HTA-style tidy frames with the unit in each column name:

    bands(...)        step, min_<unit>, p50_<unit>, p99_<unit>, max_<unit>  (one row per step or bin)
    step_table.summarise(...)  rank, host, steps, median_step_ms, max_step_ms, last_loss,
                               skipped_steps, peak_rss_bytes

(the grids and the per-rank table come from `step_table.StepTable`, a block of the stream's rows at a time)

A table of more than TABLE_ROWS ranks shows the ranks the findings name (worst first), the slowest
and the lowest rank, and one distribution line (min / p50 / p99 / max of every column); every rank is
in the CSV. Up to PER_RANK_LINES ranks, plots keep one line per rank (that is as readable as a band).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ciuic_doctor.rundir.findings import Finding

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

    from ciuic_doctor.report.step_table import StepTable
    from ciuic_doctor.rundir.store import RunDir

COLUMNS = ("rank", "step", "host", "step_time_s", "pre_backward_s", "loss", "skipped", "rss", "uss")
MEMORY_COLUMNS = ("mem_allocated",)
PER_RANK_LINES = 8
TABLE_ROWS = 16
MAX_BINS = 600  # per band: more than a ~900 px wide plot can show
MAX_OUTLIERS = 6  # ranks drawn and labelled individually over a band
MAX_LINE_POINTS = 300
CSV_FORMULA_START = ("=", "+", "-", "@")  # a spreadsheet would run such a cell as a formula


class StepRecords(list):
    """The steps stream as the report needs it. As a list: the lowest rank's records (what the stability
    plot and the seed tips read, as before). `table`: the report's columns for every rank, column-wise."""

    def __init__(self, records: Sequence[dict[str, Any]], table: StepTable | None) -> None:
        super().__init__(records)
        self.table = table

    @property
    def ranks(self) -> list[int]:
        return self.table.ranks if self.table is not None else []

    @property
    def hosts(self) -> list[str]:
        return self.table.hosts if self.table is not None else []


def load_steps(run: RunDir) -> StepRecords:
    """Every rank's report columns (parallel, columnar) and the lowest rank's whole records."""
    from ciuic_doctor.report.step_table import StepTable
    from ciuic_doctor.rundir.frames import read_stream
    from ciuic_doctor.rundir.store import read_jsonl

    files = run.stream_files("steps")
    if not files:
        return StepRecords([], None)
    table = StepTable(read_stream(run, "steps", (*COLUMNS, *MEMORY_COLUMNS), encoded=True).table)
    shared = run.stream_path("steps")
    records: list[dict[str, Any]] = []
    for path in files[:2] if files[0] == shared else files[:1]:
        records.extend(read_jsonl(path).records)
    # A record without a rank (an imported log: `stability LOG --out RUN` writes rank null) is rank 0's.
    ranks = [r if isinstance(r := rec.get("rank"), int) else 0 for rec in records]
    lowest = min(ranks, default=0)
    return StepRecords([rec for rec, r in zip(records, ranks, strict=True) if r == lowest], table)


# ---- bands ----------------------------------------------------------------------------------------
def bands(steps: np.ndarray, grid: np.ndarray, *, unit: str, scale: float = 1.0) -> pd.DataFrame:
    """Cross-rank min / p50 / p99 / max per step (grid: ranks × steps), binned to at most MAX_BINS rows:
    a bin keeps the lowest min and the highest max of its steps, so a one-step spike stays visible."""
    import numpy as np
    import pandas as pd

    q = column_quantiles(grid, (0.0, 0.5, 0.99, 1.0)) * scale
    frame = pd.DataFrame(
        {"step": steps, f"min_{unit}": q[0], f"p50_{unit}": q[1], f"p99_{unit}": q[2], f"max_{unit}": q[3]}
    ).dropna()
    if len(frame) <= MAX_BINS:
        return frame.reset_index(drop=True)
    groups = frame.groupby(np.arange(len(frame)) * MAX_BINS // len(frame))
    return groups.agg(
        step=("step", "median"),
        **{f"min_{unit}": (f"min_{unit}", "min"), f"max_{unit}": (f"max_{unit}", "max")},
        **{f"p50_{unit}": (f"p50_{unit}", "median"), f"p99_{unit}": (f"p99_{unit}", "median")},
    ).reset_index(drop=True)


_BANDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # StepTable -> {(column, unit, scale): frame}


def table_band(
    table: StepTable,
    column: str,
    *,
    unit: str,
    scale: float = 1.0,
    grid: tuple[np.ndarray, np.ndarray] | None = None,
) -> pd.DataFrame:
    """`bands` of one column of every rank, computed once per table: the job section, the memory plot and
    the overview picture draw the same band (a 1,024 × 2,000 grid is 16 MiB and ~0.3 s to reduce).
    `grid`: (steps, values) of that column when the caller already holds it."""
    cache = _BANDS.setdefault(table, {})
    key = (column, unit, scale)
    if key not in cache:
        steps, grid_values = grid if grid is not None else table.grid(column)[1:]
        cache[key] = bands(steps, grid_values, unit=unit, scale=scale)
        return cache[key]
    return cache[key]


def column_quantiles(grid: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Quantiles of each column over its finite values (numpy's default 'linear' method), from one sort:
    np.nanpercentile takes a slow path per column when a column holds NaN (~1.5 s at 1,024 × 2,000)."""
    import numpy as np

    ordered = np.where(np.isfinite(grid), grid, np.nan)
    ordered.sort(axis=0)  # in place, NaN last: np.sort would be a second copy of the grid
    count = np.isfinite(ordered).sum(axis=0)
    out = np.full((len(qs), grid.shape[1]), np.nan)
    has = count > 0
    cols = np.flatnonzero(has)
    for i, q in enumerate(qs):
        position = q * (count[has] - 1)
        low = np.floor(position).astype(int)
        high = np.minimum(low + 1, count[has] - 1)
        a, b = ordered[low, cols], ordered[high, cols]
        out[i, cols] = a + (b - a) * (position - low)
    return out


def named_ranks(findings: Sequence[Finding], checks: Sequence[str], *, per_host: bool = False) -> list[int]:
    """Ranks the warn/fail findings of `checks` name, worst first (where.ranks, else where.rank). With
    `per_host`, a finding about whole hosts (where.hosts, no single rank to blame) gives one rank a host."""
    out: list[int] = []
    for f in findings:
        if f.check in checks and f.verdict in ("warn", "fail"):
            ranks = f.where.get("ranks") or ([f.where["rank"]] if "rank" in f.where else [])
            if per_host and f.check == "slow_host":
                ranks = ranks[:1]
            out.extend(r for r in ranks if isinstance(r, int) and r not in out)
    return out


def outlier_lines(
    ranks: np.ndarray,
    steps: np.ndarray,
    grid: np.ndarray,
    chosen: Sequence[int],
    *,
    scale: float = 1.0,
    labels: dict[int, str] | None = None,
    limit: int = MAX_OUTLIERS,
) -> list[tuple[str, list[float], list[float]]]:
    """(label, steps, values) of each chosen rank (at most `limit`), as medians of at most
    MAX_LINE_POINTS bins: a level that changes stays sharp, per-step jitter does not hide the band."""
    import numpy as np

    index = {int(r): i for i, r in enumerate(ranks.tolist())}
    lines = []
    for rank in [r for r in chosen if r in index][:limit]:
        row = grid[index[rank]]
        keep = np.isfinite(row)
        xs, ys = steps[keep].astype(float), row[keep] * scale
        if len(xs) > MAX_LINE_POINTS:
            bins = np.arange(len(xs)) * MAX_LINE_POINTS // len(xs)
            edges = np.flatnonzero(np.diff(bins)) + 1
            xs = np.array([np.median(c) for c in np.split(xs, edges)])
            ys = np.array([np.median(c) for c in np.split(ys, edges)])
        label = (labels or {}).get(rank, f"rank {rank}")
        lines.append((label, xs.tolist(), ys.tolist()))
    return lines


def csv_text(table: pd.DataFrame) -> str:
    """The table as CSV; a text cell that a spreadsheet would run as a formula is quoted with a '."""
    safe = table.copy()
    for column in safe.columns:
        if safe[column].dtype == object:
            safe[column] = safe[column].map(
                lambda v: f"'{v}" if isinstance(v, str) and v.startswith(CSV_FORMULA_START) else v
            )
    return safe.to_csv(index=False)


def chosen_rows(table: pd.DataFrame, named: Sequence[int], *, sort_by: str) -> pd.DataFrame:
    """The rows a collapsed table shows: the named ranks first, then the slowest and the lowest rank."""
    if len(table) <= TABLE_ROWS:
        return table
    order = list(dict.fromkeys([*named, *table.nlargest(3, sort_by)["rank"].tolist(), table["rank"].min()]))
    by_rank = table.set_index("rank")
    picked = [r for r in order if r in by_rank.index][:TABLE_ROWS]
    return by_rank.loc[picked].reset_index()


def distribution_cells(table: pd.DataFrame, columns: Sequence[str], fmt: dict[str, Any]) -> list[str]:
    """'min / p50 / p99 / max' of each numeric column over every rank (the collapsed table's last line)."""
    import numpy as np

    cells = []
    for column in columns:
        values = table[column].to_numpy(dtype=float, na_value=np.nan)
        values = values[np.isfinite(values)]
        if not len(values):
            cells.append("—")
            continue
        q = np.percentile(values, [0, 50, 99, 100])
        cells.append(" / ".join(fmt[column](v) for v in q))
    return cells
