"""Routers as other code bases write them: indices per sequence ([batch, seq, k]) are read, and a model
whose router watch cannot recognise says so (not_run with why) instead of leaving no stream and no word."""

from __future__ import annotations

import json
from pathlib import Path

from ciuic_doctor.analysis import moe
from ciuic_doctor.rundir.store import RunDir
from tests.conftest import run_cli

SCRIPT = Path(__file__).parent / "data" / "user_scripts" / "moe_shapes_train.py"


def _watch(tmp_path: Path, kind: str) -> RunDir:
    run = tmp_path / kind
    done = run_cli(
        "watch", "--moe-every", "1", "--out", str(run), "--", str(SCRIPT), "--kind", kind, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return RunDir.open(run)


def test_indices_per_sequence_are_read(tmp_path):
    """[4, 8, 2] indices: 32 tokens a call, 2 layers, 3 steps; every token's two choices counted."""
    run = _watch(tmp_path, "btk")
    records = run.read("moe").records
    assert {r["layer"] for r in records} == {0, 1}
    assert all(r["tokens"] == 32 and r["experts"] == 4 and sum(r["counts"]) == 64 for r in records), records
    checks = {f.check: f for f in moe.analyze(run)}
    assert "expert_imbalance" in checks
    assert "expert_routing_recorded" not in checks


def test_unrecognised_router_is_said_not_silent(tmp_path):
    run = _watch(tmp_path, "chooser")
    assert not run.has_stream("moe")
    status = json.loads((run.path / "meta.json").read_text())["model"]["moe"]
    assert status["experts_without_router"] == ["layers.0", "layers.1"]
    (finding,) = [f for f in moe.analyze(run) if f.check == "expert_routing_recorded"]
    assert finding.verdict == "not_run"
    assert "no expert load recorded" in finding.summary
    assert "layers.0" in finding.summary
