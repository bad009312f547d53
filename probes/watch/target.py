"""What `watch` runs: a script path, a directory with `__main__.py`, or `-m module`, checked and run the way
`python` would (the check imports no torch, so the CLI refuses a bad target before anything is recorded).

    >>> describe_target(["-m", "pkg.train", "--lr", "3e-4"])
    '-m pkg.train'
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import runpy
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import UserError

_PYTHON_SUFFIXES = (".py", ".pyw", ".pyc", ".pyz", ".zip")


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


def describe_target(argv: list[str]) -> str:
    """The target without its arguments, for messages."""
    return f"-m {argv[1]}" if argv and argv[0] == "-m" and len(argv) > 1 else (argv[0] if argv else "")


_INTERPRETER = re.compile(r"^python(\d+(\.\d+)?)?$")


def strip_interpreter(argv: list[str]) -> list[str]:
    """`watch -- python script.py` as `watch -- script.py`: watch is the interpreter, so a leading
    python / python3 / python3.11 / this interpreter's path is dropped. Interpreter options after it
    (-u, -O, -X ...) cannot be applied to a script watch runs in its own process: refused with the form
    that works.

    >>> strip_interpreter(["python3", "train.py", "--lr", "1"]), strip_interpreter(["python", "-m", "pkg"])
    (['train.py', '--lr', '1'], ['-m', 'pkg'])
    """
    if not argv or not _is_interpreter(argv[0]):
        return argv
    rest = argv[1:]
    if rest and rest[0].startswith("-") and rest[0] != "-m":
        raise UserError(
            f"{argv[0]} {rest[0]}: watch runs the script in its own interpreter and cannot pass interpreter "
            f"options; use `ciuic-doctor watch -- script.py [args]` (for -u: PYTHONUNBUFFERED=1 "
            "ciuic-doctor watch -- script.py)"
        )
    return rest


def _is_interpreter(first: str) -> bool:
    """python, python3, python3.11 (a name on PATH), a path to one, or this interpreter's own path."""
    path = Path(first)
    if _INTERPRETER.match(path.name):
        return "/" not in first or path.is_file()
    with contextlib.suppress(OSError):
        return path.is_file() and os.path.samefile(path, sys.executable)
    return False


def check_target(argv: list[str]) -> None:
    """Refuse a missing or non-Python target with one line (UserError), before anything runs."""
    if not argv:
        raise UserError("no script given: ciuic-doctor watch [options] -- script.py [args]")
    if argv[0] != "-m":
        _check_path(Path(argv[0]))
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


def _check_path(path: Path) -> None:
    if path.is_dir():  # `python dir/` runs dir/__main__.py with dir on sys.path
        if not (path / "__main__.py").is_file():
            raise UserError(f"{path}: a directory without __main__.py (python could not run it either)")
        return
    if not path.is_file():
        raise UserError(f"{path}: no such script")
    if path.suffix in _PYTHON_SUFFIXES:
        return
    try:
        with open(path, "rb") as fh:
            head = fh.read(512)
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror})") from None
    # A compiled program (an ELF binary such as /bin/ls) has NUL bytes in its first 512; a shell script
    # names its interpreter on a #! line. Either runs in its own process, where no hook of ours can be.
    first_line = head.split(b"\n", 1)[0]
    if b"\0" in head or (first_line.startswith(b"#!") and b"python" not in first_line) or not _compiles(path):
        raise UserError(
            f"{path}: not a Python script; watch runs Python training scripts in its own interpreter "
            "(for another program, watch the Python script it starts)"
        )


def _compiles(path: Path) -> bool:
    """A file without a Python suffix or #! line (a shell script) is Python only when Python can compile
    it: `echo hi` in script.sh gave a SyntaxError traceback, not the one line the README promises."""
    try:
        with open(path, "rb") as fh:
            source = fh.read(16 * 2**20)
        compile(source, str(path), "exec")
    except (SyntaxError, ValueError, OSError):
        return False
    return True


# ---- running a user's script the way `python script.py` would ------------------------------------
def run_script(argv: list[str]) -> int:
    """Run `script.py args...`, `dir/ args...` or `-m module args...` in this process as __main__; its
    exit code.

    sys.argv is the script's own; sys.path[0] is the script's directory (a directory target: itself; for
    -m: the current directory), as `python` sets them. An exception is printed as Python prints it and
    gives exit code 1; Ctrl-C gives 130.
    """
    check_target(argv)
    from ciuic_doctor.launch import note_user_code

    note_user_code()  # this process now ends the way Python ends the script
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    try:
        if argv[0] == "-m":
            sys.path[0] = os.getcwd()
            sys.argv = [argv[1], *argv[2:]]
            runner: Callable[[], Any] = functools.partial(
                runpy.run_module, argv[1], run_name="__main__", alter_sys=True
            )
        else:
            target = Path(argv[0])
            sys.argv = list(argv)
            # run_path puts a directory (or zip) on sys.path itself; a script's folder is ours to add.
            sys.path[0] = str(target.resolve() if target.is_dir() else target.resolve().parent)
            runner = functools.partial(runpy.run_path, str(target), run_name="__main__")
        try:
            runner()
        except SystemExit as exc:
            return exit_code(exc.code)
        except KeyboardInterrupt as exc:
            # one line, not Python's traceback (README: Ctrl-C is 130 and keeps every record); where the
            # script was is still said: its innermost frame
            frames = traceback.extract_tb(exc.__traceback__)
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            print(f"ciuic-doctor watch: interrupted (Ctrl-C){where}; every record is kept", file=sys.stderr)
            return 130
        except BaseException:
            traceback.print_exc()
            return 1
        return 0
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0


def exit_code(code: Any) -> int:
    """SystemExit semantics: None is 0, an int is itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
