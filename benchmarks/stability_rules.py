"""Our spike/divergence detector next to the published rules of three projects, on one labelled corpus.

The anchors, implemented from their published descriptions (shared/reference/training-logs.md):

    olmo       OLMo-core StabilityMonitor: value > mean + 6σ of the previous 128 values (population σ; only
               once 128 values are there; every value enters the window).
    lightning  Lightning SpikeDetection(mode="min", window=10, warmup=1, rtol=2.0): |x − running mean| ≥
               2.0 × mean and x not lower than the last value; a spike does not enter the running mean.
    foundry    llm-foundry KillLossSpike(outlier_multiplier=2, window_size=100, patience=4): loss ≥ 2 × the
               mean of the previous 100 losses for more than 4 consecutive steps (only once 100 are there).
    ours       ciuic-doctor's stability analysis (loss_spike starts + divergence onsets) on the same rows.

Corpus (generated, seeded): per class, --cases runs of 5000 steps; a curve decays from ~10.5 towards
~2.2 with Gaussian noise proportional to its level (0.5–5 %; a batch mean of token losses) and slow
wiggles, LR warm-up then cosine. Classes: clean runs, sharp spikes (1–2 steps, 1.3–4×), slow-recovery
spikes (100–500 steps back), spikes during warm-up (steps 30–300, on the steep part), noisy high-loss
curves (loss ~6–11, 6–10 % noise), logging interval 10 (Megatron interval means; spikes that last ≥ 10
steps), gaps (three holes of 200–800 steps), divergence (the loss doubles every 100–300 steps from an
onset). A planted spike's first point, as logged, is at least 25 % and 8 noise σ above the noise-free
curve: what a person reading the plot calls a spike.

Scoring: a detector's flagged rows become alarms (flags ≤ 20 steps apart are one alarm, at its first
step). A label is found when an alarm starts within [start − 2 rows, start + its extent] (extent: until the
spike is back within 10 %; for divergence from half a doubling time before the onset to the end of the run,
since a smooth rise has no first step); every other alarm is a false alarm.

Real logs (../shared/real-logs/, public logs nobody here wrote, each judged by a person; skipped when
../shared is absent): every detector runs on each file's loss (and OLMo's also on its grad norm), and a
file counts as *agreed* when what the detector raises meets everything labels.json says of it (must /
must_not / not_warn / max_warn / no_fail / clean_error_or). The anchors only watch the loss, so they
cannot find an overflow storm, and their only non-finite alarm is Lightning's (it flags NaN/inf).

    .venv/bin/python benchmarks/stability_rules.py [--cases 30] [--seed 0] [--real-only]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ciuic_doctor.analysis.stability import analyze_log, fold
from ciuic_doctor.errors import UserError
from ciuic_doctor.importers import StepLog, load, normalize

REAL_LOGS = Path(__file__).resolve().parents[1].parent / "shared" / "real-logs"

N = 5000
MERGE_STEPS = 20
CLASSES = ("clean", "sharp", "slow_recovery", "warmup", "noisy_high", "interval_10", "gaps", "divergence")
DETECTORS = ("ours", "olmo", "lightning", "foundry")


@dataclass(kw_only=True)
class Case:
    step: np.ndarray
    loss: np.ndarray
    interval: int = 1
    # (start step, first and last step an alarm for it may be at)
    labels: list[tuple[int, int, int]] = field(default_factory=list)


# ---- corpus ----------------------------------------------------------------------------------------


def curve(rng: np.random.Generator, *, start=10.5, floor=2.2, noise=None, n=N):
    """(loss, relative noise σ, the noise-free level the loss fluctuates around)."""
    noise = rng.uniform(0.005, 0.05) if noise is None else noise
    t = np.arange(1, n + 1, dtype=float)
    decay = rng.uniform(200, 800)
    trend = floor + (start - floor) * (0.75 * np.exp(-t / decay) + 0.25 / np.sqrt(1 + t / (5 * decay)))
    wiggle = np.convolve(rng.normal(0, noise * 0.6, n + 200), np.ones(200) / math.sqrt(200), "same")[100:-100]
    level = trend * np.exp(0.3 * wiggle[:n])
    # A batch-mean loss: Gaussian noise around its level, its width proportional to the level.
    return level * np.clip(1 + rng.normal(0, noise, n), 0.05, None), noise, level


def plant(loss, level, s: int, *, magnitude: float, recovery: int, noise: float) -> int:
    """Multiply in a spike starting at step s that decays over `recovery` steps; returns its extent.

    The spike multiplies a noisy point, so a low draw there can hide part of it: the magnitude is raised
    where needed so that the first point *as logged* is ≥ 25 % and ≥ 8σ above the noise-free level.
    """
    k = np.arange(len(loss))
    need = max(0.25, 8 * noise)
    magnitude = max(magnitude, (1 + need) * level[s - 1] / loss[s - 1])
    shape = np.where(k >= s - 1, np.exp(-np.clip(k - (s - 1), 0, None) * 3.0 / max(recovery, 1)), 0.0)
    loss *= 1 + (magnitude - 1) * shape
    back = np.flatnonzero((k >= s - 1) & ((magnitude - 1) * shape < 0.1))
    return int(back[0] + 1 if len(back) else len(loss))


def make_case(kind: str, rng: np.random.Generator) -> Case:
    if kind == "noisy_high":
        loss, noise, level = curve(rng, start=11.0, floor=6.0, noise=rng.uniform(0.06, 0.10))
    else:
        loss, noise, level = curve(rng)
    step = np.arange(1, N + 1)
    labels: list[tuple[int, int, int]] = []
    spaced = sorted(int(s) for s in rng.choice(np.arange(600, N - 600, 400), size=3, replace=False))

    def spike(s: int, low: float, high: float, recovery: int) -> None:
        end = plant(loss, level, s, magnitude=rng.uniform(low, high), recovery=recovery, noise=noise)
        labels.append((s, s, end))

    if kind in ("sharp", "noisy_high", "gaps"):
        for s in spaced:
            spike(s, 1.3, 4.0, int(rng.integers(1, 3)))
    elif kind == "slow_recovery":
        for s in spaced:
            spike(s, 1.5, 3.0, int(rng.integers(100, 500)))
    elif kind == "warmup":
        spike(int(rng.integers(30, 300)), 1.5, 3.0, int(rng.integers(1, 20)))
    elif kind == "interval_10":
        for s in spaced:
            spike(s, 1.5, 3.0, int(rng.integers(30, 100)))
    elif kind == "divergence":
        onset = int(rng.integers(N // 2, N - 800))
        doubling = rng.uniform(100, 300)
        loss *= np.exp(np.clip(step - onset, 0, None) * math.log(2) / doubling)
        # A smooth rise has no first step: an onset within half a doubling time before it counts.
        labels.append((onset, onset - int(doubling / 2), N))
    case = Case(step=step, loss=loss, labels=labels)
    if kind == "interval_10":
        case.step, case.loss, case.interval = step[9::10], loss.reshape(-1, 10).mean(axis=1), 10
    if kind == "gaps":
        keep = np.ones(N, dtype=bool)
        for g in rng.choice(np.arange(400, N - 1200, 500), size=3, replace=False):
            hole = slice(int(g), int(g) + int(rng.integers(200, 800)))
            if not any(hole.start <= s < hole.stop + 10 for s, _, _ in labels):
                keep[hole] = False
        case.step, case.loss = step[keep], loss[keep]
    return case


# ---- detectors --------------------------------------------------------------------------------------


def ours(case: Case) -> list[int]:
    table = normalize(
        {"step": case.step, "loss": case.loss, "interval_steps": np.full(len(case.step), case.interval)}
    )
    alarms = []
    for f in analyze_log(StepLog(table=table)):
        if f.check in ("loss_spike", "divergence") and f.verdict in ("warn", "fail"):
            alarms.append(int(f.where["step"]))
    return sorted(alarms)


def olmo(case: Case) -> list[int]:
    x = case.loss
    flags = np.zeros(len(x), dtype=bool)
    window = 128
    if len(x) > window:
        c1 = np.concatenate([[0.0], np.cumsum(x)])
        c2 = np.concatenate([[0.0], np.cumsum(x * x)])
        i = np.arange(window, len(x))
        mean = (c1[i] - c1[i - window]) / window
        var = np.maximum((c2[i] - c2[i - window]) / window - mean**2, 0.0)
        std = np.sqrt(var)
        flags[window:] = (std >= 1e-10) & (x[window:] > mean + 6.0 * std)
    return case.step[flags].tolist()


def lightning(case: Case) -> list[int]:
    running: deque[float] = deque(maxlen=10)
    last = None
    flagged = []
    for i, value in enumerate(case.loss):
        spike = False
        if i >= 1 and running:
            mean = sum(running) / len(running)
            better = last is not None and value - last <= 0
            spike = (not math.isfinite(value)) or (not better and abs(value - mean) >= 2.0 * abs(mean))
        if spike:
            flagged.append(int(case.step[i]))
        else:
            running.append(value)
            last = value
    return flagged


def foundry(case: Case) -> list[int]:
    window: deque[float] = deque(maxlen=100)
    total = 0.0
    counter = 0
    flagged = []
    for i, value in enumerate(case.loss):
        if len(window) == 100:
            mean = total / 100
            if value >= 2 * mean:
                counter += 1
                if counter > 4:
                    flagged.append(int(case.step[i]))
            else:
                counter = 0
        if len(window) == 100:
            total -= window[0]
        window.append(value)
        total += value
    return flagged


def alarms_of(flagged: list[int]) -> list[int]:
    out: list[int] = []
    last = None
    for s in flagged:
        if last is None or s - last > MERGE_STEPS:
            out.append(s)
        last = s
    return out


# ---- scoring ----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Score:
    labels: int = 0
    found: int = 0
    false_alarms: int = 0
    errors: list[int] = field(default_factory=list)

    def add(self, case: Case, alarms: list[int]) -> None:
        used = set()
        for start, first, end in case.labels:
            self.labels += 1
            lo = first - 2 * case.interval
            hits = [a for a in alarms if lo <= a <= max(end, start + case.interval) and a not in used]
            if hits:
                self.found += 1
                used.add(hits[0])
                self.errors.append(abs(hits[0] - start))
        self.false_alarms += sum(1 for a in alarms if a not in used and not self._inside(case, a))

    @staticmethod
    def _inside(case: Case, alarm: int) -> bool:
        """A second alarm inside a found label's extent is the same event, not a false alarm."""
        return any(first - 2 * case.interval <= alarm <= end for _, first, end in case.labels)

    @property
    def recall(self) -> float:
        return self.found / self.labels if self.labels else math.nan


# ---- real logs ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Raised:
    """What a detector raised on one file: check -> steps (one per alarm or finding)."""

    checks: dict[str, list[int | None]] = field(default_factory=dict)
    failed: bool = False
    clean_error: bool = False
    loss_rows: int = 0  # rows with a loss the import gave every detector

    def add(self, check: str, steps: list[int | None]) -> None:
        if steps:
            self.checks.setdefault(check, []).extend(steps)


def agrees(label: dict, got: Raised) -> tuple[bool, list[str]]:
    """Whether `got` meets every line of the file's label, and the lines it misses."""
    misses = []
    for want in label.get("must", []):
        steps = [s for s in got.checks.get(want["check"], []) if s is not None]
        if not any(abs(s - want["step"]) <= want["tol"] for s in steps):
            misses.append(f"missed {want['check']}@{want['step']}")
    for check in label.get("must_not", []) + label.get("not_warn", []):
        if got.checks.get(check):
            misses.append(f"raised {check}")
    for check, most in label.get("max_warn", {}).items():
        if len(got.checks.get(check, [])) > most:
            misses.append(f"{len(got.checks[check])}× {check}")
    if label.get("no_fail") and got.failed:
        misses.append("failed")
    if got.loss_rows < label.get("loss_rows_min", 0):
        misses.append(f"read {got.loss_rows} losses, not {label['loss_rows_min']}")
    either = label.get("clean_error_or", [])
    if either and not got.clean_error and not any(got.checks.get(c) for c in either):
        misses.append("neither a clean error nor " + "/".join(label["clean_error_or"]))
    return not misses, misses


def real_log_rows() -> list[tuple[str, dict[str, Raised], dict]]:
    labels = json.loads((REAL_LOGS / "labels.json").read_text())
    rows = []
    for name, label in sorted(labels.items()):
        results = {d: Raised() for d in DETECTORS}
        try:
            log = load(REAL_LOGS / name)
        except UserError:
            for r in results.values():
                r.clean_error = True
            rows.append((name, results, label))
            continue
        for r in results.values():
            r.loss_rows = int(log.table["loss"].notna().sum())
        for f in analyze_log(log):
            if f.verdict in ("warn", "fail"):
                results["ours"].add(f.check, [f.where.get("step")])
                results["ours"].failed |= f.verdict == "fail"
        for key in sorted(int(k) for k in log.table["series"].unique()):
            curve = fold(log.table[log.table["series"] == key])
            loss = np.where(curve.nonfinite > 0, np.nan, curve.loss)
            rows_with_loss = np.isfinite(curve.loss) | (curve.nonfinite > 0)
            loss_case = Case(step=curve.step[rows_with_loss], loss=loss[rows_with_loss])
            grad = np.isfinite(curve.grad_norm)
            grad_case = Case(step=curve.step[grad], loss=curve.grad_norm[grad])
            for name_, detect in (("olmo", olmo), ("lightning", lightning), ("foundry", foundry)):
                flagged = detect(loss_case) if len(loss_case.loss) else []
                finite = set(loss_case.step[np.isfinite(loss_case.loss)].tolist())
                results[name_].add("loss_spike", alarms_of([s for s in flagged if s in finite]))
                results[name_].add("nonfinite_loss", alarms_of([s for s in flagged if s not in finite]))
            if len(grad_case.loss):
                results["olmo"].add("grad_norm_spike", alarms_of(olmo(grad_case)))
        rows.append((name, results, label))
    return rows


def print_real_logs() -> bool:
    """The per-file table; True when ours agrees with the person on every file."""
    if not (REAL_LOGS / "labels.json").is_file():
        print(f"real logs: {REAL_LOGS} is not here; skipped")
        return True
    rows = real_log_rows()
    width = max(len(name) for name, _, _ in rows)
    print(f"\nreal logs ({REAL_LOGS}): agreement with the person's judgement (labels.json)")
    header = (
        f"{'file':<{width}}"
        + "".join(f"{d:>11}" for d in DETECTORS)
        + "   what ours missed / the others raised"
    )
    print(header)
    print("-" * len(header))
    totals = dict.fromkeys(DETECTORS, 0)
    for name, results, label in rows:
        cells, notes = [], []
        for d in DETECTORS:
            ok, misses = agrees(label, results[d])
            totals[d] += ok
            cells.append(f"{'yes' if ok else 'NO':>11}")
            spikes = [s for s in results[d].checks.get("loss_spike", []) if s is not None]
            if misses:
                notes.append(f"{d}: {', '.join(misses)}")
            elif spikes:  # allowed, and worth seeing (e.g. the 3.3× spike at iteration 3)
                notes.append(f"{d}: loss spike at {', '.join(map(str, spikes[:3]))}")
        print(f"{name:<{width}}" + "".join(cells) + "   " + "; ".join(notes))
    print("-" * len(header))
    print(f"{'agreed':<{width}}" + "".join(f"{f'{totals[d]}/{len(rows)}':>11}" for d in DETECTORS))
    return totals["ours"] == len(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=30, help="runs per class (default 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--real-only", action="store_true", help="only the real-log table")
    args = parser.parse_args()
    if args.real_only:
        return 0 if print_real_logs() else 1
    rng = np.random.default_rng(args.seed)
    scores = {(k, d): Score() for k in CLASSES for d in DETECTORS}
    detectors = {"ours": ours, "olmo": olmo, "lightning": lightning, "foundry": foundry}
    started = time.perf_counter()
    for kind in CLASSES:
        for _ in range(args.cases):
            case = make_case(kind, rng)
            for name, detect in detectors.items():
                scores[kind, name].add(case, alarms_of(detect(case)))
        print(f"  {kind:<14} {args.cases} runs done ({time.perf_counter() - started:.0f} s)", flush=True)
    print()
    header = (
        f"{'class':<14}{'labels':>7}" + "".join(f"{d + ' R/FA':>16}" for d in DETECTORS) + "   ours ≥ best"
    )
    print(header)
    print("-" * len(header))
    all_ok = True
    for kind in CLASSES:
        row = [scores[kind, d] for d in DETECTORS]
        cells = []
        for s in row:
            recall = "  -  " if not s.labels else f"{s.recall:5.0%}"
            cells.append(f"{recall:>9} / {s.false_alarms:<4}")
        mine, others = row[0], row[1:]
        best_recall = max((o.recall for o in others if o.labels), default=math.nan)
        least_fa = min(o.false_alarms for o in others)
        ok = (not mine.labels or mine.recall >= best_recall) and mine.false_alarms <= least_fa
        all_ok &= ok
        print(
            f"{kind:<14}{row[0].labels:>7}"
            + "".join(f"{c:>16}" for c in cells)
            + f"   {'yes' if ok else 'NO'}"
        )
    print()
    print("median |alarm − planted step| over found labels:")
    for kind in CLASSES:
        parts = []
        for d in DETECTORS:
            errs = scores[kind, d].errors
            parts.append(f"{d} {np.median(errs):.0f}" if errs else f"{d} -")
        print(f"  {kind:<14} " + ", ".join(parts))
    all_ok &= print_real_logs()
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
