"""Writing a big stream file's part (`file_parts`, whose docstring has the why and the layout): the
report's own read of that one file, with its counts and the file's [name, size, mtime_ns], as Arrow IPC.

Watch calls `write_at_exit` for a rank's steps file when the rank ends, memwatch for its file when it
stops; `benchmarks/report_scale.py` calls `write` for every file of a generated run.

>>> import pathlib, tempfile
>>> run = pathlib.Path(tempfile.mkdtemp())
>>> steps = run / "steps.rank0.jsonl"
>>> _ = steps.write_text('{"schema":1,"t":1.5,"host":"n1","rank":0,"step":1,"step_time_s":0.2}\\n')
>>> write(steps).relative_to(run).as_posix()
'columnar/_files/steps.rank0.jsonl.arrow'
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ciuic_doctor.rundir.frames.file_parts import FILES, FORMAT, KEY, part_path, source_of

MAX_SOURCE_BYTES = 8 << 30  # a JSONL file past this is left to the report (its part: ~2 GB in memory)
# at a probe's exit, a file past this is left to the report too: parsing it would hold the job's end for
# over ~2.5 s (pyarrow parses these records at ~110 MB/s a core). A rank's 1,000 steps are 0.5 MB, a
# node's memwatch samples ~330 MB a day of 8 ranks and an agent.
EXIT_MAX_BYTES = 256 << 20


def write(jsonl: Path, stream: str | None = None) -> Path | None:
    """Write `jsonl`'s part; its path, or None when the stream has no columnar copy or the file changed
    while it was read (its part would be stale at once). OSError (`safe_io.Unsafe`) when the part cannot
    be written where it belongs (a symlink or a file planted on the way)."""
    import pyarrow as pa

    from ciuic_doctor.rundir import safe_io
    from ciuic_doctor.rundir.columnar.layout import ROOT_NAME
    from ciuic_doctor.rundir.frames import STREAM_COLUMNS, file_parts, read_table
    from ciuic_doctor.rundir.schemas import stream_of

    jsonl = Path(jsonl)
    stream = stream or stream_of(jsonl.name)
    before = source_of(jsonl)
    if stream not in STREAM_COLUMNS or before is None or before[1] > MAX_SOURCE_BYTES:
        return None
    # the JSONL itself, not a part written before: and no listing of columnar/_files, which holds
    # every other file's part (100,000 ranks: one listing a write made writing them all quadratic)
    read = read_table([jsonl], STREAM_COLUMNS[stream], stream, use_parts=False)
    if source_of(jsonl) != before:
        return None
    meta = {
        "format": FORMAT,
        "stream": stream,
        "source": before,
        "rows": read.rows,
        "dropped_lines": read.dropped_lines,
        "nulled_values": read.nulled_values,
        "invalid_reasons": read.invalid_reasons,
    }
    table = read.table.replace_schema_metadata({KEY: json.dumps(meta).encode()})
    safe_io.make_dir(jsonl.parent, ROOT_NAME)
    safe_io.make_dir(jsonl.parent / ROOT_NAME, FILES)
    target = part_path(jsonl)
    with safe_io.atomic_file(target) as (fh, _), pa.ipc.new_file(fh, table.schema) as writer:
        writer.write_table(table, max_chunksize=file_parts.BATCH_ROWS)
    return target


def write_at_exit(jsonl: Path, stream: str, *, copies: int) -> Path | None:
    """`write`, for a probe ending: only when `copies` files of this one's size reach the bytes from which
    a stream gets a columnar copy (a world of ranks, or of nodes) and the file is at most EXIT_MAX_BYTES,
    and never raising: a part is a speed-up for the report, and the job's end must not depend on it."""
    from ciuic_doctor.rundir.frames.copies import copy_min_bytes

    with contextlib.suppress(Exception):
        threshold, source = copy_min_bytes(), source_of(jsonl)
        if threshold < 0 or source is None or source[1] > EXIT_MAX_BYTES:
            return None
        if source[1] * max(copies, 1) >= threshold:
            return write(jsonl, stream)
    return None
