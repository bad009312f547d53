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

    def workers(self) -> int:
        return len(self.client.scheduler_info().get("workers", {}))

    def map(self, remote: Any, items: Sequence[Any]) -> list[Any]:
        """[remote.apply(remote.payload(item)) for item in items], on the cluster, in item order."""
        futures = []
        for item in items:  # a payload is made while the blocks before it compute
            futures.append(self.client.submit(remote.apply, self._payload(remote, item), pure=False))
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
