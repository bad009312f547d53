"""The folded per-step curve every stability check reads: one value per step, ranks folded.

Split from `stability.py` (the analysis entry point) so that the checks (`stability.checks`) import the
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
    A missing rank (NA) counts as rank -1, one value, as drop_duplicates counts NA (ranks are >= 0).
    Comparisons only (a bool per row), no copy of the rows of one rank (80 MB at 10,000 ranks)."""
    import numpy as np

    rank = table["rank"].to_numpy(dtype=np.int64, na_value=-1)
    step = table["step"].to_numpy(dtype=np.int64)
    if not (rank[1:] >= rank[:-1]).all():
        return False
    return bool(((step[1:] > step[:-1]) | (rank[1:] != rank[:-1])).all())


def _ranks(table, in_order: bool) -> int:
    """How many ranks (NA not counted): for rows sorted by rank, the changes of rank, without the hash
    table nunique sizes by the rows (32 MB at 3,000 ranks × 1,000 steps)."""
    import numpy as np

    if not in_order or not len(table):
        return int(table["rank"].nunique())
    rank = table["rank"].to_numpy(dtype=np.int64, na_value=-1)
    return int(np.count_nonzero(rank[1:] != rank[:-1])) + 1 - int(rank[0] == -1)


# the fold of the ranks' rows of one step
PER_STEP = {
    "loss": ("loss", "mean"), "nonfinite": ("nonfinite", "max"), "lr": ("lr", "max"),
    "grad_norm": ("grad_norm", "max"), "loss_scale": ("loss_scale", "min"), "skipped": ("skipped", "max"),
    "attempted_scale": ("attempted_scale", "max"), "interval_steps": ("interval_steps", "max"),
}  # fmt: skip


def _per_step(frame):  # -> DataFrame: step, then PER_STEP's columns, one row per step in step order
    """`frame.groupby("step").agg(PER_STEP)`. Steps from 0 to about the rows' count (every watched run)
    are grouped by their index among the steps found, as a Categorical's codes (int16 for up to 32,767
    steps), instead of pandas' factorize of the int64 column: its codes and a hash table sized by the rows
    (55 MB at its peak at 3,000 ranks × 1,000 steps, against ~30). Same groups, same rows in each, in the
    same order: the same sums and means."""
    import numpy as np
    import pandas as pd

    step = frame["step"].to_numpy(dtype=np.int64)
    top = int(step.max()) if len(step) else -1
    if not len(step) or int(step.min()) < 0 or top > len(step) // 2 + (1 << 16):
        return frame.groupby("step", sort=True).agg(**PER_STEP).reset_index()
    present = np.zeros(top + 1, dtype=bool)
    present[step] = True
    steps = np.flatnonzero(present)
    kind = np.int16 if len(steps) < 2**15 else np.int32
    codes = (np.cumsum(present, dtype=np.int32) - 1).astype(kind)[step]
    del present
    key = pd.Categorical.from_codes(codes, categories=pd.Index(steps), validate=False)
    del codes
    out = frame.groupby(key, observed=True, sort=True).agg(**PER_STEP)
    out.index = pd.Index(steps, name="step")
    return out.reset_index()


def fold(table) -> Curve:
    """Per-step curve from the normalized table (later rows win for a repeated (rank, step))."""
    import numpy as np

    series = int(table["series"].iloc[0]) if len(table) else 0
    # watch's per-rank files come in (rank, step) order without repeats: then there is nothing to drop,
    # and drop_duplicates' hashing and copy of the whole table (1 GB at 10,000 ranks) are skipped
    in_order = _unique_in_order(table)
    frame = table if in_order else table.drop_duplicates(subset=["rank", "step"], keep="last")
    ranks = _ranks(frame, in_order)
    if ranks > 1 or not frame["step"].is_unique:
        frame = _per_step(frame)
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
