"""Judge MoE expert load (stream `moe`, from watch's router hook) and what it costs all_to_all (stream `comm`,
from `comm-bench --splits-from RUN`).

- `expert_imbalance`: per layer, the load of each expert summed over ranks (with expert parallelism an
  expert serves every rank's tokens) and over the sampled steps. max/mean is what an expert-parallel MoE
  layer pays: its time follows the busiest expert's rank, so 1.5 means the layer runs ≥ 50 % longer than
  balanced (DeepSeek's MaxVio = max/mean − 1, which its auxiliary-loss-free balancing keeps low). Judged
  on the load summed over the window, a systematic imbalance (persistent hot experts), not on single
  steps: a step's tokens come in few sequences whose tokens route alike, so per-step max/mean is noisy
  (the balanced embedded job, 16 sequences a step, reads 1.3–1.9 per step and ≤ 1.23 summed over 8 steps;
  the per-step median is in the evidence). Threshold max(IMBALANCE_WARN, the multinomial noise floor
  1 + 3/√(mean tokens per expert)). The hot experts (≥ HOT × mean) and cold ones (≤ COLD × mean) of each
  layer are named, and the summed max/mean of the first and last third of the samples (does it drift?).
- `dead_experts`: experts that received no token on any rank in every sample of the last
  ≥ DEAD_MIN_STEPS steps (at least DEAD_MIN_SAMPLES samples): their parameters train no more.
- `alltoall_routing` (probe comm): all_to_all with the recorded routing's split sizes beside equal
  splits of the same volume (medians of the iterations: a shared machine's stalls move means by 2x);
  the ratio is what the imbalance costs in the dispatch; warn from ALLTOALL_WARN.

Evidence carries what the report draws: the layer × expert load (÷ mean) heat-map and max/mean per layer
over the sampled steps. Pure functions of records: no torch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir

STREAMS = ("moe", "comm", "steps")  # steps: a watched run whose model has experts watch could not read
SECONDS_PER_MILLION_STEP_ROWS = 0.03  # 0.31 s at 10,000 ranks × 1,000 steps (side by side: longest first)
PROBE = "moe"
IMBALANCE_WARN = 1.5  # busiest expert / mean: the layer's expert-parallel time ≥ 1.5 x balanced
NOISE_Z = 3.0  # a balanced multinomial's max/mean stays below 1 + 3/sqrt(mean) (z = 3 over <= 256 experts)
HOT = 1.5
COLD = 0.5
DEAD_MIN_STEPS = 10
DEAD_MIN_SAMPLES = 3
MAX_NAMED = 5  # experts named per layer
MAX_LAYERS_NAMED = 5
MAX_SERIES_POINTS = 200
ALLTOALL_WARN = 1.5  # routed dispatch >= 1.5 x the even one: the imbalance costs more than noise does


def load_table(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """layer -> {"steps": [...], "counts": array [steps, experts] summed over ranks, "ranks": [...],
    "name": router name}; records whose expert count differs from the layer's first are left out."""
    by_layer: dict[int, dict[int, np.ndarray]] = defaultdict(dict)
    ranks: dict[int, set[int]] = defaultdict(set)
    names: dict[int, str] = {}
    width: dict[int, int] = {}
    for r in records:
        layer, step, counts = r.get("layer"), r.get("step"), r.get("counts")
        if (
            not isinstance(layer, int)
            or not isinstance(step, int)
            or not isinstance(counts, list)
            or not counts
        ):
            continue
        if width.setdefault(layer, len(counts)) != len(counts):
            continue
        row = np.asarray(counts, dtype=np.float64)
        steps = by_layer[layer]
        steps[step] = steps[step] + row if step in steps else row
        if isinstance(r.get("rank"), int):
            ranks[layer].add(r["rank"])
        names.setdefault(layer, str(r.get("name") or f"layer {layer}"))
    out = {}
    for layer, steps in sorted(by_layer.items()):
        order = sorted(steps)
        out[layer] = {
            "steps": order,
            "counts": np.stack([steps[s] for s in order]),
            "ranks": sorted(ranks[layer]),
            "name": names[layer],
        }
    return out


def _ratio(row: np.ndarray) -> float:
    mean = float(row.mean())
    return float(row.max()) / mean if mean > 0 else math.nan


def layer_stats(entry: dict[str, Any]) -> dict[str, Any]:
    """One layer's load over the sampled window: max/mean of the summed load (what the warning judges),
    the median of the per-step max/mean (what a single step pays), CV, hot and cold experts, and the
    summed-load max/mean of the first and last third of the samples (does it drift?)."""
    counts: np.ndarray = entry["counts"]
    total = counts.sum(axis=0)
    mean = float(total.mean())
    per_step = [_ratio(row) for row in counts]
    finite = [v for v in per_step if math.isfinite(v)]
    third = max(1, len(counts) // 3)
    share = total / mean if mean > 0 else np.zeros_like(total)
    order = np.argsort(-share, kind="stable")
    return {
        "layer_name": entry["name"],
        "samples": len(entry["steps"]),
        "max_over_mean": round(_ratio(total), 3) if mean > 0 else None,
        "max_over_mean_step_median": round(float(np.median(finite)), 3) if finite else None,
        "max_over_mean_worst_step": round(max(finite), 3) if finite else None,
        "max_over_mean_first": round(_ratio(counts[:third].sum(axis=0)), 3) if mean > 0 else None,
        "max_over_mean_last": round(_ratio(counts[-third:].sum(axis=0)), 3) if mean > 0 else None,
        "cv": round(float(total.std() / mean), 3) if mean > 0 else None,
        "tokens_per_expert": round(mean, 1),
        "noise_floor": round(1 + NOISE_Z / math.sqrt(mean), 3) if mean > 0 else None,
        "hot": [{"expert": int(e), "load_over_mean": round(float(share[e]), 2)}
                for e in order[:MAX_NAMED] if share[e] >= HOT],
        "cold": [{"expert": int(e), "load_over_mean": round(float(share[e]), 2)}
                 for e in order[::-1][:MAX_NAMED] if share[e] <= COLD],
        "share": [round(float(v), 3) for v in share],
        "per_step": per_step,
    }  # fmt: skip


def dead_in(entry: dict[str, Any]) -> tuple[list[int], int | None]:
    """Experts at zero in every sample of the trailing window, and the first step of that window."""
    steps, counts = entry["steps"], entry["counts"]
    if len(steps) < DEAD_MIN_SAMPLES:
        return [], None
    dead, since = [], None
    for expert in range(counts.shape[1]):
        column = counts[:, expert]
        nonzero = np.nonzero(column)[0]
        first_zero = int(nonzero[-1]) + 1 if nonzero.size else 0
        if first_zero >= len(steps):
            continue
        span = steps[-1] - steps[first_zero] + 1
        if len(steps) - first_zero >= DEAD_MIN_SAMPLES and span >= DEAD_MIN_STEPS:
            dead.append(expert)
            since = steps[first_zero] if since is None else min(since, steps[first_zero])
    return dead, since


def analyze(run: RunDir) -> list[Finding]:
    findings = []
    table = load_table(run.read("moe").records) if run.has_stream("moe") else {}
    if table:
        findings += [imbalance_finding(table), dead_finding(table)]
    status = ((run.read_meta().get("model") or {}).get("moe")) if run.has_stream("steps") else None
    if isinstance(status, dict) and (silent := not_recorded_finding(status, bool(table))) is not None:
        findings.append(silent)
    if run.has_stream("comm"):
        routed = alltoall_finding(run.read("comm").records)
        if routed is not None:
            findings.append(routed)
    return findings


def not_recorded_finding(status: dict[str, Any], recorded: bool) -> Finding | None:
    """not_run when the model has experts whose routing watch did not record (meta.json model.moe, from
    probes/watch/moe.py): a router found whose output it could not read, or expert blocks with no router
    it recognised. Without this a silent run reads as "balanced"."""
    unread = [u for u in status.get("routers_unread") or [] if isinstance(u, dict)]
    without = [str(b) for b in status.get("experts_without_router") or []]
    if not unread and not without:
        return None
    parts = []
    if unread:
        first = unread[0]
        parts.append(f"{len(unread)} router(s) found but not read: {first.get('name')}: {first.get('why')}")
    if without:
        parts.append(
            f"{len(without)} expert block(s) with no router watch recognises ({', '.join(without[:3])}"
            f"{', …' if len(without) > 3 else ''}; a router is a `gate`/`router` module beside `experts`, "
            "or a class named *Router/*Gate)"
        )
    scope = "the routers read are judged above; " if recorded else "no expert load recorded: "
    return Finding(
        probe=PROBE,
        check="expert_routing_recorded",
        verdict="not_run",
        summary=scope + "; ".join(parts),
        evidence={
            "routers_unread": unread,
            "experts_without_router": without,
            "routers_read": list(status.get("routers_read") or []),
        },
    )


def _series(stats: dict[int, dict[str, Any]], table: dict[int, dict[str, Any]]) -> dict[str, Any]:
    steps = next(iter(table.values()))["steps"]
    stride = max(1, math.ceil(len(steps) / MAX_SERIES_POINTS))
    return {
        "steps": steps[::stride],
        "layers": {
            str(layer): [round(v, 3) if math.isfinite(v) else None for v in s["per_step"][::stride]]
            for layer, s in stats.items()
            if table[layer]["steps"] == steps
        },
    }


def imbalance_finding(table: dict[int, dict[str, Any]]) -> Finding:
    stats = {layer: layer_stats(entry) for layer, entry in table.items()}
    judged = {k: s for k, s in stats.items() if s["max_over_mean"] is not None}
    over = {
        layer: s
        for layer, s in judged.items()
        if s["max_over_mean"] >= max(IMBALANCE_WARN, s["noise_floor"] or 0)
    }
    worst = sorted(over, key=lambda k: -over[k]["max_over_mean"])
    ranks = sorted({r for e in table.values() for r in e["ranks"]})
    evidence = {
        "threshold_max_over_mean": IMBALANCE_WARN,
        "layers": {
            str(k): {key: v for key, v in s.items() if key not in ("share", "per_step")}
            for k, s in stats.items()
        },
        "heatmap": {"layers": list(stats), "load_over_mean": [s["share"] for s in stats.values()]},
        "over_steps": _series(stats, table),
        "ranks": ranks,
    }
    if not worst:
        top = max(judged.values(), key=lambda s: s["max_over_mean"], default=None)
        figure = f"; the most uneven layer reads {top['max_over_mean']:.2f}" if top else ""
        return Finding(
            probe=PROBE,
            check="expert_imbalance",
            verdict="pass",
            summary=f"expert load balanced in {len(stats)} MoE layer(s): busiest expert below "
            f"{IMBALANCE_WARN}x "
            f"the mean load over the sampled steps (or within the noise floor){figure}",
            evidence=evidence,
            where={"ranks": ranks},
        )
    parts = []
    for layer in worst[:MAX_LAYERS_NAMED]:
        s = over[layer]
        hot = ", ".join(f"{h['expert']} ({h['load_over_mean']:.1f}x)" for h in s["hot"]) or "none above 1.5x"
        drift = ""
        if s["samples"] >= 6:
            drift = f", {s['max_over_mean_first']:.2f} -> {s['max_over_mean_last']:.2f} over the run"
        parts.append(
            f"layer {layer}: busiest expert {s['max_over_mean']:.2f}x the mean over {s['samples']} sampled "
            f"step(s) (CV {s['cv']:.2f}, median step {s['max_over_mean_step_median']:.2f}x{drift}); "
            f"hot experts {hot}"
        )
    more = f"; {len(worst) - MAX_LAYERS_NAMED} more layer(s)" if len(worst) > MAX_LAYERS_NAMED else ""
    return Finding(
        probe=PROBE,
        check="expert_imbalance",
        verdict="warn",
        summary=f"router sends uneven load in {len(worst)} of {len(stats)} MoE layer(s): "
        + "; ".join(parts)
        + more
        + f". With expert parallelism the layer waits for its busiest expert's rank ({IMBALANCE_WARN}x = "
        "50 % longer than balanced)",
        evidence={**evidence, "worst_layers": worst},
        where={"layers": worst, "ranks": ranks},
    )


def dead_finding(table: dict[int, dict[str, Any]]) -> Finding:
    dead = {}
    for layer, entry in table.items():
        experts, since = dead_in(entry)
        if experts:
            dead[layer] = {"experts": experts, "since_step": since, "of": int(entry["counts"].shape[1])}
    ranks = sorted({r for e in table.values() for r in e["ranks"]})
    if not dead:
        samples = min(len(e["steps"]) for e in table.values())
        note = "" if samples >= DEAD_MIN_SAMPLES else f" (only {samples} sample(s): too few to call one dead)"
        return Finding(
            probe=PROBE,
            check="dead_experts",
            verdict="pass",
            summary=f"every expert of {len(table)} MoE layer(s) received tokens{note}",
            evidence={"min_steps": DEAD_MIN_STEPS, "min_samples": DEAD_MIN_SAMPLES},
            where={"ranks": ranks},
        )
    order = sorted(dead, key=lambda k: -len(dead[k]["experts"]))
    parts = [
        f"layer {k}: {len(dead[k]['experts'])} of {dead[k]['of']} experts "
        f"({', '.join(map(str, dead[k]['experts'][:8]))}{' ...' if len(dead[k]['experts']) > 8 else ''}) "
        f"since step {dead[k]['since_step']}"
        for k in order[:MAX_LAYERS_NAMED]
    ]
    return Finding(
        probe=PROBE,
        check="dead_experts",
        verdict="warn",
        summary="experts that received no token on any rank (their weights no longer train): "
        + "; ".join(parts),
        evidence={"layers": {str(k): v for k, v in dead.items()}, "min_steps": DEAD_MIN_STEPS},
        where={"layers": order, "ranks": ranks},
    )


def alltoall_finding(records: list[dict[str, Any]]) -> Finding | None:
    """Routed vs even all_to_all (comm-bench --splits-from): per layer the ratio of the medians with its
    95 % interval over the paired rounds (even and routed alternate round by round; measures.student.
    paired_ratio). A layer costs something only when its whole interval lies above 1; the headline is
    the layer whose interval lies highest, or "no measurable cost" when every interval holds 1 (on gloo
    the routed and even dispatches read 0.91-1.10x at random)."""
    from ciuic_doctor.measures.student import paired_ratio

    pairs: dict[Any, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        if (
            r.get("collective") == "all_to_all"
            and r.get("splits") in ("routed", "even")
            and r.get("status", "ok") == "ok"
        ):
            pairs[r.get("layer")][r["splits"]] = r
    rows = []
    for layer, pair in pairs.items():
        routed, even = pair.get("routed"), pair.get("even")
        if not routed or not even or not even.get("time_us_p50") or not routed.get("time_us_p50"):
            continue
        rounds = [
            [v for v in side.get("round_p50_us") or [] if isinstance(v, int | float)]
            for side in (even, routed)
        ]
        paired = paired_ratio(rounds[0], rounds[1]) if len(rounds[0]) == len(rounds[1]) else None
        rows.append(
            {
                "layer": layer,
                "routed_us": routed["time_us_p50"],
                "even_us": even["time_us_p50"],
                "routed_mean_us": routed.get("time_us"),
                "even_mean_us": even.get("time_us"),
                "ratio": round(paired[0] if paired else routed["time_us_p50"] / even["time_us_p50"], 3),
                "ci_low": round(paired[1], 3) if paired else None,
                "ci_high": round(paired[2], 3) if paired else None,
                "rounds": len(rounds[0]) if paired else None,
                "bytes_per_rank": routed.get("bytes"),
                "max_rank_send_bytes": routed.get("max_send_bytes"),
                "hidden": routed.get("hidden"),
                "hidden_source": routed.get("hidden_source"),
            }
        )
    if not rows:
        return None
    rows.sort(key=lambda row: -(row["ci_low"] if row["ci_low"] is not None else row["ratio"]))
    top = rows[0]
    costly = [row for row in rows if row["ci_low"] is not None and row["ci_low"] > 1.0]
    slow = [row for row in costly if row["ratio"] >= ALLTOALL_WARN]
    assumed = top.get("hidden_source") or ""
    note = f"; token size {assumed}" if assumed.startswith("assumed") else ""
    if costly:
        summary = (
            f"all_to_all with the recorded routing: layer {top['layer']} takes {top['ratio']:.2f}x the time "
            f"of equal splits of the same volume (95 % CI {top['ci_low']:.2f}–{top['ci_high']:.2f}x over "
            f"{top['rounds']} paired rounds; {top['routed_us']:.0f} vs {top['even_us']:.0f} us, medians); "
            f"{len(costly)} of {len(rows)} layer(s) cost measurably"
            + (f"; the router's imbalance costs the dispatch >= {ALLTOALL_WARN}x" if slow else "")
        )
    elif all(row["ci_low"] is not None for row in rows):
        widest = max(max(row["ci_high"], 1 / row["ci_low"]) for row in rows)
        summary = (
            f"all_to_all with the recorded routing: no measurable cost on any of {len(rows)} layer(s): every "
            f"95 % interval holds 1.00x (largest ratio {max(r['ratio'] for r in rows):.2f}x; the rounds "
            f"exclude only changes beyond {widest:.2f}x, more rounds would tell)"
        )
    else:
        summary = (
            f"all_to_all with the recorded routing: layer {top['layer']} {top['ratio']:.2f}x the time of "
            f"equal splits (medians, no per-round times recorded: no interval); {len(rows)} layer(s) measured"
        )
    return Finding(
        probe="comm",
        check="alltoall_routing",
        verdict="warn" if slow else "pass",
        summary=summary + note,
        evidence={"layers": rows, "threshold": ALLTOALL_WARN},
        where={"layers": [row["layer"] for row in slow]},
    )
