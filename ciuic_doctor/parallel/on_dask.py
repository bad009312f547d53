"""Blocks run on a Dask distributed cluster: each block's arrays shipped to a worker once, every pass
over the blocks sent where they are.

Dask's workers share no memory with the report, so a block goes over the network as a self-contained
payload (`Remote.payload`: the block's step rows and memwatch samples as numpy arrays, ~100 MB a block
of 1,024 ranks × 1,000 steps). The memory checks make five passes over the same blocks (host, device
and reserved-bytes fits, non-PyTorch bytes, fragmentation); the payload is scattered to the cluster
the first time and its future kept while the data it came from lives (`Remote.owner`), so the later
passes send a function only. `distributed` is imported here, inside functions: the default path
needs neither Dask nor its dependencies.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

CONNECT_TIMEOUT_S = 10  # a scheduler that answers does so in milliseconds; a wrong port never does


def _check_address(address: str) -> None:
    """A scheme Dask does not know, or no host, is refused before a Client is made: a Client that fails
    on one prints a traceback when it is collected."""
    from distributed.comm.addressing import parse_address
    from distributed.comm.registry import get_backend

    from ciuic_doctor.errors import UserError

    try:
        scheme, location = parse_address(address)
        get_backend(scheme)
    except ValueError as exc:
        raise UserError(f"--scheduler {address}: {' '.join(str(exc).split())}") from None
    if not location.strip(":"):
        raise UserError(f"--scheduler {address}: no host, e.g. tcp://host:8786") from None


class DaskSession:
    """A client of the scheduler at `address`, and the payloads already on its workers."""

    def __init__(self, address: str) -> None:
        from ciuic_doctor.errors import UserError

        try:
            from distributed import Client
        except ImportError:
            raise UserError("--scheduler needs Dask distributed: pip install 'ciuic-doctor[dask]'") from None
        _check_address(address)
        try:
            self.client = Client(address, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
        except Exception as exc:  # OSError, TimeoutError: all one line
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise UserError(f"--scheduler {address}: no Dask scheduler answered ({reason})") from None
        self.address = address
        # owner -> {item: the future of its payload on the cluster}; an owner gone frees its payloads
        self._scattered: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
        with contextlib.suppress(Exception):  # a worker that cannot warm up just starts cold
            self._warm_up()

    def _warm_up(self) -> None:
        """A `warm_up` task on every worker, not waited for: it runs while the report reads its streams."""
        from distributed import fire_and_forget

        for worker in self.client.scheduler_info().get("workers", {}):
            task = self.client.submit(warm_up, workers=[worker], allow_other_workers=False, pure=False)
            fire_and_forget(task)

    def workers(self) -> int:
        return len(self.client.scheduler_info().get("workers", {}))

    def map(self, remote: Any, items: Sequence[Any]) -> list[Any]:
        """[remote.apply(remote.payload(item)) for item in items], on the cluster, in item order."""
        futures = []
        for item in items:  # a payload is made while the blocks before it compute
            payload = self._payload(remote, item)
            futures.append(self.client.submit(on_worker, remote.apply, payload, pure=False))
        return self.client.gather(futures)

    def _payload(self, remote: Any, item: Any) -> Any:
        kept = self._kept(remote.owner)
        if kept is not None and item in kept:
            return kept[item]
        future = self.client.scatter(remote.payload(item), hash=False)
        if kept is not None:
            kept[item] = future
        return future

    def _kept(self, owner: Any) -> dict[Any, Any] | None:
        if owner is None:
            return None
        try:
            return self._scattered.setdefault(owner, {})
        except TypeError:  # an owner without weak references is not kept
            return None

    def close(self) -> None:
        self._scattered = weakref.WeakKeyDictionary()
        self.client.close()


# glibc's own dynamic mmap threshold grows to 32 MiB; Dask's nanny starts workers with
# MALLOC_TRIM_THRESHOLD_=65536, which fixes it at 128 KiB: every temporary of a block (8 MB arrays)
# was then a fresh mmap, page-faulted in and unmapped again — a block's checks took 2.2× the CPU
# of the same block in the report's process (4.5 s of thread time vs 2.9; 1.6 M minor faults).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
_ALLOCATOR: list[bool] = []  # set once per worker process


def on_worker(apply: Any, payload: Any) -> Any:
    """`apply(payload)` on a Dask worker, its allocator first set to keep a block's temporaries."""
    if not _ALLOCATOR:
        _ALLOCATOR.append(_keep_temporaries())
    return apply(payload)


def warm_up() -> None:
    """Run on every worker as the report connects, while it reads its streams: the allocator set and
    numpy and pandas imported before the first block comes. A cold worker's first pass took ~2 s longer
    (10,000 ranks: the checks' first round on a fresh cluster 13.1 s, the next ones 10.4–11.0 s)."""
    if not _ALLOCATOR:
        _ALLOCATOR.append(_keep_temporaries())
    import numpy  # noqa: F401
    import pandas  # noqa: F401


def _keep_temporaries() -> bool:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to set
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
