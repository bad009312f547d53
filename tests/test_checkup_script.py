"""Issue 14: `checkup --nproc 2 -- script.py` checks the user's own DDP script end to end: comm-bench on
2 ranks, the script under watch under torchrun with memwatch attached, loader-sweep on the script's own
dataset (--dataset), and a report of that job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ciuic_doctor.rundir.store import RunDir
from tests.conftest import run_cli

SCRIPTS = Path(__file__).parent / "data" / "user_scripts"


def phases_of(meta: dict) -> dict[str, dict]:
    return {p["name"]: p for p in meta["checkup"]["phases"]}


@pytest.mark.slow
def test_checkup_of_a_ddp_script_on_two_ranks(tmp_path):
    out = tmp_path / "run"
    done = run_cli(
        "checkup", "--nproc", "2", "--steps", "6", "--loader-budget", "3", "--dataset", "tinydata:build",
        "--out", str(out), "--", str(SCRIPTS / "ddp_train.py"),
        cwd=SCRIPTS, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    meta = json.loads((out / "meta.json").read_text())
    phases = phases_of(meta)
    for name in ("comm-bench", "job", "memwatch", "loader-sweep"):
        assert phases[name]["status"] == "ok", phases[name]
    assert "torch.distributed.run" not in " ".join(phases["job"]["argv"])  # argv is ciuic-doctor's
    run = RunDir.open(out)
    steps = run.read("steps").records
    assert sorted({r["rank"] for r in steps}) == [0, 1]
    assert max(r["step"] for r in steps) == 6  # --steps 6 stopped both ranks at the same step
    assert run.read("comm").records
    assert run.read("memwatch").records
    assert run.read("loader").records
    observed = meta["observed"]
    assert observed["job"]["procs_per_node"] == 2
    distributed = observed["distributed"]
    assert (distributed["backend"], distributed["timeout_s"], distributed["world_size"]) == ("gloo", 120.0, 2)
    assert (distributed["wrapper"], distributed["bucket_cap_mb"]) == ("DistributedDataParallel", 5.0)
    assert observed["optim"]["class"] == "SGD"
    assert observed["optim"]["momentum"] == 0.9
    assert observed["dataloader"]["sampler"] == "DistributedSampler"
    html = (out / "report.html").read_text()
    assert "<title>ciuic-doctor: ddp_train.py" in html
    recs = json.loads((out / "recommendations.json").read_text())["recommendations"]
    current = {r["setting"]: r.get("current") for r in recs}
    # loader-sweep started from the script's own DataLoader, and "current" is the script's.
    findings = json.loads((out / "findings.json").read_text())
    findings = findings["findings"] if isinstance(findings, dict) else findings
    sweep = next(f for f in findings if f["check"] == "loader_throughput")
    assert sweep["evidence"]["current"] == {
        "num_workers": 1,
        "prefetch_factor": 3,
        "pin_memory": False,
        "persistent_workers": True,
    }
    assert current["dataloader.num_workers"] == 1
    assert current["distributed.timeout_s"] == 120.0
    assert phases["checkpoint-check"]["status"] == "skipped"


def test_checkup_of_a_script_without_dataset_says_why_loader_sweep_did_not_run(tmp_path):
    out = tmp_path / "run"
    done = run_cli(
        "checkup", "--steps", "2", "--skip", "memwatch", "--out", str(out),
        "--", "-m", "plain_train",  # the `python -m module` form
        cwd=SCRIPTS, timeout=480,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    phases = phases_of(json.loads((out / "meta.json").read_text()))
    assert phases["job"]["status"] == "ok"
    assert phases["job"]["argv"][-2:] == ["-m", "plain_train"]
    assert len(RunDir.open(out).read("steps").records) == 2
    assert phases["comm-bench"]["status"] == "skipped"  # one process: no collective to measure
    assert "--dataset module:callable" in phases["loader-sweep"]["reason"]
    assert "give --dataset module:callable" in (out / "report.html").read_text()


def test_checkup_refuses_a_missing_script(tmp_path):
    done = run_cli("checkup", "--out", str(tmp_path / "run"), "--", str(tmp_path / "nope.py"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_dataset_without_a_script_is_a_usage_error(tmp_path):
    done = run_cli("checkup", "--dataset", "mydata:build", "--out", str(tmp_path / "run"))
    assert done.returncode == 2
    assert "give the script" in done.stderr
    assert "Traceback" not in done.stderr
