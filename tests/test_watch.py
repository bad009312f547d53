"""`ciuic-doctor watch`: real scripts in real processes (plain PyTorch, torchrun ranks, the embedded job),
and the steps analysis on the records they write."""

from __future__ import annotations

import doctest
import importlib
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli, torchrun

from ciuic_doctor.analysis.steps import analyze, check_rank_desync, check_step_time
from ciuic_doctor.cli import main
from ciuic_doctor.rundir.store import RunDir, as_float

RECORD_KEYS = (
    "rank", "step", "t", "step_time_s", "pre_backward_s", "loss", "lr", "grad_norm", "grad_norm_source",
    "clip_max_norm", "loss_scale", "skipped", "backward_calls", "mem_allocated", "mem_reserved",
    "mem_active_peak", "alloc_retries", "rss", "uss", "weights_checksum", "desync_ranks",
    "optimizer", "optimizer_class", "loss_scale_next", "segment",
)  # fmt: skip

# A user's script: plain PyTorch, no ciuic_doctor import. It prints what it saw so the test can compare.
PLAIN_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch

    steps, mode = int(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=mode == "fp16")
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    seen = {"argv": sys.argv, "name": __name__, "losses": [], "norms": [], "lrs": []}
    for step in range(1, steps + 1):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=mode == "fp16"):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if mode == "fp16" and step == 2:
            model[0].weight.grad[0, 0] = float("inf")  # what an fp16 overflow leaves behind
        scaler.unscale_(opt)
        if mode == "clip":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        seen["lrs"].append(opt.param_groups[0]["lr"])
        scaler.step(opt)
        scaler.update()
        sched.step()
        seen["losses"].append(loss.item())
        seen["norms"].append(norm.item())
        if mode == "raise" and step == 3:
            raise RuntimeError("the user's bug")
    print(json.dumps(seen))
    sys.exit(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "user_train.py"
    path.write_text(PLAIN_SCRIPT)
    return path


def steps_of(path) -> list[dict]:
    return sorted(RunDir.open(path).read("steps").records, key=lambda r: (r["rank"], r["step"]))


@pytest.mark.parametrize(
    "name",
    [
        "ciuic_doctor.measures.ranks",
        "ciuic_doctor.probes.watch.snapshot",
        "ciuic_doctor.probes.watch.steps",
        "ciuic_doctor.probes.watch.target",
        "ciuic_doctor.probes.watch.exit",
    ],
)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0
    assert result.failed == 0


# ---- a plain user script -----------------------------------------------------------------------------
def test_plain_script_is_recorded_with_its_own_argv_and_exit_code(tmp_path, script):
    out = tmp_path / "run"
    done = run_cli("watch", "--out", str(out), "--", str(script), "5", "clip", "3", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["argv"] == [str(script), "5", "clip", "3"]
    assert seen["name"] == "__main__"
    records = steps_of(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(set(r) >= set(RECORD_KEYS) for r in records)
    assert [r["loss"] for r in records] == seen["losses"]  # the very scalar backward() ran on
    assert [r["grad_norm"] for r in records] == pytest.approx(seen["norms"], rel=1e-6)
    assert [r["lr"] for r in records] == seen["lrs"]
    assert {r["grad_norm_source"] for r in records} == {"clip"}
    assert {r["clip_max_norm"] for r in records} == {0.5}
    assert not any(r["skipped"] for r in records)
    assert all(r["rss"] > 0 for r in records)
    assert records[0]["uss"] > 0  # sampled at step 1, then every K steps
    assert records[1]["step_time_s"] > 0
    meta = RunDir.open(out).read_meta()
    assert meta["probes"]["watch"]["exit_code"] == 3
    assert meta["probes"]["watch"]["steps"] == 5


def test_grad_scaler_skip_is_a_record_with_the_scale_it_overflowed_at_and_unscaled_loss(tmp_path, script):
    out = tmp_path / "run"
    done = run_cli("watch", "--out", str(out), "--", str(script), "4", "fp16", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    records = steps_of(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the skipped step 2 is still a record
    assert [r["skipped"] for r in records] == [False, True, False, False]
    # The scale each step's loss was multiplied by: step 2 overflowed at 1024 (issue 13.4), then halved.
    assert [r["loss_scale"] for r in records] == [1024.0, 1024.0, 512.0, 512.0]
    assert [r["loss_scale_next"] for r in records] == [1024.0, 512.0, 512.0, 512.0]
    assert [r["loss"] for r in records] == seen["losses"]  # unscaled: what the script computed
    assert records[0]["grad_norm_source"] == "computed"  # the script does not clip
    assert records[0]["grad_norm"] == pytest.approx(seen["norms"][0], rel=1e-6)


def test_a_raising_script_keeps_its_records_and_exits_1(tmp_path, script):
    out = tmp_path / "run"
    done = run_cli("watch", "--out", str(out), "--", str(script), "10", "raise", cwd=tmp_path)
    assert done.returncode == 1
    assert "RuntimeError: the user's bug" in done.stderr
    assert [r["step"] for r in steps_of(out)] == [1, 2, 3]


def test_attach_api_records_and_restores_torch(tmp_path):
    import torch

    from ciuic_doctor import watch

    backward, clip = torch.autograd.backward, torch.nn.utils.clip_grad_norm_
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch.attach(out=tmp_path / "run") as session:
        assert watch.attach() is session  # a second attach joins the first
        session.close()
        for _ in range(3):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert watch.current() is None
    assert torch.autograd.backward is backward
    assert torch.nn.utils.clip_grad_norm_ is clip
    assert [r["step"] for r in steps_of(tmp_path / "run")] == [1, 2, 3]


def test_an_internal_error_stops_recording_not_training(tmp_path, monkeypatch, capsys):
    import torch

    from ciuic_doctor import watch
    from ciuic_doctor.probes.watch import records as probe_records

    calls = []

    def failing_rss():
        calls.append(1)
        if len(calls) > 2:
            raise OSError("disk gone")
        return 1

    monkeypatch.setattr(probe_records, "read_rss", failing_rss)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch.attach(out=tmp_path / "run"):
        for _ in range(5):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    assert len(calls) == 3  # steps 4 and 5 trained without recording
    assert "recording stopped after an internal error" in capsys.readouterr().err
    assert [r["step"] for r in steps_of(tmp_path / "run")] == [1, 2]


def test_records_wait_in_step_order_for_their_device_values():
    """The CUDA path's ordering logic, with stand-in events (there is no GPU here)."""
    from ciuic_doctor.probes.watch.values import MAX_PENDING, Pending, PendingQueue

    class Event:
        def __init__(self):
            self.done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    written = []
    queue = PendingQueue(finish=lambda p: written.append((p.record["step"], p.values()["loss"])))
    events = [Event() for _ in range(3)]
    for step, event in enumerate(events, start=1):
        queue.push(Pending(record={"step": step}, host=[([("loss", 1)], [float(step)])], events=[event]))
    events[1].done = True
    queue.drain()
    assert written == []  # step 2 is ready, but step 1 is not: order is kept
    events[0].done = True
    queue.drain()
    assert written == [(1, [1.0]), (2, [2.0])]
    for step in range(4, 4 + MAX_PENDING + 1):  # a backlog past the bound is waited for
        queue.push(Pending(record={"step": step}, host=[([("loss", 1)], [0.0])], events=[Event()]))
    assert len(written) > 2
    queue.flush()
    assert [step for step, _ in written] == list(range(1, 4 + MAX_PENDING + 1))


def test_watch_usage_errors_are_one_line(tmp_path, capsys):
    for argv in (
        ["watch"],
        ["watch", "--", str(tmp_path / "missing.py")],
        ["watch", "--", "-m", "no_such_mod_x"],
    ):
        assert main([*argv[:1], "--out", str(tmp_path / "r"), *argv[1:]]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ciuic-doctor watch: error:"), err


# ---- the embedded job under torchrun + watch ---------------------------------------------------------
@pytest.fixture(scope="module")
def job_under_watch(tmp_path_factory):
    """2 gloo ranks: rank 1 sleeps 150 ms before every forward and nudges its weights at step 3."""
    out = tmp_path_factory.mktemp("watch") / "run"
    done = torchrun(
        "watch", "--out", str(out), "--checksum-every", "4", "--",
        "-m", "ciuic_doctor.jobs.train", "--steps", "8", "--set", "dataloader.num_workers=1",
        "--inject", "desync=3", "--inject", "slow-rank=1:150",
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_job_under_torchrun_watch_writes_complete_records_for_both_ranks(job_under_watch):
    records = steps_of(job_under_watch)
    assert [(r["rank"], r["step"]) for r in records] == [(k, s) for k in (0, 1) for s in range(1, 9)]
    for rec in records:
        assert set(rec) >= set(RECORD_KEYS)
        assert math.isfinite(rec["loss"])
        assert rec["grad_norm_source"] == "clip"
        assert rec["rss"] > 0
        assert rec["step"] == 1 or rec["step_time_s"] > 0
    checks = [r["step"] for r in records if r["rank"] == 0 and r["weights_checksum"] is not None]
    assert checks == [1, 5]
    meta = RunDir.open(job_under_watch).read_meta()
    assert meta["spec"]["job"]["name"] == "deepseek-v3-tiny"  # the job wrote its spec into watch's run
    assert meta["probes"]["watch"]["status"] == "finished"


def test_desync_injection_is_found(job_under_watch):
    finding = check_rank_desync(RunDir.open(job_under_watch).read("steps").records)
    assert finding.verdict == "fail"
    assert finding.evidence["step"] == 5  # in sync at step 1, apart from the first check after step 3
    assert finding.evidence["ranks"] == [1]
    assert set(finding.evidence["checksums"]) == {"0", "1"}


def test_slow_rank_is_named_the_straggler(job_under_watch):
    finding = check_step_time(RunDir.open(job_under_watch).read("steps").records)
    assert finding.verdict == "warn", finding.summary
    assert finding.evidence["slowest_rank"] == 1
    assert finding.evidence["slowdown_pct"] > 10


# ---- the analysis on recorded data ---------------------------------------------------------------------
def _records(step_times, pre_backward, checksums=None):
    """Synthetic steps records: step_times[rank][i] for step i+1; checksums {step: {rank: value}}."""
    out = []
    for rank, times in enumerate(step_times):
        for i, value in enumerate(times):
            step = i + 1
            out.append(
                {
                    "rank": rank,
                    "step": step,
                    "step_time_s": value if step > 1 else None,
                    "pre_backward_s": pre_backward[rank][i] if step > 1 else None,
                    "weights_checksum": (checksums or {}).get(step, {}).get(rank),
                }
            )
    return out


def test_rank_desync_pass_fail_and_not_run():
    same = _records([[0.1] * 12] * 2, [[0.03] * 12] * 2, {1: {0: 5.0, 1: 5.0}, 11: {0: 7.25, 1: 7.25}})
    assert check_rank_desync(same).verdict == "pass"
    apart = _records([[0.1] * 12] * 2, [[0.03] * 12] * 2, {1: {0: 5.0, 1: 5.0}, 11: {0: 7.25, 1: 7.5}})
    finding = check_rank_desync(apart)
    assert finding.verdict == "fail"
    assert finding.where == {"step": 11, "rank": 1}
    assert finding.evidence["checksums"] == {"0": 7.25, "1": 7.5}
    nan = _records([[0.1] * 3] * 2, [[0.03] * 3] * 2, {1: {0: 5.0, 1: float("nan")}})
    assert check_rank_desync(nan).verdict == "fail"
    assert check_rank_desync(_records([[0.1] * 3], [[0.03] * 3])).verdict == "not_run"


def test_step_time_tells_a_straggler_from_noise():
    noisy = [[0.1 + 0.01 * ((i * 7) % 3) for i in range(20)] for _ in range(2)]
    fine = check_step_time(_records(noisy, [[0.03 + 0.003 * ((i * 5) % 4) for i in range(20)]] * 2))
    assert fine.verdict == "pass"
    assert set(fine.evidence["median_step_time_s"]) == {"0", "1"}
    slow = check_step_time(_records([[0.25] * 20] * 4, [[0.03] * 20, [0.03] * 20, [0.18] * 20, [0.03] * 20]))
    assert slow.verdict == "warn"
    assert slow.evidence["slowest_rank"] == 2
    assert slow.evidence["slowdown_pct"] == pytest.approx(150.0)  # 0.25 s steps: 0.15 s of waiting
    one = check_step_time(_records([[0.1] * 5], [[0.03] * 5]))
    assert one.verdict == "not_run"


def test_analyze_returns_both_checks(tmp_path):
    run = RunDir.create(tmp_path / "run")
    with run.writer("steps", rank=0, per_rank_file=True) as w:
        for rec in _records([[0.1] * 6], [[0.03] * 6]):
            w.write(rec)
    checks = {"rank_desync", "step_time", "straggler_onset", "slow_host", "stall", "intermittent"}
    assert {f.check for f in analyze(run)} == checks
    assert as_float(run.read("steps").records[1]["step_time_s"]) == 0.1


def test_module_in_the_current_directory_runs_through_the_console_script(tmp_path, script):
    """`ciuic-doctor watch -- -m mod` finds mod in the current directory, as `python -m mod` would. The
    console script's own sys.path[0] is its bin directory, so a check made there alone refused it."""
    console = Path(sys.executable).with_name("ciuic-doctor")
    out = tmp_path / "run"
    done = subprocess.run(
        [str(console), "watch", "--out", str(out), "--", "-m", script.stem, "3", "clip"],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in steps_of(out)] == [1, 2, 3]
