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


def _a2a(layer: int, mode: str, rounds: list[float]) -> dict:
    ordered = sorted(rounds)
    return {"collective": "all_to_all", "splits": mode, "layer": layer, "status": "ok",
            "time_us_p50": (ordered[1] + ordered[2]) / 2, "round_p50_us": rounds}  # fmt: skip


def test_alltoall_headline_has_an_interval_and_says_no_measurable_cost_for_noise():
    """Layer 0 reads 1.10x on its medians but its rounds go both ways: noise. With a layer whose every
    round is 1.6x, that layer is the headline, with its interval."""
    noise = [_a2a(0, "even", [100, 120, 90, 110]), _a2a(0, "routed", [125, 105, 115, 100])]
    found = moe.alltoall_finding(noise)
    assert found.verdict == "pass"
    assert "no measurable cost" in found.summary, found.summary
    costly = [*noise, _a2a(3, "even", [100, 101, 99, 100]), _a2a(3, "routed", [160, 162, 158, 161])]
    found = moe.alltoall_finding(costly)
    assert found.verdict == "warn"
    assert found.summary.startswith("all_to_all with the recorded routing: layer 3 takes 1.60x"), (
        found.summary
    )
    assert "95 % CI" in found.summary


def test_comm_bench_splits_take_the_token_width_from_the_recorded_router(tmp_path):
    """A model without an HF config: the token width is the router weight's (16), not DeepSeek-V3's
    7,168, and the output says where it came from; each record carries its per-round medians."""
    run = _watch(tmp_path, "btk")
    out = tmp_path / "a2a"
    done = run_cli("comm-bench", "--nproc", "2", "--splits-from", str(run.path), "--iters", "5",
                   "--out", str(out), timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "router weight's input width" in done.stdout
    records = [r for r in RunDir.open(out).read("comm").records if r.get("splits")]
    assert records
    assert {r["hidden"] for r in records} == {16}
    assert all(len(r["round_p50_us"]) == 4 for r in records)
    assert "95 %" in done.stdout
