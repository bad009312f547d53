"""How a watched process ended, written to meta.json whichever way it ends.

Returning, raising, `sys.exit` and Ctrl-C reach the `finally` of `ciuic-doctor watch`'s run. Two ways skip
every `finally` and atexit handler, and are covered here:

- `os._exit(code)` (scripts that end that way to dodge slow teardown; multiprocessing children): patched
  to call `on_end("exited", code)` first; `os.exec*()` (the process becomes another program): patched
  to call `on_end("exec", 0)` first.
- SIGTERM (torchrun stopping the other ranks when one fails, `kill`, a scheduler's preemption). A Python
  signal handler alone would run only when the main thread comes back to the interpreter, so a rank
  blocked in a collective would no longer die of SIGTERM at all. Instead the C-level handler's wakeup fd
  (`signal.set_wakeup_fd`) wakes a helper thread at once; it records the end and exits with 128 + 15,
  as a shell reports a SIGTERM death. Installed only when SIGTERM still has its default action and no
  wakeup fd is taken (asyncio takes one): a script's own handler is never replaced. A forked child gets
  the default action back (it has no helper thread).

The wakeup fd is one per process, so other parts of watch that must react to a signal while the main thread
is blocked (the hang watchdog: SIGUSR1 asks for a dump, SIGTERM dumps before dying) listen through
`on_signal` on this helper thread instead of taking the fd themselves.

    >>> import signal
    >>> exit_code_for(signal.SIGTERM)
    143
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

from ciuic_doctor.rundir.safe_io import fd_identity

_LISTENERS: dict[int, list[Callable[[], None]]] = {}  # signal number -> run on the helper thread
_HELPER: dict[str, bool] = {"listening": False}


def on_signal(signum: int, listener: Callable[[], None]) -> Callable[[], None] | None:
    """Run `listener()` on the helper thread when `signum` arrives (for SIGTERM: before the process ends);
    returns the undo, or None when no helper thread listens (the caller then handles the signal itself).
    The caller sets a Python handler for `signum` (a no-op will do): the C-level handler writes the wakeup
    fd only for signals that have one."""
    if not _HELPER["listening"]:
        return None
    _LISTENERS.setdefault(signum, []).append(listener)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _LISTENERS.get(signum, []).remove(listener)

    return remove


def exit_code_for(signum: int) -> int:
    return 128 + signum


def install(on_end: Callable[[str, int], None]) -> Callable[[], None]:
    """Call on_end(status, exit code) before os._exit or a SIGTERM ends the process; returns the undo."""
    undo: list[Callable[[], None]] = []
    original_exit = os._exit
    ended = threading.Event()
    pid = os.getpid()

    def end_once(status: str, code: int) -> None:
        if not ended.is_set() and os.getpid() == pid:  # a forked child's os._exit is not our end
            ended.set()
            with contextlib.suppress(Exception):  # the process is ending either way
                on_end(status, code)

    def _exit(code: int) -> None:
        end_once("exited", code)
        original_exit(code)

    os._exit = _exit
    undo.append(lambda: setattr(os, "_exit", original_exit))
    for name in ("execv", "execve"):  # every os.exec*() ends in one of these two
        original = getattr(os, name)

        def replace(*args: object, _original: Callable[..., None] = original) -> None:
            end_once("exec", 0)  # the process becomes another program: no finally, no atexit runs
            try:
                _original(*args)
            except BaseException:
                ended.clear()  # it did not happen: the end is still to be recorded
                raise

        setattr(os, name, replace)
        undo.append(lambda name=name, original=original: setattr(os, name, original))
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        undo.append(_watch_sigterm(end_once, original_exit))

    def remove() -> None:
        for step in reversed(undo):
            step()

    return remove


def _close_if(fd: int, identity: tuple[int, int] | None) -> None:
    """Close `fd` only if it is still open on `identity` (a script that ran os.closerange may have
    reused the number for a file of its own)."""
    if identity is not None and fd_identity(fd) == identity:
        with contextlib.suppress(OSError):
            os.close(fd)


def _watch_sigterm(
    end_once: Callable[[str, int], None], exit_now: Callable[[int], None]
) -> Callable[[], None]:
    """The helper thread woken by SIGTERM through the wakeup fd; returns the undo."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd)
    if previous_fd != -1:  # someone else's: leave SIGTERM alone
        signal.set_wakeup_fd(previous_fd)
        os.close(read_fd)
        os.close(write_fd)
        return lambda: None
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the helper thread acts on it
    stop = threading.Event()
    pipe = fd_identity(read_fd)  # both ends share the pipe's inode

    def wait_for_sigterm() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data or stop.is_set():
                # EOF without `stop`: the script closed every inherited fd (os.closerange), ours too, and
                # the number may be its own file now: close only what is still our pipe
                _close_if(read_fd, pipe)
                return
            for signum in data:
                for listener in list(_LISTENERS.get(signum, ())):
                    with contextlib.suppress(Exception):  # a listener's failure must not stop this thread
                        listener()
            if signal.SIGTERM in data:
                end_once("killed", exit_code_for(signal.SIGTERM))
                exit_now(exit_code_for(signal.SIGTERM))

    thread = threading.Thread(target=wait_for_sigterm, name="ciuic-watch-sigterm", daemon=True)
    thread.start()
    _HELPER["listening"] = True

    def reset_in_child() -> None:  # a fork has no helper thread: SIGTERM must kill it as before
        _HELPER["listening"] = False
        _LISTENERS.clear()
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)

    os.register_at_fork(after_in_child=reset_in_child)

    def remove() -> None:
        stop.set()
        _HELPER["listening"] = False
        with contextlib.suppress(ValueError):
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
        if fd_identity(write_fd) == pipe:  # else the script closed it and the number is another file now
            with contextlib.suppress(OSError):
                os.write(write_fd, b"\0")  # wakes the helper, which sees `stop` and ends
        _close_if(write_fd, pipe)

    return remove
