"""Step numbers from the framework's own counter, so watch's step N is the framework's step N.

A resumed HF Trainer (`--resume_from_checkpoint`) counts steps 11..20; Lightning restores `global_step`
from its checkpoint. Both count *finished* optimizer steps and add one after the step returns
(transformers Trainer: `self.state.global_step += 1` after `optimizer.step()`; Lightning:
`optim_progress.optimizer.step.increment_completed()` after `LightningOptimizer.step`), so the record of
the step in progress is the counter + 1 (watch.WatchSession.set_step_source).

The Trainer classes are patched when their module is imported (a sys.meta_path finder that wraps the
module's loader), so a script that never imports them pays nothing, and none is imported here.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import weakref
from collections.abc import Callable
from typing import Any

# module defining `Trainer` -> how to read a trainer's count of finished optimizer steps
TRAINERS: dict[str, Callable[[Any], int | None]] = {
    "transformers.trainer": lambda trainer: trainer.state.global_step,
    "lightning.pytorch.trainer.trainer": lambda trainer: trainer.global_step,
    "pytorch_lightning.trainer.trainer": lambda trainer: trainer.global_step,
}


def install(session: Any) -> Callable[[], None]:
    """Patch every Trainer already imported and those imported later; returns the undo."""
    undo: list[Callable[[], None]] = []

    def patch(module: Any) -> None:
        trainer_cls = getattr(module, "Trainer", None)
        if trainer_cls is None or "__init__" not in vars(trainer_cls):
            return
        original = trainer_cls.__init__
        read = TRAINERS[module.__name__]

        def __init__(trainer: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            original(trainer, *args, **kwargs)
            ref = weakref.ref(trainer)
            session.set_step_source(lambda: _read(ref, read))

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        trainer_cls.__init__ = __init__
        undo.append(lambda: setattr(trainer_cls, "__init__", original))

    for name in TRAINERS:
        if name in sys.modules:
            patch(sys.modules[name])
    finder = _PatchOnImport({name: patch for name in TRAINERS if name not in sys.modules})
    sys.meta_path.insert(0, finder)

    def remove() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for step in reversed(undo):
            step()

    return remove


def _read(ref: weakref.ref, read: Callable[[Any], int | None]) -> int | None:
    trainer = ref()
    if trainer is None:
        return None
    try:
        value = read(trainer)
    except Exception:  # a trainer not yet set up for fit: our own numbering
        return None
    return value if isinstance(value, int) else None


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs patches[name](module) right after module `name` has executed."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            self.patches.pop(name, None)
            with contextlib.suppress(Exception):  # never break the user's import for our numbering
                patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
