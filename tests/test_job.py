"""The embedded DeepSeek-V3 job: real training processes with real faults injected, real checkpoints."""

from __future__ import annotations

import contextlib
import doctest
import importlib
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys

import pytest
from conftest import run_cli

from ciuic_doctor.cli import main
from ciuic_doctor.errors import UserError
from ciuic_doctor.jobs.inject import parse_injections
from ciuic_doctor.rundir.store import RunDir, as_float

FAST = ("--set", "dataloader.num_workers=0", "--set", "checkpoint.every_steps=0")


def steps_of(path) -> list[dict]:
    return RunDir.open(path).read("steps").records


@pytest.mark.parametrize(
    "name",
    [
        "ciuic_doctor.jobs.data",
        "ciuic_doctor.jobs.inject",
        "ciuic_doctor.jobs.train",
        "ciuic_doctor.jobs.progress",
    ],
)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0
    assert result.failed == 0


# ---- fault injection and data, in-process ----------------------------------------------------------
def test_parse_injections_reads_every_kind():
    inj = parse_injections(["leak=2.5", "spike=7:30,overflow=4:3", "slow-rank=1:50", "desync=5"])
    assert inj.leak_mb_per_step == 2.5
    assert inj.lr_factor(7) == 30.0
    assert inj.lr_factor(8) == 1.0
    assert inj.overflow_steps == {4, 5, 6}
    assert inj.slow_ranks == {1: 50.0}
    assert inj.desync_step == 5


@pytest.mark.parametrize(
    "text",
    ["leak", "leak=-1", "spike=3", "spike=x:2", "overflow=0", "slow-rank=a:10", "slow-rank=-1:5", "boom=1"],
)
def test_parse_injections_rejects_malformed(text):
    with pytest.raises(UserError, match="--inject"):
        parse_injections([text])


def test_injections_that_cannot_run_are_refused_before_training():
    with pytest.raises(UserError, match="fp16"):
        parse_injections(["overflow=3"]).check(world=1, precision="fp32")
    with pytest.raises(UserError, match="2 ranks"):
        parse_injections(["desync=3"]).check(world=1, precision="fp32")


def test_dataset_is_a_function_of_seed_and_index_and_the_sampler_resumes_mid_epoch():
    import torch

    from ciuic_doctor.jobs.data import SyntheticTokenDataset, make_loader
    from ciuic_doctor.jobs.spec import load_spec, with_updates

    a = SyntheticTokenDataset(vocab_size=64, seq_len=16, num_samples=32, seed=3)
    b = SyntheticTokenDataset(vocab_size=64, seq_len=16, num_samples=32, seed=3)
    assert torch.equal(a[5], b[5])
    assert not torch.equal(a[5], a[6])
    spec = with_updates(load_spec(), {"dataloader.num_workers": 0})
    loader, sampler = make_loader(spec, rank=1, world=2)
    sampler.set_epoch(2)
    full = list(loader)
    sampler.set_position(2, 3 * spec.batch.per_process)
    resumed = list(loader)
    assert len(resumed) == len(full) - 3
    assert torch.equal(resumed[0], full[3])
    _, other_sampler = make_loader(spec, rank=0, world=2)
    other_sampler.set_epoch(2)
    assert not set(sampler) & set(other_sampler)  # the ranks see disjoint samples


def test_bad_job_input_is_one_line_and_exit_2(tmp_path, capsys):
    cases = [
        ["job", "--inject", "boom=1"],
        ["job", "--nproc", "1", "--inject", "overflow=3"],
        ["job", "--set", "batch.nope=1"],
        ["job", "--set", "novalue"],
        ["job", "--nproc", "1", "--resume", str(tmp_path / "missing.pt")],
        ["job", "--spec", str(tmp_path / "missing.toml")],
        ["job", "--nproc", "2", "--set", "model.hiden_size=64"],  # refused before any rank starts
        ["job", "--nproc", "2", "--resume", str(tmp_path)],
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("ciuic-doctor job: error:"), err
        assert "Traceback" not in err


# ---- real training runs ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp16_leaky_run(tmp_path_factory):
    """One fp16 run: two overflowing steps (the GradScaler skips for real), a 16 MB/step leak, an LR spike."""
    out = tmp_path_factory.mktemp("job") / "run"
    done = run_cli(
        "job", "--nproc", "1", "--steps", "7", "--out", str(out), "--precision", "fp16",
        "--inject", "overflow=3:2", "--inject", "leak=16", "--inject", "spike=6:1000", *FAST, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out, done


def test_a_finished_job_closes_its_watch_record(fp16_leaky_run):
    """meta.json said watch `running` after a finished job (issue 22): the job ends that record too."""
    out, _ = fp16_leaky_run
    watch = json.loads((out / "meta.json").read_text())["probes"]["watch"]
    assert watch["status"] == "finished", watch


def test_overflow_skips_steps_and_halves_the_scale(fp16_leaky_run):
    out, done = fp16_leaky_run
    records = {r["step"]: r for r in steps_of(out)}
    assert sorted(records) == list(range(1, 8))
    assert [records[s]["skipped"] for s in range(1, 8)] == [False, False, True, True, False, False, False]
    scale_before = records[2]["loss_scale"]
    # loss_scale: the scale the step used (it overflowed at it); loss_scale_next: what update() set.
    assert [records[s]["loss_scale"] for s in (3, 4, 5)] == [scale_before, scale_before / 2, scale_before / 4]
    halved = [scale_before / 2, scale_before / 4, scale_before / 4]
    assert [records[s]["loss_scale_next"] for s in (3, 4, 5)] == halved
    assert math.isinf(as_float(records[3]["grad_norm"]))
    assert all(math.isfinite(records[s]["loss"]) for s in records)  # the loss itself was fine
    assert "SKIPPED (scale now" in done.stdout
    meta = RunDir.open(out).read_meta()
    assert meta["spec"]["precision"]["mode"] == "fp16"
    assert meta["job_run"]["injections"]["overflow_steps"] == [3, 4]


def test_leak_shows_as_growing_rss(fp16_leaky_run):
    out, _ = fp16_leaky_run
    rss = [r["rss"] for r in sorted(steps_of(out), key=lambda r: r["step"])]
    growth_mb = [(b - a) / 2**20 for a, b in itertools.pairwise(rss[2:])]
    # 16 MB a step after the warm-up. One step's RSS delta also carries the allocator returning or
    # reusing activation pages (seen on a fresh clone: 11, 21, 9.5, 24 MB), so judge the mean.
    assert all(g > 0 for g in growth_mb), growth_mb
    assert 12 < statistics.mean(growth_mb) < 20, growth_mb


def test_spike_multiplies_the_lr_of_one_step(fp16_leaky_run):
    out, _ = fp16_leaky_run
    lr = {r["step"]: r["lr"] for r in steps_of(out)}
    assert lr[6] > 10 * max(lr[5], lr[7])  # x1000 on the scheduled LR, for step 6 only
    assert lr[7] < lr[5]  # the schedule goes on as before


def test_sigkill_keeps_every_finished_step(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    argv = ["job", "--nproc", "1", "--steps", "500", "--out", str(out), *FAST]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ciuic_doctor", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    try:
        seen = None
        for line in proc.stdout:  # a printed step is a step already written
            if line.startswith("step 3/"):
                seen = 3
                break
        assert seen == 3, "the job never reached step 3"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    read = RunDir.open(out).read("steps")
    steps = [r["step"] for r in read.records]
    assert read.skipped_lines == 0
    assert len(steps) >= 3
    assert steps == list(range(1, len(steps) + 1))
    assert all(math.isfinite(r["loss"]) for r in read.records)


def test_resume_continues_with_the_same_loss_bit_for_bit(tmp_path):
    """Two ranks, fp16 + GradScaler, a DataLoader worker: resume at step 3 equals the run that went on."""
    common = (
        "job", "--nproc", "2", "--steps", "5", "--precision", "fp16",
        "--set", "checkpoint.every_steps=3", "--set", "dataloader.num_workers=1",
    )  # fmt: skip
    first = run_cli(*common, "--out", str(tmp_path / "a"), timeout=300)
    assert first.returncode == 0, first.stderr
    checkpoint = tmp_path / "a" / "checkpoints" / "step000003.pt"
    assert checkpoint.is_file()
    second = run_cli(*common, "--out", str(tmp_path / "b"), "--resume", str(checkpoint), timeout=300)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout

    def by_key(path):
        return {
            (r["rank"], r["step"]): (r["loss"], r["lr"], r["grad_norm"], r["loss_scale"])
            for r in steps_of(path)
        }

    a, b = by_key(tmp_path / "a"), by_key(tmp_path / "b")
    assert sorted(b) == [(rank, step) for rank in (0, 1) for step in (4, 5)]
    for key, values in b.items():
        assert values == a[key], key


@pytest.mark.parametrize("persistent", [False, True])
def test_epochs_roll_over_with_worker_processes_stopped_or_reused(persistent, monkeypatch):
    """Past an epoch's end the next batch comes from the next epoch. Without persistent_workers the old
    workers are stopped before new ones are forked, so worker processes never pile up; with it, the
    same workers serve every epoch."""
    import psutil

    from ciuic_doctor.jobs import data, train
    from ciuic_doctor.jobs.inject import Injections
    from ciuic_doctor.jobs.spec import load_spec, with_updates

    def small_loader(spec, rank, world):  # 32 samples: an epoch is 4 steps of 8 on one rank
        return data.make_loader(spec, rank, world, dataset=data.dataset_from_spec(spec, num_samples=32))

    monkeypatch.setattr(train, "make_loader", small_loader)
    spec = with_updates(
        load_spec(), {"dataloader.num_workers": 1, "dataloader.persistent_workers": persistent}
    )
    trainer = train.Trainer(spec, train.World(), total_steps=10, injections=Injections())

    def workers() -> list[int]:  # live descendants, less multiprocessing's forkserver and resource tracker
        me, found = psutil.Process(), []
        helpers = {c.pid for c in me.children() if "multiprocessing." in " ".join(c.cmdline())}
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.pid not in helpers and child.status() != psutil.STATUS_ZOMBIE:
                    found.append(child.pid)
        return found

    workers_seen: set[int] = set()
    try:
        for _ in range(10):  # 2.5 epochs: two roll-overs
            trainer.train_step()
            alive = workers()
            assert len(alive) == 1, alive  # one worker at a time
            workers_seen.update(alive)
        assert trainer.data_position() == (2, 2 * 8)
    finally:
        trainer.close()
    assert len(workers_seen) == (1 if persistent else 3)
    assert set(workers()) & workers_seen == set()  # close() stopped them
