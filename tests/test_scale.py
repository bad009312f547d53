"""A many-rank job: the cross-rank step analysis, the one-finding-per-check contract and the summarised
report on a generated 256-rank run with a straggler from mid-run, a whole slow host and a leaking rank
planted (tests/scalesynth.py); and the change-point arithmetic on matrices with known answers."""

from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest

from ciuic_doctor.analysis import run_all
from ciuic_doctor.analysis.steps import check_pace
from ciuic_doctor.analysis.steps.crossrank import StepMatrix, classify, slow_hosts
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir
from tests import scalesynth
from tests.conftest import run_cli

PLAN = scalesynth.Plan(ranks=256, steps=600)


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    path = scalesynth.generate(tmp_path_factory.mktemp("scale") / "run", PLAN)
    findings = run_all(RunDir.open(path))
    return path, findings


def _flagged(findings: list[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        if f.verdict in ("warn", "fail"):
            out.setdefault(f.check, []).append(f)
    return out


@pytest.mark.slow
def test_each_planted_problem_is_named_in_one_finding_and_nothing_else(big_run):
    _, findings = big_run
    flagged = _flagged(findings)
    assert set(flagged) == {"straggler_onset", "slow_host", "memory_leak"}, {
        k: [f.summary for f in v] for k, v in flagged.items()
    }
    assert all(len(v) == 1 for v in flagged.values())
    onset = flagged["straggler_onset"][0]
    assert onset.where["ranks"] == [PLAN.straggler_rank]
    assert onset.where["hosts"] == [PLAN.host_of(PLAN.straggler_rank)]
    assert onset.where["step"] == pytest.approx(PLAN.straggler_from_step, abs=PLAN.steps * 0.02)
    assert onset.evidence["excess_pct"] == pytest.approx(PLAN.straggler_pct, abs=2)
    host = flagged["slow_host"][0]
    assert host.where["hosts"] == [PLAN.slow_host_name]
    assert sorted(host.where["ranks"]) == PLAN.slow_host_ranks
    assert host.evidence["slow_hosts"][0]["excess_pct"] == pytest.approx(PLAN.slow_host_pct, abs=2)
    leak = flagged["memory_leak"][0]
    assert leak.where["ranks"] == [PLAN.leak_rank]
    assert leak.evidence["growth_mb_per_step"] == pytest.approx(PLAN.leak_mib_per_step, rel=0.05)
    assert leak.evidence["ranks_checked"] == PLAN.ranks
    # one finding per check for the whole job, never one per rank
    per_check = {}
    for f in findings:
        per_check[(f.probe, f.check, f.evidence.get("kind"))] = (
            per_check.get((f.probe, f.check, f.evidence.get("kind")), 0) + 1
        )
    assert max(per_check.values()) == 1, per_check
    assert len(findings) < 30
    # the slow host's ranks are a host problem: not named again as rank stragglers
    step_time = next(f for f in findings if f.check == "step_time")
    assert step_time.verdict == "pass"
    assert step_time.evidence["chronic_ranks"] == 0


@pytest.mark.slow
def test_report_summarises_256_ranks(big_run, tmp_path):
    path, _ = big_run
    done = run_cli("report", str(path), "--quiet", timeout=300)
    assert done.returncode == 0, done.stderr
    page = (path / "report.html").read_text()
    assert len(page) < 1.5 * 2**20
    # bands and a heat-map, not one SVG line per rank
    assert "step time per step across ranks" in page
    assert "host × rank heat-map" in page
    assert f"rank {PLAN.straggler_rank} ({PLAN.host_of(PLAN.straggler_rank)})" in page
    # the per-rank table shows the named ranks and a distribution line; the CSV has every rank
    assert 'href="steps_per_rank.csv"' in page
    match = re.search(r"Per rank: the (\d+) ranks the findings name or that are slowest, of 256", page)
    assert match is not None
    assert int(match[1]) <= 16
    with open(path / "steps_per_rank.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == PLAN.ranks
    assert {int(r["rank"]) for r in rows} == set(range(PLAN.ranks))
    assert float(rows[PLAN.leak_rank]["peak_rss_bytes"]) > float(rows[0]["peak_rss_bytes"]) + 500 * 2**20
    # where-lists are abbreviated in the page, complete in findings.json
    data = json.loads((path / "findings.json").read_text())
    host = next(f for f in data["findings"] if f["check"] == "slow_host")
    assert len(host["where"]["ranks"]) == 8
    assert "… (+" not in host["summary"]


# ---- the arithmetic, on matrices with known answers ---------------------------------------------------
def _matrix(pace: np.ndarray, hosts: list[str | None] | None = None) -> StepMatrix:
    ranks = np.arange(pace.shape[0])
    return StepMatrix(
        ranks=ranks,
        steps=np.arange(1, pace.shape[1] + 1),
        hosts=hosts or [None] * len(ranks),
        step_time_s=pace + 0.5,
        pace_s=pace,
        pace_metric="pre_backward_s",
    )


def _noise(ranks: int, steps: int, sigma: float = 0.03, seed: int = 3) -> np.ndarray:
    return 0.3 * (1 + np.random.default_rng(seed).normal(0, sigma, (ranks, steps)))


def test_onset_recovery_chronic_and_one_off_are_told_apart():
    pace = _noise(64, 800)
    pace[5, 500:] *= 1.2  # slow from step 501
    pace[9, :300] *= 1.25  # slow until step 301
    pace[13] *= 1.3  # slow all along
    pace[17, [100, 400]] *= 3.0  # two one-off slow steps
    by_rank = {p.rank: p for p in classify(_matrix(pace))}
    assert (by_rank[5].kind, by_rank[5].change_step) == ("onset", 501)
    assert by_rank[5].excess_pct == pytest.approx(20, abs=1.5)
    assert (by_rank[9].kind, by_rank[9].change_step) == ("recovered", 301)
    assert by_rank[13].kind == "chronic"
    assert by_rank[13].excess_pct == pytest.approx(30, abs=1.5)
    assert by_rank[17].kind == "one_off"
    assert by_rank[17].one_off_steps == [101, 401]
    others = [p for r, p in by_rank.items() if r not in (5, 9, 13, 17)]
    assert {p.kind for p in others} == {"ok"}


def test_pure_noise_flags_nothing_across_1024_ranks():
    paces = classify(_matrix(_noise(1024, 500, sigma=0.05, seed=11)))
    assert [p.rank for p in paces if p.kind in ("chronic", "onset", "recovered")] == []


def test_a_shift_of_7_percent_is_a_straggler_among_alike_ranks_but_not_in_a_4_rank_job():
    pace = _noise(32, 600)
    pace[4, 300:] *= 1.07
    found = classify(_matrix(pace))[4]
    onset = check_pace(_matrix(pace))[1]
    assert re.search(r"rank 4 is \d\.\d % slower than its peers from step 30\d", onset.summary), onset.summary
    assert found.kind == "onset"
    assert found.change_step == pytest.approx(301, abs=3)
    assert found.excess_pct == pytest.approx(7, abs=1)
    assert classify(_matrix(pace[:4]))[0].kind == "ok"  # 4 ranks: too few for a spread, the 10 % rule
    assert classify(_matrix(pace[4:8]))[0].kind == "ok"


def test_a_shift_under_ten_percent_must_last(monkeypatch):
    from ciuic_doctor.analysis.steps import crossrank

    pace = _noise(64, 240, sigma=0.02)
    pace[4, 220:] *= 1.07  # the last 20 steps: a change point's segment, not yet sustained
    assert classify(_matrix(pace))[4].kind == "ok"
    monkeypatch.setattr(crossrank, "SUSTAINED_STEPS", 0)
    assert classify(_matrix(pace))[4].kind == "onset"  # what the rule holds back
    monkeypatch.undo()
    pace[4, 200:220] *= 1.07  # the last 40
    assert classify(_matrix(pace))[4].kind == "onset"
    pace = _noise(64, 240, sigma=0.02)
    pace[4, 220:] *= 1.2  # 20 %: the 10 % rule, no wait
    assert classify(_matrix(pace))[4].kind == "onset"


def test_a_shift_below_five_percent_is_never_a_straggler():
    pace = _noise(256, 600, sigma=0.01)
    pace[4, 300:] *= 1.04
    assert classify(_matrix(pace))[4].kind == "ok"


def test_a_whole_host_6_percent_slower_is_found_from_step_k():
    pace = _noise(128, 300, sigma=0.04, seed=5)
    hosts = [f"h{r // 8:02d}" for r in range(128)]
    pace[40:48, 150:] *= 1.06
    found, seen = slow_hosts(classify(_matrix(pace, hosts)), _matrix(pace, hosts))
    assert seen == 16
    assert [h.host for h in found] == ["h05"]
    assert found[0].change_step == pytest.approx(151, abs=5)
    assert found[0].excess_pct == pytest.approx(6, abs=1.5)


def test_a_host_whose_ranks_differ_too_much_one_by_one_is_found_as_one_unit():
    """Ranks 1.5 % apart (σ) keep the 10 % floor; their hosts' medians, √8 closer, do not: a host 8 %
    slower is named only as a unit."""
    pace = _noise(128, 300, sigma=0.04, seed=5) * (1 + np.random.default_rng(105).normal(0, 0.015, (128, 1)))
    hosts = [f"h{r // 8:02d}" for r in range(128)]
    pace[40:48, 150:] *= 1.08
    assert not [p for p in classify(_matrix(pace, hosts)) if p.kind not in {"ok", "one_off"}]
    by_check = {f.check: f for f in check_pace(_matrix(pace, hosts))}
    host = by_check["slow_host"]
    assert (host.verdict, host.where["host"], host.where["hosts"]) == ("warn", "h05", ["h05"])
    said = r"its 8 ranks together \(their median pace\) are \d\.\d % slower than the typical host.s"
    assert re.search(said, host.summary), host.summary
    assert host.evidence["slow_hosts"][0]["judged_as_unit"] is True
    assert slow_hosts(classify(_matrix(pace, hosts)))[0] == []  # rank by rank: not found


def test_whole_host_slow_is_a_host_problem_and_a_single_rank_is_not():
    pace = _noise(32, 400)
    hosts = [f"h{r // 8}" for r in range(32)]
    pace[8:16] *= 1.18  # every rank of h1
    pace[27] *= 1.4  # one rank of h3
    found, seen = slow_hosts(classify(_matrix(pace, hosts)))
    assert seen == 4
    assert [h.host for h in found] == ["h1"]
    assert found[0].ranks == list(range(8, 16))
    assert found[0].excess_pct == pytest.approx(18, abs=1.5)
