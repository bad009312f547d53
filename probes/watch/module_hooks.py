"""Forward hooks watch puts on the user's modules, left out of every copy the user makes of them.

A hook registered on a module lives in the module's own `_forward_pre_hooks` / `_forward_hooks`, so
`torch.save(model)`, `pickle.dumps(model)` and `copy.deepcopy(model)` carry it: a bound method or a
closure of watch's drags the whole session along ("cannot pickle code objects"), and a deep copy (an EMA
or teacher model) would report its forwards into the watched run. pytorch/examples' word_language_model
saves its model with `torch.save(model, f)` and failed at its first checkpoint under watch.

So each module watch hooks gets an instance `__getstate__` (looked up before the class's, by pickle and
copy alike) that returns the class's own state without watch's hook ids and without itself: a pickle
holds nothing of ciuic_doctor (it loads where ciuic_doctor is not installed) and a copy is the module as
it was unwatched. The ids are held here, in a WeakKeyDictionary keyed by module, never on the module.
`remove()` of the handle takes the hook and, with the last one, the `__getstate__` away again.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

_STATE = "__getstate__"
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_OURS: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()


class Handle:
    """Like torch's RemovableHandle; removing the last of a module's hooks restores its pickling."""

    def __init__(self, module: Any, handle: Any) -> None:
        self._module = weakref.ref(module)
        self._handle = handle

    def remove(self) -> None:
        self._handle.remove()
        module = self._module()
        if module is None:
            return
        ids = _OURS.get(module)
        if ids is not None:
            ids.discard(self._handle.id)
            if not ids:
                del _OURS[module]
                module.__dict__.pop(_STATE, None)


def forward_pre_hook(module: Any, hook: Callable[..., Any]) -> Handle:
    """`module.register_forward_pre_hook(hook)`, kept out of the module's pickles and copies."""
    return _ours(module, module.register_forward_pre_hook(hook))


def forward_hook(module: Any, hook: Callable[..., Any]) -> Handle:
    """`module.register_forward_hook(hook)`, kept out of the module's pickles and copies."""
    return _ours(module, module.register_forward_hook(hook))


def _ours(module: Any, handle: Any) -> Handle:
    _OURS.setdefault(module, set()).add(handle.id)
    if _STATE not in module.__dict__:
        # object.__setattr__: nn.Module's own would do the same for a plain value, without its checks.
        object.__setattr__(module, _STATE, functools.partial(_state_without_ours, weakref.ref(module)))
    return Handle(module, handle)


def _state_without_ours(ref: weakref.ref) -> Any:
    """The module's state as its class gives it, less watch's hooks and this function itself."""
    module = ref()
    state = type(module).__getstate__(module)
    if not isinstance(state, dict):  # a class with a state of its own shape: left as it is
        return state
    state = dict(state)
    state.pop(_STATE, None)
    ids = _OURS.get(module, set())
    for name in _HOOK_DICTS:
        hooks = state.get(name)
        if isinstance(hooks, dict) and ids & hooks.keys():
            state[name] = OrderedDict((k, v) for k, v in hooks.items() if k not in ids)
    return state
