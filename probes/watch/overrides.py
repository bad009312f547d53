"""`watch --set KEY=VALUE`: run an unchanged script with one of its settings changed.

The keys are the job spec's names, as `observed` uses them; each is applied through the constructor or
call that already carries it, before the original runs, so the script builds what it would have built
with that value written in its source:

    dataloader.num_workers / prefetch_factor / pin_memory / persistent_workers   DataLoader.__init__ (every
        loader the script builds; num_workers = 0 also drops prefetch_factor, persistent_workers and
        multiprocessing_context, which DataLoader refuses without workers)
    precision.init_scale / growth_interval       torch.amp.GradScaler.__init__ (torch.cuda.amp's too)
    optim.clip_max_norm                          the max_norm clip_grad_norm_ (or clip_grads_with_norm_,
        accelerate's and so HF Trainer's way to clip) is called with
    distributed.timeout_s                        init_process_group(timeout=...)
    distributed.env.NAME  (NCCL_*, TORCH_*, GLOO_*, PYTORCH_CUDA_ALLOC_CONF)   os.environ, set before the
        script runs, so before its process group exists

A key the script gives no hold to (no DataLoader, no enabled GradScaler, no clip_grad_norm_ call, no
process group, an env variable the script overwrites itself) cannot be known before the script runs:
it is refused at the first optimizer step, the first point where it is knowable (the training loop has
built its loader, scaler and process group by then), with one line and exit 2; a script that ends
without any step is judged the same way when it ends. Unknown keys and bad values are refused before
anything runs (`parse`, no torch imported).

`record()` is what meta.json's `observed.overrides` holds: per key the script's own value and the one in
force. The wrappers sit outside watch's own hooks, so `observed` and the step records show the values
in force.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.errors import UserError

REFUSED_EXIT = 2


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v <= 10**9


def _positive(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and 0 < v <= 1e9


ENV_KEY = re.compile(r"^distributed\.env\.((?:NCCL|TORCH|GLOO)_[A-Z0-9_]+|PYTORCH_CUDA_ALLOC_CONF)$")
# key -> (what it is applied through, what the value must be, its check)
KEYS: dict[str, tuple[str, str, Callable[[Any], bool]]] = {
    "dataloader.num_workers": ("DataLoader", "a whole number >= 0", lambda v: _int(v) and v >= 0),
    "dataloader.prefetch_factor": ("DataLoader", "a whole number >= 1", lambda v: _int(v) and v >= 1),
    "dataloader.pin_memory": ("DataLoader", "true or false", lambda v: isinstance(v, bool)),
    "dataloader.persistent_workers": ("DataLoader", "true or false", lambda v: isinstance(v, bool)),
    "precision.init_scale": ("GradScaler", "a finite number > 0", _positive),
    "precision.growth_interval": ("GradScaler", "a whole number >= 1", lambda v: _int(v) and v >= 1),
    "optim.clip_max_norm": ("clip_grad_norm_", "a finite number > 0", _positive),
    "distributed.timeout_s": ("init_process_group", "a finite number > 0", _positive),
}
WHAT_IS_MISSING = {
    "DataLoader": "the script built no torch DataLoader",
    "GradScaler": "the script built no enabled GradScaler (it does not train in fp16 with loss scaling)",
    "clip_grad_norm_": "the script never called clip_grad_norm_ (or clip_grads_with_norm_)",
    "init_process_group": "the script created no process group (init_process_group)",
}


def parse_value(text: str) -> Any:
    """A TOML value (`3`, `1e-4`, `true`, `"x"`), else the bare text as a string."""
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def settable_keys() -> str:
    return ", ".join([*KEYS, "distributed.env.NCCL_*|TORCH_*|GLOO_*|PYTORCH_CUDA_ALLOC_CONF"])


def parse(items: list[str], *, flag: str = "--set") -> dict[str, Any]:
    """KEY=VALUE items -> {key: value}; every unknown key or bad value named in one UserError."""
    settings: dict[str, Any] = {}
    bad: list[str] = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            bad.append(f"{item!r}: expected KEY=VALUE, e.g. dataloader.num_workers=4")
            continue
        value = parse_value(text.strip())
        if ENV_KEY.match(key):
            if not isinstance(value, str | int | float | bool) or not str(value).isprintable():
                bad.append(f"{key} = {text.strip()!r}: must be a one-line value")
                continue
            value = str(value).lower() if isinstance(value, bool) else str(value)
        elif key in KEYS:
            _, must, ok = KEYS[key]
            if not ok(value):
                bad.append(f"{key} = {text.strip()}: must be {must}")
                continue
        else:
            bad.append(f"{key}: not a setting watch can apply to a script (it can: {settable_keys()})")
            continue
        settings[key] = value
    if bad:
        raise UserError(f"{flag}: " + "; ".join(bad))
    return settings


@dataclass(kw_only=True)
class Override:
    key: str
    value: Any
    through: str
    script: Any = None  # the script's own value (the first call's)
    seen: bool = False
    applied: int = 0  # calls / constructions the value was put into
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        in_force = self.value if self.applied else None  # a value put into nothing is not in force
        out = {"script": self.script, "in_force": in_force, "through": self.through}
        out["applied"] = self.applied
        return {**out, "note": self.note} if self.note else out


@dataclass(kw_only=True)
class Overrides:
    items: dict[str, Override] = field(default_factory=dict)
    undo: list[Callable[[], None]] = field(default_factory=list)
    checked: bool = False
    refused: str = ""  # the line the script was stopped with (exit 2), if it was

    def unapplied(self) -> list[str]:
        """One sentence per key the script gave no hold to."""
        out = []
        for o in self.items.values():
            if o.through == "env":
                current = os.environ.get(o.key.rsplit(".", 1)[1])
                if current != o.value:
                    out.append(f"{o.key}: the script sets it itself (to {current!r}), after watch set it")
            elif not o.applied:
                out.append(f"{o.key}: {o.note or WHAT_IS_MISSING[o.through]}")
        return out

    def refusal(self, when: str) -> str | None:
        missing = self.unapplied()
        if not missing:
            return None
        return f"ciuic-doctor watch: --set cannot be applied to this script ({when}): " + "; ".join(missing)

    def close(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()


_ACTIVE: list[Overrides] = []


def record() -> dict[str, Any]:
    """meta.json `observed.overrides`: {key: {script, in_force, through, applied}} ({} when none)."""
    return {k: o.to_dict() for k, o in _ACTIVE[-1].items.items()} if _ACTIVE else {}


def install(settings: dict[str, Any]) -> Overrides:
    """Apply `settings` (from `parse`) to what the script will build; call after watch's own hooks."""
    state = Overrides()
    _ACTIVE.append(state)
    if not settings:
        return state
    for key, value in settings.items():
        through = "env" if ENV_KEY.match(key) else KEYS[key][0]
        state.items[key] = Override(key=key, value=value, through=through)
        if through == "env":
            name = key.rsplit(".", 1)[1]
            state.items[key].script = os.environ.get(name)
            state.items[key].applied = 1
            os.environ[name] = value
    families = {o.through for o in state.items.values()}
    if "DataLoader" in families:
        _hook_loader(state)
    if "GradScaler" in families:
        _hook_scaler(state)
    if "clip_grad_norm_" in families:
        _hook_clip(state)
    if "init_process_group" in families:
        _hook_process_group(state)
    _hook_first_step(state)
    return state


def _patch(state: Overrides, owner: Any, name: str, wrapper: Callable) -> None:
    original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(wrapper(original)))
    state.undo.append(functools.partial(setattr, owner, name, original))


def _take(state: Overrides, key: str, bound: inspect.BoundArguments, param: str, default: Any) -> None:
    """Put the override of `key` into `bound` (the call's arguments), noting the script's own value."""
    o = state.items.get(key)
    if o is None:
        return
    if not o.seen:
        o.script, o.seen = bound.arguments.get(param, default), True
    bound.arguments[param] = o.value
    o.applied += 1


def _not_in_force(state: Overrides, key: str) -> None:
    """`key` was dropped from this DataLoader (it needs workers): it is not in force there, and a key
    in force nowhere is refused with this reason, never reported as applied."""
    o = state.items.get(key)
    if o is not None and o.seen and o.applied:
        o.applied -= 1
        o.note = "it acts only with DataLoader workers, and the script's loader runs num_workers=0"


def _hook_loader(state: Overrides) -> None:
    from torch.utils.data import DataLoader

    signature = inspect.signature(DataLoader.__init__)
    defaults = {n: p.default for n, p in signature.parameters.items()}

    def make(original: Callable) -> Callable:
        def __init__(loader: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            bound = signature.bind(loader, *args, **kwargs)
            for name in ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers"):
                _take(state, f"dataloader.{name}", bound, name, defaults[name])
            if bound.arguments.get("num_workers", 0) == 0:  # DataLoader refuses these without workers
                for name in ("prefetch_factor", "persistent_workers", "multiprocessing_context"):
                    bound.arguments.pop(name, None)
                    _not_in_force(state, f"dataloader.{name}")
            original(*bound.args, **bound.kwargs)

        return __init__

    _patch(state, DataLoader, "__init__", make)


def _hook_scaler(state: Overrides) -> None:
    from torch.amp.grad_scaler import GradScaler

    signature = inspect.signature(GradScaler.__init__)
    defaults = {n: p.default for n, p in signature.parameters.items()}

    def make(original: Callable) -> Callable:
        def __init__(scaler: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            bound = signature.bind(scaler, *args, **kwargs)
            if bound.arguments.get("enabled", True):  # a disabled scaler keeps none of its settings
                for name in ("init_scale", "growth_interval"):
                    _take(state, f"precision.{name}", bound, name, defaults[name])
            original(*bound.args, **bound.kwargs)

        return __init__

    _patch(state, GradScaler, "__init__", make)


def _hook_clip(state: Overrides) -> None:
    import torch
    import torch.nn.utils.clip_grad as clip_module

    signature = inspect.signature(clip_module.clip_grad_norm_)
    wrapped: dict[int, Callable] = {}

    def make(original: Callable) -> Callable:
        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            _take(state, "optim.clip_max_norm", bound, "max_norm", None)
            return original(*bound.args, **bound.kwargs)

        return clip_grad_norm_

    for owner in (clip_module, torch.nn.utils):  # `from torch.nn.utils import clip_grad_norm_` too
        original = owner.clip_grad_norm_
        if id(original) not in wrapped:
            wrapped[id(original)] = functools.wraps(original)(make(original))
        owner.clip_grad_norm_ = wrapped[id(original)]
        state.undo.append(functools.partial(setattr, owner, "clip_grad_norm_", original))
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):  # torch >= 2.6: the clip of a norm taken apart
        with_norm = torch.nn.utils.clip_grads_with_norm_
        with_signature = inspect.signature(with_norm)

        def clip_grads_with_norm_(*args: Any, **kwargs: Any) -> Any:
            bound = with_signature.bind(*args, **kwargs)
            _take(state, "optim.clip_max_norm", bound, "max_norm", None)
            return with_norm(*bound.args, **bound.kwargs)

        torch.nn.utils.clip_grads_with_norm_ = functools.wraps(with_norm)(clip_grads_with_norm_)
        state.undo.append(functools.partial(setattr, torch.nn.utils, "clip_grads_with_norm_", with_norm))


def _hook_process_group(state: Overrides) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        state.items["distributed.timeout_s"].note = "torch.distributed is not available in this build"
        return
    import torch.distributed.distributed_c10d as c10d

    signature = inspect.signature(c10d.init_process_group)
    o = state.items["distributed.timeout_s"]

    def make(original: Callable) -> Callable:
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            if not o.seen:
                timeout = bound.arguments.get("timeout")
                o.script = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None
                o.seen = True
            bound.arguments["timeout"] = datetime.timedelta(seconds=float(o.value))
            o.applied += 1
            return original(*bound.args, **bound.kwargs)

        return init_process_group

    original = c10d.init_process_group
    wrapper = functools.wraps(original)(make(original))
    for owner in (c10d, dist):  # one wrapper under both names, as watch's observer does
        state.undo.append(functools.partial(setattr, owner, "init_process_group", owner.init_process_group))
        owner.init_process_group = wrapper


def _hook_first_step(state: Overrides) -> None:
    """At the first optimizer step the training loop has built what the keys need: refuse a key the
    script gave no hold to (SystemExit(2): the watched script ends there, its records kept)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if state.checked:
            return
        state.checked = True
        handle.remove()
        line = state.refusal("known at its first optimizer step")
        if line:
            state.refused = line
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(REFUSED_EXIT)

    handle = register_optimizer_step_post_hook(first_step)
    state.undo.append(handle.remove)
