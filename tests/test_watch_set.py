"""Issue 21: `watch --set KEY=VALUE` changes what an unchanged script runs, through the constructors and
calls that carry each setting; `observed` and the step records show the value in force, `observed.
overrides` the script's own; a key the script gives no hold to is refused (exit 2, one line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

SCRIPT = Path(__file__).parent / "data" / "user_scripts" / "slow_loader_train.py"
TIMEOUT_S = 300  # a few seconds alone; generous for a loaded 2-core machine


def _meta(run: Path) -> dict:
    return json.loads((run / "meta.json").read_text())


def _steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "steps.rank0.jsonl").read_text().splitlines()]


def test_set_applies_every_key_family_to_an_unchanged_script(tmp_path):
    run = tmp_path / "run"
    sets = {
        "dataloader.num_workers": "2",
        "dataloader.prefetch_factor": "3",
        "dataloader.persistent_workers": "false",
        "precision.init_scale": "1024",
        "precision.growth_interval": "7",
        "optim.clip_max_norm": "0.25",
        "distributed.timeout_s": "77",
        "distributed.env.NCCL_ALGO": "Tree",
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    done = run_cli("watch", "--steps", "4", "--out", str(run), *args, "--", str(SCRIPT), "--fp16", "--pg",
                   timeout=TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr
    observed = _meta(run)["observed"]
    loader = observed["dataloader"]
    assert (loader["num_workers"], loader["prefetch_factor"], loader["persistent_workers"]) == (2, 3, False)
    assert (observed["precision"]["init_scale"], observed["precision"]["growth_interval"]) == (1024.0, 7)
    assert observed["optim"]["clip_max_norm"] == 0.25
    assert observed["distributed"]["timeout_s"] == 77.0
    assert observed["distributed"]["env"]["NCCL_ALGO"] == "Tree"
    assert {r["clip_max_norm"] for r in _steps(run)} == {0.25}  # what clip_grad_norm_ really ran with
    assert {r["loss_scale"] for r in _steps(run)[:1]} == {1024.0}  # the scaler started where we set it
    forced = observed["overrides"]
    assert forced["dataloader.num_workers"] == {
        "script": 0,
        "in_force": 2,
        "through": "DataLoader",
        "applied": 1,
    }
    assert forced["dataloader.prefetch_factor"]["script"] is None  # the script's loader has no workers
    assert forced["precision.init_scale"]["script"] == 256.0
    assert forced["precision.growth_interval"]["script"] == 50
    assert forced["optim.clip_max_norm"]["script"] == 1.0
    assert forced["distributed.timeout_s"]["script"] == 1800.0
    assert forced["distributed.env.NCCL_ALGO"]["script"] is None


def test_num_workers_zero_drops_what_needs_workers(tmp_path):
    """DataLoader refuses prefetch_factor / persistent_workers without workers: the override drops them."""
    run = tmp_path / "run"
    done = run_cli("watch", "--steps", "3", "--out", str(run), "--set", "dataloader.num_workers=0", "--",
                   str(SCRIPT), "--workers", "1", timeout=TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr
    loader = _meta(run)["observed"]["dataloader"]
    assert (loader["num_workers"], loader["prefetch_factor"], loader["persistent_workers"]) == (
        0,
        None,
        False,
    )


def test_a_key_the_script_gives_no_hold_is_refused_with_exit_2(tmp_path):
    run = tmp_path / "run"
    done = run_cli("watch", "--out", str(run), "--set", "dataloader.num_workers=2", "--set",
                   "precision.init_scale=8", "--", str(SCRIPT), "--no-loader", timeout=TIMEOUT_S)  # fmt: skip
    assert done.returncode == 2
    refusal = [line for line in done.stderr.splitlines() if "--set cannot be applied" in line]
    assert len(refusal) == 1, done.stderr
    assert "dataloader.num_workers: the script built no torch DataLoader" in refusal[0]
    assert "precision.init_scale: the script built no enabled GradScaler" in refusal[0]
    assert "Traceback" not in done.stderr
    assert len(_steps(run)) <= 1  # refused at the first optimizer step: training did not go on
    assert "trained" not in done.stdout


def test_unknown_keys_and_bad_values_are_refused_before_anything_runs(tmp_path):
    run = tmp_path / "run"
    done = run_cli("watch", "--out", str(run), "--set", "optim.lr=3", "--set", "dataloader.num_workers=-1",
                   "--", str(SCRIPT), timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "optim.lr: not a setting watch can apply" in done.stderr
    assert "dataloader.num_workers = -1: must be a whole number >= 0" in done.stderr
    assert "Traceback" not in done.stderr
    assert not run.exists()  # nothing ran, nothing recorded


def test_checkup_takes_the_same_set(tmp_path):
    """Embedded job: --set changes the spec every phase and the report use; a bad one is exit 2 before
    anything runs; a script's checkup refuses a key watch cannot apply, also before anything runs."""
    run = tmp_path / "run"
    skip = "comm-bench,loader-sweep,job,memwatch,checkpoint-check"
    done = run_cli(
        "checkup", "--skip", skip, "--set", "dataloader.num_workers=0", "--out", str(run), timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert _meta(run)["spec"]["dataloader"]["num_workers"] == 0
    assert "num_workers = 0" in (run / "checkup-spec.toml").read_text()
    bad = run_cli(
        "checkup", "--skip", skip, "--set", "dataloader.num_workers=-3", "--out", str(tmp_path / "b")
    )
    assert bad.returncode == 2
    assert "--set" in bad.stderr
    assert not (tmp_path / "b").exists()
    script = run_cli("checkup", "--set", "optim.lr=1", "--out", str(tmp_path / "s"), "--", str(SCRIPT))
    assert script.returncode == 2
    assert "optim.lr: not a setting watch can apply" in script.stderr
    assert not (tmp_path / "s").exists()


SPLIT_CLIP = """
import json, sys, torch
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen = {"pre": [], "post": []}
for _ in range(3):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(torch.randn(64, 16)), 10 * torch.randn(64, 4)).backward()
    # accelerate >= 1.16 (so HF Trainer) clips this way, importing at call time, not clip_grad_norm_
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm
    params = [p for p in model.parameters() if p.grad is not None]
    total = get_total_norm([p.grad for p in params])
    clip_grads_with_norm_(params, 1.0, total)
    seen["pre"].append(float(total))
    seen["post"].append(float(get_total_norm([p.grad for p in params])))
    opt.step()
print(json.dumps(seen))
"""


def test_a_clip_of_a_norm_taken_apart_is_recorded_and_set(tmp_path):
    """torch.nn.utils.clip_grads_with_norm_ (accelerate's clip): the pre-clip norm and max_norm are
    recorded as clip_grad_norm_'s, and --set optim.clip_max_norm changes the max_norm it runs with."""
    script = tmp_path / "split_clip.py"
    script.write_text(SPLIT_CLIP)
    for sets, max_norm in (([], 1.0), (["--set", "optim.clip_max_norm=0.25"], 0.25)):
        run = tmp_path / f"run{max_norm}"
        done = run_cli("watch", "--out", str(run), *sets, "--", str(script), timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        records = _steps(run)
        assert [r["grad_norm"] for r in records] == pytest.approx(seen["pre"], rel=1e-5)
        assert {r["grad_norm_source"] for r in records} == {"clip"}
        assert {r["clip_max_norm"] for r in records} == {max_norm}
        assert _meta(run)["observed"]["optim"]["clip_max_norm"] == max_norm
        assert min(seen["pre"]) > 1.0  # every step was clipped, to what was in force
        assert max(seen["post"]) <= max_norm * 1.001
