"""Run the job as it is (A) and with each candidate change (B1, B2, ...), interleaved, within a budget.

A round is one run of A and one of every candidate still being tried, in an order that alternates
(A B1 B2 ... then ... B2 B1 A), so load that drifts on a shared machine, and whatever the position in a
round does (a warm page cache), hits both sides alike. Rounds come in such pairs, so each position is
held as often by A as by B: a new pair starts while both of its rounds fit the budget (their time
estimated from the rounds so far), up to --max-rounds. Every run is a run directory of its
own under RUN/verify/, written by the same command the job ran under (`job` for the embedded job,
`watch` for a script), with `--steps` warm-up + N steps and the candidate's `--set`.

A B run that watch refuses (exit 2: the script gives the key no hold) makes the candidate "not
verifiable here" with watch's own line; a B run that fails otherwise makes it "hurts" (the change broke
the job). An A run that fails ends verification: the job does not run unchanged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import ProbeFailed
from ciuic_doctor.processes import die_with_parent
from ciuic_doctor.verify.plan import Candidate

VERIFY_DIR = "verify"
REFUSED_EXIT = 2  # watch --set: the script gives the key no hold (probes/watch/overrides.py)
REFUSAL = "--set cannot be applied"  # watch's refusal line; under torchrun the exit code is torchrun's 1


@dataclass(kw_only=True)
class JobCommand:
    """How to start one run of the job: `argv(out, set_items)` and where to start it."""

    kind: str  # job | watch
    base: list[str]  # the command up to (not including) --out / --set
    tail: list[str] = field(default_factory=list)  # after the options (watch: -- script argv)
    launcher: list[str] = field(default_factory=lambda: [sys.executable])
    cwd: str | None = None
    spec_text: str | None = None  # the embedded job: its spec, written to RUN/verify/base.toml
    env: dict[str, str] = field(default_factory=dict)  # what the run's own spec exports (shown first)
    # cluster.spread.Spread: each run a step over the nodes of a Slurm allocation (or a batch job), for a
    # job that ran on several nodes (verify/nodes.py); None: a process on this host (run_once)
    spread: Any = None

    def argv(self, out: Path, set_items: list[str]) -> list[str]:
        sets = [x for item in set_items for x in ("--set", item)]
        return [*self.launcher, "-m", "ciuic_doctor", *self.base, "--out", str(out), *sets, *self.tail]


@dataclass(kw_only=True)
class RunResult:
    side: str  # "A" or a candidate id
    round: int
    path: str
    seconds: float
    exit_code: int | None  # None: timed out
    last_line: str = ""
    queue_s: float = 0.0  # waiting for the scheduler's resources: not the job's time, not in the budget

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(kw_only=True)
class Schedule:
    budget_s: float
    max_rounds: int = 12
    min_rounds: int = 3
    run_timeout_s: float = 600.0


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)  # every run gets --out explicitly
    return env


def _last_line(text: str) -> str:
    """What a run's output says of its end: watch's --set refusal when there is one, else the last line."""
    from ciuic_doctor.render_text import terminal

    lines = [line.strip() for line in text.splitlines() if line.strip()]
    refusal = [line for line in lines if REFUSAL in line]
    return terminal((refusal or lines or [""])[-1][:600])  # a job's bytes never reach the terminal raw


def run_once(
    command: JobCommand, out: Path, set_items: list[str], timeout_s: float
) -> tuple[int | None, str]:
    """One run in its own process group (a timeout or Ctrl-C takes its ranks and workers with it)."""
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        proc = subprocess.Popen(
            command.argv(out, set_items),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=command.cwd,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - one libc call, prepared before the fork
        )
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        except BaseException:  # Ctrl-C: end the run's whole group before going
            _kill_group(proc)
            raise
        if code is None:
            _kill_group(proc)
        log.seek(0)
        text = log.read()
    if out.is_dir():
        from ciuic_doctor.rundir.store import RunDir

        RunDir(out).write_text("verify-run.log", text)  # secrets scrubbed, next to the run's records
    return code, _last_line(text)


def launch(
    command: JobCommand, out: Path, set_items: list[str], timeout_s: float
) -> tuple[int | None, str, float]:
    """One run through the job's launcher: (exit code, last line, seconds queued). On this host
    (run_once), or one torchrun per node as a Slurm step or batch job (verify/nodes.py)."""
    if command.spread is None:
        code, line = run_once(command, out, set_items, timeout_s)
        return code, line, 0.0
    from ciuic_doctor.verify.nodes import run_on_nodes

    code, text, queue_s = run_on_nodes(command, out, set_items, timeout_s)
    if out.is_dir():
        from ciuic_doctor.rundir.store import RunDir

        RunDir(out).write_text("verify-run.log", text)
    return code, _last_line(text), queue_s


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def interleave(
    command: JobCommand,
    candidates: list[Candidate],
    root: Path,
    schedule: Schedule,
    say: Callable[[str], None],
) -> tuple[list[RunResult], dict[str, str]]:
    """Rounds of A and every tried candidate; returns every run and, per candidate dropped on the way,
    why ("refused: ..." or "failed: ..."). Raises ProbeFailed when the job fails unchanged."""
    tried = [c for c in candidates if not c.unverifiable]
    dropped: dict[str, str] = {}
    results: list[RunResult] = []
    started = time.perf_counter()
    queued = 0.0  # seconds the runs waited for the scheduler: kept out of the budget, and said so
    round_times: list[float] = []
    timeout_s = schedule.run_timeout_s
    for rnd in range(1, schedule.max_rounds + 1):
        active = [c for c in tried if c.id not in dropped]
        if not active:
            break
        elapsed = time.perf_counter() - started - queued
        if round_times and rnd % 2 == 1:  # a new pair of rounds (A first, then A last) must fit whole
            estimate = sum(round_times) / len(round_times) * (len(active) + 1) / (len(tried) + 1)
            pair = min(2, schedule.max_rounds - rnd + 1)
            if elapsed + pair * estimate > schedule.budget_s:
                say(
                    f"verify: budget {schedule.budget_s:.0f} s: stopping after {rnd - 1} round(s) "
                    f"({elapsed:.0f} s spent; a round takes about {estimate:.0f} s)"
                    + (f"; {queued:.0f} s in the queue, not counted" if queued else "")
                )
                break
        order: list[Candidate | None] = [None, *active]
        if rnd % 2 == 0:
            order.reverse()
        t_round = time.perf_counter()
        for cand in order:
            side = "A" if cand is None else cand.id
            out = root / f"r{rnd:02d}-{side}"
            t0 = time.perf_counter()
            # the budget holds from the first run on; time waiting in the scheduler's queue is not the job's
            left = schedule.budget_s - (t0 - started - queued)
            limit = min(timeout_s, max(left, 1.0))
            code, line, queue_s = launch(command, out, cand.set_items() if cand else [], limit)
            queued += queue_s
            if code is None and limit < timeout_s:
                _budget_spent(schedule, rnd, side, out, say)
                return [r for r in results if r.round != rnd], dropped  # a round cut short is no pair
            result = RunResult(
                side=side, round=rnd, path=str(out), seconds=time.perf_counter() - t0 - queue_s,
                exit_code=code, last_line=line, queue_s=queue_s,
            )  # fmt: skip
            results.append(result)
            if cand is None and not result.ok:
                raise ProbeFailed(
                    f"verify: the job failed unchanged in round {rnd} "
                    f"({'timed out' if code is None else f'exit code {code}'}): {line}; records in {out}"
                )
            if cand is not None and not result.ok:
                if command.kind == "watch" and (code == REFUSED_EXIT or REFUSAL in line):
                    dropped[cand.id] = f"refused: {line}"
                else:
                    dropped[cand.id] = (
                        f"failed: {'timed out' if code is None else f'exit code {code}'}: {line}"
                    )
            if rnd == 1 and cand is None:  # a run several times longer than the unchanged job is stuck
                timeout_s = min(schedule.run_timeout_s, max(120.0, 5 * result.seconds))
            what = "A (as it is)" if cand is None else f"{cand.id} {cand.label}"
            status = (
                "ok"
                if result.ok
                else ("refused" if side in dropped and "refused" in dropped[side] else "FAILED")
            )
            say(
                f"verify [round {rnd}] {what:<40.40s} {status:<7} {result.seconds:6.1f} s"
                f"{_figures(out) if result.ok else ' — ' + line}"
                + (f" (+{queue_s:.1f} s queued)" if queue_s >= 0.05 else "")
            )
        round_times.append(time.perf_counter() - t_round - sum(r.queue_s for r in results if r.round == rnd))
    return results, dropped


def _budget_spent(schedule: Schedule, rnd: int, side: str, out: Path, say: Callable[[str], None]) -> None:
    """A run cut by --budget: in the first round nothing can be judged (ProbeFailed); later, the round
    it was in is left out and the rounds before it are judged."""
    if rnd == 1:
        raise ProbeFailed(
            f"verify: --budget {schedule.budget_s:.0f} s ran out before the first round ended (run {side} "
            f"still going: stopped); records in {out}; give a larger --budget or fewer --verify-steps"
        )
    say(f"verify: budget {schedule.budget_s:.0f} s spent during round {rnd} (run {side} stopped); "
        f"judged on the {rnd - 1} round(s) before it")  # fmt: skip


def _figures(out: Path) -> str:
    """The run's mean step time and time before backward, for the progress line."""
    from ciuic_doctor.verify.figures import run_figures

    fig = run_figures(out)
    parts = []
    if fig.step_time_s is not None:
        parts.append(f"step {fig.step_time_s * 1e3:.1f} ms")
    if fig.pre_backward_s is not None:
        parts.append(f"before backward {fig.pre_backward_s * 1e3:.1f} ms")
    return ("; " + ", ".join(parts)) if parts else ""


def describe(results: list[RunResult]) -> list[dict[str, Any]]:
    return [
        {
            "side": r.side,
            "round": r.round,
            "path": r.path,
            "seconds": round(r.seconds, 2),
            "exit_code": r.exit_code,
            **({"queue_s": round(r.queue_s, 2)} if r.queue_s else {}),
            **({"last_line": r.last_line} if not r.ok else {}),
        }
        for r in results
    ]
