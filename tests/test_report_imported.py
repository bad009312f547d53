"""Issue 24: `stability LOG --out RUN && report RUN` is a report about that log, for every format people
have: titled after the log, with its loss plot, its job section from its rows, and no recommendation nor
measured seed-tip verdict resting on the embedded job's default spec (which the log says nothing of)."""

from __future__ import annotations

import json
import re

import logsynth as ls
import logsynth_formats as lf
import pytest
from conftest import run_cli

from ciuic_doctor.report import build_report
from ciuic_doctor.rundir.store import RunDir


def write_log(tmp_path, kind: str):
    run = ls.make_run(400, seed=41, spikes=((250, 2.2, 10),))
    writers = {
        "megatron": ("train.log", lambda: lf.megatron_args_block() + ls.megatron_log(run)),
        "lightning": ("metrics.csv", lambda: ls.lightning_csv(run)),
        "nanogpt": ("nanogpt.out", lambda: ls.nanogpt_log(run)),
        "torchtitan": ("titan.log", lambda: lf.torchtitan_log(run, ranks=2, val_every=100)),
    }
    name, text = writers[kind]
    path = tmp_path / name
    path.write_text(text())
    return path


def stability_section(html: str) -> str:
    return html[html.index('<section id="stability"') : html.index('<section id="memory"')]


def check_report(run_dir, log_name: str, kind: str) -> None:
    html = (run_dir / "report.html").read_text()
    title = re.search(r"<title>([^<]*)</title>", html).group(1)
    assert f"{log_name} ({kind})" in title
    assert "deepseek-v3-tiny" not in html  # the embedded job is not what this report is about
    assert "<svg" in stability_section(html)  # the loss plot
    job = html[html.index('<section id="job"') : html.index('<section id="stability"')]
    assert "from the imported log" in job
    assert "loss first / best / last" in job
    recs = json.loads((run_dir / "recommendations.json").read_text())
    assert recs["recommendations"] == []
    assert "global batch 16" not in html
    assert "8 per rank" not in html
    measured = [c for t in recs["seed_tips"] for c in t["claims"] if c["basis"] == "measured"]
    assert measured
    assert all(c["status"] == "not measured" for c in measured)
    assert (run_dir / "summary.md").read_text().startswith(f"## ciuic-doctor: {log_name} ({kind})")


@pytest.mark.parametrize("kind", ["megatron", "lightning", "nanogpt"])
def test_report_of_an_imported_log_is_about_that_log(tmp_path, kind):
    from ciuic_doctor.analysis.stability import analyze_log, write_findings
    from ciuic_doctor.importers import load
    from ciuic_doctor.importers._run import write_run

    path = write_log(tmp_path, kind)
    log = load(path)
    out = RunDir.create(tmp_path / "run")
    assert write_run(out, log, [path])
    write_findings(out, analyze_log(log))
    build_report(out)
    check_report(out.path, path.name, kind)
    if kind == "megatron":  # the arguments block is shown as what the log prints, not judged as a spec
        html = (out.path / "report.html").read_text()
        assert "printed: global_batch_size" in html
        assert "global_batch_size 512" in html


def test_torchtitan_log_through_the_commands(tmp_path):
    path = write_log(tmp_path, "torchtitan")
    run_dir = tmp_path / "run"
    done = run_cli("stability", str(path), "--out", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert "torchtitan" in done.stdout
    done = run_cli("report", str(run_dir))
    assert done.returncode == 0, done.stderr
    check_report(run_dir, path.name, "torchtitan")


def test_a_spec_given_for_an_imported_log_is_judged(tmp_path):
    """With --spec a person said what the job was: the settings rules run again (the gate is only for the
    embedded default standing in for a job the log does not describe)."""
    from importlib import resources

    path = write_log(tmp_path, "nanogpt")
    run_dir = tmp_path / "run"
    assert run_cli("stability", str(path), "--out", str(run_dir)).returncode == 0
    spec = tmp_path / "job.toml"
    spec.write_text(resources.files("ciuic_doctor.jobs").joinpath("default.toml").read_text())
    build_report(RunDir.open(run_dir), spec_path=spec)
    recs = json.loads((run_dir / "recommendations.json").read_text())
    assert recs["recommendations"], "the spec's settings are judged"
    assert not any(f["check"] == "job_settings" for f in recs["settings_findings"])


def test_a_log_name_cannot_add_a_line_to_recommended_env():
    """The title is a file name, and recommended.env (which a shell sources) carries it in a comment."""
    from ciuic_doctor.recommend import Plan
    from ciuic_doctor.report import files
    from ciuic_doctor.report.imported import log_title

    title = log_title({"source": {"import": {"formats": {"/x/a\nexport EVIL=1\x1b[31m.log": "megatron"}}}})
    assert "\n" not in title
    assert "\x1b" not in title
    env = files.env_text(Plan(), job=title, run="r")
    assert not any(line.startswith("export") for line in env.splitlines())
