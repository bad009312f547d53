"""Our steps stream of a many-rank run directory, read column-wise (frames.read_stream), for the stability
analysis: the same StepLog `ours.load` gives, without its per-file set-up.

`ours.load` reads one file at ~1.5 µs a line but pays ~15–40 ms of set-up per file (chunking, a layout
probe, a pandas parse per chunk); a 1,024-rank run has 1,024 files, which made that set-up alone
15–45 s of a report on 2 shared cores. pyarrow reads all files in parallel in one pass, and the report's
other readers (steps, memory, the report itself) take their columns from the same cached table.
`stability.analyze` uses this path from MIN_FILES step files on; fewer files keep `ours.load`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ciuic_doctor.importers import StepLog
from ciuic_doctor.importers.ours import to_steplog
from ciuic_doctor.rundir.store import RunDir

if TYPE_CHECKING:
    import pyarrow

MIN_FILES = 16
# the watch probe's fields ours.load reads (its own WANTED also has fields only imported logs carry)
WANTED = ("rank", "step", "t", "loss", "lr", "grad_norm", "loss_scale", "skipped", "clip_max_norm",
          "loss_scale_next", "optimizer")  # fmt: skip


def load(path: Path) -> StepLog:
    """The run directory's steps (every file, shared first, then per rank) as ours.load returns them."""
    from ciuic_doctor.rundir.frames import read_stream

    read = read_stream(RunDir(path), "steps", WANTED)
    return to_steplog(
        _Columns(read.table),
        # an off-schema record is dropped by the reader (and counted there), as an unparsable line is
        read_lines=read.rows + read.dropped_lines + read.invalid_records,
        unread_lines=read.dropped_lines + read.invalid_records,
        meta_dir=path,
        name=path.name,
    )


class _Columns:
    """The cached table's columns as `to_steplog` reads them (`get`), each turned into numpy when it is
    read: a column without nulls is a read-only view of the table (no copy; no pandas frame of the whole
    table either), a column of nulls only is None (to_steplog reads it as an absent one: it is), skipped
    and the non-finite losses are 0/1 int64 (None when there is none). At 10,000 ranks × 1,000 steps a
    column is 80 MB: what the table does not keep is let go by its reader."""

    def __init__(self, table: pyarrow.Table) -> None:
        self.table = table

    def get(self, name: str, default: Any = None) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        from ciuic_doctor.rundir.frames import float_values

        if name == "nonfinite":  # the store writes a non-finite loss as "nan"/"inf": read back as NaN/inf
            loss = self._column("loss")
            if loss is None:
                return default
            return _flags(pc.and_(pc.is_valid(loss), pc.invert(pc.is_finite(loss))).fill_null(False))
        column = self._column(name)
        if column is None:
            return default
        if pa.types.is_boolean(column.type):
            return _flags(pc.fill_null(column, False))
        if pa.types.is_integer(column.type) and not column.null_count:
            return column.to_numpy()
        return float_values(column)  # (an int column with nulls: float64, NaN for null, as pandas reads it)

    def _column(self, name: str) -> pyarrow.ChunkedArray | None:
        if name not in self.table.column_names:
            return None
        column = self.table.column(name)
        return None if len(column) and column.null_count == len(column) else column


def _flags(column: pyarrow.ChunkedArray) -> Any:  # bool, no nulls -> int64 0/1 numpy | None (all 0)
    import numpy as np
    import pyarrow.compute as pc

    if not pc.any(column).as_py():
        return None
    return column.to_numpy(zero_copy_only=False).astype(np.int64)
