"""Compact a finished run's JSONL streams into Parquet, losslessly, for fast reading of large runs.

Each RUN/<stream>[.rank<R>].jsonl gets a <same name>.parquet beside it. The JSONL files stay (they are
what every probe appends to); the analyses and the report read the Parquet copy instead while the JSONL
file is unchanged, and the JSONL again as soon as it grows. Every copy is read back and compared with
the JSONL's records before it is kept, so a copy never differs from its source.

It also writes the columnar copy of the steps and memwatch streams (RUN/columnar/, a Parquet dataset
partitioned by rank block: ciuic_doctor/rundir/columnar/README.md) that a report otherwise writes the
first time it reads a big run, so that even the first report parses no JSON.

Examples:
    ciuic-doctor compact reports/big-run
    ciuic-doctor compact reports/big-run --stream steps      # only the steps stream
"""

from __future__ import annotations

import argparse
import signal
import sys

NAME = "compact"
HELP = "write a lossless Parquet copy beside each JSONL stream of a finished run (faster reports)"
ORDER = 75


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="a run directory")
    parser.add_argument(
        "--stream", action="append", metavar="NAME", help="only this stream (repeatable; default: all)"
    )
    parser.add_argument("--quiet", action="store_true", help="print the totals only")


def run(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from ciuic_doctor.errors import UserError
    from ciuic_doctor.rundir import safe_io
    from ciuic_doctor.rundir.parquet_store import compact_file, fresh_parquet
    from ciuic_doctor.rundir.store import RunDir

    run_dir = RunDir.open(args.run)
    found = sorted(run_dir.path.glob("*.jsonl"))
    files = [f for f in found if safe_io.is_regular(f)]  # a symlink, FIFO or device is not compacted
    irregular = [
        f"{f.name}: {safe_io.irregular_reason(f)}, not a regular file" for f in found if f not in files
    ]
    if args.stream:
        files = [f for f in files if f.name.split(".", 1)[0] in set(args.stream)]
        if not files:
            raise UserError(f"{run_dir.path}: no JSONL files of stream(s) {', '.join(args.stream)}")
    todo = [f for f in files if fresh_parquet(f) is None]
    failed: list[str] = []

    def one(path):
        try:
            return compact_file(path)
        except (ValueError, OSError) as exc:  # a file we cannot copy losslessly stays JSONL only
            failed.append(f"{path.name}: {exc}")
            return None

    def stop(signum: int, frame: object) -> None:
        # SIGTERM: leaving the pool lets the files being written finish (each renamed into place or
        # removed: no .tmp stays), then the exit is 143
        from ciuic_doctor.launch import Interrupted

        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, stop)
    pool = ThreadPoolExecutor(max_workers=4)
    try:
        results = [r for r in pool.map(one, todo) if r is not None]
    finally:  # on SIGTERM or Ctrl-C the files not started are not started: the exit comes promptly
        pool.shutdown(wait=True, cancel_futures=True)
    if not args.quiet:
        for r in results[:20]:
            print(
                f"  {r.jsonl.name}: {r.records} records, {r.jsonl_bytes / 2**20:.1f} -> "
                f"{r.parquet_bytes / 2**20:.1f} MiB"
            )
        if len(results) > 20:
            print(f"  ... and {len(results) - 20} more files")
    before = sum(r.jsonl_bytes for r in results)
    after = sum(r.parquet_bytes for r in results)
    print(
        f"compacted {len(results)} file(s) ({len(files) - len(todo)} already up to date): "
        f"{before / 2**20:.1f} MiB of JSONL -> {after / 2**20:.1f} MiB of Parquet, "
        f"{sum(r.records for r in results)} records, "
        f"{sum(r.skipped_lines for r in results)} torn line(s) skipped"
    )
    failed.extend(_columnar_copies(run_dir, args))
    for line in irregular + failed:
        print(f"ciuic-doctor compact: not compacted: {line}", file=sys.stderr)
    return 1 if failed else 0


def _columnar_copies(run_dir, args: argparse.Namespace) -> list[str]:
    """The run's columnar copy of each big stream selected; what could not be written, one line each."""
    from ciuic_doctor.rundir.frames import STREAM_COLUMNS, columnar_copy

    problems = []
    for stream in STREAM_COLUMNS:
        if (args.stream and stream not in args.stream) or not run_dir.has_stream(stream):
            continue
        read = columnar_copy(run_dir, stream)
        if read.copy_id is None:
            problems.extend(run_dir.notes)
            run_dir.notes.clear()
        elif not args.quiet:
            print(f"  columnar/{stream}: {read.rows} records")
    return problems
