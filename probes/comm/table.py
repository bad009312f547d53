"""The nccl-tests-style text table comm-bench prints on rank 0, one line per size as it goes.

Columns as nccl-tests prints them (size, count, type, redop, root, then time / algbw / busbw / #wrong for
out-of-place and again for in-place), so the numbers can be held next to an nccl-tests run. A placement
PyTorch cannot express prints as N/A. Pure string functions: no torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

BUSBW_NOTE = (
    "# busbw = algbw x factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; "
    "broadcast 1): the rate a flat ring would need. Compare it across algorithms and with nccl-tests, "
    "not with link speed: Tree on 2 nodes, NVLS or SHARP can exceed it."
)
_PLACEMENT_COLS = "{:>9} {:>7} {:>7} {:>6}"


@dataclass(kw_only=True)
class Cell:
    """One placement's figures on a table line."""

    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int


def format_time_us(us: float) -> str:
    """nccl-tests-like width: two decimals while short, fewer as the number grows."""
    if us < 1e4:
        return f"{us:.2f}"
    if us < 1e6:
        return f"{us:.1f}"
    return f"{us:.0f}"


def header(*, collective: str, algo: str, dtype: str, backend: str, world_size: int, note: str = "") -> str:
    title = f"# {collective}  algo={algo}  dtype={dtype}  backend={backend}  ranks={world_size}"
    lines = [title]
    if note:
        lines.append(f"# ({note})")
    lines += [
        "#" + " " * 50 + f"{'out-of-place':^32}  {'in-place':^32}",
        "# {:>10} {:>12} {:>9} {:>6} {:>6}  ".format("size", "count", "type", "redop", "root")
        + _PLACEMENT_COLS.format("time", "algbw", "busbw", "#wrong")
        + "  "
        + _PLACEMENT_COLS.format("time", "algbw", "busbw", "#wrong"),
        "# {:>10} {:>12} {:>9} {:>6} {:>6}  ".format("(B)", "(elements)", "", "", "")
        + _PLACEMENT_COLS.format("(us)", "(GB/s)", "(GB/s)", "")
        + "  "
        + _PLACEMENT_COLS.format("(us)", "(GB/s)", "(GB/s)", ""),
    ]
    return "\n".join(text.rstrip() for text in lines)


def _cell(cell: Cell | None) -> str:
    if cell is None:
        return _PLACEMENT_COLS.format("N/A", "N/A", "N/A", "N/A")
    return _PLACEMENT_COLS.format(
        format_time_us(cell.time_us), f"{cell.algbw_gbps:.2f}", f"{cell.busbw_gbps:.2f}", cell.wrong
    )


def line(
    *,
    size: int,
    count: int,
    type_name: str,
    redop: str,
    root: int,
    cells: Mapping[bool, Cell | None],
    algo_used: str | None = None,
) -> str:
    """One table line; `cells` maps inplace (False / True) to that placement's figures."""
    text = (
        f"  {size:>10} {count:>12} {type_name:>9} {redop:>6} {root:>6}  "
        + _cell(cells.get(False))
        + "  "
        + _cell(cells.get(True))
    )
    return text + (f"  {algo_used}" if algo_used else "")


def footer(busbw_values: Iterable[float], wrong_total: int) -> tuple[str, float]:
    """nccl-tests' footer: wrong elements with OK/FAILED and the plain mean busbw of the printed rows."""
    values = list(busbw_values)
    avg = sum(values) / len(values) if values else 0.0
    verdict = "OK" if wrong_total == 0 else "FAILED"
    text = f"# Wrong elements      : {wrong_total} {verdict}\n# Avg bus bandwidth    : {avg:.3f} GB/s"
    return text, avg
