"""Which engine reads a large run's JSONL streams fastest: pyarrow's JSON reader, Polars, DuckDB, or the
store's row reader (json.loads per line) — side by side, in one run, on the same generated files.

Each engine reads the seven columns the step analysis needs from every `steps.rank<R>.jsonl` of an
N-rank × S-step run (tests/scalesynth.py) and the wall time, CPU time and rows are printed, with each
engine's ratio to the fastest. Engines that are not installed are skipped.

    .venv/bin/python benchmarks/columnar_readers.py --ranks 256 --steps 2000
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

COLUMNS = ("rank", "step", "t", "host", "step_time_s", "pre_backward_s", "rss")


def with_pyarrow(files: list[Path]) -> int:
    from ciuic_doctor.rundir.frames import read_table

    return read_table(files, COLUMNS).table.num_rows


def with_polars(files: list[Path]) -> int:
    import polars as pl

    schema = {
        "rank": pl.Int64,
        "step": pl.Int64,
        "t": pl.Float64,
        "host": pl.String,
        "step_time_s": pl.Float64,
        "pre_backward_s": pl.Float64,
        "rss": pl.Int64,
    }
    frame = pl.scan_ndjson([str(f) for f in files], schema=schema, ignore_errors=True).collect()
    return frame.height


def with_duckdb(files: list[Path]) -> int:
    import duckdb

    columns = {
        "rank": "BIGINT",
        "step": "BIGINT",
        "t": "DOUBLE",
        "host": "VARCHAR",
        "step_time_s": "DOUBLE",
        "pre_backward_s": "DOUBLE",
        "rss": "BIGINT",
    }
    con = duckdb.connect()
    rel = con.read_json([str(f) for f in files], columns=columns, format="newline_delimited")
    return len(rel.fetchnumpy()["rank"])


def with_rows(files: list[Path]) -> int:
    from ciuic_doctor.rundir.store import read_jsonl

    return sum(len(read_jsonl(f).records) for f in files)


ENGINES: dict[str, Callable[[list[Path]], int]] = {
    "pyarrow.json (ciuic_doctor.rundir.frames)": with_pyarrow,
    "polars scan_ndjson": with_polars,
    "duckdb read_json": with_duckdb,
    "store.read_jsonl (json.loads)": with_rows,
}


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    import scalesynth

    with tempfile.TemporaryDirectory(prefix="ciuic-readers-") as tmp:
        run = scalesynth.generate(Path(tmp) / "run", scalesynth.Plan(ranks=args.ranks, steps=args.steps))
        files = sorted(run.glob("steps.rank*.jsonl"))
        size = sum(f.stat().st_size for f in files)
        print(f"{len(files)} files, {size / 2**20:.0f} MiB, {args.ranks * args.steps} rows, 7 columns")
        results = {}
        for name, read in ENGINES.items():
            try:
                read(files[:2])  # imports and first-call set-up outside the timing
            except ImportError:
                print(f"  {name}: not installed, skipped")
                continue
            c0, t0 = cpu_s(), time.perf_counter()
            rows = read(files)
            results[name] = (time.perf_counter() - t0, cpu_s() - c0, rows)
        best = min(wall for wall, _, _ in results.values())
        for name, (wall, cpu, rows) in results.items():
            print(f"  {name:38s} {wall:6.2f} s wall ({wall / best:4.1f}×)  {cpu:6.2f} s CPU  {rows} rows")


if __name__ == "__main__":
    main()
