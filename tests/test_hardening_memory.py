"""Leak verdicts on series that only look like leaks (issue 11): a one-time level shift (mnist's jump
between epochs) is not a leak, and a 4-step run sampled at 10 Hz has too few steady points to judge."""

from __future__ import annotations

import random

import pytest

from ciuic_doctor.analysis import memory
from ciuic_doctor.rundir.store import RunDir

MIB = 2**20


def _steps_run(tmp_path, rss_of_step, steps: int, noise_mib: float = 2) -> RunDir:
    run = RunDir.create(tmp_path / "run")
    rng = random.Random(5)
    with run.writer("steps", rank=0, per_rank_file=True) as writer:
        for step in range(1, steps + 1):
            noise = rng.gauss(0, noise_mib) * MIB
            writer.write({"step": step, "t": 1000.0 + step, "rss": int(rss_of_step(step) + noise)})
    return run


def _host_leak(run: RunDir):
    found = [f for f in memory.analyze(run) if f.check == "memory_leak" and f.evidence.get("kind") == "host"]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize(("at", "noise_mib"), [(30, 1), (40, 1), (30, 20), (40, 60)])
def test_one_time_level_shift_is_not_a_leak(tmp_path, at, noise_mib):
    """+300 MiB over 6 steps, flat before and after: the line alone fits it with R² 0.63-0.78 and was
    called a leak (warn, ~7 MiB/step) before the two-level test."""
    run = _steps_run(tmp_path, lambda s: 1024 * MIB + 300 * MIB * min(1, max(0, (s - at) / 6)), 60, noise_mib)
    finding = _host_leak(run)
    assert finding.verdict == "pass", finding.summary
    assert "level shift" in finding.summary
    assert 250 * MIB < finding.evidence["level_shift_bytes"] < 310 * MIB


def test_steady_growth_is_still_a_leak(tmp_path):
    run = _steps_run(tmp_path, lambda s: 1024 * MIB + 10 * MIB * s, steps=60)
    finding = _host_leak(run)
    assert finding.verdict in ("warn", "fail"), finding.summary
    assert "level_shift_bytes" not in finding.evidence


def test_a_jump_then_steady_growth_is_a_leak(tmp_path):
    run = _steps_run(tmp_path, lambda s: 1024 * MIB + (300 * MIB if s > 20 else 0) + 8 * MIB * s, steps=60)
    assert _host_leak(run).verdict in ("warn", "fail")


def test_four_steps_sampled_at_10_hz_are_not_run(tmp_path):
    """Start-up growth over a 4-step checkup: hundreds of samples, but only 4 steps of span."""
    run = RunDir.create(tmp_path / "run")
    with run.writer("steps", rank=0, per_rank_file=True) as writer:
        for step in range(1, 5):
            writer.write({"step": step, "t": 1000.0 + step, "rss": 900 * MIB})
    with run.writer("memwatch") as writer:
        for i in range(50):  # 10 Hz over 5 s, memory rising as the job starts up
            t = 1000.0 + i / 10
            writer.write(
                {"t": t, "pid": 77, "role": "rank 0", "rank": 0, "rss": int(500 * MIB + 8 * MIB * i)}
            )
    finding = _host_leak(run)
    assert finding.verdict == "not_run", finding.summary
