"""Flight Recorder dumps read as data: a pickle unpickled without ever running code.

torch writes a rank's Flight Recorder trace as a pickle (`_dump_fr_trace`; ProcessGroupNCCL's dump on
a timeout to `TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`), and its own reader, `torchfrtrace`'s
`read_dump`, is `pickle.load`: a planted `RUN/hang.fr/rank0` (or a job's user's `/tmp/nccl_trace_rank_0`
read by root in `hang --pid`) would run whatever it names. The format holds only builtin containers and
scalars (a torch 2.13 gloo dump uses dicts, lists, tuples, str, int, bool and None: checked opcode by
opcode in tests), so the unpickler here refuses every global: no class, no function, no persistent id,
so no REDUCE / BUILD / NEWOBJ can call anything. Then the entries are cut to the fields the hang doctor
reads, each of its type, with every number and count bounded:

    MAX_ENTRIES 100,000 per dump (torch keeps TORCH_FR_BUFFER_SIZE, 2,000 by default)
    MAX_FRAMES  512 per entry; MAX_SIZES 4,096 tensors per entry, 16 dimensions each

>>> import pickle
>>> loads_data(pickle.dumps({"entries": [], "pg_status": {"0": {"last_completed_collective": 3}}}))
{'entries': [], 'pg_status': {'0': {'last_completed_collective': 3}}}
>>> loads_data(pickle.dumps(print))
Traceback (most recent call last):
...
_pickle.UnpicklingError: refused builtins.print: a Flight Recorder dump holds data only
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from ciuic_doctor.rundir.safe_io import MAX_PICKLE_BYTES, read_bytes

MAX_ENTRIES = 100_000
MAX_FRAMES = 512
MAX_SIZES = 4096
MAX_DIMS = 16
MAX_STR = 4096
INT_BOUND = 2**63


class _DataOnly(pickle.Unpickler):
    """pickle with every global refused: what is left builds only builtin data, never calls."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a Flight Recorder dump holds data only")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id: a Flight Recorder dump holds data only")


def loads_data(raw: bytes) -> Any:
    """`raw` unpickled with no global allowed; pickle.UnpicklingError (or another Exception) when it is
    not plain data."""
    return _DataOnly(io.BytesIO(raw)).load()


def read(path: Path, *, root: Path | None = None) -> dict[str, Any]:
    """A dump as {"entries": [...], "pg_status": {...}}, cleaned; ValueError with one short reason when
    it is not one (OSError when the file cannot be read: safe_io.Unsafe for a symlink, FIFO, too big)."""
    return parse(read_bytes(path, max_bytes=MAX_PICKLE_BYTES, root=root))


def parse(raw: bytes) -> dict[str, Any]:
    """A dump's bytes as {"entries": [...], "pg_status": {...}}, cleaned; ValueError when not one."""
    try:
        data = loads_data(raw)
    except Exception as exc:  # a torn or foreign pickle: pickle raises many kinds; all say "not a dump"
        raise ValueError(f"not a Flight Recorder dump ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"not a Flight Recorder dump (a pickled {type(data).__name__})")
    entries = data.get("entries", [])
    if not isinstance(entries, list):
        raise ValueError("not a Flight Recorder dump (entries is not a list)")
    return {"entries": clean_entries(entries), "pg_status": clean_status(data.get("pg_status"))}


def _int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and -INT_BOUND < value < INT_BOUND:
        return value
    return None


def _str(value: Any) -> str | None:
    return value[:MAX_STR] if isinstance(value, str) else None


def clean_status(status: Any) -> dict[str, dict[str, int]]:
    """{pg: {counter: int}}: Flight Recorder's per-group counters, anything else dropped."""
    if not isinstance(status, dict):
        return {}
    out: dict[str, dict[str, int]] = {}
    for pg, counters in list(status.items())[:MAX_ENTRIES]:
        if isinstance(pg, str | int) and not isinstance(pg, bool) and isinstance(counters, dict):
            out[str(pg)[:MAX_STR]] = {
                k[:MAX_STR]: n
                for k, v in counters.items()
                if isinstance(k, str) and (n := _int(v)) is not None
            }
    return out


def _frames(frames: Any) -> list[dict[str, Any]]:
    if not isinstance(frames, list | tuple):
        return []
    out = []
    for f in frames[:MAX_FRAMES]:
        if isinstance(f, dict):
            out.append({"name": _str(f.get("name")), "filename": _str(f.get("filename")),
                        "line": _int(f.get("line"))})  # fmt: skip
    return out


def _sizes(sizes: Any) -> list[list[int]] | None:
    if not isinstance(sizes, list | tuple):
        return None
    out = []
    for dims in sizes[:MAX_SIZES]:
        if not isinstance(dims, list | tuple) or len(dims) > MAX_DIMS:
            return None
        ints = [_int(d) for d in dims]
        if any(d is None for d in ints):
            return None
        out.append(ints)
    return out


def _strings(values: Any) -> list[str] | None:
    if not isinstance(values, list | tuple):
        return None
    return [s for v in values[:MAX_SIZES] if (s := _str(v)) is not None]


def clean_entries(entries: list[Any]) -> list[dict[str, Any]]:
    """The entries with the fields the hang doctor reads, each of its type; an entry without an int
    `collective_seq_id` is dropped (nothing can place it)."""
    out = []
    for e in entries[:MAX_ENTRIES]:
        if not isinstance(e, dict) or _int(e.get("collective_seq_id")) is None:
            continue
        group = e.get("process_group")
        out.append(
            {
                "collective_seq_id": e["collective_seq_id"],
                "pg_id": _int(e.get("pg_id")) if not isinstance(e.get("pg_id"), str) else _str(e["pg_id"]),
                "is_p2p": e.get("is_p2p") is True,
                "profiling_name": _str(e.get("profiling_name")) or "",
                "process_group": [_str(g) or "?" for g in group[:2]]
                if isinstance(group, list | tuple)
                else None,
                "input_sizes": _sizes(e.get("input_sizes")),
                "input_dtypes": _strings(e.get("input_dtypes")),
                "output_sizes": _sizes(e.get("output_sizes")),
                "state": _str(e.get("state")),
                "retired": e.get("retired") is True,
                "timeout_ms": _int(e.get("timeout_ms")),
                "frames": _frames(e.get("frames")),
            }
        )
    return out
