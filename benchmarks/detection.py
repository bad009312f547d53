"""How surely and how fast the offline analyses find stragglers, stalls and leaks: generated runs with one
planted fault each (or none), judged by the analyses in-process, scored per class. One table.

    .venv/bin/python benchmarks/detection.py --runs 200 --ranks 1024 --steps 240 --seed 37
    .venv/bin/python benchmarks/detection.py --runs 4 --ranks 10000 --steps 200 --seed 37  # 10,000 ranks
    .venv/bin/python benchmarks/detection.py --runs 100 --classes slow_rank,slow_host --slow-pct 5,10

Each run is N ranks × S steps of watch's step records in DDP's timing model (tests/scalesynth.py: a rank's
own pace is its time before backward, `pre_backward_s`; every rank's step ends after the slowest pace plus
backward and the all-reduce), 8 ranks a host, with realistic noise: per-step jitter 1–4 % (σ, drawn per
run), a per-rank bias of 0.5 % (σ), a batch-to-batch variation every rank shares (3 %), and RSS noise of
8 MiB. Every run, faulty or not, may also carry the events that must not be flagged: warm-up (the first
3–15 steps up to 3× slower on every rank), checkpoint saves that stall every rank 5–30 s (each rank's
share ±10 %), evaluation pauses (every rank, 5–20 s, ±5 %), and 1–3 single GC pauses (one rank, one step,
+0.1–0.6 s). ≥ 30 % of the runs are healthy; the others plant one of:

- slow_rank: one rank 5–50 % slower from step k (k in the middle half of the run);
- slow_host: the 8 ranks of one host 5–50 % slower, from step 1 or from step k;
- slow_link: two ranks' collective time 10–50 % longer in the job's comm-bench table (every row);
- intermittent: one rank 50–200 % slower every n-th step (n 5–20);
- loader_stall: one rank's data wait +1–5 s for 2–6 consecutive steps from step k;
- leak: one rank's RSS growing 0.5–4 MiB a step.

The analyses: steps' check_pace (step_time, straggler_onset, slow_host, stall, intermittent) on the
ranks × steps matrix, comm's straggler on the comm-bench rows, and memory's analysis on a run directory
written with the steps' rss (only for leak runs and the healthy ones: the memory analysis reads files).
A finding counts only when it names the planted rank (or host, or ranks) and, where the class has one,
the planted step (slow_rank: the change step within max(3, 5 % of S); loader_stall: within the stall);
any other warn or fail is a false positive of its class. Latency (steps from onset to the first
finding) re-runs the steps analysis on the run cut at onset + 5, 10, 20, 40, ... steps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

MIB = 2**20
RANKS_PER_HOST = 8
PACE_S, BACKWARD_S = 0.30, 0.55  # tests/scalesynth.py's Plan
CLASSES = ("slow_rank", "slow_host", "slow_link", "intermittent", "loader_stall", "leak")
# which planted class a warn/fail finding claims
CLAIMS = {
    ("steps", "step_time"): "slow_rank",
    ("steps", "straggler_onset"): "slow_rank",
    ("steps", "slow_host"): "slow_host",
    ("steps", "stall"): "loader_stall",
    ("steps", "intermittent"): "intermittent",
    ("comm", "straggler"): "slow_link",
    ("memory", "memory_leak"): "leak",
}


@dataclass(kw_only=True)
class Planted:
    kind: str  # healthy or one of CLASSES
    rank: int | None = None
    ranks: list[int] = field(default_factory=list)
    host: str | None = None
    step: int | None = None
    until: int | None = None
    size: float = 0.0
    every: int | None = None


@dataclass(kw_only=True)
class Run:
    ranks: int
    steps: int
    pace: np.ndarray
    step_time: np.ndarray
    rss: np.ndarray
    comm_rows: list[dict[str, Any]]
    planted: Planted
    events: list[str]

    def host_of(self, rank: int) -> str:
        return f"node-{rank // RANKS_PER_HOST:03d}"


def generate(
    rng: np.random.Generator, kind: str, n_ranks: int, n_steps: int, slow_pct: tuple[float, float] = (5, 50)
) -> Run:
    """One run with `kind` planted (module docstring); a slow rank or host `slow_pct` % slower."""
    steps = np.arange(1, n_steps + 1)
    jitter = rng.uniform(0.01, 0.04)
    bias = 1 + rng.normal(0, 0.005, (n_ranks, 1))
    batch = 1 + rng.normal(0, 0.03, (1, n_steps))
    pace = PACE_S * bias * batch * (1 + rng.normal(0, jitter, (n_ranks, n_steps)))
    extra = np.zeros((n_ranks, n_steps))  # seconds added to a rank's pace at a step
    events = []
    if rng.random() < 0.6:
        warm = int(rng.integers(3, 16))
        pace[:, :warm] *= np.linspace(3.0, 1.0, warm)[None, :]
        events.append(f"warm-up {warm}")
    if rng.random() < 0.6:
        every = int(rng.integers(50, 151))
        for s in range(every, n_steps, every):
            extra[:, s] += rng.uniform(5, 30) * (1 + rng.normal(0, 0.10, n_ranks))
        events.append(f"checkpoint /{every}")
    if rng.random() < 0.5:
        every = int(rng.integers(60, 121))
        for s in range(every - 7, n_steps, every):
            extra[:, s] += rng.uniform(5, 20) * (1 + rng.normal(0, 0.05, n_ranks))
        events.append(f"eval /{every}")
    if rng.random() < 0.6:
        for _ in range(int(rng.integers(1, 4))):
            extra[int(rng.integers(n_ranks)), int(rng.integers(20, n_steps))] += rng.uniform(0.1, 0.6)
        events.append("gc")
    rss = 9e9 + np.arange(n_ranks)[:, None] * 1e5 + rng.uniform(0, 8 * MIB, (n_ranks, n_steps))
    planted = Planted(kind=kind)
    link: tuple[int, int] | None = None
    link_pct = 0.0
    victim = int(rng.integers(n_ranks))
    onset = int(rng.integers(n_steps // 4, 3 * n_steps // 4))
    if kind == "slow_rank":
        size = rng.uniform(*slow_pct)
        pace[victim, onset - 1 :] *= 1 + size / 100
        planted = Planted(kind=kind, rank=victim, ranks=[victim], step=onset, size=size)
    elif kind == "slow_host":
        size = rng.uniform(*slow_pct)
        host = victim // RANKS_PER_HOST
        members = list(range(host * RANKS_PER_HOST, min(n_ranks, (host + 1) * RANKS_PER_HOST)))
        start = 1 if rng.random() < 0.5 else onset
        pace[members, start - 1 :] *= 1 + size / 100
        planted = Planted(kind=kind, ranks=members, host=f"node-{host:03d}", step=start, size=size)
    elif kind == "slow_link":
        other = int((victim + 1 + rng.integers(n_ranks - 1)) % n_ranks)
        link, link_pct = (victim, other), rng.uniform(10, 50)
        planted = Planted(kind=kind, rank=victim, ranks=sorted(link), size=link_pct)
    elif kind == "intermittent":
        size, every = rng.uniform(50, 200), int(rng.integers(5, 21))
        phase = int(rng.integers(every))
        pace[victim, phase::every] *= 1 + size / 100
        planted = Planted(kind=kind, rank=victim, ranks=[victim], size=size, every=every)
    elif kind == "loader_stall":
        length, size = int(rng.integers(2, 7)), rng.uniform(1, 5)
        extra[victim, onset - 1 : onset - 1 + length] += size
        planted = Planted(
            kind=kind, rank=victim, ranks=[victim], step=onset, until=onset + length - 1, size=size
        )
    elif kind == "leak":
        size = rng.uniform(0.5, 4)
        rss[victim] += size * MIB * steps
        planted = Planted(kind=kind, rank=victim, ranks=[victim], size=size)
    pace = pace + extra
    step_time = np.tile(pace.max(axis=0) + BACKWARD_S, (n_ranks, 1)) * (1 + rng.normal(0, 0.003, pace.shape))
    return Run(
        ranks=n_ranks,
        steps=n_steps,
        pace=pace,
        step_time=step_time,
        rss=rss,
        comm_rows=comm_rows(rng, n_ranks, link, link_pct),
        planted=planted,
        events=events,
    )


def comm_rows(rng: np.random.Generator, world: int, link: tuple[int, int] | None, pct: float) -> list[dict]:
    """comm-bench's rows (tests/gpusynth.py's table: all_reduce ring/tree, all_gather, 1 MiB-1 GiB), each
    rank's time within 0.3 %; a slow link makes both its ranks' time `pct` % longer in every row."""
    rows = []
    for collective, algo in (("all_reduce", "ring"), ("all_reduce", "tree"), ("all_gather", "ring")):
        for size in [2**k for k in range(20, 31, 2)]:
            time_us = size / (180.0 * 1e3)
            per_rank = time_us * (1 + rng.normal(0, 0.003, world))
            if link is not None:
                per_rank[list(link)] *= 1 + pct / 100 * rng.uniform(0.9, 1.1)
            rows.append(
                {"collective": collective, "algo": algo, "bytes": size, "status": "ok", "wrong": 0,
                 "world_size": world, "time_us": float(per_rank.max()), "rank_time_us": per_rank.tolist()}
            )  # fmt: skip
    return rows


def matrix(run: Run, upto: int | None = None) -> Any:
    from ciuic_doctor.analysis.steps.grid import StepMatrix

    n = upto or run.steps
    ranks = np.arange(run.ranks)
    steps = np.arange(1, n + 1)
    keep = steps > 2  # steps.WARMUP_STEPS, as matrix_from_table drops them
    return StepMatrix(
        ranks=ranks,
        steps=steps[keep],
        hosts=[run.host_of(r) for r in ranks.tolist()],
        step_time_s=np.ascontiguousarray(run.step_time[:, :n][:, keep]),
        pace_s=np.ascontiguousarray(run.pace[:, :n][:, keep]),
        pace_metric="pre_backward_s",
    )


def write_rss(run: Run, path: Path) -> Path:
    """The run's steps with rss (and the times), one file per rank, for the memory analysis."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    for r in range(run.ranks):
        host = run.host_of(r)
        t = 1.76e9 + np.cumsum(run.step_time[r])
        lines = [
            f'{{"schema":1,"t":{t[i]:.3f},"host":"{host}","rank":{r},"step":{i + 1},'
            f'"step_time_s":{run.step_time[r, i]:.4f},"pre_backward_s":{run.pace[r, i]:.4f},'
            f'"rss":{int(run.rss[r, i])}}}\n'
            for i in range(run.steps)
        ]
        (path / f"steps.rank{r}.jsonl").write_text("".join(lines))
    meta = {"schema": 1, "run": path.name, "created": 1.76e9, "probes": {"watch": {"status": "ok"}}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def findings_of(run: Run, *, memory_root: Path | None) -> list[Any]:
    from ciuic_doctor.analysis.comm import straggler
    from ciuic_doctor.analysis.steps import check_pace

    found = [*check_pace(matrix(run)), straggler(run.comm_rows)]
    if memory_root is not None:
        from ciuic_doctor.analysis import memory
        from ciuic_doctor.rundir.store import RunDir

        where = write_rss(run, memory_root / "run")
        try:
            found.extend(memory.analyze(RunDir(where)))
        finally:
            shutil.rmtree(where, ignore_errors=True)
    return [f for f in found if f.verdict in ("warn", "fail")]


def correct(finding: Any, planted: Planted, steps: int) -> bool:
    """Whether `finding` names what was planted (its class, its rank/host/ranks and step)."""
    claim = CLAIMS.get((finding.probe, finding.check))
    if claim != planted.kind:
        return False
    where = finding.where or {}
    if claim == "slow_host":
        return where.get("host") == planted.host and (where.get("hosts") or [planted.host]) == [planted.host]
    if claim == "slow_link":
        named = set(where.get("ranks") or [where.get("rank")])
        return bool(named) and named <= set(planted.ranks)
    if where.get("rank") != planted.rank or len(where.get("ranks") or [planted.rank]) != 1:
        return False
    if claim == "slow_rank":
        if finding.check != "straggler_onset":
            return False
        return abs(int(where.get("step") or -1000) - planted.step) <= max(3, 0.05 * steps)
    if claim == "loader_stall":
        return planted.step <= int(where.get("step") or -1) <= planted.until
    return True


def latency(run: Run) -> int | None:
    """Steps from the planted onset (step 1 for a fault there from the start) to the first cut of the run
    at which the steps analysis names it; None for a class the steps analysis does not judge."""
    from ciuic_doctor.analysis.steps import check_pace

    if run.planted.kind not in ("slow_rank", "slow_host", "loader_stall", "intermittent"):
        return None
    onset = run.planted.step or 1
    for after in (5, 10, 20, 40, 80, 160, 320, 640):
        upto = min(run.steps, max(onset + after, 12))
        if any(correct(f, run.planted, upto) for f in check_pace(matrix(run, upto)) if f.verdict == "warn"):
            return upto - onset
        if upto == run.steps:
            return None
    return None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--healthy", type=float, default=0.34, help="share of healthy runs (0.34)")
    parser.add_argument("--latency-runs", type=int, default=4, help="faulty runs a class timed for latency")
    parser.add_argument("--memory-healthy", type=int, default=12, help="healthy runs also given to memory")
    parser.add_argument("--slow-pct", default="5,50", help="slow rank/host slowdown range, %% (5,50)")
    parser.add_argument("--classes", default=",".join(CLASSES), help="the faults planted (all)")
    args = parser.parse_args()
    try:
        low, high = (float(x) for x in args.slow_pct.split(","))
    except ValueError:
        parser.error("--slow-pct: two numbers, e.g. 5,10")
    if not 0 < low <= high:
        parser.error("--slow-pct: 0 < low <= high")
    slow_pct = (low, high)
    classes = tuple(args.classes.split(","))
    if not classes or any(c not in CLASSES for c in classes):
        parser.error(f"--classes: some of {', '.join(CLASSES)}")
    rng = np.random.default_rng(args.seed)
    n_healthy = round(args.healthy * args.runs)
    kinds = ["healthy"] * n_healthy + [classes[i % len(classes)] for i in range(args.runs - n_healthy)]
    rng.shuffle(kinds)
    tp = dict.fromkeys(CLASSES, 0)
    fp = dict.fromkeys(CLASSES, 0)
    fn = dict.fromkeys(CLASSES, 0)
    lat: dict[str, list[int]] = {c: [] for c in CLASSES}
    missed_lat = dict.fromkeys(CLASSES, 0)
    healthy_flagged, healthy_memory = 0, 0
    misses: list[str] = []
    started, cpu0 = time.monotonic(), time.process_time()
    root = Path(tempfile.mkdtemp(prefix="detection-"))
    try:
        for i, kind in enumerate(kinds):
            run = generate(rng, kind, args.ranks, args.steps, slow_pct)
            memory = kind == "leak" or (kind == "healthy" and healthy_memory < args.memory_healthy)
            healthy_memory += kind == "healthy" and memory
            found = findings_of(run, memory_root=root if memory else None)
            hit = False
            for f in found:
                claim = CLAIMS.get((f.probe, f.check))
                if claim is None:
                    continue
                if correct(f, run.planted, run.steps):
                    hit = True
                else:
                    fp[claim] += 1
                    misses.append(f"run {i} ({kind} {_desc(run.planted)}): false {f.check} {f.where}")
            if kind == "healthy":
                healthy_flagged += bool(found)
            else:
                tp[kind] += hit
                fn[kind] += not hit
                if not hit:
                    misses.append(f"run {i} ({kind} {_desc(run.planted)}): missed")
                elif len(lat[kind]) + missed_lat[kind] < args.latency_runs:
                    took = latency(run)
                    if took is None:
                        missed_lat[kind] += 1
                    else:
                        lat[kind].append(took)
            verdict = "ok" if (hit or kind == "healthy") else "MISSED"
            print(f"  {i + 1}/{len(kinds)} {kind}: {verdict} {len(found)} flagged  "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall, cpu = time.monotonic() - started, time.process_time() - cpu0
    score = {"tp": tp, "fp": fp, "fn": fn, "lat": lat, "healthy_flagged": healthy_flagged}
    _table(args, kinds, score, healthy_memory=healthy_memory, wall=wall, cpu=cpu)
    if misses:
        print("\nwrong or missed:")
        for line in misses[:40]:
            print("  " + line)
    return 0


def _desc(p: Planted) -> str:
    bits = [f"rank {p.rank}" if p.rank is not None else "", p.host or "", f"step {p.step}" if p.step else ""]
    bits += [f"{p.size:.1f}" + ("%" if p.kind not in ("loader_stall", "leak") else "")]
    if p.every:
        bits.append(f"every {p.every}")
    return ", ".join(b for b in bits if b)


def _prf(t: int, p: int, n: int) -> tuple[float, float, float]:
    precision = t / (t + p) if t + p else 1.0
    recall = t / (t + n) if t + n else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def _table(args, kinds: list[str], score: dict, *, healthy_memory: int, wall: float, cpu: float) -> None:
    tp, fp, fn, lat = score["tp"], score["fp"], score["fn"], score["lat"]
    load = os.getloadavg()
    planted = "" if args.slow_pct == "5,50" else f" (slow rank/host {args.slow_pct} %)"
    print(f"detection benchmark: {len(kinds)} runs of {args.ranks} ranks x {args.steps} steps{planted}, "
          f"seed {args.seed}; {wall:.0f} s wall, {cpu:.0f} s CPU; load average {load[0]:.1f} "
          f"on {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'class':<14}{'runs':>5}{'TP':>5}{'FP':>5}{'FN':>5}{'precision':>11}{'recall':>8}{'F1':>7}"
          f"   steps onset->finding (median, max; n)")  # fmt: skip
    for c in CLASSES:
        p, r, f1 = _prf(tp[c], fp[c], fn[c])
        times = lat[c]
        when = f"{int(np.median(times))}, {max(times)}; {len(times)}" if times else "-"
        print(
            f"{c:<14}{kinds.count(c):>5}{tp[c]:>5}{fp[c]:>5}{fn[c]:>5}{p:>11.3f}{r:>8.3f}{f1:>7.3f}   {when}"
        )
    t, p_, n = sum(tp.values()), sum(fp.values()), sum(fn.values())
    p, r, f1 = _prf(t, p_, n)
    faulty = len(kinds) - kinds.count("healthy")
    print(f"{'overall':<14}{faulty:>5}{t:>5}{p_:>5}{n:>5}{p:>11.3f}{r:>8.3f}{f1:>7.3f}")
    print(f"{'healthy':<14}{kinds.count('healthy'):>5}  flagged: {score['healthy_flagged']} "
          f"(memory analysis on {healthy_memory} of them)")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
