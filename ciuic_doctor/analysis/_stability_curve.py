"""The folded per-step curve every stability check reads: one value per step, ranks folded.

Split from `stability.py` (the analysis entry point) so that the checks (`_stability_checks`) import the
Curve from below instead of from the module that runs them. Folding: mean loss, max grad norm, min scale,
any skip per step, so a loss spike on one rank's batch still shows and a skip is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass(kw_only=True)
class Curve:
    """One value per step (ranks folded), in step order, as numpy arrays."""

    step: np.ndarray
    interval: np.ndarray
    loss: np.ndarray
    nonfinite: np.ndarray
    lr: np.ndarray
    grad_norm: np.ndarray
    scale: np.ndarray
    attempted: np.ndarray  # the scale each row's first overflow attempted (NaN: not printed)
    skipped: np.ndarray
    ranks: int
    series: int = 0  # the table's series this curve is (events of another series are not its own)
    loss_kind: str = "mean"  # StepLog.loss_kind: a row's loss is the interval's mean, or one step's sample
    vocab_size: int | None = None  # what the log prints: ln of it is a uniform guess's loss
    eval_loss: list[tuple[int, float]] = field(default_factory=list)  # the log's eval (step, loss) pairs

    @property
    def steps_covered(self) -> int:
        return int(self.interval.sum())


def _unique_in_order(table) -> bool:
    """Whether the rows are sorted by rank, then strictly by step within a rank (no (rank, step) twice).
    A missing rank (NA) counts as rank -1, one value, as drop_duplicates counts NA (ranks are >= 0)."""
    import numpy as np

    rank = table["rank"].to_numpy(dtype=np.int64, na_value=-1)
    step = table["step"].to_numpy(dtype=np.int64)
    same = rank[1:] == rank[:-1]
    return bool((rank[1:] >= rank[:-1]).all() and (step[1:][same] > step[:-1][same]).all())


def fold(table) -> Curve:
    """Per-step curve from the normalized table (later rows win for a repeated (rank, step))."""
    import numpy as np

    series = int(table["series"].iloc[0]) if len(table) else 0
    # watch's per-rank files come in (rank, step) order without repeats: then there is nothing to drop,
    # and drop_duplicates' hashing and copy of the whole table (1 GB at 10,000 ranks) are skipped
    frame = table if _unique_in_order(table) else table.drop_duplicates(subset=["rank", "step"], keep="last")
    ranks = int(frame["rank"].nunique())
    if ranks > 1 or not frame["step"].is_unique:
        grouped = frame.groupby("step", sort=True)
        frame = grouped.agg(
            loss=("loss", "mean"), nonfinite=("nonfinite", "max"), lr=("lr", "max"),
            grad_norm=("grad_norm", "max"), loss_scale=("loss_scale", "min"), skipped=("skipped", "max"),
            attempted_scale=("attempted_scale", "max"),
            interval_steps=("interval_steps", "max"),
        ).reset_index()  # fmt: skip
    elif not frame["step"].is_monotonic_increasing:
        frame = frame.sort_values("step", kind="stable")
    return Curve(
        step=frame["step"].to_numpy(dtype=np.int64),
        interval=frame["interval_steps"].to_numpy(dtype=np.int64),
        loss=frame["loss"].to_numpy(dtype=np.float64),
        nonfinite=frame["nonfinite"].to_numpy(dtype=np.int64),
        lr=frame["lr"].to_numpy(dtype=np.float64),
        grad_norm=frame["grad_norm"].to_numpy(dtype=np.float64),
        scale=frame["loss_scale"].to_numpy(dtype=np.float64),
        attempted=frame["attempted_scale"].to_numpy(dtype=np.float64),
        skipped=frame["skipped"].to_numpy(dtype=np.int64),
        ranks=max(ranks, 1),
        series=series,
    )
