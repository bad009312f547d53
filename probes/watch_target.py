"""What `watch` runs: a script path or `-m module`, checked the way `python` would find it (no torch here,
so the CLI can refuse a bad target before anything is recorded)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from ciuic_doctor.errors import UserError


@contextlib.contextmanager
def module_search_path() -> Iterator[None]:
    """sys.path[0] = the current directory while it lasts, as `python -m` sets it. The console script's
    own sys.path[0] is its bin directory, where no user module lives."""
    saved = sys.path[0] if sys.path else None
    if sys.path:
        sys.path[0] = os.getcwd()
    else:
        sys.path.append(os.getcwd())
    try:
        yield
    finally:
        if saved is not None:
            sys.path[0] = saved


def check_target(argv: list[str]) -> None:
    """Refuse a missing script or module with one line (UserError), before anything runs."""
    if not argv:
        raise UserError("no script given: ciuic-doctor watch [options] -- script.py [args]")
    if argv[0] != "-m":
        if not Path(argv[0]).is_file():
            raise UserError(f"{argv[0]}: no such script")
        return
    if len(argv) < 2:
        raise UserError("-m needs a module name")
    with module_search_path():
        try:
            found = importlib.util.find_spec(argv[1])
        except (ImportError, ValueError):
            found = None
    if found is None:
        raise UserError(f"-m {argv[1]}: no such module")
