"""Issue 14 with the real frameworks: an HF Trainer script and a Lightning script under watch give
`observed` values equal to what the script set, and their reports name the script and use those values.
Both build tiny models from code (no hub download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ciuic_doctor.report import build_report
from ciuic_doctor.rundir.store import RunDir
from tests.conftest import run_cli

SCRIPTS = Path(__file__).parent / "data" / "user_scripts"


def watched(tmp_path: Path, script: str, *args: str) -> tuple[Path, dict]:
    out = tmp_path / "run"
    done = run_cli("watch", "--out", str(out), "--", str(SCRIPTS / script), *args, timeout=480)
    assert done.returncode == 0, done.stderr
    return out, json.loads((out / "meta.json").read_text())["observed"]


def report_of(run: Path) -> tuple[str, str, dict]:
    build_report(RunDir.open(run))
    tips = json.loads((run / "recommendations.json").read_text())["seed_tips"]
    return (run / "report.html").read_text(), (run / "recommended.toml").read_text(), tips


@pytest.mark.slow
def test_hf_trainer_settings_are_observed(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out, observed = watched(tmp_path, "hf_train.py", str(tmp_path / "trainer-out"))
    # TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=8, ...)
    assert observed["batch"] == {"per_process": 4, "grad_accum": 2}
    assert observed["job"]["steps_recorded"] == 8
    assert observed["job"]["steps"] == 8  # get_linear_schedule_with_warmup(num_training_steps=8)
    optim = observed["optim"]
    assert optim["class"] == "AdamW"
    assert optim["betas"] == [0.85, 0.97]
    assert optim["eps"] == 1e-7
    assert optim["weight_decay"] == 0.01
    assert optim["clip_max_norm"] == 0.7  # max_grad_norm
    assert optim["lr_ran"]["first"] == 0.0  # linear warm-up from 0 ...
    assert optim["lr_ran"]["peak"] == 5e-4  # ... to learning_rate at step warmup_steps + 1
    assert optim["lr_ran"]["peak_step"] == 4
    assert optim["scheduler"]["lr_lambda"]["num_warmup_steps"] == 3
    assert optim["warmup_pct"] == 3 / 8
    assert observed["dataloader"]["batch_size"] == 4
    assert observed["dataloader"]["num_workers"] == 0
    # the loader keeps a SequentialSampler it never draws from; the batches come from the batch sampler's
    assert observed["dataloader"]["sampler"] == "RandomSampler"
    assert optim["lr_constructed"] == 5e-4  # learning_rate, beside the warm-up that ran from 0
    assert observed["precision"]["mode"] == "fp32"
    assert observed["job"]["seed"] == 3  # TrainingArguments(seed=3): the Trainer's set_seed
    html, toml, tips = report_of(out)
    assert "<title>ciuic-doctor: hf_train.py" in html
    assert "base_lr = 0.0005" in toml
    assert "grad_accum = 2" in toml
    tip4 = next(t for t in tips if t["number"] == 4)
    assert "peak of 0.0005 at step 4" in tip4["claims"][0]["evidence"]
    assert tip4["claims"][1]["text"] == "the job's warm-up keeps the start stable"
    assert "in 4 steps" in tip4["claims"][1]["evidence"]


@pytest.mark.slow
def test_lightning_settings_are_observed(tmp_path):
    pytest.importorskip("lightning")
    out, observed = watched(tmp_path, "lightning_train.py")
    # Trainer(max_steps=6, gradient_clip_val=0.3, accumulate_grad_batches=2, precision="bf16-mixed")
    assert observed["batch"] == {"per_process": 8, "grad_accum": 2}
    assert observed["job"]["steps_recorded"] == 6
    optim = observed["optim"]
    assert (optim["class"], optim["name"]) == ("Adam", "adam")
    assert optim["betas"] == [0.8, 0.99]
    assert optim["eps"] == 1e-6
    assert optim["weight_decay"] == 0.02
    assert optim["base_lr"] == 2e-3
    assert optim["clip_max_norm"] == 0.3
    assert optim["scheduler"]["class"] == "CosineAnnealingLR"
    assert optim["scheduler"]["T_max"] == 6
    assert observed["job"]["steps"] == 6
    assert observed["precision"]["mode"] == "bf16"
    assert observed["precision"]["autocast"] == {"device_type": "cpu", "dtype": "bfloat16"}
    html, toml, tips = report_of(out)
    assert "<title>ciuic-doctor: lightning_train.py" in html
    assert 'mode = "bf16"' in toml
    assert "clip_max_norm = 0.3" in toml
    tip4 = next(t for t in tips if t["number"] == 4)
    assert "ran no OneCycleLR warm-up" in tip4["claims"][1]["evidence"]  # cosine from its peak
