"""What a columnar read of a stream found: the table, and what the reader dropped or nulled on the way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ciuic_doctor.rundir.frames.assemble import plain_strings
from ciuic_doctor.rundir.store import StreamRead

if TYPE_CHECKING:
    import numpy as np
    import pandas
    import pyarrow


@dataclass(kw_only=True)
class TableRead:
    """What a columnar read found: the table, and what it had to drop (lines) or null (values)."""

    table: pyarrow.Table
    files: list[Path] = field(default_factory=list)
    dropped_lines: int = 0
    nulled_values: dict[str, int] = field(default_factory=dict)
    invalid_records: int = 0
    invalid_reasons: dict[str, int] = field(default_factory=dict)
    parquet_files: int = 0
    part_files: int = 0  # files read from the part their writer left at its exit (`frames.file_parts`)
    copy_id: str | None = None  # the columnar copy read or written (`rundir.columnar`), for block readers
    # None: the rows are in the stream's order. Else each row's place in the stream: a columnar copy of a
    # stream whose ranks interleave, read as its parts hold them (`read_stream(..., any_order=True)`)
    stream_rows: np.ndarray | None = None

    def frame(self) -> pandas.DataFrame:
        """The table as pandas (numpy-backed columns; null ints become float NaN), one block per column:
        pandas' default consolidation stacks every float column into one new 2-D block (a second copy of
        them all at its peak; 1.2 GB for the report's steps columns at 10,000 ranks), and a column without
        nulls stays a view of the table instead of a copy."""
        return self.table.to_pandas(split_blocks=True)

    @property
    def rows(self) -> int:
        return self.table.num_rows

    def select(self, columns: Sequence[str], *, encoded: bool = False) -> TableRead:
        """The same read, `columns` only (counts kept: they describe the files, not the columns), with
        plain strings where the cached table keeps a column dictionary-encoded (`frames.assemble`), or
        with the codes as they are (`encoded`: for a reader that looks up a few values, such as a rank's
        host; the plain copy of a host column is 120 MB at 10,000 ranks × 1,000 steps)."""
        table = self.table.select(list(dict.fromkeys(columns)))
        return TableRead(
            table=table if encoded else plain_strings(table),
            files=self.files,
            dropped_lines=self.dropped_lines,
            nulled_values=self.nulled_values,
            invalid_records=self.invalid_records,
            invalid_reasons=self.invalid_reasons,
            parquet_files=self.parquet_files,
            part_files=self.part_files,
            copy_id=self.copy_id,
            stream_rows=self.stream_rows,
        )

    def in_stream_order(self) -> TableRead:
        """The same read with its rows in the stream's order (itself when they are).

        >>> import numpy as np, pyarrow as pa
        >>> read = TableRead(table=pa.table({"t": [3.0, 1.0, 2.0]}), stream_rows=np.array([2, 0, 1]))
        >>> read.in_stream_order().table["t"].to_pylist()
        [1.0, 2.0, 3.0]
        """
        import pyarrow as pa

        from ciuic_doctor.rundir.columnar.read import _inverse

        if self.stream_rows is None:
            return self
        taken = self.table.take(pa.array(_inverse(self.stream_rows, len(self.stream_rows))))
        table = pa.table({name: taken[name].combine_chunks() for name in taken.column_names})
        return replace(self, table=table, stream_rows=None)

    def problems(self) -> str | None:
        """What was skipped, in the row reader's words (`StreamRead.problems`); None when nothing was."""
        return StreamRead(
            skipped_lines=self.dropped_lines,
            invalid_records=self.invalid_records,
            invalid_reasons=self.invalid_reasons,
        ).problems()
