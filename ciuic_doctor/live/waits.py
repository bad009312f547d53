"""The collectives the watched ranks are waiting in: the hang watchdog's RUN/hang.rank<R>.wait.json
records (probes/watch/hang/waits.py), read at every update of the live view, and who they wait for.

A rank stuck outside a collective (a forward that never returns, a deadlock in its data loading) leaves
its peers blocked in the next collective: they are in it, it is not. Once the peers have waited
WAIT_STEPS median steps (and WAIT_MIN_S), a rank that is not in the collective, has made no step since
they began to wait, and is idle (below BUSY_CPU_PERCENT of a CPU and not in a disk wait) is the culprit:
`stalled`, its peers `waiting` in that collective. A busy rank (a rank-0 evaluation or checkpoint save
the others wait for at a barrier) is left to the 30 s stall rule, so that work is not called a hang in
seconds; an evaluation on every rank puts no rank in a collective and is never judged here.

A record is data another process wrote: read without following a symlink, at most MAX_BYTES, and kept
only when its fields have the types they should; the op name is cut to MAX_OP characters (it is shown
in a terminal and served as a label, each escaped there).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ciuic_doctor.rundir.safe_io import read_json

WAIT_FILE = re.compile(r"^hang\.rank(\d{1,9})\.wait\.json$")
MAX_BYTES = 4096
MAX_OP = 64
WAIT_STEPS = 10.0  # the peers waited 10 median steps...
WAIT_MIN_S = 5.0  # ...and 5 s: 5x a 1 s collective under load on a shared 2-core machine
BUSY_CPU_PERCENT = 30.0  # a rank sleeping or blocked uses ~0 %; a rank computing, ~100 % of one CPU


@dataclass(frozen=True, kw_only=True)
class Wait:
    rank: int
    pid: int
    t_since: float  # unix time the collective was enqueued
    op: str


def read_waits(run_dirs: set[Path]) -> dict[int, Wait]:
    """rank -> its wait record, over the run directories the ranks write to."""
    out: dict[int, Wait] = {}
    for run_dir in sorted(run_dirs):
        try:
            names = os.listdir(run_dir)
        except OSError:
            continue
        for name in names:
            match = WAIT_FILE.match(name)
            if match is None:
                continue
            wait = _parse(read_json(run_dir / name, max_bytes=MAX_BYTES, root=run_dir), int(match.group(1)))
            if wait is not None:
                out[wait.rank] = wait
    return out


def _parse(data: object, rank: int) -> Wait | None:
    if not isinstance(data, dict) or data.get("rank") != rank:
        return None
    pid, since, op = data.get("pid"), data.get("t_since"), data.get("op")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(op, str):
        return None
    if not isinstance(since, (int, float)) or isinstance(since, bool) or not math.isfinite(since):
        return None
    return Wait(rank=rank, pid=pid, t_since=float(since), op=op[:MAX_OP])


def culprits(
    waits: dict[int, Wait], samples: dict, figures: dict[int, dict], typical_step_s: float, now: float
) -> dict[int, tuple[str, str]]:
    """rank -> ("stalled" | "waiting", why), from the ranks' wait records (module docstring); {} when no
    rank has waited long enough or no idle rank explains the wait."""
    live = {r: w for r, w in waits.items() if r in samples and samples[r].up and samples[r].pid == w.pid}
    if not live or len(live) == len(samples):
        return {}
    waited = now - min(w.t_since for w in live.values())
    if waited < max(WAIT_STEPS * typical_step_s, WAIT_MIN_S):
        return {}
    slack = 1.0 + typical_step_s  # a step record written just after the wait began
    held: list[int] = []
    for rank, sample in samples.items():
        age = figures.get(rank, {}).get("since_last_step_s")
        if rank in live or not sample.up or age is None or age < waited - slack:
            continue
        busy = (sample.cpu_percent or 0.0) >= BUSY_CPU_PERCENT or sample.state == "disk wait"
        if not busy:
            held.append(rank)
    if not held:
        return {}
    op = max(live.values(), key=lambda w: now - w.t_since).op
    waiters = ", ".join(str(r) for r in sorted(live))
    out = {
        r: ("stalled", f"not in the {op} its peers (rank {waiters}) wait in for {waited:.0f} s; idle, "
            f"no step for {figures[r]['since_last_step_s']:.0f} s")
        for r in held
    }  # fmt: skip
    culprit = ", ".join(str(r) for r in held)
    for rank, wait in live.items():
        out[rank] = ("waiting", f"in {wait.op} for {now - wait.t_since:.0f} s, waiting on rank {culprit}")
    return out
