"""A rank killed with -9 reaches a real Prometheus: a 2-rank gloo job under `torchrun -m ciuic_doctor watch
--metrics-port`, each rank with 2 DataLoader workers; the exporter watch starts labels the job with its
run directory (torchrun was given no --rdzv-id: its run id is the placeholder "none"), counts each rank's
2 workers and not watch's sentinel, and serves the job's final state after the job is gone, so the shipped
CiuicRankDown rule, with its own `for:`, fires for the killed rank."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.prometheus_server import Prometheus
from tests.test_live_job import REPO, TORCHRUN, free_port, wait_for

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    loader = DataLoader(data, batch_size=16, num_workers=2, persistent_workers=True)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with open(sys.argv[1] + os.environ["RANK"], "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 300  # never outlive the test
    while time.monotonic() < deadline:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            time.sleep(0.05)
            if time.monotonic() > deadline:
                break
    """
)


def _scrape(port: int) -> str:
    import urllib.request

    with (
        contextlib.suppress(OSError),
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r,
    ):
        return r.read().decode()
    return ""


def _series(text: str, name: str) -> dict[str, tuple[str, float]]:
    """rank -> (job, value) of a per-rank series in the exposition text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            out[labels["rank"]] = (labels["job"], float(line.rsplit(" ", 1)[1]))
    return out


def _exporters_of(run: Path) -> list[int]:
    """The exporter watch started for this run (detached, in a session of its own), by its command line."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        words = proc.info["cmdline"] or []
        if "export" in words and str(run) in words:
            found.append(proc.info["pid"])
    return found


def test_a_rank_killed_with_sigkill_fires_the_shipped_rank_down_rule(tmp_path: Path) -> None:
    server = shutil.which("prometheus")
    if server is None:
        pytest.skip("Debian's prometheus is not installed (scripts/ensure-test-tools.sh installs it as root)")
    rules = REPO / "deploy/prometheus/ciuic-alerts.yml"
    for_s = float(re.search(r"alert: CiuicRankDown\n(?:.*\n)*?\s+for: (\d+)s", rules.read_text()).group(1))
    script, ready, run = tmp_path / "train.py", str(tmp_path / "ready."), tmp_path / "run"
    script.write_text(SCRIPT)
    export_port, prom_port = free_port(), free_port()
    log = (tmp_path / "job.log").open("w")
    job = subprocess.Popen(
        [*TORCHRUN, "--nproc-per-node", "2", "-m", "ciuic_doctor", "watch", "--metrics-port",
         str(export_port), "--out", str(run), "--", str(script), ready],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    prom = Prometheus(server, tmp_path, export_port=export_port, rules=rules, port=prom_port)
    try:
        wait_for("both ranks training", lambda: all(os.path.exists(ready + r) for r in "01") or job.poll())
        assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]

        def two_workers_each() -> str:
            text = _scrape(export_port)
            workers = _series(text, "ciuic_rank_workers")
            return text if len(workers) == 2 and {v for _, v in workers.values()} == {2.0} else ""

        # workers are named pt_data_worker as their loop starts; discovery settles in ~1 s
        text = wait_for("each rank's 2 workers on the endpoint", two_workers_each, timeout_s=60, every_s=0.5)
        up = _series(text, "ciuic_rank_up")
        assert {job_label for job_label, _ in up.values()} == {"run"}, text  # the run directory, not "none"
        assert 'job="none"' not in text
        wait_for("prometheus ready", lambda: prom.ready() or prom.exited(), timeout_s=60)
        assert not prom.exited(), prom.log_tail()
        wait_for("both ranks scraped", lambda: len(prom.query("ciuic_rank_up == 1")) == 2)
        killed_at = time.monotonic()
        os.kill(int(Path(ready + "1").read_text()), signal.SIGKILL)
        alerts = wait_for(
            "CiuicRankDown firing for rank 1",
            lambda: prom.firing("CiuicRankDown", rank="1"),
            timeout_s=for_s + 60,
            every_s=1,
        )
        took = time.monotonic() - killed_at
        assert job.wait(timeout=30) != 0  # torchrun ended the job when its rank died
        assert alerts[0]["metric"]["job"] == "run"
        assert for_s <= took, took
        print(f"CiuicRankDown fired {took:.1f} s after the kill (for: {for_s:g}s)")
        finished = prom.query("ciuic_job_finished")
        assert [float(s["value"][1]) for s in finished] == [0.0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        log.close()
        for pid in _exporters_of(run):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        prom.close()
