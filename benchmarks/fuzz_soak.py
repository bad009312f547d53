"""Soak the record fuzz: every field of every record shape of every stream, set to each hostile value
(and deleted), then random multi-field mutations; analyze (and with --report, report) must never raise.
Prints each distinct crash site once, with the mutation that reached it; exit 1 when any was found.

The CI suite (tests/test_fuzz_records.py) runs the same properties with a few dozen examples.

    .venv/bin/python benchmarks/fuzz_soak.py                   # sweep (~5000) + 2000 random: ~15 min
    .venv/bin/python benchmarks/fuzz_soak.py --random 0        # the deterministic sweep only
    .venv/bin/python benchmarks/fuzz_soak.py --no-sweep --random 300
    .venv/bin/python benchmarks/fuzz_soak.py --report --random 50
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

SWEEP_VALUES = ["<delete>", None, "x", "nan", [], {}, True, 2**70, -1, 1e308, [None], {"a": None}]


def crash_site(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "ciuic_doctor" in f.filename]
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
    return f"{where} {type(exc).__name__}: {str(exc)[:80]}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--random", type=int, default=2000, help="random multi-field examples (2000)")
    parser.add_argument("--report", action="store_true", help="also build the report each time (slow)")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--no-sweep", action="store_true", help="random examples only")
    args = parser.parse_args()

    import fuzzkit

    from ciuic_doctor.analysis import run_all
    from ciuic_doctor.report import build_report
    from ciuic_doctor.rundir.schemas import SCHEMAS
    from ciuic_doctor.rundir.store import RunDir

    cases: list[list[tuple]] = []
    for name, rows in () if args.no_sweep else fuzzkit.BASE.items():
        shapes: dict[tuple, int] = {}
        for index, row in enumerate(rows):
            shapes.setdefault(tuple(sorted(row)), index)
        for index in shapes.values():
            fields = sorted(set(rows[index]) | set(SCHEMAS.get(fuzzkit.stream_name(name), {})))
            for field in fields:
                for value in SWEEP_VALUES:
                    cases.append([(name, index, field, fuzzkit.DELETE if value == "<delete>" else value)])
    rng = random.Random(args.seed)
    for _ in range(args.random):
        cases.append(fuzzkit.random_mutations(rng))

    crashes: dict[str, list[tuple]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ciuic-fuzz-") as tmp:
        folder = Path(tmp) / "run"
        for number, changes in enumerate(cases, 1):
            invalid = fuzzkit.write_run(folder, changes)
            try:
                run = RunDir.open(folder)
                findings = build_report(run, analyze=True).findings if args.report else run_all(run)
                fuzzkit.assert_counted(RunDir.open(folder), invalid, findings)
            except Exception as exc:
                site = crash_site(exc)
                if site not in crashes:
                    crashes[site] = changes
                    print(f"CRASH {site}\n    after {changes!r:.300}", flush=True)
            if number % 200 == 0:
                print(f"{number}/{len(cases)} examples, {len(crashes)} crash sites", flush=True)
    elapsed = time.perf_counter() - started
    print(f"\n{len(cases)} examples in {elapsed:.0f} s ({elapsed / len(cases) * 1000:.0f} ms each)")
    print(f"{len(crashes)} distinct crash site(s)")
    return 1 if crashes else 0


if __name__ == "__main__":
    raise SystemExit(main())
