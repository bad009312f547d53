"""The report's per-block checks on one core, on every core, and on Dask: time, and the same findings.

Two parts, each interleaved (one core, N cores, Dask; again) because the machine is shared:

- checks: one process reads the run once (`memory._Data`: the streams the memory checks read), then
  runs the memory checks — the passes `memory.blocks.in_blocks` cuts into blocks of ranks — under
  `parallel.using(jobs=1)`, `using(jobs=N)` and `using(scheduler=ADDRESS)`, round after round. Per
  round: wall, CPU of this process and its forked workers (getrusage self + children), and for Dask
  the CPU its workers spent (getrusage on each worker, before and after), and whether the findings
  are the same as one core's (their JSON, compared as bytes).
- report (--report): `ciuic-doctor report RUN --reanalyze --quiet` once per path (--jobs 1, --jobs N,
  --scheduler), wall and CPU of the process (wait4: its workers included; Dask's workers are other
  processes, their CPU is printed apart), and `cmp` of findings.json across the three paths. Its
  "created" time is the only field that differs between two reports of the same run, so it is taken
  out first (written to FILE.cmp beside a copy of each path's findings.json).

Without --scheduler a local Dask cluster is started: `dask scheduler` and WORKERS `dask worker`
processes of one thread each (pip install 'ciuic-doctor[dask]'); without distributed, Dask's rows say
so and the rest runs.

    .venv/bin/python benchmarks/report_parallel.py /tmp/rs1k/r1024x2000 --rounds 2 --report
    .venv/bin/python benchmarks/report_parallel.py /tmp/rs10k/r10000x1000 --rounds 1 --report
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DASK = [sys.executable, "-m", "distributed.cli.dask_scheduler"]


def cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _worker_cpu() -> float:
    return cpu_s(resource.RUSAGE_SELF)


def run_checks(run: Path, modes: list[tuple[str, dict]], rounds: int) -> None:
    """The child: read once, then every mode once a round; one line per mode and round."""
    from ciuic_doctor.analysis.memory import cuda_findings, leak_findings, worker_findings
    from ciuic_doctor.analysis.memory.blocks import RANKS_PER_BLOCK
    from ciuic_doctor.analysis.memory.data import _Data
    from ciuic_doctor.parallel import using
    from ciuic_doctor.rundir.store import RunDir

    t0, c0 = time.perf_counter(), cpu_s(resource.RUSAGE_SELF)
    data = _Data(RunDir.open(run))
    ranks = len(data.ranks())
    print(f"  read {ranks} ranks: {time.perf_counter() - t0:.1f} s wall, "
          f"{cpu_s(resource.RUSAGE_SELF) - c0:.1f} s CPU", flush=True)  # fmt: skip
    # one core's whole-job pass of a run of one block caches the job's columns in `data`: a fresh read
    fresh = ranks <= RANKS_PER_BLOCK
    reference: bytes | None = None
    for round_no in range(1, rounds + 1):
        for name, plan in modes:
            if fresh and (round_no, name) != (1, modes[0][0]):
                data = _Data(RunDir.open(run))
            try:
                load = os.getloadavg()[0]
                wall, cpu = time.perf_counter(), cpu_s(resource.RUSAGE_SELF)
                children = cpu_s(resource.RUSAGE_CHILDREN)
                with using(**plan):  # its end stops the forked workers: their CPU counts once reaped
                    dask = _dask_cpu(plan)
                    found = [*leak_findings(data), *cuda_findings(data), *worker_findings(data)]
                    remote = _dask_cpu(plan) - dask if dask is not None else 0.0
                wall = time.perf_counter() - wall
                cpu = cpu_s(resource.RUSAGE_SELF) - cpu + cpu_s(resource.RUSAGE_CHILDREN) - children
            except Exception as exc:
                print(f"  round {round_no} {name:8s} not run: {' '.join(str(exc).split())}", flush=True)
                continue
            text = json.dumps([f.to_dict() for f in found], sort_keys=True).encode()
            reference = reference if reference is not None else text
            same = "same" if text == reference else "DIFFERENT"
            print(
                f"  round {round_no} {name:8s} load {load:4.1f}  wall {wall:6.1f} s  CPU here "
                f"{cpu:6.1f} s  CPU on Dask workers {remote:6.1f} s  findings {same} "
                f"({len(found)} findings, {len(text)} bytes)",
                flush=True,
            )


def _dask_cpu(plan: dict) -> float | None:
    from ciuic_doctor import parallel

    session = parallel._PLAN.dask
    if not plan.get("scheduler") or session is None:
        return None
    return sum(session.client.run(_worker_cpu).values())


def run_reports(run: Path, modes: list[tuple[str, list[str]]], scheduler: str | None, out: Path) -> None:
    """Each path's `report --reanalyze` in a fresh process, and cmp of its findings (less "created")."""
    stripped = []
    for name, extra in modes:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("CIUIC_RUN_DIR", None)
        argv = [sys.executable, "-m", "ciuic_doctor", "report", str(run), "--reanalyze", "--quiet", *extra]
        dask = _cluster_cpu(scheduler) if name == "dask" else None
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if status:
            print(f"  report {name:8s} failed: {err.strip().splitlines()[-1:]}", flush=True)
            continue
        remote = _cluster_cpu(scheduler) - dask if dask is not None else 0.0
        copy = out / f"{run.name}.{name}.findings.json"
        shutil.copyfile(run / "findings.json", copy)
        body = json.loads(copy.read_text())
        body.pop("created", None)
        target = copy.with_suffix(".cmp")
        target.write_text(json.dumps(body, sort_keys=True, indent=1))
        stripped.append(target)
        print(
            f"  report {name:8s} load {load:4.1f}  wall {wall:6.1f} s  "
            f"CPU {usage.ru_utime + usage.ru_stime:6.1f} s "
            f"(+ {remote:.1f} s on Dask workers)  peak RSS {usage.ru_maxrss / 1024:.0f} MiB",
            flush=True,
        )
    for other in stripped[1:]:
        same = subprocess.run(["cmp", stripped[0], other], check=False, capture_output=True, text=True)
        verdict = "identical" if same.returncode == 0 else same.stdout.strip() or same.stderr.strip()
        print(f"  cmp {stripped[0].name} {other.name}: {verdict}", flush=True)


def _cluster_cpu(scheduler: str | None) -> float | None:
    if not scheduler:
        return None
    from distributed import Client

    with Client(scheduler, timeout=10, set_as_default=False) as client:
        return sum(client.run(_worker_cpu).values())


def start_cluster(workers: int, folder: Path) -> tuple[str | None, list[subprocess.Popen]]:
    """A local scheduler and `workers` one-thread workers; (None, []) without distributed."""
    try:
        import distributed  # noqa: F401
    except ImportError:
        print("  Dask: distributed is not installed (pip install 'ciuic-doctor[dask]'): its rows are skipped")
        return None, []
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    log = (folder / "dask.log").open("w")
    procs = [subprocess.Popen([*DASK, "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                              stdout=log, stderr=log)]  # fmt: skip
    worker = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
              "--no-dashboard", "--memory-limit", "0"]  # fmt: skip
    procs += [subprocess.Popen(worker, stdout=log, stderr=log) for _ in range(workers)]
    from distributed import Client

    with Client(address, timeout=30, set_as_default=False) as client:
        client.wait_for_workers(workers, timeout=60)
    return address, procs


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "runs", nargs="*", type=Path, help="run directories (report_scale.py --keep makes them)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the checks (default 2)")
    parser.add_argument("--jobs", type=int, default=2, help="local cores, and Dask workers started (2)")
    parser.add_argument("--scheduler", help="an existing Dask scheduler (default: start one here)")
    parser.add_argument("--report", action="store_true", help="also time whole reports and cmp findings")
    parser.add_argument("--out", type=Path, help="where the findings copies go (default: a temp folder)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        modes = [("1 core", {"jobs": 1}), (f"{args.jobs} cores", {"jobs": args.jobs})]
        if args.scheduler:
            modes.append(("dask", {"scheduler": args.scheduler}))
        run_checks(args.child, modes, args.rounds)
        return 0
    if not args.runs:
        parser.error("give at least one run directory")
    out = args.out or Path(tempfile.mkdtemp(prefix="report-parallel-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{os.cpu_count()} CPUs; load average at start {os.getloadavg()[0]:.1f}; findings copies in {out}")
    scheduler, procs = (args.scheduler, []) if args.scheduler else start_cluster(args.jobs, out)
    try:
        for run in args.runs:
            if args.rounds > 0:  # --rounds 0: whole reports only
                print(f"{run}: the memory checks (read once, then interleaved)", flush=True)
                child = [sys.executable, __file__, "--child", str(run), "--rounds", str(args.rounds)]
                child += ["--jobs", str(args.jobs), *(["--scheduler", scheduler] if scheduler else [])]
                subprocess.run(child, check=False)
            if args.report:
                print(f"{run}: whole reports", flush=True)
                modes = [("1 core", ["--jobs", "1"]), (f"{args.jobs} cores", ["--jobs", str(args.jobs)])]
                if scheduler:
                    modes.append(("dask", ["--scheduler", scheduler]))
                run_reports(run, [(n.replace(" ", ""), m) for n, m in modes], scheduler, out)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=30)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
