"""The processes a watched script starts: ranks it launches itself record their own streams; forks none.

- `torch.multiprocessing.spawn` (the DDP tutorial's multigpu.py) and any `multiprocessing.Process` whose
  target is the script's own function: the target is wrapped (session.WatchedTarget, picklable, so it crosses
  into a spawned interpreter) and attaches a session in the child before the user's function runs. The
  child's rank is the process group's once `init_process_group` ran (mp.spawn scripts pass it there),
  else $RANK, else the spawn index.
- A script that re-runs its own argv (Lightning `devices=2` without torchrun starts
  `[sys.executable, script.py, *argv]` for every other local rank): `subprocess.Popen` of this Python
  on the same script (or `-m` module) becomes `python -m ciuic_doctor watch --child ... -- <same argv>`.
- `os.fork()` (and multiprocessing's fork start of a DataLoader worker): the child inherits the parent's
  hooks and its open stream. It forgets both at once (os.register_at_fork), so a child's optimizer steps
  never land in the parent's stream as duplicate steps.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_STATE: dict[str, Any] = {"spawn_index": None, "target": None, "children": 0, "hang": None, "step_aside": []}
_USER_MODULES = ("__main__", "__mp_main__")
_TORCH_SPAWN_WRAP = ("torch.multiprocessing.spawn", "_wrap")  # mp.spawn's per-process entry point


def set_target(argv: list[str]) -> None:
    """The command line `watch` runs (`script.py ...` or `-m module ...`): a re-run of it is a rank."""
    _STATE["target"] = list(argv)


def set_hang(settings: dict[str, Any] | None) -> None:
    """The hang watchdog's settings (HangConfig's fields): a rank the script starts arms its own with them."""
    _STATE["hang"] = dict(settings) if settings is not None else None


def on_first_rank_started(callback: Callable[[], None]) -> None:
    """Call `callback()` (once) when this process starts its first rank through multiprocessing: from then
    on it launches and waits, and the ranks are its children (the watchdog steps aside for theirs)."""
    _STATE["step_aside"].append(callback)


def hang_settings() -> dict[str, Any] | None:
    return _STATE["hang"]


def watched_argv() -> list[str] | None:
    """The command line watch runs (`script.py args` or `-m module args`), None when not set."""
    return list(_STATE["target"]) if _STATE["target"] is not None else None


def children_started() -> int:
    """Child processes of this one that were started with watch attached."""
    return _STATE["children"]


def resolve_rank() -> int:
    """This process's rank: the process group's, else $RANK, else its mp.spawn index, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if os.environ.get("RANK", "").isdigit():
        return int(os.environ["RANK"])
    return _STATE["spawn_index"] or 0


def spawn_started(index: int | None) -> None:
    """In a child the script started with a watched target: remember its spawn index (for resolve_rank)."""
    _STATE["spawn_index"] = index


def forget_children() -> None:
    """In a forked child: none of the parent's children are this process's."""
    _STATE["children"] = 0


def install(session: Any) -> Callable[[], None]:
    """Follow the script's own ranks into their processes; returns the undo."""
    import multiprocessing.process
    import subprocess

    undo: list[Callable[[], None]] = []

    def patch(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, functools.wraps(original)(make(original)))
        undo.append(lambda: setattr(owner, name, original))

    def make_start(original: Callable) -> Callable:
        def start(process: Any) -> None:
            target = getattr(process, "_target", None)
            if not session._closed and _is_user_target(target):
                index = _spawn_index(target, getattr(process, "_args", ()))
                process._target = session.watched_target(target, index=index)
                _STATE["children"] += 1
                if _STATE["children"] == 1 and not session.steps_written:
                    for callback in _STATE["step_aside"]:
                        callback()  # the launcher's watchdog: the ranks arm their own
            return original(process)

        return start

    def make_popen_init(original: Callable) -> Callable:
        def __init__(popen: Any, args: Any, *rest: Any, **kwargs: Any) -> None:  # noqa: N807
            if not session._closed:
                rewritten = _rerun_under_watch(args, session)
                if rewritten is not None:
                    args = rewritten
                    _STATE["children"] += 1
            original(popen, args, *rest, **kwargs)

        return __init__

    patch(multiprocessing.process.BaseProcess, "start", make_start)
    patch(subprocess.Popen, "__init__", make_popen_init)

    def remove() -> None:
        for step in reversed(undo):
            step()

    return remove


def _is_user_target(target: Any) -> bool:
    """The script's own function or mp.spawn's entry point; not DataLoader workers or pool internals."""
    if target is None or getattr(target, "watched", False):  # a session.WatchedTarget already
        return False
    module, name = getattr(target, "__module__", None), getattr(target, "__name__", None)
    return module in _USER_MODULES or (module, name) == _TORCH_SPAWN_WRAP


def _spawn_index(target: Any, args: tuple) -> int | None:
    """mp.spawn calls _wrap(fn, i, args, error_queue): i is the process index (its local rank)."""
    name = (getattr(target, "__module__", None), getattr(target, "__name__", None))
    if name == _TORCH_SPAWN_WRAP and len(args) > 1 and isinstance(args[1], int):
        return args[1]
    return None


def _rerun_under_watch(args: Any, session: Any) -> list[str] | None:
    """`[python, <the watched script or -m module>, ...]` as the same under `watch --child`, else None."""
    target = _STATE["target"]
    if target is None or not isinstance(args, (list, tuple)) or len(args) < 2:
        return None
    argv = [os.fspath(a) for a in args]
    if not _is_this_python(argv[0]):
        return None
    if target[0] == "-m":
        same = len(argv) > 2 and argv[1] == "-m" and argv[2] == target[1]
    else:
        same = argv[1] != "-m" and _same_file(argv[1], target[0])
    if not same:
        return None
    config = session.config
    options = [
        "--child", "--out", str(session.run.path), "--checksum-every", str(config.checksum_every),
        "--uss-every", str(config.uss_every), "--agree-timeout", f"{config.agree_timeout_s:g}",
    ]  # fmt: skip
    options += ["--no-grad-norm"] * (not config.grad_norm) + ["--no-checksum"] * (not config.checksum)
    options += ["--moe-every", str(config.moe_every)] + ["--no-moe"] * (not config.moe)
    return [sys.executable, "-m", "ciuic_doctor", "watch", *options, "--", *argv[1:]]


def _is_this_python(program: str) -> bool:
    found = shutil.which(program) or program
    try:
        return (
            os.path.samefile(found, sys.executable) or Path(found).resolve() == Path(sys.executable).resolve()
        )
    except OSError:
        return False


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
