"""`watch --snapshot-on-leak` (CUDA only): when allocated device memory keeps growing, dump the allocator's
history so the leaking allocation's Python stack can be seen.

Recording starts at attach with `torch.cuda.memory._record_memory_history(stacks="python")` (python-only
stacks, as torchtitan does: C++ symbolisation is slow) and a bounded history. The dump is
RUN/memory_snapshot.rank<R>.pickle, which https://pytorch.org/memory_viz opens locally in the browser.
One dump per process, then recording stops (it costs host time on every allocation).

The trigger is deliberately plain: after the warm-up (optimizer state appears at steps 1-2), allocated
memory rose on at least 90 % of the last 20 step-to-step comparisons and by at least 64 MiB in total.
A steady job's allocated memory returns to the same value every step, so it never fires on one.

Not testable without a GPU; `leak_suspected` is, and is tested.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from typing import Any

WARMUP_STEPS = 3
WINDOW = 20
RISING_FRACTION = 0.9
MIN_GROWTH_BYTES = 64 << 20
MAX_ENTRIES = 100_000  # allocation events kept: bounded host memory for the history


def leak_suspected(allocated: list[int]) -> bool:
    """True when the last WINDOW+1 values rise almost every step and by MIN_GROWTH_BYTES overall.

    >>> leak_suspected([i * (8 << 20) for i in range(21)])
    True
    >>> leak_suspected([1 << 30] * 21)
    False
    """
    if len(allocated) < WINDOW + 1:
        return False
    window = allocated[-(WINDOW + 1) :]
    rises = sum(b > a for a, b in itertools.pairwise(window))
    return rises >= RISING_FRACTION * WINDOW and window[-1] - window[0] >= MIN_GROWTH_BYTES


class LeakSnapshot:
    def __init__(self, *, run: Any, rank: int) -> None:
        import torch

        self.run = run
        self.rank = rank
        self.done = False
        self._allocated: deque[int] = deque(maxlen=WINDOW + 1)
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")

    def observe(self, step: int, allocated: int | None) -> None:
        if self.done or allocated is None or step <= WARMUP_STEPS:
            return
        self._allocated.append(allocated)
        if leak_suspected(list(self._allocated)):
            self.dump(step)

    def stop(self) -> None:
        """Stop recording the allocation history (at close, when no dump was needed)."""
        import torch

        if not self.done:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.done = True

    def dump(self, step: int) -> None:
        import torch

        path = self.run.path / f"memory_snapshot.rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.done = True
        self.run.record_probe("watch_snapshot", rank=self.rank, step=step, path=str(path))
        print(
            f"ciuic-doctor watch: rank {self.rank}: allocated memory kept growing up to step {step}; "
            f"memory snapshot in {path} (open it at https://pytorch.org/memory_viz)",
            file=sys.stderr,
        )
