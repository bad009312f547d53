"""NCCL and nccl-tests facts as pure functions: bus-bandwidth factors, the NCCL_ALGO syntax by version,
and the TUNING debug lines that say which algorithm and protocol NCCL really ran.

Everything here works on strings and numbers, so it is tested on recorded log text without a GPU
(sources: nccl-tests' PERFORMANCE.md and NCCL's env docs, summarised in reference/collectives.md).

>>> busbw_factor("all_reduce", 8)
1.75
>>> nccl_algo_env("tree", (2, 26, 2))
'allreduce:tree'
>>> nccl_algo_env("tree", (2, 21, 5))
'Tree'
>>> parse_tuning_line("h:1:2 [0] NCCL INFO AllReduce: 1048576 Bytes -> Algo RING proto SIMPLE "
...                   "channel{Lo..Hi}={0..15}").algo
'ring'
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

Version = tuple[int, int, int]

# The per-collective form `allreduce:tree` exists since NCCL 2.24.3 (the first public 2.24 release);
# from then on a filter that leaves a collective no algorithm is an error, so a global "Tree" would
# break broadcast / all_gather / reduce_scatter. Older NCCL only knows plain names.
PER_COLLECTIVE_ALGO_SINCE: Version = (2, 24, 3)
# NCCL logs one `TUNING` line per collective on rank 0 from 2.23.4 on.
TUNING_LOG_SINCE: Version = (2, 23, 4)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

# NCCL's function names in its logs and in the `func:` part of NCCL_ALGO.
NCCL_FUNC = {
    "all_reduce": "AllReduce",
    "all_gather": "AllGather",
    "reduce_scatter": "ReduceScatter",
    "broadcast": "Broadcast",
    "all_to_all": "SendRecv",  # point-to-point underneath: NCCL_ALGO does not apply to it
}
_ALGO_DISPLAY = {"ring": "Ring", "tree": "Tree", "nvls": "NVLS", "nvlstree": "NVLSTree", "pat": "PAT",
                 "collnetdirect": "CollNetDirect", "collnetchain": "CollNetChain"}  # fmt: skip


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' busbw = algbw × factor: what a flat point-to-point ring would need to move.

    all_reduce 2(n-1)/n; all_gather, reduce_scatter and all_to_all (n-1)/n; broadcast 1.
    With one rank there is no bus: the factor is 0 for every collective but broadcast.
    """
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


def parse_version(text: str | Iterable[int] | None) -> Version | None:
    """(2, 21, 5) from "2.21.5", "2.21.5-1", (2, 21, 5) or an int like 22105; None when unknown."""
    if text is None:
        return None
    if isinstance(text, int):  # NCCL_VERSION_CODE: major*10000 + minor*100 + patch
        return (text // 10000, text // 100 % 100, text % 100)
    if not isinstance(text, str):
        parts = [int(p) for p in text]
        padded = [*parts, 0, 0, 0]
        return (padded[0], padded[1], padded[2])
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        return None
    return (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))


def format_version(version: Version | None) -> str | None:
    return None if version is None else ".".join(map(str, version))


def nccl_algo_env(algo: str, version: Version | None, collective: str = "all_reduce") -> str:
    """The NCCL_ALGO value that forces `algo` for `collective` and leaves the others to NCCL.

    NCCL ≥ 2.24.3: `allreduce:tree` (per-collective, lower-case function name); before: `Tree`, which
    then applies to every collective (older NCCL falls back to Ring where Tree cannot run).
    """
    name = _ALGO_DISPLAY.get(algo.lower().replace("_", ""), algo)
    if version is not None and version >= PER_COLLECTIVE_ALGO_SINCE:
        return f"{NCCL_FUNC[collective].lower()}:{name.lower()}"
    return name


def tuning_log_supported(version: Version | None) -> bool:
    return version is not None and version >= TUNING_LOG_SINCE


@dataclass(kw_only=True, frozen=True)
class TuningEntry:
    """One `NCCL_DEBUG_SUBSYS=TUNING` line: what NCCL chose for one collective call on rank 0."""

    func: str  # NCCL's name: AllReduce, AllGather, ...
    bytes: int  # count × type size as NCCL logs it (per-rank count for AllGather / ReduceScatter)
    algo: str  # lower case: ring, tree, nvls, nvls_tree, collnet_direct, collnet_chain, pat
    proto: str  # lower case: simple, ll, ll128
    channel_lo: int | None = None
    channel_hi: int | None = None
    comm: str | None = None  # communicator address, printed by some NCCL versions


# `AllReduce: 1048576 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..15} [comm 0x55..]`, after the
# usual `host:pid:tid [dev] NCCL INFO ` prefix (src/enqueue.cc, NCCL ≥ 2.23.4).
_TUNING = re.compile(
    r"NCCL INFO (?P<func>[A-Za-z]+): (?P<bytes>\d+) Bytes -> Algo (?P<algo>\w+) proto (?P<proto>\w+)"
    r"(?: channel\{Lo\.\.Hi\}=\{(?P<lo>\d+)\.\.(?P<hi>\d+)\})?(?: comm (?P<comm>0x[0-9a-fA-F]+))?"
)


def parse_tuning_line(line: str) -> TuningEntry | None:
    match = _TUNING.search(line)
    if not match:
        return None
    lo, hi = match.group("lo"), match.group("hi")
    return TuningEntry(
        func=match.group("func"),
        bytes=int(match.group("bytes")),
        algo=match.group("algo").lower(),
        proto=match.group("proto").lower(),
        channel_lo=int(lo) if lo is not None else None,
        channel_hi=int(hi) if hi is not None else None,
        comm=match.group("comm"),
    )


def parse_tuning_log(text: str) -> list[TuningEntry]:
    """Every TUNING line in a debug log, in order; other lines (INIT, WARN, ...) are ignored."""
    return [entry for line in text.splitlines() if (entry := parse_tuning_line(line)) is not None]


def algo_used(
    entries: Iterable[TuningEntry], collective: str, total_bytes: int, world_size: int
) -> tuple[str, str] | None:
    """The (algo, proto) NCCL used most often for `collective` at this size, or None if it never logged.

    NCCL logs count × type size of the call: the whole buffer for AllReduce / Broadcast, one rank's
    share for AllGather / ReduceScatter; both are accepted. Calls of other sizes (a barrier's 4-byte
    all_reduce, control traffic) are not counted.
    """
    func = NCCL_FUNC[collective]
    sizes = {total_bytes, total_bytes // max(world_size, 1)}
    seen = Counter((e.algo, e.proto) for e in entries if e.func == func and e.bytes in sizes)
    return seen.most_common(1)[0][0] if seen else None


def debug_file_path(pattern: str, host: str, pid: int) -> str:
    """Expand NCCL_DEBUG_FILE's `%h` (host) and `%p` (pid) the way NCCL does; `%%` is a percent sign."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "%" and i + 1 < len(pattern):
            code = pattern[i + 1]
            out.append({"h": host, "p": str(pid), "%": "%"}.get(code, "%" + code))
            i += 2
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


def tuning_debug_env(current: dict[str, str], log_path: str) -> dict[str, str]:
    """Variables that make NCCL write its TUNING lines to `log_path`, keeping what the user set.

    NCCL reads its debug settings once per process, at the first NCCL call, so these must be in the
    environment before the process group exists. A user's own NCCL_DEBUG_FILE wins (we read that file);
    their NCCL_DEBUG_SUBSYS gains TUNING; NCCL_DEBUG is raised to INFO unless it is already INFO or TRACE.
    """
    updates: dict[str, str] = {}
    if current.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        updates["NCCL_DEBUG"] = "INFO"
    subsys = current.get("NCCL_DEBUG_SUBSYS", "").strip()
    names = [s.strip() for s in subsys.lstrip("^").split(",") if s.strip()]
    if not subsys:
        updates["NCCL_DEBUG_SUBSYS"] = "TUNING"
    elif subsys.startswith("^"):  # an exclusion list: only make sure TUNING is not excluded
        kept = [s for s in names if s.upper() != "TUNING"]
        if len(kept) != len(names):
            updates["NCCL_DEBUG_SUBSYS"] = "^" + ",".join(kept) if kept else "ALL"
    elif not {"TUNING", "ALL"} & {s.upper() for s in names}:
        updates["NCCL_DEBUG_SUBSYS"] = subsys + ",TUNING"
    if not current.get("NCCL_DEBUG_FILE"):
        updates["NCCL_DEBUG_FILE"] = log_path
    return updates


class TuningTail:
    """Read the TUNING lines NCCL appended to its debug file since the last call.

    NCCL opens NCCL_DEBUG_FILE unbuffered (src/debug.cc), so a line is in the file as soon as the
    collective is enqueued; an incomplete last line waits for the next call.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> list[TuningEntry]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        complete = data.rfind(b"\n") + 1
        self.offset += complete
        return parse_tuning_log(data[:complete].decode(errors="replace"))
