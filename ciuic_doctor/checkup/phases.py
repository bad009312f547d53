"""The checkup's phase runner: each phase a `python -m ciuic_doctor <command>` subprocess writing into one
run directory, a progress line per phase, meta.json's phase log kept current, and the report at the end.

Shared by the two forms of `ciuic-doctor checkup` (the embedded job in commands/checkup.py, the user's
script in checkup/script.py); it sits below both so that neither imports the other.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ciuic_doctor.processes import die_with_parent

CPU_MAX_BYTES = "4M"  # gloo on a CPU box: the small sizes are enough to see latency and bandwidth
MEMWATCH_INTERVAL_S = "0.2"


@dataclass(kw_only=True)
class Phase:
    """One step of the checkup as meta.json records it (the report reads `reason` for not-run sections)."""

    name: str
    status: str = "pending"  # ok | failed | timeout | skipped
    seconds: float = 0.0
    reason: str = ""
    argv: list[str] = field(default_factory=list)


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
        self,
        name: str,
        argv: list[str],
        launcher: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> tuple[Phase, subprocess.Popen | None]:
        """Start `python -m ciuic_doctor <argv>`, or `<launcher> -m ciuic_doctor <argv>` (torchrun, or
        srun then python: a step on every node), with `env` added to ours."""
        phase = Phase(name=name, argv=argv)
        self.say(name, "running...")
        # The raw output may echo a secret: it goes to an anonymous temp file (gone even after a crash or
        # Ctrl-C), and only its scrubbed copy reaches the run directory.
        log = tempfile.TemporaryFile("w+", errors="replace")  # noqa: SIM115 (closed in finish)
        command = [*(launcher or [sys.executable]), "-m", "ciuic_doctor", *argv]
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**_child_env(), **(env or {})},
            text=True,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - one libc call, prepared before the fork
        )
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
        from ciuic_doctor.rundir.hang.files import has_hang_dumps

        # Did the job hang: the hang doctor judged the ranks' dumps a hang (a dump made when checkup's own
        # --timeout stopped a slow, healthy job says "not hung when dumped"). A job phase that ran out of
        # --timeout is "did not finish", not "hung".
        hung = has_hang_dumps(self.run.path) and any(
            f.probe == "hang" and f.check == "hang" and f.verdict == "fail" for f in result.findings
        )
        unfinished = [p for p in self.phases if p.name == "job" and p.status == "timeout"]
        phases = [asdict(p) for p in self.phases]
        self.run.update_meta(checkup={"phases": phases, "seconds": total_s, "hung": hung})
        self.say("report", f"{'ok':<8} {time.perf_counter() - t0:6.1f} s")
        print()
        print(result.summary)
        if hung:
            print(f"the job hung: `ciuic-doctor hang {self.run.path}` says which rank, where and why")
        elif unfinished:
            print(f"the job did not finish: {unfinished[0].reason} (--timeout); its records so far are kept")
        if baseline is not None:
            from ciuic_doctor.compare import summary_lines

            print("\n".join(["", *summary_lines(self.run.read_json("comparison.json"))]))
        print(
            f"checkup finished in {time.perf_counter() - started:.0f} s; open {result.paths['report.html']}"
        )
        if not getattr(args, "verify", False):  # --verify goes on to try them, and says what it found
            print(result.closing_line())
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
