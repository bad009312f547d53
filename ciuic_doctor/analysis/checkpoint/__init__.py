"""Judge checkpoint-check's records (stream `checkpoint`): what a checkpoint costs, whether its save fits
the process-group timeout, whether a resumed run continues the original, and whether the file is safe.

- `checkpoint_cost`: rank 0's save time, the other ranks' barrier wait, size, load time and peak host
  memory, for every rank loading itself and for the seed's rank-0 load + broadcast, side by side. Every
  rank blocks for the save each `checkpoint.every_steps` steps: above SAVE_OVERHEAD_WARN of the training
  time between checkpoints it is a warning; so is loading on every local rank at once needing more than
  MEMORY_WARN_FRACTION of the host's available memory (a fail above all of it). Either trigger puts the
  hint "torch.distributed.checkpoint (sharded, async_save)" in the evidence, with the measurement behind it.
- `timeout_risk`: the longest wait inside a collective (rank 0's save, the barrier, the broadcast of a
  rank-0 load) against the job's process-group timeout (PyTorch's default: 600 s NCCL, 1800 s gloo). At or
  over it the job's barrier would time out: fail. Within TIMEOUT_SAFETY_FACTOR of it: warn (a save measured
  once varies with storage and page cache; recommend.py uses the same factor).
- `resume_mismatch`: see checkpoint/resume.py.
- `unsafe_checkpoint`: a file weights_only=True refuses (it names callables to run when unpickled) fails;
  it is never loaded otherwise. `checkpoint_contents` (for `--inspect`): which kinds of state it lacks.

Pure functions of records: no torch.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from ciuic_doctor.analysis.checkpoint.resume import PROBE, REFERENCE, check_resume
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir, as_float
from ciuic_doctor.units import format_bytes

STREAMS = ("checkpoint",)
SAVE_OVERHEAD_WARN = 0.05  # 5 % of training time spent blocked in checkpoints is worth acting on
MEMORY_WARN_FRACTION = 0.5
TIMEOUT_SAFETY_FACTOR = 3.0
DCP_HINT = "torch.distributed.checkpoint (sharded, async_save) instead of rank-0 save + broadcast"

__all__ = ["REFERENCE", "STREAMS", "analyze", "analyze_records", "summary_lines"]


def analyze(run: RunDir) -> list[Finding]:
    from ciuic_doctor.rundir.frames import read_records

    return analyze_records(read_records(run, "checkpoint"))


def analyze_records(records: list[dict[str, Any]]) -> list[Finding]:
    findings: list[Finding] = []
    config = next((r for r in reversed(records) if r.get("kind") == "config"), None)
    if config is not None:
        findings.append(check_cost(records, config))
        findings.append(check_timeout(records, config))
        findings.extend(check_resume(records, exact=config.get("device") == "cpu"))
    for record in records:
        if record.get("kind") == "inspect":
            findings.append(check_unsafe(record))
            if record.get("role") == "file":
                findings.append(check_contents(record))
    return findings


# ---- figures ---------------------------------------------------------------------------------------
def _per_repeat(records: list[dict[str, Any]], kind: str, method: str | None = None) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("kind") == kind and (method is None or r.get("method") == method):
            groups[int(r.get("repeat") or 0)].append(r)
    return groups


def _num(record: dict[str, Any], key: str) -> float:
    return as_float(record.get(key)) or 0.0


def _median_of_max(groups: dict[int, list[dict]], key: str, ranks: set[int] | None = None) -> float | None:
    """Per repetition the slowest rank's figure (the job waits for the slowest), then the median."""
    values = []
    for group in groups.values():
        picked = [_num(r, key) for r in group if ranks is None or r.get("rank", 0) in ranks]
        if picked:
            values.append(max(picked))
    return statistics.median(values) if values else None


def _max(groups: dict[int, list[dict]], key: str) -> float | None:
    values = [_num(r, key) for group in groups.values() for r in group if r.get(key) is not None]
    return max(values) if values else None


def cost_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    saves = _per_repeat(records, "save")
    every = _per_repeat(records, "load", "every_rank")
    seed = _per_repeat(records, "load", "rank0_broadcast")
    ranks = {r.get("rank", 0) for group in saves.values() for r in group}
    reference = next((r for r in records if r.get("kind") == "resume" and r.get("variant") == REFERENCE), {})
    rank0_saves = [r for g in saves.values() for r in g if r.get("rank", 0) == 0]
    last_save = max(rank0_saves, key=lambda r: r.get("repeat", 0), default={})
    return {
        "save_s": _median_of_max(saves, "save_s", {0}),
        "gather_s": _median_of_max(saves, "gather_s", {0}),
        "barrier_wait_s": _median_of_max(saves, "barrier_wait_s", ranks - {0}) or 0.0,
        "size_bytes": int(_num(last_save, "size_bytes")),
        "load_s": _median_of_max(every, "load_s"),
        "peak_load_rss_bytes": _max(every, "peak_rss_bytes"),
        "load_rss_delta_bytes": _max(every, "rss_delta_bytes"),
        "load_held_bytes": _max(every, "held_bytes"),
        "broadcast_load_s": _median_of_max(seed, "load_s"),
        "broadcast_peak_rss_bytes": _max(seed, "peak_rss_bytes"),
        "broadcast_rss_delta_bytes": _max(seed, "rss_delta_bytes"),
        "broadcast_held_bytes": _max(seed, "held_bytes"),
        "median_step_s": as_float(reference.get("median_step_s")),
        "repeats": len(saves),
        "per_rank": _per_rank(records, sorted(ranks)),
    }


def _per_rank(records: list[dict[str, Any]], ranks: list[int]) -> list[dict[str, Any]]:
    rows = []
    for rank in ranks:
        mine = [r for r in records if r.get("rank", 0) == rank]

        def med(kind: str, key: str, method: str | None = None, mine: list = mine) -> float | None:
            values = [
                _num(r, key)
                for r in mine
                if r.get("kind") == kind and (method is None or r.get("method") == method)
            ]
            return statistics.median(values) if values else None

        rows.append(
            {
                "rank": rank,
                "save_s": med("save", "save_s"),
                "barrier_wait_s": med("save", "barrier_wait_s"),
                "load_s": med("load", "load_s", "every_rank"),
                "broadcast_load_s": med("load", "load_s", "rank0_broadcast"),
                "peak_load_rss_bytes": med("load", "peak_rss_bytes", "every_rank"),
                "broadcast_peak_rss_bytes": med("load", "peak_rss_bytes", "rank0_broadcast"),
            }
        )
    return rows


# ---- checkpoint_cost ---------------------------------------------------------------------------------
def check_cost(records: list[dict[str, Any]], config: dict[str, Any]) -> Finding:
    fig = cost_figures(records)
    if fig["save_s"] is None:
        return Finding(
            probe=PROBE,
            check="checkpoint_cost",
            verdict="not_run",
            summary="no save was measured (the probe ended before its first save)",
        )
    every_steps = int(config.get("every_steps") or 0)
    blocking_s = max(fig["save_s"] + (fig["gather_s"] or 0.0), fig["barrier_wait_s"])
    triggers: list[str] = []
    verdict = "pass"
    overhead = None
    if every_steps and fig["median_step_s"]:
        overhead = blocking_s / (every_steps * fig["median_step_s"])
        text = (
            f"a save blocks every rank {blocking_s:.3g} s per {every_steps} steps of "
            f"{fig['median_step_s']:.3g} s = {100 * overhead:.1f} % of training time"
        )
        if overhead > SAVE_OVERHEAD_WARN:
            verdict = "warn"
            triggers.append(f"{text} (> {100 * SAVE_OVERHEAD_WARN:g} %)")
        else:
            triggers.append(f"{text} (≤ {100 * SAVE_OVERHEAD_WARN:g} %)")
    local = int(config.get("local_world_size") or config.get("nproc") or 1)
    available = as_float(config.get("host_available_bytes"))
    # What one rank's load needs: the RSS it added, or at least the tensor bytes it holds (a warm process
    # reuses freed heap; a resumed job's fresh process does not).
    per_rank = [fig[k] for k in ("load_rss_delta_bytes", "load_held_bytes") if fig[k] is not None]
    host_load_bytes = local * max(per_rank) if per_rank else None
    if host_load_bytes is not None and available:
        share = host_load_bytes / available
        text = (
            f"loading on {local} local rank(s) at once takes {format_bytes(host_load_bytes)} "
            f"of {format_bytes(available)} available"
        )
        if share > 1.0:
            verdict = "fail"
            triggers.append(f"{text}: more than the host has")
        elif share > MEMORY_WARN_FRACTION:
            verdict = "warn" if verdict == "pass" else verdict
            triggers.append(f"{text} (> {100 * MEMORY_WARN_FRACTION:g} %)")
        else:
            triggers.append(text)
    faster = None
    if fig["load_s"] is not None and fig["broadcast_load_s"] is not None:
        faster = "every_rank" if fig["load_s"] <= fig["broadcast_load_s"] else "rank0_broadcast"
    evidence = {
        **{k: v for k, v in fig.items() if k != "per_rank"},
        "blocking_s": blocking_s,
        "every_steps": every_steps,
        "save_overhead_pct": None if overhead is None else 100 * overhead,
        "host_load_bytes": host_load_bytes,
        "host_available_bytes": available,
        "local_world_size": local,
        "faster_load": faster,
        "per_rank": fig["per_rank"],
        "hint": DCP_HINT if verdict != "pass" else None,
        "hint_trigger": "; ".join(triggers)
        or "no step time or checkpoint interval to weigh the save against",
    }
    summary = (
        f"save {fig['save_s']:.3g} s ({format_bytes(fig['size_bytes'])}) on rank 0, others waited "
        f"{fig['barrier_wait_s']:.3g} s at the barrier"
    )
    if fig["load_s"] is not None:
        summary += f"; load: every rank {fig['load_s']:.3g} s"
    if fig["broadcast_load_s"] is not None:
        summary += f" vs rank 0 + broadcast {fig['broadcast_load_s']:.3g} s"
    if overhead is not None:
        summary += f"; {100 * overhead:.1f} % of training time at every {every_steps} steps"
    if verdict != "pass":
        summary += f" — {triggers[-1] if verdict == 'fail' else triggers[0]}"
    return Finding(probe=PROBE, check="checkpoint_cost", verdict=verdict, summary=summary, evidence=evidence)


# ---- timeout_risk ------------------------------------------------------------------------------------
def check_timeout(records: list[dict[str, Any]], config: dict[str, Any]) -> Finding:
    timeout_s = as_float(config.get("timeout_s"))
    saves = [r for r in records if r.get("kind") == "save"]
    if not saves or not timeout_s:
        return Finding(
            probe=PROBE,
            check="timeout_risk",
            verdict="not_run",
            summary="no save measured or no timeout in the spec",
        )
    save_s = max(_num(r, "save_s") + _num(r, "gather_s") for r in saves if r.get("rank", 0) == 0)
    barrier_s = max(_num(r, "barrier_wait_s") for r in saves)
    broadcast_s = max(
        (_num(r, "broadcast_wait_s") for r in records if r.get("method") == "rank0_broadcast"), default=0.0
    )
    waits = {
        "rank 0's save (others wait for it)": save_s,
        "barrier wait after the save": barrier_s,
        "wait in the broadcast of the seed's rank-0 load": broadcast_s,
    }
    label, longest = max(waits.items(), key=lambda kv: kv[1])
    evidence = {
        "save_s": save_s,
        "barrier_wait_s": barrier_s,
        "broadcast_wait_s": broadcast_s,
        "timeout_s": timeout_s,
        "longest_wait": label,
        "longest_wait_s": longest,
        "safety_factor": TIMEOUT_SAFETY_FACTOR,
        "pytorch_default_timeout_s": as_float(config.get("pytorch_default_timeout_s")),
        "backend": config.get("backend"),
        "probe_timeout_s": as_float(config.get("probe_timeout_s")),
    }
    figures = f"{label}: {longest:.3g} s (worst of {len({r.get('repeat') for r in saves})} repetition(s))"
    if longest >= timeout_s:
        verdict = "fail"
        summary = (
            f"{figures} ≥ the job's process-group timeout {timeout_s:g} s: in the job this collective would "
            f"time out (measured here under a {evidence['probe_timeout_s'] or 0:g} s timeout)"
        )
        evidence["hint"] = (
            f"raise distributed.timeout_s to ≥ {TIMEOUT_SAFETY_FACTOR * longest:.0f} s, or {DCP_HINT}"
        )
    elif longest * TIMEOUT_SAFETY_FACTOR > timeout_s:
        verdict = "warn"
        summary = f"{figures}: within {TIMEOUT_SAFETY_FACTOR:g}× of the process-group timeout {timeout_s:g} s"
        evidence["hint"] = f"raise distributed.timeout_s to ≥ {TIMEOUT_SAFETY_FACTOR * longest:.0f} s"
    else:
        verdict = "pass"
        cover = timeout_s / max(longest, 1e-9)
        summary = f"{figures}; the process-group timeout {timeout_s:g} s covers it {cover:.0f}×"
    return Finding(probe=PROBE, check="timeout_risk", verdict=verdict, summary=summary, evidence=evidence)


# ---- the file itself ---------------------------------------------------------------------------------
def check_unsafe(record: dict[str, Any]) -> Finding:
    path = record.get("path")
    evidence = {
        "path": path,
        "container": record.get("container"),
        "unsafe_globals": record.get("unsafe_globals") or [],
        "weights_only_loaded": record.get("weights_only_loaded"),
        "error": record.get("error"),
        "role": record.get("role"),
    }
    safe = record.get("safe")
    if safe is True:
        summary = f"{path}: loads with torch.load(weights_only=True) (tensors and plain containers only)"
        return Finding(
            probe=PROBE, check="unsafe_checkpoint", verdict="pass", summary=summary, evidence=evidence
        )
    if safe is False:
        names = ", ".join(evidence["unsafe_globals"]) or "callables outside the weights_only allowlist"
        return Finding(
            probe=PROBE,
            check="unsafe_checkpoint",
            verdict="fail",
            summary=f"{path}: needs arbitrary pickle ({names}); loading it with weights_only=False would run "
            "that code, so it was not loaded. Save plain state_dicts (tensors, numbers, strings)",
            evidence=evidence,
        )
    return Finding(
        probe=PROBE,
        check="unsafe_checkpoint",
        verdict="not_run",
        evidence=evidence,
        summary=f"{path}: {record.get('error') or 'not a torch.save file'}",
    )


def check_contents(record: dict[str, Any]) -> Finding:
    present = record.get("present") or {}
    missing = list(record.get("missing") or [])
    conditional = record.get("conditional") or {}
    guessed = bool(record.get("guessed_from_names"))
    evidence = {
        "path": record.get("path"),
        "present": present,
        "missing": missing,
        "conditional": conditional,
        "guessed_from_names": guessed,
    }
    how = " (guessed from key names in the pickle: it was not loaded)" if guessed else ""
    extra = "; " + "; ".join(f"{k}: {why}" for k, why in conditional.items()) if conditional else ""
    if missing:
        evidence["hint"] = "also save: " + ", ".join(missing)
        summary = f"lacks {', '.join(missing)}{how}: a resumed run will not continue the same run{extra}"
        return Finding(
            probe=PROBE, check="checkpoint_contents", verdict="warn", summary=summary, evidence=evidence
        )
    summary = f"holds every kind of state a resume needs{how}{extra}"
    return Finding(
        probe=PROBE, check="checkpoint_contents", verdict="pass", summary=summary, evidence=evidence
    )


# ---- printing ----------------------------------------------------------------------------------------
def summary_lines(findings: list[Finding]) -> list[str]:
    """The findings one per line, then the two load methods side by side when both were measured."""
    lines = [f"{f.verdict.upper():<7} {f.check:<19} {f.summary}" for f in findings]
    cost = next((f for f in findings if f.check == "checkpoint_cost" and f.verdict != "not_run"), None)
    if cost is not None and cost.evidence.get("broadcast_load_s") is not None:
        ev = cost.evidence
        lines += [
            "",
            f"{'load, side by side':<28} {'time (slowest rank)':>20} {'peak RSS':>12} {'RSS added':>12}"
            f" {'tensors held':>13}",
            _row(
                "every rank reads the file",
                ev["load_s"],
                ev["peak_load_rss_bytes"],
                ev["load_rss_delta_bytes"],
                ev.get("load_held_bytes"),
            ),
            _row(
                "rank 0 reads + broadcast",
                ev["broadcast_load_s"],
                ev["broadcast_peak_rss_bytes"],
                ev["broadcast_rss_delta_bytes"],
                ev.get("broadcast_held_bytes"),
            ),
            "(RSS added is on a warm process, which reuses heap freed earlier; a fresh one needs at least "
            "the tensors held)",
        ]
    hint = cost.evidence.get("hint") if cost is not None else None
    if hint:
        lines.append(f"hint: {hint} ({cost.evidence['hint_trigger']})")
    return lines


def _row(name: str, seconds: Any, peak: Any, delta: Any, held: Any) -> str:
    def size(n: Any) -> str:
        return format_bytes(n) if n is not None else "—"

    time_s = f"{seconds:.3f} s" if seconds is not None else "—"
    return f"{name:<28} {time_s:>20} {size(peak):>12} {size(delta):>12} {size(held):>13}"
