"""Blocks run in forked worker processes that inherit the report's tables: nothing is pickled on the way
in, only each block's (small) result on the way back.

The job — the function and its items — is put in a module global before the workers are forked, and
each worker is sent an index only. The tables a block reads (hundreds of MB at 10,000 ranks) are the
parent's pages, shared copy-on-write: numpy and Arrow buffers carry no reference counts, so reading them
un-shares nothing. A worker's result comes back pickled; a block's per-rank figures are a few MB.
Workers are forked per call (a few ms each, the page tables of the parent), so each call's job is
the one they inherit. concurrent.futures' pool is used, not multiprocessing.Pool: a worker killed (the
OOM killer) raises BrokenProcessPool there, where Pool waits forever.
"""

from __future__ import annotations

import gc
import multiprocessing
import weakref
from collections.abc import Callable, Sequence
from typing import Any


class _State:
    job: tuple[Callable[[Any], Any], Sequence[Any]] | None = None  # what the next fork inherits
    owner: Any = None  # what an owner's pool inherits (`map_owned`)
    in_worker = False  # set in a forked worker: a job inside a block runs there, serially


_STATE = _State()


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def in_worker() -> bool:
    return _STATE.in_worker


def _run(index: int) -> Any:
    _STATE.in_worker = True
    assert _STATE.job is not None, "a forked worker inherits the job set before the fork"
    fn, items = _STATE.job
    return fn(items[index])


def map_forked(fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
    """[fn(item) for item in items], in `workers` forked processes (in item order)."""
    from concurrent.futures import ProcessPoolExecutor

    _STATE.job = (fn, items)
    # the objects made so far go to a generation no collection visits: a worker's collector would
    # otherwise write to every object's header, copying each page of the parent's heap it touches
    gc.freeze()
    try:
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            # chunksize 1: a block is seconds of work, and blocks differ (the last is short)
            return list(pool.map(_run, range(len(items)), chunksize=1))
    finally:
        gc.unfreeze()
        _STATE.job = None


def beside(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn() in one worker forked now, while this process goes on; the callable returned waits for its
    result (pickled back). A worker that died (killed) leaves fn() to that callable, here."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _STATE.job = (lambda _: fn(), [None])
    gc.freeze()  # as in map_forked
    try:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"))
        future = pool.submit(_run, 0)  # the fork happens here, while the job is set
    finally:
        gc.unfreeze()
        _STATE.job = None

    def result() -> Any:
        try:
            return future.result()
        except BrokenProcessPool:
            return fn()
        finally:
            pool.shutdown(wait=True)

    return result


# owner -> (its pool, workers): the workers forked while it lived, kept for its later jobs
_POOLS: weakref.WeakKeyDictionary[Any, tuple[Any, int]] = weakref.WeakKeyDictionary()


def map_owned(
    apply: Callable[[Any], Any],
    local: Callable[[Any, Any], Any],
    owner: Any,
    items: Sequence[Any],
    workers: int,
) -> list[Any]:
    """[apply(local(owner, item)) for item in items] in `workers` processes forked once for `owner`.

    A fresh worker faults in every page of its temporaries: forked per pass, the memory checks' five
    passes at 1,024 ranks cost 7.0 s of CPU against 5.1 s on one core. Forked once per owner (the
    memory analysis's data), a worker reuses its heap from pass to pass. `apply` and `local` travel
    pickled (module functions or partials of them); `owner` is inherited, never pickled."""
    pool = _pool_for(owner, workers)
    futures = [pool.submit(_run_owned, apply, local, item) for item in items]
    return [future.result() for future in futures]


def _run_owned(apply: Callable[[Any], Any], local: Callable[[Any, Any], Any], item: Any) -> Any:
    _STATE.in_worker = True
    return apply(local(_STATE.owner, item))


def _pool_for(owner: Any, workers: int) -> Any:
    from concurrent.futures import ProcessPoolExecutor

    kept = _POOLS.get(owner)
    if kept is not None and kept[1] == workers:
        return kept[0]
    if kept is not None:
        kept[0].shutdown(wait=False)
    _STATE.owner = owner
    gc.freeze()  # as in map_forked
    try:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))
        # with fork, every worker starts at the first submit: now, while the owner is set
        list(pool.map(int, range(workers)))
    finally:
        gc.unfreeze()
        _STATE.owner = None
    _POOLS[owner] = (pool, workers)
    weakref.finalize(owner, pool.shutdown, wait=False)  # the owner gone, its workers go
    return pool


def close_pools() -> None:
    """Stop every owner's workers (the command's `parallel.using` ends)."""
    for pool, _ in list(_POOLS.values()):
        pool.shutdown(wait=True)
    _POOLS.clear()
