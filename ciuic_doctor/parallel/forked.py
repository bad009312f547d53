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
from collections.abc import Callable, Sequence
from typing import Any


class _State:
    job: tuple[Callable[[Any], Any], Sequence[Any]] | None = None  # what the next fork inherits
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
