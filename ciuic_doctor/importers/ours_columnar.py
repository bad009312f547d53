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

from ciuic_doctor.importers import StepLog, intervals, normalize
from ciuic_doctor.importers.ours import _apply_meta
from ciuic_doctor.store import RunDir

MIN_FILES = 16
# the watch probe's fields ours.load reads (its own WANTED may grow with fields only imported logs carry)
WANTED = ("rank", "step", "t", "loss", "lr", "grad_norm", "loss_scale", "skipped", "clip_max_norm")


def load(path: Path) -> StepLog:
    """The run directory's steps (every file, shared first, then per rank) as ours.load returns them."""
    import pandas as pd
    import pyarrow.compute as pc

    from ciuic_doctor.frames import read_stream

    read = read_stream(RunDir(path), "steps", WANTED)
    loss = read.table["loss"]
    # the store writes a non-finite loss as "nan"/"inf"; frames reads those back as float NaN/inf (not null)
    nonfinite = pc.and_(pc.is_valid(loss), pc.invert(pc.is_finite(loss))).fill_null(False)
    raw = read.table.to_pandas()
    raw["nonfinite"] = nonfinite.to_numpy(zero_copy_only=False).astype("int64")
    raw["skipped"] = raw["skipped"].astype("boolean").fillna(False).astype("int64")
    table = normalize(
        {
            **{k: raw[k] for k in WANTED if k != "clip_max_norm"},
            "nonfinite": raw["nonfinite"],
            "interval_steps": intervals(raw["step"], raw["rank"]),
        },
        source=f"ours:{path.name}",
    )
    log = StepLog(
        table=table,
        read_lines=read.rows + read.dropped_lines,
        unread_lines=read.dropped_lines,
        framework="gradscaler",
    )
    clips = pd.to_numeric(raw["clip_max_norm"], errors="coerce").dropna()
    if len(clips):  # the watch probe records the max_norm a script passed to clip_grad_norm_
        log.clip_max_norm = float(clips.iloc[-1])
    _apply_meta(log, path)
    if table["loss_scale"].notna().any() and log.precision is None:
        log.precision = "fp16"  # only torch.amp.GradScaler gives a scale
    return log
