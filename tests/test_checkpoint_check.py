"""checkpoint-check with real processes: 2 gloo ranks saving, loading and resuming the embedded job, a user's
save function slower than the job's timeout, and --inspect on files that must not be unpickled."""

from __future__ import annotations

import doctest
import importlib
import re
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import run_cli, torchrun

from ciuic_doctor.analysis.checkpoint import analyze
from ciuic_doctor.report import build_report
from ciuic_doctor.rundir.store import RunDir

FP16_SPEC = """
[precision]
mode = "fp16"          # GradScaler on, so leaving out its state is something to detect
[dataloader]
num_workers = 1        # a real worker process, as the job has
"""
DROPS = ("optimizer", "scheduler", "scaler", "rng", "sampler")


def _findings(run: Path, check: str) -> list:
    return [f for f in analyze(RunDir.open(run)) if f.check == check]


@pytest.fixture(scope="module")
def drop_run(tmp_path_factory):
    """One 2-rank run: the checkpoint as saved, then one restart per --drop (each omission in turn)."""
    base = tmp_path_factory.mktemp("checkpoint")
    spec = base / "fp16.toml"
    spec.write_text(FP16_SPEC)
    run = base / "run"
    drops = [arg for name in DROPS for arg in ("--drop", name)]
    result = run_cli(
        "checkpoint-check", "--spec", str(spec), "--steps-before", "2", "--steps-after", "2",
        "--repeats", "1", *drops, "--out", str(run), timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = RunDir.open(run).read("checkpoint").records
    return SimpleNamespace(result=result, run=run, records=records, findings=analyze(RunDir.open(run)))


def _resume(findings, variant):
    return next(f for f in findings if f.check == "resume_mismatch" and f.evidence["variant"] == variant)


def test_complete_checkpoint_resumes_bit_identically_on_two_gloo_ranks(drop_run):
    config = next(r for r in drop_run.records if r["kind"] == "config")
    assert (config["backend"], config["nproc"], config["precision"]) == ("gloo", 2, "fp16")
    finding = _resume(drop_run.findings, "as saved")
    assert finding.verdict == "pass", finding.summary
    assert finding.evidence["missing"] == []
    assert finding.evidence["max_abs_loss_diff"] == 0.0
    resumes = {(r["variant"], r["rank"]): r for r in drop_run.records if r["kind"] == "resume"}
    for rank in (0, 1):
        reference, resumed = resumes[("reference", rank)], resumes[("as saved", rank)]
        assert len(resumed["losses"]) == 2
        assert resumed["losses"] == reference["losses"]
        assert resumed["fingerprint"] == reference["fingerprint"]
    # The ranks trained on different data (DistributedSampler), so equal losses are not one rank twice.
    assert resumes[("reference", 0)]["losses"] != resumes[("reference", 1)]["losses"]


@pytest.mark.parametrize(
    ("dropped", "named"),
    [
        ("optimizer", "optimizer"),
        ("scheduler", "scheduler"),
        ("scaler", "scaler"),
        ("rng", "rng.python"),
        ("sampler", "sampler"),
    ],
)
def test_each_kind_of_missing_state_is_detected_and_named(drop_run, dropped, named):
    finding = _resume(drop_run.findings, f"without {dropped}")
    assert finding.verdict in ("warn", "fail"), finding.summary
    assert named in finding.evidence["missing"]
    # Measured, not only read off the file: the restarted run differs where that state acts.
    assert named in finding.evidence["state_behind_differences"]
    assert named in finding.summary
    assert named in finding.evidence["hint"]


def test_omissions_that_change_the_loss_fail_and_latent_ones_warn(drop_run):
    sampler = _resume(drop_run.findings, "without sampler")
    assert sampler.verdict == "fail"
    assert sampler.evidence["first_divergent_step"] == 3  # the first step after the checkpoint at 2
    assert sampler.evidence["max_abs_loss_diff"] > 0
    rng = _resume(drop_run.findings, "without rng")  # no dropout: nothing drew from the RNGs yet
    assert rng.verdict == "warn"
    assert rng.evidence["first_divergent_step"] is None


def test_save_and_load_cost_measured_per_rank_both_ways(drop_run):
    records = drop_run.records
    loads = {(r["method"], r["rank"]) for r in records if r["kind"] == "load"}
    assert loads == {(m, rank) for m in ("every_rank", "rank0_broadcast") for rank in (0, 1)}
    saves = {r["rank"]: r for r in records if r["kind"] == "save"}
    assert saves[0]["save_s"] > 0
    assert saves[1]["save_s"] == 0  # only rank 0 writes; rank 1 waits at the barrier
    assert saves[1]["barrier_wait_s"] > 0
    cost = _findings(drop_run.run, "checkpoint_cost")[0]
    weights_bytes = 1_175_040 * 4  # the tiny model's fp32 parameters; Adam keeps two more copies
    assert cost.evidence["size_bytes"] > 2 * weights_bytes
    assert cost.evidence["load_held_bytes"] > 2 * weights_bytes
    assert cost.evidence["peak_load_rss_bytes"] > cost.evidence["size_bytes"]
    assert cost.evidence["broadcast_load_s"] > 0
    assert cost.evidence["hint_trigger"]
    assert "rank 0 reads + broadcast" in drop_run.result.stdout
    safe = _findings(drop_run.run, "unsafe_checkpoint")[0]
    assert safe.verdict == "pass"


def test_slow_save_against_short_timeout_is_timeout_risk(tmp_path):
    """A save longer than the spec's 1 s timeout: the probe survives it (its own group waits longer) and
    says the job's barrier would time out."""
    slow = tmp_path / "slowsave.py"
    slow.write_text(
        textwrap.dedent(
            """
            import time
            import torch

            def save(state, path):
                time.sleep(2.5)
                torch.save(state, path)
            """
        )
    )
    spec = tmp_path / "short.toml"
    spec.write_text("[distributed]\ntimeout_s = 1\n[dataloader]\nnum_workers = 0\n")
    run = tmp_path / "run"
    result = torchrun(
        "checkpoint-check", "--spec", str(spec), "--save", f"{slow}:save", "--steps-before", "1",
        "--steps-after", "1", "--repeats", "1", "--out", str(run), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    risk = _findings(run, "timeout_risk")[0]
    assert risk.verdict == "fail", risk.summary
    assert risk.evidence["timeout_s"] == 1
    assert risk.evidence["save_s"] >= 2.5  # the sleep is a lower bound, not a timing expectation
    assert risk.evidence["barrier_wait_s"] > risk.evidence["timeout_s"]
    assert "torch.distributed.checkpoint" in risk.evidence["hint"]
    # The user's save kept everything, so the resume through it is still exact.
    assert _findings(run, "resume_mismatch")[0].verdict == "pass"


class _OpensAFile:
    """Unpickling this object calls open(marker, "w"): the file appears only if the pickle is executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_inspect_finds_arbitrary_pickle_and_never_runs_it(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    torch.save({"model": {"0.weight": torch.zeros(2, 2)}, "extra": _OpensAFile(marker)}, path)
    run = tmp_path / "run"
    result = run_cli("checkpoint-check", "--inspect", str(path), "--out", str(run), timeout=120)
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    unsafe = _findings(run, "unsafe_checkpoint")[0]
    assert unsafe.verdict == "fail"
    assert any(name.endswith(".open") for name in unsafe.evidence["unsafe_globals"])
    contents = _findings(run, "checkpoint_contents")[0]
    assert contents.evidence["guessed_from_names"] is True
    assert "optimizer" in contents.evidence["missing"]
    # The test can fail: the same file, unpickled for real, does create the marker.
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_inspect_lists_the_kinds_of_state_a_checkpoint_lacks(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    path = tmp_path / "partial.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, path)
    run = tmp_path / "run"
    result = run_cli("checkpoint-check", "--inspect", str(path), "--out", str(run), timeout=120)
    assert result.returncode == 0, result.stderr
    assert _findings(run, "unsafe_checkpoint")[0].verdict == "pass"
    contents = _findings(run, "checkpoint_contents")[0]
    assert contents.verdict == "warn"
    assert set(contents.evidence["present"]) == {"model", "optimizer", "sampler"}
    assert contents.evidence["missing"] == ["scheduler", "rng.python", "rng.numpy", "rng.torch", "step"]
    assert set(contents.evidence["conditional"]) == {"scaler", "rng.cuda"}


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--save", "no_such_module_xyz:save"], "cannot import"),
        (["--save", "save_without_module"], "expected module:callable"),
        (["--load", "os:no_such_function"], "has no callable"),
        (["--save", "os:getcwd"], "must accept save(state, path)"),
        (["--drop", "optimizer,weights"], "unknown weights"),
        (["--spec", "/no/such/spec.toml"], "no such file"),
        (["--inspect", "/no/such/checkpoint.pt"], "no such file"),
        (["--inspect", __file__], "not a PyTorch checkpoint"),
        (["--inspect", __file__, "--drop", "rng"], "takes no --drop"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, words):
    result = run_cli("checkpoint-check", *args, "--out", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert words in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "name",
    [
        "ciuic_doctor.probes.checkpoint.options",
        "ciuic_doctor.probes.checkpoint.inspection",
        "ciuic_doctor.analysis.checkpoint.resume",
    ],
)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0
    assert result.failed == 0


def test_report_tables_show_each_rank_each_load_method_and_each_resumed_variant(drop_run, tmp_path):
    """The report's checkpoint section from the real 2-rank run: the analysis's figures, in tables."""
    run = tmp_path / "run"
    shutil.copytree(drop_run.run, run, ignore=shutil.ignore_patterns("*.pt", "checkpoints"))
    build_report(RunDir.open(run))
    html = (run / "report.html").read_text()
    section = html[html.index('id="checkpoint"') :]
    tables = {
        re.sub(r" \(\d+ rows?\)$", "", title): body
        for title, body in re.findall(r"<summary>([^<]*)</summary>(.*?)</table>", section, re.S)
    }
    per_rank = next(body for title, body in tables.items() if title.startswith("Save and load per rank"))
    assert len(re.findall(r"<tr>", per_rank)) == 1 + 2  # header + ranks 0 and 1
    both = next(body for title, body in tables.items() if title.startswith("Two ways to load"))
    assert re.findall(r"<tr><td[^>]*>([^<]*)</td>", both) == [
        "every rank reads the file",
        "rank 0 reads + broadcast",
    ]
    resume = next(body for title, body in tables.items() if title.startswith("Resume against"))
    verdicts = dict(re.findall(r"<tr><td[^>]*>([^<]*)</td><td[^>]*>([^<]*)</td>", resume))
    assert verdicts["as saved"] == "pass"
    assert verdicts["without sampler"] == "fail"  # the data order changes the next loss
    assert set(verdicts) == {"as saved", *(f"without {name}" for name in DROPS)}
    contents = next(body for title, body in tables.items() if title.startswith("What "))
    status = dict(re.findall(r"<tr><td[^>]*>([^<]*)</td><td[^>]*>([^<]*)</td>", contents))
    assert status["optimizer"] == "present"
    assert status["scaler"] == "present"  # fp16: GradScaler's state was saved
