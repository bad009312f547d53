"""The whole checkup of a training job in one command, into one run directory. On the embedded
DeepSeek-V3 job by default (or the job --spec describes; `-- train.py [args]` checks your own script,
see _checkup_script), each phase runs as a `python -m ciuic_doctor`
subprocess writing into the same RUN, in this order: comm-bench on --nproc local ranks (a small size range;
with CUDA up to twice the gradient bucket, so Ring vs Tree is judged where the job's all-reduces are);
loader-sweep within --loader-budget seconds; the job itself under watch, with memwatch attached to it by
PID; checkpoint-check when this build has it; then the analyses, the recommendations, the seed-tip check,
report.html and summary.md. A line per phase shows its time, and the summary is printed at the end. A phase
that fails, times out or is missing is recorded in meta.json with the reason and the checkup goes on: the
report shows that section as not run, or shows the records it left with a warning. Each phase's output is
kept in RUN/checkup-<phase>.log (secrets scrubbed). Exit code 0 when the checkup completed, whatever it
found (with --strict, 1 when any check failed); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ciuic_doctor.cli_args import add_out, positive_float, positive_int

NAME = "checkup"
HELP = "measure the job end to end (collectives, loader, steps, memory) and write the report"
ORDER = 10

CPU_MAX_BYTES = "4M"  # gloo on a CPU box: the small sizes are enough to see latency and bandwidth
MEMWATCH_INTERVAL_S = "0.2"


@dataclass(kw_only=True)
class Phase:
    """One step of the checkup as meta.json records it (the report reads `reason` for not-run sections)."""

    name: str
    status: str = "pending"  # ok | failed | timeout | missing | skipped
    seconds: float = 0.0
    reason: str = ""
    argv: list[str] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", metavar="JOB.TOML", help="the job to check (default: the embedded DeepSeek-V3 job)"
    )
    add_out(parser)
    parser.add_argument(
        "--nproc",
        type=positive_int,
        help="local ranks (default: the spec's procs_per_node; for a script 1, more runs it under torchrun)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        help="training steps of the job (default: the spec's); a script is stopped cleanly after N "
        "optimizer steps",
    )
    parser.add_argument(
        "--loader-budget", type=positive_float, default=20.0, metavar="S", help="loader-sweep budget (20 s)"
    )
    parser.add_argument(
        "--skip", default="", metavar="LIST", help="phases to leave out, e.g. comm-bench,loader-sweep"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when any check failed")
    parser.add_argument(
        "--baseline",
        metavar="RUN",
        help="an earlier checkup to compare with (apply and verify: checkup, apply the recommendations, "
        "checkup --baseline <first run>)",
    )
    script = parser.add_argument_group("your own script (issue 14): checkup [options] -- train.py [args]")
    script.add_argument(
        "--dataset",
        metavar="MODULE:CALLABLE",
        help="rebuilds the script's dataset for loader-sweep (else loader-sweep is not run)",
    )
    script.add_argument(
        "--timeout",
        type=positive_float,
        default=1800.0,
        metavar="S",
        help="the script's time limit under watch (default 1800 s; --steps N keeps it short)",
    )
    script.add_argument(
        "script_argv",  # not "command": the CLI front keeps the sub-command's name there
        nargs=argparse.REMAINDER,
        metavar="-- script.py [args] | -- -m module [args]",
        help="check your own training script instead of the embedded job, e.g. "
        "`ciuic-doctor checkup --nproc 2 --steps 50 -- train.py --config tiny.yaml`",
    )


def _available(command: str) -> bool:
    module = command.replace("-", "_")
    return importlib.util.find_spec(f"ciuic_doctor.commands.{module}") is not None


def _child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)  # every child gets --out explicitly
    return env


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


class Checkup:
    """Runs the phases in order, prints a line per phase, and keeps meta.json's phase log current."""

    def __init__(self, run: Any, total: int) -> None:
        self.run = run
        self.total = total
        self.phases: list[Phase] = []
        self.numbers: dict[str, int] = {}

    def _number(self, name: str) -> int:
        return self.numbers.setdefault(name, len(self.numbers) + 1)

    def _record(self, phase: Phase) -> None:
        self.phases.append(phase)
        self.run.update_meta(checkup={"phases": [asdict(p) for p in self.phases]})
        mark = {"ok": "ok", "skipped": "skipped"}.get(phase.status, "NOT RUN")
        why = f" — {phase.reason}" if phase.reason and phase.status != "ok" else ""
        self.say(phase.name, f"{mark:<8} {phase.seconds:6.1f} s{why}")

    def say(self, name: str, text: str) -> None:
        print(f"checkup [{self._number(name)}/{self.total}] {name:<17} {text}", flush=True)

    def skip(self, name: str, reason: str, status: str = "skipped") -> None:
        self._record(Phase(name=name, status=status, reason=reason))

    def start(
        self, name: str, argv: list[str], launcher: list[str] | None = None
    ) -> tuple[Phase, subprocess.Popen | None]:
        """Start `python -m ciuic_doctor <argv>`, or `<launcher> -m ciuic_doctor <argv>` (torchrun)."""
        phase = Phase(name=name, argv=argv)
        if not _available(name):
            phase.status, phase.reason = "missing", f"the {name} command is not available in this build"
            return phase, None
        self.say(name, "running...")
        # The raw output may echo a secret: it goes to an anonymous temp file (gone even after a crash or
        # Ctrl-C), and only its scrubbed copy reaches the run directory.
        log = tempfile.TemporaryFile("w+", errors="replace")  # noqa: SIM115 (closed in finish)
        command = [*(launcher or [sys.executable]), "-m", "ciuic_doctor", *argv]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), text=True)
        proc.log = log  # type: ignore[attr-defined]
        phase.seconds = time.perf_counter()
        return phase, proc

    def finish(self, phase: Phase, proc: subprocess.Popen | None, timeout_s: float) -> None:
        if proc is None:
            self._record(phase)
            return
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = None
        phase.seconds = time.perf_counter() - phase.seconds
        log = proc.log  # type: ignore[attr-defined]
        log.seek(0)
        output = log.read()
        log.close()
        self.run.write_text(f"checkup-{phase.name}.log", output)  # store.write_text scrubs secrets
        if code is None:
            phase.status, phase.reason = "timeout", f"did not finish within {timeout_s:.0f} s"
        elif code == 0:
            phase.status = "ok"
        else:
            phase.status, phase.reason = "failed", f"exit code {code}: {_last_line(output)}"
        self._record(phase)

    def report(self, args: argparse.Namespace, started: float, baseline: Any = None) -> int:
        """The last phase: analyses, recommendations and report (compared with `baseline`, a RunDir, when
        given); prints the summary; the exit code."""
        from ciuic_doctor.report import build_report

        t0 = time.perf_counter()
        result = build_report(self.run, spec_path=args.spec, analyze=True, baseline=baseline)
        self.phases.append(Phase(name="report", status="ok", seconds=time.perf_counter() - t0))
        total_s = round(time.perf_counter() - started, 2)
        from ciuic_doctor.hang_files import has_hang_dumps

        # Did the job hang (issue 16): a rank dumped hang files, or the job phase ran out of time.
        hung = has_hang_dumps(self.run.path) or any(
            p.name == "job" and p.status == "timeout" for p in self.phases
        )
        phases = [asdict(p) for p in self.phases]
        self.run.update_meta(checkup={"phases": phases, "seconds": total_s, "hung": hung})
        self.say("report", f"{'ok':<8} {time.perf_counter() - t0:6.1f} s")
        print()
        print(result.summary)
        if hung:
            print(f"the job hung: `ciuic-doctor hang {self.run.path}` says which rank, where and why")
        if baseline is not None:
            from ciuic_doctor.compare import summary_lines

            print("\n".join(["", *summary_lines(self.run.read_json("comparison.json"))]))
        print(
            f"checkup finished in {time.perf_counter() - started:.0f} s; open {result.paths['report.html']}"
        )
        return 1 if args.strict and result.overall == "fail" else 0

    def run_phase(self, name: str, argv: list[str], timeout_s: float) -> Phase:
        phase, proc = self.start(name, argv)
        self.finish(phase, proc, timeout_s)
        return phase


def parse_skip(text: str, phases: tuple[str, ...]) -> set[str]:
    """--skip's phases; an unknown one is a usage error (`--skip foo` was ignored and every phase ran)."""
    from ciuic_doctor.errors import UserError

    skip = {s.strip() for s in text.split(",") if s.strip()}
    if unknown := sorted(skip - set(phases)):
        raise UserError(f"--skip: unknown phase(s) {', '.join(unknown)}; choose from {','.join(phases)}")
    return skip


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.commands import _checkup_script
    from ciuic_doctor.errors import UserError

    if script := _checkup_script.script_argv(args):  # issue 14: the user's own script
        return _checkup_script.run(args, script)
    if args.dataset:
        raise UserError("--dataset rebuilds a script's dataset: give the script, `checkup ... -- train.py`")
    from ciuic_doctor.jobs.spec import load_spec
    from ciuic_doctor.launch import check_nproc
    from ciuic_doctor.store import RunDir, default_run_path
    from ciuic_doctor.units import format_size_short

    skip = parse_skip(args.skip, ("comm-bench", "loader-sweep", "job", "memwatch", "checkpoint-check"))
    spec = load_spec(args.spec)
    baseline = RunDir.open(args.baseline) if args.baseline else None  # a wrong path fails before measuring
    nproc = args.nproc or spec.job.procs_per_node
    check_nproc(nproc, "--nproc" if args.nproc else "the spec's [job] procs_per_node =")
    run_dir = RunDir.create(default_run_path("checkup", args.out))
    out = str(run_dir.path)
    spec_args = ["--spec", str(Path(args.spec).resolve())] if args.spec else []
    started = time.perf_counter()
    run_dir.record_environment()
    run_dir.update_meta(spec=spec.to_dict(), spec_source=spec.source, checkup={"phases": []})
    print(f"checkup of {spec.job.name}: {nproc} local rank(s), run directory {out}", flush=True)

    bucket = int(spec.distributed.bucket_cap_mb * 2**20)
    cuda = run_dir.read_meta()["env"].get("cuda_available")
    max_bytes = format_size_short(1 << (2 * bucket - 1).bit_length()) if cuda else CPU_MAX_BYTES
    job_argv = ["job", "--nproc", str(nproc), "--out", out, *spec_args]
    if args.steps:
        job_argv += ["--steps", str(args.steps)]
    comm_argv = ["comm-bench", "--nproc", str(nproc), "--out", out, "-b", "1K", "-e", max_bytes, "-f", "4"]
    comm_argv += ["--time-budget", "0.05", "--timeout", "60", "--bucket-bytes", str(bucket)]
    loader_argv = ["loader-sweep", *spec_args, "--budget", f"{args.loader_budget:g}"]
    loader_argv += ["--local-world-size", str(nproc), "--out", out]
    plan = [
        ("comm-bench", comm_argv, 180.0),
        ("loader-sweep", loader_argv, args.loader_budget + 90.0),
        ("job", job_argv, 300.0),
        ("memwatch", [], 0.0),  # attached to the job, see below
        ("checkpoint-check", ["checkpoint-check", *spec_args, "--nproc", str(nproc), "--out", out], 180.0),
    ]
    checkup = Checkup(run_dir, total=len(plan) + 1)
    for name, argv, timeout_s in plan:
        if name == "memwatch":
            continue  # recorded together with the job
        if name in skip:
            checkup.skip(name, "left out with --skip")
            if name == "job":
                checkup.skip("memwatch", "no job to attach to (job left out with --skip)")
            continue
        if name != "job":
            checkup.run_phase(name, argv, timeout_s)
            continue
        job, job_proc = checkup.start("job", argv)
        watcher, watch_proc = (None, None)
        if job_proc is not None and "memwatch" not in skip:
            watch_argv = ["memwatch", "--pid", str(job_proc.pid), "--interval", MEMWATCH_INTERVAL_S]
            watcher, watch_proc = checkup.start("memwatch", [*watch_argv, "--out", out])
        checkup.finish(job, job_proc, timeout_s)
        if watcher is not None:
            checkup.finish(watcher, watch_proc, 30.0)  # it ends when the job's process tree does
        else:
            checkup.skip("memwatch", "left out with --skip" if "memwatch" in skip else "no job to attach to")

    return checkup.report(args, started, baseline=baseline)
