"""`comm-bench --splits-from RUN` checks the recorded routing before any rank allocates: counts of
10^15, 10^6 experts, hidden_size 10^12 and negative counts end in one line and exit 2, no folder made."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ciuic_doctor.errors import UserError
from ciuic_doctor.probes.comm.splits import MAX_EXPERTS, bytes_per_rank, plan_from_run
from ciuic_doctor.rundir.store import RunDir


def _routing(path: Path, *, count=100, experts=8, hidden=64) -> Path:
    run = RunDir.create(path)
    run.update_meta(model={"config": {"hidden_size": hidden}, "seq_len": 64})
    for rank in range(2):
        writer = run.writer("moe", rank=rank, per_rank_file=True)
        for step in (1, 2):
            counts = [count] * experts
            writer.write({"step": step, "layer": 1, "rank": rank, "t": time.time(), "counts": counts})
        writer.close()
    return path


def test_sizes_no_router_produces_are_refused_naming_the_value(tmp_path):
    with pytest.raises(UserError, match="records -100 tokens for expert 0"):
        plan_from_run(_routing(tmp_path / "neg", count=-100), 2)
    with pytest.raises(UserError, match=f"at most {MAX_EXPERTS:,} are measured"):
        plan_from_run(_routing(tmp_path / "experts", experts=MAX_EXPERTS + 1, count=0), 2)
    with pytest.raises(UserError, match="hidden_size must be a whole number from 1 to"):
        plan_from_run(_routing(tmp_path / "hidden", hidden=10**12), 2)
    with pytest.raises(UserError, match="hidden_size must be a whole number from 1 to"):
        plan_from_run(_routing(tmp_path / "text", hidden="big"), 2)


def test_the_buffers_a_rank_needs_are_counted_before_allocating(tmp_path):
    plans = plan_from_run(_routing(tmp_path / "ok"), 2)
    # 2 ranks x 100 tokens x 8 experts x 64 elements: each rank sends and receives 51,200 elements
    assert bytes_per_rank(plans, 4) == 51_200 * 4 + 51_200 * 8
    huge = plan_from_run(_routing(tmp_path / "huge", count=10**15), 2)
    assert bytes_per_rank(huge, 4) > 10**18


@pytest.mark.slow
def test_comm_bench_refuses_huge_recorded_counts_in_one_line_and_makes_no_folder(tmp_path, cli):
    out = tmp_path / "bench"
    done = cli("comm-bench", "--nproc", "2", "--splits-from", str(_routing(tmp_path / "r", count=10**15)),
               "--out", str(out), timeout=180)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "of all_to_all buffers per rank" in lines[0]
    assert not out.exists()
