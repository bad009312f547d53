"""Reading and writing files of a run directory as data from someone else, never as instructions.

A run directory is what users copy between machines and share on NFS, and `hang --pid` reads files a
job's user controls: every name in it may be a symlink to a file outside, a FIFO (an open or a read
never returns), a device (`/dev/zero` never ends) or a huge sparse file. So every command opens them
through here:

- **writes** never follow a symlink: a whole file is written to a temp file created with
  `O_CREAT | O_EXCL | O_NOFOLLOW` beside it and renamed over the name (a planted symlink is replaced,
  never written through); an appended stream or a kept-open file is opened with `O_NOFOLLOW` and used
  only when it is a regular file with one link (a hard link to a file outside would be written through);
  a folder on the way (`hang.fr/`) is opened with `O_NOFOLLOW | O_DIRECTORY`;
- **reads** take only a regular file reached without a symlink below the run directory itself, opened
  `O_NONBLOCK` (a FIFO cannot block the open), and at most the cap of its kind:

      MAX_JSON_BYTES    64 MiB   meta.json, findings.json, a hang dump, hang.pyspy.json
      MAX_TEXT_BYTES    16 MiB   faulthandler's stacks (hang.rank<R>.fatal.txt)
      MAX_PICKLE_BYTES 256 MiB   a Flight Recorder dump (2,000 entries with stacks: ~2 MiB measured)
      MAX_STREAM_BYTES  64 GiB   one JSONL stream file (a 1,024-rank steps file of 1 M steps: ~0.5 GiB)
      MAX_LINE_BYTES    16 MiB   one JSONL record (watch's largest, a step with observed settings: ~8 KiB)

  A file refused is an `Unsafe` error (an OSError) with one short reason, for the caller to count and
  skip: nothing here raises anything else on hostile content.
- **paths from inside a run** (a dump's `fr_file`) are confined: relative, no `..`, no symlink.

Standard library only (memwatch and `--help` import the store).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

MAX_JSON_BYTES = 64 * 2**20
MAX_TEXT_BYTES = 16 * 2**20
MAX_PICKLE_BYTES = 256 * 2**20
MAX_STREAM_BYTES = 64 * 2**30
MAX_LINE_BYTES = 16 * 2**20

_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Unsafe(OSError):
    """A file of a run that is not read or written: a symlink, a FIFO, a device, a folder, too large."""

    def __init__(self, path: Path | str, why: str) -> None:
        super().__init__(errno.EPERM, why, str(path))
        self.why = why

    def __str__(self) -> str:
        return f"{Path(self.filename).name}: {self.why}"


def _why(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symlink (not followed)"
    if exc.errno in (errno.ENXIO, errno.EAGAIN):
        return "not a regular file (a FIFO or socket)"
    return exc.strerror or str(exc)


def kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def is_regular(path: Path) -> bool:
    """True for a regular file that is not a symlink (lstat: the link itself is judged)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def irregular_reason(path: Path) -> str | None:
    """Why `path` is not read (a symlink, a FIFO, a device, a folder), or None for a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        return exc.strerror or "unreadable"
    return None if stat.S_ISREG(mode) else kind_of(mode)


# ---- reading -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _dir_fd(root: Path, parts: tuple[str, ...]) -> Iterator[int]:
    """A descriptor of root/parts..., each part opened without following a symlink."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                child = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Unsafe(root.joinpath(*parts), f"{part}/ is a symlink or not a folder") from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def folder(root: Path, parts: tuple[str, ...]) -> contextlib.AbstractContextManager[int]:
    """A descriptor of root/parts... for `open_regular(name, dir_fd=...)` of many files in it: no part
    below `root` is followed if it is a symlink (`Unsafe`), and the walk is made once, not a file."""
    return _dir_fd(Path(root), parts)


def open_regular(path: Path, *, max_bytes: int, root: Path | None = None, dir_fd: int | None = None) -> int:
    """A read-only descriptor of a regular file of at most `max_bytes`; `Unsafe` (an OSError) otherwise.

    With `root`, `path` must lie below it and no folder between them may be a symlink; with `dir_fd`
    (a folder opened by `folder`), `path` is a name in that folder. The last part is never followed.
    """
    path = Path(path)
    if dir_fd is not None:
        if len(path.parts) != 1:
            raise Unsafe(path, "not a name in its folder")
        try:
            fd = os.open(path.name, _READ, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise
            raise Unsafe(path, _why(exc)) from None
    elif root is not None:
        try:
            rel = path.relative_to(root)
        except ValueError:
            raise Unsafe(path, "outside the run directory") from None
        parts = rel.parts
        with _dir_fd(Path(root), parts[:-1]) as dfd:
            try:
                fd = os.open(parts[-1], _READ, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    raise
                raise Unsafe(path, _why(exc)) from None
    else:
        try:
            fd = os.open(path, _READ)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise
            raise Unsafe(path, _why(exc)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise Unsafe(path, f"{kind_of(info.st_mode)}, not a regular file")
    if info.st_size > max_bytes:
        os.close(fd)
        raise Unsafe(path, f"{info.st_size} bytes, above the {max_bytes} a file of its kind may have")
    os.set_blocking(fd, True)
    return fd


def read_bytes(path: Path, *, max_bytes: int, root: Path | None = None) -> bytes:
    """The whole file, at most `max_bytes` (a file that grows while read is cut there)."""
    fd = open_regular(path, max_bytes=max_bytes, root=root)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise Unsafe(path, f"grew above the {max_bytes} bytes a file of its kind may have")
    return data


def read_text(path: Path, *, max_bytes: int, root: Path | None = None) -> str:
    """The file as text; bytes that are not UTF-8 become U+FFFD (a dump is data, not a decoding test)."""
    return read_bytes(path, max_bytes=max_bytes, root=root).decode("utf-8", errors="replace")


def read_json(path: Path, *, max_bytes: int, root: Path | None = None) -> Any:
    """A small JSON file another process wrote, or None: not a regular file, a symlink, over `max_bytes`,
    unreadable or not JSON (a file being written is tried again at the next look)."""
    import json

    try:
        return json.loads(read_bytes(path, max_bytes=max_bytes, root=root))
    except (OSError, ValueError, RecursionError):
        return None


def lines(fh, *, max_line: int = MAX_LINE_BYTES) -> Iterator[bytes | None]:
    """The lines of a binary file; a line longer than `max_line` is yielded as None (count it, skip it)
    and never held whole in memory."""
    while True:
        line = fh.readline(max_line + 1)
        if not line:
            return
        if len(line) > max_line and not line.endswith(b"\n"):
            while (rest := fh.readline(max_line)) and not rest.endswith(b"\n"):
                pass
            yield None
            continue
        yield line


def confined(root: Path, name: object) -> Path | None:
    """`root/name` for a path a file inside the run gave (a dump's `fr_file`), or None when it would
    leave the run: not a string, absolute, with `..`, empty parts, NUL, or too long. Symlinks on the
    way are refused when the file is opened (`open_regular(..., root=root)`)."""
    if not isinstance(name, str) or not name or len(name) > 4096 or "\x00" in name or "\\" in name:
        return None
    pure = PurePosixPath(name)
    if pure.is_absolute() or any(part in ("..", ".", "") for part in name.split("/")):
        return None
    return Path(root, *pure.parts)


# ---- writing -----------------------------------------------------------------------------------
def _check_writable(fd: int, path: Path) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise Unsafe(path, f"exists and is {kind_of(info.st_mode)}, not a regular file")
    if info.st_nlink > 1:
        os.close(fd)
        raise Unsafe(path, "has other hard links (it would be written through to a file elsewhere)")


def open_append(path: Path, *, mode: int = 0o644) -> int:
    """An O_APPEND descriptor of a stream file, created if missing; never through a symlink, a FIFO
    (O_NONBLOCK: the open fails instead of waiting for a reader) or a hard link."""
    return _open_writable(path, os.O_WRONLY | os.O_APPEND, mode)


def open_truncated(path: Path, *, mode: int = 0o644) -> int:
    """A descriptor of `path` emptied for writing (a file kept open, like faulthandler's), created if
    missing; a symlink, FIFO, device or hard-linked file there is refused before anything is cut."""
    fd = _open_writable(path, os.O_RDWR, mode)
    os.ftruncate(fd, 0)
    return fd


def _open_writable(path: Path, access: int, mode: int) -> int:
    """`path` opened (created if missing) for `access`, never through a symlink; non-blocking while it is
    checked to be a regular file with one link, so a FIFO cannot make the open wait for a reader."""
    flags = access | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        raise Unsafe(path, _why(exc)) from None
    _check_writable(fd, path)
    os.set_blocking(fd, True)
    return fd


def make_dir(root: Path, name: str) -> None:
    """root/name as a folder (created if missing); `Unsafe` when a symlink or a file holds the name."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(Path(root) / name, 0o755)
    with _dir_fd(Path(root), (name,)):
        pass


def write_atomic(path: Path, data: bytes, *, root: Path | None = None, mode: int = 0o644) -> Path:
    """Replace `path` with `data` as a whole: a temp file beside it (O_EXCL | O_NOFOLLOW, a random
    name) renamed over it. A symlink at `path` is replaced, never followed; with `root`, no folder
    between it and `path` may be a symlink. The temp file never outlives a failure."""
    path = Path(path)
    base = Path(root) if root is not None else path.parent
    try:
        parts = path.relative_to(base).parts
    except ValueError:
        raise Unsafe(path, "outside the run directory") from None
    name = parts[-1]
    with _dir_fd(base, parts[:-1]) as dfd:
        try:
            mode_now = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
        except OSError:
            mode_now = 0
        if stat.S_ISDIR(mode_now):  # rename cannot replace a directory
            raise Unsafe(path, "exists and is a directory; move it away and run again")
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, mode, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    return path


@contextlib.contextmanager
def atomic_file(path: Path, *, mode: int = 0o644) -> Iterator[tuple[BinaryIO, Path]]:
    """(file, temp path) for a writer that streams (pyarrow): the temp file is created beside `path`
    with O_EXCL | O_NOFOLLOW and a random name, renamed over `path` when the block ends and removed
    when it raises (no `.tmp` left behind, even on Ctrl-C)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh, tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def fd_identity(fd: int) -> tuple[int, int] | None:
    """(device, inode) of what `fd` is open on now, None when it is closed: a watched script that runs
    os.closerange(3, ...) closes watch's descriptors too, and its next open reuses their numbers, so a
    descriptor is written or closed only while it is still open on the file watch opened (an fstat, ~1 us)."""
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino
