"""Warnings raised inside a function watch wraps keep the script's line as their origin.

`warnings.warn(msg, stacklevel=2)` in a constructor names the constructor's caller: with watch's wrapper in
between, that was watch's own file (`observe.py:381: UserWarning ...`), and the script's `-W` filters by
module no longer matched. `call_as_caller` records what the wrapped call warns (through the filters in
force, so an "error" filter still raises inside the call) and re-emits each warning after it (also when
it raised), with the frames of watch replaced by the first frame outside watch and the registry of the
module it is then attributed to, where the script's module filters apply. Only constructors are wrapped
this way (DataLoader, Optimizer, LRScheduler, GradScaler, autocast, DDP, init_process_group), not per-step
hooks: `catch_warnings` swaps the process's warning state, so it must not run on a hot path (nor from two
threads at once; constructors run on one).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

_OURS = (f"{Path(__file__).resolve().parents[1]}{os.sep}",)  # probes/ (installed as ciuic_doctor.probes)
_REGISTRIES: dict[str, dict[Any, Any]] = {}  # per file, for warnings attributed to a file not a module


def call_as_caller(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """original(*args, **kwargs), its warnings re-emitted as if watch's frames were not there."""
    caught: list[warnings.WarningMessage] = []
    try:
        # The filters stay as they are ("always" made torch's lazy import of torch._dynamo inside
        # Optimizer.__init__ record thousands of DeprecationWarnings: minutes); what they let through
        # is re-emitted below, where the script's own module filters apply.
        with warnings.catch_warnings(record=True) as caught:
            result = original(*args, **kwargs)
    except BaseException:
        with contextlib.suppress(Warning):  # the call's own exception wins over a warning made an error
            reemit(caught)
        raise
    reemit(caught)
    return result


def reemit(caught: list[warnings.WarningMessage]) -> None:
    """Each recorded warning again, attributed past watch's frames, through the filters now in force."""
    caller: Any = None
    for message in caught:
        filename, lineno, globals_ = message.filename, message.lineno, None
        if filename.startswith(_OURS):
            if caller is None:
                caller = _first_frame_outside()
            if caller is not None:
                filename, lineno, globals_ = caller.f_code.co_filename, caller.f_lineno, caller.f_globals
        registry = (
            globals_.setdefault("__warningregistry__", {})
            if globals_ is not None
            else _REGISTRIES.setdefault(filename, {})
        )
        warnings.warn_explicit(
            message.message, message.category, filename, lineno, registry=registry, module_globals=globals_
        )


def _first_frame_outside() -> Any:
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_OURS) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    return frame
