"""Independent blocks of work run on every core of this machine, or on a Dask cluster: `map_blocks`.

The report's heavy passes (the memory checks' per-rank fits) are already cut into blocks of ranks that
read only their own rows; this layer runs those blocks, in item order, on one of three back-ends:

- serial: one core, in this process (`--jobs 1`; and any job of one block: nothing to share);
- forked (the default): `usable_cores()` worker processes forked from this one, which inherit the
  tables already read — no data is pickled on the way in (`parallel.forked`); the jobs of one owner
  (the memory analysis's data: five passes) share workers forked once;
- Dask distributed (`--scheduler ADDRESS`): the blocks' arrays shipped to the cluster's workers once,
  every pass sent to them (`parallel.on_dask`); a job that cannot be shipped (no `remote`) runs forked.

Every back-end runs the same function on the same block and joins the results in the same order, so
the findings are identical to the bit (tests/test_parallel_report.py compares findings.json).
The command picks the back-end for its duration with `using(jobs=..., scheduler=...)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from ciuic_doctor.parallel.cores import usable_cores

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["Remote", "map_blocks", "usable_cores", "using", "width", "workers"]


@dataclass(frozen=True)
class Remote:
    """How a job runs where this process's memory is not: `apply(payload(item))` gives `fn(item)`.

    `apply` and the payload are pickled (cloudpickle: a lambda is fine); `owner`, when given, is the
    object the payloads are made from: while it lives, each item's payload stays on the cluster and
    later jobs with the same owner and item reuse it."""

    apply: Callable[[Any], Any]
    payload: Callable[[Any], Any]
    owner: object | None = None
    # (owner, item) -> what `apply` takes, made in a forked worker from the owner it inherited: with it
    # (and `apply` picklable by reference), the owner's jobs share workers forked once
    local: Callable[[Any, Any], Any] | None = None


@dataclass
class _Plan:
    jobs: int | None = None  # None: every usable core
    dask: Any = None  # an on_dask.DaskSession while `using(scheduler=...)` runs


_PLAN = _Plan()  # the command's choice, for as long as `using` runs


@contextmanager
def using(jobs: int | None = None, scheduler: str | None = None) -> Iterator[None]:
    """Run `map_blocks` on `jobs` local cores (None: all usable), or on the Dask scheduler at
    `scheduler`, until the block ends. A scheduler that does not answer raises UserError at once."""
    before = (_PLAN.jobs, _PLAN.dask)
    session = None
    if scheduler:
        from ciuic_doctor.parallel.on_dask import DaskSession

        session = DaskSession(scheduler)
    _PLAN.jobs, _PLAN.dask = jobs, session
    try:
        yield
    finally:
        from ciuic_doctor.parallel.forked import close_pools

        close_pools()
        _PLAN.jobs, _PLAN.dask = before
        if session is not None:
            session.close()


def workers(blocks: int) -> int:
    """Local worker processes for `blocks` blocks: the plan's jobs (else every usable core), never more
    than the blocks, 1 (serial) where this process cannot fork or is itself a forked worker."""
    from ciuic_doctor.parallel import forked

    if blocks <= 1 or forked.in_worker() or not forked.can_fork():
        return 1
    return max(1, min(blocks, _PLAN.jobs or usable_cores()))


def width() -> int:
    """How many blocks the current back-end runs at once: a job cut into fewer leaves workers idle."""
    from ciuic_doctor.parallel import forked

    if _PLAN.dask is not None:
        return max(1, _PLAN.dask.workers())
    if forked.in_worker() or not forked.can_fork():
        return 1
    return max(1, _PLAN.jobs or usable_cores())


def map_blocks(fn: Callable[[T], R], items: Sequence[T], *, remote: Remote | None = None) -> list[R]:
    """[fn(item) for item in items], computed on the current back-end, in item order."""
    if len(items) > 1 and _PLAN.dask is not None and remote is not None:
        return _PLAN.dask.map(remote, items)
    count = workers(len(items))
    if count == 1:
        return [fn(item) for item in items]
    from ciuic_doctor.parallel.forked import map_forked, map_owned

    if remote is not None and remote.owner is not None and remote.local is not None and _picklable(remote):
        return map_owned(remote.apply, remote.local, remote.owner, items, count)
    return map_forked(fn, items, count)


def _picklable(remote: Remote) -> bool:
    import pickle

    try:
        pickle.dumps((remote.apply, remote.local))
    except (pickle.PicklingError, TypeError, AttributeError):
        return False
    return True
