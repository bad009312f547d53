"""Where `report`'s time and memory go, stage by stage, in one process: each analysis (with the stream
reads it triggers), and with --memory-parts the memory analysis cut into its reads and checks.

For each stage: resident memory before it, its peak (sampled every 20 ms by a thread) and the rise over
`before`, resident after it, wall and CPU seconds. The peak of a `report` is the highest `peak` here plus
the page (`benchmarks/report_scale.py` measures the whole command). Use a run kept by report_scale:

    .venv/bin/python benchmarks/report_scale.py --sizes 10000x1000 --root /tmp/rs --keep
    .venv/bin/python benchmarks/analysis_stages.py /tmp/rs/r10000x1000
    .venv/bin/python benchmarks/analysis_stages.py /tmp/rs/r10000x1000 --memory-parts

Issue 25's figures at 10,000 ranks × 1,000 steps were taken this way (reads ~2.7 GB of cached tables,
the memory checks +0.3 GB over them).
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIB = 2**20


class Sampler:
    """The process's peak resident memory since `reset`, sampled every 20 ms."""

    def __init__(self) -> None:
        import psutil

        self.process = psutil.Process()
        self.peak = 0
        threading.Thread(target=self._run, daemon=True).start()

    def rss(self) -> int:
        return self.process.memory_info().rss

    def reset(self) -> int:
        self.peak = now = self.rss()
        return now

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.02)


def stage(sampler: Sampler, name: str, work: Callable[[], Any]) -> Any:
    before = sampler.reset()
    wall, cpu = time.perf_counter(), time.process_time()
    result = work()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after, peak = sampler.rss(), max(sampler.peak, sampler.rss())
    print(
        f"{name:16s} {before / MIB:8.0f} {peak / MIB:8.0f} {(peak - before) / MIB:+8.0f} {after / MIB:8.0f} "
        f"{wall:8.1f} {cpu:8.1f}",
        flush=True,
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", type=Path, help="a run directory (e.g. one kept by report_scale.py --keep)")
    parser.add_argument(
        "--memory-parts", action="store_true", help="the memory analysis as its reads and its checks"
    )
    args = parser.parse_args()
    if not (args.run / "meta.json").is_file() and not any(args.run.glob("*.jsonl")):
        print(f"analysis_stages: {args.run} is not a run directory", file=sys.stderr)
        return 2

    from ciuic_doctor import analysis
    from ciuic_doctor.rundir.store import RunDir

    run = RunDir.open(args.run)
    run.read_meta()
    sampler = Sampler()
    print(
        f"{'stage':16s} {'before':>8} {'peak':>8} {'rise':>8} {'after':>8} {'wall s':>8} {'CPU s':>8}  (MiB)"
    )
    if args.memory_parts:
        from ciuic_doctor.analysis.memory import cuda as _memory_cuda
        from ciuic_doctor.analysis.memory import data as _memory_data
        from ciuic_doctor.analysis.memory import leaks as _memory_leaks
        from ciuic_doctor.analysis.memory import workers as _memory_workers
        from ciuic_doctor.analysis.memory.columns import MemwatchColumns
        from ciuic_doctor.analysis.memory.steps import StepColumns
        from ciuic_doctor.rundir.frames import read_stream

        if run.has_stream("memwatch"):
            stage(sampler, "read memwatch", lambda: read_stream(run, "memwatch", MemwatchColumns.COLUMNS))
        if run.has_stream("steps"):
            stage(sampler, "read steps", lambda: read_stream(run, "steps", StepColumns.COLUMNS))
        data = stage(sampler, "memory: _Data", lambda: _memory_data._Data(run))
        stage(sampler, "memory: leaks", lambda: _memory_leaks.leak_findings(data))
        stage(sampler, "memory: cuda", lambda: _memory_cuda.cuda_findings(data))
        stage(sampler, "memory: workers", lambda: _memory_workers.worker_findings(data))
    else:
        for module in analysis.analysis_modules():
            if any(run.has_stream(s) for s in module.STREAMS):
                stage(sampler, module.__name__.rsplit(".", 1)[-1], lambda module=module: module.analyze(run))
    print(f"max resident {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
