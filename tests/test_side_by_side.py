"""The analyses after the memory checks, side by side in forked workers (ciuic_doctor/analysis: run_all):
findings.json identical to one after the other, the analyses really in other processes, what they leave
on the RunDir brought back, and a worker killed mid-analysis costs nothing but time."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import ciuic_doctor.analysis as analysis_front
from ciuic_doctor import parallel
from ciuic_doctor.analysis import run_all
from ciuic_doctor.analysis import steps as steps_analysis
from ciuic_doctor.analysis import throughput as throughput_analysis
from ciuic_doctor.rundir import frames
from ciuic_doctor.rundir.store import RunDir
from tests.scalesynth import generate, gpu_plan


@pytest.fixture(scope="module")
def run_path(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("sbs") / "run", gpu_plan(64, 80))


@pytest.fixture(autouse=True)
def _fresh_cache():
    frames.clear_cache()
    yield
    frames.clear_cache()


def _analysed(run_path: Path, *, min_rows: int, monkeypatch) -> tuple[list[dict], list[str], RunDir]:
    """findings.json's findings after run_all on two workers, side by side from `min_rows` held step rows."""
    monkeypatch.setattr(analysis_front, "SIDE_BY_SIDE_MIN_ROWS", min_rows)
    said: list[str] = []
    run = RunDir.open(run_path)
    with parallel.using(jobs=2):
        run_all(run, said.append)
    return json.loads((run_path / "findings.json").read_text())["findings"], said, run


def test_side_by_side_gives_the_findings_of_one_after_the_other_from_other_processes(
    run_path, tmp_path, monkeypatch
):
    serial, said_serial, _ = _analysed(run_path, min_rows=10**12, monkeypatch=monkeypatch)
    assert not any("side by side" in line for line in said_serial)

    pids = tmp_path / "pids"
    original = steps_analysis.analyze

    def noting_pid(run):
        with open(pids, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        return original(run)

    monkeypatch.setattr(steps_analysis, "analyze", noting_pid)
    together, said, _ = _analysed(run_path, min_rows=0, monkeypatch=monkeypatch)
    assert together == serial
    assert [line for line in said if "side by side" in line] == [
        "analysing moe, stability, steps, throughput side by side (5-8/8)"
    ], said
    assert [int(p) for p in pids.read_text().split()] != [os.getpid()]  # steps ran in a forked worker


def test_the_longest_analyses_start_first(run_path, tmp_path, monkeypatch):
    """Two workers take the two analyses with the most time per step record first (steps, throughput),
    so that a short one is what is left at the end; the findings still come back in module order."""
    from ciuic_doctor.analysis import moe, stability

    started = tmp_path / "started"
    modules = {"moe": moe, "stability": stability, "steps": steps_analysis, "throughput": throughput_analysis}
    for name, module in modules.items():

        def noting_start(run, name=name, original=module.analyze):
            with open(started, "a") as fh:
                fh.write(f"{name}\n")
            return original(run)

        monkeypatch.setattr(module, "analyze", noting_start)
    serial, _, _ = _analysed(run_path, min_rows=10**12, monkeypatch=monkeypatch)
    started.unlink()
    together, _, _ = _analysed(run_path, min_rows=0, monkeypatch=monkeypatch)
    assert together == serial
    order = started.read_text().split()
    assert sorted(order) == sorted(modules)
    assert set(order[:2]) == {"steps", "throughput"}, order


def test_what_an_analysis_leaves_on_the_rundir_in_a_worker_comes_back(run_path, monkeypatch):
    original = throughput_analysis.analyze
    parent = os.getpid()

    def leaving_problems(run):
        assert os.getpid() != parent
        run.read_problems["throughput_probe"] = "2 lines dropped"
        run.notes.append("a copy could not be written")
        return original(run)

    monkeypatch.setattr(throughput_analysis, "analyze", leaving_problems)
    findings, _, run = _analysed(run_path, min_rows=0, monkeypatch=monkeypatch)
    assert run.read_problems["throughput_probe"] == "2 lines dropped"
    assert "a copy could not be written" in run.notes
    readable = [f for f in findings if f["check"] == "records_readable"]
    assert len(readable) == 1
    assert "throughput_probe: 2 lines dropped" in readable[0]["summary"]


def test_a_worker_killed_mid_analysis_leaves_them_to_this_process(run_path, monkeypatch):
    serial, _, _ = _analysed(run_path, min_rows=10**12, monkeypatch=monkeypatch)
    original = steps_analysis.analyze
    parent = os.getpid()

    def killed_in_a_worker(run):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer's way
        return original(run)

    monkeypatch.setattr(steps_analysis, "analyze", killed_in_a_worker)
    findings, said, _ = _analysed(run_path, min_rows=0, monkeypatch=monkeypatch)
    assert findings == serial
    assert "analysing steps (7/8)" in said  # run again here, one after the other


def _job_section(run_path: Path, min_rows: int, monkeypatch) -> str:
    """The job section of the page (plots, tables, notes, files), made beside the rest from `min_rows`."""
    from ciuic_doctor.analysis import load_findings
    from ciuic_doctor.report import sections

    monkeypatch.setattr(sections, "JOB_BESIDE_MIN_ROWS", min_rows)
    run = RunDir.open(run_path)
    with parallel.using(jobs=2):
        if not (run_path / "findings.json").exists():
            run_all(run)
        streams = sections.load_streams(run)
        made = sections.build_sections(streams, load_findings(run), run.read_meta())
    job = next(s for s in made if s.id == "job")
    # as text: a table's NaN cells are equal as written, not as floats (a pickled NaN is another object)
    return json.dumps([job.plots, [t.__dict__ for t in job.tables], job.notes, job.files], default=str)


def test_the_job_section_made_beside_the_rest_of_the_page_is_the_same(run_path, tmp_path, monkeypatch):
    from ciuic_doctor.report import band_plots, sections, steps_section

    alone = _job_section(run_path, 10**12, monkeypatch)
    assert "<svg" in alone
    assert "steps_per_rank.csv" in alone
    assert "heat-map of pace and memory" in alone
    pids, heatmap_pids = tmp_path / "pids", tmp_path / "heatmap_pids"

    def noting_pid(original, path):
        def noted(*args, **kwargs):
            with open(path, "a") as fh:
                fh.write(f"{os.getpid()}\n")
            return original(*args, **kwargs)

        return noted

    monkeypatch.setattr(sections, "job_content", noting_pid(steps_section.job_content, pids))
    monkeypatch.setattr(band_plots, "host_heatmap", noting_pid(band_plots.host_heatmap, heatmap_pids))
    assert _job_section(run_path, 0, monkeypatch) == alone
    worker = [int(p) for p in pids.read_text().split()]
    assert worker != [os.getpid()]  # made in a forked worker
    # and its heat-map in a worker of its own, beside the bands
    assert [int(p) for p in heatmap_pids.read_text().split()] not in ([os.getpid()], worker)


def test_a_job_section_worker_killed_leaves_it_to_this_process(run_path, monkeypatch):
    from ciuic_doctor.report import sections, steps_section

    alone = _job_section(run_path, 10**12, monkeypatch)
    original = steps_section.job_content
    parent = os.getpid()

    def killed_in_a_worker(*args, **kwargs):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    monkeypatch.setattr(sections, "job_content", killed_in_a_worker)
    assert _job_section(run_path, 0, monkeypatch) == alone
