"""The five collectives comm-bench measures: buffers, launch, and an exact correctness check.

Sizes follow nccl-tests: `bytes` is the whole buffer (the larger of send and receive), `count` its
elements, and for all_gather / reduce_scatter / all_to_all the size is rounded down to a multiple of
world_size elements, so every rank's share is equal.

Placements. torch.distributed has no out-of-place all_reduce or broadcast (both work on one tensor), so
those two are measured in place only; all_to_all_single is measured out of place only, because NCCL
gives no guarantee when send and receive buffers alias (PyTorch's all-to-all is grouped send/recv).
all_gather and reduce_scatter have both, in place meaning the nccl-tests layout: a rank's share is a
slice of the full buffer.

The inputs and the expected results live in comm_check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    # DeepSeek-V3 dispatches MoE tokens in FP8 over all_to_all; reductions in FP8 are rarely supported
    "float8_e4m3fn": torch.float8_e4m3fn,
}
NCCL_TESTS_TYPE = {"float32": "float", "float16": "half", "bfloat16": "bfloat16", "float64": "double",
                   "int32": "int32", "int64": "int64", "float8_e4m3fn": "f8e4m3"}  # fmt: skip
REDUCING = ("all_reduce", "reduce_scatter")
# (out-of-place, in-place) availability; see the module docstring for why.
PLACEMENTS: dict[str, tuple[bool, ...]] = {
    "all_reduce": (True,),
    "broadcast": (True,),
    "all_gather": (False, True),
    "reduce_scatter": (False, True),
    "all_to_all": (False,),
}
PLACEMENT_NOTE = {
    "all_reduce": "in place only: torch.distributed.all_reduce has no out-of-place form",
    "broadcast": "in place only: torch.distributed.broadcast works on one tensor",
    "all_to_all": "out of place only: NCCL does not allow aliased all-to-all buffers",
}


@dataclass(kw_only=True)
class Shape:
    """How one (collective, size) is laid out: total elements and each rank's share."""

    collective: str
    count: int  # elements in the whole buffer, as nccl-tests prints
    share: int  # elements per rank for the sharded collectives (= count otherwise)
    bytes: int


def shape(collective: str, size_bytes: int, elem_bytes: int, world_size: int) -> Shape | None:
    """Lay out `size_bytes`; None when the size is too small to give every rank one element."""
    count = size_bytes // elem_bytes
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        share = count // world_size
        count = share * world_size
    else:
        share = count
    if count == 0 or share == 0:
        return None
    return Shape(collective=collective, count=count, share=share, bytes=count * elem_bytes)


@dataclass(kw_only=True)
class Buffers:
    send: torch.Tensor
    recv: torch.Tensor  # for in-place collectives a view of (or the same tensor as) `send`


def allocate(sh: Shape, *, inplace: bool, dtype: torch.dtype, device: torch.device, rank: int) -> Buffers:
    full = torch.zeros(sh.count, dtype=dtype, device=device)
    if sh.collective in ("all_reduce", "broadcast"):
        return Buffers(send=full, recv=full)
    mine = slice(rank * sh.share, (rank + 1) * sh.share)
    if sh.collective == "all_gather":
        if inplace:
            return Buffers(send=full[mine], recv=full)
        return Buffers(send=torch.zeros(sh.share, dtype=dtype, device=device), recv=full)
    if sh.collective == "reduce_scatter":
        if inplace:
            return Buffers(send=full, recv=full[mine])
        return Buffers(send=full, recv=torch.zeros(sh.share, dtype=dtype, device=device))
    if sh.collective == "all_to_all":
        return Buffers(send=full, recv=torch.zeros_like(full))
    raise ValueError(f"unknown collective {sh.collective!r}")


# torch ≥ 2.13 renames the tensor forms (`*_into_tensor` / `*_tensor` warn as deprecated); older torch
# only has the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def launch(collective: str, buf: Buffers, group: Any, root: int = 0) -> None:
    """One collective call (synchronous for gloo; enqueued on the NCCL stream for nccl)."""
    if collective == "all_reduce":
        dist.all_reduce(buf.recv, group=group)
    elif collective == "broadcast":
        dist.broadcast(buf.recv, src=root, group=group)
    elif collective == "all_gather":
        _all_gather(buf.recv, buf.send, group=group)
    elif collective == "reduce_scatter":
        _reduce_scatter(buf.recv, buf.send, group=group)
    elif collective == "all_to_all":
        dist.all_to_all_single(buf.recv, buf.send, group=group)
    else:
        raise ValueError(f"unknown collective {collective!r}")


def elem_bytes(dtype: str) -> int:
    return torch.tensor([], dtype=DTYPES[dtype]).element_size()


def sweep_sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """min, min·f, min·f², ... up to max inclusive (nccl-tests' -b/-e/-f)."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        nxt = math.floor(size * factor)
        if nxt <= size:
            break
        size = nxt
    return sizes
