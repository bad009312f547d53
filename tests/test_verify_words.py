"""verify's words: "yours is fine" only when the interval lies inside the negligible margin, and a
change that needs another (prefetch_factor needs workers) is tried with it, as one change."""

from __future__ import annotations

from ciuic_doctor.recommend.core import Plan
from ciuic_doctor.recommend.verified import NO_EFFECT, apply
from ciuic_doctor.rundir.findings import Recommendation
from ciuic_doctor.verify.figures import RunFigures
from ciuic_doctor.verify.judge import judge
from ciuic_doctor.verify.plan import Candidate, JobKind, candidates
from ciuic_doctor.verify.runner import RunResult

JOB = JobKind(kind="watch", backend="none", cuda=False, settable=None)


def _judged(b_over_a: list[float]) -> dict:
    """Rounds whose B / A of the time before backward are `b_over_a`; step time and RSS unchanged."""
    results, figures = [], {}
    for rnd, ratio in enumerate(b_over_a, start=1):
        for side, factor in (("A", 1.0), ("c1", ratio)):
            path = f"r{rnd}-{side}"
            results.append(RunResult(side=side, round=rnd, path=path, seconds=1.0, exit_code=0))
            figures[path] = RunFigures(step_time_s=0.2, pre_backward_s=0.1 * factor, rss_bytes=1e8,
                                       steps=10, records=[])  # fmt: skip
    cand = Candidate(id="c1", settings={"dataloader.pin_memory": True}, current={}, target="pre_backward")
    return judge(cand, results, None, figures)


def test_wide_interval_is_not_called_fine():
    """Rounds at 0.5×, 2.1×, 1.0×, 0.8×: an interval of roughly −50 … +100 %; nothing is excluded that a
    user would call small, so the words say what was excluded and the change is not dropped."""
    wide = _judged([0.5, 2.1, 1.0, 0.8])
    assert wide["status"] == NO_EFFECT
    assert wide["conclusive"] is False
    assert "yours is fine" not in wide["reason"]
    assert "rule out only changes larger than" in wide["reason"]
    assert "more rounds would tell" in wide["reason"]
    narrow = _judged([1.002, 0.998, 1.001, 0.999])
    assert narrow["status"] == NO_EFFECT
    assert narrow["conclusive"] is True
    assert "yours is fine" in narrow["reason"]

    rec = Recommendation(
        setting="dataloader.pin_memory", value=True, current=False, why="w", confidence="medium"
    )
    for judged, kept in ((wide, True), (narrow, False)):
        out = apply(Plan(recommendations=[rec]), {"candidates": [{**judged, "source": "recommendation"}]})
        assert out.recommendations[0].value is kept, out.recommendations[0].why
        assert ("yours is fine" in out.recommendations[0].why) is not kept


def _rec(setting, value, current, change=True):
    return {"setting": setting, "value": value, "current": current, "change": change, "evidence": {}}


def test_worker_settings_go_with_the_workers_they_need():
    """From 0 workers, prefetch_factor 4 and persistent_workers true cannot act alone: one change with
    num_workers 2; without a worker change they are not tried (never dropped as "fine")."""
    recs = [
        _rec("dataloader.num_workers", 2, 0),
        _rec("dataloader.prefetch_factor", 4, None),
        _rec("dataloader.persistent_workers", True, False),
    ]
    found = candidates(recs, [], JOB)
    assert len(found) == 1
    assert found[0].settings == {
        "dataloader.num_workers": 2,
        "dataloader.prefetch_factor": 4,
        "dataloader.persistent_workers": True,
    }
    alone = candidates([_rec("dataloader.num_workers", 0, 0, change=False), *recs[1:]], [], JOB)
    assert len(alone) == 2
    assert all(c.unverifiable for c in alone)
    assert all("num_workers=0" in c.unverifiable for c in alone)


def test_prefetch_factor_at_zero_workers_is_refused_not_in_force(tmp_path):
    """`watch --set dataloader.prefetch_factor=4` on a script whose loader runs 0 workers: DataLoader
    would refuse the key, so watch drops it; it is then in force nowhere and watch says so (exit 2)."""
    from tests.conftest import run_cli
    from tests.test_data_wait import SCRIPT

    run = tmp_path / "run"
    done = run_cli("watch", "--set", "dataloader.prefetch_factor=4", "--out", str(run), "--", str(SCRIPT),
                   "--steps", "3", "--load-ms", "0", timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "acts only with DataLoader workers" in done.stderr
