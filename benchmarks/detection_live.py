"""The live half of benchmarks/detection.py: faults planted in real 2-rank gloo jobs under `torchrun -m
ciuic_doctor watch`, and the seconds until the live view (what `top` and `export` show) names them.

    .venv/bin/python benchmarks/detection_live.py --trials 3 --healthy-s 300
    .venv/bin/python benchmarks/detection_live.py --trials 10 --healthy-s 1200   # the issue's 20 minutes

The job: each step sleeps PACE_S in its data phase (the rank's own pace, recorded as pre_backward_s), runs
a tiny Linear forward and backward, and all-reduces the gradients (gloo). Faults, on rank 1, each in a
fresh job once both ranks have 15 steps: `stuck` (its forward sleeps forever: rank 0 waits in the
all-reduce), `stop` (SIGSTOP), `kill` (SIGKILL), `slow` (its data phase 20-50 % longer). Seconds from the
fault to: the live view's verdict on rank 1 (STALLED, DOWN or straggler; LiveJob.update every 0.5 s, as
`top --interval 0.5`), and for stuck/stop to `hang --pid` naming rank 1 as the culprit (and, stuck, the
all_reduce). The healthy run: the same job with a 3 s checkpoint on every rank every 40 steps and a 6 s
evaluation every 70, watched for --healthy-s seconds; a false alarm is a sample with any rank not `ok`.
The Prometheus path adds the rule's `for:` and a scrape and an evaluation interval to the verdict's time
(tests/test_live_down.py measures it for a killed rank).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


class Job:
    def __init__(self, root: Path, *, ckpt: int = 0, evals: int = 0) -> None:
        self.ctrl = root / "ctrl"
        self.ctrl.mkdir(parents=True)
        self.run = root / "run"
        script = root / "job.py"
        script.write_text(JOB)
        self.log = (root / "job.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "ciuic_doctor",
             "watch", "--out", str(self.run), "--", str(script), str(self.ctrl), str(PACE_S), str(ckpt),
             str(evals)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip

    def ready(self, steps: int = 15, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the job ended before its first steps")
            if all(lines_in(self.run / f"steps.rank{r}.jsonl") >= steps for r in (0, 1)):
                return
            time.sleep(0.5)
        raise RuntimeError("no steps in time")

    def pid(self, rank: int) -> int:
        return int((self.ctrl / f"pid.{rank}").read_text())

    def close(self) -> None:
        (self.ctrl / "end").touch()
        for name in ("stuck.0", "stuck.1"):
            with contextlib.suppress(FileNotFoundError):
                (self.ctrl / name).unlink()
        for rank in (0, 1):
            with contextlib.suppress(OSError, ValueError):
                os.kill(self.pid(rank), signal.SIGCONT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            for rank in (0, 1):  # torchrun's ranks may sit in sessions of their own
                with contextlib.suppress(OSError, ValueError):
                    os.kill(self.pid(rank), signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def verdict_of(kind: str, rows: dict) -> bool:
    row = rows.get(1)
    if row is None:
        return False
    v = row.verdict
    return {"stuck": v.stalled, "stop": v.stalled, "kill": not v.up, "slow": v.straggler}[kind]


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


def trial(kind: str, root: Path, slow_factor: float) -> dict:
    from ciuic_doctor.live.view import LiveJob

    job = Job(root)
    out: dict = {"kind": kind}
    try:
        job.ready()
        live = LiveJob(pid=job.proc.pid, rediscover_s=2.0)
        for _ in range(4):
            live.update()
            time.sleep(0.5)
        t0 = time.monotonic()
        if kind == "stuck":
            (job.ctrl / "stuck.1").touch()
        elif kind == "stop":
            os.kill(job.pid(1), signal.SIGSTOP)
        elif kind == "kill":
            os.kill(job.pid(1), signal.SIGKILL)
        else:
            (job.ctrl / "slow.1").write_text(f"{slow_factor:.3f}")
        if kind in ("stuck", "stop"):  # hang --pid, asked again until it names rank 1, beside the view
            import threading

            def ask_hang() -> None:
                while time.monotonic() - t0 < 90:
                    if hang_names(job.proc.pid, kind):
                        out["hang_s"] = round(time.monotonic() - t0, 1)
                        return
                    time.sleep(1)

            asker = threading.Thread(target=ask_hang, daemon=True)
            asker.start()
        limit = 120 if kind == "slow" else 60
        while time.monotonic() - t0 < limit:
            rows = {r.rank: r for r in live.update().rows}
            if verdict_of(kind, rows):
                out["verdict_s"] = round(time.monotonic() - t0, 1)
                out["why"] = "; ".join(rows[1].verdict.why)
                break
            time.sleep(0.5)
        if kind in ("stuck", "stop"):
            asker.join(timeout=120)
    finally:
        job.close()
    return out


def healthy(root: Path, seconds: float) -> dict:
    from ciuic_doctor.live.view import LiveJob

    job = Job(root, ckpt=40, evals=70)
    alarms: list[str] = []
    samples = 0
    try:
        job.ready()
        live = LiveJob(pid=job.proc.pid, rediscover_s=2.0)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for row in live.update().rows:
                if row.verdict.status != "ok":
                    alarms.append(f"rank {row.rank} {row.verdict.status}: {'; '.join(row.verdict.why)}")
            samples += 1
            time.sleep(1.0)
        steps = min(lines_in(job.run / f"steps.rank{r}.jsonl") for r in (0, 1))
    finally:
        job.close()
    return {"samples": samples, "alarms": alarms, "steps": steps}


def main() -> int:
    import random

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3, help="trials per fault (3)")
    parser.add_argument("--healthy-s", type=float, default=300.0, help="seconds of the healthy run (300)")
    parser.add_argument("--faults", default="stuck,stop,kill,slow")
    parser.add_argument("--seed", type=int, default=37)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="detection-live-"))
    results: list[dict] = []
    started = time.monotonic()
    for kind in args.faults.split(","):
        for n in range(args.trials):
            result = trial(kind, root / f"{kind}{n}", 1 + rng.uniform(0.2, 0.5))
            print(f"  {result}", file=sys.stderr, flush=True)
            results.append(result)
    calm = healthy(root / "healthy", args.healthy_s) if args.healthy_s > 0 else None
    load = os.getloadavg()
    print(f"live detection: 2-rank gloo jobs under watch, {args.trials} trial(s) a fault; "
          f"{time.monotonic() - started:.0f} s; load average {load[0]:.1f} "
          f"on {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'fault':<8}{'trials':>7}{'verdict s (each)':>34}{'<= goal':>9}{'hang names s':>30}")
    for kind in args.faults.split(","):
        mine = [r for r in results if r["kind"] == kind]
        goal = 30 if kind == "slow" else 15
        times = [r.get("verdict_s") for r in mine]
        within = sum(1 for t in times if t is not None and t <= goal)
        hangs = [r.get("hang_s") for r in mine] if kind in ("stuck", "stop") else []
        shown = ", ".join("-" if t is None else f"{t:g}" for t in times)
        hang_shown = ", ".join("-" if t is None else f"{t:g}" for t in hangs) or "n/a"
        print(f"{kind:<8}{len(mine):>7}{shown:>34}{f'{within}/{len(mine)}':>9}{hang_shown:>30}")
    if calm is not None:
        print(f"healthy {args.healthy_s:.0f} s ({calm['steps']} steps, checkpoints every 40, evals every "
              f"70): {len(calm['alarms'])} non-ok rank samples of {calm['samples']}")  # fmt: skip
        for line in sorted(set(calm["alarms"]))[:10]:
            print(f"  {line}")
    for r in results:
        if r.get("why"):
            print(f"  {r['kind']}: {r['why']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
