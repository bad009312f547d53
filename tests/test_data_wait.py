"""A loader-bound script found by the everyday path: watch's own step timings show the data wait, the
report recommends workers within the CPU budget, and verify tries them (analysis/loader/wait.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ciuic_doctor.analysis.loader.wait import data_wait_finding
from ciuic_doctor.verify.plan import JobKind, candidates
from tests.conftest import run_cli

SCRIPT = Path(__file__).parent / "data" / "user_scripts" / "sleepy_loader_train.py"


def _watch_and_report(run: Path, *args: str) -> list[dict]:
    done = run_cli("watch", "--out", str(run), "--", str(SCRIPT), *args, timeout=300)
    assert done.returncode == 0, done.stderr
    done = run_cli("report", str(run), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((run / "recommendations.json").read_text())["recommendations"]


@pytest.mark.slow
def test_loader_bound_script_gets_workers_and_verify_tries_them(tmp_path):
    """5 ms an item × 8 items a batch in the main process against a ~1 ms step: the steps wait for data
    almost all the time; the report recommends workers and verify has a change to try."""
    recs = _watch_and_report(tmp_path / "run")
    workers = [r for r in recs if r["setting"] == "dataloader.num_workers"]
    assert workers, recs
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    budget = meta["env"]["cpu"]["usable"]
    assert workers[0]["current"] == 0
    assert 1 <= workers[0]["value"] <= budget
    found = candidates(recs, [], JobKind(kind="watch", backend="none", cuda=False, settable=None))
    tried = [c for c in found if "dataloader.num_workers" in c.settings and not c.unverifiable]
    assert tried
    assert tried[0].target == "pre_backward"


@pytest.mark.slow
def test_compute_bound_script_gets_no_workers(tmp_path):
    """The same script with a free dataset and a wider model: the wait is a few per cent, no change."""
    recs = _watch_and_report(tmp_path / "run", "--load-ms", "0", "--width", "2048")
    assert not [r for r in recs if r["setting"] == "dataloader.num_workers"], recs


def test_the_rule_in_numbers():
    """48 ms steps of which 47 ms before backward: the wait is ~46.5 ms; the suggestion is capped by the
    budget, and a job whose wait is a tenth of its step passes."""
    loader = {"num_workers": 0}
    bound = data_wait_finding([(0.048, 0.047)] * 10, loader, budget=2)
    assert bound.verdict == "warn"
    assert bound.evidence["suggested_num_workers"] == 2
    assert bound.evidence["workers_to_hide_wait"] > 2
    light = data_wait_finding([(0.100, 0.040)] * 10, loader, budget=8)  # 40 − 60/2 = 10 ms of 100
    assert light.verdict == "pass"
    assert data_wait_finding([(0.1, 0.09)] * 3, loader, budget=2).verdict == "not_run"
    full = data_wait_finding([(0.048, 0.047)] * 10, {"num_workers": 2}, budget=2)
    assert full.verdict == "warn"
    assert "do not fit" in full.summary
