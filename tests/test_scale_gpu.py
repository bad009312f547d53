"""What a GPU job writes, at a size a test can afford (issue 25): every CUDA step field, memwatch with NVML
and a comm-bench table from tests/scalesynth.gpu_plan, judged by every analysis — the straggler, the leaking
rank and the reserved-memory grower each named by exactly one finding, nothing else flagged; the grouped
trend equal to robust_trend series by series; the hang analysis reading nothing without hang files."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ciuic_doctor.analysis import hang, run_all
from ciuic_doctor.analysis.stats.batch_trend import RankSeries, fit
from ciuic_doctor.analysis.stats.trend import robust_trend
from ciuic_doctor.rundir import frames
from ciuic_doctor.rundir.store import RunDir
from tests import scalesynth

# 240 steps: the grower grows 2 MiB/step to clear the growth floor (0.5 % of its ~63 GB) in a short run
PLAN = dataclasses.replace(scalesynth.gpu_plan(32, 240), grower_mib_per_step=2.0)


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    frames.clear_cache()
    path = scalesynth.generate(tmp_path_factory.mktemp("gpu") / "run", PLAN)
    return path, run_all(RunDir.open(path))


def test_each_planted_problem_is_named_once_and_nothing_else_is_flagged(judged):
    _, findings = judged
    flagged = [f for f in findings if f.verdict in ("warn", "fail")]
    by_check = {f.check: f for f in flagged}
    assert sorted(by_check) == ["empty_cache", "memory_leak", "straggler_onset"], [f.summary for f in flagged]
    assert len(flagged) == 3
    assert by_check["straggler_onset"].where["ranks"] == [PLAN.straggler_rank]
    assert by_check["memory_leak"].where["ranks"] == [PLAN.leak_rank]
    assert by_check["memory_leak"].evidence["kind"] == "host"
    assert by_check["memory_leak"].evidence["source"] == "memwatch"  # anon, mapped to steps
    assert by_check["empty_cache"].where["ranks"] == [PLAN.grower_rank]
    checked = {(f.check, f.evidence.get("kind")): f for f in findings}
    assert checked[("memory_leak", "device")].verdict == "pass"
    assert checked[("memory_leak", "device")].evidence["ranks_checked"] == PLAN.ranks
    assert checked[("non_pytorch_device_memory", None)].verdict == "pass"
    assert checked[("fragmentation", None)].evidence["ranks_checked"] == PLAN.ranks
    assert checked[("correctness", None)].verdict == "pass"  # the comm-bench table was judged too


def test_the_report_lists_the_named_ranks_among_the_watched_processes(judged, tmp_path):
    from ciuic_doctor.report import build_report

    path, _ = judged
    build_report(RunDir.open(path), analyze=False)
    page = (path / "report.html").read_text()
    assert f">rank {PLAN.leak_rank}<" in page
    assert "more processes not listed" in page  # 36 watched processes, 16 rows


def test_the_hang_analysis_reads_nothing_without_hang_files(judged, monkeypatch):
    path, _ = judged

    def refuse(*args, **kwargs):
        raise AssertionError("read a stream")

    monkeypatch.setattr(frames, "read_stream", refuse)
    monkeypatch.setattr(RunDir, "read", refuse)
    assert hang.analyze(RunDir.open(path)) == []


def test_grouped_trends_equal_robust_trend_series_by_series():
    rng = np.random.default_rng(5)
    ids, xs, ys, series = [], [], [], []
    # the last two: one block of two series on the same x (the x differences made once for both)
    for i, n in enumerate([2, 5, 9, 150, 200, 201, 999, 2000, 2000, 2000, 300, 300]):
        x = np.arange(n, dtype=float) if i % 4 else np.repeat(np.arange(n // 2 + 1), 2)[:n].astype(float)
        y = 1e9 + (i % 3) * 3e5 * x + rng.normal(0, 2e6, n)
        y[rng.integers(0, n)] = np.nan  # a missing value is left out, as robust_trend leaves it
        ids.append(np.full(n, i))
        xs.append(x)
        ys.append(y)
        series.append((x, y))
    trends = fit(RankSeries.of(np.concatenate(ids), np.concatenate(xs), np.concatenate(ys), len(series)))
    for i, (x, y) in enumerate(series):
        want, got = robust_trend(x, y), trends.trend(i)
        assert (want is None) == (got is None), i
        if want is None:
            continue
        for key in ("slope", "intercept", "r2", "z", "n", "x_first", "x_last"):
            assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-9, abs=1e-9), (i, key)


@pytest.mark.parametrize("kind", ["rising", "falling", "flat steps", "tiny", "subnormal"])
def test_mann_kendall_counted_about_the_median_equals_every_pair(kind):
    """The batch fit counts the rises and falls of the slopes once they are partitioned about their median
    (half the comparisons), or of every pair where a division could lose a sign; z must equal
    robust_trend's, which counts every pair, to the last bit."""
    rng = np.random.default_rng(11)
    n, count = 400, 60
    x = np.arange(n, dtype=float)
    series = []
    for i in range(count):
        if kind == "flat steps":  # mostly equal values: the median slope is 0, most pairs tie
            y = 1e9 + 4096 * rng.integers(0, 3, n) * (rng.random(n) < 0.05)
        elif kind == "subnormal":  # a few of the smallest doubles apart: dy / dx underflows to 0
            y = (rng.integers(0, 3, n) + (i % 5) * (x // 80)) * 5e-324
        else:
            scale = 1e-200 if kind == "tiny" else 1.0
            trend = {"rising": 3e5, "falling": -3e5}.get(kind, (-1) ** i * 1e3)
            y = (1e9 + trend * x + rng.normal(0, 2e6 if i % 2 else 2e8, n)) * scale
        series.append(y)
    ids = np.repeat(np.arange(count), n)
    trends = fit(RankSeries.of(ids, np.tile(x, count), np.concatenate(series), count))
    zs = [robust_trend(x, y).z for y in series]
    assert trends.z.tolist() == zs
    # every case the counting takes: the median slope above, below and at 0
    want = {"rising": trends.slope > 0, "falling": trends.slope < 0, "flat steps": trends.slope == 0}
    assert want.get(kind, np.ones(count, bool)).all()


def test_blocks_of_rows_or_queries_change_no_figure(monkeypatch):
    """The trend fits and the per-rank interpolation work a block at a time (to bound their temporaries);
    the block size must change nothing, to the last bit."""
    from ciuic_doctor.analysis.memory import columns as _memory_columns
    from ciuic_doctor.analysis.stats import batch_trend as _trends

    rng = np.random.default_rng(7)
    lengths = [3, 40, 40, 41, 200, 200, 200]
    ids = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
    xs = np.concatenate([np.arange(n, dtype=float) for n in lengths])
    ys = 1e9 + 3e5 * xs + rng.normal(0, 2e6, len(xs))
    group = rng.integers(0, len(lengths), 5000)
    t = rng.uniform(-5, 210, 5000)
    t[:50] = xs[ids == group[0]][-1]  # on a group's last point, and beyond it
    args = (group, t, ids, xs, ys)

    def figures():
        trends = fit(RankSeries.of(ids, xs, ys, len(lengths)))
        fields = ("slope", "intercept", "r2", "z", "n", "x_first", "x_last")
        at = _memory_columns.group_last_before(group, t, ids, xs)
        return [getattr(trends, k) for k in fields], _memory_columns.group_interp(*args), at

    whole = figures()
    monkeypatch.setattr(_trends, "PAIRS_PER_BLOCK", 50)
    monkeypatch.setattr(_trends, "TRANSPOSE_BLOCK", 7)
    monkeypatch.setattr(_memory_columns, "QUERY_BLOCK", 7)
    blocked = figures()
    for a, b in zip(whole[0], blocked[0], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole[1], blocked[1])
    np.testing.assert_array_equal(whole[2], blocked[2])
    assert np.isfinite(whole[1]).sum() > 1000
    assert (whole[2] >= 0).sum() > 1000


def test_blocks_of_ranks_change_no_figure(judged, monkeypatch):
    """The memory checks' grouped passes run RANKS_PER_BLOCK ranks at a time: any block size (here 5 and
    7 of 32 ranks, so blocks end mid-host) gives every rank the same series, trend and finding."""
    from ciuic_doctor.analysis import memory
    from ciuic_doctor.analysis.memory import blocks as _memory_blocks
    from ciuic_doctor.analysis.memory.batch import device_fits, host_fits, steps_fits
    from ciuic_doctor.analysis.memory.cuda_figures import fragmentation_figures, non_pytorch_fits
    from ciuic_doctor.analysis.memory.data import _Data

    path, _ = judged
    run = RunDir.open(path)

    def figures():
        data = _Data(run)
        every = {
            "host": host_fits(data),
            "device": device_fits(data),
            "reserved": steps_fits(data, "mem_reserved"),
            "some": steps_fits(data, "mem_allocated", [1, 6, 30]),
            "nonpt": non_pytorch_fits(data),
        }
        out = {}
        for name, made in every.items():
            fits = made
            if name == "nonpt":
                out["nonpt_arrays"] = [made.points, made.level, made.last]
                fits = made.fits
            trends = [getattr(fits.trends, k) for k in ("valid", "slope", "intercept", "r2", "z", "n")]
            out[name] = [fits.has, fits.step_unit, *trends]
            series = [fits.series(i) for i in range(len(fits.ranks))]
            out[name + "_lists"] = (fits.ranks, fits.metric, fits.source, fits.pid, fits.host, series)
        shards = fragmentation_figures(data)
        out["fragmentation"] = [getattr(shards, k) for k in ("reserved", "allocated", "peak", "retries")]
        out["fragmentation_lists"] = shards.ranks
        findings = [f.to_dict() for f in memory.analyze(run)]
        return out, findings

    whole, whole_findings = figures()
    assert sum(len(s.x) for s in whole["host_lists"][-1]) > 1000
    assert sum(len(s.x) for s in whole["nonpt_lists"][-1]) > 1000
    for size in (5, 7):
        monkeypatch.setattr(_memory_blocks, "RANKS_PER_BLOCK", size)
        blocked, blocked_findings = figures()
        for name, values in whole.items():
            if name.endswith("_lists"):
                assert values == blocked[name], name
            else:
                for a, b in zip(values, blocked[name], strict=True):
                    np.testing.assert_array_equal(a, b, err_msg=name)
        assert whole_findings == blocked_findings


@pytest.mark.parametrize("memwatch", [False, True])
def test_blocks_of_ranks_without_memwatch_or_cuda_fields_change_no_finding(tmp_path, monkeypatch, memwatch):
    """A CPU job's steps alone (no memwatch), or memwatch beside them: blocks of 3 of 10 ranks judge
    every memory check as one block does, not_run reasons included."""
    from ciuic_doctor.analysis import memory
    from ciuic_doctor.analysis.memory import blocks as _memory_blocks

    plan = scalesynth.Plan(ranks=10, steps=80, gpu=False, memwatch=memwatch, ranks_per_host=4)
    run = RunDir.open(scalesynth.generate(tmp_path / "run", plan))
    frames.clear_cache()
    whole = [f.to_dict() for f in memory.analyze(run)]
    monkeypatch.setattr(_memory_blocks, "RANKS_PER_BLOCK", 3)
    blocked = [f.to_dict() for f in memory.analyze(run)]
    assert blocked == whole
    assert any(f["check"] == "memory_leak" and f["verdict"] in ("warn", "fail") for f in whole)


def test_blocks_of_ranks_convert_only_their_own_rows(judged, monkeypatch):
    """In blocks, no memory check makes a job-wide float64 copy of a steps or memwatch column (80 MB each
    at 10,000 ranks × 1,000 steps) and no joined fit keeps its points; host and role stay dictionary
    codes while the checks run, and a joined fit still gives any rank's series (made again from it).
    On one core: forked workers' copies would die with them, unseen here."""
    from ciuic_doctor.analysis.memory import blocks as _memory_blocks
    from ciuic_doctor.analysis.memory.data import _Data
    from ciuic_doctor.parallel import using

    path, _ = judged
    monkeypatch.setattr(_memory_blocks, "RANKS_PER_BLOCK", 6)
    data = _Data(RunDir.open(path))
    with using(jobs=1):  # the blocks run here, where a job-wide column would be seen
        _convert_only_own_rows(data)


def _convert_only_own_rows(data):
    import pyarrow as pa

    from ciuic_doctor.analysis.memory.batch import host_fits
    from ciuic_doctor.analysis.memory.cuda import cuda_findings
    from ciuic_doctor.analysis.memory.leaks import leak_findings

    assert pa.types.is_dictionary(data.steps._table["host"].type)
    assert pa.types.is_dictionary(data.memwatch._table["role"].type)
    flagged = [f for f in [*leak_findings(data), *cuda_findings(data)] if f.verdict in ("warn", "fail")]
    assert {f.check for f in flagged} == {"memory_leak", "empty_cache"}
    assert not data.steps._columns  # no job-wide column was made
    assert not data.memwatch._columns
    fits = host_fits(data)
    assert fits.points is None
    leak = fits.ranks.index(PLAN.leak_rank)
    series = fits.series(leak)
    assert len(series.x) > 100
    assert series.source == "memwatch"


def test_the_memory_analysis_lets_its_data_go_without_the_cycle_collector(judged, monkeypatch):
    """Joined fits make a rank's series again from `data` (RankFits.remake): the memory analysis's columns
    must be freed when it returns, not when Python's cycle collector next runs (an analysis later)."""
    import gc
    import weakref

    from ciuic_doctor.analysis import memory
    from ciuic_doctor.analysis.memory import blocks as _memory_blocks
    from ciuic_doctor.analysis.memory import data as _memory_data

    path, _ = judged
    monkeypatch.setattr(_memory_blocks, "RANKS_PER_BLOCK", 6)
    made: list[weakref.ref] = []

    def data_of(run):
        data = _memory_data._Data(run)
        made.append(weakref.ref(data))
        return data

    monkeypatch.setattr(memory, "_Data", data_of)
    gc.collect()
    gc.disable()
    try:
        memory.analyze(RunDir.open(path))
        alive = [ref() is not None for ref in made]
    finally:
        gc.enable()
    assert alive == [False]


def test_the_passes_made_ahead_in_one_map_give_the_same_findings(judged, monkeypatch):
    """memory.analyze runs its five grouped passes over the blocks in one map (`blocks.run_ahead`), in
    forked workers; the findings equal those of the passes made one map each, when asked."""
    from ciuic_doctor import parallel
    from ciuic_doctor.analysis import memory
    from ciuic_doctor.analysis.memory import blocks as _memory_blocks

    path, _ = judged
    monkeypatch.setattr(_memory_blocks, "RANKS_PER_BLOCK", 7)  # 32 ranks: 5 blocks
    maps = []
    original = _memory_blocks.map_blocks

    def counted(fn, items, **kwargs):
        maps.append(len(items))
        return original(fn, items, **kwargs)

    monkeypatch.setattr(_memory_blocks, "map_blocks", counted)

    def findings() -> list[dict]:
        frames.clear_cache()
        with parallel.using(jobs=2):
            return [f.to_dict() for f in memory.analyze(RunDir.open(path))]

    ahead = findings()
    assert maps == [5]  # every pass in one map of the 5 blocks
    maps.clear()
    monkeypatch.setattr(memory, "run_ahead", lambda data, passes: None)
    one_by_one = findings()
    assert maps == [5, 5, 5, 5, 5]
    assert ahead == one_by_one
    assert any(f["verdict"] == "warn" for f in ahead)
