"""What attaching `export` and `top` costs a running job, measured side by side in one run.

1. Step time with and without: one 2-rank torchrun job of the embedded model runs throughout; windows of
   --window-s seconds alternate A (nothing attached) and B (`export --interval 1` scraped every second
   plus an interactive `top --interval 1` in tmux), A B A B ... A, and the job's own step_time_s records
   of each window are compared: each B's median against the mean of its neighbouring A medians; the
   median of those ratios, goal <= 1.005. The CPU the attached processes spent is printed per B window.
2. The exporter's own CPU on 8 ranks: 8 watched ranks of a light training script (small steps with a
   DataLoader worker each), `export --interval 1` scraped every second for --cpu-s seconds; its CPU time
   from /proc over wall time, goal <= 2 % of one core.

    .venv/bin/python benchmarks/live_overhead.py [--pairs 4] [--window-s 20] [--cpu-s 60]

Prints one line per window and the two ratios; exit 0 either way (a benchmark reports, it does not gate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

CLI = [sys.executable, "-m", "ciuic_doctor"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # torchrun, as the venv may lack the script

LIGHT_SCRIPT = textwrap.dedent(
    """
    import time, torch
    from torch.utils.data import DataLoader, TensorDataset
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(2048, 32), torch.randn(2048, 1))
    loader = DataLoader(data, batch_size=32, num_workers=1, persistent_workers=True)
    model = torch.nn.Linear(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.time() + float(__import__("sys").argv[1])
    while time.time() < end:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            time.sleep(0.1)
            if time.time() >= end:
                break
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int) -> None:
    with (
        contextlib.suppress(OSError),
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r,
    ):
        r.read()


def step_times(run: Path, start: float, end: float) -> list[float]:
    out = []
    for path in run.glob("steps.rank*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if start <= record.get("t", 0) < end and record.get("step_time_s"):
                    out.append(record["step_time_s"])
    return out


def wait_steps(run: Path, n: int, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if all(len(step_times(run, 0, 1e12)) >= n for _ in (0,)):
            return
        time.sleep(1)
    raise SystemExit("the job did not start stepping")


def attach(agent: int, port: int, session: str) -> list[int]:
    """export (scraped by the caller) and an interactive top in tmux; returns their PIDs."""
    exporter = subprocess.Popen(
        [*CLI, "export", "--pid", str(agent), "--port", str(port), "--address", "127.0.0.1",
         "--interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pids = [exporter.pid]
    if shutil.which("tmux"):
        top = " ".join([*CLI, "top", "--pid", str(agent), "--interval", "1"])
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "40", top], check=True)
        pane = subprocess.run(["tmux", "list-panes", "-t", session, "-F", "#{pane_pid}"],
                              capture_output=True, text=True, check=False).stdout.split()  # fmt: skip
        pids += [int(p) for p in pane]
    return pids


def detach(pids: list[int], session: str) -> None:
    subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, check=False)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def window(run: Path, label: str, window_s: float, port: int, attached: list[int]) -> tuple[float, float]:
    """(median step time in the window, CPU seconds the attached processes spent in it)."""
    cpu0 = sum(cpu_seconds(p) for p in attached if Path(f"/proc/{p}").exists())
    start = time.time()
    while time.time() < start + window_s:
        if attached:
            scrape(port)
        time.sleep(1)
    end = time.time()
    cpu = sum(cpu_seconds(p) for p in attached if Path(f"/proc/{p}").exists()) - cpu0
    times = step_times(run, start, end)
    median = statistics.median(times) if times else float("nan")
    cost = f", export+top CPU {100 * cpu / (end - start):.2f} % of a core" if attached else ""
    print(f"{label}: {len(times)} steps, median step time {median * 1e3:.2f} ms{cost}")
    return median, cpu / (end - start)


def step_time_ab(pairs: int, window_s: float, tmp: Path) -> float:
    """A B A B ... A: each B against the mean of the A windows either side of it (the job's pace drifts
    with the machine's load; neighbours share the drift), the median of those ratios is the result."""
    run = tmp / "ab"
    job = subprocess.Popen(
        [*TORCHRUN, "--nproc-per-node", "2", "-m", "ciuic_doctor", "job", "--steps", "1000000",
         "--out", str(run)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    a_medians: list[float] = []
    b_medians: list[float] = []
    try:
        wait_steps(run, 20)
        port, session = free_port(), f"bench-top-{os.getpid()}"
        a_medians.append(window(run, "A 1", window_s, port, [])[0])
        for pair in range(pairs):
            attached = attach(job.pid, port, session)
            time.sleep(2.0)  # their start-up (imports, first walk) is not the steady cost
            b_medians.append(window(run, f"B {pair + 1}", window_s, port, attached)[0])
            detach(attached, session)
            a_medians.append(window(run, f"A {pair + 2}", window_s, port, [])[0])
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait()
    ratios = [b / ((a_medians[i] + a_medians[i + 1]) / 2) for i, b in enumerate(b_medians)]
    ratio = statistics.median(ratios)
    print(f"step time with export+top / without: {ratio:.4f} (median of {len(ratios)} B/A ratios "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; goal <= 1.005)")  # fmt: skip
    return ratio


def exporter_cpu(seconds: float, tmp: Path) -> float:
    script = tmp / "light_train.py"
    script.write_text(LIGHT_SCRIPT)
    run = tmp / "eight"
    job = subprocess.Popen(
        [*TORCHRUN, "--nproc-per-node", "8", "-m", "ciuic_doctor", "watch", "--out", str(run),
         "--", str(script), str(seconds + 240)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 240
        while len(list(run.glob("steps.rank*.jsonl"))) < 8 and time.time() < deadline:
            time.sleep(1)
        port = free_port()
        exporter = subprocess.Popen(
            [*CLI, "export", "--pid", str(job.pid), "--port", str(port), "--address", "127.0.0.1",
             "--interval", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        print(exporter.stdout.readline().strip())
        time.sleep(3)  # start-up (imports, first walk) is not the steady cost
        cpu0, t0 = cpu_seconds(exporter.pid), time.monotonic()
        while time.monotonic() < t0 + seconds:
            scrape(port)
            time.sleep(1)
        share = 100 * (cpu_seconds(exporter.pid) - cpu0) / (time.monotonic() - t0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            ranks = {line.split('rank="')[1].split('"')[0] for line in r.read().decode().splitlines()
                     if line.startswith("ciuic_rank_up{")}  # fmt: skip
        exporter.terminate()
        exporter.wait()
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait()
    print(f"exporter CPU on {len(ranks)} ranks at 1 s: {share:.2f} % of one core (goal <= 2 %)")
    return share


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--cpu-s", type=float, default=60.0)
    parser.add_argument("--skip-ab", action="store_true")
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args()
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"load average {load}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="ciuic-live-bench-") as tmp:
        if not args.skip_cpu:
            exporter_cpu(args.cpu_s, Path(tmp))
        if not args.skip_ab:
            step_time_ab(args.pairs, args.window_s, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
