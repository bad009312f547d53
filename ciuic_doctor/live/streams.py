"""Tail a watched run's `steps.rank<R>.jsonl` files: only the bytes written since the last look.

The files are data another process writes: each is opened with O_NOFOLLOW (a symlink is refused, never
followed), must be a regular file, and is read at most `MAX_READ_BYTES` per look (a burst of records is
caught up over several looks); at first sight only its last `START_TAIL_BYTES` are read, so attaching to
a week-old run costs the same as to a new one. A torn last line waits for its end; a line that does not
parse is counted and skipped (store.py's rule). A file replaced or truncated is read again from its start.

Per rank a window of the last `WINDOW_STEPS` step records is kept: the live figures and verdicts are
computed on it.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEPS_FILE = re.compile(r"^steps\.rank(\d+)\.jsonl$")
MAX_READ_BYTES = 4 << 20  # per file per look
START_TAIL_BYTES = 512 << 10  # ~2,000 step records of ~250 bytes
MAX_LINE_BYTES = 1 << 20  # a "line" longer than this is not a record: dropped
WINDOW_STEPS = 200
KEYS = ("step", "t", "step_time_s", "pre_backward_s", "loss", "grad_norm", "loss_scale", "skipped", "tokens")


@dataclass(kw_only=True)
class StepWindow:
    """The last records of one rank, reduced to the fields the live view uses."""

    rank: int
    records: deque = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))
    steps_seen: int = 0  # records read since attaching (the step counter's increase)
    skipped_seen: int = 0
    tokens_seen: float = 0.0
    bad_lines: int = 0
    _cache: dict = field(default_factory=dict)  # (what, steps_seen) -> value: recomputed on new records

    @property
    def last(self) -> dict[str, Any] | None:
        return self.records[-1] if self.records else None

    def column(self, key: str) -> list[float]:
        return [float(r[key]) for r in self.records if _finite(r.get(key))]

    def pace(self, key: str, last_n: int = 100) -> tuple[float, float, int] | None:
        """(median, MAD, count) of `key` over the last `last_n` records; None without values."""
        cached = self._cache.get(("pace", key, self.steps_seen), False)
        if cached is not False:
            return cached
        values = self.column(key)[-last_n:]
        result = None
        if values:
            middle = statistics.median(values)
            result = (middle, statistics.median(abs(v - middle) for v in values), len(values))
        self._cache = {k: v for k, v in self._cache.items() if k[-1] == self.steps_seen}
        self._cache[("pace", key, self.steps_seen)] = result
        return result

    def figures(self, now: float) -> dict[str, Any]:
        """step, steps/s, seconds since the last step, loss, grad norm, loss scale, skipped steps in the
        window, time before backward, tokens/s (None where the records do not carry it)."""
        last = self.last
        if last is None:
            return {}
        cached = self._cache.get(("figures", self.steps_seen))
        if cached is None:
            cached = self._cache[("figures", self.steps_seen)] = self._figures()
        age = max(0.0, now - float(last["t"])) if _finite(last.get("t")) else None
        return {**cached, "since_last_step_s": age}

    def _figures(self) -> dict[str, Any]:
        last = self.records[-1]
        times = self.column("step_time_s")[-50:]
        stamps = [float(r["t"]) for r in list(self.records)[-50:] if _finite(r.get("t"))]
        steps_per_s = None
        if len(stamps) >= 2 and stamps[-1] > stamps[0]:
            steps_per_s = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        elif times:
            steps_per_s = 1 / statistics.median(times) if statistics.median(times) > 0 else None
        pre = self.column("pre_backward_s")[-50:]
        return {
            "step": last.get("step"),
            "steps_per_s": steps_per_s,
            "step_time_s": statistics.median(times) if times else None,
            "pre_backward_s": statistics.median(pre) if pre else None,
            "loss": last.get("loss") if _finite(last.get("loss")) else None,
            "grad_norm": last.get("grad_norm") if _finite(last.get("grad_norm")) else None,
            "loss_scale": last.get("loss_scale") if _finite(last.get("loss_scale")) else None,
            "skipped_in_window": sum(1 for r in self.records if r.get("skipped")),
            "tokens_per_s": self._tokens_per_s(),
        }

    def _tokens_per_s(self) -> float | None:
        """Tokens the rank trained per second of wall time over its last 50 steps, like steps/s: the tokens
        of the steps after the first carrying `tokens`, over the time since it (a pause between steps, an
        evaluation or a checkpoint, lowers it, as it lowers the job's throughput). A step without the field
        after that counted no tokens (watch leaves it out at 0). With one step: its tokens / step time."""
        recent = [r for r in list(self.records)[-50:] if _finite(r.get("t"))]
        first = next((i for i, r in enumerate(recent) if _finite(r.get("tokens"))), None)
        if first is None:
            return None
        span = recent[first:]
        elapsed_s = float(span[-1]["t"]) - float(span[0]["t"])
        if len(span) >= 2 and elapsed_s > 0:
            return sum(float(r["tokens"]) for r in span[1:] if _finite(r.get("tokens"))) / elapsed_s
        last = span[-1]
        if _finite(last.get("step_time_s")) and last["step_time_s"] > 0:
            return float(last["tokens"]) / float(last["step_time_s"])
        return None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(kw_only=True)
class _Cursor:
    inode: tuple[int, int]
    offset: int
    pending: bytes = b""


class StepsTail:
    """Every steps.rank<R>.jsonl of one run directory, read incrementally."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.windows: dict[int, StepWindow] = {}
        self._cursors: dict[int, _Cursor] = {}
        self.refused: dict[str, str] = {}  # file -> why it is not read (a symlink, not a regular file)

    def poll(self) -> dict[int, StepWindow]:
        try:
            names = os.listdir(self.run_dir)
        except OSError:
            return self.windows
        for name in names:
            match = STEPS_FILE.match(name)
            if match:
                self._read(int(match.group(1)), self.run_dir / name)
        return self.windows

    def _read(self, rank: int, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            self.refused[path.name] = "a symlink: not followed" if os.path.islink(path) else str(exc)
            return
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                self.refused[path.name] = "not a regular file"
                return
            key = (info.st_dev, info.st_ino)
            cursor = self._cursors.get(rank)
            if cursor is None or cursor.inode != key or info.st_size < cursor.offset:
                start = max(0, info.st_size - START_TAIL_BYTES)
                cursor = self._cursors[rank] = _Cursor(inode=key, offset=start)
                if start:  # the first line read from the middle is a fragment
                    cursor.pending = b"\0"
            if info.st_size <= cursor.offset:
                return
            os.lseek(fd, cursor.offset, os.SEEK_SET)
            data = os.read(fd, min(MAX_READ_BYTES, info.st_size - cursor.offset))
        finally:
            os.close(fd)
        cursor.offset += len(data)
        self._parse(rank, cursor, data)

    def _parse(self, rank: int, cursor: _Cursor, data: bytes) -> None:
        window = self.windows.setdefault(rank, StepWindow(rank=rank))
        lines = (cursor.pending + data).split(b"\n")
        cursor.pending = lines.pop()
        if len(cursor.pending) > MAX_LINE_BYTES:
            cursor.pending, window.bad_lines = b"", window.bad_lines + 1
        for line in lines:
            if line.startswith(b"\0"):
                continue  # the fragment before the first whole line
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                window.bad_lines += 1
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                window.bad_lines += 1
                continue
            kept = {k: record.get(k) for k in KEYS}
            window.records.append(kept)
            window.steps_seen += 1
            window.skipped_seen += 1 if record.get("skipped") else 0
            if _finite(record.get("tokens")):
                window.tokens_seen += float(record["tokens"])
