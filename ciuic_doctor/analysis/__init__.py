"""Analyses: pure functions from a run directory's records to findings.

Each package here judges one probe's streams and exposes, from its `__init__`,

    STREAMS: tuple[str, ...]                 the streams it reads (it runs when any is present)
    def analyze(run: RunDir) -> list[Finding]

`run_all` discovers the packages that define `analyze`, runs those whose streams exist, and writes
findings.json. A new analysis is a new package; nothing here changes. The statistics the analyses share
live in `stats/`, one function per concept.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from collections.abc import Callable, Collection, Mapping
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
    from ciuic_doctor.analysis import side_by_side
    from ciuic_doctor.rundir import frames

    findings: list[Finding] = []
    ran: list[str] = []
    run.read_meta()  # fills run.meta_problems before the analyses read it
    applicable = [m for m in analysis_modules() if any(run.has_stream(stream) for stream in m.STREAMS)]
    rest = side_by_side.first_of_the_rest(applicable)

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
            together = side_by_side.analyze(run, applicable, rest, one, progress)
            if together is not None:
                findings.extend(f for part in together for f in part)
                ran.extend(side_by_side.names(applicable[rest:]))
                let_go(applicable[rest:], len(applicable))
                break
        name = module.__name__.rsplit(".", 1)[-1]
        if progress is not None:
            progress(f"analysing {name} ({number}/{len(applicable)})")
        findings.extend(one(module))
        ran.append(name)
        let_go([module], number)
    return findings, ran


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
