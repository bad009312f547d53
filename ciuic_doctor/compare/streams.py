"""The other probes' streams of two runs, compared: loader-sweep throughput per configuration, comm-bench
busbw per collective and size, checkpoint save / load time, and memwatch peaks per process.

Noise, per probe, from what the probe records:
- loader: each configuration's timed groups of batches (`group_s`) are separate measurements, so the
  rate ratio gets an iid bootstrap over groups (analysis.loader.pool pools every round, as the analysis
  judged them).
- comm: a record holds one size's mean time, not its iterations. Each size is measured twice, in place and
  out of place, which are the same collective on the same bytes: the spread of log(t_in / t_out) over the
  sizes measures how much one measurement scatters in that run (conservative: a real in/out difference
  counts as noise). Without both, the iteration spread (p50 to p99 ≈ 2.33 σ) over sqrt(iters) is used.
  Pairs measured back to back miss what differs between two runs' moments, so the scatter of the B / A
  ratio between neighbouring sizes sets a floor (`_between_run_noise`).
- checkpoint: per repetition the slowest rank (the job waits for it), then a t test of the log times
  (a few repetitions: no bootstrap).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from ciuic_doctor.analysis.loader import last_sweep, pool
from ciuic_doctor.compare.change import Change
from ciuic_doctor.compare.loss import step_noise
from ciuic_doctor.compare.stats import MIN_SAMPLES, ratio_from_log_normal, ratio_of_means, t_interval
from ciuic_doctor.rundir.store import as_float
from ciuic_doctor.units import format_size_short

PLACE = {True: "in place", False: "out of place"}
P99_SIGMAS = 2.326  # the 99th percentile of a normal lies 2.326 σ above its median


# ---- loader --------------------------------------------------------------------------------------
def loader_changes(records_a: list[dict[str, Any]], records_b: list[dict[str, Any]]) -> list[Change]:
    pooled_a, pooled_b = pool(last_sweep(records_a)[1]), pool(last_sweep(records_b)[1])
    rows = []
    for config in sorted(set(pooled_a) & set(pooled_b)):
        pa, pb = pooled_a[config], pooled_b[config]
        change = Change(
            check="loader",
            metric="loader samples/s",
            scope=config,
            unit="samples/s",
            a=pa.samples_per_s,
            b=pb.samples_per_s,
            lower_is_better=False,
            n_a=len(pa.group_s),
            n_b=len(pb.group_s),
        )
        if min(len(pa.group_s), len(pb.group_s)) < MIN_SAMPLES or not (pa.samples_per_s and pb.samples_per_s):
            change.note = f"fewer than {MIN_SAMPLES} timed groups"
        else:
            # rate ∝ 1 / group time: B's rate over A's is A's mean group time over B's.
            est = ratio_of_means(pb.group_s, pa.group_s, blocks=False)
            scale = (pb.samples_per_s / pa.samples_per_s) / est.ratio  # 1 unless group sizes differ
            change.ratio = pb.samples_per_s / pa.samples_per_s
            change.ci_low, change.ci_high = est.ci_low * scale, est.ci_high * scale
            change.p_value, change.method = est.p_value, est.method + " over timed groups"
        rows.append(change)
    return rows  # judged as a family by compare_runs


# ---- comm ----------------------------------------------------------------------------------------
def _comm_key(r: dict[str, Any]) -> tuple[str, str, int]:
    return (str(r.get("collective")), str(r.get("algo") or "default"), int(r["bytes"]))


def _comm_records(records: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[bool, dict[str, Any]]]:
    out: dict[tuple[str, str, int], dict[bool, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        if r.get("status", "ok") == "ok" and isinstance(r.get("bytes"), int) and as_float(r.get("time_us")):
            out[_comm_key(r)][bool(r.get("inplace"))] = r  # a rerun appends: the last one counts
    return out


def _comm_noise(
    by_key: dict[tuple[str, str, int], dict[bool, dict[str, Any]]],
) -> dict[tuple[str, str], float]:
    """σ of log(time) of one measurement, per (collective, algo), from in-place vs out-of-place pairs."""
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (collective, algo, _), places in by_key.items():
        if True in places and False in places:
            pairs[(collective, algo)].append(
                math.log(as_float(places[True]["time_us"]) / as_float(places[False]["time_us"]))
            )
    return {k: statistics.stdev(v) / math.sqrt(2) for k, v in pairs.items() if len(v) >= 3}


def _iteration_noise(r: dict[str, Any]) -> float | None:
    p50, p99, iters = as_float(r.get("time_us_p50")), as_float(r.get("time_us_p99")), r.get("iters")
    time_us = as_float(r.get("time_us"))
    if not (p50 and p99 and time_us and isinstance(iters, int) and iters > 1):
        return None
    return max(p99 - p50, 0.0) / P99_SIGMAS / time_us / math.sqrt(iters)


def _between_run_noise(
    by_a: dict[tuple[str, str, int], dict[bool, dict[str, Any]]],
    by_b: dict[tuple[str, str, int], dict[bool, dict[str, Any]]],
) -> dict[tuple[str, str, bool], float]:
    """σ of one size's log busbw ratio B / A, from how much that ratio jumps between neighbouring sizes.

    In-place and out-of-place run back to back, so they share the load of their moment and miss what
    differs between two runs made at different times. A real change moves a range of sizes together, so
    the ratio's step-to-step scatter over sizes (MAD of first differences × 1.4826 / sqrt(2), as for the
    loss) is noise, including the between-run part. Measured on two checkups of the embedded job 3 minutes
    apart (gloo, shared 2-core box): 8 of 49 sizes "significant" with in/out pairs alone, in both directions.
    """
    ratios: dict[tuple[str, str, bool], list[tuple[int, float]]] = defaultdict(list)
    for key in set(by_a) & set(by_b):
        collective, algo, size = key
        for inplace in set(by_a[key]) & set(by_b[key]):
            bw_a, bw_b = (as_float(by[key][inplace].get("busbw_gbps")) for by in (by_a, by_b))
            if bw_a and bw_b:
                ratios[(collective, algo, inplace)].append((size, math.log(bw_b / bw_a)))
    return {
        key: step_noise([r for _, r in sorted(points)])
        for key, points in ratios.items()
        if len(points) >= MIN_SAMPLES
    }


def comm_changes(records_a: list[dict[str, Any]], records_b: list[dict[str, Any]]) -> list[Change]:
    by_a, by_b = _comm_records(records_a), _comm_records(records_b)
    noise_a, noise_b = _comm_noise(by_a), _comm_noise(by_b)
    between = _between_run_noise(by_a, by_b)
    rows = []
    for key in sorted(set(by_a) & set(by_b)):
        collective, algo, size = key
        for inplace in sorted(set(by_a[key]) & set(by_b[key])):
            ra, rb = by_a[key][inplace], by_b[key][inplace]
            bw_a, bw_b = as_float(ra.get("busbw_gbps")), as_float(rb.get("busbw_gbps"))
            change = Change(
                check="busbw",
                metric="busbw",
                scope=f"{collective} {algo} {format_size_short(size)} {PLACE[inplace]}",
                unit="GB/s",
                a=bw_a,
                b=bw_b,
                lower_is_better=False,
            )
            sd_a = noise_a.get((collective, algo), _iteration_noise(ra))
            sd_b = noise_b.get((collective, algo), _iteration_noise(rb))
            if not (bw_a and bw_b) or sd_a is None or sd_b is None:
                change.note = "no noise estimate (no in/out pair, no iteration percentiles)"
            else:
                sd = max(math.hypot(sd_a, sd_b), between.get((collective, algo, inplace), 0.0))
                est = ratio_from_log_normal(bw_b / bw_a, sd)
                change.ratio, change.ci_low, change.ci_high = est.ratio, est.ci_low, est.ci_high
                change.p_value, change.method = est.p_value, est.method
            rows.append(change)
    return rows  # judged as a family by compare_runs


# ---- checkpoint ----------------------------------------------------------------------------------
def _repeat_times(records: list[dict[str, Any]], kind: str, method: str | None) -> list[float]:
    per_repeat: dict[int, float] = {}
    key = "save_s" if kind == "save" else "load_s"
    for r in records:
        value = as_float(r.get(key))
        if r.get("kind") == kind and (method is None or r.get("method") == method) and value:
            repeat = int(r.get("repeat") or 0)
            per_repeat[repeat] = max(per_repeat.get(repeat, 0.0), value)
    return list(per_repeat.values())


def _job_saves(meta: dict[str, Any]) -> list[float]:
    saves = (meta.get("job_run") or {}).get("checkpoints") or []
    return [v for c in saves if isinstance(c, dict) and (v := as_float(c.get("save_s")))]


def checkpoint_changes(
    records_a: list[dict[str, Any]],
    records_b: list[dict[str, Any]],
    meta_a: dict[str, Any],
    meta_b: dict[str, Any],
) -> list[Change]:
    rows = []
    series = [
        (
            "checkpoint save",
            "checkpoint-check",
            _repeat_times(records_a, "save", None),
            _repeat_times(records_b, "save", None),
        ),
        (
            "checkpoint load",
            "checkpoint-check, every rank reads",
            _repeat_times(records_a, "load", "every_rank"),
            _repeat_times(records_b, "load", "every_rank"),
        ),
        ("checkpoint save", "the job's periodic saves", _job_saves(meta_a), _job_saves(meta_b)),
    ]
    for metric, scope, a, b in series:
        if not a or not b:
            continue
        change = Change(check="checkpoint", metric=metric, scope=scope, unit="s", n_a=len(a), n_b=len(b))
        change.a, change.b = statistics.median(a), statistics.median(b)
        change.ratio = change.b / change.a
        if len(a) < 2 or len(b) < 2:
            change.note = "one measurement per run: no interval"
        else:
            la, lb = [math.log(x) for x in a], [math.log(x) for x in b]
            va, vb = statistics.variance(la) / len(la), statistics.variance(lb) / len(lb)
            se = math.sqrt(va + vb)
            df = (va + vb) ** 2 / (va**2 / (len(la) - 1) + vb**2 / (len(lb) - 1)) if se > 0 else 1.0
            low, high, p = t_interval(statistics.fmean(lb) - statistics.fmean(la), se, df, 0.05)
            change.ratio = math.exp(statistics.fmean(lb) - statistics.fmean(la))
            change.ci_low, change.ci_high, change.p_value = math.exp(low), math.exp(high), p
            change.method = "Welch t test of log times (geometric mean ratio)"
        rows.append(change)
    return rows  # judged as a family by compare_runs


# ---- memwatch ------------------------------------------------------------------------------------
def memwatch_changes(samples_a: list[dict[str, Any]], samples_b: list[dict[str, Any]]) -> list[Change]:
    """Peak RSS of each watched role (agent, rank, worker): one peak per run, so no interval."""

    def peaks(samples: list[dict[str, Any]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in samples:
            role, rss = s.get("role"), as_float(s.get("rss"))
            if role and rss:
                out[str(role)] = max(out.get(str(role), 0.0), rss)
        return out

    pa, pb = peaks(samples_a), peaks(samples_b)
    return [
        Change(
            check="memory",
            metric="memwatch peak RSS",
            scope=role,
            unit="bytes",
            a=pa[role],
            b=pb[role],
            ratio=pb[role] / pa[role],
            note="one peak per run: no interval",
        )
        for role in sorted(set(pa) & set(pb))
    ]
