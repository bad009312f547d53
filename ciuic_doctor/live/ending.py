"""What the exporter says about a job beyond its ranks' figures: the `job` label, and how the job ended.

The label names the job for `sum by (job)`: `--job` where given, else the run directory the exporter was
pointed at (`watch --metrics-port` passes its own), else torchrun's run id unless it is the placeholder
"none" (torchrun without --rdzv-id gives every job that id, so jobs would share one series), else the run
directory the ranks write, else the script and the PID (`train.py-12345`): never "none".

The end: a rank killed with -9 takes its torchrun job down within a second (the agent stops the other
ranks), so an exporter that left with the job would never be scraped with `ciuic_rank_up 0` and no
`for:` clause could fire. After the job ends the exporter samples once more (every rank reads down) and
serves that final state for LINGER_S: the shipped CiuicRankDown (`for: 30s`) fires with a scrape and an
evaluation every 15 s (30 + 2 x 15 + 15 = 75 s; 120 s leaves room). A job that ended well is told apart by
`ciuic_job_finished 1`: meta.json's watch record says `finished` (only a watched run records it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ciuic_doctor.live.discover import JobLayout

LINGER_S = 120.0
META_MAX_BYTES = 16 << 20
PLACEHOLDER_RUN_ID = "none"  # torchrun's --rdzv-id default

T = TypeVar("T")


def job_label(*, given: str | None, run_arg: str | None, layout: JobLayout, pid: int) -> str:
    """The `job` label (module docstring), never empty and never torchrun's placeholder."""
    if given:
        return given
    if run_arg:
        return Path(run_arg).resolve().name or "run"
    if layout.run_id and layout.run_id != PLACEHOLDER_RUN_ID:
        return layout.run_id
    if layout.run_dir is not None and layout.run_dir.resolve().name:
        return layout.run_dir.resolve().name
    script = os.path.basename(layout.script or "") or "job"
    return f"{script.replace(' ', '-')}-{pid}"


def finished(run_dir: Path | None) -> bool:
    """True when the watched run's meta.json records a clean end (status `finished`)."""
    if run_dir is None:
        return False
    from ciuic_doctor.rundir.safe_io import read_json
    from ciuic_doctor.rundir.watch_end import watch_record

    with contextlib.suppress(OSError, ValueError):
        meta = read_json(run_dir / "meta.json", max_bytes=META_MAX_BYTES)
        record = watch_record(meta) if isinstance(meta, dict) else None
        return record is not None and record.get("status") == "finished"
    return False


def bind_retrying(start: Callable[[], T], *, wait_s: float, every_s: float = 1.0) -> T:
    """`start()`, retried while its port is in use, for up to `wait_s`: the exporter of the job before
    (same port, same node) may still be serving its final state."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return start()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
        time.sleep(every_s)
