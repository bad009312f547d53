"""Throughput, MFU and goodput of a watched job (stream `steps`, meta.json `model`, `env`, `mfu`).

- `throughput`: tokens per second per rank and for the job, from the tokens each step's model saw (watch
  counts the input ids handed to the model's forward) over the step's time; the median over steady steps
  (the first WARMUP_STEPS left out).
- `mfu`: FLOPs per token of the recorded model config (ciuic_doctor/mfu/flops.py) × tokens/s per rank ÷ the
  device's dense peak for the job's precision (ciuic_doctor/mfu/peak.py). Stated in our convention (explicit
  matmuls, causal attention halved) with torchtitan's and Megatron's beside it, so the figure can be set
  against what a trainer prints. not_run, with the reason, on a device the table does not know (a CPU
  run): `ciuic-doctor analyze RUN --peak-tflops X` gives the peak.
- `goodput`: the share of wall-clock time spent on productive steps (Google's ML Productivity Goodput):
  from the run's start (meta.json created) to the last step record; a kept step's productive time is its
  step time up to the run's typical (median) step, so skipped steps (GradScaler), the excess of a stalled
  or checkpointing step over the typical one, start-up (up to the end of step 1, whose warm-up is no
  training pace), restarts (gaps between segments) and repeated steps after a rollback are not
  productive. Judged per rank; the worst rank is the job's figure; warn
  below GOODPUT_WARN of the time after start-up.

Pure functions of records: no torch.
"""

from __future__ import annotations

import statistics
from typing import Any

from ciuic_doctor.analysis.stats.signs import Signs, from_counts
from ciuic_doctor.mfu.flops import CONVENTION_NOTES, ConfigError, flops_per_token
from ciuic_doctor.mfu.peak import peak_tflops
from ciuic_doctor.rundir.findings import Finding, some_ranks
from ciuic_doctor.rundir.store import RunDir, as_float

STREAMS = ("steps",)
SECONDS_PER_MILLION_STEP_ROWS = 0.10  # 0.99 s at 10,000 ranks × 1,000 steps (side by side: longest first)
PROBE = "throughput"
WARMUP_STEPS = 2
MFU_MAX = 1.0  # the peak is the dense matmul ceiling: a figure above it means an input is wrong
GOODPUT_MIN_STEPS = 10  # fewer steps after start-up: one stall on a shared machine is 10 % of the run
GOODPUT_WARN = 0.8  # after start-up, 20 % of the time unproductive is worth a look (stalls, skips, restarts)
COLUMNS = ("rank", "step", "t", "step_time_s", "tokens", "skipped", "segment", "optimizer", "loss")


def _precision(meta: dict[str, Any]) -> str:
    spec = (meta.get("spec") or {}).get("precision") or {}
    observed = (
        ((meta.get("observed") or {}).get("precision") or {})
        if isinstance(meta.get("observed"), dict)
        else {}
    )
    mode = spec.get("mode") or observed.get("mode")
    return mode if isinstance(mode, str) else "bf16"


def _device(meta: dict[str, Any]) -> str | None:
    devices = (meta.get("env") or {}).get("devices") or []
    names = [d.get("name") for d in devices if isinstance(d, dict) and isinstance(d.get("name"), str)]
    return names[0] if names else None


def analyze(run: RunDir) -> list[Finding]:
    from ciuic_doctor.analysis.throughput.columns import per_rank
    from ciuic_doctor.rundir.frames import read_stream

    meta = run.read_meta()
    table = read_stream(run, "steps", COLUMNS).table
    if not table.num_rows:
        return []
    signs = _loss_signs(table)
    rates, good = per_rank(table, meta.get("created"), tokens_per_s, goodput)
    del table
    return [throughput_finding(rates), mfu_finding(rates, meta), goodput_finding(good, signs)]


def _loss_signs(table) -> Signs | None:
    """Whether the recorded loss goes below zero (stats.signs: a policy gradient's, whose steps are
    episodes of unequal length), counted by pyarrow without a copy of the column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if "loss" not in table.column_names:
        return None
    loss = table.column("loss")
    if not (pa.types.is_floating(loss.type) or pa.types.is_integer(loss.type)):
        return None  # no loss recorded (a null column)
    finite = pc.is_finite(loss)

    def count(mask) -> int:
        return int(pc.sum(pc.and_kleene(mask, finite)).as_py() or 0)

    return from_counts(count(pc.less(loss, 0)), count(pc.greater(loss, 0)), count(finite))


def tokens_per_s(rows: list[dict[str, Any]]) -> float | None:
    """Median tokens / step time over the steady steps of one rank (None without token counts)."""
    rows = sorted(rows, key=lambda r: (r.get("segment") or 1, r.get("step") or 0))
    steady = rows[WARMUP_STEPS:] if len(rows) > WARMUP_STEPS + 2 else rows
    rates = [
        tokens / time_s
        for r in steady
        if (tokens := as_float(r.get("tokens"))) and (time_s := as_float(r.get("step_time_s"))) and time_s > 0
    ]
    return statistics.median(rates) if rates else None


def throughput_finding(rates: dict[int, float]) -> Finding:
    if not rates:
        return Finding(
            probe=PROBE,
            check="throughput",
            verdict="not_run",
            summary="no token counts in the step records: the model was never called with token ids "
            "(watch counts the input_ids its forward receives)",
        )
    ranks = sorted(rates, key=lambda r: rates[r])
    total = sum(rates.values())
    return Finding(
        probe=PROBE,
        check="throughput",
        verdict="pass",
        summary=f"{total:,.0f} tokens/s over {len(rates)} rank(s) (median of steady steps; slowest rank "
        f"{ranks[0]}: {rates[ranks[0]]:,.0f} tokens/s)",
        evidence={
            "tokens_per_s": total,
            "tokens_per_s_per_rank": some_ranks(rates, sorted(rates, key=rates.__getitem__)),  # slowest first
            "ranks_measured": len(rates),
        },
        where={"ranks": ranks},
    )


def _mfu_missing(rates: dict[int, float], config: Any, seq_len: Any) -> str:
    """Why MFU cannot be computed, as a clause: what is not recorded, named one by one."""
    if not rates:
        return "no token counts in the step records"
    absent = [
        name
        for name, ok in (("config", isinstance(config, dict)), ("sequence length", isinstance(seq_len, int)))
        if not ok
    ]
    noun = " and ".join(absent)
    verb = "are" if len(absent) > 1 else "is"
    return f"the model's {noun} {verb} not recorded (meta.json model.config, model.seq_len)"


def mfu_finding(rates: dict[int, float], meta: dict[str, Any]) -> Finding:
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    config, seq_len = model.get("config"), model.get("seq_len")
    if not rates or not isinstance(config, dict) or not isinstance(seq_len, int):
        return Finding(
            probe=PROBE,
            check="mfu",
            verdict="not_run",
            summary=f"MFU not computed: {_mfu_missing(rates, config, seq_len)}",
        )
    try:
        flops = flops_per_token(config, seq_len=seq_len, mtp_layers=model.get("mtp_layers_run"))
    except ConfigError as exc:
        return Finding(probe=PROBE, check="mfu", verdict="not_run", summary=f"MFU not computed: {exc}")
    given = (meta.get("mfu") or {}).get("peak_tflops") if isinstance(meta.get("mfu"), dict) else None
    peak = peak_tflops(_device(meta), _precision(meta), given=as_float(given))
    per_rank = statistics.median(rates.values())
    conventions = {name: flops.get(name) for name in CONVENTION_NOTES}
    evidence: dict[str, Any] = {
        "flops": flops.to_dict(),
        "tokens_per_s_per_rank": per_rank,
        "peak_tflops": peak.tflops,
        "peak_device": peak.device,
        "peak_dtype": peak.dtype,
        "peak_source": peak.source,
        "convention": "ciuic",
        "achieved_tflops": {name: f * per_rank / 1e12 for name, f in conventions.items()},
    }
    per_token = (
        f"{flops.ciuic / 1e9:.4g} GFLOP/token (ciuic: explicit matmuls, causal attention halved; "
        f"torchtitan {flops.torchtitan / 1e9:.4g}, Megatron {flops.megatron / 1e9:.4g}) at seq {seq_len}"
    )
    if peak.tflops is None:
        return Finding(
            probe=PROBE,
            check="mfu",
            verdict="not_run",
            summary=f"MFU not computed: {peak.reason}. {per_token}; "
            f"{evidence['achieved_tflops']['ciuic']:.3g} TFLOP/s per rank achieved",
            evidence=evidence,
        )
    mfu = {name: value / peak.tflops for name, value in evidence["achieved_tflops"].items()}
    evidence["mfu"] = mfu
    if not mfu["ciuic"] <= MFU_MAX:
        return Finding(
            probe=PROBE,
            check="mfu",
            verdict="fail",
            summary=f"MFU {100 * mfu['ciuic']:.4g} % (ciuic convention) is above 100 %, which no device "
            f"reaches: an input is wrong: the peak {peak.tflops:g} TFLOP/s ({peak.device or 'given'}, "
            f"{peak.source}), the model config in meta.json, or the token counts of the step records; "
            f"{per_token}",
            evidence=evidence,
        )
    return Finding(
        probe=PROBE,
        check="mfu",
        verdict="pass",
        summary=f"MFU {100 * mfu['ciuic']:.1f} % in the ciuic convention (explicit matmuls, causal attention "
        f"halved); torchtitan's convention {100 * mfu['torchtitan']:.1f} %, Megatron's "
        f"{100 * mfu['megatron']:.1f} %; against {peak.tflops:g} TFLOP/s ({peak.device or 'given'}, "
        f"{peak.dtype} dense, {peak.source}); {per_token}",
        evidence=evidence,
    )


def goodput(rows: list[dict[str, Any]], created: Any) -> dict[str, float] | None:
    """One rank's goodput and where the rest of its time went (seconds)."""
    first_optimizer = min((o for r in rows if isinstance(o := r.get("optimizer"), int | float)), default=None)
    rows = [
        r for r in rows if as_float(r.get("t")) is not None and r.get("optimizer") in (None, first_optimizer)
    ]  # one record a step: the first optimizer's (a GAN's second optimizer steps in the same step)
    if len(rows) < 3:
        return None
    rows.sort(key=lambda r: r["t"])
    times = [v for r in rows if (v := as_float(r.get("step_time_s"))) is not None and v > 0]
    if not times:
        return None
    typical = statistics.median(times)
    end = rows[-1]["t"]
    first_end = rows[0]["t"]  # step 1 (allocator, DataLoader and compile warm-up) counts as start-up
    start = first_end - (as_float(rows[0].get("step_time_s")) or typical)
    if isinstance(created, int | float) and created < start:
        start = float(created)
    kept: dict[int, float] = {}  # the last record of a step number counts (a rollback redoes it)
    skipped_s = stalled_s = 0.0
    for r in rows[1:]:
        step_s = as_float(r.get("step_time_s")) or 0.0
        key = r.get("step") or 0
        if r.get("skipped") is True or (isinstance(r.get("skipped"), int) and r.get("skipped")):
            skipped_s += step_s
            kept.pop(key, None)
            continue
        kept[key] = min(step_s, typical)
        stalled_s += max(0.0, step_s - typical)
    wall = end - start
    if wall <= 0:
        return None
    productive = sum(kept.values())
    startup = first_end - start
    return {
        "goodput": productive / wall,
        "goodput_after_startup": productive / max(wall - startup, 1e-9),
        "wall_s": wall,
        "productive_s": productive,
        "startup_s": startup,
        "skipped_s": skipped_s,
        "over_typical_s": stalled_s,
        "typical_step_s": typical,
        "steps": len(rows) - 1,
    }


def goodput_finding(good: dict[int, dict[str, float]], signs: Signs | None = None) -> Finding:
    """The goodput of the worst rank. With a loss below zero (`signs`: a policy gradient's, one step an
    episode) a step that takes longer did more work, so time over the typical step is not called a stall
    and low goodput is not warned."""
    if not good:
        return Finding(
            probe=PROBE, check="goodput", verdict="not_run", summary="goodput not computed: too few steps"
        )
    ranks = sorted(good, key=lambda r: good[r]["goodput_after_startup"])
    worst = good[ranks[0]]
    low = worst["goodput_after_startup"] < GOODPUT_WARN
    verdict = "warn" if low and worst["steps"] >= GOODPUT_MIN_STEPS and signs is None else "pass"
    note = f"; below {GOODPUT_WARN:.0%} after start-up" if verdict == "warn" else ""
    if low and verdict == "pass":
        note = f"; {worst['steps']} steps after start-up are too few to judge (from {GOODPUT_MIN_STEPS})"
    longer = "(stalls, evaluation, checkpoints, data waits)"
    if signs is not None:
        longer = "(steps of unequal work, not stalls)"
        note = (
            f"; not judged: the loss goes below 0 ({signs.negative} of {signs.points} values), "
            "as a policy gradient's does, whose step is an episode: a longer episode is a longer step"
        )
    return Finding(
        probe=PROBE,
        check="goodput",
        verdict=verdict,
        summary=f"goodput {100 * worst['goodput']:.0f} % of wall-clock on rank {ranks[0]} "
        f"({100 * worst['goodput_after_startup']:.0f} % after {worst['startup_s']:.1f} s start-up): "
        f"{worst['productive_s']:.1f} s productive of {worst['wall_s']:.1f} s; "
        f"{worst['over_typical_s']:.1f} s in steps longer than the typical {worst['typical_step_s']:.3f} s "
        f"{longer}, {worst['skipped_s']:.1f} s in skipped steps" + note,
        evidence={"ranks": some_ranks(good, ranks), "ranks_judged": len(good), "threshold": GOODPUT_WARN},
        where={"ranks": ranks[:8]},
    )
