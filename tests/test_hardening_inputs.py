"""Hostile input ends in one line on stderr and exit 2, never a traceback (issue 11): numbers that
overflow, usage errors, refused output folders, a spec with every kind of bad value, what cannot fit the
machine, stream files that are directories or FIFOs."""

from __future__ import annotations

import json
import os

import pytest

from ciuic_doctor import cli_args as _common
from ciuic_doctor.errors import UserError
from ciuic_doctor.jobs.spec import load_spec, with_updates
from ciuic_doctor.rundir.store import RunDir


def in_process(capsys, *argv: str):
    """The CLI in this process: for refusals that happen before anything runs, without paying a fresh
    interpreter and torch import (~10 s on this machine) per case."""
    from conftest import Completed

    from ciuic_doctor.cli import _run_command

    capsys.readouterr()
    try:
        code = _run_command(list(argv))
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return Completed(code, captured.out, captured.err)


def one_line_exit_2(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "usage:" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["comm-bench", "-f", "inf"],
        ["comm-bench", "--time-budget", "1e308"],
        ["comm-bench", "--timeout", "nan"],
        ["memwatch", "--pid", "1", "--interval", "inf"],
        ["loader-sweep", "--timeout", "1e308"],
        ["loader-sweep", "--budget=-inf"],
        ["comm-bench", "-w", "-1"],
    ],
)
def test_numbers_that_overflow_are_one_line(cli, argv):
    line = one_line_exit_2(cli(*argv))
    assert "finite" in line or "at most" in line or "at least" in line


def test_number_parsers_reject_non_finite_and_huge():
    for text in ("inf", "-inf", "nan", "1e308", "1e10"):
        with pytest.raises(Exception, match=r"finite|at most"):
            _common.positive_float(text)
    assert _common.positive_float("1e9") == 1e9
    assert _common.non_negative_float("0") == 0.0


def test_usage_errors_are_one_line_without_a_usage_block(cli):
    one_line_exit_2(cli("no-such-command"))
    one_line_exit_2(cli("memwatch"))  # --pid missing
    line = one_line_exit_2(cli("comm-bench", "-b", "-1M"))
    assert "--option=VALUE" in line  # what to do, not only "expected one argument"


def test_out_refuses_a_folder_that_is_not_a_run_unless_forced(cli, tmp_path, sleeper):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "summary.md").write_text("my own notes\n")
    (folder / "data.jsonl").write_text('{"mine": 1}\n')
    line = one_line_exit_2(
        cli("memwatch", "--pid", str(sleeper.pid), "--duration", "0.5", "--out", str(folder))
    )
    assert "not a run directory" in line
    assert "--force" in line
    assert sorted(p.name for p in folder.iterdir()) == ["data.jsonl", "summary.md"]  # nothing written
    one_line_exit_2(cli("memwatch", "--pid", str(sleeper.pid), "--duration", "0.5", "--out", "/"))

    forced = cli("memwatch", "--pid", str(sleeper.pid), "--duration", "0.5", "--out", str(folder), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (folder / "memwatch.jsonl").is_file()
    assert json.loads((folder / "meta.json").read_text())["tool"]["name"] == "ciuic-doctor"
    assert (folder / "summary.md").read_text() == "my own notes\n"
    # From now on it is a run: no --force needed to add to it.
    again = cli("memwatch", "--pid", str(sleeper.pid), "--duration", "0.5", "--out", str(folder))
    assert again.returncode == 0, again.stderr


def test_run_dir_create_accepts_empty_folders_and_runs(tmp_path):
    RunDir.create(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    RunDir.create(tmp_path / "empty")
    run = RunDir.create(tmp_path / "run")
    run.update_meta(probes={"x": {}})
    (run.path / "report.html").write_text("<html>")
    RunDir.create(run.path)  # a run with its outputs is still a run
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "README").write_text("x")
    with pytest.raises(UserError, match="not a run directory"):
        RunDir.create(tmp_path / "other")


def test_spec_lists_every_bad_key_with_what_it_must_be(tmp_path):
    spec = tmp_path / "bad.toml"
    spec.write_text(
        '[job]\nsteps = -3\nname = "a\\nb"\n[batch]\nper_process = "8"\n[optim]\nbase_lr = nan\n'
        "betas = [0.9, 0.95, 0.99]\nwarmup_pct = 1.5\n[precision]\ninit_scale = 0\n"
        "[dataloader]\npin_memory = 1\n[model]\nnum_attention_heads = 0\n"
        '[distributed]\ntimeout_s = inf\n[distributed.env]\nHF_TOKEN = 5\n"BAD NAME" = "x"\n'
    )
    with pytest.raises(UserError) as caught:
        load_spec(spec)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{spec}: 12 problems")
    for fragment in (
        "[job] steps = -3: must be a whole number >= 1",
        "[job] name",
        "[batch] per_process = '8'",
        "[optim] base_lr = nan: must be a finite number > 0",
        "[optim] betas",
        "[optim] warmup_pct = 1.5",
        "[precision] init_scale = 0",
        "[dataloader] pin_memory = 1: must be true or false",
        "[model] num_attention_heads = 0",
        "[distributed] timeout_s = inf",
        "[distributed.env] HF_TOKEN = 5: must be a string",
        "[distributed.env] 'BAD NAME': not a valid environment variable name",
    ):
        assert fragment in message


def test_set_values_are_blamed_on_set_and_the_spec_on_the_spec(capsys, tmp_path):
    line = one_line_exit_2(
        in_process(capsys, "job", "--set", "batch.per_process=0", "--set", "optim.betas=[1.5, 0.9]")
    )
    assert "--set batch.per_process, optim.betas" in line
    assert "[batch] per_process = 0" in line
    spec = tmp_path / "s.toml"
    spec.write_text("[job]\nsteps = -3\n")
    line = one_line_exit_2(in_process(capsys, "job", "--spec", str(spec)))
    assert str(spec) in line
    assert "--steps" not in line
    assert with_updates(load_spec(), {"batch.per_process": 4}, origin="--set").source == "default"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["job", "--nproc", "999"], "more local ranks than this machine's"),
        (["job", "--set", "job.procs_per_node=999"], "the spec's [job] procs_per_node = 999"),
        (["comm-bench", "--nproc", "999"], "more local ranks"),
        (["comm-bench", "-e", "1000T"], "of host memory"),
        (["loader-sweep", "--workers", "500"], "500 is too many"),
        (["loader-sweep", "--workers", "4-0"], "runs backwards"),
        (["checkup", "--skip", "foo"], "unknown phase(s) foo"),
    ],
)
def test_what_cannot_fit_is_refused_with_the_reason(capsys, tmp_path, argv, fragment):
    line = one_line_exit_2(in_process(capsys, *argv, "--out", str(tmp_path / "run")))
    assert fragment in line
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_stream_that_is_a_directory_or_fifo_is_skipped_and_named(cli, tmp_path):
    run = RunDir.create(tmp_path / "run")
    with run.writer("steps", rank=0, per_rank_file=True) as writer:
        for step in range(1, 4):
            writer.write({"step": step, "loss": 2.0})
    (run.path / "steps.rank1.jsonl").mkdir()
    os.mkfifo(run.path / "memwatch.jsonl")  # no writer: a blocking open would hang forever
    read = run.read("steps")
    assert len(read.records) == 3
    assert "steps.rank1.jsonl unreadable" in run.read_problems["steps"]
    result = cli("analyze", str(run.path), timeout=60)
    assert result.returncode in (0, 1), result.stderr
    assert "Traceback" not in result.stderr
    findings = json.loads((run.path / "findings.json").read_text())["findings"]
    quality = [f for f in findings if f["check"] == "records_readable"]
    assert "memwatch.jsonl unreadable" in quality[0]["summary"]


def test_report_html_that_is_a_directory_is_one_line(cli, tmp_path):
    run = RunDir.create(tmp_path / "run")
    with run.writer("steps", rank=0, per_rank_file=True) as writer:
        writer.write({"step": 1, "loss": 2.0})
    (run.path / "report.html").mkdir()
    line = one_line_exit_2(cli("report", str(run.path), timeout=120))
    assert "report.html" in line
    assert "is a directory" in line


@pytest.mark.parametrize("fmt", [[], ["--format", "megatron"]])
def test_a_fifo_given_as_a_log_is_one_line_not_a_hang(capsys, tmp_path, fmt):
    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)  # no writer: reading it would block forever
    line = one_line_exit_2(in_process(capsys, "stability", str(fifo), *fmt))
    assert "not a regular file" in line


def test_a_1e308_loss_is_said_in_a_few_digits():
    """A diverging loss that reaches 1e308 printed a 300-digit ratio in the summary."""
    import numpy as np

    from ciuic_doctor.analysis.stability import analyze_log
    from ciuic_doctor.importers import StepLog, normalize

    steps = np.arange(1, 201)
    loss = np.where(steps < 150, 3.0 - steps / 100, 10.0 ** (1 + (steps - 150) * 6.1))
    log = StepLog(table=normalize({"step": steps, "loss": loss}, source="test"))
    summaries = " ".join(f.summary for f in analyze_log(log))
    assert max(len(word) for word in summaries.split()) < 40, summaries


def test_a_folder_with_only_hang_files_is_a_run(tmp_path):
    """A rank's hang watchdog writes hang.rank<R>.armed.json before rank 0 writes meta.json, and
    `hang --pid --out D` writes only hang.* files: neither folder may be refused as 'not a run'."""
    racing = tmp_path / "racing"
    (racing / "hang.fr").mkdir(parents=True)
    (racing / "hang.rank1.armed.json").write_text("{}")
    (racing / "steps.rank1.jsonl").write_text("")
    assert RunDir.create(racing).path == racing
    pid = tmp_path / "pid"
    pid.mkdir()
    (pid / "hang.pyspy.json").write_text("{}")
    assert RunDir.create(pid).path == pid
