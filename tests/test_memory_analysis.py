"""The memory analysis on recorded runs with known answers (tests/data/memory_make.py plants them) and
on series built here: leak slope per step and per second, warm-up, step alignment, fragmentation,
NVML − reserved growth, copy-on-read workers, the empty_cache verdict, and no leak in flat noise."""

from __future__ import annotations

import doctest
import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic_doctor.analysis import memory
from ciuic_doctor.analysis.memory import data as _memory_data
from ciuic_doctor.analysis.stats import trend as _trend
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir
from tests.conftest import run_cli

DATA = Path(__file__).parent / "data"
MIB, GIB = 2**20, 2**30


def _copy(name: str, tmp_path: Path) -> RunDir:
    target = tmp_path / name
    shutil.copytree(DATA / name, target)
    return RunDir.open(target)


def _one(findings, check, **where):
    matches = [f for f in findings if f.check == check and all(f.where.get(k) == v for k, v in where.items())]
    assert len(matches) == 1, [f.to_dict() for f in matches]
    return matches[0]


@pytest.fixture(scope="module")
def cuda(tmp_path_factory):
    return memory.analyze(_copy("memory_cuda", tmp_path_factory.mktemp("cuda")))


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    return memory.analyze(_copy("memory_cpu", tmp_path_factory.mktemp("cpu")))


def _leak(findings, kind, rank):
    """The job's one memory_leak finding of `kind` when it names `rank`, else a pass for that rank
    (a rank not named in a judged finding was checked and found flat)."""
    (finding,) = [f for f in findings if f.check == "memory_leak" and f.evidence.get("kind") == kind]
    if rank in finding.where.get("ranks", []) or finding.verdict == "not_run":
        return finding
    assert finding.evidence["ranks_checked"] >= 1
    return Finding(probe="memory", check="memory_leak", verdict="pass", summary=finding.summary)


def test_device_leak_per_step_with_projection(cuda):
    leak = _leak(cuda, "device", 0)
    ev = leak.evidence
    assert ev["slope_bytes_per_step"] == pytest.approx(2 * MIB, rel=0.05)
    assert ev["growth_mb_per_step"] == pytest.approx(2.0, rel=0.05)
    assert ev["r2"] > 0.9
    assert ev["limit_bytes"] == 81559 * MIB
    # headroom = device total − what NVML says rank 0 holds at the end (36 GiB reserved + ~1.2 GiB)
    assert ev["headroom_bytes"] == pytest.approx(81559 * MIB - 37.2 * GIB, rel=0.01)
    steps_left = ev["headroom_bytes"] / ev["slope_bytes_per_step"]
    assert ev["projected_oom_step"] == pytest.approx(150 + steps_left, abs=2)
    assert ev["projected_oom_s"] == pytest.approx(steps_left * 0.5, rel=0.03)
    assert leak.verdict == "fail"  # ~3 h from now at 0.5 s a step


def test_flat_device_and_host_are_no_leak(cuda):
    assert _leak(cuda, "device", 1).verdict == "pass"
    assert _leak(cuda, "host", 0).verdict == "pass"
    assert _leak(cuda, "host", 1).verdict == "pass"


def test_fragmentation_from_allocator_fields(cuda):
    frag = _one(cuda, "fragmentation")  # one finding for the job, naming the fragmented rank
    assert frag.where["ranks"] == [1]
    assert frag.summary.startswith("fragmentation on 1 of 2 rank(s); worst rank 1: 3 allocator retries")
    assert frag.verdict == "warn"
    assert frag.evidence["alloc_retries"] == 3
    assert frag.evidence["reserved_minus_allocated_bytes"] == pytest.approx(14 * GIB, rel=0.01)
    assert frag.evidence["reserved_minus_peak_bytes"] == pytest.approx(12 * GIB, rel=0.01)
    assert frag.evidence["inactive_split_bytes"] == 3 * GIB
    assert frag.evidence["suggested_alloc_conf"] == "expandable_segments:True"
    assert frag.evidence["ranks_checked"] == 2
    clean = frag.evidence["per_rank"]["0"]
    assert clean["verdict"] == "pass"
    assert clean["alloc_retries"] == 0


def test_two_of_four_ranks_fragment_one_finding_worst_first(tmp_path):
    """Ranks 2 and 3 join the recorded run: rank 2 retries twice as often as rank 1, rank 3 is clean."""
    run = _copy("memory_cuda", tmp_path)
    for source, rank, retries_factor in (("steps.rank1.jsonl", 2, 2), ("steps.rank0.jsonl", 3, 1)):
        rows = [json.loads(line) for line in (run.path / source).read_text().splitlines()]
        for row in rows:
            row["rank"] = rank
            row["alloc_retries"] = (row.get("alloc_retries") or 0) * retries_factor
        (run.path / f"steps.rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    findings = memory.analyze(RunDir.open(run.path))
    frag = _one(findings, "fragmentation")
    assert frag.verdict == "warn"
    assert frag.where["ranks"] == [2, 1]
    assert frag.where["rank"] == 2
    assert frag.where["hosts"] == ["gpu-node-01"]
    assert frag.summary.startswith("fragmentation on 2 of 4 rank(s); worst rank 2: 6 allocator retries")
    ev = frag.evidence
    assert ev["alloc_retries"] == 6  # the worst rank's figures at the top level
    assert (ev["worst_rank"], ev["affected_ranks"], ev["ranks_checked"]) == (2, 2, 4)
    # per_rank: the affected ranks plus the worst few (3); clean rank 3 beyond them is only counted
    assert {rank: row["alloc_retries"] for rank, row in ev["per_rank"].items()} == {"2": 6, "1": 3, "0": 0}
    # the ranks without memwatch samples do not add findings: one per check
    assert _one(findings, "non_pytorch_device_memory").where["ranks"] == [1]
    assert _one(findings, "non_pytorch_device_memory").evidence["ranks_not_run"] == [2, 3]


def test_non_pytorch_memory_nvml_minus_reserved(cuda):
    growing = _one(cuda, "non_pytorch_device_memory")
    assert growing.where["ranks"] == [1]
    assert growing.evidence["growing"] is True
    assert growing.evidence["slope"] == pytest.approx(8 * MIB, rel=0.05)
    assert growing.verdict == "warn"
    flat = growing.evidence["per_rank"]["0"]
    assert flat["growing"] is False
    assert flat["bytes"] == pytest.approx(1.2 * GIB, rel=0.02)
    assert flat["verdict"] == "pass"


def test_copy_on_read_workers(cuda):
    workers = _one(cuda, "worker_memory_growth")
    assert workers.where["ranks"] == [0]
    assert workers.verdict == "warn"
    assert workers.evidence["workers"] == 2
    assert workers.evidence["pattern"] == "copy_on_read"
    assert workers.evidence["uss_slope_bytes_per_s"] == pytest.approx(MIB, rel=0.1)


def test_empty_cache_verdict_names_the_growth_it_cannot_free(cuda):
    verdict = _one(cuda, "empty_cache")
    assert verdict.verdict == "warn"
    assert verdict.evidence["non_pytorch_growing_ranks"] == [1]
    assert verdict.evidence["alloc_retries"] == 3


def test_empty_cache_pass_on_a_clean_cuda_run(tmp_path):
    """The same run without the planted problems: nothing for empty_cache to do."""
    run = _copy("memory_cuda", tmp_path)
    for name in ("steps.rank0.jsonl", "steps.rank1.jsonl", "memwatch.jsonl"):
        rows = [json.loads(line) for line in (run.path / name).read_text().splitlines()]
        for row in rows:
            row.pop("alloc_retries", None)
            if row.get("rank") == 1 and row.get("gpu_bytes"):
                row["gpu_bytes"] = None  # no NVML figure for rank 1: its NCCL growth is not seen
        (run.path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdict = _one(memory.analyze(run), "empty_cache")
    assert verdict.verdict == "pass"
    assert verdict.evidence["recommend_periodic_empty_cache"] is False


def test_host_leak_aligned_to_steps(cpu):
    """1 MiB per step = 2 MiB per 1 Hz sample: only alignment by time gives the per-step figure."""
    leak = _leak(cpu, "host", 0)
    ev = leak.evidence
    assert ev["metric"] == "anon"
    assert ev["slope_bytes_per_step"] == pytest.approx(MIB, rel=0.05)
    assert "slope_bytes_per_s" not in ev
    assert ev["limit_bytes"] == pytest.approx(20 * GIB - 120 * MIB, rel=0.01)  # available at the end
    assert ev["projected_oom_step"] == pytest.approx(
        120 + ev["limit_bytes"] / ev["slope_bytes_per_step"], abs=3
    )
    assert leak.verdict == "fail"


def test_optimizer_state_at_step_two_is_warm_up_not_a_leak(cpu):
    assert _leak(cpu, "host", 1).verdict == "pass"


def test_cpu_run_says_why_cuda_checks_did_not_run(cpu):
    for check in ("fragmentation", "empty_cache", "non_pytorch_device_memory"):
        finding = _one(cpu, check)
        assert finding.verdict == "not_run", check
    assert "NVML Shared Library Not Found" in _one(cpu, "non_pytorch_device_memory").summary


def test_analyze_command_reads_a_torn_stream(tmp_path):
    run = _copy("memory_cpu", tmp_path)
    assert run.read("memwatch").skipped_lines == 1
    result = run_cli("analyze", str(run.path), "--json")
    assert result.returncode == 1  # the rank 0 leak fails
    findings = json.loads(result.stdout)
    assert any(f["check"] == "memory_leak" and f["verdict"] == "fail" for f in findings)
    assert "memory" in json.loads((run.path / "findings.json").read_text())["analyses"]


def _run_with_series(tmp_path: Path, values: list[float], *, step_s: float = 1.0) -> RunDir:
    run = RunDir.create(tmp_path / "run")
    with run.writer("memwatch") as writer:
        for i, value in enumerate(values):
            writer.write({"t": 1000.0 + i * step_s, "pid": 7, "role": "rank 0", "rank": 0, "rss": int(value)})
    return run


def test_time_based_leak_when_there_are_no_steps(tmp_path):
    rng = random.Random(3)
    values = [4 * GIB + 3 * MIB * i + rng.gauss(0, 20 * MIB) for i in range(300)]
    leak = _leak(memory.analyze(_run_with_series(tmp_path, values, step_s=2.0)), "host", 0)
    assert leak.evidence["slope_bytes_per_s"] == pytest.approx(1.5 * MIB, rel=0.1)
    assert leak.verdict == "warn"  # no available-memory figure: no projection, so no fail


def test_the_samples_go_with_the_memory_analysis_not_with_the_next_collection(tmp_path):
    """MemwatchColumns is in no reference cycle: its samples (0.9 GB at 10,000 ranks x 1,000 steps) are
    freed when the analysis drops it, not whenever Python's cyclic collector next runs (+90 MB on the
    10,000-rank report's peak)."""
    import gc
    import weakref

    from ciuic_doctor.analysis.memory.columns import MemwatchColumns

    columns = MemwatchColumns(_run_with_series(tmp_path, [4 * GIB + i * MIB for i in range(50)]))
    assert columns.flat("rss").size == 50  # the whole job's column, made through the lazy converter
    gone = weakref.ref(columns)
    gc.disable()
    try:
        del columns
        assert gone() is None
    finally:
        gc.enable()


def test_gc_sawtooth_is_not_a_leak(tmp_path):
    values = [6 * GIB + (i % 15) * 40 * MIB for i in range(300)]  # grows and is collected, every 15 s
    assert _leak(memory.analyze(_run_with_series(tmp_path, values)), "host", 0).verdict == "pass"


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(8, 400),
    level=st.floats(1e8, 1e11),
    noise=st.floats(0.0, 0.2),
    heavy=st.booleans(),
)
def test_flat_noise_is_never_a_leak(seed, n, level, noise, heavy):
    rng = random.Random(seed)
    draw = (lambda: rng.paretovariate(1.5) - 3) if heavy else (lambda: rng.gauss(0, 1))
    ys = [level * (1 + noise * draw() / 10) for _ in range(n)]
    trend = _trend.robust_trend(list(range(n)), ys)
    assert trend is not None
    assert not _memory_data._grows(trend, _memory_data.LEAK_MIN_BYTES)


def test_trend_doc_examples():
    result = doctest.testmod(_trend)
    assert result.attempted > 0
    assert result.failed == 0


def test_a_short_job_sampled_in_time_is_not_judged_a_leak(tmp_path):
    """A 4-step checkup: memwatch's samples grow with start-up (MiB/s), but the job's own steps say it
    never got past start-up; judged, that was a FAIL "runs out in 0.1 h"."""
    run = RunDir.create(tmp_path / "run")
    t0 = 1_760_000_000.0
    for rank in (0, 1):
        writer = run.writer("steps", rank=rank, per_rank_file=True)
        for step in range(1, 5):
            writer.write({"step": step, "t": t0 + 28.0 + 0.3 * step, "step_time_s": 0.3, "rank": rank})
        writer.close()
    writer = run.writer("memwatch")
    for sample in range(31):
        for rank in (0, 1):
            anon = 500 * MIB + sample * 14 * MIB  # 14 MiB/s of start-up growth
            writer.write(
                {
                    "t": t0 + sample,
                    "sample": sample,
                    "pid": 7000 + rank,
                    "role": f"rank {rank}",
                    "rank": rank,
                    "rss": anon + 100 * MIB,
                    "anon": anon,
                    "uss": anon,
                    "pss": anon,
                    "sys_total_bytes": 8 * GIB,
                    "sys_available_bytes": 4 * GIB - sample * 28 * MIB,
                }
            )
    writer.close()
    leak = _leak(memory.analyze(run), "host", 0)
    assert leak.verdict == "not_run", leak.summary
    # one of the two start-up rules answers (growth outside the recorded steps, or too few steps made);
    # either way the summary names the 4 steps and asks for more
    assert "outside its 4 recorded step(s)" in leak.summary or "made only 4 step(s)" in leak.summary
    assert "run more steps" in leak.summary


def test_ranks_on_two_hosts_with_the_same_pid_are_two_processes(tmp_path):
    """Nodes booted alike give their ranks the same PIDs: rank 0 on node-a and rank 1 on node-b are both
    PID 4242 here. Each is its own process (host and PID): rank 0's growth is rank 0's, rank 1 is flat."""
    run = RunDir.create(tmp_path / "run")
    t0 = 1_760_000_000.0
    for rank in (0, 1):
        writer = run.writer("steps", rank=rank, per_rank_file=True)
        for step in range(1, 301):
            writer.write({"step": step, "t": t0 + step, "step_time_s": 1.0, "rank": rank})
        writer.close()
    writer = run.writer("memwatch")
    for sample in range(302):
        for rank, host in ((0, "node-a"), (1, "node-b")):
            anon = 2 * GIB + (sample * 8 * MIB if rank == 0 else 0)  # rank 0 leaks 8 MiB a step
            writer.write(
                {"t": t0 + sample, "sample": sample, "host": host, "pid": 4242, "role": f"rank {rank}",
                 "rank": rank, "rss": anon + 100 * MIB, "anon": anon, "uss": anon, "pss": anon,
                 "sys_total_bytes": 64 * GIB, "sys_available_bytes": 32 * GIB}
            )  # fmt: skip
    writer.close()
    findings = memory.analyze(run)
    leaking = _leak(findings, "host", 0)
    assert leaking.verdict in ("warn", "fail"), leaking.summary
    assert leaking.evidence["pid"] == 4242  # the PID as the host has it, not the key that tells them apart
    assert leaking.where["hosts"] == ["node-a"]
    assert leaking.evidence["ranks_checked"] == 2
    assert leaking.evidence["slope_bytes_per_step"] == 8 * MIB
    flat = _leak(findings, "host", 1)
    assert flat.verdict == "pass", flat.summary


@pytest.mark.parametrize("block", [1, 2, 3, 1 << 20])
def test_a_pid_on_two_hosts_is_found_across_the_walks_blocks(monkeypatch, block):
    """The PID order is walked a block at a time: a PID whose samples straddle two blocks, with its second
    host only in the later one, is still found; a PID on one host never is."""
    import numpy as np

    from ciuic_doctor.analysis.memory import columns

    monkeypatch.setattr(columns, "QUERY_BLOCK", block)
    pid = np.array([7, 5, 7, 5, 9, 7, 9])
    codes = np.array([0, 1, 0, 1, 2, 3, 2], np.int32)  # 7 on hosts 0 and 3; 5 and 9 on one host each
    order = np.argsort(pid, kind="stable")
    assert columns._pids_on_two_hosts(pid, codes, order).tolist() == [7]
    assert columns._pids_on_two_hosts(pid, np.zeros(7, np.int32), order).tolist() == []
