"""A Frame as a Rich renderable: the header, one line per rank, the distribution line past a screen.

Every string that came from the job (its script name, host names, stacks) is shown as Rich `Text`, never
parsed as markup, and stripped of control characters, so a file named `[red]x` or an escape sequence in
an argv cannot restyle or move the terminal.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

from ciuic_doctor.live.view import Frame, Row

SPARKS = "▁▂▃▄▅▆▇█"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
SORTS: dict[str, Callable[[Row], Any]] = {
    "status": lambda r: (r.verdict.severity, -(r.figures.get("since_last_step_s") or 0), r.rank),
    "rank": lambda r: r.rank,
    "step": lambda r: (r.figures.get("step") is None, r.figures.get("step") or 0),
    "step_time": lambda r: -(r.figures.get("step_time_s") or 0),
    "cpu": lambda r: -(r.sample.cpu_percent or 0),
    "rss": lambda r: -(r.sample.rss_bytes or 0),
}
SORT_ORDER = tuple(SORTS)


def clean(text: Any) -> str:
    """A string from the job, safe for a terminal: control characters become '?'."""
    return _CONTROL.sub("?", str(text))


def sparkline(values: list[float], width: int = 40) -> str:
    """The last `width` values as block characters, lowest to highest.

    >>> sparkline([1, 2, 3, 4])
    '▁▃▆█'
    """
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)][-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    if high == low:
        return SPARKS[3] * len(values)
    return "".join(SPARKS[min(7, int((v - low) / (high - low) * 7.999))] for v in values)


def size(value: float | None) -> str:
    """Bytes in powers of 1024, short enough for a column.

    >>> size(3 * 2**30), size(512 * 2**20), size(None)
    ('3.0G', '512M', '-')
    """
    if value is None:
        return "-"
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}" if unit == "G" else f"{value / scale:.0f}{unit}"
    return f"{value:.0f}B"


def num(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt)


COLUMNS = (
    "RANK", "PID", "LR", "STATUS", "STATE", "CPU%", "RSS", "USS", "THR", "WKR", "IO_R/W", "GPU",
    "STEP", "STEP/S", "AGE", "STEP_T", "PRE_BWD", "LOSS", "GNORM", "SCALE", "SKIP", "TOK/S",
)  # fmt: skip


def row_cells(row: Row) -> list[str]:
    """The cells of one rank's line; none holds a space, so a script can split the line into columns
    (WKR: workers/their CPU %, IO_R/W: read/written per second, GPU: index:util/memory/power)."""
    s, f = row.sample, row.figures
    gpu = "-"
    if s.gpus:
        g = s.gpus[0]
        util = g.get("utilization_ratio")
        gpu = f"{row.gpu}:{num(None if util is None else 100 * util, '.0f')}%/"
        gpu += f"{size(g.get('memory_used_bytes'))}/{num(g.get('power_watts'), '.0f')}W"
    elif row.gpu:
        gpu = row.gpu
    io = "-"
    if s.read_bytes_per_s is not None:
        io = f"{size(s.read_bytes_per_s)}/{size(s.write_bytes_per_s)}"
    workers = "-"
    if s.workers:
        workers = f"{s.workers}/{num(s.workers_cpu_percent, '.0f')}%"
    return [
        str(row.rank),
        str(row.pid),
        num(row.local_rank, "d"),
        row.verdict.status,
        s.state,
        num(s.cpu_percent, ".0f"),
        size(s.rss_bytes),
        size(s.uss_bytes),
        num(s.threads, "d"),
        workers,
        io,
        gpu,
        num(f.get("step"), "d"),
        num(f.get("steps_per_s"), ".2f"),
        num(f.get("since_last_step_s"), ".1f"),
        num(f.get("step_time_s"), ".3f"),
        num(f.get("pre_backward_s"), ".3f"),
        num(f.get("loss"), ".4g"),
        num(f.get("grad_norm"), ".3g"),
        num(f.get("loss_scale"), ".0f"),
        num(f.get("skipped_in_window"), "d"),
        num(f.get("tokens_per_s"), ".0f"),
    ]


def distribution(rows: list[Row]) -> str:
    """One line for ranks not shown: how many, and the spread of their pace, CPU and memory."""

    def spread(values: list[float], fmt: Callable[[float], str]) -> str:
        if not values:
            return "-"
        values = sorted(values)
        p50 = statistics.median(values)
        return f"min {fmt(values[0])} p50 {fmt(p50)} max {fmt(values[-1])}"

    statuses: dict[str, int] = {}
    for row in rows:
        statuses[row.verdict.status] = statuses.get(row.verdict.status, 0) + 1
    said = ", ".join(f"{n} {status}" for status, n in sorted(statuses.items()))
    rates = [r.figures["steps_per_s"] for r in rows if r.figures.get("steps_per_s")]
    cpu = [r.sample.cpu_percent for r in rows if r.sample.cpu_percent is not None]
    rss = [r.sample.rss_bytes for r in rows if r.sample.rss_bytes is not None]
    return (
        f"... {len(rows)} more ranks ({said}): steps/s {spread(rates, lambda v: f'{v:.2f}')}; "
        f"CPU% {spread(cpu, lambda v: f'{v:.0f}')}; RSS {spread(rss, size)}"
    )


def _partial(frame: Frame) -> str:
    """' (k of n ranks)' when only some ranks record tokens: the sum is then not the job's."""
    if 0 < frame.tokens_ranks < len(frame.rows):
        return f" ({frame.tokens_ranks} of {len(frame.rows)} ranks)"
    return ""


def header_lines(frame: Frame, sort: str) -> list[str]:
    bad = sum(1 for r in frame.rows if r.verdict.status != "ok")
    clock = time.strftime("%H:%M:%S", time.localtime(frame.t))
    run = clean(frame.run_dir) if frame.run_dir else "- (not watched)"
    lines = [
        f"ciuic-doctor top  {clock}  script {clean(frame.script)}  "
        f"world size {num(frame.world_size, 'd')}  ranks here {len(frame.rows)}  "
        f"hosts {clean(','.join(frame.hosts)) or '-'}" + ("" if frame.alive else "  [job ended]"),
        f"step {num(frame.step, 'd')}  steps/s {num(frame.steps_per_s, '.2f')}  "
        f"tokens/s {num(frame.tokens_per_s, '.0f')}{_partial(frame)}  "
        f"attention {bad} rank(s)  sort: {sort}  run {run}",
    ]
    if frame.step_time_series:
        lines.append(
            f"step time {sparkline(frame.step_time_series)} {frame.step_time_series[-1]:.3f} s (slowest rank)"
        )
    if frame.loss_series:
        lines.append(f"loss      {sparkline(frame.loss_series)} {frame.loss_series[-1]:.4g}")
    lines.extend(f"note: {clean(n)}" for n in frame.notes)
    return lines


def visible_rows(frame: Frame, sort: str, max_rows: int) -> tuple[list[Row], list[Row]]:
    """(rows shown, rows folded into the distribution line). Past a screen, the ranks needing attention
    come first whatever the sort, then the sort order."""
    ordered = sorted(frame.rows, key=SORTS.get(sort, SORTS["status"]))
    if len(ordered) <= max_rows:
        return ordered, []
    keep = max(1, max_rows - 1)
    attention = [r for r in ordered if r.verdict.status != "ok"]
    rest = [r for r in ordered if r.verdict.status == "ok"]
    shown = (attention + rest)[:keep]
    chosen = {id(r) for r in shown}
    return [r for r in ordered if id(r) in chosen], [r for r in ordered if id(r) not in chosen]


def renderable(frame: Frame, *, sort: str = "status", max_rows: int = 40, footer: str = "") -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    for name in COLUMNS:
        table.add_column(
            name, no_wrap=True, justify="left" if name in ("STATUS", "STATE", "GPU") else "right"
        )
    shown, folded = visible_rows(frame, sort, max_rows)
    styles = {"DOWN": "bold red", "STALLED": "bold red", "waiting": "yellow", "straggler": "magenta"}
    for row in shown:
        table.add_row(*(Text(c) for c in row_cells(row)), style=styles.get(row.verdict.status))
    parts: list[Any] = [Text(line) for line in header_lines(frame, sort)]
    parts.append(table)
    if folded:
        parts.append(Text(distribution(folded)))
    for row in shown:
        if row.verdict.why and row.verdict.status != "ok":
            parts.append(Text(f"rank {row.rank}: {clean('; '.join(row.verdict.why))}"))
    if footer:
        parts.append(Text(footer, style="dim"))
    return Group(*parts)


def as_text(frame: Frame, *, sort: str = "status", max_rows: int = 40, width: int = 200) -> str:
    """The frame as plain text (`top --once`), no colour, no terminal codes."""
    import io

    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False, legacy_windows=False)
    console.print(renderable(frame, sort=sort, max_rows=max_rows))
    return buffer.getvalue()
