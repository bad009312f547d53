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

from ciuic_doctor.importers import StepLog
from ciuic_doctor.importers.ours import to_steplog
from ciuic_doctor.store import RunDir

MIN_FILES = 16
# the watch probe's fields ours.load reads (its own WANTED also has fields only imported logs carry)
WANTED = ("rank", "step", "t", "loss", "lr", "grad_norm", "loss_scale", "skipped", "clip_max_norm",
          "loss_scale_next", "optimizer")  # fmt: skip


def load(path: Path) -> StepLog:
    """The run directory's steps (every file, shared first, then per rank) as ours.load returns them."""
    import pyarrow.compute as pc

    from ciuic_doctor.frames import read_stream

    read = read_stream(RunDir(path), "steps", WANTED)
    loss = read.table["loss"]
    # the store writes a non-finite loss as "nan"/"inf"; frames reads those back as float NaN/inf (not null)
    nonfinite = pc.and_(pc.is_valid(loss), pc.invert(pc.is_finite(loss))).fill_null(False)
    raw = read.frame()  # a block per column: no 2-D copy of every float column (1.2 GB at 10,000 ranks)
    raw["nonfinite"] = nonfinite.to_numpy(zero_copy_only=False).astype("int64")
    raw["skipped"] = raw["skipped"].astype("boolean").fillna(False).astype("int64")
    return to_steplog(
        raw,
        # an off-schema record is dropped by the reader (and counted there), as an unparsable line is
        read_lines=read.rows + read.dropped_lines + read.invalid_records,
        unread_lines=read.dropped_lines + read.invalid_records,
        meta_dir=path,
        name=path.name,
    )
