"""What `watch` reads besides the step's own scalars: memory, the cross-rank weight checksum, and the
deferred read of device scalars (no device sync per step).

Device scalars (loss, grad norm, loss scale, found-inf, checksums) stay on the device when a step ends. On
CPU they are plain memory and are read at once. On CUDA they are copied into pinned host memory with a
non-blocking copy queued behind the step's kernels, and a CUDA event is recorded after it; the record is
written as soon as that event has completed (`Event.query()` never blocks). A `.item()` per step would
instead stall the host until the GPU drains its queue, every step.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

# USS reads may take at most 0.05 % of the step time, amortised. A read walks the page tables: 2.8 ms for a
# small CPU torch process here, so at 0.2 % it alone was a fifth of watch's 1 % on a 25 ms step (50 us).
# USS moves slowly; a rank's steps still carry it every ~6 s at 25 ms steps, RSS every step.
USS_COST_BUDGET = 0.0005
MAX_PENDING = 64  # records waiting for the device; beyond this the oldest is waited for


# ---- host and device memory -------------------------------------------------------------------
_NO_CUDA_MEMORY = MappingProxyType(
    {"mem_allocated": None, "mem_reserved": None, "mem_active_peak": None, "alloc_retries": None}
)


def cuda_memory(device: torch.device | None) -> Mapping[str, int | None]:
    """Allocator counters of this process's CUDA device (host-side bookkeeping: no device sync).

    Keys read with .get(): they differ between versions and the cudaMallocAsync backend. The peak is
    since process start (or the script's last reset): resetting it here would reset the user's own
    peak counters too, the side effect DeepSpeed's see_memory_usage has.
    """
    if device is None or device.type != "cuda":
        return _NO_CUDA_MEMORY  # read-only: one mapping for every step of a CPU job
    stats = torch.cuda.memory_stats(device)
    return {
        "mem_allocated": stats.get("allocated_bytes.all.current"),
        "mem_reserved": stats.get("reserved_bytes.all.current"),
        "mem_active_peak": stats.get("active_bytes.all.peak"),
        "alloc_retries": stats.get("num_alloc_retries"),
    }


_STATM: dict[int, int] = {}  # pid -> open fd of /proc/<pid>/statm (a forked child opens its own)
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def read_rss() -> int | None:
    """Resident set size: one pread of /proc/<pid>/statm on a descriptor kept open (a few us a step)."""
    pid = os.getpid()
    try:
        fd = _STATM.get(pid)
        if fd is None:
            fd = _STATM[pid] = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().memory_info().rss


def read_uss() -> int | None:
    """Unique set size: pages only this process holds (what it would give back if it exited).

    RSS counts shared pages (CUDA libraries, shared memory) in every process; USS does not. But the kernel
    must walk every page table to count it: ~1 ms for a small CPU job, far more for a large one.
    """
    try:
        total = 0
        with open("/proc/self/smaps_rollup", "rb") as fh:
            for line in fh:
                if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
        return total
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            return psutil.Process().memory_full_info().uss
        except Exception:
            return None


@dataclass(kw_only=True)
class UssSampler:
    """Reads USS every `every` steps, or less often when reading it is costly.

    The interval stretches so that the amortised cost stays within USS_COST_BUDGET of the step time:
    with a 1 ms read and 1 s steps that is every 10 steps (the floor); with a 3 ms read and 25 ms
    steps, every 240; with a 100 ms read on a 100 GB process and 1 s steps, every 200.

    >>> sampler = UssSampler(every=10)
    >>> sampler._interval(cost_s=0.003, step_time_s=0.025), sampler._interval(cost_s=0.001, step_time_s=1.0)
    (240, 10)
    """

    every: int = 10
    _next_step: int = 1
    _cost_s: float = 0.0

    def sample(self, step: int, step_time_s: float | None) -> int | None:
        if step < self._next_step:
            return None
        start = time.perf_counter()
        value = read_uss()
        self._cost_s = time.perf_counter() - start
        self._next_step = step + self._interval(self._cost_s, step_time_s)
        return value

    def _interval(self, cost_s: float, step_time_s: float | None) -> int:
        if not step_time_s or step_time_s <= 0:
            return self.every
        return max(self.every, math.ceil(cost_s / (USS_COST_BUDGET * step_time_s)))


# ---- cross-rank weight checksum ----------------------------------------------------------------
def is_sharded(params: list[torch.Tensor]) -> bool:
    """FSDP / DTensor shards differ between ranks by design: a checksum across ranks means nothing."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        DTensor = ()  # noqa: N806
    return any(isinstance(p, DTensor) or getattr(p, "_is_flat_param", False) for p in params)


@dataclass(kw_only=True)
class Replicas:
    """A DDP module's parameters and the process group over which they must be identical."""

    params: Callable[[], list[torch.Tensor]]
    group: Any

    def gather_checksums(self) -> tuple[torch.Tensor, list[int], int] | None:
        """all_gather of each rank's float64 parameter sum: (values, their global ranks, this rank)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        params = self.params()
        if not params or is_sharded(params):
            return None
        group = self.group if self.group is not None else dist.group.WORLD
        size = dist.get_world_size(group)
        if size < 2:
            return None
        with torch.no_grad():
            local = torch.stack([p.detach().sum(dtype=torch.float64) for p in params]).sum().reshape(1)
        if dist.get_backend(group) != "nccl":
            local = local.cpu()  # gloo gathers host tensors
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts), dist.get_process_group_ranks(group), dist.get_rank()


def agree_watched(group: Any, timeout_s: float) -> tuple[bool, str | None]:
    """Whether every rank of `group` is watched (and so will join the checksum all_gather); why not.

    Each watched rank says so under a key in the process group's own store (no collective), then waits
    up to `timeout_s` for the others. The first rank to decide writes the decision with compare_set and
    every rank follows it: a rank arriving after a "skip" skips too, so none is left alone in all_gather
    with a partner that is not watched (which would wait until the process-group timeout, 30 min).
    """
    import datetime

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return True, None  # no process group: gather_checksums does nothing
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) < 2:
        return True, None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # a private API: without it, no way to agree without a collective
        return False, "cross-rank weight checksum skipped: the process group has no store to agree on"
    prefix = "ciuic_watch/" + "-".join(map(str, ranks))
    store.set(f"{prefix}/watched/{dist.get_rank()}", "1")
    keys = [f"{prefix}/watched/{rank}" for rank in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        verdict = b"go"
    except Exception:  # DistStoreError: a rank did not say so in time
        verdict = b"skip"
    decided = store.compare_set(f"{prefix}/decision", b"", verdict)
    if decided == b"go":
        return True, None
    missing = [rank for rank, key in zip(ranks, keys, strict=True) if not store.check([key])]
    return False, (
        f"cross-rank weight checksum skipped: rank(s) {missing or '?'} not watched within "
        f"{timeout_s:g} s (its all_gather would wait for them)"
    )


def last_step_and_segment(path: Path) -> tuple[int, int]:
    """The last step and segment in an existing steps stream (0, 0 when there is none): a new watch
    session into the same run continues the numbering as its next segment."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 65536))
            tail = fh.read().splitlines()
    except OSError:
        return 0, 0
    for line in reversed(tail):  # the last whole line that is a step record (a torn one is skipped)
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            segment = record.get("segment")
            return record["step"], segment if isinstance(segment, int) else 1
    return 0, 0


# ---- deferred reads of device scalars ----------------------------------------------------------
@dataclass(kw_only=True)
class Pending:
    """A record whose device values are still on their way to the host."""

    record: dict[str, Any]
    host: list[tuple[list[tuple[str, int]], Any]] = field(default_factory=list)  # (keys+sizes, values)
    events: list[Any] = field(default_factory=list)

    def ready(self) -> bool:
        return all(event.query() for event in self.events)

    def values(self) -> dict[str, list[float]]:
        """Every lazy value as a list of floats (blocks only if the copy has not finished)."""
        for event in self.events:
            event.synchronize()
        out: dict[str, list[float]] = {}
        for keys, buffer in self.host:
            flat = buffer.tolist() if isinstance(buffer, torch.Tensor) else buffer
            offset = 0
            for key, size in keys:
                out[key] = flat[offset : offset + size]
                offset += size
        return out


def start_copy(record: dict[str, Any], lazy: dict[str, torch.Tensor | None]) -> Pending:
    """Queue the host copies of `lazy` (CPU tensors are read at once, without any copy)."""
    pending = Pending(record=record)
    by_device: dict[str, list[tuple[str, torch.Tensor]]] = {}
    host_keys: list[tuple[str, int]] = []
    host_values: list[Any] = []
    for key, tensor in lazy.items():
        if tensor is None:
            continue
        if tensor.device.type == "cpu":  # host memory: read now, no copy (a scalar: one .item())
            values = [tensor.item()] if tensor.numel() == 1 else tensor.detach().reshape(-1).tolist()
            host_keys.append((key, len(values)))
            host_values += values
            continue
        by_device.setdefault(str(tensor.device), []).append((key, tensor.detach().reshape(-1)))
    if host_keys:
        pending.host.append((host_keys, host_values))
    for items in by_device.values():
        keys = [(key, tensor.numel()) for key, tensor in items]
        joined = torch.cat([tensor.to(torch.float64) for _, tensor in items])
        buffer = torch.empty(joined.numel(), dtype=torch.float64, pin_memory=True)
        with torch.cuda.device(joined.device):  # copy and event on that device's current stream
            buffer.copy_(joined, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        pending.host.append((keys, buffer))
        pending.events.append(event)
    return pending


@dataclass(kw_only=True)
class PendingQueue:
    """Records in step order; each is written once its device values have reached the host."""

    finish: Callable[[Pending], None]
    _queue: deque[Pending] = field(default_factory=deque)

    def push(self, pending: Pending) -> None:
        self._queue.append(pending)
        self.drain(block=len(self._queue) > MAX_PENDING)

    def drain(self, *, block: bool = False) -> None:
        """Write every record that is ready; with `block`, first wait until half the backlog is gone."""
        while self._queue and (self._queue[0].ready() or (block and len(self._queue) > MAX_PENDING // 2)):
            self.finish(self._queue.popleft())

    def flush(self) -> None:
        while self._queue:
            self.finish(self._queue.popleft())
