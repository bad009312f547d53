"""The memory checks' grouped passes a block of ranks at a time: the same figures, temporaries
the size of a block instead of the job.

`memory.batch` fits every rank's series in one vectorised pass over a flat (rank, x, y) table. At
10,000 ranks × 1,000 steps each pass built ~10 M-point tables several times over (candidates, their
warm-up cuts, bins, the sort for the fit): 1.5–2 GB above the cached streams for each of host_fits,
device_fits, non_pytorch_fits and the reserved-bytes fit, the report's peak (6.4 GB). Every figure of
those passes belongs to one rank and reads only that rank's rows, so the job is cut into blocks of
RANKS_PER_BLOCK ranks, each pass runs on a `_DataBlock` (the block's step rows, a slice; its
processes' memwatch samples, gathered), and the per-rank results are joined (`memory.batch.join_fits`).
The block size changes no figure (tests/test_scale_gpu.py compares them to the last bit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import numpy as np

    from ciuic_doctor.analysis.memory.data import _Data

RANKS_PER_BLOCK = 1024  # 1,024 ranks × 1,000 steps: ~1 M points a pass, ~25 MB per temporary

T = TypeVar("T")


class _StepsBlock:
    """`StepColumns` of a run of consecutive ranks: its rows are one slice (rows are in rank order)."""

    def __init__(self, steps: Any, ranks: list[int]) -> None:
        bounds = steps.bounds()
        spans = [bounds[r] for r in ranks if r in bounds]
        self._steps = steps
        self._rows = slice(min(s for s, _ in spans), max(e for _, e in spans)) if spans else slice(0, 0)
        self._flat: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self._rows.stop - self._rows.start

    def flat(self, name: str) -> np.ndarray:
        if name not in self._flat:  # converted from the block's rows: no job-wide float64 copy is made
            self._flat[name] = self._steps.rows(name, self._rows.start, self._rows.stop)
        return self._flat[name]

    def host(self, rank: int) -> str | None:
        return self._steps.host(rank)


class _MemwatchBlock:
    """`MemwatchColumns` of some processes: their samples gathered, process after process."""

    def __init__(self, memwatch: Any, pids: list[int]) -> None:
        import numpy as np

        self._memwatch = memwatch
        self._bounds: dict[int, tuple[int, int]] = {}
        rows, at = [], 0
        for pid in dict.fromkeys(pids):
            start, stop = memwatch.bounds()[pid]
            self._bounds[pid] = (at, at + stop - start)
            rows.append(np.arange(start, stop))
            at += stop - start
        self._rows = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
        self._flat: dict[str, np.ndarray] = {}

    def bounds(self) -> dict[int, tuple[int, int]]:
        return self._bounds

    def flat(self, name: str) -> np.ndarray:
        if name not in self._flat:  # from the table's order: the job's PID-ordered copy is never made
            self._flat[name] = self._memwatch.gather(name, self._rows)
        return self._flat[name]

    def host(self, pid: int) -> str | None:
        return self._memwatch.host(pid)


class _DataBlock:
    """What the grouped passes read of `_Data`, for `ranks` only."""

    def __init__(self, data: _Data, ranks: list[int]) -> None:
        self._ranks = ranks
        self._pids = {rank: data.rank_pid(rank) for rank in ranks}
        self.steps = _StepsBlock(data.steps, ranks)
        self.memwatch = _MemwatchBlock(data.memwatch, [p for p in self._pids.values() if p is not None])
        self.first_step = data.first_step

    def ranks(self) -> list[int]:
        return self._ranks

    def rank_pid(self, rank: int) -> int | None:
        return self._pids[rank]


def in_blocks(data: _Data, make: Callable[[Any], T], join: Callable[[list[T]], T]) -> T:
    """`make(data)`, computed RANKS_PER_BLOCK ranks at a time and joined; one call for a smaller job."""
    ranks = data.ranks()
    if len(ranks) <= RANKS_PER_BLOCK:
        return make(data)
    starts = range(0, len(ranks), RANKS_PER_BLOCK)
    return join([make(_DataBlock(data, ranks[i : i + RANKS_PER_BLOCK])) for i in starts])
