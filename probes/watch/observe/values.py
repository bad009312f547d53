"""Plain JSON values of what a watched script configured: an optimizer's hyper-parameters, the sampler its
batches really come from, any setting as a JSON-safe value (part of observe.py, kept apart for size).
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

import torch

HYPER_SKIP = ("params", "foreach", "fused", "capturable", "differentiable", "maximize_dtype")


def hyper_parameters(defaults: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's constructor settings as plain JSON values: numbers, flags, strings, lists of numbers
    (implementation switches such as `foreach` say how it runs, not what it does, and are left out)."""
    out: dict[str, Any] = {}
    for key, value in defaults.items():
        if key in HYPER_SKIP:
            continue
        plain = _plain(value)
        scalar = plain is None or isinstance(plain, bool | int | float | str)
        if scalar or (isinstance(plain, list) and all(isinstance(v, int | float) for v in plain)):
            out[key] = plain
    return out


def yielding_sampler(loader: Any) -> Any:
    """The sampler whose indices the batches are made of: a loader given a `batch_sampler` (HF Trainer and
    accelerate wrap theirs: BatchSamplerShard, SkipBatchSampler) keeps a default SequentialSampler in
    `.sampler` that it never draws from; the real one is `batch_sampler[.batch_sampler...].sampler`."""
    node = getattr(loader, "batch_sampler", None)
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if node is None:
            break
        inner = getattr(node, "batch_sampler", None)
        if inner is not None and inner is not node:
            node = inner
            continue
        sampler = getattr(node, "sampler", None)
        if sampler is not None:
            return sampler
        break
    return getattr(loader, "sampler", None)


def _name(obj: Any) -> str | None:
    return type(obj).__name__ if obj is not None else None


def _plain(value: Any) -> Any:
    """A JSON-safe copy: numbers, strings, lists; a callable by its name (a partial with its keywords)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 and value.device.type == "cpu" else str(value.shape)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, functools.partial):
        return {"function": _plain(value.func), **{k: _plain(v) for k, v in value.keywords.items()}}
    if callable(value):
        return getattr(value, "__qualname__", None) or type(value).__name__
    return type(value).__name__
