"""The loader analysis on recorded sweeps: recommendation, knee, noise, pitfalls (no torch needed)."""

from __future__ import annotations

import pytest

from ciuic_doctor.analysis import loader, run_all
from ciuic_doctor.rundir.store import RunDir

SWEEP = "s1"
BATCH = 8


def header(**overrides):
    base = {
        "kind": "sweep",
        "sweep": SWEEP,
        "batch_size": BATCH,
        "local_world_size": 2,
        "cpu_budget_per_rank": 4,
        "cpu": {"logical": 8, "affinity": 8, "cgroup_quota": None, "usable": 8},
        "lightning_rule_workers": 3,
        "current": {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": True},
        "shm_free_bytes": 8 << 30,
        "shm_total_bytes": 8 << 30,
        "dataset": {"length": 1000},
        "step_ms": 0.0,
    }
    return {**base, **overrides}


def measure(workers, rate, *, prefetch=2, rnd=0, groups=12, jitter=0.005, current=False, **extra):
    """A kind=measure record whose groups average `rate` samples/s, scattered by ±jitter."""
    group = max(1, workers)
    mean = group * BATCH / rate
    group_s = [mean * (1 + (jitter if i % 2 else -jitter)) for i in range(groups)]
    config = f"w{workers}-p{prefetch}" if workers else "w0"
    return {
        "kind": "measure", "sweep": SWEEP, "round": rnd, "config": config, "num_workers": workers,
        "prefetch_factor": prefetch if workers else None, "pin_memory": False,
        "persistent_workers": workers > 0, "eligible": workers <= 4, "over_budget": workers > 4,
        "is_current": current, "status": "ok", "samples": groups * group * BATCH,
        "elapsed_s": sum(group_s), "group_s": group_s, "batch_bytes": 1 << 20,
        "epoch_start_s": 0.05 + 0.02 * workers, "persistent_restart_s": 0.01,
        "worker_uss_growth_bytes": 1 << 20 if workers else None, "worker_rss_growth_bytes": 0,
        **extra,
    }  # fmt: skip


def findings(records, **hdr):
    return {f.check: f for f in loader.analyze_records(header(**hdr), records)}


def curve():
    """Rates rise to 2 workers and flatten: 0 → 100, 1 → 180, 2 → 196, 3 → 200, 4 → 199."""
    return [
        measure(0, 100.0),
        measure(1, 180.0),
        measure(2, 196.0, current=True),
        measure(3, 200.0),
        measure(4, 199.0),
    ]


def test_recommends_the_smallest_within_noise_of_the_best_and_the_knee():
    f = findings(curve())["loader_throughput"]
    assert f.verdict == "pass"
    assert f.evidence["best"]["num_workers"] == 3
    assert f.evidence["recommended"]["num_workers"] == 2  # 196 is within 3 % of 200; 180 is not
    assert f.evidence["within_noise_of_best"] is True
    assert f.evidence["knee_workers"] == 1  # 180 >= 90 % of 200
    assert f.evidence["current_samples_per_s"] == pytest.approx(196.0, rel=1e-6)
    assert f.evidence["lightning_rule_workers"] == 3
    assert f.evidence["lightning_rule_samples_per_s"] == pytest.approx(200.0, rel=1e-6)
    assert f.evidence["recommended"]["persistent_workers"] is True  # restart saving 0.05 s > 10 ms


def test_scattered_windows_widen_the_noise_margin():
    """With ±30 % scatter between groups, 180 vs 200 can no longer be told apart: 1 worker suffices."""
    records = [measure(0, 100.0), measure(1, 180.0, jitter=0.3), measure(3, 200.0, jitter=0.3)]
    f = findings(records)["loader_throughput"]
    assert f.evidence["recommended"]["num_workers"] == 1
    assert f.evidence["noise_margin_pct"] > 10


def test_wild_scatter_caps_the_margin_and_says_noisy():
    """±80 % scatter between groups: a config 4x slower still does not count as "within noise"."""
    records = [measure(0, 50.0, jitter=0.8, groups=4), measure(2, 200.0, jitter=0.8, groups=4)]
    got = findings(records)["loader_throughput"]
    assert got.evidence["recommended"]["num_workers"] == 2
    assert got.evidence["noisy"] is True
    assert "rerun" in got.summary
    current = {"num_workers": 0, "prefetch_factor": None, "pin_memory": False, "persistent_workers": False}
    recs = loader.recommendations(loader.analyze_records(header(current=current), records))
    assert recs
    assert {r.confidence for r in recs} == {"low"}


def test_current_settings_clearly_slower_warn():
    records = [measure(0, 100.0), measure(1, 150.0, current=True), measure(2, 200.0)]
    f = findings(records)["loader_throughput"]
    assert f.verdict == "warn"
    assert "below the best" in f.summary


def test_recommendation_prefers_the_deepest_round():
    """A config seen only in round 0 with a lucky short window is not recommended over the finalists."""
    records = [
        measure(1, 199.0, groups=3, jitter=0.2),  # round 0 only, noisy: within noise of anything
        measure(2, 200.0, rnd=0),
        measure(2, 200.0, rnd=1),
        measure(3, 201.0, rnd=0),
        measure(3, 201.0, rnd=1),
    ]
    f = findings(records)["loader_throughput"]
    assert f.evidence["recommended"]["num_workers"] == 2


def test_over_budget_config_is_never_recommended():
    records = [measure(1, 100.0), measure(8, 400.0, current=True)]
    got = findings(records, cpu_budget_per_rank=1)
    assert got["loader_throughput"].evidence["recommended"]["num_workers"] == 1
    assert got["loader_throughput"].evidence["best"]["num_workers"] == 1  # best within the budget
    assert got["loader_throughput"].evidence["current_samples_per_s"] == pytest.approx(400.0, rel=1e-6)
    assert got["loader_budget"].verdict == "warn"
    assert "exceeds" in got["loader_budget"].summary


def test_halving_keeps_the_fastest_third_and_the_cheapest_within_noise():
    pooled = loader.pool(
        [measure(0, 50.0), measure(1, 120.0), measure(2, 199.0), measure(3, 150.0), measure(4, 201.0),
         measure(5, 202.0)]
    )  # fmt: skip
    kept = [p.config for p in loader.halving_keep(list(pooled.values()), eta=3)]
    assert kept == ["w5-p2", "w4-p2", "w2-p2"]  # top 2 of 6 by rate, and w2 (within 3 % of 202)
    two = [p for p in pooled.values() if p.config in ("w2-p2", "w5-p2")]
    assert [p.config for p in loader.halving_keep(two, eta=3)] == ["w5-p2"]  # a round must shrink


def test_shm_need_above_free_fails_and_bus_error_fails():
    # 4 workers × prefetch 4 × 8 MiB × 2 ranks = 256 MiB > 64 MiB (docker's default /dev/shm)
    records = [measure(4, 200.0, prefetch=4, batch_bytes=8 << 20)]
    current = {"num_workers": 4, "prefetch_factor": 4, "pin_memory": False, "persistent_workers": True}
    f = findings(records, shm_free_bytes=64 << 20, current=current)["loader_shm"]
    assert f.verdict == "fail"
    assert f.evidence["current"]["need_bytes_node"] == 256 << 20
    assert findings(records)["loader_shm"].verdict == "pass"  # 8 GiB free
    bus = "DataLoader worker (pid 7) is killed by signal: Bus error. It is possible that ... shared memory"
    crashed = {**measure(2, 1.0), "status": "worker_crashed", "error": bus}
    assert findings([*records, crashed])["loader_shm"].verdict == "fail"


def test_worker_growth_beyond_in_flight_batches_warns():
    quiet = measure(2, 200.0, worker_uss_growth_bytes=3 << 20)  # < 2 batches of 1 MiB + 16 MiB
    growing = measure(3, 200.0, worker_uss_growth_bytes=80 << 20, worker_rss_growth_bytes=1 << 20)
    assert findings([quiet])["loader_worker_growth"].verdict == "pass"
    f = findings([quiet, growing])["loader_worker_growth"]
    assert f.verdict == "warn"
    assert f.evidence["config"] == "w3-p2"
    assert "copy-on-read" in f.summary
    assert findings([measure(0, 100.0)])["loader_worker_growth"].verdict == "not_run"


def test_failures_fail_and_nothing_measured_is_not_run():
    hung = {**measure(1, 1.0), "status": "timeout", "error": "watchdog: no batch for 2 s"}
    got = findings([measure(0, 100.0), hung])
    assert got["loader_errors"].verdict == "fail"
    assert got["loader_errors"].evidence["failures"][0]["status"] == "timeout"
    assert got["loader_throughput"].evidence["recommended"]["num_workers"] == 0
    assert findings([hung])["loader_throughput"].verdict == "not_run"


def test_recommendations_name_only_what_changes():
    recs = {r.setting: r for r in loader.recommendations(loader.analyze_records(header(), curve()))}
    assert set(recs) == set()  # current (2 workers, prefetch 2, persistent) is already the recommendation
    current = {"num_workers": 4, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": True}
    recs = {
        r.setting: r for r in loader.recommendations(loader.analyze_records(header(current=current), curve()))
    }
    assert recs["dataloader.num_workers"].value == 2
    assert recs["dataloader.num_workers"].current == 4


def test_analyze_reads_the_last_sweep_of_a_run_directory(tmp_path):
    run = RunDir.create(tmp_path / "run")
    with run.writer("loader") as w:
        old = [{**r, "sweep": "old"} for r in [header(sweep="old"), measure(0, 999.0)]]
        for record in [*old, header(), *curve()]:
            w.write(record)
    got = {f.check: f for f in run_all(run) if f.probe == "loader"}
    assert got["loader_throughput"].evidence["best"]["num_workers"] == 3
    assert set(got) == {
        "loader_throughput",
        "loader_shm",
        "loader_worker_growth",
        "loader_budget",
        "loader_errors",
    }
