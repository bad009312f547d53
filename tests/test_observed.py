"""Issue 14: `watch` records what a plain script configured (meta.json `observed`), and the report
describes that job: its name, its settings as "current", tip 4 against the LR it ran, no recommendation
for a setting it did not expose, and a banner when the spec is a fallback."""

from __future__ import annotations

import doctest
import importlib
import json
import math
from pathlib import Path

import pytest

from ciuic_doctor.jobs.observed import spec_from_observed
from ciuic_doctor.recommend import recommend
from ciuic_doctor.report import build_report, resolve_spec
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir
from tests.conftest import run_cli

SCRIPTS = Path(__file__).parent / "data" / "user_scripts"
WATCH_TIMEOUT_S = 360  # a few seconds alone; generous for a 2-core machine shared by several suites


@pytest.mark.parametrize("name", ["ciuic_doctor.jobs.observed", "ciuic_doctor.probes.watch.observe.sections"])
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0
    assert result.failed == 0


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> Path:
    """plain_train.py under watch, once for the module (16 steps, one DataLoader worker)."""
    out = tmp_path_factory.mktemp("plain") / "run"
    script = SCRIPTS / "plain_train.py"
    done = run_cli(
        "watch",
        "--out",
        str(out),
        "--",
        str(script),
        "--api-token",
        "hunter2-secret",
        timeout=WATCH_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    return out


def observed_of(run: Path) -> dict:
    return json.loads((run / "meta.json").read_text())["observed"]


def test_observed_equals_what_the_plain_script_set(plain_run):
    observed = observed_of(plain_run)
    assert observed["job"]["name"] == "plain_train.py"
    assert observed["job"]["argv"][1:] == ["--api-token", "<redacted>"]  # the secret never reaches disk
    assert "hunter2-secret" not in (plain_run / "meta.json").read_text()
    assert observed["job"]["steps"] == 64  # OneCycleLR's total_steps: the steps the job plans
    assert observed["job"]["steps_recorded"] == 16  # 256 samples / 8 per batch / 2 accumulated
    assert observed["batch"] == {"per_process": 8, "grad_accum": 2}
    loader = observed["dataloader"]
    assert {k: loader[k] for k in ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory")} == {
        "num_workers": 1,
        "prefetch_factor": 3,
        "persistent_workers": True,
        "pin_memory": False,
    }
    assert loader["multiprocessing_context"] == "forkserver"
    assert loader["sampler"] == "RandomSampler"  # shuffle=True
    optim = observed["optim"]
    assert (optim["class"], optim["name"]) == ("AdamW", "adamw")
    assert optim["betas"] == [0.9, 0.98]
    assert optim["eps"] == 1e-7
    assert optim["weight_decay"] == 0.05  # the larger param group's (the weights; biases have 0)
    assert [g["weight_decay"] for g in optim["param_groups"]] == [0.05, 0.0]
    # OneCycleLR starts at max_lr / div_factor (25) and its peak is max_lr.
    assert math.isclose(optim["param_groups"][0]["lr"], 3e-3 / 25)
    assert math.isclose(optim["lr_ran"]["first"], 3e-3 / 25)
    assert optim["base_lr"] == 3e-3
    scheduler = optim["scheduler"]
    assert (scheduler["class"], scheduler["max_lr"], scheduler["total_steps"]) == ("OneCycleLR", 3e-3, 64)
    assert optim["warmup_pct"] == 0.25
    assert optim["clip_max_norm"] == 0.5
    assert observed["precision"]["mode"] == "fp32"
    assert observed["model"]["parameters"] == 16 * 32 + 32 + 32 + 1
    assert observed["job"]["procs_per_node"] == 1
    assert observed["job"]["seed"] == 0  # torch.manual_seed(0)


def test_report_describes_the_watched_script(plain_run):
    run = RunDir.open(plain_run)
    build_report(run)
    html = (plain_run / "report.html").read_text()
    assert "<title>ciuic-doctor: plain_train.py" in html
    assert "deepseek-v3-tiny" not in html
    assert "Observed job spec." in html
    assert "checkpoint.every_steps" in html
    toml = (plain_run / "recommended.toml").read_text()
    assert 'name = "plain_train.py"' in toml
    assert "base_lr = 0.003" in toml
    assert "num_workers = 1" in toml
    assert "hidden_size" not in toml  # not the DeepSeek model
    tips = json.loads((plain_run / "recommendations.json").read_text())["seed_tips"]
    tip4 = next(t for t in tips if t["number"] == 4)
    sqrt, warmup = tip4["claims"]
    assert sqrt["status"] == "not measured"
    assert "peak of 0.003 at step 16" in sqrt["evidence"]
    assert "pct_start 0.25 of 64 steps = 16 warm-up steps" in warmup["evidence"]


def test_current_settings_come_from_observed_and_unexposed_ones_get_none(plain_run, tmp_path):
    meta = json.loads((plain_run / "meta.json").read_text())
    sweep = Finding(
        probe="loader",
        check="loader_throughput",
        verdict="pass",
        summary="measured",
        evidence={"recommended": {"num_workers": 2, "prefetch_factor": 2, "samples_per_s": 900.0}},
    )
    resolved = resolve_spec(meta, None)
    plan = recommend(resolved.spec, [sweep], meta, resolved=resolved)
    current = {r.setting: r.current for r in plan.recommendations}
    assert current["dataloader.num_workers"] == 1
    assert current["dataloader.prefetch_factor"] == 3
    assert "optim.lr_scaling" not in current  # the reference batch was not observed: nothing to scale

    # The same script without a DataLoader (and in fp16): no DataLoader recommendation at all.
    out = tmp_path / "run"
    script = str(SCRIPTS / "plain_train.py")
    done = run_cli("watch", "--out", str(out), "--", script, "--no-loader", "--fp16", timeout=WATCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["observed"]["dataloader"] == {}
    precision = meta["observed"]["precision"]
    assert (precision["mode"], precision["init_scale"], precision["growth_interval"]) == ("fp16", 256.0, 50)
    assert precision["autocast"] == {"device_type": "cpu", "dtype": "float16"}
    assert meta["observed"]["optim"]["clip_max_norm"] == 0.5
    resolved = resolve_spec(meta, None)
    assert "dataloader.num_workers" in resolved.assumed
    plan = recommend(resolved.spec, [sweep], meta, resolved=resolved)
    assert not [r for r in plan.recommendations if r.setting.startswith("dataloader.")]


def test_steps_stops_the_script_cleanly_with_every_record(tmp_path):
    out = tmp_path / "run"
    script = str(SCRIPTS / "plain_train.py")
    done = run_cli(
        "watch", "--steps", "3", "--out", str(out), "--", script, "--no-loader", timeout=WATCH_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    assert "trained" not in done.stdout  # it really stopped
    assert "stopping after 3 optimizer steps" in done.stderr
    records = RunDir.open(out).read("steps").records
    assert [r["step"] for r in records] == [1, 2, 3]
    assert observed_of(out)["job"]["steps_recorded"] == 3


def test_a_run_without_settings_says_its_spec_is_a_fallback(tmp_path):
    run = RunDir.create(tmp_path / "run")
    run.record_environment()
    writer = run.writer("steps", rank=0, per_rank_file=True)
    for step in range(1, 6):
        writer.write({"rank": 0, "step": step, "loss": 2.0 - 0.1 * step, "lr": 1e-3, "grad_norm": 0.5})
    writer.close()
    resolved = resolve_spec(run.read_meta(), None)
    assert resolved.kind == "fallback"
    build_report(run)
    html = (tmp_path / "run" / "report.html").read_text()
    assert "Fallback job spec." in html
    assert "not the job that ran" in html
    assert (tmp_path / "run" / "recommended.toml").read_text().startswith("# FALLBACK:")


def test_observed_values_the_spec_cannot_hold_stay_assumed():
    observed = {
        "job": {"name": "x.py", "nodes": 1, "procs_per_node": 1},
        "optim": {"class": "Lion", "base_lr": 1e-4},  # no spec name for Lion
        "dataloader": {"num_workers": 2, "multiprocessing_context": "weird"},
    }
    result = spec_from_observed(observed)
    assert result.spec.optim.base_lr == 1e-4
    assert result.spec.dataloader.num_workers == 2
    assert "optim.name" in result.assumed
    assert "dataloader.multiprocessing_context" in result.assumed


def test_a_script_without_a_dataloader_gets_no_loader_sweep_and_tip_2_says_why(tmp_path):
    import argparse

    from ciuic_doctor.checkup.phases import Checkup
    from ciuic_doctor.checkup.script import _loader_phase
    from ciuic_doctor.recommend import Context
    from ciuic_doctor.recommend.tips.seed import evaluate_tips

    run = RunDir.create(tmp_path / "run")
    observed = {"job": {"name": "train.py", "nodes": 1, "procs_per_node": 1}, "dataloader": {}}
    run.update_meta(observed=observed)
    checkup = Checkup(run, total=1)
    args = argparse.Namespace(dataset="mydata:build", loader_budget=5.0)
    _loader_phase(checkup, args, run, nproc=1, out=str(run.path), skip=set())
    (phase,) = checkup.phases
    assert phase.status == "skipped"
    assert "no torch DataLoader" in phase.reason

    meta = run.read_meta()
    resolved = resolve_spec(meta, None)
    tips = evaluate_tips(Context(spec=resolved.spec, findings=[], meta=meta, resolved=resolved))
    tip2 = next(t for t in tips if t.number == 2)
    assert {c.evidence for c in tip2.claims} == {
        "the job builds no torch DataLoader: these settings do not apply to it"
    }
