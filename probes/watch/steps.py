"""What one optimizer step collects while it runs, and how its device values become record fields
(watch.WatchSession keeps these per process; nothing here hooks anything).

    >>> import torch
    >>> float(total_loss([torch.tensor(0.25), torch.tensor(0.5)]))
    0.75
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ciuic_doctor.measures.ranks import differing_ranks


@dataclass(kw_only=True, slots=True)
class Group:
    """The backward calls since the last optimizer step: the gradients the next step(s) use."""

    losses: list[torch.Tensor] = field(default_factory=list)
    backward_calls: int = 0
    t_first_backward: float | None = None
    clip_norm: torch.Tensor | None = None
    clip_max_norm: float | None = None
    scaler: Any = None  # an enabled GradScaler that scaled this group's loss
    scale_used: torch.Tensor | None = None  # the scale it multiplied the loss by
    sealed: bool = False  # an optimizer stepped on it: the next backward starts a new group
    # backward calls per call site (code, line), closure re-evaluations left out: a site called k times
    # is k micro-batches accumulated; two sites once each are two losses of one step (a GAN's D)
    sites: Counter = field(default_factory=Counter)
    reached: set[int] | None = None  # id() of the parameters its losses' graphs reach (first groups only)


@dataclass(kw_only=True)
class OptimizerState:
    """One optimizer's identity and the step it is in."""

    ref: weakref.ref
    index: int
    name: str
    count: int = 0  # steps recorded in this session
    t_prev_end: float | None = None
    grad_norm: torch.Tensor | None = None  # computed for the step in progress
    stepped: bool = False  # the step in progress reached the optimizer (not skipped by a scaler)
    group: Group | None = None  # the group of a step that waits for scaler.update()


TRACED_GROUPS = 8  # the first backward groups' graphs are walked (~1 ms each): enough to see which
# optimizers' losses reach another's parameters (a GAN: G's loss goes through D)
_NOT_CALLERS = tuple(
    f"{p}{os.sep}" for p in (Path(torch.__file__).parent, Path(__file__).resolve().parents[1])
)


_SKIPPED: dict[Any, bool] = {}  # code object -> it is torch's or watch's (a frame to look past)
_SKIPPED_MAX = 4096  # code objects remembered; past it the answer is computed again (a code object
# made per call, by exec, must not grow this forever)


def backward_site() -> tuple[Any, int] | None:
    """(code, line) of the first frame outside torch and watch that led to this backward call. Each code
    object's answer is remembered: the walk runs every backward, the answer never changes."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        code = frame.f_code
        skipped = _SKIPPED.get(code)
        if skipped is None:
            skipped = code.co_filename.startswith(_NOT_CALLERS)
            if len(_SKIPPED) < _SKIPPED_MAX:
                _SKIPPED[code] = skipped
        if not skipped:
            return code, frame.f_lineno
        frame = frame.f_back
    return None


def accumulated(group: Group) -> int:
    """Micro-batches accumulated into this step's gradients: the most backward calls from one call site."""
    return max(group.sites.values(), default=0)


def graph_parameters(loss: torch.Tensor, limit: int = 50_000) -> set[int]:
    """id() of the leaf tensors (parameters) `loss`'s autograd graph reaches, walking at most `limit` nodes:
    a GAN's generator loss reaches the discriminator's parameters too (it is computed through D)."""
    out: set[int] = set()
    start = loss.grad_fn
    if start is None:
        return out
    stack, seen = [start], {start}
    while stack and len(seen) < limit:
        node = stack.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            out.add(id(variable))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return out


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def grad_norm(optimizer: Any) -> torch.Tensor | None:
    """The total 2-norm of the gradients `optimizer` is about to apply (None: it has none)."""
    grads = [p.grad for p in optimizer_params(optimizer) if p.grad is not None]
    if not grads:
        return None
    if len(grads) == 1 and not grads[0].is_sparse:  # one op, not get_total_norm's foreach + stack + norm
        grad = grads[0]
        norm = torch.linalg.vector_norm(grad.detach() if grad.requires_grad else grad)
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    # Fused optimizers unscale inside their kernel: their grads still carry the loss scale here.
    grad_scale = getattr(optimizer, "grad_scale", None)
    if isinstance(grad_scale, torch.Tensor):
        norm = norm / grad_scale.to(norm.device)
    # detach() is an op of its own (~1 us a step); a norm that carries no graph is kept as it is
    return norm.detach() if norm.requires_grad else norm


def found_inf(scaler: Any) -> dict[int, torch.Tensor]:
    """id(optimizer) -> sum of its found-inf flags for this step, on the device (GradScaler internals)."""
    out = {}
    for key, state in getattr(scaler, "_per_optimizer_states", {}).items():
        flags = list(state.get("found_inf_per_device", {}).values())
        if flags:
            device = flags[0].device
            out[key] = sum((f.to(device, non_blocking=True).float() for f in flags[1:]), flags[0].float())
    return out


def merge_values(record: dict[str, Any], values: dict[str, list[float]]) -> None:
    """Put a step's device values, now on the host, into its record (and the checksum verdict)."""
    first = {key: vals[0] if vals else None for key, vals in values.items() if key != "checksums"}
    for key in ("loss", "grad_norm", "loss_scale", "loss_scale_next", "lr"):
        if key in first:
            record[key] = first[key]
    if "found_inf" in first:
        record["skipped"] = bool(first["found_inf"] > 0)
    ranks, me = record.pop("_checksum_ranks", None), record.pop("_checksum_me", None)
    if "checksums" in values and ranks:
        record["weights_checksum"] = values["checksums"][ranks.index(me)] if me in ranks else None
        record["desync_ranks"] = differing_ranks(values["checksums"], ranks)


def norm_source(group: Group, computed: torch.Tensor | None) -> str | None:
    if group.clip_norm is not None:
        return "clip"
    return "computed" if computed is not None else None


def total_loss(losses: list[torch.Tensor]) -> torch.Tensor | None:
    """The step's loss: the one backward() loss, or the sum over micro-batches (each already divided by
    the accumulation count in a correct loop, so the sum is the mean loss)."""
    if not losses:
        return None
    total = losses[0]
    for loss in losses[1:]:
        total = total.float() + loss.float()
    return total
