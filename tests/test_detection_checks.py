"""The steps analysis's stall and intermittent checks and comm's slow-link pair, on generated matrices of
64 ranks (benchmarks/detection.py runs them at 1,024 ranks): each names the planted rank and step, and what
must not be flagged (a single GC pause, a checkpoint stalling every rank) is not."""

from __future__ import annotations

import numpy as np

from ciuic_doctor.analysis.comm import straggler
from ciuic_doctor.analysis.steps import check_pace
from ciuic_doctor.analysis.steps.grid import StepMatrix

RANKS, STEPS = 64, 200


def _matrix(pace: np.ndarray) -> StepMatrix:
    return StepMatrix(
        ranks=np.arange(RANKS),
        steps=np.arange(3, STEPS + 3),
        hosts=[f"node-{r // 8:03d}" for r in range(RANKS)],
        step_time_s=np.tile(pace.max(axis=0) + 0.55, (RANKS, 1)),
        pace_s=pace,
        pace_metric="pre_backward_s",
    )


def _pace(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.3 * (1 + rng.normal(0, 0.03, (RANKS, STEPS)))


def _flagged(pace: np.ndarray) -> dict[str, dict]:
    return {f.check: f.where for f in check_pace(_matrix(pace)) if f.verdict == "warn"}


def test_a_loader_stall_is_named_with_its_rank_and_first_step_and_a_gc_pause_is_not() -> None:
    pace = _pace(1)
    pace[:, 100] += 20.0  # a checkpoint: every rank
    pace[7, 50] += 0.5  # a GC pause: one rank, one step
    pace[21, 120:124] += 2.0  # a loader stall: 4 steps
    flagged = _flagged(pace)
    assert set(flagged) == {"stall"}, flagged
    assert (flagged["stall"]["rank"], flagged["stall"]["step"]) == (21, 123)  # steps start at 3


def test_a_rank_slow_every_tenth_step_is_intermittent() -> None:
    pace = _pace(2)
    pace[40, ::10] *= 2.0
    flagged = _flagged(pace)
    assert set(flagged) == {"intermittent"}, flagged
    assert flagged["intermittent"]["rank"] == 40


def test_a_healthy_matrix_with_pauses_flags_nothing() -> None:
    pace = _pace(3)
    pace[:, :8] *= np.linspace(3, 1, 8)  # warm-up
    pace[:, 60] += 12.0 * (1 + np.random.default_rng(4).normal(0, 0.1, RANKS))  # an evaluation
    assert _flagged(pace) == {}


def test_a_slow_link_names_both_of_its_ranks() -> None:
    rng = np.random.default_rng(5)
    rows = []
    for _ in range(12):
        times = 100 * (1 + rng.normal(0, 0.003, RANKS))
        times[[9, 33]] *= 1.2
        rows.append({"rank_time_us": times.tolist()})
    finding = straggler(rows)
    assert finding.verdict == "warn"
    assert sorted(finding.where["ranks"]) == [9, 33]
