"""Discovery on real process trees that are not torchrun's: a script that starts its ranks with
torch.multiprocessing.spawn, each with a DataLoader worker, unwatched (no run directory, no RANK in the
environment); and the one-line errors of top/export for a wrong target."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.test_live_down import _exporters_of
from tests.test_live_job import CLI, top_once, wait_for

SPAWN_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    import torch.multiprocessing as mp
    from torch.utils.data import DataLoader, TensorDataset

    def rank_main(rank, world, ready):
        data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
        loader = DataLoader(data, batch_size=64, num_workers=1, persistent_workers=True)
        model = torch.nn.Linear(16, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        while True:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                open(ready + str(rank), "w").close()
                time.sleep(0.005)

    if __name__ == "__main__":
        torch.set_num_threads(1)
        mp.spawn(rank_main, args=(2, sys.argv[1]), nprocs=2)
    """
)


@pytest.mark.slow
def test_mp_spawn_ranks_and_their_dataloader_workers_are_found(tmp_path: Path) -> None:
    script = tmp_path / "spawn_train.py"
    script.write_text(SPAWN_SCRIPT)
    ready = str(tmp_path / "ready.")
    proc = subprocess.Popen([sys.executable, str(script), ready], start_new_session=True)
    try:
        wait_for("both ranks training", lambda: all(os.path.exists(ready + r) for r in "01"), timeout_s=120)
        ranks = [
            c for c in psutil.Process(proc.pid).children() if "multiprocessing" in " ".join(c.cmdline())
            and "resource_tracker" not in " ".join(c.cmdline())
        ]  # fmt: skip
        ranks.sort(key=lambda c: c.create_time())
        text = top_once("--pid", str(ranks[1].pid), "--interval", "0.5")  # a rank's PID finds the job
        assert "script spawn_train.py" in text
        assert "ranks here 2" in text
        lines = {
            line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])
        }
        assert lines["0"][1] == str(ranks[0].pid), text
        assert lines["1"][1] == str(ranks[1].pid), text
        for words in lines.values():
            assert words[9].startswith("1/"), text  # WKR: one DataLoader worker each, with its CPU %
            assert words[3] == "ok"
            assert words[12] == "-"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["top", "--once", "--pid", "999999999"], "no process with PID 999999999"),
        (["top", "--once"], "give a running job's PID"),
        (["top", "--once", "/nonexistent/run"], "/nonexistent/run: not a directory"),
        (["export", "--port", "9464"], "export needs the running job's PID"),
        (["top", "--once", "--pid", "1", "/tmp"], "one of them"),
    ],
)
def test_a_wrong_target_is_one_line_and_exit_2(argv: list[str], said: str) -> None:
    done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_idle_run_directory_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([*CLI, "top", "--once", str(tmp_path)], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "no running process is writing" in done.stderr


def test_help_and_top_import_no_torch() -> None:
    code = (
        "import sys\n"
        "from ciuic_doctor.cli import build_parser\n"
        "build_parser()\n"
        "import ciuic_doctor.commands.top, ciuic_doctor.commands.export\n"
        "import ciuic_doctor.live.view, ciuic_doctor.live.render, ciuic_doctor.live.metrics\n"
        "import ciuic_doctor.live.top_app\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


WATCHED_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    while not os.path.exists(sys.argv[1]):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.02)
    """
)


def _metrics(port: int) -> str:
    import urllib.request

    with (
        contextlib.suppress(OSError),
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r,
    ):
        return r.read().decode()
    return ""


@pytest.mark.slow
def test_watch_metrics_port_serves_the_watched_script_and_ends_with_it(tmp_path: Path) -> None:
    from tests.test_live_job import free_port

    script, stop, port = tmp_path / "loop.py", tmp_path / "stop", free_port()
    script.write_text(WATCHED_SCRIPT)
    proc = subprocess.Popen(
        [*CLI, "watch", "--metrics-port", str(port), "--out", str(tmp_path / "run"), "--", str(script),
         str(stop)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        text = wait_for(
            "the watched script's steps on the endpoint",
            lambda: 'ciuic_rank_steps_total{gpu="",host=' in (t := _metrics(port)) and t,
            timeout_s=120,
            every_s=0.5,
        )
        line = next(x for x in text.splitlines() if x.startswith("ciuic_rank_steps_total{"))
        assert 'rank="0"' in line
        assert float(line.split()[-1]) >= 1
        assert f'job="{tmp_path.name}"' not in line  # the run directory's name is "run"
        assert 'job="run"' in line
        workers = re.search(r'^ciuic_rank_workers\{[^}]*rank="0"[^}]*\} (\S+)$', text, re.M)
        assert workers, text
        assert float(workers.group(1)) == 0, text  # no DataLoader: watch's sentinel is no worker
    finally:
        stop.touch()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    try:  # after the job, its final state: the rank down, the run's clean end recorded
        done = 'ciuic_job_finished{job="run"} 1.0'
        final = wait_for("the final state", lambda: done in (t := _metrics(port)) and t, timeout_s=30)
        assert re.search(r'ciuic_rank_up\{[^}]*rank="0"[^}]*\} 0\.0', final), final
        # the lingering exporter keeps its log open in the run directory, yet it is no part of the job
        late = subprocess.run([*CLI, "top", "--once", str(tmp_path / "run")], capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip
        assert late.returncode == 2, late.stdout
        assert "no running process is writing this run directory" in late.stderr
    finally:
        for pid in _exporters_of(tmp_path / "run"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


ALLREDUCE_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    with open(sys.argv[1] + os.environ["RANK"], "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 300  # never outlive the test: torchrun starts ranks in their own session
    while time.monotonic() < deadline:
        dist.all_reduce(torch.ones(4))
        time.sleep(0.05)
    """
)


@pytest.mark.slow
def test_two_agents_of_one_job_on_a_host_are_joined_by_their_run_id(tmp_path: Path) -> None:
    from tests.test_live_job import TORCHRUN, free_port

    script, ready, port = tmp_path / "allreduce.py", str(tmp_path / "ready."), free_port()
    script.write_text(ALLREDUCE_SCRIPT)
    command = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-agents",
               str(script), ready]  # fmt: skip
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    agents = [subprocess.Popen(command, start_new_session=True, **quiet) for _ in range(2)]
    try:
        wait_for("both ranks in the collective", lambda: all(os.path.exists(ready + r) for r in "01"))
        text = top_once("--pid", str(agents[0].pid), "--interval", "0.3")
        assert "world size 2" in text, text
        assert "ranks here 2" in text, text
        ranks = {line.split()[0] for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])}
        assert ranks == {"0", "1"}, text
    finally:
        ranks = []
        for r in "01":  # the ranks are in sessions of their own: killing the agents' groups leaves them
            with contextlib.suppress(OSError, ValueError):
                ranks.append(int(Path(ready + r).read_text()))
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_watch_metrics_port_exporter_is_not_taken_for_rank_0(tmp_path: Path) -> None:
    """watch's exporter inherits rank 0's environment (RANK, TORCHELASTIC_RUN_ID) and lives outside the
    job's tree: the live view found it by the run id and showed it as rank 0 instead of the rank."""
    from ciuic_doctor.live.view import LiveJob
    from tests.test_live_job import TORCHRUN, free_port

    script, ready, run = tmp_path / "allreduce.py", str(tmp_path / "ready."), tmp_path / "run"
    script.write_text(ALLREDUCE_SCRIPT)
    agent = subprocess.Popen(
        [*TORCHRUN, "--nproc-per-node", "2", "-m", "ciuic_doctor", "watch", "--metrics-port",
         str(free_port()), "--out", str(run), "--", str(script), ready],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    ranks: list[int] = []
    try:
        wait_for("both ranks in the collective", lambda: all(os.path.exists(ready + r) for r in "01"))
        ranks = [int(Path(ready + r).read_text()) for r in "01"]
        exporter = wait_for("watch's exporter", lambda: _exporters_of(run), timeout_s=60)
        assert psutil.Process(exporter[0]).environ().get("RANK") == "0"  # what misled the discovery
        layout = LiveJob(pid=agent.pid).discovery.refresh()
        assert {r: p.pid for r, p in layout.ranks.items()} == {0: ranks[0], 1: ranks[1]}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        for pid in [*ranks, *_exporters_of(run)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


TWO_RANKS = textwrap.dedent(
    """
    import os, subprocess, sys, time
    loop = "import time\\nwhile True: time.sleep(0.1)"
    ranks = [subprocess.Popen([sys.executable, "-c", loop],
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"})
             for r in range(2)]
    print(" ".join(str(p.pid) for p in ranks), flush=True)
    time.sleep(120)
    """
)


def test_a_rank_that_dies_stays_in_view_as_down(tmp_path: Path) -> None:
    from ciuic_doctor.live.view import LiveJob

    launcher = subprocess.Popen([sys.executable, "-c", TWO_RANKS], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in launcher.stdout.readline().split()]
    try:
        live = LiveJob(pid=launcher.pid, rediscover_s=0.0)  # walks the tree at every update
        wait_for("both ranks", lambda: len(live.update().rows) == 2)
        os.kill(pids[1], signal.SIGKILL)
        rows = wait_for(
            "rank 1 down",
            lambda: (r := {x.rank: x for x in live.update().rows})[1].verdict.status == "DOWN" and r,
        )
        assert rows[0].verdict.status == "ok"
        assert not rows[1].sample.up
    finally:
        launcher.kill()
        launcher.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
