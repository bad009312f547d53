"""No false word about a healthy job: small real scripts that public training code resembles, under watch.

Each class of wrong verdict seen on public scripts (pytorch/examples dcgan, time_sequence_prediction,
word_language_model, the DDP tutorial's mp.spawn multigpu.py, nanoGPT under checkup) has a script here
of the same shape, written by the test, run for real, and judged: a long evaluation after training, a
pause, an mp.spawn DDP job, a loss of exactly 0, a GAN whose generator loss rises, LBFGS, memory that
grows before the first step and not after, a warning raised inside a wrapped constructor.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ciuic_doctor.analysis.hang import user_frame
from ciuic_doctor.jobs.observed import merge_ranks
from ciuic_doctor.rundir.store import RunDir
from tests.conftest import run_cli

TIMEOUT_S = 240  # seconds alone; generous for a loaded 2-core machine


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def watch(tmp_path: Path, path: Path, *args: str, options: tuple[str, ...] = ()) -> tuple[Path, str]:
    out = tmp_path / f"run-{path.stem}"
    done = run_cli("watch", "--out", str(out), *options, "--", str(path), *args, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stderr


def findings(run: Path) -> dict[str, list[dict]]:
    done = run_cli("analyze", str(run), timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((run / "findings.json").read_text())
    out: dict[str, list[dict]] = {}
    for f in data["findings"]:
        out.setdefault(f"{f['probe']}/{f['check']}", []).append(f)
    return out


def observed(run: Path) -> dict:
    return json.loads((run / "meta.json").read_text())["observed"]


AFTER_TRAINING = """\
    import sys, time, torch
    m = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(5):
        loss = m(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    end = time.monotonic() + float(sys.argv[2])
    if sys.argv[1] == "eval":  # a long evaluation: busy, its stack moving
        with torch.no_grad():
            while time.monotonic() < end:
                m(torch.randn(256, 64)).sum().item()
    else:  # a pause that does nothing
        time.sleep(float(sys.argv[2]))
"""


def test_a_long_evaluation_after_training_is_not_a_hang(tmp_path):
    path = script(tmp_path, "train_then_eval.py", AFTER_TRAINING)
    run, stderr = watch(tmp_path, path, "eval", "6", options=("--hang-after", "1.5"))
    assert not (run / "hang.rank0.json").exists(), stderr  # 4x hang-after of evaluation: no dump at all
    assert "hang dump" not in stderr
    assert findings(run)["hang/hang"][0]["verdict"] == "pass"


def test_a_pause_is_dumped_once_never_overwritten_and_hang_run_says_the_run_finished(tmp_path):
    path = script(tmp_path, "train_then_pause.py", AFTER_TRAINING)
    run, _ = watch(tmp_path, path, "sleep", "5", options=("--hang-after", "1.5"))
    dumps = sorted(p.name for p in run.glob("hang.rank*") if "armed" not in p.name)
    assert dumps == [  # one dump; none while watch closed (it would have moved this one aside)
        "hang.rank0.fatal.txt",
        "hang.rank0.json",
        "hang.rank0.last.json",
        "hang.rank0.stacks.txt",
    ], dumps
    dump = json.loads((run / "hang.rank0.json").read_text())
    assert (dump["reason"], dump["main_thread_moving"]) == ("no-progress", False)
    assert dump["resumed_t"]  # the script went on and exited 0: a pause
    done = run_cli("hang", str(run), timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    first, table = done.stdout.splitlines()[0], done.stdout
    assert first == "the run finished (exit 0)."
    assert "PASS" in table
    assert "no hang: the run finished (exit 0)" in table
    assert "train_then_pause.py:13" in table  # the script's own frame (time.sleep), not ciuic-doctor's
    assert "bin/ciuic-doctor" not in table
    assert "FAIL" not in table


def test_watch_frames_are_never_the_culprit_frame():
    frames = [
        {"file": "/usr/lib/python3.11/threading.py", "line": 320, "function": "wait"},
        {"file": "/venv/lib/python3.11/site-packages/ciuic_doctor/watch.py", "line": 9, "function": "close"},
        {"file": "/venv/bin/ciuic-doctor", "line": 8, "function": "<module>"},
    ]
    assert user_frame(frames) is None
    assert user_frame([{"file": "/work/train.py", "line": 3, "function": "main"}, *frames])["line"] == 3


MP_SPAWN_DDP = """\
    import os, torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    def main(rank, world_size):
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", os.environ["TEST_PORT"]
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(main, args=(2,), nprocs=2)
"""


def test_an_mp_spawn_ddp_script_is_observed_on_every_rank(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("TEST_PORT", str(s.getsockname()[1]))
    path = script(tmp_path, "spawn_ddp.py", MP_SPAWN_DDP)
    run, stderr = watch(tmp_path, path)
    seen = observed(run)
    assert seen["job"]["name"] == "spawn_ddp.py"  # never "ciuic-doctor"
    assert seen["job"]["steps_recorded"] == 8  # 256 / 2 ranks / 16
    assert seen["batch"] == {"per_process": 16, "grad_accum": 1}
    assert (seen["optim"]["class"], seen["optim"]["momentum"]) == ("SGD", 0.9)
    assert seen["dataloader"]["sampler"] == "DistributedSampler"
    assert seen["distributed"]["world_size"] == 2
    assert (run / "observed.rank1.json").is_file()
    merged = merge_ranks(run, RunDir.open(run).read_meta())["observed"]["ranks"]
    assert merged == {"recorded": [0, 1], "disagree": {}}
    for rank in (0, 1):  # each rank armed its own watchdog, in the group's world
        armed = json.loads((run / f"hang.rank{rank}.armed.json").read_text())
        assert (armed["rank"], armed["world_size"]) == (rank, 2)
    assert "rank 0: 8, rank 1: 8 step records" in stderr
    meta = json.loads((run / "meta.json").read_text())["probes"]["watch"]
    assert (meta["status"], meta["steps"], meta["steps_all_processes"]) == ("finished", 8, 16)
    assert "armed on 2 ranks" in findings(run)["hang/hang"][0]["summary"]


def test_a_loss_and_grad_norm_of_exactly_zero_are_values(tmp_path):
    path = script(
        tmp_path,
        "zero_loss.py",
        """\
        import torch
        m = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(24):
            loss = (m(torch.randn(8, 4)) * 0.0).sum()
            opt.zero_grad(); loss.backward(); opt.step()
        """,
    )
    run, _ = watch(tmp_path, path)
    found = findings(run)
    assert found["stability/loss_spike"][0]["summary"] == "no loss spike in 24 logged points"
    assert found["stability/divergence"][0]["verdict"] == "pass"
    gradients = found["stability/gradients"][0]
    assert gradients["verdict"] == "warn"
    assert "exactly 0 on all 24 logged steps" in gradients["summary"]


GAN = """\
    import torch
    torch.manual_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    D = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optD = torch.optim.Adam(D.parameters(), lr=1e-2)
    optG = torch.optim.Adam(G.parameters(), lr=1e-4)  # a weak generator: D wins, G's loss rises
    bce = torch.nn.BCEWithLogitsLoss()
    for step in range(60):
        real, fake = torch.randn(32, 2) * 0.5 + 2.0, G(torch.randn(32, 4))
        optD.zero_grad()
        errD_real = bce(D(real), torch.ones(32, 1)); errD_real.backward()
        errD_fake = bce(D(fake.detach()), torch.zeros(32, 1)); errD_fake.backward()
        optD.step()
        optG.zero_grad()
        errG = bce(D(fake), torch.ones(32, 1)); errG.backward()
        optG.step()
"""


def test_a_gan_whose_generator_loss_rises_is_not_called_divergent(tmp_path):
    run, _ = watch(tmp_path, script(tmp_path, "gan.py", GAN))
    seen = observed(run)
    assert seen["optim"]["coupled_optimizers"] == [[1, 0]]  # G's loss goes through D's parameters
    assert seen["batch"]["grad_accum"] == 1  # D's real + fake backward pair is one step, not 2 micro-batches
    steps = RunDir.open(run).read("steps").records
    g_loss = [r["loss"] for r in steps if r["optimizer"] == 1]
    assert sum(g_loss[-10:]) / 10 > 1.5 * min(g_loss)  # the level really rises
    found = findings(run)
    assert found["stability/divergence"][0]["verdict"] == "pass"
    assert "adversarial" in found["stability/divergence"][0]["summary"]
    assert not [f for fs in found.values() for f in fs if f["verdict"] == "fail"]


def test_lbfgs_is_observed_as_lbfgs_and_its_recommended_toml_invents_no_adamw(tmp_path):
    path = script(
        tmp_path,
        "lbfgs.py",
        """\
        import torch
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 1).double()
        x, y = torch.randn(64, 8).double(), torch.randn(64, 1).double()
        opt = torch.optim.LBFGS(m.parameters(), lr=0.8, max_iter=20)
        for i in range(6):
            def closure():
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(m(x), y)
                loss.backward()
                return loss
            opt.step(closure)
        """,
    )
    run, _ = watch(tmp_path, path)
    steps = RunDir.open(run).read("steps").records
    assert max(r["backward_calls"] for r in steps) > 1  # the line search re-evaluated the closure ...
    optim = observed(run)["optim"]
    assert observed(run)["batch"]["grad_accum"] == 1  # ... which is not gradient accumulation
    assert optim["class"] == "LBFGS"
    assert "name" not in optim
    assert optim["hyper_parameters"]["max_iter"] == 20
    assert optim["hyper_parameters"]["history_size"] == 100
    assert optim["lr_constructed"] == 0.8
    done = run_cli("report", str(run), timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    import tomllib

    optim_toml = tomllib.loads((run / "recommended.toml").read_text())["optim"]
    assert "name" not in optim_toml  # no "adamw" for an LBFGS job ...
    assert "betas" not in optim_toml  # ... nor AdamW's betas
    assert optim_toml["base_lr"] == 0.8


def test_memory_that_grows_before_the_first_step_is_not_a_leak(tmp_path):
    path = script(
        tmp_path,
        "grow_then_train.py",
        """\
        import time, torch
        held = []
        for i in range(12):  # start-up: 12 x 16 MiB over ~3 s (imports, a dataset, a model)
            held.append(bytearray(16 << 20)); time.sleep(0.25)
        torch.manual_seed(0)
        m = torch.nn.Linear(16, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        x = torch.randn(8, 16)  # one batch, a smoothly falling loss (12 noisy points can read as divergence)
        for step in range(12):  # then flat
            loss = m(x).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            time.sleep(0.25)
        """,
    )
    out = tmp_path / "run-memory"
    command = [sys.executable, "-m", "ciuic_doctor", "watch", "--out", str(out), "--", str(path)]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "meta.json").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    memwatch = run_cli("memwatch", "--pid", str(job.pid), "--interval", "0.5", "--out", str(out), "--force",
                       timeout=TIMEOUT_S)  # fmt: skip
    assert job.wait(timeout=TIMEOUT_S) == 0, job.stderr.read() if job.stderr else ""
    assert memwatch.returncode == 0, memwatch.stderr[-2000:]
    samples = RunDir.open(out).read("memwatch").records
    first_step_t = min(r["t"] for r in RunDir.open(out).read("steps").records)
    assert sum(s["t"] < first_step_t for s in samples) >= 3  # memwatch did see the start-up growth
    leaks = findings(out)["memory/memory_leak"]
    host = [f for f in leaks if f["evidence"].get("kind") == "host" or "host" in f["summary"]]
    assert host
    assert all(f["verdict"] != "fail" for f in host), host


def test_a_warning_inside_a_wrapped_constructor_keeps_the_scripts_line(tmp_path):
    path = script(
        tmp_path,
        "warns.py",
        """\
        import torch
        scaler = torch.amp.GradScaler("cuda")  # no CUDA here: torch warns with stacklevel=2
        m = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.randn(4, 2)).sum().backward(); opt.step()
        """,
    )
    _, stderr = watch(tmp_path, path)
    assert "warns.py:2: UserWarning: torch.cuda.amp.GradScaler is enabled" in stderr
    assert "observe.py" not in stderr
    assert "hooks.py" not in stderr


@pytest.mark.slow
def test_torchrun_and_watch_cause_no_reduce_op_deprecation_warning(tmp_path):
    from tests.conftest import torchrun

    path = script(
        tmp_path,
        "ddp.py",
        """\
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(3):
            loss = m(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        dist.destroy_process_group()
        """,
    )
    done = torchrun("watch", "--out", str(tmp_path / "run"), "--", str(path), timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reduce_op" not in done.stderr + done.stdout
