"""Real fp16 overflow: the embedded job with GradScaler on CPU, non-finite gradients injected, then judged."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

FP16_SPEC = """
[precision]
mode = "fp16"

[checkpoint]
every_steps = 0

[dataloader]
num_workers = 0
persistent_workers = false

[batch]
per_process = 2
seq_len = 16
"""
# fp16 matmuls on a CPU have no fast kernels: the default 8 x 64 tokens took ~15 s a step on a loaded
# machine, 2 x 16 about 2 s. GradScaler's skips and halvings do not depend on the batch's size.


@pytest.mark.slow
def test_injected_overflow_is_a_storm_then_a_collapse(tmp_path):
    spec = tmp_path / "fp16.toml"
    spec.write_text(FP16_SPEC)
    run = tmp_path / "run"
    # 18 non-finite steps from step 10: GradScaler halves 2**16 eighteen times, below 1 at the 17th (step 26).
    job = run_cli(
        "job", "--nproc", "1", "--steps", "36", "--spec", str(spec), "--inject", "overflow=10:18",
        "--out", str(run), timeout=600,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-2000:]
    done = run_cli("stability", str(run), "--json")
    assert done.returncode == 1, done.stderr  # the collapse fails the run
    findings = {f["check"]: f for f in json.loads(done.stdout)}
    storm = findings["overflow_storm"]
    assert storm["verdict"] == "warn"
    assert storm["where"]["step"] == 10
    assert storm["evidence"]["skipped"] == 18
    collapse = findings["scale_collapse"]
    assert collapse["verdict"] == "fail"
    assert collapse["where"]["step"] == 26
    assert collapse["evidence"]["scale"] < 1
    scaler = findings["loss_scaler"]["evidence"]
    assert scaler["precision"] == "fp16"
    assert scaler["skipped_total"] == 18
    assert scaler["suggest_bf16"] is True
    assert findings["clipping"]["evidence"]["clip_max_norm"] == 1.0  # from the job spec in meta.json
