"""How often `compare` calls noise a change (false-positive rate at nominal 5 %), and how often it finds a
real one (power), side by side for the resampling choices, in one run.

1. Recorded: pairs of same-settings step-time series drawn by blocks from a real 240-step recording of the
   embedded job (tests/data/compare/step_times.json), each pair judged by
   - compare's method (circular blocks of 3x the Politis-White length, k / (k - 1) variance correction,
     t degrees of freedom counted in blocks),
   - the same with 1x Politis-White blocks,
   - an iid bootstrap (single steps: what ignoring autocorrelation does).
   Then power and interval coverage with B made 10 / 25 / 50 % slower at every step.
2. AR(1) series (phi 0.3, 0.6, 0.8): the textbook case, same three methods.
3. Fresh runs (--runs N, default 0): N real same-settings jobs, two at a time (so a pair shares the load),
   each concurrent pair compared: real run-to-run noise, including what the recording cannot hold.

    .venv/bin/python benchmarks/compare_fpr.py [--pairs 1000] [--length 40] [--runs 6] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ciuic_doctor.compare import stats  # noqa: E402

RECORDED = REPO / "tests" / "data" / "compare" / "step_times.json"
METHODS = {
    "compare (3x PW, corrected)": {"factor": stats.BLOCK_FACTOR, "blocks": True},
    "1x Politis-White blocks": {"factor": 1, "blocks": True},
    "iid (single steps)": {"factor": 1, "blocks": False},
}


def _p(a: np.ndarray, b: np.ndarray, method: dict, seed: int) -> stats.RatioEstimate:
    saved = stats.BLOCK_FACTOR
    stats.BLOCK_FACTOR = method["factor"]
    try:
        return stats.ratio_of_means(a, b, seed=seed, blocks=method["blocks"])
    finally:
        stats.BLOCK_FACTOR = saved


def _pairs(series: np.ndarray, pairs: int, length: int, block: int, seed: int):
    rng = np.random.default_rng(seed)
    draws = series[stats.circular_block_indices(len(series), block, 2 * pairs, rng)[:, :length]]
    return [(draws[2 * i], draws[2 * i + 1]) for i in range(pairs)]


def _ar(phi: float, n: int, rng: np.random.Generator) -> np.ndarray:
    x = np.zeros(n + 50)
    noise = rng.standard_normal(n + 50)
    for t in range(1, n + 50):
        x[t] = phi * x[t - 1] + noise[t]
    return 0.1 + 0.01 * x[50:]


def recorded(pairs: int, length: int) -> None:
    series = np.asarray(json.loads(RECORDED.read_text())["step_time_s"])
    print(f"1. recorded series ({len(series)} steps), {pairs} same-settings pairs of {length} steps")
    print(f"   {'method':30s} " + " ".join(f"FPR src-block {b:<3d}" for b in (4, 8, 16)))
    for name, method in METHODS.items():
        rates = []
        for block in (4, 8, 16):
            hits = sum(
                _p(a, b, method, i).p_value < 0.05
                for i, (a, b) in enumerate(_pairs(series, pairs, length, block, 7))
            )
            rates.append(hits / pairs)
        print(f"   {name:30s} " + " ".join(f"{r:>17.1%}" for r in rates))
    print(f"   power / coverage of compare's method, source blocks of 8, {pairs // 2} pairs:")
    for slower in (1.10, 1.25, 1.50):
        found = covered = 0
        for i, (a, b) in enumerate(_pairs(series, pairs // 2, length, 8, 11)):
            est = _p(a, b * slower, METHODS["compare (3x PW, corrected)"], i)
            found += est.p_value < 0.05 and est.ratio > 1
            covered += est.ci_low <= slower <= est.ci_high
        share, cover = found / (pairs // 2), covered / (pairs // 2)
        print(f"     B {100 * (slower - 1):.0f} % slower: found {share:.1%}, 95 % CI covers it {cover:.1%}")


def autoregressive(pairs: int, length: int) -> None:
    print(f"2. AR(1) series, {pairs} pairs of {length} steps")
    print(f"   {'method':30s} " + " ".join(f"FPR phi {phi:<4g}" for phi in (0.3, 0.6, 0.8)))
    rng = np.random.default_rng(5)
    data = {
        phi: [(_ar(phi, length, rng), _ar(phi, length, rng)) for _ in range(pairs)] for phi in (0.3, 0.6, 0.8)
    }
    for name, method in METHODS.items():
        rates = [
            sum(_p(a, b, method, i).p_value < 0.05 for i, (a, b) in enumerate(data[phi])) / pairs
            for phi in data
        ]
        print(f"   {name:30s} " + " ".join(f"{r:>12.1%}" for r in rates))


def fresh_runs(runs: int, steps: int) -> None:
    print(f"3. {runs} fresh same-settings jobs of {steps} steps, two at a time; each pair compared")
    from ciuic_doctor.compare import compare_runs
    from ciuic_doctor.rundir.store import RunDir

    root = Path(tempfile.mkdtemp(prefix="compare-fpr-"))
    flagged = []
    for pair in range(runs // 2):
        dirs = [root / f"run{pair}{side}" for side in "ab"]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "ciuic_doctor", "job", "--steps", str(steps), "--out", str(d)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for d in dirs
        ]
        if any(p.wait() for p in procs):
            print(f"   pair {pair}: a job failed; skipped")
            continue
        result = compare_runs(RunDir.open(dirs[0]), RunDir.open(dirs[1]))
        step = next(f for f in result.findings if f.check == "step_time")
        flagged.append(bool(step.evidence.get("significant")))
        print(f"   pair {pair}: {step.summary}")
    if flagged:
        print(f"   significant in {sum(flagged)} of {len(flagged)} pairs (nominal 5 %); runs kept in {root}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--length", type=int, default=40, help="steps per series (the job's default is 40)")
    parser.add_argument("--runs", type=int, default=0, help="fresh same-settings jobs (even number)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    recorded(args.pairs, args.length)
    autoregressive(args.pairs // 2, args.length)
    if args.runs:
        fresh_runs(args.runs, args.steps)


if __name__ == "__main__":
    main()
