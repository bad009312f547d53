"""memwatch's samples as the memory checks read them: column-wise, grouped by process, never as dicts.

A 1,024-rank job sampled every second for half an hour is ~2 M samples; the row reader made each a dict
(and validated it: `schemas.validate` per record), then the checks walked them per rank. Here the
samples are read with `frames.read_stream` (only the columns the checks use), stably sorted by PID so
each process's samples are one slice in file order, and the per-rank lookups the checks make — a time
as a fractional step of that rank, the reserved bytes of its last step before a time — are one
vectorised search over every rank at once (`group_interp`, `group_last_before`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from ciuic_doctor.rundir.store import RunDir

# queries answered at once by group_interp / group_last_before: each of their ~15 temporaries is then
# 8 MiB, not one per sample (80 MB each at 10,000 ranks: ~1.2 GB at once, every page faulted in anew)
QUERY_BLOCK = 1 << 20
NUMERIC = ("t", "rss", "anon", "uss", "pss", "gpu_bytes", "gpu_total_bytes", "sys_available_bytes")


class LazyColumns(dict):
    """name -> the whole job's float64 numpy column, made by `convert` on first read (80 MB each at
    10,000 ranks × 1,000 steps): what `flat` gives a run of at most one block of ranks; a bigger run's
    blocks convert only their own rows (`memory.blocks`)."""

    def __init__(self, names: tuple[str, ...], convert: Any) -> None:
        super().__init__()
        self._names = set(names)
        self._convert = convert

    def __missing__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        self[name] = values = self._convert(name)
        return values

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default


PID_BITS = 32  # a process key: its PID, plus its host's place above these bits when the PID is on two hosts


def pid_of(key: int | None) -> int | None:
    """The PID of a process key (`MemwatchColumns`' keys).

    >>> pid_of(4242), pid_of(4242 + (3 << PID_BITS)), pid_of(None)
    (4242, 4242, None)
    """
    return None if key is None else key & ((1 << PID_BITS) - 1)


def _process_keys(table: Any, stream_rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(each sample's process key, the order that groups them, each process's samples in stream order).
    A process is its host and PID: nodes booted alike give their ranks the same PIDs, and keyed by PID
    alone two ranks on two nodes were one series (half the slope, one rank checked). The key is the PID
    itself unless that PID is on more than one host; then the host's dictionary code goes above PID_BITS
    (`pid_of` takes it off). `stream_rows`: the rows' places in the stream, where the table is not in
    its order (`TableRead.stream_rows`)."""
    import numpy as np

    pid = table["pid"].to_numpy()
    order = _grouped(pid, stream_rows)
    if "host" not in table.column_names:
        return pid, order
    codes = _host_codes(table["host"])
    shared = _pids_on_two_hosts(pid, codes, order)
    if not len(shared):  # every PID on one host (one node, or nodes that differ): the PID is the key
        return pid, order
    key = np.where(np.isin(pid, shared), pid + ((codes.astype(np.int64) + 2) << PID_BITS), pid)
    return key, _grouped(key, stream_rows)


def _grouped(key: np.ndarray, stream_rows: np.ndarray | None) -> np.ndarray:
    """The rows by key, each key's rows in stream order: what a stable argsort of the key gives over the
    stream's rows. A copy's parts hold each process's samples in stream order (every sample of a process
    names its rank, whose part holds them all), so a stable argsort of the parts' rows gives it too;
    checked, and sorted on the places where a process's samples span parts.

    >>> import numpy as np
    >>> _grouped(np.array([7, 5, 7, 5]), np.array([2, 3, 0, 1])).tolist()
    [3, 1, 2, 0]
    """
    import numpy as np

    order = np.argsort(key, kind="stable")
    if stream_rows is None:
        return order
    for start in range(0, len(order) - 1, QUERY_BLOCK):  # a block at a time: whole copies in key order
        rows = order[start : start + QUERY_BLOCK + 1]  # were 170 MB at 10,000 ranks, at the report's peak
        keys, places = key[rows], stream_rows[rows]
        if not ((keys[1:] != keys[:-1]) | (places[1:] > places[:-1])).all():
            return np.lexsort((stream_rows, key))
    return order


def _host_codes(host: Any) -> np.ndarray:
    """Each sample's host as an int32 code (-1 where it has none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_dictionary(host.type):
        host = pc.dictionary_encode(host)
    if host.num_chunks != 1:
        host = pa.table({"host": host}).unify_dictionaries().column(0).combine_chunks()
    else:
        host = host.chunk(0)
    indices = host.indices.fill_null(-1) if host.null_count else host.indices
    return indices.to_numpy(zero_copy_only=False)


def _pids_on_two_hosts(pid: np.ndarray, codes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The PIDs whose samples name more than one host, walking the PID order a block at a time (whole
    copies of it in PID order were 200 MB at 10,000 ranks, at the report's peak)."""
    import numpy as np

    found = [np.empty(0, pid.dtype)]
    last_pid, last_code = pid[:0], codes[:0]
    for start in range(0, len(order), QUERY_BLOCK):
        rows = order[start : start + QUERY_BLOCK]
        p, c = np.concatenate([last_pid, pid[rows]]), np.concatenate([last_code, codes[rows]])
        other = (p[1:] == p[:-1]) & (c[1:] != c[:-1])
        if other.any():
            found.append(p[1:][other])
        last_pid, last_code = p[-1:], c[-1:]
    return np.unique(np.concatenate(found))


class MemwatchColumns(Mapping):
    """Samples per process (as a mapping: process key -> that process's samples as records, built when
    asked — the worker check reads a few). `roles`: each process's last role, in order of first
    appearance. A process key is its PID, made unique by its host where two hosts share the PID
    (`pid_of` gives the PID back)."""

    COLUMNS = ("pid", "role", "host", *NUMERIC)

    def __init__(self, run: RunDir) -> None:
        import numpy as np
        import pyarrow.compute as pc

        from ciuic_doctor.rundir.frames import read_stream

        self._table: Any = None
        self._columns: dict[str, np.ndarray] = {}
        self._order = np.empty(0, dtype=np.int64)
        self._bounds: dict[int, tuple[int, int]] = {}
        self._hosts: dict[int, str | None] = {}
        self.roles: dict[int, str] = {}
        self._cache: dict[int, list[dict[str, Any]]] = {}
        self.rows = 0
        if not run.has_stream("memwatch"):
            return
        # role, host: codes; the rows as the columnar copy holds them, grouped by process below anyway
        read = read_stream(run, "memwatch", self.COLUMNS, encoded=True, any_order=True)
        table, stream_rows = read.table, read.stream_rows
        # a sample without a PID or a time (0 counts as none, as the row checks had it) is no sample
        t = table["t"]
        keep = pc.and_(pc.is_valid(table["pid"]), pc.and_(pc.is_valid(t), pc.not_equal(t, 0.0)))
        keep = keep.fill_null(False)
        if not pc.all(keep).as_py():  # a filter copies every column: only when a sample goes
            table = table.filter(keep)
            if stream_rows is not None:
                stream_rows = stream_rows[keep.to_numpy(zero_copy_only=False)]
        if not table.num_rows:
            return
        # Each process's samples in file order: one stable sort by PID. A column is never copied into that
        # order for the job (PID-ordered copies of six columns were 480 MB at 10,000 ranks): a block of
        # ranks or one process gathers its own samples through `order` (`gather`); `flat`, the whole
        # job's, is for a run of at most one block (`memory.blocks`).
        pid, order = _process_keys(table, stream_rows)
        if len(order) < 2**31:  # 40 MB instead of 80 at 10,000 ranks
            order = order.astype(np.int32)
        pid = pid[order]
        starts = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]])
        stops = np.r_[starts[1:], len(pid)]
        unique = pid[starts]
        del pid
        self._table, self._order, self.rows = table, order, len(order)
        # a weak reference: a closure over self made a cycle, which kept the samples (~0.9 GB at 10,000
        # ranks x 1,000 steps) after the memory analysis until Python's collector happened to run
        own = weakref.ref(self)
        self._columns = LazyColumns(NUMERIC, lambda name: own().gather(name, slice(None)))
        roles = table["role"].take(order[stops - 1]).to_pylist()  # a pid's last role wins
        hosts = table["host"].take(order[starts]).to_pylist()
        # in order of first appearance in the stream: each process's first sample is its first in `order`
        first = order[starts] if stream_rows is None else stream_rows[order[starts]]
        rows = list(zip(unique.tolist(), starts.tolist(), stops.tolist(), roles, hosts, strict=True))
        for i in np.argsort(first).tolist():  # places are distinct: any sort gives the one order
            p, start, stop, role, host = rows[i]
            self._bounds[p] = (start, stop)
            self.roles[p] = role
            self._hosts[p] = host

    def column(self, pid: int, name: str) -> np.ndarray:
        start, stop = self._bounds.get(pid, (0, 0))
        return self.gather(name, slice(start, stop))

    def gather(self, name: str, rows: np.ndarray | slice) -> np.ndarray:
        """`name` at `rows` of the PID order (`bounds`' positions) as float64, gathered from the table's
        own order: a view of the table's buffer indexed where the column is float64 without nulls, else
        a take() of those rows only (fill_null copies the whole column: 80 MB at 10,000 ranks)."""
        import numpy as np
        import pyarrow as pa

        from ciuic_doctor.rundir.frames import float_values

        if self._table is None or name not in NUMERIC or name not in self._table.column_names:
            return np.empty(0)
        column, at = self._table[name], self._order[rows]
        if pa.types.is_float64(column.type) and not column.null_count and column.num_chunks == 1:
            return column.chunk(0).to_numpy()[at]
        return float_values(column.take(at))

    def host(self, pid: int) -> str | None:
        return self._hosts.get(pid)

    def has(self, name: str) -> bool:
        """Whether any sample carries `name` (NVML's gpu_bytes: whether NVML saw the processes)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if self._table is None or name not in self._table.column_names:
            return False
        column = self._table[name]
        if column.null_count == len(column):
            return False
        return not pa.types.is_floating(column.type) or bool(pc.any(pc.is_finite(column)).as_py())

    def bounds(self) -> dict[int, tuple[int, int]]:
        return self._bounds

    def flat(self, name: str) -> np.ndarray:
        import numpy as np

        return self._columns.get(name, np.empty(0))

    def __getitem__(self, pid: int) -> list[dict[str, Any]]:
        if pid not in self._bounds:
            raise KeyError(pid)
        if pid not in self._cache:
            arrays = {name: self.column(pid, name) for name in NUMERIC}
            base = {"pid": pid_of(pid), "role": self.roles[pid], "host": self._hosts[pid]}
            self._cache[pid] = [
                {**base, **{k: float(v[i]) if v[i] == v[i] else None for k, v in arrays.items()}}
                for i in range(len(arrays["t"]))
            ]
        return self._cache[pid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._bounds)

    def __len__(self) -> int:
        return len(self._bounds)


def _keys(group: np.ndarray, t: np.ndarray, low: float, width: float) -> np.ndarray:
    """One sortable float per (group, time): groups apart by more than any time span."""
    return group * width + (t - low)


def group_interp(
    group: np.ndarray, t: np.ndarray, point_group: np.ndarray, point_t: np.ndarray, point_v: np.ndarray
) -> np.ndarray:
    """np.interp(t, point_t, point_v, left=nan, right=nan) within each group, for every query at once.

    Points must be sorted by group, then time (finite). A query outside its group's span, or in a group
    with fewer than 2 points, is NaN (the per-rank np.interp call this replaces returned None there)."""
    import numpy as np

    out = np.full(len(t), np.nan)
    if not len(t) or len(point_t) < 2:
        return out
    counts = np.bincount(point_group, minlength=int(max(group.max(), point_group.max())) + 1)
    low = float(min(np.min(t), np.min(point_t)))
    width = float(max(np.max(t), np.max(point_t)) - low) + 1.0
    keys = _keys(point_group.astype(float), point_t, low, width)
    points = (keys, counts, point_group, point_t, point_v)
    for start in range(0, len(t), QUERY_BLOCK):  # each query is answered alone: blocks change nothing
        part = slice(start, start + QUERY_BLOCK)
        out[part] = _interp_block(group[part], t[part], points, low, width)
    return out


def _interp_block(group: np.ndarray, t: np.ndarray, points: tuple, low: float, width: float) -> np.ndarray:
    """group_interp of one block of queries; `points`: (keys, counts per group, group, t, value)."""
    import numpy as np

    keys, counts, point_group, point_t, point_v = points
    out = np.full(len(t), np.nan)
    query = _keys(group.astype(float), t, low, width)
    hi = np.searchsorted(keys, query, side="right")
    lo = hi - 1
    n = len(keys)
    ok_lo = (lo >= 0) & (point_group[np.clip(lo, 0, n - 1)] == group)
    ok_hi = (hi < n) & (point_group[np.clip(hi, 0, n - 1)] == group)
    enough = counts[group] >= 2
    lo_c, hi_c = np.clip(lo, 0, n - 1), np.clip(hi, 0, n - 1)
    inside = ok_lo & ok_hi & enough
    span = point_t[hi_c] - point_t[lo_c]
    with np.errstate(divide="ignore", invalid="ignore"):  # np.interp's own formula, term for term
        slope = np.where(span > 0, (point_v[hi_c] - point_v[lo_c]) / span, 0.0)
    out[inside] = (slope * (t - point_t[lo_c]) + point_v[lo_c])[inside]
    # exactly on the group's last point: np.interp gives its value (side="right" stepped past it)
    at_end = ok_lo & ~ok_hi & enough & (point_t[lo_c] == t)
    out[at_end] = point_v[lo_c][at_end]
    return out


def group_last_before(
    group: np.ndarray, t: np.ndarray, point_group: np.ndarray, point_t: np.ndarray
) -> np.ndarray:
    """Index of each query's group's last point at or before its time (bisect_right − 1), or −1."""
    import numpy as np

    if not len(t) or not len(point_t):
        return np.full(len(t), -1)
    low = float(min(np.min(t), np.min(point_t)))
    width = float(max(np.max(t), np.max(point_t)) - low) + 1.0
    keys = _keys(point_group.astype(float), point_t, low, width)
    out = np.empty(len(t), dtype=np.int64)
    for start in range(0, len(t), QUERY_BLOCK):
        part = slice(start, start + QUERY_BLOCK)
        lo = np.searchsorted(keys, _keys(group[part].astype(float), t[part], low, width), side="right") - 1
        ok = (lo >= 0) & (point_group[np.clip(lo, 0, len(keys) - 1)] == group[part])
        out[part] = np.where(ok, lo, -1)
    return out
