"""A loss that goes below zero has no floor at zero: its level is not a distance from a best.

A supervised loss (cross-entropy, MSE, NLL of a discrete target) is never negative, so "ends 1.5× its best"
and "spiked 3×" mean something. A policy-gradient loss does not: REINFORCE's −Σ log π(a|s) × (normalized
return) over an episode is negative about as often as positive (pytorch/examples' reinforce.py on CartPole:
both signs throughout), and its size grows with the episode's length, so a policy that gets better makes
it larger; RL4CO's REINFORCE loss in a Lightning CSV is negative on all but one row. A WGAN critic's loss
and a continuous log-density are of the same kind. Such a series is named,
and judged only for non-finite values (stability.series_kind); its step times are episodes of unequal
length, not stalls (throughput.goodput).

    >>> below_zero(np.array([0.5, -1.2, 3.0, -0.1, 2.2, 0.7, -4.0, 1.1])).negative
    3
    >>> below_zero(np.array([2.3, 2.1, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4])) is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_POINTS = 8  # as the spike check's floor: fewer cannot tell a pattern from an accident
# Below zero on at least 5 % of the finite points: one stray negative value (a bug, a regulariser that
# overshoots once) does not turn a supervised loss into a signed one.
MIN_FRACTION = 0.05


@dataclass(frozen=True)
class Signs:
    negative: int
    positive: int
    points: int

    def describe(self) -> str:
        return (
            f"the loss goes below 0 ({self.negative} of {self.points} logged values), as a "
            "policy-gradient loss does (−log π × a normalized return, summed over an episode, so its size "
            "grows with the episode): with no floor at zero its level and ratios are no measure of "
            "convergence; judge the run by the return or reward it prints"
        )


def below_zero(values: np.ndarray) -> Signs | None:
    """The signs of a series below zero on at least MIN_FRACTION of its finite values (else None)."""
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    return from_counts(int((finite < 0).sum()), int((finite > 0).sum()), len(finite))


def from_counts(negative: int, positive: int, points: int) -> Signs | None:
    """`below_zero` from counts already made (a column counted without a copy, as pyarrow's compute does)."""
    if points < MIN_POINTS or negative < MIN_FRACTION * points:
        return None
    return Signs(negative=negative, positive=positive, points=points)
