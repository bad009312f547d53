"""What the hang watchdog adds to a training process, measured side by side in one run.

    .venv/bin/python benchmarks/hang_watch_cost.py

1. Per Python collective: the last-collective record (one pwrite) around dist.all_reduce, on a gloo group
   of one rank, in alternating blocks of calls with the wrapper on and off (so machine load falls on both).
2. Per poll: Flight Recorder's group status (`_dump_fr_trace` without entries), which the watchdog thread
   reads every 0.5 s, and that as a share of one core.
3. Per dump: the whole hang dump (stacks + Flight Recorder with 2000 entries and their stack traces).

Watch's overhead goal is <= 1 % of a step; a step issues a few Python collectives (DDP's buckets are C++
and are not wrapped), so (1) times those calls divided by the step time is the ratio to compare.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    import torch
    import torch.distributed as dist

    from ciuic_doctor.probes.watch.hang import HangConfig, HangWatchdog, fr_status
    from ciuic_doctor.rundir.store import RunDir

    scratch = Path(tempfile.mkdtemp())
    dist.init_process_group("gloo", init_method=f"file://{scratch / 'store'}", rank=0, world_size=1)
    run = RunDir.create(scratch / "run")
    tensor = torch.ones(1024)
    raw = dist.all_reduce
    watchdog = HangWatchdog(run=run, rank=0, config=HangConfig(hang_after_s=3600))
    watchdog._install_last_collective()
    wrapped = dist.all_reduce
    per_call: dict[str, list[float]] = {"off": [], "on": []}
    for round_no in range(20):
        for name in ("off", "on") if round_no % 2 == 0 else ("on", "off"):
            call = raw if name == "off" else wrapped
            t0 = time.perf_counter()
            for _ in range(200):
                call(tensor)
            per_call[name].append((time.perf_counter() - t0) / 200)
    off, on = statistics.median(per_call["off"]), statistics.median(per_call["on"])
    print(f"all_reduce of 4 KiB on 1 gloo rank: {off * 1e6:.1f} us plain, {on * 1e6:.1f} us with the record")
    print(
        f"  the record costs {max(0.0, on - off) * 1e6:.1f} us per Python collective (ratio {on / off:.3f})"
    )

    polls = []
    for _ in range(50):
        t0 = time.perf_counter()
        fr_status()
        polls.append(time.perf_counter() - t0)
    poll = statistics.median(polls)
    print(f"status poll: {poll * 1e6:.0f} us every 0.5 s = {poll / 0.5 * 100:.3f} % of one core")

    t0 = time.perf_counter()
    watchdog.dump("requested")
    print(f"one hang dump (2000 Flight Recorder entries with stack traces): {time.perf_counter() - t0:.2f} s")
    watchdog.stop()
    dist.destroy_process_group()
    sys.stderr.flush()


if __name__ == "__main__":
    main()
