"""The wrappers watch puts around torch's functions: each hands what it saw to the session's hook bodies
(`session._on_backward`, `_on_clip`, ...) through `session._guarded`, so a bug in them never breaks the
user's training. `WatchSession._install` applies them (the clip ones through `install_clip`); a new hook
is one more factory here and one `self._patch` line there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ciuic_doctor.probes.watch.steps import found_inf
from ciuic_doctor.probes.watch.warn_origin import call_as_caller


def backward(session: Any, original: Callable) -> Callable:
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        # Re-entrant activation checkpointing calls backward inside backward: not a new loss.
        if session._backward_depth == 0:
            session._guarded(session._on_backward, tensors)
        session._backward_depth += 1
        try:
            return original(tensors, *args, **kwargs)
        finally:
            session._backward_depth -= 1

    return backward


def install_clip(session: Any) -> list[Callable]:
    """Wrap clip_grad_norm_ (under both names a script imports it by) and, on torch >= 2.6,
    clip_grads_with_norm_; the undo of each. torch's clip_grad_norm_ calls the module's private copy of
    clip_grads_with_norm_, so one clip is never seen twice."""
    import functools

    import torch
    import torch.nn.utils.clip_grad as clip_module

    undo: list[Callable] = []
    clip = clip_grad_norm_(session, clip_module.clip_grad_norm_)
    for owner in (clip_module, torch.nn.utils):
        original = owner.clip_grad_norm_
        owner.clip_grad_norm_ = functools.wraps(original)(clip)
        undo.append(functools.partial(setattr, owner, "clip_grad_norm_", original))
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        original = torch.nn.utils.clip_grads_with_norm_
        wrapper = clip_grads_with_norm_(session, original)
        torch.nn.utils.clip_grads_with_norm_ = functools.wraps(original)(wrapper)
        undo.append(functools.partial(setattr, torch.nn.utils, "clip_grads_with_norm_", original))
    return undo


def clip_grad_norm_(session: Any, original: Callable) -> Callable:
    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        total = original(*args, **kwargs)
        max_norm = kwargs.get("max_norm", args[1] if len(args) > 1 else None)
        session._guarded(session._on_clip, total, max_norm)
        return total

    return clip_grad_norm_


def clip_grads_with_norm_(session: Any, original: Callable) -> Callable:
    """`torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)`: the clip of a norm taken
    apart (torch ≥ 2.6), which accelerate ≥ 1.16 (so HF Trainer) uses instead of clip_grad_norm_; the
    norm it is handed is the pre-clip total norm, as clip_grad_norm_ returns it."""

    def clip_grads_with_norm_(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        max_norm = kwargs.get("max_norm", args[1] if len(args) > 1 else None)
        total = kwargs.get("total_norm", args[2] if len(args) > 2 else None)
        session._guarded(session._on_clip, total, max_norm)
        return result

    return clip_grads_with_norm_


def scale(session: Any, original: Callable) -> Callable:
    def scale(scaler: Any, outputs: Any) -> Any:
        result = original(scaler, outputs)
        session._guarded(session._on_scale, scaler, outputs, result)
        return result

    return scale


def scaler_step(session: Any, original: Callable) -> Callable:
    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not scaler.is_enabled():  # a disabled scaler calls optimizer.step() and nothing else
            return original(scaler, optimizer, *args, **kwargs)
        session._guarded(session._on_scaler_step, optimizer)
        session._in_scaler_step.add(id(optimizer))
        try:
            return original(scaler, optimizer, *args, **kwargs)
        finally:
            session._in_scaler_step.discard(id(optimizer))

    return step


def scaler_update(session: Any, original: Callable) -> Callable:
    def update(scaler: Any, new_scale: Any = None) -> None:
        found = session._guarded(found_inf, scaler) if new_scale is None else None
        original(scaler, new_scale)
        if scaler.is_enabled() and session._awaiting_update:
            session._guarded(session._flush_awaiting, scaler=scaler, found_inf=found or {})

    return update


def ddp_init(session: Any, original: Callable) -> Callable:
    def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        call_as_caller(original, ddp, *args, **kwargs)  # its warnings keep the script's line
        session._guarded(session.watch_replicas, ddp.module, getattr(ddp, "process_group", None))

    return __init__


def optimizer_init(session: Any, original: Callable) -> Callable:
    def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        call_as_caller(original, optimizer, *args, **kwargs)
        session._guarded(session._on_optimizer_created, optimizer)

    return __init__
