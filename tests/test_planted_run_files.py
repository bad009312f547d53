"""Planted files in a run directory end in one line and exit 2 (or the right answer), never a traceback:
a symlink where watch writes its hang file or steps stream; a verification.json with null figures."""

from __future__ import annotations

import json

import pytest

SCRIPT = """
import pathlib, sys, torch
pathlib.Path(sys.argv[1]).write_text("ran")
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad(); m(torch.randn(8, 4)).pow(2).mean().backward(); opt.step()
"""


@pytest.mark.parametrize("name", ["hang.rank0.last.json", "steps.rank0.jsonl"])
def test_watch_refuses_a_symlink_where_it_writes_before_the_script_starts(tmp_path, cli, name):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "elsewhere"
    (run / name).symlink_to(target)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    marker = tmp_path / "marker"
    done = cli("watch", "--out", str(run), "--", str(script), str(marker), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [
        f"ciuic-doctor watch: error: {run / name} is a symlink, and watch writes there only to a regular "
        "file of its own: remove it, or record into another --out"
    ]
    assert not marker.exists()  # the script never started
    assert not target.exists()  # nothing written through the link
    assert "no optimizer step" not in done.stderr


def test_report_takes_a_verification_json_with_null_or_foreign_figures(tmp_path, cli):
    from ciuic_doctor.rundir.store import RunDir

    run = RunDir.create(tmp_path / "run")
    writer = run.writer("steps", rank=0, per_rank_file=True)
    for step in range(1, 6):
        writer.write({"step": step, "t": 1000.0 + step, "step_time_s": 0.1, "loss": 2.0, "rank": 0})
    writer.close()
    cand = {"label": "num_workers=2", "source": "recommendation", "settings": {"dataloader.num_workers": 2},
            "status": "helps", "target_metric": "step_time_s", "rounds": 2}  # fmt: skip
    planted = {
        "budget_s": "x",
        "rounds": 10**400,
        "candidates": [
            {**cand, "ratio": 0.8, "ci_low": 0.7, "ci_high": None},
            {**cand, "label": "b", "ratio": "1", "ci_low": True, "ci_high": 10**400},
            "not a candidate",
        ],
    }
    (run.path / "verification.json").write_text(json.dumps(planted))
    done = cli("report", str(run.path), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "num_workers=2" in (run.path / "report.html").read_text()


def test_compare_says_which_run_had_records_it_could_not_read(tmp_path, cli):
    from ciuic_doctor.rundir.store import RunDir

    paths = []
    for name in ("a", "b"):
        run = RunDir.create(tmp_path / name)
        for rank in range(2):
            if name == "b" and rank == 1:
                (run.path / "steps.rank1.jsonl").mkdir()  # a stream that is a folder
                continue
            writer = run.writer("steps", rank=rank, per_rank_file=True)
            for step in range(1, 31):
                writer.write(
                    {"step": step, "t": 1000.0 + step, "step_time_s": 0.1 + step * 1e-4, "rank": rank}
                )
            writer.close()
        paths.append(str(run.path))
    done = cli("compare", *paths, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if "records_readable" in line)
    assert f"run B ({paths[1]}): skipped what could not be read" in line
    assert "steps.rank1.jsonl unreadable (a directory, not a regular file)" in line
