"""The hang watchdog's settings: when no progress counts as a hang, and Flight Recorder's buffer.

A stall is HANG_STEP_MULTIPLE median steps without progress, at least HANG_FLOOR_S, and at most
PG_TIMEOUT_FRACTION of the process-group timeout, so the dump happens while every rank still waits.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

FR_BUFFER_DEFAULT = 2000  # entries per rank; torch 2.13 defaults to 2000 too (measured), older ones to 0
HANG_STEP_MULTIPLE = 20  # a stall is this many median steps without progress ...
HANG_FLOOR_S = 30.0  # ... but never less: a checkpoint save or an eval pass is not a hang
PG_TIMEOUT_FRACTION = 0.8  # ... and never above the process-group timeout: dump while every rank still waits
DEFAULT_PG_TIMEOUT_S = 1800.0  # torch.distributed.constants.default_pg_timeout (gloo; NCCL's is 600 s)
POLL_S = 0.5
PEER_SETTLE_S = 0.5


@dataclass(kw_only=True)
class HangConfig:
    hang_after_s: float | None = None  # None: HANG_STEP_MULTIPLE x the run's median step, see above
    fr_buffer: int = FR_BUFFER_DEFAULT
    poll_s: float = POLL_S


def arm_flight_recorder(buffer: int = FR_BUFFER_DEFAULT) -> None:
    """Turn Flight Recorder on for the process groups this process creates from now on.

    torch reads TORCH_FR_BUFFER_SIZE when a process group is created, so this must run before the
    script's init_process_group; a value the user exported already wins.
    """
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(buffer))


def default_hang_after(*, step_times_s: list[float], pg_timeout_s: float | None) -> float:
    """Seconds without progress that count as a hang: 20 median steps, at least 30 s, at most 0.8 x the
    process-group timeout (the cap wins over the floor: with a 10 s timeout, a hang is 8 s)."""
    cap = PG_TIMEOUT_FRACTION * (pg_timeout_s or DEFAULT_PG_TIMEOUT_S)
    if not step_times_s:
        return cap
    return min(cap, max(HANG_FLOOR_S, HANG_STEP_MULTIPLE * statistics.median(step_times_s)))
