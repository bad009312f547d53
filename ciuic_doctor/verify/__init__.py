"""Try every recommended change on the job it is for, and keep only what helps.

    from ciuic_doctor.verify import Options, verify_run
    data = verify_run(RunDir.open("reports/run"), Options(budget_s=480), say=print)

The job is the one RUN recorded: the embedded job (its spec from meta.json, its world size, its
injected faults) or the script watch ran (its argv and working directory, its rank count). Each
changing recommendation in RUN/recommendations.json (and each `--try KEY=VALUE`) is a candidate, tried
alone against the job as it is, interleaved (runner.py), and judged on the job's own figures
(judge.py). RUN/verification.json holds the runs and a status with its interval per candidate; the
report reads it (recommend/verified.py).

    plan.py    candidates, and why a change is not verifiable by short runs here
    runner.py  the interleaved A / B runs within the budget, a progress line per run
    judge.py   paired-by-round intervals, Holm over each candidate's figures, the status
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import UserError
from ciuic_doctor.recommend.verified import STATUSES, VERIFICATION_FILE
from ciuic_doctor.rundir.store import RunDir
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


def job_of(run: RunDir, meta: dict[str, Any], steps: int) -> tuple[JobCommand, JobKind]:
    """How to re-run the job RUN recorded; a UserError when RUN recorded no job that can be re-run."""
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
        root = run.path / VERIFY_DIR
        root.mkdir(exist_ok=True)
        base = RunDir(root).write_text("base.toml", dump_spec(spec))
        nproc = int(job_run.get("world_size") or spec.job.procs_per_node)
        argv = ["job", "--spec", str(base.resolve()), "--steps", str(total), "--nproc", str(nproc)]
        argv += ["--set", "checkpoint.every_steps=0"]  # a save in a short run is noise on both sides
        for item in _injections(job_run):
            argv += ["--inject", item]
        backend = str(job_run.get("backend") or ("nccl" if cuda else "gloo"))
        return JobCommand(kind="job", base=argv), JobKind(kind="job", backend=backend, cuda=cuda)
    watch = probes.get("watch") if isinstance(probes.get("watch"), dict) else {}
    argv = watch.get("argv")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise UserError(f"{run.path}: recorded neither the embedded job nor a watched script to re-run")
    if any("<redacted>" in a for a in argv):
        raise UserError(
            f"{run.path}: the script's command line held a secret (redacted): it cannot be re-run"
        )
    checkup = meta.get("checkup") if isinstance(meta.get("checkup"), dict) else {}
    nproc = int(checkup.get("nproc") or watch.get("nproc") or 1)
    launcher = [sys.executable]
    if nproc > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
        ]
    observed = meta.get("observed") if isinstance(meta.get("observed"), dict) else {}
    backend = str((observed.get("distributed") or {}).get("backend") or "none")
    recorded = [x for item in watch.get("set") or [] if isinstance(item, str) for x in ("--set", item)]
    command = JobCommand(
        kind="watch",
        base=["watch", "--steps", str(total), "--no-checksum", *recorded],  # the job as it ran
        tail=["--", *argv],
        launcher=launcher,
        cwd=watch.get("cwd") if isinstance(watch.get("cwd"), str) and Path(watch["cwd"]).is_dir() else None,
    )
    return command, JobKind(kind="watch", backend=backend, cuda=cuda, settable=set(KEYS), argv=argv)


def _recommendations(run: RunDir) -> list[dict[str, Any]]:
    path = run.path / "recommendations.json"
    if not path.is_file():
        from ciuic_doctor.report import build_report

        build_report(run)
    data = run.read_json("recommendations.json")
    recs = data.get("recommendations") if isinstance(data, dict) else None
    return [r for r in recs or [] if isinstance(r, dict)]


def verify_run(run: RunDir, options: Options, *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Verify RUN's changes on its job; writes RUN/verification.json and returns it."""
    meta = run.read_meta()
    command, kind = job_of(run, meta, options.steps)
    from ciuic_doctor.verify.nodes import spread_for

    command.spread = spread_for(meta, options.slurm, str(run.path))  # None: on this host
    _check_tries(kind, options.tries, meta)  # a bad --try is a usage error, before anything runs
    recs = [] if options.only_tries else _recommendations(run)
    found = candidates(recs, options.tries, kind)
    _fill_current(found, meta)
    started = time.time()
    # A folder of its own for each verify: a run directory used twice would continue its steps.
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    root, n = run.path / VERIFY_DIR / stamp, 1
    while root.exists():
        n += 1
        root = run.path / VERIFY_DIR / f"{stamp}-{n}"
    root.mkdir(parents=True)
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
