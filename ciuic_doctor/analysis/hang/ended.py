"""The hang findings of a run that finished (exit 0): whatever its ranks dumped while it ran, it did not hang.

A watchdog dump of a run that went on to finish is a pause (an evaluation, a checkpoint save, a slow data
preparation: the watchdog dumps once when no optimizer step came for its hang-after seconds) or a dump
someone asked for (SIGUSR1). `hang RUN` says that first, with where each rank was when it dumped.
"""

from __future__ import annotations

from typing import Any

from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.hang.files import HangFiles

Position = Any  # analysis.hang.Position (not imported: hang imports this module)

PROBE = "hang"


def finished_run(files: HangFiles, pos: dict[int, Position]) -> list[Finding]:
    dumped = [p for p in pos.values() if p.source != "none"]
    said = []
    for p in dumped:
        dump = files.dumps.get(p.rank) or {}
        pause = dump.get("stalled_s")
        what = (
            f"paused {pause:.0f} s without an optimizer step" if isinstance(pause, int | float) else "dumped"
        )
        said.append(f"rank {p.rank} {what} when it dumped ({p.reason or 'no reason'}), at {p.frame or '?'}")
    summary = "no hang: the run finished (exit 0)"
    if said:
        summary += "; dumps taken while it ran: " + "; ".join(said[:4]) + (" ..." if len(said) > 4 else "")
    rows: list[dict[str, Any]] = [
        {
            "rank": p.rank,
            "host": p.host,
            "source": p.source,
            "state": p.state,
            "reason": p.reason,
            "frame": p.frame,
            "in_collective": None,
            "op": None,
            "seq": None,
        }
        for p in pos.values()
    ]
    return [
        Finding(
            probe=PROBE,
            check="hang",
            verdict="pass",
            summary=summary,
            evidence={"kind": "none", "run_status": "finished", "ranks": rows, "problems": files.problems},
        )
    ]
