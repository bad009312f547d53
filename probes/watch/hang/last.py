"""The last Python collective a rank issued, left on disk as it is issued (part of the hang watchdog).

A rank that gloo aborts (it was sent more bytes than it expected: a size mismatch or a skipped
collective) dies inside the collective, in a C++ thread, with no time to dump; faulthandler gives its
Python stack but not the tensor it passed. So each of torch.distributed's Python collectives is wrapped to
overwrite one fixed-size JSON line in RUN/hang.rank<R>.last.json (one pwrite into the page cache, which
outlives the process): op, input sizes and dtypes as Flight Recorder writes them, the call site, and the
sizes the same call site had the time before. Collectives issued from C++ (DDP's buckets) are not seen
here; Flight Recorder has those.

    >>> import torch
    >>> tensor_meta(torch.ones(2, 3))
    ('[[2, 3]]', '["Float"]')
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ciuic_doctor.rundir.safe_io import fd_identity

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
)  # fmt: skip
RECORD_BYTES = 1024
_FR_DTYPES = {  # c10's ScalarType names, which Flight Recorder's input_dtypes use
    "torch.float32": "Float", "torch.float64": "Double", "torch.float16": "Half",
    "torch.bfloat16": "BFloat16", "torch.int64": "Long", "torch.int32": "Int", "torch.int16": "Short",
    "torch.int8": "Char", "torch.uint8": "Byte", "torch.bool": "Bool",
}  # fmt: skip


_DTYPE_JSON: dict[Any, str] = {}  # torch.dtype -> its name as a JSON string, made once per dtype


def _dtype(t: Any) -> str:
    text = _DTYPE_JSON.get(t.dtype)
    if text is None:
        text = _DTYPE_JSON[t.dtype] = json.dumps(_FR_DTYPES.get(str(t.dtype), str(t.dtype)))
    return text


def tensor_meta(first: Any) -> tuple[str, str]:
    """(input_sizes, input_dtypes) as JSON text, for a tensor or a list of tensors (the first 8)."""
    if hasattr(first, "shape"):  # the common case, kept short: this runs on every collective
        return f"[{list(first.shape)}]", f"[{_dtype(first)}]"
    tensors = [t for t in (first or ())[:8] if hasattr(t, "shape")]
    sizes = "[" + ", ".join(str(list(t.shape)) for t in tensors) + "]"
    return sizes, "[" + ", ".join(_dtype(t) for t in tensors) + "]"


def install(path: Path) -> Callable[[], None]:
    """Wrap the collectives of torch.distributed (module attributes, so a script's later
    `dist.all_reduce` or `from torch.distributed import all_reduce` gets the wrapper); returns the undo."""
    import torch.distributed as dist

    from ciuic_doctor.rundir.safe_io import open_truncated

    fd = open_truncated(path)  # never through a symlink or hard link planted under its name
    ours = fd_identity(fd)  # a script that runs os.closerange may reuse the number for its own file
    count = [0]
    sites: dict[tuple[Any, int], str] = {}  # (code, line) -> the record's constant part, as JSON
    previous: dict[tuple[Any, int], str] = {}  # (code, line) -> its sizes last time

    def make(name: str, original: Callable) -> Callable:
        def collective(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            try:  # never the user's training
                caller = sys._getframe(1)
                key = (caller.f_code, caller.f_lineno)
                site = sites.get(key)
                if site is None:
                    site = sites[key] = (
                        f'"op": "{name}", "file": {json.dumps(caller.f_code.co_filename)}, '
                        f'"line": {caller.f_lineno}, "function": {json.dumps(caller.f_code.co_name)}'
                    )
                sizes, dtypes = tensor_meta(args[0] if args else kwargs.get("tensor"))
                line = (
                    f'{{"n": {count[0]}, {site}, "input_sizes": {sizes}, "input_dtypes": {dtypes}, '
                    f'"prev_sizes": {previous.get(key, "null")}}}'
                )
                previous[key] = sizes
                if (
                    len(line) < RECORD_BYTES and fd_identity(fd) == ours
                ):  # a huge list: keep the last that fit
                    os.pwrite(fd, line.ljust(RECORD_BYTES - 1).encode() + b"\n", 0)
            except Exception:
                pass
            return original(*args, **kwargs)

        return functools.wraps(original)(collective)

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, original in originals.items():
        setattr(dist, name, make(name, original))

    def undo() -> None:
        for name, original in originals.items():
            setattr(dist, name, original)
        if fd_identity(fd) == ours:
            os.close(fd)

    return undo
