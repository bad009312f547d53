"""Analyses: pure functions from a run directory's records to findings.

Each package here judges one probe's streams and exposes, from its `__init__`,

    STREAMS: tuple[str, ...]                 the streams it reads (it runs when any is present)
    def analyze(run: RunDir) -> list[Finding]

and may declare OWN_WORKERS = True (its passes fork workers of their own: the analyses after it run side
by side on a big job) and SECONDS_PER_MILLION_STEP_ROWS (its measured time: side by side, the longest
go first).

`run_all` discovers the packages that define `analyze`, runs those whose streams exist, and writes
findings.json. A new analysis is a new package; nothing here changes. The statistics the analyses share
live in `stats/`, one function per concept.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from types import ModuleType

from ciuic_doctor.rundir.findings import Finding, sort_findings
from ciuic_doctor.rundir.store import RunDir

FINDINGS_FILE = "findings.json"


def analysis_modules() -> list[ModuleType]:
    """Every analysis package, in name order: a package (not a module) whose `__init__` defines `analyze`."""
    packages = [
        importlib.import_module(f"{__name__}.{info.name}")
        for info in pkgutil.iter_modules(__path__)
        if info.ispkg and not info.name.startswith("_")
    ]
    return [package for package in packages if hasattr(package, "analyze")]


def run_all(
    run: RunDir,
    progress: Callable[[str], None] | None = None,
    *,
    keep: Collection[str] = (),
    before_letting_go: Mapping[str, Callable[[], object]] | None = None,
) -> list[Finding]:
    """Every applicable analysis on `run`; findings.json is written and the findings returned.
    `progress` is told each analysis as it starts ("memory (4/9)"): at 10,000 ranks they take minutes.

    A stream's cached table is let go once no analysis still to run reads it, unless the caller reads it
    next (`keep`): memwatch's 0.85 GB at 10,000 ranks x 1,000 steps is not held through the steps
    analyses, whose temporaries came on top of it. `before_letting_go[stream]` is called just before
    (the report takes its page's view of the stream there, while it is still held)."""
    from ciuic_doctor.rundir import frames

    with frames.one_snapshot():  # every analysis judges the streams as their first reader found them
        findings, ran = _run_each(run, progress, keep=keep, before_letting_go=before_letting_go)
    if quality := records_finding(run):
        findings.append(quality)
    from ciuic_doctor.analysis.run_end import run_end_finding

    if (end := run_end_finding(run.read_meta())) is not None:  # a crash, a kill: said, never `running`
        findings.append(end)
    findings = sort_findings(findings)
    run.write_json(
        FINDINGS_FILE,
        {"schema": 1, "created": time.time(), "analyses": ran, "findings": [f.to_dict() for f in findings]},
    )
    return findings


def _run_each(
    run: RunDir,
    progress: Callable[[str], None] | None,
    *,
    keep: Collection[str],
    before_letting_go: Mapping[str, Callable[[], object]] | None,
) -> tuple[list[Finding], list[str]]:
    """The applicable analyses in turn: (their findings, their names)."""
    from ciuic_doctor.rundir import frames

    findings: list[Finding] = []
    ran: list[str] = []
    run.read_meta()  # fills run.meta_problems before the analyses read it
    applicable = [m for m in analysis_modules() if any(run.has_stream(stream) for stream in m.STREAMS)]
    rest = _first_of_the_rest(applicable)

    def one(module: ModuleType) -> list[Finding]:
        try:
            return list(module.analyze(run))
        except Exception as exc:  # a record the schemas let through: one analysis lost, not the run
            return [_crashed(module.__name__.rsplit(".", 1)[-1], exc)]

    def let_go(finished: list[ModuleType], done: int) -> None:
        """The streams of `finished` that no analysis after the first `done` reads (nor the caller)."""
        still_read = {stream for later in applicable[done:] for stream in later.STREAMS}
        for stream in sorted({s for m in finished for s in m.STREAMS} - still_read - set(keep)):
            if before_letting_go and stream in before_letting_go:
                before_letting_go[stream]()
            frames.forget(run, stream)

    for number, module in enumerate(applicable, 1):
        if number - 1 == rest:  # the rest side by side, when worth it
            together = _side_by_side(run, applicable, rest, one, progress)
            if together is not None:
                findings.extend(f for part in together for f in part)
                ran.extend(_names(applicable[rest:]))
                let_go(applicable[rest:], len(applicable))
                break
        name = module.__name__.rsplit(".", 1)[-1]
        if progress is not None:
            progress(f"analysing {name} ({number}/{len(applicable)})")
        findings.extend(one(module))
        ran.append(name)
        let_go([module], number)
    return findings, ran


# ---- the analyses after the memory checks, side by side ------------------------------------------------
# At 10,000 ranks × 1,000 steps the analyses after the memory checks (moe 0.3 s, stability 0.8 s, steps
# 2.3 s, throughput 1.0 s) ran one after the other on one core while the other idled: 4.4 s of a 24 s
# second report. Each reads the steps table the report already holds, which a forked worker inherits
# without a copy (`parallel.forked`); the memory checks, which fork their own workers a block of ranks at
# a time (`OWN_WORKERS`), run before them here and let memwatch go first (0.85 GB). A worker runs whole
# analyses, the same functions on the same tables, so the findings are those made one after the other
# (tests/test_side_by_side.py); what an analysis leaves on the RunDir for later readers — the read
# problems (`records_readable`) and notes — comes back with its findings. Below SIDE_BY_SIDE_MIN_ROWS
# step records they take well under a second and a fork costs more than it saves: one after the other.
SIDE_BY_SIDE_MIN_ROWS = 1_000_000  # step records held (1,000 ranks × 1,000 steps: ~0.5 s of these analyses)


def _first_of_the_rest(modules: Sequence[ModuleType]) -> int:
    """Where the analyses that may run side by side begin: after the last with `OWN_WORKERS` (the
    memory checks), else at the first."""
    owners = [i for i, module in enumerate(modules) if getattr(module, "OWN_WORKERS", False)]
    return owners[-1] + 1 if owners else 0


def _side_by_side(
    run: RunDir,
    modules: Sequence[ModuleType],
    rest: int,
    one: Callable[[ModuleType], list[Finding]],
    progress: Callable[[str], None] | None = None,
) -> list[list[Finding]] | None:
    """`one(module)` of every module from `rest` on, in forked workers, in module order; None where they
    should run one after the other here (fewer than two, one core, no fork, a small job) or a worker
    died (killed: the caller runs them again, here). `progress` is told one line for them all."""
    from concurrent.futures.process import BrokenProcessPool

    from ciuic_doctor import parallel
    from ciuic_doctor.parallel.forked import map_forked
    from ciuic_doctor.rundir import frames

    together = list(modules[rest:])
    count = parallel.workers(len(together))
    if count < 2 or frames.held_rows(run, "steps") < SIDE_BY_SIDE_MIN_ROWS:
        return None
    if progress is not None:  # "analysing moe, stability, steps, throughput side by side (6-9/9)"
        span = f"{rest + 1}-{len(modules)}/{len(modules)}"
        progress(f"analysing {', '.join(_names(together))} side by side ({span})")
    notes_before = len(run.notes)

    def in_worker(module: ModuleType) -> tuple[list[Finding], dict[str, str], list[str]]:
        findings = one(module)
        return findings, dict(run.read_problems), run.notes[notes_before:]

    # longest first: a worker that takes a short one last is not left idle beside the longest (at
    # 10,000 ranks × 1,000 steps, module order left one of two workers idle for 0.7 of 2.45 s)
    order = sorted(range(len(together)), key=lambda i: -_cost(together[i]))
    try:
        done = map_forked(in_worker, [together[i] for i in order], count)
    except BrokenProcessPool:
        return None
    results = [result for _, result in sorted(zip(order, done, strict=True))]
    for _, problems, notes in results:
        run.read_problems.update(problems)
        run.notes.extend(note for note in notes if note not in run.notes)
    return [findings for findings, _, _ in results]


def _cost(module: ModuleType) -> float:
    """An analysis's time per million step records (its SECONDS_PER_MILLION_STEP_ROWS; else 0)."""
    return float(getattr(module, "SECONDS_PER_MILLION_STEP_ROWS", 0.0))


def _names(modules: Sequence[ModuleType]) -> list[str]:
    return [module.__name__.rsplit(".", 1)[-1] for module in modules]


def _crashed(analysis: str, exc: Exception) -> Finding:
    """not_run for an analysis that raised: the others' findings and the report still come out.

    The readers validate every record against its stream's schema (ciuic_doctor.rundir.schemas), so this is a
    value the schema allows but the analysis did not expect: a bug to report, with its one line here.
    """
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "ciuic_doctor" in f.filename]
    where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
    return Finding(
        probe=analysis,
        check="analysis_error",
        verdict="not_run",
        summary=f"the {analysis} analysis failed on this run's records ({type(exc).__name__} at {where}: "
        f"{str(exc)[:160]}); please report it",
        evidence={"error": type(exc).__name__, "where": where},
    )


def records_finding(run: RunDir) -> Finding | None:
    """One warning naming every stream whose reader skipped lines or off-schema records, and what
    meta.json lost: the analyses judged what was left, and the report must say so. None when all read."""
    if not run.read_problems and not run.meta_problems:
        return None
    parts = [f"{stream}: {problem}" for stream, problem in sorted(run.read_problems.items())]
    parts += [f"meta.json: {problem}" for problem in run.meta_problems[:5]]
    return Finding(
        probe="store",
        check="records_readable",
        verdict="warn",
        summary="skipped what could not be read; the findings judge the rest. " + "; ".join(parts),
        evidence={"streams": dict(run.read_problems), "meta": list(run.meta_problems)},
    )


def load_findings(run: RunDir) -> list[Finding]:
    """findings.json of `run` (empty when it was never analysed or cannot be read: analysis reruns)."""
    path = run.path / FINDINGS_FILE
    if not path.is_file():
        return []
    try:
        data = run.read_json(FINDINGS_FILE)
        return [Finding.from_dict(d) for d in data.get("findings", [])]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []
