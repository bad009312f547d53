"""The live half of benchmarks/detection.py: faults planted in real gloo jobs of 2 and 4 ranks under
`torchrun -m ciuic_doctor watch --metrics-port`, and the seconds until the live view (what `top` and
`export` show), the shipped Prometheus rules and `hang --pid` name them.

    .venv/bin/python benchmarks/detection_live.py --trials 4 --healthy-s 300
    .venv/bin/python benchmarks/detection_live.py --faults none --healthy-s 1200   # the issue's 20 minutes

The job: each step sleeps PACE_S in its data phase (the rank's own pace, recorded as pre_backward_s), runs
a tiny Linear forward and backward, and all-reduces the gradients (gloo). Faults, on rank 1, each in a
fresh job once every rank has 15 steps (trial n of a fault runs with the n-th of --ranks in turn):
`stuck` (its forward sleeps forever: the others wait in the all-reduce), `stop` (SIGSTOP), `kill`
(SIGKILL), `slow` (its data phase 20-50 % longer). Seconds from the fault to:

- the live view's verdict (LiveJob.update every 0.5 s, as `top --interval 0.5`; export samples the same
  view every 1 s): rank 1 STALLED (stuck: rank 1 alone, with the all_reduce named), DOWN or straggler;
- the shipped rule firing for rank 1 in a real Prometheus (started here when the `prometheus` binary is
  installed; scrape and rule evaluation every 1 s, deploy/prometheus/ciuic-alerts.yml unchanged):
  CiuicRankStalled for stuck/stop, CiuicRankDown for kill (each `for: 30s`); CiuicRankStraggler has
  `for: 5m` and is not waited for;
- `hang --pid` naming rank 1 as the culprit (and, stuck, the all_reduce), asked once a second.

The healthy run: the same job with a 3 s checkpoint on every rank every 40 steps and a 6 s evaluation
every 70, watched for --healthy-s seconds; a false alarm is a sample with any rank not `ok`, or any
alert firing in Prometheus.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PACE_S = 0.2
JOB = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ctrl, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    pace, ckpt, evals = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 1)
        def forward(self, x):
            while (ctrl / f"stuck.{rank}").exists():
                time.sleep(1)
            return self.lin(x)

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    (ctrl / f"pid.{rank}").write_text(str(os.getpid()))
    step = 0
    while not (ctrl / "end").exists():
        step += 1
        slow = ctrl / f"slow.{rank}"
        time.sleep(pace * (float(slow.read_text()) if slow.exists() else 1.0))
        loss = model(torch.randn(32, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        if ckpt and step % ckpt == 0:
            time.sleep(3.0)
        if evals and step % evals == 0:
            time.sleep(6.0)
    """
)


def lines_in(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


PROMETHEUS_ALERT = {"stuck": "CiuicRankStalled", "stop": "CiuicRankStalled", "kill": "CiuicRankDown"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    def __init__(self, root: Path, *, world: int = 2, ckpt: int = 0, evals: int = 0, prom: bool = False):
        self.world = world
        self.ctrl = root / "ctrl"
        self.ctrl.mkdir(parents=True)
        self.run = root / "run"
        script = root / "job.py"
        script.write_text(JOB)
        self.log = (root / "job.log").open("w")
        self.export_port = free_port() if prom else None
        metrics = ["--metrics-port", str(self.export_port)] if prom else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "-m",
             "ciuic_doctor", "watch", *metrics, "--out", str(self.run), "--", str(script), str(self.ctrl),
             str(PACE_S), str(ckpt), str(evals)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        server = shutil.which("prometheus") if prom else None
        self.prometheus = None
        if server:  # scrape and rule evaluation every 1 s, the shipped rules as they are
            from tests.prometheus_server import Prometheus

            rules = REPO / "deploy/prometheus/ciuic-alerts.yml"
            self.prometheus = Prometheus(
                server, root, export_port=self.export_port, rules=rules, port=free_port()
            )

    def ready(self, steps: int = 15, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the job ended before its first steps")
            stepped = all(lines_in(self.run / f"steps.rank{r}.jsonl") >= steps for r in range(self.world))
            if stepped and (self.prometheus is None or self._scraped()):
                return
            time.sleep(0.5)
        raise RuntimeError("no steps in time")

    def _scraped(self) -> bool:
        return len(self.prometheus.query("ciuic_rank_up == 1", missing_ok=True)) == self.world

    def pid(self, rank: int) -> int:
        return int((self.ctrl / f"pid.{rank}").read_text())

    def close(self) -> None:
        (self.ctrl / "end").touch()
        for rank in range(self.world):
            with contextlib.suppress(FileNotFoundError):
                (self.ctrl / f"stuck.{rank}").unlink()
            with contextlib.suppress(OSError, ValueError):
                os.kill(self.pid(rank), signal.SIGCONT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            for rank in range(self.world):  # torchrun's ranks may sit in sessions of their own
                with contextlib.suppress(OSError, ValueError):
                    os.kill(self.pid(rank), signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        if self.prometheus is not None:
            self.prometheus.close()
        for pid in self._exporters():  # watch's exporter outlives the job by its linger
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def _exporters(self) -> list[int]:
        import psutil

        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            words = proc.info["cmdline"] or []
            if "export" in words and str(self.run) in words:
                found.append(proc.info["pid"])
        return found


def verdict_of(kind: str, rows: dict) -> bool:
    """Rank 1 named for what was planted; stuck: rank 1 alone as the culprit, with the collective."""
    row = rows.get(1)
    if row is None:
        return False
    v = row.verdict
    if kind == "stuck":
        alone = not any(r.verdict.stalled for rank, r in rows.items() if rank != 1)
        return v.stalled and alone and "all_reduce" in "; ".join(v.why)
    return {"stop": v.stalled, "kill": not v.up, "slow": v.straggler}[kind]


def hang_names(agent: int, kind: str) -> bool:
    done = subprocess.run(
        [sys.executable, "-m", "ciuic_doctor", "hang", "--pid", str(agent), "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    try:
        text = json.dumps(json.loads(done.stdout))
    except ValueError:
        return False
    named = '"culprit_ranks": [1]' in text  # the hang finding's evidence (analysis/hang)
    return named and (kind != "stuck" or "all_reduce" in text or "allreduce" in text)


def _plant(kind: str, job: Job, slow_factor: float) -> None:
    if kind == "stuck":
        (job.ctrl / "stuck.1").touch()
    elif kind == "stop":
        os.kill(job.pid(1), signal.SIGSTOP)
    elif kind == "kill":
        os.kill(job.pid(1), signal.SIGKILL)
    else:
        (job.ctrl / "slow.1").write_text(f"{slow_factor:.3f}")


def trial(kind: str, root: Path, slow_factor: float, *, world: int, prom: bool, ask_hang: bool) -> dict:
    import threading

    from ciuic_doctor.live.view import LiveJob

    job = Job(root, world=world, prom=prom)
    out: dict = {"kind": kind, "world": world}
    try:
        job.ready()
        live = LiveJob(pid=job.proc.pid, rediscover_s=2.0)
        for _ in range(4):
            live.update()
            time.sleep(0.5)
        t0 = time.monotonic()
        _plant(kind, job, slow_factor)
        helpers = []
        if ask_hang and kind in ("stuck", "stop"):  # hang --pid, asked until it names rank 1

            def hang_loop() -> None:
                while time.monotonic() - t0 < 90:
                    if hang_names(job.proc.pid, kind):
                        out["hang_s"] = round(time.monotonic() - t0, 1)
                        return
                    time.sleep(1)

            helpers.append(threading.Thread(target=hang_loop, daemon=True))
        alert = PROMETHEUS_ALERT.get(kind)
        if job.prometheus is not None and alert is not None:

            def alert_loop() -> None:
                while time.monotonic() - t0 < 150:
                    if job.prometheus.firing(alert, "1", missing_ok=True):
                        out["alert_s"] = round(time.monotonic() - t0, 1)
                        return
                    time.sleep(0.5)

            helpers.append(threading.Thread(target=alert_loop, daemon=True))
        for helper in helpers:
            helper.start()
        limit = 120 if kind == "slow" else 60
        while time.monotonic() - t0 < limit:
            rows = {r.rank: r for r in live.update().rows}
            if verdict_of(kind, rows):
                out["verdict_s"] = round(time.monotonic() - t0, 1)
                out["why"] = "; ".join(rows[1].verdict.why)
                break
            time.sleep(0.5)
        for helper in helpers:
            helper.join(timeout=160)
    finally:
        job.close()
    return out


def healthy(root: Path, seconds: float, *, world: int, prom: bool) -> dict:
    from ciuic_doctor.live.view import LiveJob

    job = Job(root, world=world, ckpt=40, evals=70, prom=prom)
    alarms: list[str] = []
    fired: set[str] = set()
    samples = 0
    try:
        job.ready()
        live = LiveJob(pid=job.proc.pid, rediscover_s=2.0)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for row in live.update().rows:
                if row.verdict.status != "ok":
                    alarms.append(f"rank {row.rank} {row.verdict.status}: {'; '.join(row.verdict.why)}")
            if job.prometheus is not None and samples % 5 == 0:
                fired |= {f"{a['metric']['alertname']} rank {a['metric'].get('rank')}"
                          for a in job.prometheus.firing(missing_ok=True)}  # fmt: skip
            samples += 1
            time.sleep(1.0)
        steps = min(lines_in(job.run / f"steps.rank{r}.jsonl") for r in range(world))
    finally:
        job.close()
    return {"samples": samples, "alarms": alarms, "steps": steps, "fired": sorted(fired),
            "prometheus": job.prometheus is not None}  # fmt: skip


def main() -> int:
    import random

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=4, help="trials per fault (4)")
    parser.add_argument("--ranks", default="2,4", help="world sizes, trial n uses the n-th in turn (2,4)")
    parser.add_argument("--healthy-s", type=float, default=300.0, help="seconds of the healthy run (300)")
    parser.add_argument("--healthy-ranks", type=int, default=2)
    parser.add_argument("--faults", default="stuck,stop,kill,slow", help="or 'none': the healthy run only")
    parser.add_argument("--no-prometheus", action="store_true", help="no Prometheus even where installed")
    parser.add_argument("--no-hang", action="store_true", help="do not ask `hang --pid` (it costs CPU)")
    parser.add_argument("--seed", type=int, default=37)
    args = parser.parse_args()
    try:
        sizes = [int(n) for n in args.ranks.split(",")]
    except ValueError:
        parser.error("--ranks: world sizes separated by commas, e.g. 2,4")
    if any(n < 2 for n in sizes) or args.healthy_ranks < 2:
        parser.error("a world size is at least 2 (the fault is planted on rank 1)")
    prom = not args.no_prometheus
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="detection-live-"))
    results: list[dict] = []
    started = time.monotonic()
    faults = [] if args.faults == "none" else args.faults.split(",")
    if any(kind not in ("stuck", "stop", "kill", "slow") for kind in faults):
        parser.error("--faults: stuck, stop, kill, slow (separated by commas) or none")
    for kind in faults:
        for n in range(args.trials):
            world = sizes[n % len(sizes)]
            result = trial(kind, root / f"{kind}{n}", 1 + rng.uniform(0.2, 0.5), world=world, prom=prom,
                           ask_hang=not args.no_hang)  # fmt: skip
            print(f"  {result}", file=sys.stderr, flush=True)
            results.append(result)
    calm = None
    if args.healthy_s > 0:
        calm = healthy(root / "healthy", args.healthy_s, world=args.healthy_ranks, prom=prom)
    _table(args, sizes, faults, results, calm, wall=time.monotonic() - started)
    return 0


def _shown(values: list) -> str:
    return ", ".join("-" if t is None else f"{t:g}" for t in values) or "n/a"


def _table(args, sizes: list[int], faults: list[str], results: list[dict], calm, *, wall: float) -> None:
    load = os.getloadavg()
    prometheus = shutil.which("prometheus") and not args.no_prometheus
    trials = args.trials if faults else 0
    print(f"live detection: gloo jobs of {'/'.join(map(str, sizes))} ranks under watch, {trials} "
          f"trial(s) a fault; {wall:.0f} s; load average {load[0]:.1f} on {os.cpu_count()} CPUs; "
          f"Prometheus: {'yes (scrape and rules every 1 s)' if prometheus else 'not run'}")  # fmt: skip
    head = f"{'fault':<7}{'ranks':>9}{'verdict s (each)':>30}{'<= goal':>9}{'alert s':>28}"
    if faults:
        print(f"{head}{'hang names s':>24}")
    for kind in faults:
        mine = [r for r in results if r["kind"] == kind]
        goal = 30 if kind == "slow" else 15
        times = [r.get("verdict_s") for r in mine]
        within = sum(1 for t in times if t is not None and t <= goal)
        hangs = _shown([r.get("hang_s") for r in mine]) if kind in ("stuck", "stop") else "n/a"
        alert = PROMETHEUS_ALERT.get(kind)
        alerts = _shown([r.get("alert_s") for r in mine]) if prometheus and alert else "n/a"
        worlds = ",".join(str(r["world"]) for r in mine)
        print(f"{kind:<7}{worlds:>9}{_shown(times):>30}{f'{within}/{len(mine)}':>9}{alerts:>28}{hangs:>24}")
    if calm is not None:
        print(f"healthy {args.healthy_s:.0f} s, {args.healthy_ranks} ranks ({calm['steps']} steps, "
              f"checkpoints every 40, evals every 70): {len(calm['alarms'])} non-ok rank samples of "
              f"{calm['samples']}; Prometheus alerts fired: "
              f"{(', '.join(calm['fired']) or 'none') if calm['prometheus'] else 'not run'}")  # fmt: skip
        for line in sorted(set(calm["alarms"]))[:10]:
            print(f"  {line}")
    if faults:
        print("alerts: " + ", ".join(f"{k}: {a}" for k, a in PROMETHEUS_ALERT.items()) + "; slow: "
          "CiuicRankStraggler has for: 5m, not waited for")  # fmt: skip
    for r in results:
        if r.get("why"):
            print(f"  {r['kind']} ({r['world']} ranks): {r['why']}")


if __name__ == "__main__":
    raise SystemExit(main())
