"""watch as a user types it: `watch -- python train.py` runs train.py, and what it records of a script
that never clips is "no threshold" (null), not a threshold of 0."""

from __future__ import annotations

import json

from ciuic_doctor.jobs.observed import spec_from_observed
from ciuic_doctor.probes.watch.target import strip_interpreter
from tests.conftest import run_cli
from tests.test_data_wait import SCRIPT


def test_watch_python_script_runs_the_script_and_records_no_clip(tmp_path):
    run = tmp_path / "run"
    done = run_cli("watch", "--out", str(run), "--", "python", str(SCRIPT), "--steps", "3", "--load-ms", "0",
                   timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    observed = json.loads((run / "meta.json").read_text())["observed"]
    assert observed["job"]["argv"][0] == str(SCRIPT)
    assert observed["optim"]["clip_max_norm"] is None  # the script never calls clip_grad_norm_
    resolved = spec_from_observed(observed)
    assert resolved.spec.optim.clip_max_norm == 0.0  # the spec's "no clipping"
    assert "optim.clip_max_norm" not in resolved.assumed


def test_interpreter_options_are_refused_with_the_form_that_works(tmp_path):
    done = run_cli("watch", "--out", str(tmp_path / "run"), "--", "python", "-u", str(SCRIPT), timeout=60)
    assert done.returncode == 2
    assert "ciuic-doctor watch -- script.py" in done.stderr
    assert "Traceback" not in done.stderr


def test_strip_interpreter_keeps_a_script_argument():
    assert strip_interpreter(["train.py", "python"]) == ["train.py", "python"]
    assert strip_interpreter(["python3.11", "-m", "pkg.train"]) == ["-m", "pkg.train"]
