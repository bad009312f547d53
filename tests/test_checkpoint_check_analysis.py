"""The checkpoint analysis on recorded figures (no torch, no ranks): verdict thresholds, the hint and what
triggers it, exact vs tolerant resume comparison, and the evidence the recommendations read."""

from __future__ import annotations

import pytest

from ciuic_doctor.analysis.checkpoint import DCP_HINT, analyze_records, summary_lines
from ciuic_doctor.rundir.findings import Finding

GIB = 1 << 30


def config(**overrides):
    base = {
        "kind": "config", "rank": 0, "device": "cpu", "backend": "gloo", "nproc": 2, "local_world_size": 2,
        "timeout_s": 1800, "pytorch_default_timeout_s": 1800.0, "probe_timeout_s": 3600.0, "every_steps": 20,
        "host_available_bytes": 16 * GIB,
    }  # fmt: skip
    return {**base, **overrides}


def saves(save_s, *, repeats=1, size=10 << 20):
    """Rank 0 writes for save_s; rank 1 waits about as long at the barrier."""
    records = []
    for repeat in range(repeats):
        records.append(
            {
                "kind": "save",
                "rank": 0,
                "repeat": repeat,
                "save_s": save_s,
                "gather_s": 0.01,
                "barrier_wait_s": 0.001,
                "size_bytes": size,
            }
        )
        records.append(
            {
                "kind": "save",
                "rank": 1,
                "repeat": repeat,
                "save_s": 0.0,
                "gather_s": 0.01,
                "barrier_wait_s": save_s,
                "size_bytes": size,
            }
        )
    return records


def loads(load_s=0.05, broadcast_s=0.2, *, held=10 << 20, delta=1 << 20, peak=400 << 20):
    records = []
    for rank in (0, 1):
        records.append(
            {
                "kind": "load",
                "method": "every_rank",
                "rank": rank,
                "repeat": 0,
                "load_s": load_s,
                "peak_rss_bytes": peak,
                "rss_delta_bytes": delta,
                "held_bytes": held,
            }
        )
        records.append(
            {
                "kind": "load",
                "method": "rank0_broadcast",
                "rank": rank,
                "repeat": 0,
                "load_s": broadcast_s,
                "broadcast_wait_s": broadcast_s if rank else None,
                "peak_rss_bytes": peak + held,
                "rss_delta_bytes": 2 * held,
                "held_bytes": held,
            }
        )
    return records


def fingerprint(**overrides):
    base = {
        "params": {"sha256": "p0", "sumsq": 12.5}, "optimizer": {"sha256": "o0", "sumsq": 3.25},
        "lr": [1e-4, 1e-4], "scaler": None, "rng.python": "a", "rng.numpy": "b", "rng.torch": "c",
        "rng.cuda": None, "step": 8, "data_position": [0, 64, 8],
    }  # fmt: skip
    return {**base, **overrides}


def resumes(variant="as saved", *, losses=(6.9, 6.8), fp=None, **extra):
    records = []
    for rank in (0, 1):
        records.append(
            {
                "kind": "resume",
                "rank": rank,
                "variant": "reference",
                "first_step": 5,
                "losses": [6.9, 6.8],
                "fingerprint": fingerprint(),
                "median_step_s": 0.2,
            }
        )
        records.append(
            {
                "kind": "resume",
                "rank": rank,
                "variant": variant,
                "first_step": 5,
                "losses": list(losses),
                "fingerprint": fp or fingerprint(),
                "drop": [],
                "missing": [],
                "not_applicable": ["scaler", "rng.cuda"],
                **extra,
            }
        )
    return records


def one(findings: list[Finding], check: str) -> Finding:
    matching = [f for f in findings if f.check == check]
    assert len(matching) == 1, [f.check for f in findings]
    return matching[0]


@pytest.mark.parametrize(
    ("save_s", "timeout_s", "verdict"),
    [(2.5, 1, "fail"), (0.5, 1, "warn"), (0.1, 1, "pass"), (0.1, 1800, "pass"), (700.0, 1800, "warn")],
)
def test_timeout_risk_compares_the_longest_wait_with_the_timeout(save_s, timeout_s, verdict):
    findings = analyze_records([config(timeout_s=timeout_s), *saves(save_s), *loads(broadcast_s=0.01)])
    risk = one(findings, "timeout_risk")
    assert risk.verdict == verdict
    assert risk.evidence["timeout_s"] == timeout_s
    assert risk.evidence["barrier_wait_s"] == save_s
    assert risk.evidence["save_s"] == pytest.approx(save_s + 0.01)  # the RNG gather is part of the wait
    assert ("hint" in risk.evidence) == (verdict != "pass")


def test_a_broadcast_load_longer_than_the_timeout_is_a_risk_too():
    findings = analyze_records([config(timeout_s=60), *saves(0.1), *loads(broadcast_s=90.0)])
    risk = one(findings, "timeout_risk")
    assert risk.verdict == "fail"
    assert risk.evidence["longest_wait"] == "wait in the broadcast of the seed's rank-0 load"


def test_cost_hint_names_the_save_share_of_training_time_that_triggered_it():
    # A 1 s save every 20 steps of 0.2 s: every rank spends 1.01 s of each 4 s blocked, 25 %.
    findings = analyze_records([config(), *saves(1.0, repeats=3), *loads(), *resumes()])
    cost = one(findings, "checkpoint_cost")
    assert cost.verdict == "warn"
    assert cost.evidence["hint"] == DCP_HINT
    assert cost.evidence["save_overhead_pct"] == pytest.approx(25.25)
    assert "25.2 % of training time" in cost.evidence["hint_trigger"]


def test_cost_fails_when_every_local_rank_loading_at_once_exceeds_host_memory():
    # The warm process added little RSS, but each rank holds 10 GiB of tensors: 2 ranks need 20 of 16 GiB.
    records = [config(), *saves(0.01), *loads(held=10 * GIB, delta=1 << 20), *resumes()]
    cost = one(analyze_records(records), "checkpoint_cost")
    assert cost.verdict == "fail"
    assert cost.evidence["host_load_bytes"] == 20 * GIB
    assert cost.evidence["hint"] == DCP_HINT
    assert "more than the host has" in cost.evidence["hint_trigger"]


def test_cheap_checkpoint_passes_with_both_loads_side_by_side():
    findings = analyze_records([config(), *saves(0.05), *loads(load_s=0.05, broadcast_s=0.2), *resumes()])
    cost = one(findings, "checkpoint_cost")
    assert cost.verdict == "pass"
    assert cost.evidence["hint"] is None
    assert cost.evidence["faster_load"] == "every_rank"
    for key in (
        "save_s",
        "load_s",
        "size_bytes",
        "barrier_wait_s",
        "peak_load_rss_bytes",
        "broadcast_load_s",
    ):
        assert cost.evidence[key] is not None, key
    assert [row["rank"] for row in cost.evidence["per_rank"]] == [0, 1]
    text = "\n".join(summary_lines(findings))
    assert "every rank reads the file" in text
    assert "rank 0 reads + broadcast" in text


@pytest.mark.parametrize(("device", "verdict"), [("cpu", "fail"), ("cuda", "pass")])
def test_resume_is_exact_on_cpu_and_within_tolerance_on_cuda(device, verdict):
    nudged = fingerprint(params={"sha256": "p1", "sumsq": 12.5 * (1 + 1e-9)})
    records = [config(device=device), *saves(0.05), *resumes(losses=(6.9, 6.8 * (1 + 1e-9)), fp=nudged)]
    finding = one(analyze_records(records), "resume_mismatch")
    assert finding.verdict == verdict
    assert finding.evidence["exact"] is (device == "cpu")


def test_only_latent_state_differing_is_a_warning_that_names_it():
    records = [
        config(),
        *saves(0.05),
        *resumes(fp=fingerprint(**{"rng.python": "other"}), missing=["rng.python"]),
    ]
    finding = one(analyze_records(records), "resume_mismatch")
    assert finding.verdict == "warn"
    assert finding.evidence["differs"] == ["rng.python"]
    assert finding.evidence["first_divergent_step"] is None
    assert finding.evidence["hint"] == "also save: rng.python"


def test_a_loss_difference_fails_at_the_step_it_appears():
    records = [config(), *saves(0.05), *resumes(losses=(6.9, 7.0), missing=["optimizer"])]
    finding = one(analyze_records(records), "resume_mismatch")
    assert finding.verdict == "fail"
    assert finding.evidence["first_divergent_step"] == 6
    assert finding.evidence["max_abs_loss_diff"] == pytest.approx(0.2)
    assert finding.where["step"] == 6


def test_resume_not_run_says_why():
    records = [config(), *saves(0.05), {"kind": "skipped", "rank": 0, "reason": "not readable"}]
    finding = one(analyze_records(records), "resume_mismatch")
    assert finding.verdict == "not_run"
    assert "not readable" in finding.summary


def test_a_file_that_is_not_a_torch_checkpoint_is_not_judged_unsafe():
    record = {"kind": "inspect", "role": "saved", "path": "x.ckpt", "safe": None, "error": "a directory"}
    finding = one(analyze_records([record]), "unsafe_checkpoint")
    assert finding.verdict == "not_run"


def test_recommendations_read_the_evidence_keys():
    from ciuic_doctor.jobs.spec import load_spec
    from ciuic_doctor.recommend import recommend

    records = [config(timeout_s=1), *saves(2.5), *loads(), *resumes(losses=(6.9, 7.0), missing=["optimizer"])]
    plan = recommend(load_spec(), analyze_records(records))
    settings = {rec.setting: rec for rec in plan.recommendations}
    assert settings["checkpoint contents"].value == "also save: optimizer"
    assert "torch.distributed.checkpoint" in settings["checkpoint method"].value
    assert settings["distributed.timeout_s"].value >= 3 * 2.5
