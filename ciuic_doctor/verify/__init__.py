"""Try every recommended change on the job it is for, and keep only what helps.

    from ciuic_doctor.verify import Options, verify_run
    data = verify_run(RunDir.open("reports/run"), Options(budget_s=480), say=print)

The job is the one RUN recorded: the embedded job (its spec from meta.json, its world size, its
injected faults) or the script watch ran (its argv and working directory, its rank count). It runs
without a question only when this user's watch or job signed what it re-runs (consent.py,
rundir/trust.py); otherwise after showing the command and a yes. Each changing recommendation of RUN
(from the report verify makes of RUN's records, never a recommendations.json found there) and each
`--try KEY=VALUE` is a candidate, tried alone against the job as it is, interleaved (runner.py), and
judged on the job's own figures (judge.py). RUN/verification.json holds the runs and a status with its
interval per candidate; the report reads it (recommend/verified.py).

    consent.py whether it may run: the signature, the folder, the rank count, --yes or a prompt
    plan.py    candidates, and why a change is not verifiable by short runs here
    runner.py  the interleaved A / B runs within the budget, a progress line per run
    judge.py   paired-by-round intervals, Holm over each candidate's figures, the status
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import UserError
from ciuic_doctor.recommend.verified import STATUSES, VERIFICATION_FILE
from ciuic_doctor.rundir.store import RunDir
from ciuic_doctor.verify.consent import Consent, decide
from ciuic_doctor.verify.consent import describe as describe_command
from ciuic_doctor.verify.consent import ranks as consent_ranks
from ciuic_doctor.verify.plan import JobKind, candidates
from ciuic_doctor.verify.runner import VERIFY_DIR, JobCommand, Schedule, describe, interleave

DEFAULT_BUDGET_S = 480.0  # the embedded job's verification in <= 10 minutes on 2 CPU cores
DEFAULT_STEPS = 20  # steady steps per run, after the warm-up
WARMUP_STEPS = 2  # analysis.steps.WARMUP_STEPS: step 1 has no time, step 2 still warms up


@dataclass(kw_only=True)
class Options:
    budget_s: float = DEFAULT_BUDGET_S
    steps: int = DEFAULT_STEPS
    max_rounds: int = 12
    tries: list[tuple[str, Any]] = field(default_factory=list)  # --try KEY=VALUE, in order
    only_tries: bool = False  # --try given: the recommendations are left out unless --with-recommendations
    nproc: int | None = None  # --nproc: ranks to re-run on instead of the recorded count
    consent: Consent = field(default_factory=Consent)  # --yes, or a prompt on a terminal
    slurm: Any = None  # verify.nodes.SlurmChoice: a multi-node job's runs go to its nodes through Slurm


def options_from_args(args: Any) -> Options:
    """Options from `verify`'s and `checkup --verify`'s shared flags (--budget, --verify-steps,
    --max-rounds, --try KEY=VALUE, --with-recommendations); a malformed --try is one line (UserError)."""
    from ciuic_doctor.probes.watch.overrides import parse_value

    tries: list[tuple[str, object]] = []
    for item in getattr(args, "tries", []) or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--try {item!r}: expected KEY=VALUE, e.g. --try dataloader.num_workers=4")
        tries.append((key.strip(), parse_value(text.strip())))
    return Options(
        budget_s=args.budget,
        steps=args.verify_steps,
        max_rounds=args.max_rounds,
        tries=tries,
        only_tries=bool(tries) and not getattr(args, "with_recommendations", False),
        nproc=getattr(args, "nproc", None),
        consent=Consent(yes=bool(getattr(args, "yes", False))),
    )


def _injections(job_run: dict[str, Any]) -> list[str]:
    """The run's injected faults in --inject form, so A and B carry the same demonstration."""
    inj = job_run.get("injections") if isinstance(job_run.get("injections"), dict) else {}
    out = []
    if inj.get("leak_mb_per_step"):
        out.append(f"leak={inj['leak_mb_per_step']:g}")
    for step, factor in (inj.get("spikes") or {}).items():
        out.append(f"spike={step}:{factor:g}")
    for step in inj.get("overflow_steps") or []:
        out.append(f"overflow={step}")
    for rank, ms in (inj.get("slow_ranks") or {}).items():
        out.append(f"slow-rank={rank}:{ms:g}")
    if inj.get("desync_step"):
        out.append(f"desync={inj['desync_step']}")
    return out


def job_of(
    meta: dict[str, Any], steps: int, base: Path, *, nproc: int | None = None
) -> tuple[JobCommand, JobKind]:
    """How to re-run the job RUN recorded (nothing is written: the embedded job's spec goes to `base`
    later, as `JobCommand.spec_text`); a UserError when RUN recorded no job that can be re-run.
    `nproc`: --nproc, the user's own rank count instead of the recorded one."""
    from ciuic_doctor.probes.watch.overrides import KEYS

    env = meta.get("env") if isinstance(meta.get("env"), dict) else {}
    cuda = bool(env.get("cuda_available"))
    probes = meta.get("probes") if isinstance(meta.get("probes"), dict) else {}
    job_run = meta.get("job_run") if isinstance(meta.get("job_run"), dict) else {}
    total = steps + WARMUP_STEPS
    if "job" in probes and isinstance(meta.get("spec"), dict) and "optim" in meta["spec"]:
        from ciuic_doctor.jobs.spec import dump_spec
        from ciuic_doctor.report import resolve_spec

        spec = resolve_spec(meta, None).spec
        recorded = job_run.get("world_size") or spec.job.procs_per_node
        ranks = nproc or consent_ranks(recorded, "meta.json job_run.world_size")
        argv = ["job", "--spec", str(base), "--steps", str(total), "--nproc", str(ranks)]
        argv += ["--set", "checkpoint.every_steps=0"]  # a save in a short run is noise on both sides
        for item in _injections(job_run):
            argv += ["--inject", item]
        backend = str(job_run.get("backend") or ("nccl" if cuda else "gloo"))
        command = JobCommand(kind="job", base=argv, spec_text=dump_spec(spec), env=dict(spec.distributed.env))
        return command, JobKind(kind="job", backend=backend, cuda=cuda)
    watch = probes.get("watch") if isinstance(probes.get("watch"), dict) else {}
    argv = watch.get("argv")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise UserError("it recorded neither the embedded job nor a watched script to re-run")
    if any("<redacted>" in a for a in argv):
        raise UserError("the script's command line held a secret (redacted): it cannot be re-run")
    ranks = nproc or consent_ranks(watch.get("nproc", 1), "meta.json probes.watch.nproc")
    launcher = [sys.executable]
    if ranks > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
        ]
    observed = meta.get("observed") if isinstance(meta.get("observed"), dict) else {}
    backend = str((observed.get("distributed") or {}).get("backend") or "none")
    recorded_set = [x for item in watch.get("set") or [] if isinstance(item, str) for x in ("--set", item)]
    cwd = watch.get("cwd")
    command = JobCommand(
        kind="watch",
        base=["watch", "--steps", str(total), "--no-checksum", *recorded_set],  # the job as it ran
        tail=["--", *argv],
        launcher=launcher,
        cwd=cwd if isinstance(cwd, str) and Path(cwd).is_dir() else None,
    )
    return command, JobKind(kind="watch", backend=backend, cuda=cuda, settable=set(KEYS), argv=argv)


def _trusted(
    run: RunDir, meta: dict[str, Any], command: JobCommand, options: Options, say: Callable[[str], None]
) -> list[str]:
    """Run `command` only when RUN is this user's and signed, or the user said yes (consent.py)."""
    from ciuic_doctor.rundir import trust

    why = []
    if problem := trust.folder_problem(run.path):
        why.append(f"the run directory {problem}")
    if problem := trust.check(meta, command.kind):
        why.append(f"its command line is {problem}" if "not signed" in problem else problem)
    # command.env is the spec's [distributed.env], already allow-listed where every spec is built.
    argv = command.argv(run.path / VERIFY_DIR / "<run>", [])
    spread = command.spread
    if spread is not None:  # on the nodes each run is the same command under one torchrun a node
        argv = [*spread.torchrun("<first node>:<port>", "<job>-<run>"), *argv[len(command.launcher) :]]
    what = describe_command(argv, command.cwd, command.env)
    if spread is not None:
        what += f", on {spread.describe()}"
    decide(why, what, run.path, options.consent, say)
    return why


def _recommendations(run: RunDir) -> list[dict[str, Any]]:
    """RUN's recommendations as this tool makes them from RUN's records now: the report is made again,
    so a recommendations.json someone put in RUN never chooses a change to run."""
    from ciuic_doctor.report import build_report

    build_report(run)
    data = run.read_json("recommendations.json")
    recs = data.get("recommendations") if isinstance(data, dict) else None
    return [r for r in recs or [] if isinstance(r, dict)]


def _refuse_env(found: list[Any]) -> None:
    """A change that would set a variable outside the allow-list (rundir/trust.py) is not run."""
    from ciuic_doctor.rundir import trust

    for c in found:
        for key in c.settings:
            name = key.removeprefix("distributed.env.")
            if key.startswith("distributed.env.") and (why := trust.env_refusal(name)):
                c.unverifiable = f"{name} is never set for a job from a run: {why}"


def _folders(run: RunDir, started: float) -> tuple[Path, Path]:
    """RUN/verify (never through a symlink) and a new folder of this verify's own in it."""
    from ciuic_doctor.rundir import safe_io

    base = run.path / VERIFY_DIR
    try:
        safe_io.make_dir(run.path, VERIFY_DIR)
        # A folder of its own for each verify: a run directory used twice would continue its steps.
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
        name, n = stamp, 1
        while True:
            try:
                os.mkdir(base / name, 0o755)
                break
            except FileExistsError:
                n += 1
                name = f"{stamp}-{n}"
        safe_io.make_dir(base, name)
    except OSError as exc:
        raise UserError(f"{base}: not written ({getattr(exc, 'why', None) or exc.strerror or exc})") from None
    return base, base / name


def verify_run(run: RunDir, options: Options, *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Verify RUN's changes on its job; writes RUN/verification.json and returns it."""
    meta = run.read_meta()
    try:
        command, kind = job_of(
            meta, options.steps, run.path.resolve() / VERIFY_DIR / "base.toml", nproc=options.nproc
        )
    except UserError as exc:
        raise UserError(f"{run.path}: {exc}") from None
    from ciuic_doctor.verify.nodes import spread_for

    command.spread = spread_for(meta, options.slurm, str(run.path), nproc=options.nproc)  # None: this host
    _check_tries(kind, options.tries, meta)  # a bad --try is a usage error, before anything runs
    asked = _trusted(run, meta, command, options, say)  # before anything is written or started
    started = time.time()
    base, root = _folders(run, started)
    if command.spec_text is not None:
        RunDir(base).write_text("base.toml", command.spec_text)
    recs = [] if options.only_tries else _recommendations(run)
    found = candidates(recs, options.tries, kind)
    _refuse_env(found)
    _fill_current(found, meta)
    tried = [c for c in found if not c.unverifiable]
    say(
        f"verify {run.path}: {len(found)} change(s), {len(tried)} to try on the job "
        f"({kind.kind}: {' '.join(kind.argv) or 'the embedded job'}), {options.steps} steps after "
        f"{WARMUP_STEPS} warm-up per run, budget {options.budget_s:.0f} s"
    )
    for c in found:
        if c.unverifiable:
            say(f"verify: {c.label}: not verifiable here — {c.unverifiable}")
    results, dropped = [], {}
    if tried:
        schedule = Schedule(budget_s=options.budget_s, max_rounds=options.max_rounds)
        results, dropped = interleave(command, found, root, schedule, say)
    from ciuic_doctor.verify.figures import run_figures
    from ciuic_doctor.verify.judge import judge

    figures = {r.path: run_figures(r.path) for r in results if r.ok}
    judged = [judge(c, results, dropped.get(c.id), figures) for c in found]
    data = {
        "schema": 1,
        "run": str(run.path),
        "created": started,
        "seconds": round(time.time() - started, 1),
        "budget_s": options.budget_s,
        "steps_per_run": options.steps,
        "warmup_steps": WARMUP_STEPS,
        "rounds": max((r.round for r in results), default=0),
        "job": {"kind": kind.kind, "argv": kind.argv, "backend": kind.backend},
        **({"confirmed": asked} if asked else {}),  # run without this user's signature, on --yes
        "statuses": list(STATUSES),
        "candidates": judged,
        "runs": describe(results),
    }
    run.write_json(VERIFICATION_FILE, data)
    return data


def _check_tries(kind: JobKind, tries: list[tuple[str, Any]], meta: dict[str, Any]) -> None:
    from ciuic_doctor.verify.plan import _toml

    if not tries:
        return
    items = [f"{key}={_toml(value)}" for key, value in tries]
    if kind.kind == "watch":
        from ciuic_doctor.probes.watch.overrides import parse

        parse(items, flag="--try")
        return
    from ciuic_doctor.jobs.spec import with_updates
    from ciuic_doctor.report import resolve_spec

    spec = resolve_spec(meta, None).spec
    for key, value in tries:
        with_updates(spec, {key: value}, origin=f"--try {key}")


def _fill_current(found: list[Any], meta: dict[str, Any]) -> None:
    """The job's own value of each --try key (from the spec it ran, or what watch observed)."""
    from ciuic_doctor.compare.settings import flatten
    from ciuic_doctor.report import resolve_spec

    flat = flatten(resolve_spec(meta, None).spec.to_dict())
    for c in found:
        for key in c.settings:
            if c.current.get(key) is None:
                c.current[key] = flat.get(key)


def lines(data: dict[str, Any]) -> list[str]:
    """One line per candidate: status, the target figure's change with its interval, and why."""
    from ciuic_doctor.compare.change import interval, percent

    out = []
    for c in data.get("candidates") or []:
        reason = str(c.get("reason", ""))
        if c.get("ratio") is not None and c.get("ci_low") is not None and c["status"] == "hurts":
            aimed = f"{c['target_metric']} {percent(c['ratio'])}"
            aimed += f" (95 % CI {interval(c['ci_low'], c['ci_high'])})"
            reason = reason if aimed in reason else f"{reason} [{aimed}]"
        out.append(f"  {c['status']:<21s} {c['label']}: {reason}")
    return out
