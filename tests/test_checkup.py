"""`ciuic-doctor checkup` end to end on the embedded job (2 gloo ranks): every probe as a real subprocess
into one run directory, then analyses, recommendations and the report. Slow (about a minute here), and run
in CI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ciuic_doctor.report import OUTPUTS
from tests.test_report import CHROMIUM
from tests.test_report_first_screen import assert_first_screen

SECRET = "hf_Checkup7SecretTokenValue42"


def all_bytes(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_checkup_end_to_end_writes_every_output(tmp_path, cli):
    run = tmp_path / "run"
    env = {"HF_TOKEN": SECRET, "TORCH_CIUIC_TEST_NOTE": f"copied {SECRET}"}  # captured into meta.json's env
    result = cli(
        "checkup", "--out", str(run), "--nproc", "2", "--steps", "10", "--loader-budget", "6",
        timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in (*OUTPUTS, "findings.json", "meta.json", "comm.jsonl", "loader.jsonl", "memwatch.jsonl"):
        assert (run / name).stat().st_size > 0, name
    assert sorted(p.name for p in run.glob("steps.rank*.jsonl")) == ["steps.rank0.jsonl", "steps.rank1.jsonl"]
    # progress: a line per phase with its time, then the summary
    for phase in ("comm-bench", "loader-sweep", "job", "memwatch", "report"):
        assert f"] {phase}" in result.stdout, phase
    assert "## ciuic-doctor: deepseek-v3-tiny" in result.stdout
    meta = json.loads((run / "meta.json").read_text())
    phases = {p["name"]: p for p in meta["checkup"]["phases"]}
    for name in ("comm-bench", "loader-sweep", "job", "memwatch"):
        assert phases[name]["status"] == "ok", phases[name]
    # The last line: the changes no run has tried yet, the command that tries them and how long it takes.
    assert re.fullmatch(
        rf"\d+ changes? not yet tried on this job: `ciuic-doctor verify {re.escape(str(run))}` "
        r"tries (it|them) \(about \d+ (min|s), estimated\)",
        result.stdout.strip().splitlines()[-1],
    ), result.stdout[-500:]
    if CHROMIUM is not None:  # the headline, the changes and the overview picture on the first screen
        assert_first_screen(run / "report.html", tmp_path)
    html = (run / "report.html").read_text()
    for section in ("comm", "job", "memory", "loader"):
        assert f'<section id="{section}" class="probe ">' in html, section
    recs = json.loads((run / "recommendations.json").read_text())
    assert any(r["setting"] == "NCCL_ALGO" and r["value"] is None for r in recs["recommendations"])  # gloo
    assert len(recs["seed_tips"]) == 7
    # the secret was in the environment of every phase; it is in no file of the run directory
    leaked = [name for name, data in all_bytes(run).items() if SECRET.encode() in data]
    assert leaked == []
    assert SECRET not in result.stdout


@pytest.mark.slow
def test_a_failing_probe_is_recorded_as_not_run_and_the_checkup_goes_on(tmp_path, cli):
    run = tmp_path / "run"
    result = cli(
        "checkup", "--out", str(run), "--skip", "loader-sweep,job,checkpoint-check",
        env={"CIUIC_COMM_FAULT": "1:1024:exit"},  # comm-bench's test hook: rank 1 exits at the first size
        timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "comm-bench        NOT RUN" in result.stdout
    meta = json.loads((run / "meta.json").read_text())
    phases = {p["name"]: p for p in meta["checkup"]["phases"]}
    assert phases["comm-bench"]["status"] == "failed"
    assert "rank 1" in phases["comm-bench"]["reason"]
    assert phases["memwatch"]["reason"] == "no job to attach to (job left out with --skip)"
    for name in OUTPUTS:
        assert (run / name).exists(), name
    summary = (run / "summary.md").read_text()
    assert "comm-bench failed: exit code 1" in summary
    assert "NOT RUN `job`: left out with --skip" in summary
