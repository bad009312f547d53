"""The analyses after the last one with workers of its own, run side by side in forked processes.

Why: at 10,000 ranks × 1,000 steps the analyses after the memory checks (moe 0.3 s, stability 0.8 s,
steps 2.3 s, throughput 1.0 s) ran one after the other on one core while the other idled: 4.4 s of a
24 s second report. Each of them reads the steps table the report already holds, which a forked
worker inherits without a copy (`parallel.forked`); the memory checks, which fork their own workers a
block of ranks at a time, run before them in this process and let memwatch go first (0.85 GB).

Each worker runs whole analyses, the same functions on the same tables, so the findings are the ones
`run_all` makes one after the other (tests/test_side_by_side.py compares them). What an analysis leaves
on the RunDir for later readers — the streams' read problems (the `records_readable` finding) and
notes — comes back with its findings. A small job runs them one after the other: below
SIDE_BY_SIDE_MIN_ROWS step records they take well under a second, and a fork costs more than it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir

SIDE_BY_SIDE_MIN_ROWS = 1_000_000  # step records held (1,000 ranks × 1,000 steps: ~0.5 s of these analyses)


def first_of_the_rest(modules: Sequence[ModuleType]) -> int:
    """Where the analyses that may run side by side begin: after the last with `OWN_WORKERS` (the
    memory checks), else at the first."""
    owners = [i for i, module in enumerate(modules) if getattr(module, "OWN_WORKERS", False)]
    return owners[-1] + 1 if owners else 0


def analyze(
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
        progress(f"analysing {', '.join(names(together))} side by side ({span})")
    notes_before = len(run.notes)

    def in_worker(module: ModuleType) -> tuple[list[Finding], dict[str, str], list[str]]:
        findings = one(module)
        return findings, dict(run.read_problems), run.notes[notes_before:]

    try:
        results = map_forked(in_worker, together, count)
    except BrokenProcessPool:
        return None
    for _, problems, notes in results:
        run.read_problems.update(problems)
        run.notes.extend(note for note in notes if note not in run.notes)
    return [findings for findings, _, _ in results]


def names(modules: Sequence[ModuleType]) -> list[str]:
    return [module.__name__.rsplit(".", 1)[-1] for module in modules]
