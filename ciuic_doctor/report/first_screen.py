"""The report's first screen: the answer before the evidence.

    verdict           one line: the overall verdict, how many checks warn or fail, how many changes
    proved            the changes `verify` showed to help on this job, with B / A and its 95 % interval
    not yet tried     the changes no run has tried, the exact command that tries them and how long it takes
    look at           warn/fail findings that no setting fixes (a straggler, a leak, a spike), each a link to
                      the section with its evidence

A recommendation whose `setting` is not a job-spec key or an environment variable (recommend.setting_kind
"advice", e.g. "straggler (from a step on)") is never listed as a change: it is something to look at.

The time estimate follows how `verify` schedules its runs (ciuic_doctor/verify/runner.py): a round is one
run of the job as it is plus one per change, each run WARMUP + STEPS steps plus the job's start-up; rounds
come in pairs, the first pair always, more while they fit the budget, at most MAX_ROUNDS. The step time is
the job's own median; the start-up is what the checkup's job phase took beyond its steps (else
DEFAULT_STARTUP_S, said so). tests/test_report_first_screen.py checks these constants against verify's.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ciuic_doctor.compare.change import interval, percent
from ciuic_doctor.recommend import Plan, is_change, setting_kind
from ciuic_doctor.recommend.verified import HELPS, HURTS, NO_EFFECT, NOT_VERIFIABLE, fact, status_of
from ciuic_doctor.report.blocks import Section
from ciuic_doctor.report.imported import import_summary
from ciuic_doctor.rundir.findings import Finding

# verify's defaults (ciuic_doctor/verify: DEFAULT_BUDGET_S, DEFAULT_STEPS, WARMUP_STEPS; Options.max_rounds)
VERIFY_BUDGET_S, VERIFY_STEPS, VERIFY_WARMUP, MAX_ROUNDS = 480.0, 20, 2, 12
DEFAULT_STARTUP_S = (
    15.0  # torchrun + imports + model build of the embedded job on 2 CPU cores, measured ~12 s
)
SHOWN = 4  # rows of each list on the first screen; the rest are counted, with a link to the full table
SETTING_KINDS = ("spec", "env")
# Findings that happen at a step or to a rank, which no setting fixes: first under "look at".
EVENTS = ("straggler", "straggler_onset", "slow_host", "memory_leak", "loss_spike", "grad_norm_spike",
          "overflow_storm", "hang", "divergence", "rank_desync", "worker_memory_growth")  # fmt: skip
# A finding (by check, else by probe) and the settings whose change answers it.
COVERED_BY = {"loader": "dataloader.", "clipping": "optim.clip_max_norm", "loss_scaler": "precision."}


@dataclass(kw_only=True)
class Change:
    setting: str
    current: str
    value: str
    note: str = ""  # proved: "step time −12 % (95 % CI …)"; not tried: the reason it was recommended


@dataclass(kw_only=True)
class LookAt:
    verdict: str
    what: str
    summary: str
    anchor: str
    step: int | None = None


@dataclass(kw_only=True)
class Estimate:
    seconds: float
    rounds: int
    runs_per_round: int
    step_s: float
    startup_s: float
    startup_measured: bool

    @property
    def short(self) -> str:
        minutes = self.seconds / 60
        return f"about {minutes:.0f} min" if minutes >= 1.5 else f"about {self.seconds:.0f} s"

    @property
    def how(self) -> str:
        """The estimate's arithmetic on one line."""
        return (
            f"{self.rounds} rounds × {self.runs_per_round} runs × ({VERIFY_WARMUP + VERIFY_STEPS} steps × "
            f"{self.step_s:.2f} s + {self.startup_s:.0f} s start-up)"
        )

    @property
    def why(self) -> str:
        """Where each number of `how` comes from."""
        startup = (
            "what the checkup's job phase took beyond its steps"
            if self.startup_measured
            else f"assumed ({DEFAULT_STARTUP_S:.0f} s: this run recorded no job phase to measure it from)"
        )
        return (
            f"A round runs the job as it is and once per change ({self.runs_per_round} runs), each "
            f"{VERIFY_WARMUP} warm-up + {VERIFY_STEPS} steps at the job's median step time "
            f"({self.step_s:.2f} s) plus its start-up, {startup}. Rounds come in pairs: the first pair "
            f"always, more while they fit verify's {VERIFY_BUDGET_S:.0f} s budget, at most {MAX_ROUNDS}."
        )


@dataclass(kw_only=True)
class FirstScreen:
    overall: str
    headline: str
    proved: list[Change] = field(default_factory=list)
    untried: list[Change] = field(default_factory=list)
    tried_no_gain: list[str] = field(default_factory=list)  # "NCCL_ALGO (no measurable effect)"
    command: str = ""  # what tries the untried changes ("" when nothing can re-run the job)
    alternative: str = ""
    cannot_try: str = ""  # why no command (an imported log)
    estimate: Estimate | None = None
    look_at: list[LookAt] = field(default_factory=list)
    more_look_at: int = 0

    def to_dict(self) -> dict[str, Any]:
        """For the page's data block: the first screen as data, the closing line included."""
        data = asdict(self)
        if self.estimate is not None:
            data["estimate"] = {**data["estimate"], "how": self.estimate.how}
        return {**data, "closing_line": self.closing_line()}

    def closing_line(self) -> str:
        """The last line `checkup` and `report` print: what is left to verify, and how."""
        n = len(self.untried)
        if not n:
            proved = f"{len(self.proved)} change(s) proved on this job" if self.proved else "no change to try"
            return f"nothing left to verify: {proved}"
        changes = f"{n} change{'s' if n != 1 else ''} not yet tried on this job"
        if not self.command:
            return f"{changes}: {self.cannot_try}"
        took = f" ({self.estimate.short}, estimated)" if self.estimate else ""
        return f"{changes}: `{self.command}` tries {'it' if n == 1 else 'them'}{took}"


def _shown(value: Any) -> str:
    from ciuic_doctor.report.html import show_value

    return "unset" if value is None else show_value(value)


def rerun_command(meta: dict[str, Any], run_path: str) -> tuple[str, str, str]:
    """(command, alternative, why none): `verify RUN` re-runs the embedded job from its recorded spec or
    a watched script from its argv (verify.job_of); an imported log has no job to re-run."""
    probes = meta.get("probes") if isinstance(meta.get("probes"), dict) else {}
    watch = probes.get("watch") if isinstance(probes.get("watch"), dict) else {}
    spec = meta.get("spec") if isinstance(meta.get("spec"), dict) else {}
    if ("job" in probes and "optim" in spec) or isinstance(watch.get("argv"), list):
        checkup = "ciuic-doctor checkup --verify" if isinstance(meta.get("checkup"), dict) else ""
        return f"ciuic-doctor verify {shlex.quote(run_path)}", checkup, ""
    if import_summary(meta) is not None:
        return (
            "",
            "",
            "an imported log cannot be re-run here: apply them to the job, then `ciuic-doctor compare`",
        )
    return "", "", "this run recorded no job to re-run (run it under `ciuic-doctor watch`)"


def estimate(n_changes: int, step_s: float | None, meta: dict[str, Any], steps_run: int) -> Estimate | None:
    """verify's wall time for `n_changes` changes (see the module docstring for the model)."""
    if not n_changes or step_s is None or step_s <= 0:
        return None
    startup, measured = DEFAULT_STARTUP_S, False
    for phase in ((meta.get("checkup") or {}).get("phases")) or []:
        if isinstance(phase, dict) and phase.get("name") in ("job", "watch") and phase.get("status") == "ok":
            seconds = phase.get("seconds")
            if isinstance(seconds, int | float) and steps_run and seconds > steps_run * step_s:
                startup, measured = seconds - steps_run * step_s, True
    runs = n_changes + 1
    round_s = runs * ((VERIFY_WARMUP + VERIFY_STEPS) * step_s + startup)
    rounds = 2
    while rounds + 2 <= MAX_ROUNDS and (rounds + 2) * round_s <= VERIFY_BUDGET_S:
        rounds += 2
    return Estimate(
        seconds=rounds * round_s, rounds=rounds, runs_per_round=runs, step_s=step_s,
        startup_s=startup, startup_measured=measured,
    )  # fmt: skip


def anchors_of(sections: Sequence[Section]) -> dict[str, str]:
    """probe -> the id of the section that shows its evidence (the first that ran)."""
    out: dict[str, str] = {"settings": "settings"}  # recommend's verdicts on the current settings
    for s in sections:
        for probe in s.probes:
            if s.ran:
                out.setdefault(probe, s.id)
    return out


def build(
    *,
    overall: str,
    findings: Sequence[Finding],
    plan: Plan,
    sections: Sequence[Section],
    meta: dict[str, Any],
    run_path: str,
    step_s: float | None,
    steps_run: int,
) -> FirstScreen:
    """The first screen of a report (`plan` after recommend.verified.apply)."""
    from ciuic_doctor.report.overview import finding_step

    proved, untried, no_gain, advice = [], [], [], []
    for rec in plan.recommendations:
        if setting_kind(rec.setting) not in SETTING_KINDS:
            if is_change(rec):
                advice.append(rec)
            continue
        status = status_of(rec)
        found = rec.evidence.get("verification") or {}
        if status in (NO_EFFECT, HURTS, NOT_VERIFIABLE):
            no_gain.append(f"{rec.setting} ({status})")
            continue
        if not is_change(rec):
            continue
        row = Change(setting=rec.setting, current=_shown(rec.current), value=_shown(rec.value))
        if status == HELPS:
            if found.get("follows"):  # forced by another change (num_workers=0 unsets prefetch_factor)
                row.note = f"comes with {found['follows']}"
            elif found.get("ratio") is not None and found.get("ci_low") is not None:
                row.note = (
                    f"{found.get('target_metric')} {percent(found['ratio'])} "
                    f"(95 % CI {interval(found['ci_low'], found['ci_high'])}, {found.get('rounds')} rounds)"
                )
            proved.append(row)
        elif not fact(rec):
            row.note = rec.why
            untried.append(row)
    anchors = anchors_of(sections)
    changed = [c.setting for c in [*proved, *untried]]
    flagged = sorted(
        (f for f in findings if f.verdict in ("fail", "warn")),
        key=lambda f: (
            f.verdict != "fail",
            _covered(f, changed),
            finding_step(f) is None and f.check not in EVENTS,
        ),
    )
    look = [
        LookAt(
            verdict=f.verdict, what=f"{f.probe}/{f.check}", summary=f.summary,
            anchor=anchors.get(f.probe, "verdicts"), step=finding_step(f),
        )
        for f in flagged
    ]  # fmt: skip
    said = [f.summary for f in flagged]
    for rec in advice:  # a finding in a recommendation's clothes: what to look at, not a setting
        if any(summary and (summary in rec.why or rec.why in summary) for summary in said):
            continue  # the finding it repeats is listed already
        look.append(LookAt(verdict="warn", what=rec.setting, summary=rec.why, anchor="settings"))
    command, alternative, cannot = rerun_command(meta, run_path)
    screen = FirstScreen(
        overall=overall,
        headline="",
        proved=proved,
        untried=untried,
        tried_no_gain=no_gain,
        command=command,
        alternative=alternative,
        cannot_try=cannot,
        estimate=estimate(len(untried), step_s, meta, steps_run) if command else None,
        look_at=look[:SHOWN],
        more_look_at=max(0, len(look) - SHOWN),
    )
    screen.headline = _headline(overall, findings, screen, len(look))
    return screen


def _covered(finding: Finding, settings: Sequence[str]) -> bool:
    """A finding a listed change answers (the DataLoader's, the clip threshold's): it goes after the
    findings no setting fixes, which are what "look at" is for."""
    prefix = COVERED_BY.get(finding.check) or COVERED_BY.get(finding.probe)
    return prefix is not None and any(s.startswith(prefix) for s in settings)


def _headline(overall: str, findings: Sequence[Finding], screen: FirstScreen, looks: int) -> str:
    fails = sum(f.verdict == "fail" for f in findings)
    warns = sum(f.verdict == "warn" for f in findings)
    checked = sum(f.verdict != "not_run" for f in findings)
    parts = [f"{fails} fail, {warns} warn of {checked} checks that ran"]
    if screen.proved:
        parts.append(f"{len(screen.proved)} change(s) proved to help on this job")
    if screen.untried:
        parts.append(f"{len(screen.untried)} not yet tried")
    if not screen.proved and not screen.untried:
        parts.append("no setting to change")
    if looks:
        parts.append(f"{looks} thing(s) to look at")
    return "; ".join(parts)
