"""The steps stream as the memory checks read it: column-wise, per rank, without 2 M dicts.

Split from `memory.py`: `StepColumns` is `_Data.steps` (numpy columns sliced per rank; records built
per rank only when a check asks for them), `binned` the trend's bins in one vectorised pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from ciuic_doctor.rundir.store import RunDir


class StepColumns(Mapping):
    """The steps stream, read column-wise (frames.read_stream: only the fields the memory checks use)
    and sorted by rank and time. `column(rank, name)` is a numpy view; as a mapping (rank -> records)
    it builds a rank's records only when asked, so a 1,024-rank run never holds 2 M dicts."""

    COLUMNS = (
        "rank",
        "step",
        "t",
        "host",
        "step_time_s",
        "rss",
        "uss",
        "mem_allocated",
        "mem_reserved",
        "mem_active_peak",
        "alloc_retries",
        "inactive_split_bytes",
    )

    def __init__(self, run: RunDir) -> None:
        import numpy as np
        import pyarrow.compute as pc

        from ciuic_doctor.analysis.memory.columns import LazyColumns
        from ciuic_doctor.analysis.stats.grouped import in_order
        from ciuic_doctor.rundir.frames import float_values, read_stream

        self._table: Any = None
        self._columns: dict[str, np.ndarray] = {}
        self._hosts: dict[int, str | None] = {}
        self._bounds: dict[int, tuple[int, int]] = {}
        self._cache: dict[int, list[dict[str, Any]]] = {}
        if not run.has_stream("steps"):
            return
        table = read_stream(run, "steps", self.COLUMNS, encoded=True).table  # host: codes, looked up per rank
        if table["rank"].null_count or table["step"].null_count:  # a filter copies every column
            table = table.filter(pc.and_(pc.is_valid(table["rank"]), pc.is_valid(table["step"])))
        if not table.num_rows:
            return
        # sorted by rank, then time (a record without a time first), in arrow: no 2 M-row Python loop.
        # Per-rank files in rank order, each in time order, are sorted already: check, don't sort.
        rank = table["rank"].to_numpy()
        t = float_values(table["t"], -np.inf)
        # comparisons of neighbours only: each rank's times gathered apart (t[1:][same]) were two more
        # 80 MB copies at 10,000 ranks × 1,000 steps, made at the memory analysis's read peak
        if not in_order(t, rank):
            keys = [("rank", "ascending", "at_start"), ("t", "ascending", "at_start")]
            table = table.take(pc.sort_indices(table, keys))
            rank = table["rank"].to_numpy()
        del t
        self._table = table
        # The job's column as float64 only when the whole job is asked for (`flat`: a run of at most one
        # block of ranks, `memory.blocks`); a block or a rank converts its own rows (`rows`): at 10,000
        # ranks × 1,000 steps each job-wide copy was 80 MB, and the checks made seven of them.
        numeric = tuple(c for c in self.COLUMNS if c != "host")
        self._columns = LazyColumns(numeric, lambda name: float_values(table[name]))
        starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])  # in rank order: no np.unique sort
        unique = rank[starts].astype(np.int64, copy=False)
        stops = [*starts[1:].tolist(), len(rank)]
        hosts = table["host"].take(starts).to_pylist()
        for rank_no, start, stop, host in zip(unique.tolist(), starts.tolist(), stops, hosts, strict=True):
            self._bounds[rank_no] = (start, stop)
            self._hosts[rank_no] = host

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """`name` of rows start..stop (`flat`'s order) as float64, converted from those rows only."""
        import numpy as np

        from ciuic_doctor.rundir.frames import float_values

        if name in self._columns:  # the job's column was made already: a view of it
            return self._columns[name][start:stop]
        if self._table is None or name not in self._table.column_names:
            return np.empty(0)
        return float_values(self._table[name].slice(start, stop - start))

    def column(self, rank: int, name: str) -> np.ndarray:
        start, stop = self._bounds.get(rank, (0, 0))
        return self.rows(name, start, stop)

    def bounds(self) -> dict[int, tuple[int, int]]:
        """rank -> (first row, row after its last) in `flat`'s order."""
        return self._bounds

    def flat(self, name: str) -> np.ndarray:
        """`name` of every row, ranks one after another (rank, then time order)."""
        import numpy as np

        return self._columns.get(name, np.empty(0))

    def host(self, rank: int) -> str | None:
        return self._hosts.get(rank)

    def __getitem__(self, rank: int) -> list[dict[str, Any]]:
        if rank not in self._bounds:
            raise KeyError(rank)
        if rank not in self._cache:
            names = [n for n in self.COLUMNS if n not in ("host", "rank")]
            arrays = [self.column(rank, n) for n in names]
            host = self._hosts[rank]
            records = []
            for i in range(len(arrays[0])):
                record: dict[str, Any] = {"rank": rank, "host": host}
                for name, values in zip(names, arrays, strict=True):
                    if values[i] == values[i]:  # not NaN
                        record[name] = int(values[i]) if name == "step" else float(values[i])
                records.append(record)
            self._cache[rank] = records
        return self._cache[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._bounds)

    def __len__(self) -> int:
        return len(self._bounds)


def binned(x: list[float], y: list[float]) -> tuple[Any, Any]:
    """The same bins `stats.trend.robust_trend` makes of a long series (np.array_split of the x order into
    MAX_POINTS chunks, median x and y of each), computed in one vectorised pass: its per-bin loop cost
    ~20 ms a series, 20 s for a 1,024-rank run. Shorter series pass through unchanged."""
    import numpy as np

    from ciuic_doctor.analysis.stats.trend import MAX_POINTS

    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = xa[keep], ya[keep]
    n = len(xa)
    if n <= MAX_POINTS:
        return xa, ya
    order = np.argsort(xa, kind="stable")
    xa, ya = xa[order], ya[order]
    size, extra = divmod(n, MAX_POINTS)  # array_split: the first `extra` chunks hold one more
    cut = extra * (size + 1)
    xs = [np.median(xa[:cut].reshape(extra, size + 1), axis=1)] if extra else []
    ys = [np.median(ya[:cut].reshape(extra, size + 1), axis=1)] if extra else []
    xs.append(np.median(xa[cut:].reshape(MAX_POINTS - extra, size), axis=1))
    ys.append(np.median(ya[cut:].reshape(MAX_POINTS - extra, size), axis=1))
    return np.concatenate(xs), np.concatenate(ys)
