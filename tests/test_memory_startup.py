"""A script that dies after one step: the memory it grew on its way (start-up, the crash) is no leak, and
no line beside it may say "+0 MB/step"."""

from __future__ import annotations

from pathlib import Path

from ciuic_doctor.analysis import memory
from ciuic_doctor.recommend.core import Context, Plan
from ciuic_doctor.recommend.memory import rule_memory_findings
from ciuic_doctor.rundir.store import RunDir

MIB = 2**20


def _died_after_one_step(tmp_path: Path) -> RunDir:
    """One step record at t=1000, then 30 s of memwatch samples growing 26 MiB/s with 2.8 GiB free:
    the shape that was called FAIL "runs out in 0.2 h"."""
    run = RunDir.create(tmp_path / "run")
    with run.writer("steps", rank=0, per_rank_file=True) as writer:
        writer.write({"rank": 0, "step": 1, "t": 1000.0, "step_time_s": None, "rss": 300 * MIB})
    with run.writer("memwatch") as writer:
        for i in range(60):
            rss = 300 * MIB + int(13 * MIB * i)
            writer.write({"t": 1000.0 + 0.5 * i, "pid": 7, "role": "rank 0", "rank": 0, "rss": rss,
                          "sys_available_bytes": 2800 * MIB})  # fmt: skip
    return run


def test_growth_outside_the_steps_is_not_a_leak(tmp_path):
    findings = memory.analyze(_died_after_one_step(tmp_path))
    host = next(f for f in findings if f.check == "memory_leak" and f.evidence.get("kind") == "host")
    assert host.verdict == "not_run", host
    assert "outside its 1 recorded step" in host.summary
    ctx = Context(spec=None, findings=findings)  # type: ignore[arg-type]
    plan = Plan()
    rule_memory_findings(ctx, plan)
    assert not [r for r in plan.recommendations if r.setting.startswith("memory leak")]


def test_a_time_based_leak_reads_per_second(tmp_path):
    """A leak judged per second (a process without steps) is worded per second, never "+0 MB/step"."""
    from ciuic_doctor.rundir.findings import Finding

    leak = Finding(probe="memory", check="memory_leak", verdict="fail", summary="s",
                   evidence={"kind": "host", "growth_mb_per_s": 26.0, "projected_oom_s": 814.0},
                   where={"rank": 0})  # fmt: skip
    plan = Plan()
    rule_memory_findings(Context(spec=None, findings=[leak]), plan)  # type: ignore[arg-type]
    assert plan.recommendations[0].value.startswith("+26 MB/s, out of memory in ~814 s")
