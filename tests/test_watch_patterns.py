"""`watch` on the training-loop patterns of real public scripts (issue 13), each script unchanged under
`ciuic-doctor watch` in a real process, its records compared with what the script itself saw:
LBFGS's closure, a two-optimizer GAN (dcgan's loop), gradient accumulation, `torch.multiprocessing.spawn`
(the DDP tutorial), a script that re-runs its own argv (Lightning devices=2's launcher), os.fork, a
second session into the same run, `watch -- dir/`, and a non-Python target."""

from __future__ import annotations

import json
import socket
import textwrap

import pytest
from conftest import run_cli

from ciuic_doctor.rundir.store import RunDir


def steps_of(path) -> list[dict]:
    records = RunDir.open(path).read("steps").records
    return sorted(records, key=lambda r: (r["rank"], r["step"], r["optimizer"]))


def write(tmp_path, name: str, body: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def last_json(stdout: str):
    return json.loads(stdout.strip().splitlines()[-1])


def watched(tmp_path, name: str, body: str):
    """Write the script, run it under `ciuic-doctor watch`; its last stdout line (JSON) and the records."""
    script = write(tmp_path, name, body)
    done = run_cli("watch", "--out", str(tmp_path / "run"), "--", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return last_json(done.stdout), steps_of(tmp_path / "run")


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


# ---- closures, several optimizers, accumulation ------------------------------------------------------
LBFGS = """
    import json, torch
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    seen = {"losses": [], "norms": [], "evaluations": []}
    for _ in range(4):
        calls = []
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            calls.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
            return loss
        seen["losses"].append(float(opt.step(closure)))  # LBFGS returns the first evaluation's loss
        seen["norms"].append(calls[0])  # the gradients the step's direction came from
        seen["evaluations"].append(len(calls))
    print(json.dumps(seen))
"""


def test_lbfgs_closure_records_what_step_returned_and_the_closures_gradients(tmp_path):
    seen, records = watched(tmp_path, "lbfgs.py", LBFGS)
    assert max(seen["evaluations"]) > 1  # the line search re-evaluated: those losses must not add up
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == pytest.approx(seen["losses"], rel=1e-6)
    assert [r["grad_norm"] for r in records] == pytest.approx(seen["norms"], rel=1e-6)
    assert {r["grad_norm_source"] for r in records} == {"computed"}
    assert [r["backward_calls"] for r in records] == seen["evaluations"]
    assert {(r["optimizer"], r["optimizer_class"]) for r in records} == {(0, "LBFGS")}


GAN = """
    import json, torch
    from torch import nn
    torch.manual_seed(0)
    netG, netD = nn.Linear(2, 4), nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4)  # dcgan creates D's optimizer first
    optimizerG = torch.optim.SGD(netG.parameters(), lr=1e-2)
    bce, ones, zeros = nn.BCELoss(), torch.ones(8, 1), torch.zeros(8, 1)
    seen = {"D": [], "G": []}
    for i in range(3):
        netD.zero_grad()
        errD_real = bce(netD(torch.randn(8, 4)), ones)
        errD_real.backward()
        fake = netG(torch.randn(8, 2))
        errD_fake = bce(netD(fake.detach()), zeros)
        errD_fake.backward()
        optimizerD.step()
        netG.zero_grad()
        errG = bce(netD(fake), ones)
        errG.backward()
        optimizerG.step()
        seen["D"].append((errD_real + errD_fake).item())  # what dcgan prints as Loss_D
        seen["G"].append(errG.item())
    print(json.dumps(seen))
"""


def test_two_optimizer_gan_records_each_optimizer_with_its_own_loss(tmp_path):
    seen, records = watched(tmp_path, "dcgan.py", GAN)
    d = [r for r in records if r["optimizer"] == 0]
    g = [r for r in records if r["optimizer"] == 1]
    assert [r["step"] for r in d] == [r["step"] for r in g] == [1, 2, 3]
    assert {r["optimizer_class"] for r in d} == {"Adam"}
    assert {r["optimizer_class"] for r in g} == {"SGD"}
    assert [r["loss"] for r in d] == pytest.approx(seen["D"], rel=1e-6)  # no Loss_G leaking in
    assert [r["loss"] for r in g] == pytest.approx(seen["G"], rel=1e-6)
    assert [r["backward_calls"] for r in d] == [2, 2, 2]
    assert [r["lr"] for r in d] == [2e-4] * 3
    assert [r["lr"] for r in g] == [1e-2] * 3


ACCUMULATE = """
    import json, sys, torch
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {"losses": [], "norms": []}
    for step in range(3):
        total = 0.0
        for micro in range(4):
            loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)) / 4
            loss.backward()
            total += loss.item()
        seen["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        seen["losses"].append(total)
    print(json.dumps(seen))
"""


def test_accumulation_and_a_second_session_continue_the_run_as_segment_two(tmp_path):
    script = write(tmp_path, "accumulate.py", ACCUMULATE)
    out = tmp_path / "run"
    truths = []
    for _ in range(2):  # watching again into the same run: steps 4..6, segment 2 (issue 13.6)
        done = run_cli("watch", "--out", str(out), "--", str(script), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        truths.append(last_json(done.stdout))
    records = steps_of(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["segment"] for r in records] == [1, 1, 1, 2, 2, 2]
    assert [r["loss"] for r in records] == pytest.approx(truths[0]["losses"] + truths[1]["losses"], rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx(
        truths[0]["norms"] + truths[1]["norms"], rel=1e-6
    )
    assert {r["backward_calls"] for r in records} == {4}
    assert RunDir.open(out).read_meta()["probes"]["watch"]["segment"] == 2


# ---- processes the script starts ---------------------------------------------------------------------
SPAWN = """
    import json, os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel as DDP

    def main(rank, world_size, port, out):  # the DDP tutorial's multigpu.py, on gloo
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(4):
            opt.zero_grad()
            loss = model(torch.randn(16, 8) + rank).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with open(os.path.join(out, f"truth{rank}.json"), "w") as fh:
            json.dump(losses, fh)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(main, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
"""


@pytest.mark.slow
def test_mp_spawn_ranks_record_their_own_streams(tmp_path):
    script = write(tmp_path, "multigpu.py", SPAWN)
    out = tmp_path / "run"
    done = run_cli("watch", "--out", str(out), "--", str(script), free_port(), str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = steps_of(out)
    assert [(r["rank"], r["step"]) for r in records] == [(k, s) for k in (0, 1) for s in (1, 2, 3, 4)]
    for rank in (0, 1):
        truth = json.loads((tmp_path / f"truth{rank}.json").read_text())
        assert [r["loss"] for r in records if r["rank"] == rank] == pytest.approx(truth, rel=1e-6)
    step1 = [r for r in records if r["step"] == 1]
    assert all(r["weights_checksum"] is not None and r["desync_ranks"] == [] for r in step1)
    watch = RunDir.open(out).read_meta()["probes"]["watch"]
    assert (watch["status"], watch["children"], watch["steps_all_processes"]) == ("finished", 2, 8)
    assert "2 process(es) the script started recorded their steps" in done.stderr
    assert "(rank 0: 4, rank 1: 4 step records this run)" in done.stderr  # what each rank's file holds


RERUN = """
    import json, os, subprocess, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    out, port = sys.argv[1], sys.argv[2]
    child = None
    if "LOCAL_RANK" not in os.environ:  # Lightning's _SubprocessScriptLauncher, reduced to its core
        env = {**os.environ, "LOCAL_RANK": "1", "RANK": "1"}
        child = subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0])] + sys.argv[1:], env=env)
    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(16, 8) * (rank + 1)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with open(os.path.join(out, f"truth{rank}.json"), "w") as fh:
        json.dump(losses, fh)
    dist.destroy_process_group()
    if child is not None:
        sys.exit(child.wait())
"""


@pytest.mark.slow
def test_a_script_that_reruns_its_argv_gets_every_rank_recorded(tmp_path):
    script = write(tmp_path, "rerun.py", RERUN)
    out = tmp_path / "run"
    done = run_cli("watch", "--out", str(out), "--", str(script), str(tmp_path), free_port(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = steps_of(out)
    assert [(r["rank"], r["step"]) for r in records] == [(k, s) for k in (0, 1) for s in (1, 2, 3)]
    for rank in (0, 1):
        truth = json.loads((tmp_path / f"truth{rank}.json").read_text())
        assert [r["loss"] for r in records if r["rank"] == rank] == pytest.approx(truth, rel=1e-6)
    assert all(r["weights_checksum"] is not None for r in records if r["step"] == 1)
    assert RunDir.open(out).read_meta()["probes"]["watch"]["status"] == "finished"


@pytest.mark.slow
def test_an_unwatched_rank_makes_watch_skip_the_checksum_not_hang(tmp_path):
    """--no-follow leaves rank 1 unwatched: rank 0's step-1 all_gather would wait forever (issue 13.3).
    run_cli's timeout fails the test if it hangs."""
    script = write(tmp_path, "rerun.py", RERUN)
    out = tmp_path / "run"
    done = run_cli(
        "watch", "--out", str(out), "--agree-timeout", "3", "--no-follow", "--",
        str(script), str(tmp_path), free_port(), cwd=tmp_path, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = steps_of(out)
    assert [(r["rank"], r["step"]) for r in records] == [(0, 1), (0, 2), (0, 3)]
    assert all(r["weights_checksum"] is None for r in records)
    watch = RunDir.open(out).read_meta()["probes"]["watch"]
    assert "checksum skipped: rank(s) [1] not watched" in watch["checksum"]
    assert "checksum skipped" in done.stderr


FORK = """
    import json, os, torch
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def train(n):
        for _ in range(n):
            model(torch.ones(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    train(3)
    pid = os.fork()
    if pid == 0:  # the child trains too: its steps are not the parent's
        train(2)
        os._exit(0)
    os.waitpid(pid, 0)
    train(2)
    print(json.dumps({"parent_steps": 5}))
"""


def test_a_forked_child_never_writes_into_the_parents_stream(tmp_path):
    seen, records = watched(tmp_path, "fork.py", FORK)
    assert [r["step"] for r in records] == list(range(1, seen["parent_steps"] + 1))


# ---- targets -----------------------------------------------------------------------------------------
def test_a_directory_with_main_runs_as_python_dir_would(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "helper.py").write_text("STEPS = 2\n")  # python dir/ puts dir on sys.path
    write(
        project,
        "__main__.py",
        "import helper\n" + textwrap.dedent(FORK.split("train(3)", maxsplit=1)[0]) + "train(helper.STEPS)\n",
    )
    done = run_cli("watch", "--out", str(tmp_path / "run"), "--", str(project), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in steps_of(tmp_path / "run")] == [1, 2]


@pytest.mark.parametrize("target", ["/bin/ls", "empty_dir"])
def test_a_target_python_cannot_run_is_refused_in_one_line(tmp_path, target):
    if target == "empty_dir":
        (tmp_path / target).mkdir()
    done = run_cli("watch", "--out", str(tmp_path / "run"), "--", target, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "not a Python script" in done.stderr or "without __main__.py" in done.stderr


def test_a_script_that_steps_no_optimizer_says_so(tmp_path):
    script = write(tmp_path, "noop.py", "print('hello')\n")
    done = run_cli("watch", "--out", str(tmp_path / "run"), "--", str(script), cwd=tmp_path)
    assert done.returncode == 0
    assert "no optimizer step was seen" in done.stderr
    assert RunDir.open(tmp_path / "run").read_meta()["probes"]["watch"]["status"] == "finished"


# ---- however the process ends, meta.json says how ----------------------------------------------------
ENDINGS = """
    import os, sys, time, torch
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    print("trained", flush=True)
    if sys.argv[1] == "os_exit":
        os._exit(3)
    time.sleep(120)  # blocked in C, as a rank in a collective is: SIGTERM must still end it
"""


@pytest.mark.parametrize("ending", ["os_exit", "sigterm"])
def test_meta_says_how_the_job_ended_even_past_every_finally(tmp_path, ending):
    import os
    import signal
    import subprocess
    import sys

    script = write(tmp_path, "endings.py", ENDINGS)
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "ciuic_doctor", "watch", "--out", str(out), "--", str(script), ending]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "trained"
        if ending == "sigterm":
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    watch = RunDir.open(out).read_meta()["probes"]["watch"]
    if ending == "os_exit":
        assert (code, watch["status"], watch["exit_code"]) == (3, "exited", 3)
    else:
        assert (code, watch["status"], watch["exit_code"]) == (143, "killed", 143)
    assert watch["steps"] == 2
    assert [r["step"] for r in steps_of(out)] == [1, 2]


def test_a_script_with_a_process_group_keeps_its_unclosed_files(tmp_path):
    """A script that made a process group ends through os._exit (gloo's teardown can abort the process
    after watch's checksum all_gather). A file an imported module holds open lives until interpreter
    teardown, which os._exit skips: its buffered lines must still reach the disk."""
    write(tmp_path, "logsink.py", 'LOG = open("train.log", "w")  # module-level, never closed\n')
    port = free_port()
    _, steps = watched(
        tmp_path,
        "group.py",
        f"""
        import json, torch, torch.distributed as dist
        import logsink
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            logsink.LOG.write(f"step {{step}} loss {{loss.item():.4f}}\\n")
        print(json.dumps({{"done": True}}))
        """,
    )
    assert len(steps) == 3
    assert (tmp_path / "train.log").read_text().count("\n") == 3
