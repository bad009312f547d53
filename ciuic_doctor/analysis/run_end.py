"""The `watch / run_end` finding: how a watched run ended, when it did not end well (none when it finished).

A run that crashed (a fatal signal: SIGSEGV, SIGABRT, SIGBUS ...) fails: its records stop at the crash and a
deploy gate (`analyze RUN && deploy`) must not pass it. A run killed (SIGTERM, SIGKILL), interrupted, failed
with an exception, or gone without any record warns: the findings judge the records it left. The status
comes from meta.json, with a `running` record whose process is gone read as `ended_unrecorded`
(ciuic_doctor.rundir.watch_end), so no reader ever calls a dead run `running`.
"""

from __future__ import annotations

from typing import Any

from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.watch_end import ABNORMAL, describe, watch_record


def run_end_finding(meta: dict[str, Any]) -> Finding | None:
    record = watch_record(meta)
    if record is None or record.get("status") not in ABNORMAL:
        return None
    status = record["status"]
    summary = f"the watched script {describe(record)}"
    if isinstance(record.get("steps"), int):
        summary += f" after {record['steps']} recorded steps"
    summary += ": the findings judge the records it left"
    if status == "crashed":
        summary += "; Python's stacks at the signal: hang.rank0.fatal.txt"
    elif record.get("reason"):
        summary += f" ({record['reason']})"
    evidence = {
        k: record.get(k) for k in ("status", "signal", "exit_code", "seen_by", "pid", "host") if k in record
    }
    return Finding(
        probe="watch",
        check="run_end",
        verdict="fail" if status == "crashed" else "warn",
        summary=summary,
        evidence=evidence,
    )
