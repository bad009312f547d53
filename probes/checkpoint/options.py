"""checkpoint-check's options that name code or state: `--save` / `--load` callables and `--drop`.

No torch here: a mistake in an option is one line (UserError, exit 2) before any rank, model or torch
import starts.

    --save module:callable    save(state: dict, path: str) -> None
    --load module:callable    load(path: str) -> dict
    (or path/to/file.py:callable; a module is imported from the current directory and sys.path)

>>> [v.name for v in parse_drops(["optimizer", "rng,sampler"])]
['without optimizer', 'without rng+sampler']
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import UserError

# What `--drop NAME` removes from the saved checkpoint (a demonstration and test aid).
DROPPABLE: dict[str, tuple[str, ...]] = {
    "optimizer": ("optimizer",),
    "scheduler": ("scheduler",),
    "scaler": ("scaler",),
    "rng": ("rng",),
    "sampler": ("sampler", "micro_batches"),  # the data position: Trainer derives it from micro_batches
}


@dataclass(kw_only=True)
class Variant:
    """One restart: `drop` empty is the checkpoint as saved."""

    drop: tuple[str, ...] = ()
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = "as saved" if not self.drop else "without " + "+".join(self.drop)

    def file_name(self) -> str:
        """Where a --drop copy goes (the checkpoint as saved is resumed from its own file)."""
        return "variant-no-" + "-".join(self.drop) + ".pt"


def parse_drops(items: list[str]) -> list[Variant]:
    """One variant per --drop option; a comma list drops those components together."""
    variants: list[Variant] = []
    for item in items:
        names = [n.strip().lower() for n in item.split(",") if n.strip()]
        unknown = [n for n in names if n not in DROPPABLE]
        if unknown or not names:
            raise UserError(
                f"--drop {item!r}: unknown {', '.join(unknown) or 'empty list'}; "
                f"choose from {','.join(DROPPABLE)}"
            )
        variants.append(Variant(drop=tuple(dict.fromkeys(names))))
    return variants


def resolve_callable(text: str, option: str, arity: int) -> Callable[..., Any]:
    """`module:callable` or `file.py:callable` -> the function; every mistake is one UserError line."""
    form = "save(state, path)" if arity == 2 else "load(path)"
    target, sep, name = text.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise UserError(f"{option} {text!r}: expected module:callable or path/to/file.py:callable")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise UserError(f"{option} {text}: no such file {path}")
            spec = importlib.util.spec_from_file_location(f"ciuic_user_{path.stem}", path)
            if spec is None or spec.loader is None:
                raise UserError(f"{option} {text}: cannot import {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            # As `python -m` does: the console script's sys.path lacks the directory you run it from.
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
    except UserError:
        raise
    except ImportError as exc:
        raise UserError(f"{option} {text}: cannot import {target!r} ({exc})") from None
    except Exception as exc:  # the user's module raised while importing: their bug, one line
        raise UserError(f"{option} {text}: importing {target} raised {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{option} {text}: {target} has no callable {name!r}")
    try:
        inspect.signature(fn).bind(*range(arity))
    except TypeError:
        raise UserError(f"{option} {text}: {name} must accept {form}") from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn
