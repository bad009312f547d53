"""comm-bench with real ranks: torchrun on 2 ranks, 2 "nodes" over c10d on loopback, a rank killed or hung
mid-sweep, a corrupted result; and the comm analysis on records of a 2-node × 8-GPU NCCL run.

Sizes stay small (1 KiB to 16 KiB) and iterations few: these tests check behaviour, not speed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, torchrun

from ciuic_doctor.analysis import comm as comm_analysis
from ciuic_doctor.machine.nccl import COLLECTIVES, busbw_factor
from ciuic_doctor.rundir.store import RunDir

DATA = Path(__file__).parent / "data"
QUICK = ("-b", "1K", "-e", "16K", "-f", "4", "--iters", "3", "--warmup", "1")
PLACEMENTS = {"all_reduce": [True], "broadcast": [True], "all_gather": [False, True],
              "reduce_scatter": [False, True], "all_to_all": [False]}  # fmt: skip


def _records(path: Path) -> list[dict]:
    return RunDir.open(path).read("comm").records


def _check_sweep(records: list[dict], *, world: int, sizes: list[int], collectives: list[str]) -> None:
    """Every (collective, size, placement) present once, exact, with nccl-tests' busbw factor."""
    ok = [r for r in records if r["status"] == "ok"]
    seen = {(r["collective"], r["bytes"], r["inplace"]) for r in ok}
    wanted = {(c, s, p) for c in collectives for s in sizes for p in PLACEMENTS[c]}
    assert seen == wanted
    assert len(ok) == len(wanted)
    for r in ok:
        assert r["world_size"] == world
        assert r["wrong"] == 0
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * busbw_factor(r["collective"], world))
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["time_us_min"] <= r["time_us"] <= r["time_us_max"]
        assert 0 < r["time_us_p50"] <= r["time_us_p99"]
        assert len(r["rank_time_us"]) == world
        assert r["slowest_rank"] in range(world)
        assert r["count"] * 4 == r["bytes"]


def test_two_ranks_under_torchrun_measure_every_collective(tmp_path):
    out = tmp_path / "run"
    result = torchrun("comm-bench", *QUICK, "--out", str(out))
    assert result.returncode == 0, result.stderr
    _check_sweep(_records(out), world=2, sizes=[1024, 4096, 16384], collectives=list(PLACEMENTS))
    # the table comes line by line: a header per collective, one line per size, the nccl-tests footer
    assert result.stdout.count("# Avg bus bandwidth") == 5
    assert result.stdout.count("# Wrong elements      : 0 OK") == 5
    assert "one algorithm per collective" in result.stdout
    assert "busbw = algbw x factor" in result.stdout
    meta = json.loads((out / "meta.json").read_text())
    probe = meta["probes"]["comm-bench"]
    assert probe["status"] == "ok"
    assert probe["backend"] == "gloo"
    assert probe["config"]["bucket_bytes"] == 25 << 20
    assert meta["env"]["world"]["world_size"] == 2
    findings = {(f.check, f.where.get("collective")): f for f in comm_analysis.analyze(RunDir.open(out))}
    assert findings[("correctness", None)].verdict == "pass"
    assert findings[("algo_choice", None)].verdict == "not_run"
    assert findings[("busbw", "all_to_all")].evidence["world_size"] == 2


def test_two_nodes_one_rank_each_over_c10d_loopback(tmp_path):
    """Two torchrun agents meeting at a c10d rendezvous, as two hosts would."""
    console = Path(sys.executable).with_name("ciuic-doctor")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    args = [*QUICK, "--collectives", "all_reduce,all_gather,all_to_all", "--out", str(out)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=cb-{port}",
                # both launch forms the README gives: -m on node 0, the console script on node 1
                *(["-m", "ciuic_doctor"] if node == 0 else ["--no-python", str(console)]),
                "comm-bench",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    _check_sweep(
        _records(out),
        world=2,
        sizes=[1024, 4096, 16384],
        collectives=["all_reduce", "all_gather", "all_to_all"],
    )
    assert sum("# Avg bus bandwidth" in text for text in outputs) == 1  # only rank 0 prints the table


def test_killed_rank_is_named_by_the_survivor_and_rows_stay(tmp_path):
    """Rank 1 SIGKILLs itself before the 4 KiB row; the 1 KiB rows are kept. --timeout is far longer
    than the test's own limit, so the survivor must notice the death, not wait for the timeout."""
    out = tmp_path / "run"
    result = torchrun(
        "comm-bench", *QUICK, "--collectives", "all_reduce,all_gather", "--timeout", "600", "--out", str(out),
        env={"CIUIC_COMM_FAULT": "1:4096:kill"}, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0, result.stderr
    assert "FAILED: rank 1 on " in result.stderr, result.stderr
    assert "died during all_reduce 4K" in result.stderr, result.stderr
    assert result.stderr.count("FAILED: rank 1") == 1, result.stderr  # one message, not one per survivor
    rows = _records(out)
    assert [(r["collective"], r["bytes"]) for r in rows] == [("all_reduce", 1024)]
    probe = json.loads((out / "meta.json").read_text())["probes"]["comm-bench"]
    assert probe["status"] == "failed"
    assert probe["message"].startswith("rank 1 on ")


SIGTERM_BETWEEN_ROWS = """
import os, signal, sys, time
from ciuic_doctor.probes.comm.faults import Terminated, Watch
watch = Watch(store=None, rank=0, world_size=2, hosts=["h", "h"], timeout_s=60, defer_sigterm=True)
watch.start()
watch.step("all_reduce 1K in-place")
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.3)  # a sleep the signal interrupts: an immediate Terminated would end the script here
print("row written", flush=True)
try:
    watch.step("all_reduce 4K in-place")
except Terminated:
    print("terminated at", watch.label, flush=True)
    sys.exit(1)
"""


def test_sigterm_between_rows_ends_the_rank_at_its_next_step():
    """The launcher SIGTERMs rank 0 about 0.1 s after a peer dies, maybe while rank 0 still writes the
    row every rank finished: the row is written, and the rank stops on entering the next one, so the
    message names the row the peer never joined. A real process signals itself between two rows."""
    result = subprocess.run(
        [sys.executable, "-c", SIGTERM_BETWEEN_ROWS], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == ["row written", "terminated at all_reduce 4K in-place"]


def test_hung_rank_is_named_within_the_timeout(tmp_path):
    out = tmp_path / "run"
    result = torchrun(
        "comm-bench", *QUICK, "--collectives", "all_reduce", "--timeout", "4", "--out", str(out),
        env={"CIUIC_COMM_FAULT": "1:4096:hang"}, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "rank 1 on " in result.stderr
    assert "stopped making progress (last seen at all_reduce 1K" in result.stderr
    assert "never joined all_reduce 4K in-place [algo default] within the 4 s --timeout" in result.stderr
    assert len(_records(out)) == 1


def test_corrupted_result_is_caught_and_fails_the_run(tmp_path):
    """The test hook adds 1 to one element of rank 1's result: every row must count it. Launched
    outside torchrun, so this also runs the --nproc path through torch's elastic launcher."""
    out = tmp_path / "run"
    result = run_cli(
        "comm-bench", "--nproc", "2", *QUICK, "--collectives", "all_reduce,reduce_scatter",
        "--out", str(out), env={"CIUIC_COMM_CORRUPT_RANK": "1"}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    rows = _records(out)
    assert len(rows) == 9
    assert all(r["wrong"] == 1 for r in rows)
    assert "FAILED: 9 wrong elements" in result.stderr
    assert result.stderr.count("wrong elements") == 1  # the parent says it once, the ranks stay quiet
    assert "# Wrong elements      : 3 FAILED" in result.stdout
    correctness = next(f for f in comm_analysis.analyze(RunDir.open(out)) if f.check == "correctness")
    assert correctness.verdict == "fail"
    assert correctness.evidence["total_wrong"] == 9


def test_a_dtype_the_backend_cannot_move_is_not_run_with_the_reason(tmp_path):
    """gloo has no float8: every collective is tried, recorded as not_run with gloo's own reason, and a
    run that measured nothing at all exits non-zero."""
    out = tmp_path / "run"
    result = torchrun("comm-bench", *QUICK, "--dtype", "float8_e4m3fn", "--out", str(out))
    assert result.returncode == 1
    rows = _records(out)
    assert [r["collective"] for r in rows] == list(COLLECTIVES)  # every one tried, in order
    assert {r["status"] for r in rows} == {"not_run"}
    assert all("Invalid scalar type" in r["reason"] for r in rows)
    assert "nothing could run on gloo with float8_e4m3fn" in result.stderr
    support = [f for f in comm_analysis.analyze(RunDir.open(out)) if f.check == "collective_support"]
    assert len(support) == 5
    assert {f.verdict for f in support} == {"not_run"}


def test_world_size_one_warns_and_a_missed_floor_fails(tmp_path):
    out = tmp_path / "run"
    result = torchrun("comm-bench", *QUICK, "--collectives", "all_reduce,broadcast", "--min-busbw", "5000",
                      "--out", str(out), nproc=1)  # fmt: skip
    assert result.returncode == 1
    assert "WARNING: world size 1: busbw is 0 by definition" in result.stdout
    assert "average busbw below 0.9 x --min-busbw 5000 GB/s" in result.stderr
    rows = _records(out)
    assert {r["busbw_gbps"] for r in rows if r["collective"] == "all_reduce"} == {0.0}
    findings = comm_analysis.analyze(RunDir.open(out))
    floor = next(f for f in findings if f.check == "busbw_floor")
    assert floor.verdict == "fail"
    assert {f.verdict for f in findings if f.check == "busbw"} == {"warn"}


BAD_ARGS = [
    (("-b", "12X"), "--min-bytes: malformed size '12X'"),
    (("-b", "64M", "-e", "1K"), "larger than --max-bytes"),
    (("--collectives", "all_reduce,alltoall"), "unknown alltoall"),
    (("--algos", "ring,bogus"), "unknown bogus"),
    (("--bucket-bytes", "-1"), "--bucket-bytes: malformed size"),
    (("--dtype", "float128"), "--dtype: unknown float128"),
]


@pytest.mark.parametrize(("args", "message"), BAD_ARGS)
def test_bad_arguments_end_in_one_line(args, message):
    result = run_cli("comm-bench", *args, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("ciuic-doctor comm-bench: error: ")
    assert message in lines[0]


def test_command_module_imports_no_torch():
    code = "import sys, ciuic_doctor.commands.comm_bench; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- the analysis on records of a 2-node × 8-GPU NCCL run ----------------------------------------------
# Built in the shape comm-bench writes on NCCL 2.26 (no GPU here): `close` has ring and tree within 3% at
# the 16-32 MiB sizes around DDP's 25 MiB bucket (tree wins only the latency-bound small sizes);
# `tree_wins` has tree ~30% faster there, as on exactly 2 nodes, and rank 9 12% slower in every row.


def _load(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def _by_check(findings) -> dict:
    return {f.check: f for f in findings if f.check != "busbw"}


def test_ring_and_tree_within_noise_leave_nccl_algo_unset():
    findings = _by_check(comm_analysis.analyze_records(_load("nccl_comm_16ranks_close.jsonl")))
    choice = findings["algo_choice"]
    assert choice.verdict == "pass"
    assert choice.evidence["recommended_nccl_algo"] is None
    assert choice.evidence["judged_bytes"] == [16 << 20, 32 << 20]
    small = next(p for p in choice.evidence["per_size"] if p["bytes"] == 1024)
    assert small["faster"] == "tree"
    assert not small["within_noise"]  # a win outside the bucket sizes does not count
    assert "leave NCCL_ALGO unset" in choice.summary
    assert findings["straggler"].verdict == "pass"


def test_a_clear_tree_win_recommends_the_per_collective_setting():
    records = _load("nccl_comm_16ranks_tree_wins.jsonl")
    findings = _by_check(comm_analysis.analyze_records(records))
    choice = findings["algo_choice"]
    assert choice.verdict == "warn"
    assert choice.evidence["recommended_nccl_algo"] == "allreduce:tree"
    judged = [p for p in choice.evidence["per_size"] if p["bytes"] in (16 << 20, 32 << 20)]
    assert [p["faster"] for p in judged] == ["tree", "tree"]
    straggler = findings["straggler"]
    assert straggler.verdict == "warn"
    assert (straggler.evidence["rank"], straggler.evidence["host"]) == (9, "gpu-a08")
    assert straggler.evidence["slowdown_pct"] == pytest.approx(12, abs=1)


def test_the_recommendation_follows_nccl_version_and_what_nccl_really_ran():
    records = _load("nccl_comm_16ranks_tree_wins.jsonl")
    old = [{**r, "nccl_version": "2.21.5"} for r in records]  # before 2.24.3: plain names only
    choice = _by_check(comm_analysis.analyze_records(old))["algo_choice"]
    assert choice.evidence["recommended_nccl_algo"] == "Tree"
    # NCCL's TUNING log says it ran ring at 16 MiB although tree was forced: no recommendation then
    moot = [
        {**r, "algo_used": "ring"} if r["algo"] == "tree" and r["bytes"] == 16 << 20 else r for r in records
    ]
    choice = _by_check(comm_analysis.analyze_records(moot))["algo_choice"]
    assert choice.evidence["recommended_nccl_algo"] is None
    assert "did not run the forced algorithm" in choice.summary


def test_floor_support_and_unhonoured_algorithm_on_recorded_records():
    records = _load("nccl_comm_16ranks_close.jsonl")
    records[0] = {**records[0], "algo_used": "tree"}  # NCCL ran tree although ring was forced
    records.append({"collective": "all_to_all", "algo": "default", "backend": "nccl", "status": "not_run",
                    "reason": "unsupported dtype"})  # fmt: skip
    findings = comm_analysis.analyze_records(records, min_busbw_gbps=150.0)
    by = _by_check(findings)
    assert by["busbw_floor"].verdict == "fail"  # the plain mean over all sizes, latency-bound ones included
    assert by["collective_support"].verdict == "not_run"
    assert by["algo_choice"].evidence["not_honoured"] == [{"bytes": 1024, "forced": "ring", "used": "tree"}]
    assert by["correctness"].verdict == "pass"
    busbw = [f for f in findings if f.check == "busbw"]
    assert {f.evidence["collective"] for f in busbw} == {"all_reduce", "all_gather", "reduce_scatter",
                                                         "broadcast", "all_to_all"}  # fmt: skip
    all_reduce = next(f for f in busbw if f.evidence["collective"] == "all_reduce")
    assert set(all_reduce.evidence["per_algo"]) == {"ring", "tree"}
    assert all_reduce.evidence["peak_busbw_gbps"] > all_reduce.evidence["avg_busbw_gbps"]


# ---- the pieces, in one process -------------------------------------------------------------------------


def _simulate(
    collective: str, world: int, dtype: str, size: int, inplace: bool, *, swap: bool = False
) -> int:
    """Run the collective's data movement by hand over `world` fake ranks and count wrong elements."""
    import torch

    from ciuic_doctor.probes.comm.check import count_wrong, expected, fill_inputs, pattern_for
    from ciuic_doctor.probes.comm.collectives import DTYPES, allocate, elem_bytes, shape

    sh = shape(collective, size, elem_bytes(dtype), world)
    pattern = pattern_for(dtype, world)
    cpu = torch.device("cpu")
    bufs = [allocate(sh, inplace=inplace, dtype=DTYPES[dtype], device=cpu, rank=r) for r in range(world)]
    for r, buf in enumerate(bufs):
        fill_inputs(buf, rank=r, pattern=pattern)
    sends = [buf.send.clone() for buf in bufs]
    if swap:  # a transport that delivers rank 0's and rank 1's blocks to each other's place
        sends[0], sends[1] = sends[1], sends[0]
    total = sum(s.double() for s in sends)  # any order: the pattern keeps every partial sum exact
    m = sh.share
    wrong = 0
    for r, buf in enumerate(bufs):
        result = {
            "all_reduce": lambda r=r: total,
            "broadcast": lambda r=r: sends[0],
            "all_gather": lambda r=r: torch.cat(sends),
            "reduce_scatter": lambda r=r: total[r * m : (r + 1) * m],
            "all_to_all": lambda r=r: torch.cat([s[r * m : (r + 1) * m] for s in sends]),
        }[collective]()
        buf.recv.copy_(result.to(buf.recv.dtype))
        wrong += count_wrong(buf.recv, expected(collective, sh, rank=r, pattern=pattern, like=buf.recv))
    return wrong


@pytest.mark.parametrize("collective", list(PLACEMENTS))
@pytest.mark.parametrize(
    ("world", "dtype"),
    [(2, "float32"), (3, "bfloat16"), (7, "float16"), (4, "float8_e4m3fn"), (130, "bfloat16")],
)
def test_expected_results_match_the_collective_semantics(collective, world, dtype):
    """(130 ranks in bfloat16 take the one-hot inputs: sums of 0..K would no longer be exact.)"""
    for inplace in PLACEMENTS[collective]:
        assert _simulate(collective, world, dtype, 3 * 1024 + 20, inplace) == 0


@pytest.mark.parametrize("collective", ["all_gather", "all_to_all", "broadcast"])
def test_check_catches_blocks_delivered_to_the_wrong_place(collective):
    assert _simulate(collective, 4, "float32", 4096, collective == "broadcast", swap=True) > 0


def test_sizes_percentiles_and_the_folded_record():
    from ciuic_doctor.probes.comm.collectives import Shape, sweep_sizes
    from ciuic_doctor.probes.comm.measure import RankResult, aggregate, percentile

    assert sweep_sizes(1024, 64 << 20, 2)[-1] == 64 << 20
    assert len(sweep_sizes(1024, 64 << 20, 2)) == 17
    assert sweep_sizes(1000, 9000, 3) == [1000, 3000, 9000]
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    sh = Shape(collective="all_reduce", count=256, share=256, bytes=1 << 20)
    ranks = [
        RankResult(time_s=0.004, iters=4, durations_us=[900, 1000, 1000, 1100], wrong=0),
        RankResult(time_s=0.006, iters=4, durations_us=[1500, 1500, 1500, 1500], wrong=2),
    ]
    record = aggregate(ranks, collective="all_reduce", sh=sh, hosts=["a", "b"])
    assert record["time_us"] == pytest.approx(1250)  # mean of 1000 and 1500, as nccl-tests averages
    assert (record["time_us_min"], record["time_us_max"]) == (pytest.approx(1000), pytest.approx(1500))
    assert record["time_us_p50"] == 1500  # per iteration, the slowest rank's time
    assert record["algbw_gbps"] == pytest.approx((1 << 20) / 1250e-6 / 1e9)
    assert record["busbw_gbps"] == pytest.approx(record["algbw_gbps"])  # 2(n-1)/n = 1 for n = 2
    assert (record["wrong"], record["slowest_rank"], record["slowest_host"]) == (2, 1, "b")


def test_phases_force_all_reduce_only_and_restore_nccl_algo(monkeypatch):
    from ciuic_doctor.probes.comm.phases import env_var, plan_phases

    monkeypatch.delenv("NCCL_ALGO", raising=False)
    phases, _ = plan_phases("nccl", list(PLACEMENTS), None, (2, 26, 2))
    assert [(p.algo, p.nccl_algo, p.collectives[0]) for p in phases] == [
        ("ring", "allreduce:ring", "all_reduce"),
        ("tree", "allreduce:tree", "all_reduce"),
        ("default", None, "broadcast"),
    ]
    old, _ = plan_phases("nccl", ["all_reduce"], ["tree", "default"], (2, 18, 1))
    assert [p.nccl_algo for p in old] == ["Tree", None]
    gloo, notes = plan_phases("gloo", ["all_reduce"], ["ring", "tree"], None)
    assert [p.algo for p in gloo] == ["default"]
    assert notes == ["gloo has one algorithm per collective: --algos ring,tree ignored"]
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    with env_var("NCCL_ALGO", "allreduce:tree"):
        assert os.environ["NCCL_ALGO"] == "allreduce:tree"
    assert os.environ["NCCL_ALGO"] == "Ring"
    monkeypatch.delenv("NCCL_ALGO")
    with env_var("NCCL_ALGO", "allreduce:tree"):
        pass
    assert "NCCL_ALGO" not in os.environ
