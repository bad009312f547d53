"""nanoGPT's train.py stdout: one line per log_interval iterations, as people paste it in bug reports.

    iter 100: loss 4.2314, time 152.31ms, mfu 38.12%
    step 250: train loss 3.9812, val loss 4.0127          (the eval line: not a training step)

The loss is the last micro-batch's (×gradient_accumulation_steps, unrounded to 4 places); `iter` counts
optimizer steps from 0. Python prints a NaN loss as `nan`, which is a finding, not a missing value.
"""

from __future__ import annotations

import re
from pathlib import Path

from ciuic_doctor.importers import StepLog
from ciuic_doctor.importers._text import RANK_PREFIX, read_rows

_LINE = re.compile(
    r"^[ \t]*" + RANK_PREFIX + r"[ \t]*iter (?P<step>\d+): loss (?P<loss>[-+0-9.eE]+|nan|-?inf)"
    r"(?:, time (?P<ms>[0-9.]+) ?ms)?",
    re.M,
)


def load(path: Path) -> StepLog:
    return read_rows(path, _LINE, source=f"nanogpt:{path.name}", framework="nanogpt")
