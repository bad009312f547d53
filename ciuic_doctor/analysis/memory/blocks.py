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

The blocks are independent, so `parallel.map_blocks` runs them on every core (forked workers read the
tables of this process) or on a Dask cluster, where a block travels as a `_PackedBlock`: its arrays,
made once and kept on the cluster for the following passes (`parallel.Remote`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from ciuic_doctor.parallel import Remote, map_blocks, width

if TYPE_CHECKING:
    import numpy as np

    from ciuic_doctor.analysis.memory.data import _Data

RANKS_PER_BLOCK = 1024  # 1,024 ranks × 1,000 steps: ~1 M points a pass, ~25 MB per temporary
# with several workers a job is cut into at least one block each, but none under this: below ~500 ranks
# the checks take well under a second and a fork per pass would cost more than it saves
MIN_RANKS_PER_BLOCK = 256

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

    def forget(self) -> None:
        """Let the converted columns go (between two passes over this block: each pass's, not all five)."""
        self.steps._flat.clear()
        self.memwatch._flat.clear()

    def packed(self) -> _PackedBlock:
        """This block as arrays only: what a Dask worker needs, pickled without the job's tables."""
        from ciuic_doctor.analysis.memory.columns import NUMERIC
        from ciuic_doctor.analysis.memory.steps import StepColumns

        steps = {n: self.steps.flat(n) for n in StepColumns.COLUMNS if n != "host"}
        memwatch = {n: self.memwatch.flat(n) for n in NUMERIC}
        return _PackedBlock(
            ranks=self._ranks,
            pids=self._pids,
            first_step=self.first_step,
            steps=_PackedColumns(steps, {r: self.steps.host(r) for r in self._ranks}, len(self.steps)),
            memwatch=_PackedColumns(
                memwatch,
                {p: self.memwatch.host(p) for p in self.memwatch.bounds()},
                len(self.memwatch.bounds()),
                self.memwatch.bounds(),
            ),
        )


class _PackedColumns:
    """A `_StepsBlock` or `_MemwatchBlock` with its columns converted: flat, host, bounds, len."""

    def __init__(
        self,
        columns: dict[str, np.ndarray],
        hosts: dict[int, str | None],
        size: int,
        bounds: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        self._columns, self._hosts, self._size, self._bounds = columns, hosts, size, bounds or {}

    def __len__(self) -> int:
        return self._size

    def flat(self, name: str) -> np.ndarray:
        import numpy as np

        values = self._columns.get(name, np.empty(0))
        if not values.flags.aligned:  # Dask's frames can put a buffer at any byte: numpy's loops are
            values = self._columns[name] = values.copy()  # several times slower on such an array
        return values

    def host(self, key: int) -> str | None:
        return self._hosts.get(key)

    def bounds(self) -> dict[int, tuple[int, int]]:
        return self._bounds


class _PackedBlock:
    """`_DataBlock`'s interface over arrays it holds: a block that can leave this process."""

    def __init__(self, *, ranks, pids, first_step, steps: _PackedColumns, memwatch: _PackedColumns) -> None:
        self._ranks, self._pids, self.first_step = ranks, pids, first_step
        self.steps, self.memwatch = steps, memwatch

    def ranks(self) -> list[int]:
        return self._ranks

    def rank_pid(self, rank: int) -> int | None:
        return self._pids[rank]


def block_size(ranks: int, workers: int) -> int:
    """Ranks per block: at most RANKS_PER_BLOCK, in a number of blocks that `workers` share evenly (each
    worker one at least, none under MIN_RANKS_PER_BLOCK), all of about one size: with one short block last
    (10,000 ranks: nine of 1,024 and one of 784), a worker waited for the other at the end of the checks
    (~0.35 s of ~9 on 2 cores). Every figure is per rank, so the size changes none of them.

    >>> [block_size(10_000, 2), block_size(1024, 1), block_size(1024, 2), block_size(700, 4)]
    [1000, 1024, 512, 256]
    >>> [block_size(300, 2), block_size(3000, 1), block_size(3000, 2)]
    [300, 1000, 750]
    """
    if workers <= 1 or ranks < 2 * MIN_RANKS_PER_BLOCK:
        workers = 1  # one block, or blocks of at most RANKS_PER_BLOCK one after the other
    blocks = max(1, -(-ranks // RANKS_PER_BLOCK))
    blocks = -(-blocks // workers) * workers  # a whole number of rounds of the workers
    size = max(1, -(-ranks // blocks))
    return size if workers == 1 else max(min(MIN_RANKS_PER_BLOCK, RANKS_PER_BLOCK), size)


def in_blocks(
    data: _Data,
    make: Callable[[Any], T],
    join: Callable[[list[T]], T],
    slim: Callable[[T], T] | None = None,
) -> T:
    """`make(data)`, computed RANKS_PER_BLOCK ranks at a time (in parallel: `parallel.map_blocks`) and
    joined in rank order; one call for a smaller job. `slim`: what of a block's result `join` does not
    read is dropped where the block ran, before it is pickled back (a fit's points: 24 MB a block).
    A pass that `run_ahead` made already is joined from its blocks' results."""
    if (made := data.made_ahead.pop(_pass_key(make), None)) is not None:
        return join(made)
    results = _each_block(data, ((make, slim),))
    return make(data) if results is None else join([passes[0] for passes in results])


Pass = tuple[Callable[[Any], Any], Callable[[Any], Any] | None]  # (make, slim), as `in_blocks` takes them


def run_ahead(data: _Data, passes: Sequence[Pass]) -> None:
    """Every pass of `passes` over every block in one map, a block's passes one after the other where it
    runs; each pass's block results are kept on `data` for its `in_blocks`. Five maps one after the other
    left a worker idle at the end of each (one block ahead of the other) and both idle while this process
    joined one pass and sent the next: ~0.6 s of 9 at 10,000 ranks on 2 cores."""
    results = _each_block(data, tuple(passes))
    if results is not None:  # else one call per pass, on the whole job, made when asked
        data.made_ahead = {_pass_key(make): [r[k] for r in results] for k, (make, _) in enumerate(passes)}


def _each_block(data: _Data, passes: tuple[Pass, ...]) -> list[tuple] | None:
    """`passes` over every block of the job's ranks (`_every_pass`), in block order; None for a job of
    one block."""
    ranks = data.ranks()
    size = block_size(len(ranks), width())
    if len(ranks) <= size:
        return None
    blocks = [tuple(ranks[i : i + size]) for i in range(0, len(ranks), size)]
    run = partial(_every_pass, passes)
    # a block's `_DataBlock` is made where it runs (its converted columns die with it); forked workers
    # read `data` as this process holds it, a Dask worker gets the block's arrays (`_PackedBlock`)
    remote = Remote(apply=run, payload=lambda b: _block_of(data, b).packed(), owner=data, local=_block_of)
    return map_blocks(lambda b: run(_block_of(data, b)), blocks, remote=remote)


def _every_pass(passes: tuple[Pass, ...], block: Any) -> tuple:
    """Each pass's result over `block` (slimmed where it ran), the block's converted columns let go
    between two passes."""
    out = []
    for make, slim in passes:
        out.append(make(block) if slim is None else slim(make(block)))
        if hasattr(block, "forget"):
            block.forget()
    return tuple(out)


def _pass_key(make: Callable[[Any], Any]) -> Any:
    """The same for two equal partials of one function (what `run_ahead` and a pass's caller each make)."""
    if isinstance(make, partial):
        return (make.func, make.args, tuple(sorted(make.keywords.items())))
    return make


def _block_of(data: _Data, ranks: tuple[int, ...]) -> _DataBlock:
    return _DataBlock(data, list(ranks))
