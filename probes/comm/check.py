"""Inputs whose collective result is exact whatever the reduction order, and that result per rank.

nccl-tests' rule: the check must be bit-exact for Ring and Tree alike, which reduce in different orders.
Small integers do it: rank r's element i is B[(i + r) mod K] = (i + r) mod K, with K chosen so that the
sum over all ranks stays exactly representable in the dtype (integers up to 2**8 in bfloat16, 2**11 in
float16, 2**24 in float32, 2**4 in float8 e4m3), and every partial sum of integers below that bound is
exact too. Where even K = 2 would overflow that bound (bfloat16 beyond 128 ranks), the inputs are one-hot
instead: element i is 1 on rank i mod n only, so every sum is exactly 1.

Both the inputs and the expected results are periodic in i, so they are built by repeating one short
tile on the device (a copy, not arithmetic per element), and compared there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ciuic_doctor.probes.comm.collectives import Buffers, Shape

# Largest M such that every integer in [0, M] is exact in the dtype (2**(mantissa bits + 1)).
EXACT_UP_TO = {"float32": 2**24, "float16": 2**11, "bfloat16": 2**8, "float64": 2**53,
               "int32": 2**31 - 1, "int64": 2**63 - 1, "float8_e4m3fn": 2**4}  # fmt: skip
MAX_PERIOD = 251  # prime: a block that lands at a wrong offset rarely matches by accident


@dataclass(kw_only=True, frozen=True)
class Pattern:
    """Rank r's element i is base[(i + sign·r) mod period]."""

    period: int
    sign: int
    base: tuple[int, ...]
    world_size: int

    @functools.cached_property
    def sums(self) -> tuple[int, ...]:
        """Σ over ranks of element i, which depends on i mod period only."""
        base = torch.tensor(self.base, dtype=torch.int64)
        index = (
            torch.arange(self.period)[:, None] + self.sign * torch.arange(self.world_size)[None, :]
        ) % self.period
        return tuple(int(v) for v in base[index].sum(dim=1))


def pattern_for(dtype: str, world_size: int) -> Pattern:
    period = min(MAX_PERIOD, EXACT_UP_TO[dtype] // max(world_size, 1))
    if period >= 2:
        return Pattern(period=period, sign=1, base=tuple(range(period)), world_size=world_size)
    return Pattern(period=world_size, sign=-1, base=(1,) + (0,) * (world_size - 1), world_size=world_size)


def periodic(tile: tuple[int, ...], starts: list[int], length: int, like: torch.Tensor) -> torch.Tensor:
    """Blocks t_k[j] = tile[(starts[k] + j) mod len(tile)], j < length, concatenated, in `like`'s dtype
    and device: one repeat of the tile, then slices of it."""
    period = len(tile)
    unit = torch.tensor(tile, dtype=like.dtype, device=like.device)
    long = unit.repeat(length // period + 2)
    blocks = [long[start % period : start % period + length] for start in starts]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def fill_inputs(buf: Buffers, *, rank: int, pattern: Pattern) -> None:
    """This rank's pattern on the send side; the receive side cleared first (in-place layouts overlap)."""
    buf.recv.zero_()
    buf.send.copy_(periodic(pattern.base, [pattern.sign * rank], buf.send.numel(), buf.send))


def expected(
    collective: str, sh: Shape, *, rank: int, pattern: Pattern, like: torch.Tensor, root: int = 0
) -> torch.Tensor:
    """What this rank's receive buffer must hold after one call on `fill_inputs` data."""
    n, m, p = pattern.world_size, sh.share, pattern
    if collective == "all_reduce":
        return periodic(p.sums, [0], sh.count, like)
    if collective == "reduce_scatter":  # my share of the sum
        return periodic(p.sums, [rank * m], m, like)
    if collective == "broadcast":
        return periodic(p.base, [p.sign * root], sh.count, like)
    if collective == "all_gather":  # block s is rank s's send buffer
        return periodic(p.base, [p.sign * s for s in range(n)], m, like)
    if collective == "all_to_all":  # block s is block `rank` of rank s's send buffer
        return periodic(p.base, [rank * m + p.sign * s for s in range(n)], m, like)
    raise ValueError(f"unknown collective {collective!r}")


def count_wrong(received: torch.Tensor, want: torch.Tensor) -> int:
    """Elements that differ from the exact expected values (compared in the buffer's own dtype)."""
    return int((received != want).sum())
