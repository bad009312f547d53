"""Options a command cannot honour are refused in one line (exit 2) before it prints a banner, makes a
folder or runs anything: checkpoint-check --nproc 999, loader-sweep --sample-bytes 100G, checkup
--dataset naming a module that is not there."""

from __future__ import annotations

import pytest


def _one_line(done) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert not done.stdout.strip(), done.stdout  # no banner
    return lines[0]


def test_checkpoint_check_refuses_more_ranks_than_cpus_before_banner_and_folder(tmp_path, cli):
    out = tmp_path / "cc"
    line = _one_line(cli("checkpoint-check", "--nproc", "999", "--out", str(out)))
    assert "--nproc 999: more local ranks than this machine's" in line
    assert not out.exists()


def test_loader_sweep_refuses_a_sample_no_batch_of_which_fits(tmp_path, cli):
    out = tmp_path / "ls"
    line = _one_line(cli("loader-sweep", "--sample-bytes", "100G", "--out", str(out)))
    assert line.startswith("ciuic-doctor loader-sweep: error: --sample-bytes 100 GiB: a batch of ")
    assert "MemoryError" not in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("dataset", "words"),
    [("nope:x", "no module 'nope' here"), ("nope", "expected module:callable")],
)
def test_checkup_refuses_a_dataset_it_cannot_find_before_the_script_runs(tmp_path, cli, dataset, words):
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    out = tmp_path / "run"
    line = _one_line(cli("checkup", "--dataset", dataset, "--out", str(out), "--", str(script), cwd=tmp_path))
    assert words in line
    assert not marker.exists()
    assert not out.exists()


def test_stability_refuses_to_import_a_log_into_a_recorded_jobs_run(tmp_path, cli):
    """Merged there, the import's findings were dropped by `report --reanalyze`, which judged the
    job's own 4 steps instead."""
    import logsynth

    from ciuic_doctor.rundir.store import RunDir

    run = RunDir.create(tmp_path / "job")
    writer = run.writer("steps", rank=0, per_rank_file=True)
    for step in range(1, 5):
        writer.write({"step": step, "t": 1000.0 + step, "loss": 3.0, "rank": 0})
    writer.close()
    log = tmp_path / "train.log"
    log.write_text(logsynth.megatron_log(logsynth.make_run(300)))
    done = cli("stability", str(log), "--out", str(run.path), timeout=180)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [
        f"ciuic-doctor stability: error: --out {run.path}: holds a recorded job's own steps; an imported "
        "log's findings there would be replaced by the job's at the next analyze or report --reanalyze: "
        "give another --out"
    ]
    assert not (run.path / "findings.json").exists()
