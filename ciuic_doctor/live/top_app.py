"""The interactive `ciuic-doctor top`: a Rich Live screen redrawn every interval, and single keys.

    s  next sort (status, rank, step, step_time, cpu, rss)     p  stacks of the ranks on screen (py-spy)
    q  quit (Ctrl-C too)                                       any key in the stack view: back

Why Rich and not Textual: Rich is already in the environment (and light: ~40 ms to import, no asyncio
event loop in a tool that must stay cheap beside a job), its Console renders the very same frame as text
for `--once`, and the screen is tested as a person uses it, in tmux (send-keys / capture-pane). Keys are
read from the terminal in cbreak mode with select(), so nothing runs between samples but the wait.
Stacks are read on demand only (never on a timer), in a thread, with py-spy --nonblocking as
`hang --pid` does: the ranks are not paused.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import threading
import time
import tty
from collections.abc import Iterator
from typing import Any

from ciuic_doctor.live.render import SORT_ORDER, clean, renderable, visible_rows
from ciuic_doctor.live.view import Frame, LiveJob

STACK_RANKS = 4  # ranks whose stacks the stack view shows (worst first)
STACK_FRAMES = 8  # innermost frames of each rank's main thread (and the script's own frame, if deeper)
HELP_LINE = "keys: s sort  p stacks  q quit"


@contextlib.contextmanager
def cbreak(stream: Any) -> Iterator[bool]:
    """Single keys without Enter while inside; False when stdin is not a terminal (keys then unread)."""
    if not stream.isatty():
        yield False
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def read_key(timeout_s: float, keys_on: bool) -> str | None:
    if not keys_on:
        time.sleep(timeout_s)
        return None
    ready, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout_s))
    if not ready:
        return None
    data = os.read(sys.stdin.fileno(), 32)
    return data.decode(errors="replace")[:1] if data else "q"


class StackView:
    """py-spy stacks of some ranks, read in a background thread so the screen stays live."""

    def __init__(self, rows: list[tuple[int, int]]) -> None:
        self.rows = rows  # (rank, pid)
        self.result: list[str] = [f"reading stacks of rank(s) {', '.join(str(r) for r, _ in rows)} ..."]
        self.done = False
        self.shown = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        from ciuic_doctor.rundir.hang.files import py_spy_stacks

        lines: list[str] = []
        for rank, pid in self.rows:
            threads, error = py_spy_stacks(pid)
            lines.append(f"rank {rank} (PID {pid}):")
            if threads is None:
                lines.append(f"  {clean(error)}")
                continue
            main = threads[0] if threads else {"frames": [], "name": "?"}
            lines.append(f"  thread {clean(main.get('name'))}, innermost first:")
            lines += stack_lines(main.get("frames", []))
        self.result = lines
        self.done = True


def stack_lines(frames: list[dict[str, Any]]) -> list[str]:
    """A thread's frames (innermost first) as the view's lines: the STACK_FRAMES innermost, and the
    script's own innermost frame when it is deeper than those, after how many are left out. A forward
    through nested modules is 20+ frames deep: its 8 innermost (Linear, _call_impl, ...) showed no line
    of the script.

    >>> torch = [{"function": f"f{i}", "file": "/site-packages/torch/m.py", "line": i} for i in range(12)]
    >>> mine = {"function": "train", "file": "/home/me/train.py", "line": 41}
    >>> [line.strip() for line in stack_lines([*torch, mine])][7:]
    ['f7  m.py:7', '... 4 frames ...', 'train  train.py:41']
    """
    from ciuic_doctor.analysis.hang.frames import user_frame

    def line(frame: dict[str, Any]) -> str:
        where = f"{os.path.basename(str(frame.get('file')))}:{frame.get('line')}"
        return f"    {clean(frame.get('function'))}  {clean(where)}"

    lines = [line(frame) for frame in frames[:STACK_FRAMES]]
    own = user_frame(frames)
    at = next((i for i, frame in enumerate(frames) if frame is own), -1)
    if at >= STACK_FRAMES:
        if at > STACK_FRAMES:
            lines.append(f"    ... {at - STACK_FRAMES} frames ...")
        lines.append(line(own))
    return lines


def run_interactive(job: LiveJob, *, interval_s: float, sort: str = "status") -> int:
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    console = Console()
    stacks: StackView | None = None
    job.update()  # rates need two readings: the first screen shows them after a short baseline
    time.sleep(min(0.5, interval_s))
    frame: Frame = job.update()
    next_sample = time.monotonic() + interval_s

    def screen() -> Any:
        with contextlib.suppress(OSError):  # the terminal's own size (a stale exported COLUMNS is not it)
            console.size = os.get_terminal_size(sys.stdout.fileno())
        height = console.size.height
        if stacks is not None:
            title = "stacks (py-spy --nonblocking; any key: back)" + ("" if stacks.done else " ...")
            return Group(Text(title, style="bold"), *(Text(line) for line in stacks.result))
        return renderable(frame, sort=sort, max_rows=max(3, height - 9), footer=HELP_LINE)

    with (
        cbreak(sys.stdin) as keys_on,
        Live(screen(), console=console, screen=True, auto_refresh=False) as live,
    ):
        live.refresh()
        while True:
            key = read_key(min(0.2, max(0.0, next_sample - time.monotonic())), keys_on)
            if key is not None:
                if stacks is not None:
                    stacks = None
                elif key in ("q", "Q", "\x1b"):
                    return 0
                elif key == "s":
                    sort = SORT_ORDER[(SORT_ORDER.index(sort) + 1) % len(SORT_ORDER)]
                elif key == "p":
                    shown, _ = visible_rows(frame, "status", STACK_RANKS)
                    stacks = StackView([(r.rank, r.pid) for r in shown if r.sample.up][:STACK_RANKS])
                live.update(screen(), refresh=True)
            if time.monotonic() >= next_sample:
                frame = job.update()
                next_sample = time.monotonic() + interval_s
                live.update(screen(), refresh=True)
            elif stacks is not None and stacks.done and not stacks.shown:
                stacks.shown = True  # the answer, drawn once (not every 0.2 s while it is on screen)
                live.update(screen(), refresh=True)
