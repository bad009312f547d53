"""Compare two runs: did the change help, by how much, and is it more than the runs' own noise?

    from ciuic_doctor.compare import compare_runs
    result = compare_runs(RunDir.open("reports/before"), RunDir.open("reports/after"))
    print("\\n".join(result.lines()))  # num_workers 2 → 0: step time −12 % (95 % CI −15 … −9 %) ...
    result.frame()                        # one row per measurement, units in the column names

Run A is the baseline, run B the candidate; every ratio is B / A. For every measurement both runs have
(step time overall and per rank, throughput, loss at matched steps, skipped steps, memory, loader-sweep
configurations, comm-bench sizes, checkpoint save / load) there is a `Change` with its 95 % interval, and
one finding per check in the common schema (probe "compare"; evidence `ratio`, `ci_low`, `ci_high`,
`significant`). The statistics are in `stats` (circular block bootstrap for autocorrelated step times,
Holm's correction within a check), the settings that differ in `settings`.

Not an auto-discovered analysis module (analysis/ judges one run; this needs two).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.compare.change import Change
from ciuic_doctor.compare.settings import SettingChange, headline, settings_diff
from ciuic_doctor.rundir.findings import Finding, overall_verdict
from ciuic_doctor.rundir.store import RunDir

STREAMS = ("steps", "loader", "comm", "checkpoint", "memwatch")


@dataclass(kw_only=True)
class Comparison:
    run_a: str
    run_b: str
    settings: list[SettingChange] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def overall(self) -> str:
        return overall_verdict(self.findings)

    def lines(self) -> list[str]:
        """What `ciuic-doctor compare` prints: the settings, then one line per finding."""
        return summary_lines(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "run_a": self.run_a,
            "run_b": self.run_b,
            "overall": self.overall,
            "settings": [s.to_dict() for s in self.settings],
            "findings": [f.to_dict() for f in self.findings],
            "changes": [c.to_dict() for c in self.changes],
        }

    def frame(self):  # -> pandas.DataFrame
        """One row per measurement, HTA style: units in the column names (pandas imported here)."""
        import pandas as pd

        return pd.DataFrame.from_records(
            [
                {
                    "check": c.check,
                    "metric": c.metric,
                    "scope": c.scope,
                    "unit": c.unit,
                    "a": c.a,
                    "b": c.b,
                    "ratio": c.ratio,
                    "change_pct": None if c.ratio is None else 100 * (c.ratio - 1),
                    "ci_low_pct": None if c.ci_low is None else 100 * (c.ci_low - 1),
                    "ci_high_pct": None if c.ci_high is None else 100 * (c.ci_high - 1),
                    "p_value": c.p_value,
                    "p_adjusted": c.p_adjusted,
                    "significant": c.significant,
                    "change": c.direction,
                }
                for c in self.changes
            ]
        )


def summary_lines(data: dict[str, Any]) -> list[str]:
    """The printed comparison from its JSON form (comparison.json), so `checkup --baseline` can print
    what `report --baseline` computed without computing it again."""
    settings = [SettingChange(**s) for s in data.get("settings") or []]
    prefix = f"{headline(settings)}: "
    lines = [f"A (baseline) {data.get('run_a')}", f"B            {data.get('run_b')}"]
    lines.append(f"settings: {headline(settings, limit=len(settings) or 1)}")
    if any(s.key == "job.name" or s.key.startswith("model.") for s in settings):
        lines.append("note: A and B train different models: each ratio compares the jobs, not one setting")
    findings = data.get("findings") or []
    for f in findings:
        summary = str(f.get("summary", ""))
        summary = summary[len(prefix) :] if summary.startswith(prefix) else summary
        lines.append(f"  {str(f.get('verdict')).replace('_', ' '):8s} {f.get('check', ''):14s} {summary}")
    judged = sum(
        1 for f in findings if f.get("verdict") != "not_run" and f.get("check") != "records_readable"
    )
    lines.append(
        f"{judged} checks compared, each at 5 % (rows within a check Holm-corrected): a check whose change "
        "is only noise is still called significant once in 20. The intervals hold each run's own noise; "
        "load that differed between the two runs' times is not in them (run the two close together)."
    )
    return lines


def _batch(meta: dict[str, Any]) -> tuple[int, int] | None:
    """(samples, tokens) per optimizer step of the whole job, from what the job recorded."""
    spec = meta.get("spec") if isinstance(meta.get("spec"), dict) else {}
    batch = spec.get("batch") if isinstance(spec.get("batch"), dict) else {}
    samples = (meta.get("job_run") or {}).get("global_batch")
    if not isinstance(samples, int):
        samples = _observed_global_batch(meta)
    if not isinstance(samples, int):
        return None
    seq_len = batch.get("seq_len")
    return samples, samples * seq_len if isinstance(seq_len, int) else 0


def _observed_global_batch(meta: dict[str, Any]) -> int | None:
    """A watched script's samples per optimizer step: the loader's batch x micro-batches accumulated x
    ranks (observed.batch.per_process, grad_accum, distributed.world_size; one rank when it made none)."""
    observed = meta.get("observed") if isinstance(meta.get("observed"), dict) else {}
    batch = observed.get("batch") if isinstance(observed.get("batch"), dict) else {}
    per_process = batch.get("per_process")
    if not isinstance(per_process, int) or isinstance(per_process, bool) or per_process <= 0:
        return None
    accum = batch.get("grad_accum")
    distributed = observed.get("distributed") if isinstance(observed.get("distributed"), dict) else {}
    world = distributed.get("world_size")
    accum = accum if isinstance(accum, int) and accum > 0 else 1
    world = world if isinstance(world, int) and world > 0 else 1
    return per_process * accum * world


def _unreadable(run: RunDir, name: str) -> list[Finding]:
    """What a run's readers skipped (a stream that is a folder, torn or off-schema lines), as analyze
    says it: the comparison judged the rest, and must say so."""
    from ciuic_doctor.analysis import records_finding

    found = records_finding(run)
    if found is None:
        return []
    found.probe = "compare"
    found.summary = f"run {name} ({run.path}): {found.summary}"
    return [found]


def compare_runs(run_a: RunDir, run_b: RunDir) -> Comparison:
    """Every measurement both runs have, compared (A is the baseline)."""
    from ciuic_doctor.compare import loss, steps, streams
    from ciuic_doctor.compare.change import finding_for, judge_family

    meta_a, meta_b = run_a.read_meta(), run_b.read_meta()
    result = Comparison(run_a=str(run_a.path), run_b=str(run_b.path), settings=settings_diff(meta_a, meta_b))
    prefix = f"{headline(result.settings)}: "
    data_a = {name: run_a.read(name).records for name in STREAMS}
    data_b = {name: run_b.read(name).records for name in STREAMS}

    if data_a["steps"] and data_b["steps"]:
        found, rows = steps.step_time_findings(
            data_a["steps"], data_b["steps"], batch_a=_batch(meta_a), batch_b=_batch(meta_b), prefix=prefix
        )
        result.findings += found
        result.changes += rows
        finding, change = loss.loss_finding(data_a["steps"], data_b["steps"], prefix)
        result.findings.append(finding)
        result.changes.append(change)
        result.findings.append(steps.skipped_finding(data_a["steps"], data_b["steps"], prefix))
    memory = steps.memory_changes(data_a["steps"], data_b["steps"])
    memory += streams.memwatch_changes(data_a["memwatch"], data_b["memwatch"])
    families = [
        ("memory", memory, "memory figures"),
        ("loader", streams.loader_changes(data_a["loader"], data_b["loader"]), "loader-sweep configurations"),
        ("busbw", streams.comm_changes(data_a["comm"], data_b["comm"]), "comm-bench sizes"),
        (
            "checkpoint",
            streams.checkpoint_changes(data_a["checkpoint"], data_b["checkpoint"], meta_a, meta_b),
            "checkpoint timings",
        ),
    ]
    for check, rows, what in families:
        judge_family(rows)
        result.changes += rows
        if rows:
            result.findings.append(finding_for(check, rows, prefix=prefix, what=what))
        else:
            result.findings.append(
                Finding(
                    probe="compare",
                    check=check,
                    verdict="not_run",
                    summary=f"{what}: not compared (not measured in both runs)",
                )
            )
    result.findings += _unreadable(run_a, "A") + _unreadable(run_b, "B")
    if not (data_a["steps"] and data_b["steps"]):
        result.findings.insert(
            0,
            Finding(
                probe="compare",
                check="step_time",
                verdict="not_run",
                summary="step times: not compared (no step records in both runs)",
            ),
        )
    return result
