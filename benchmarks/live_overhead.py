"""What attaching `export` and `top` costs a running job, measured side by side in one run.

1. Step time with and without (goal <= 1.005). One job of the embedded model runs throughout; `export
   --interval 1` (scraped every second, as Prometheus would) and an interactive `top --interval 1` (in a
   private tmux server) are started once, then alternately SIGCONTed (B: attached, sampling /proc and the
   run directory) and SIGSTOPped (A: a stopped process reads nothing and takes no CPU), in short windows
   A B A B ... A. Each window's median step time (the job's own step_time_s records, the first --settle-s
   after a switch left out) gives, per B, a ratio to the geometric mean of its neighbouring A windows (the
   job's pace drifts with the machine; neighbours share the drift). The result is the geometric mean of
   those ratios with a paired 95 % interval over the pairs (the wider of Student's t and a bootstrap):
   "meets" when the interval's upper end is <= the goal, "exceeds" when its lower end is above,
   otherwise (or under 10 pairs, or when others' load before the start leaves no core spare: there two
   runs of one setup disagreed) "cannot resolve", never a pass.
   The same is printed for the windows' mean step time (throughput: a 1 s sampler that slows one step in
   ten moves the mean, hardly the median) and for the rank's CPU seconds per step (other tenants'
   preemption does not inflate it; a tool's cache or lock cost on the rank's own CPU does).
   --amplify K runs both tools at K samples a second (--interval 1/K, rediscovery with it) and scrapes K
   times a second. Both sides keep the tools resident (A only stops them), so B - A is the tools'
   activity alone, and that is per sample: the slowdown at 1 s is the amplified one over K,
   1 + (B/A - 1) / K, and so is its interval. This resolves 0.5 % where the machine's own window-to-window
   noise (a few %) cannot. What does not scale with K is reading the job's new records (~1 KB a second
   here, the same bytes in more, smaller reads): counted K times too little, and negligible beside the
   /proc reads. Run two K (say 5 and 20) to see the linearity for yourself.
   Modes:
   - headroom (default, the representative setup): a GPU job's ranks wait on their GPUs and leave the
     host's cores partly idle. Here: 1 rank, OMP_NUM_THREADS=1, the whole job (agent, rank, DataLoader
     workers) pinned to CPU 0 with taskset; export, top, tmux and the scraper pinned to the other CPUs.
     On a machine others load there is no spare core: `--job-nice -10` (root) gives the job's CPU back
     to the job, but the verdict still waits for a quiet machine.
   - saturated (worst case): 2 ranks with torch's default threads, everything unpinned: every core busy, so
     the job pays about the tools' CPU share of the machine's cores.
2. The exporter's own CPU on 8 ranks (goal <= 2 % of one core): 8 watched ranks of a light training script,
   `export --interval 1` scraped every second for --cpu-s seconds; its CPU time from /proc over wall time.

    .venv/bin/python benchmarks/live_overhead.py [--mode headroom|saturated] [--pairs 30] [--window-s 5]
                                                 [--settle-s 1] [--job-nice 0] [--amplify 1] [--cpu-s 60]
                                                 [--skip-ab] [--skip-cpu]

Defaults take ~8 min on a quiet 2-core machine. Prints one line per window, then one table with the
setup, the load average before and after, both results and their goals; exit 0 either way (a benchmark
reports, it does not gate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
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

import psutil

CLI = [sys.executable, "-m", "ciuic_doctor"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # torchrun, as the venv may lack the script
GOAL_RATIO = 1.005
GOAL_CPU_PERCENT = 2.0

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


# --control: burns ~2.4 % of a core (12 ms every ~0.5 s), what export + top took, touching no process
BURNER = (
    "import time\nwhile True:\n    t = time.process_time()\n"
    "    while time.process_time() - t < 0.012: pass\n    time.sleep(0.5)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


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


def paired_interval(ratios: list[float], replicates: int = 10_000) -> tuple[float, float, float]:
    """(geometric mean, low, high) of the B/A ratios: the wider of the paired Student-t 95 % interval and
    the bootstrap percentile one over the pairs (seeded); the bootstrap alone is too narrow with few pairs.

    >>> paired_interval([1.0, 1.0, 1.0])
    (1.0, 1.0, 1.0)
    """
    from ciuic_doctor.compare.stats import t_quantile

    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = t_quantile(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    rng = random.Random(26)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(replicates))
    low = min(mean - half, means[int(0.025 * replicates)])
    high = max(mean + half, means[int(0.975 * replicates) - 1])
    return math.exp(mean), math.exp(low), math.exp(high)


MIN_PAIRS = 10  # fewer pairs: no verdict, however narrow the interval looks


def verdict(low: float, high: float, goal: float, pairs: int, loaded: str) -> str:
    """`loaded`: why the machine is too busy for an interval to hold ("" when quiet). On the shared 2-core
    machine at load 5-7, two runs of the same setup (--job-nice -10, 20 pairs) gave 1.116 [1.037, 1.200]
    and 0.952 [0.856, 1.059]: others' load is not stationary, so there no verdict is given."""
    if loaded:
        return f"cannot resolve: {loaded}"
    if pairs < MIN_PAIRS:
        return f"cannot resolve: {pairs} pairs (a verdict needs >= {MIN_PAIRS})"
    if high <= goal:
        return f"meets the goal (95 % interval within <= {goal})"
    if low > goal:
        return f"exceeds the goal (95 % interval above {goal})"
    return f"cannot resolve: the 95 % interval spans {goal} (more pairs or a quieter machine)"


def run_seconds(pids: list[int]) -> float:
    """CPU time of every thread of `pids` from /proc/<pid>/task/*/schedstat (nanoseconds, where
    /proc/<pid>/stat counts 10 ms ticks: too coarse for a 0.5 % effect in 5 s windows)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in os.scandir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int(Path(task.path, "schedstat").read_text().split()[0])
    return total / 1e9


class Tools:
    """export + an interactive top in a private tmux server, started once, stopped and continued."""

    def __init__(
        self, agent: int, port: int, cpus: set[int] | None, control: bool = False, interval_s: float = 1.0
    ) -> None:
        pin = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
        self.socket = f"ciuic-bench-{os.getpid()}"
        command = [*CLI, "export", "--pid", str(agent), "--port", str(port), "--address", "127.0.0.1",
                   "--interval", f"{interval_s:g}"]  # fmt: skip
        if control:  # no reads of the job at all: only the tools' CPU share, burnt on the tools' CPU
            command = [sys.executable, "-c", BURNER]
        self.exporter = subprocess.Popen(
            [*pin, *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.top: list[int] = []
        self.tmux_server: list[int] = []
        if shutil.which("tmux") and not control:
            top = " ".join([*pin, *CLI, "top", "--pid", str(agent), "--interval", f"{interval_s:g}"])
            tmux = ["tmux", "-L", self.socket]
            subprocess.run([*pin, *tmux, "new-session", "-d", "-x", "200", "-y", "40", top], check=True)
            pane = subprocess.run(["tmux", "-L", self.socket, "list-panes", "-F", "#{pane_pid}"],
                                  capture_output=True, text=True, check=False).stdout.split()  # fmt: skip
            for pid in map(int, pane):
                with contextlib.suppress(psutil.Error):
                    shell = psutil.Process(pid)
                    self.top = [pid, *(c.pid for c in shell.children(recursive=True))]
                    self.tmux_server = [shell.ppid()]
        self.stopped = False

    def signal(self, sig: int) -> None:
        # tmux continues a pane's process that stops: its (private) server is stopped first, continued last
        order = [*self.tmux_server, self.exporter.pid, *self.top]
        for pid in order if sig == signal.SIGSTOP else order[::-1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        self.stopped = sig == signal.SIGSTOP

    def cpu(self) -> dict[str, float]:
        return {"export": cpu_seconds([self.exporter.pid]), "top": cpu_seconds(self.top),
                "tmux": cpu_seconds(self.tmux_server)}  # fmt: skip

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, check=False)
        with contextlib.suppress(OSError):  # the server's socket file outlives it
            Path(os.environ.get("TMUX_TMPDIR", "/tmp"), f"tmux-{os.getuid()}", self.socket).unlink()
        self.exporter.terminate()
        self.exporter.wait()


def start_job(mode: str, run: Path, job_cpus: set[int] | None, nice: int) -> subprocess.Popen:
    pin = ["taskset", "-c", ",".join(map(str, sorted(job_cpus)))] if job_cpus else []
    if nice:
        pin = ["nice", "-n", str(nice), *pin]
    nproc = "1" if mode == "headroom" else "2"
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if mode == "headroom" else dict(os.environ)
    return subprocess.Popen(
        [*pin, *TORCHRUN, "--nproc-per-node", nproc, "-m", "ciuic_doctor", "job", "--steps", "1000000",
         "--out", str(run)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
    )  # fmt: skip


def rank_pids(agent: int) -> list[int]:
    """The job's rank processes (children of the agent with RANK in their environment)."""
    out = []
    for child in psutil.Process(agent).children():
        with contextlib.suppress(psutil.Error):
            if "RANK" in child.environ():
                out.append(child.pid)
    return out


FIGURES = {  # per window: what each B/A ratio compares
    "median": "median step time (the goal's figure)",
    "mean": "mean step time (throughput: every slowed step counts)",
    "cpu": "rank CPU s per step (blind to other tenants' preemption; misses lock waits)",
}


def pair_ratios(a: list[float], b: list[float]) -> list[float]:
    """Each B against the geometric mean of the A windows either side of it."""
    return [
        v / math.sqrt(a[i] * a[i + 1])
        for i, v in enumerate(b)
        if all(math.isfinite(x) and x > 0 for x in (v, a[i], a[i + 1]))
    ]


def step_time_ab(args: argparse.Namespace, tmp: Path, table: dict[str, str]) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    load_at_start = os.getloadavg()[0]
    job_cpus = tool_cpus = None
    if args.mode == "headroom":
        if len(cpus) < 2 or shutil.which("taskset") is None:
            raise SystemExit("headroom mode needs 2+ CPUs and taskset (util-linux)")
        job_cpus, tool_cpus = {cpus[0]}, set(cpus[1:])
        os.sched_setaffinity(0, tool_cpus)  # the scraper (this process) shares the tools' CPUs
    run = tmp / "ab"
    job = start_job(args.mode, run, job_cpus, args.job_nice)
    tools = None
    windows: dict[str, dict[str, list[float]]] = {side: {k: [] for k in FIGURES} for side in "AB"}
    cpu_b = {"export": 0.0, "top": 0.0, "tmux": 0.0}
    b_seconds = 0.0
    try:
        deadline = time.time() + 300
        while len(step_times(run, 0, 1e12)) < 10:
            if time.time() > deadline or job.poll() is not None:
                raise SystemExit("the job did not start stepping")
            time.sleep(1)
        ranks = rank_pids(job.pid)
        port = free_port()
        tools = Tools(job.pid, port, tool_cpus, control=args.control, interval_s=1.0 / args.amplify)
        time.sleep(5.0)  # their start-up (imports, first walk) is not the steady cost
        for index in range(2 * args.pairs + 1):
            attached = index % 2 == 1
            tools.signal(signal.SIGCONT if attached else signal.SIGSTOP)
            time.sleep(args.settle_s)
            before, job_cpu0, start = tools.cpu(), run_seconds(ranks), time.time()
            while time.time() < start + args.window_s:
                if attached:
                    scrape(port)
                time.sleep(min(1.0 / args.amplify, max(0.0, start + args.window_s - time.time())))
            end, after, job_cpu = time.time(), tools.cpu(), run_seconds(ranks) - job_cpu0
            times = step_times(run, start, end)
            figures = {
                "median": statistics.median(times) if times else math.nan,
                "mean": statistics.fmean(times) if times else math.nan,
                "cpu": job_cpu / len(times) if times else math.nan,
            }
            for key, value in figures.items():
                windows["B" if attached else "A"][key].append(value)
            spent = {k: after[k] - before[k] for k in after}
            if attached:
                b_seconds += end - start
                cpu_b = {k: cpu_b[k] + spent[k] for k in cpu_b}
            shares = " ".join(f"{k} {100 * v / (end - start):4.1f}" for k, v in spent.items())
            print(f"{'B' if attached else 'A'} {index // 2 + 1:<3} {len(times):3} steps  median "
                  f"{figures['median'] * 1e3:7.2f} ms  mean {figures['mean'] * 1e3:7.2f} ms  rank CPU/step "
                  f"{figures['cpu'] * 1e3:7.2f} ms  tools CPU % of a core: {shares}", flush=True)  # fmt: skip
    finally:
        if tools is not None:
            tools.close()
        os.killpg(job.pid, signal.SIGTERM)
        job.wait()
    setup = (
        f"1 rank, OMP_NUM_THREADS=1, job on CPU {cpus[0]}; export+top+tmux+scraper on CPU(s) "
        f"{','.join(map(str, sorted(tool_cpus or [])))}"
        if args.mode == "headroom"
        else f"2 ranks, default torch threads, nothing pinned, {len(cpus)} CPUs (worst case)"
    )
    table["setup"] = f"{args.mode}: {setup}" + (f"; job at nice {args.job_nice}" if args.job_nice else "")
    if args.control:
        table["setup"] += "; CONTROL: B = a CPU burner, not the tools (export CPU = the burner's)"
    loaded = ""
    if load_at_start >= max(1.0, len(cpus) - 1):  # measured before the job started: others' load
        loaded = (
            f"others' load {load_at_start:.1f} on {len(cpus)} CPUs before the job started leaves no core "
            "spare; there intervals do not replicate"
        )
        table["  warning"] = loaded
    table["windows"] = (f"{args.pairs} pairs A B ... A, {args.window_s:g} s each after {args.settle_s:g} s "
                        f"settle; A = tools SIGSTOPped, B = running, scraped {args.amplify:g}/s")  # fmt: skip
    if args.amplify != 1:
        table["amplified"] = (f"x{args.amplify:g}: tools sample every {1 / args.amplify:g} s; the verdicts "
                              "judge the slowdown at 1 s, 1 + (B/A - 1) / K")  # fmt: skip
    a_median = statistics.median(v for v in windows["A"]["median"] if math.isfinite(v))
    table["A step time"] = f"{a_median * 1e3:.2f} ms (median of the A windows' medians)"
    for key, what in FIGURES.items():
        ratios = pair_ratios(windows["A"][key], windows["B"][key])
        name = f"B/A {key}"
        if len(ratios) < 2:
            table[name] = f"not measured: {len(ratios)} usable pair(s), 2+ needed (windows with steps)"
            continue
        ratio, low, high = paired_interval(ratios)
        table[name] = f"{ratio:.4f}  95 % [{low:.4f}, {high:.4f}]  {what}"
        if args.amplify != 1:
            ratio, low, high = (1 + (v - 1) / args.amplify for v in (ratio, low, high))
            table[f"  at 1 s ({key})"] = f"{ratio:.4f}  95 % [{low:.4f}, {high:.4f}]  (x{args.amplify:g} / K)"
        if key != "cpu":
            table[f"  verdict ({key})"] = verdict(low, high, GOAL_RATIO, len(ratios), loaded)
        if key == "median":
            table["  per pair"] = " ".join(f"{r:.3f}" for r in ratios)
    if args.amplify != 1:
        table["tools' CPU"] = f"below at x{args.amplify:g}: about {args.amplify:g} times the share at 1 s"
    table["export CPU (B windows)"] = f"{100 * cpu_b['export'] / b_seconds:.2f} % of a core"
    top_share, tmux_share = (100 * cpu_b[k] / b_seconds for k in ("top", "tmux"))
    table["top CPU (B windows)"] = f"{top_share:.2f} % of a core (+ its tmux server {tmux_share:.2f} %)"


def exporter_cpu(seconds: float, tmp: Path, table: dict[str, str]) -> None:
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
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(5)  # start-up (imports, first walk) is not the steady cost
        cpu0, t0 = cpu_seconds([exporter.pid]), time.monotonic()
        while time.monotonic() < t0 + seconds:
            scrape(port)
            time.sleep(1)
        share = 100 * (cpu_seconds([exporter.pid]) - cpu0) / (time.monotonic() - t0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            ranks = {line.split('rank="')[1].split('"')[0] for line in r.read().decode().splitlines()
                     if line.startswith("ciuic_rank_up{")}  # fmt: skip
        exporter.terminate()
        exporter.wait()
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait()
    table["exporter CPU, 8 ranks"] = (f"{share:.2f} % of a core on {len(ranks)} ranks at 1 s, {seconds:g} s "
                                      f"(goal <= {GOAL_CPU_PERCENT} %)")  # fmt: skip


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("headroom", "saturated"), default="headroom")
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--cpu-s", type=float, default=60.0)
    parser.add_argument(
        "--job-nice", type=int, default=0,
        help="run the job at this niceness; on a shared machine a negative one (root) keeps other users' "
        "processes off the job's CPU, so headroom mode keeps its spare core (the tools stay at 0)",
    )  # fmt: skip
    parser.add_argument(
        "--control", action="store_true",
        help="B runs a CPU burner of the tools' share on their CPU instead of the tools: the machine's own "
        "effect of that CPU use (on a loaded host, others' processes pushed onto the job's CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--amplify", type=float, default=1.0, metavar="K",
        help="tools sample K times a second (scraped as often); the verdicts judge 1 + (B/A - 1) / K",
    )  # fmt: skip
    parser.add_argument("--skip-ab", action="store_true")
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args()
    if args.amplify <= 0:
        parser.error(f"--amplify {args.amplify:g}: a rate multiple above 0")
    table = {"machine": f"{os.cpu_count()} CPUs, load average {load()} (1/5/15 min) at start"}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ciuic-live-bench-") as tmp:
        if not args.skip_ab:
            step_time_ab(args, Path(tmp), table)
        if not args.skip_cpu:
            exporter_cpu(args.cpu_s, Path(tmp), table)
    table["load at end"] = f"{load()}; took {time.monotonic() - began:.0f} s"
    width = max(map(len, table))
    print("\n" + "\n".join(f"{key:{width}}  {value}" for key, value in table.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
