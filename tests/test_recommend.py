"""Recommendation rules and the seed-tip check on recorded findings (tests/data/report_gpu, made by its
make.py to the finding contracts), including "leave unset" and "no measurement -> no recommendation"."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest

from ciuic_doctor.jobs.spec import JobSpec, load_spec, with_updates
from ciuic_doctor.recommend import Context, Plan, nccl_algo_value, recommend, setting_kind
from ciuic_doctor.recommend.tips.seed import evaluate_tips
from ciuic_doctor.report import files, spec_for_run
from ciuic_doctor.rundir.findings import Finding

DATA = Path(__file__).parent / "data" / "report_gpu"


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((DATA / "meta.json").read_text())


@pytest.fixture(scope="module")
def gpu_spec(meta: dict) -> JobSpec:
    return spec_for_run(meta, None)


@pytest.fixture
def gpu_findings() -> list[Finding]:
    data = json.loads((DATA / "findings.json").read_text())
    return [Finding.from_dict(f) for f in data["findings"]]


def by_setting(plan: Plan) -> dict:
    return {r.setting: r for r in plan.recommendations}


def replace_finding(findings: list[Finding], check: str, **changes) -> list[Finding]:
    out = []
    evidence = changes.pop("evidence", None) or {}
    for finding in findings:
        changed = finding
        if finding.check == check:
            changed = copy.deepcopy(finding)
            for key, value in changes.items():
                setattr(changed, key, value)
            changed.evidence.update(evidence)
        out.append(changed)
    return out


def test_tree_faster_at_bucket_sizes_gives_the_per_collective_form(gpu_spec, gpu_findings, meta):
    recs = by_setting(recommend(gpu_spec, gpu_findings, meta))
    algo = recs["NCCL_ALGO"]
    assert algo.value == "allreduce:tree"
    assert algo.current == "Tree"
    assert algo.confidence == "high"
    # the sizes within 2× of the 25 MiB bucket, as comm's analysis judges them: 16 MiB
    assert [r["bytes"] for r in algo.evidence["per_size"]] == [16 * 2**20]


def test_old_nccl_gets_the_plain_algorithm_name(gpu_spec, gpu_findings, meta):
    findings = replace_finding(gpu_findings, "algo_choice", evidence={"nccl_version": "2.21.5"})
    assert by_setting(recommend(gpu_spec, findings, meta))["NCCL_ALGO"].value == "Tree"
    assert nccl_algo_value("ring", (2, 24, 3)) == "allreduce:ring"


def test_ring_and_tree_within_noise_means_leave_unset(gpu_spec, gpu_findings, meta):
    findings = replace_finding(gpu_findings, "algo_choice", evidence={"recommended_nccl_algo": None})
    plan = recommend(gpu_spec, findings, meta)
    algo = by_setting(plan)["NCCL_ALGO"]
    assert algo.value is None
    assert "within the measurement noise" in algo.why
    env = files.env_text(plan, job="j", run="r")
    assert "unset NCCL_ALGO" in env
    assert "export NCCL_ALGO" not in env
    # ...and the spec's folklore NCCL_ALGO=Tree is removed from [distributed.env]
    assert "NCCL_ALGO" not in files.recommended_spec(gpu_spec, plan).distributed.env


def test_gloo_only_means_leave_unset_without_touching_anything(gpu_spec, gpu_findings, meta):
    findings = replace_finding(
        gpu_findings,
        "algo_choice",
        verdict="not_run",
        summary="gloo has one all_reduce algorithm",
        evidence={"backend": "gloo", "recommended_nccl_algo": None},
    )
    plan = recommend(gpu_spec, findings, meta)
    algo = by_setting(plan)["NCCL_ALGO"]
    assert algo.value is None
    assert algo.confidence == "low"
    env = files.env_text(plan, job="j", run="r")
    assert "unset NCCL_ALGO" not in env  # nothing measured on NCCL: advice only, no command
    assert files.recommended_spec(gpu_spec, plan).distributed.env["NCCL_ALGO"] == "Tree"


def test_no_measurement_no_recommendation():
    """Without findings only the LR arithmetic remains, and it says it was computed, not measured."""
    spec = load_spec()
    plan = recommend(spec, [], {})
    assert {r.setting for r in plan.recommendations} == {"optim.lr_scaling", "optim.warmup_pct"}
    assert all(r.evidence["basis"].startswith("computed from the job spec") for r in plan.recommendations)
    assert all(r.confidence == "low" for r in plan.recommendations)
    assert plan.findings == []
    assert "export" not in files.env_text(plan, job="j", run="r")
    tips = evaluate_tips(Context(spec=spec, findings=[], meta={}))
    measured = [c for t in tips for c in t.claims if c.basis == "measured" and c.status != "not measured"]
    assert measured == []


def test_timeout_of_30s_next_to_a_95s_save_is_a_finding(gpu_spec, gpu_findings, meta):
    plan = recommend(gpu_spec, gpu_findings, meta)
    timeout = by_setting(plan)["distributed.timeout_s"]
    assert timeout.current == 30.0
    assert timeout.value == 600.0  # NCCL's default covers 3 × 95 s
    assert "600 s for NCCL and 1800 s for gloo" in timeout.why
    (verdict,) = [f for f in plan.findings if f.check == "pg_timeout"]
    assert verdict.verdict == "fail"
    assert verdict.evidence["longest_wait_s"] == 95.0


def test_timeout_beyond_the_default_is_rounded_up(gpu_spec, gpu_findings, meta):
    findings = replace_finding(
        gpu_findings, "checkpoint_cost", evidence={"save_s": 400.0, "barrier_wait_s": 0}
    )
    findings = [f for f in findings if f.check != "timeout_risk"]
    timeout = by_setting(recommend(gpu_spec, findings, meta))["distributed.timeout_s"]
    assert timeout.value == 1200.0  # 3 × 400 s = 1200 s


def test_a_sufficient_timeout_is_kept_with_its_evidence(gpu_findings, meta):
    spec = load_spec()  # 1800 s
    findings = [f for f in gpu_findings if f.probe == "comm"]
    plan = recommend(spec, findings, meta)
    timeout = by_setting(plan)["distributed.timeout_s"]
    assert timeout.value == timeout.current == 1800.0
    assert timeout.confidence == "medium"  # no checkpoint save was measured
    assert [f.verdict for f in plan.findings if f.check == "pg_timeout"] == ["pass"]


def test_learning_rate_both_rules_with_numbers():
    spec = with_updates(
        load_spec(), {"batch.per_process": 32, "job.procs_per_node": 8, "optim.base_lr": 1e-3}
    )
    rec = by_setting(recommend(spec, [], {}))["optim.lr_scaling"]
    assert spec.global_batch == 256 * 1
    assert rec.evidence["sqrt_rule_lr"] == pytest.approx(1e-3)
    spec = with_updates(spec, {"batch.per_process": 128})  # global 1024 = 4 × reference
    rec = by_setting(recommend(spec, [], {}))["optim.lr_scaling"]
    assert rec.value == "sqrt"
    assert rec.evidence["effective_lr"] == pytest.approx(2e-3)
    assert rec.evidence["linear_rule_lr"] == pytest.approx(4e-3)
    assert "√(1024/256)" in rec.why
    sgd = by_setting(recommend(with_updates(spec, {"optim.name": "sgd"}), [], {}))["optim.lr_scaling"]
    assert sgd.value == "linear"
    assert sgd.evidence["effective_lr"] == pytest.approx(4e-3)
    onecycle = by_setting(recommend(spec, [], {}))["optim.warmup_pct"].evidence["onecycle"]
    assert onecycle == {"max_lr": pytest.approx(2e-3), "pct_start": 0.1, "total_steps": spec.job.steps}


def test_stability_findings_drive_clip_scaler_and_bf16(gpu_spec, gpu_findings, meta):
    recs = by_setting(recommend(gpu_spec, gpu_findings, meta))
    assert recs["optim.clip_max_norm"].value == 3.1
    assert recs["precision.init_scale"].value == 8192.0
    assert recs["precision.growth_interval"].value == 2000
    assert "precision.mode" not in recs
    storm = [
        *gpu_findings,
        Finding(probe="stability", check="overflow_storm", verdict="fail", summary="storm"),
    ]
    storm = [f for f in storm if not (f.check == "overflow_storm" and f.verdict == "pass")]
    assert by_setting(recommend(gpu_spec, storm, meta))["precision.mode"].value == "bf16"


def test_memory_findings(gpu_spec, gpu_findings, meta):
    recs = by_setting(recommend(gpu_spec, gpu_findings, meta))
    assert recs["PYTORCH_CUDA_ALLOC_CONF"].value == "expandable_segments:True"
    assert "6020" in recs["memory leak (device, rank 3)"].value
    assert recs["torch.cuda.empty_cache()"].value == "do not call it periodically"
    spec = with_updates(gpu_spec, {"distributed.env": {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}})
    merged = by_setting(recommend(spec, gpu_findings, meta))["PYTORCH_CUDA_ALLOC_CONF"]
    assert merged.value == "max_split_size_mb:512,expandable_segments:True"


def test_flight_recorder_only_where_nccl_was_measured(gpu_spec, gpu_findings, meta):
    recs = by_setting(recommend(gpu_spec, gpu_findings, meta))
    assert recs["TORCH_NCCL_TRACE_BUFFER_SIZE"].value == "2000"
    assert recs["TORCH_NCCL_DUMP_ON_TIMEOUT"].value == "1"
    gloo = [f for f in gpu_findings if f.probe != "comm"]
    spec = with_updates(gpu_spec, {"distributed.backend": "gloo"})
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in by_setting(recommend(spec, gloo, meta))


def test_stragglers_are_findings_and_checkpoint_advice(gpu_spec, gpu_findings, meta):
    """A straggler is a finding to look at (rank 5 on gpu-node-02), not a setting to change."""
    assert any(f.check == "straggler" and f.verdict in ("warn", "fail") for f in gpu_findings)
    recs = by_setting(recommend(gpu_spec, gpu_findings, meta))
    assert not [s for s in recs if s.startswith("straggler")], list(recs)
    assert "sampler epoch" in recs["checkpoint contents"].value
    assert "torch.distributed.checkpoint" in recs["checkpoint method"].value
    assert setting_kind("checkpoint method") == "advice"
    assert setting_kind("dataloader.num_workers") == "spec"
    assert setting_kind("NCCL_ALGO") == "env"


def test_global_tree_on_new_nccl_is_a_failing_setting(gpu_spec, gpu_findings, meta):
    plan = recommend(gpu_spec, gpu_findings, meta)
    (form,) = [f for f in plan.findings if f.check == "nccl_algo_form"]
    assert form.verdict == "fail"
    fixed = with_updates(gpu_spec, {"distributed.env": {"NCCL_ALGO": "allreduce:tree"}})
    assert not [f for f in recommend(fixed, gpu_findings, meta).findings if f.check == "nccl_algo_form"]


def test_seed_tips_on_the_recorded_gpu_run(gpu_spec, gpu_findings, meta):
    tips = {t.number: t for t in evaluate_tips(Context(spec=gpu_spec, findings=gpu_findings, meta=meta))}
    assert len(tips) == 7
    claims = {c.text: c for t in tips.values() for c in t.claims}
    assert claims["timeout=30 s is an increase"].status == "does not hold"
    assert claims["30 s is enough for this job"].status == "does not hold"
    assert claims["Tree is faster than Ring for this job"].status == "holds"
    assert claims["a plain global NCCL_ALGO=Tree is safe"].status == "does not hold"
    assert claims["num_workers=4"].status == "holds"
    assert claims["raising init_scale prevents gradient underflow"].status == "does not hold"
    assert claims["init_scale=2**10"].status == "holds"  # steady scale 4096 within 4× of 1024
    assert claims["NCCL buffers accumulate"].status == "does not hold"
    assert claims["OneCycleLR warm-up keeps the start stable"].status == "holds"  # the spike is at step 52
    assert claims["optimizer + scheduler state make resume exact"].status == "does not hold"
    assert tips[2].status == "holds"
    assert tips[7].status == "does not hold"


def test_env_file_is_safe_to_source(tmp_path, gpu_spec, gpu_findings, meta):
    """A value with shell syntax and a why with newlines cannot run anything when the file is sourced."""
    plan = recommend(gpu_spec, gpu_findings, meta)
    evil = "expandable_segments:True; touch pwned $(touch pwned2)"
    for rec in plan.recommendations:
        if rec.setting == "PYTORCH_CUDA_ALLOC_CONF":
            rec.value = evil
            rec.why = "line one\ntouch pwned3\n"
    env_file = tmp_path / "recommended.env"
    env_file.write_text(files.env_text(plan, job="j", run="r"))
    out = subprocess.run(
        ["bash", "-c", f'source {env_file} && printf %s "$PYTORCH_CUDA_ALLOC_CONF|$NCCL_ALGO"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == f"{evil}|allreduce:tree"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recommended.env"]


def test_recommended_toml_loads_back_with_the_values_applied(tmp_path, gpu_spec, gpu_findings, meta):
    plan = recommend(gpu_spec, gpu_findings, meta)
    path = tmp_path / "recommended.toml"
    path.write_text(files.spec_toml(gpu_spec, plan, run="r"))
    spec = load_spec(path)
    assert spec.distributed.timeout_s == 600.0
    assert spec.distributed.env["NCCL_ALGO"] == "allreduce:tree"
    assert spec.precision.init_scale == 8192.0
    assert spec.optim.lr_scaling == "sqrt"
    assert spec.job.name == gpu_spec.job.name


@pytest.mark.parametrize("name", ["ciuic_doctor.recommend.core", "ciuic_doctor.report.html"])
def test_docstring_examples(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0
    assert result.failed == 0


def test_environment_capture_is_read_from_meta(meta):
    from ciuic_doctor.recommend import environment_of

    assert environment_of(meta)["host"] == "gpu-node-01"
    assert environment_of({"env": "garbled"}) == {}


def test_the_spec_the_job_recorded_is_the_current_settings(meta):
    recorded = {
        **meta,
        "spec": {**meta["spec"], "dataloader": {**meta["spec"]["dataloader"], "num_workers": 7}},
    }
    spec = spec_for_run(recorded, None)
    assert spec.dataloader.num_workers == 7
    assert spec.source == "meta.json (recorded by the job)"
    assert spec_for_run({}, None).source == "default"
