"""nanoGPT's train.py stdout: one line per log_interval iterations, as people paste it in bug reports.

    iter 100: loss 4.2314, time 152.31ms, mfu 38.12%
    step 250: train loss 3.9812, val loss 4.0127          (the eval line: not a training step)

The loss is the last micro-batch's (×gradient_accumulation_steps, printed to 4 places); `iter` counts
optimizer steps from 0. Python prints a NaN loss as `nan`, which is a finding, not a missing value.
"""

from __future__ import annotations

from ciuic_doctor.importers._text import line_format

load = line_format(
    r"iter (?P<step>\d+): loss (?P<loss>[-+0-9.eE]+|nan|-?inf)(?:, time [0-9.]+ ?ms)?",
    name="nanogpt",
    framework="nanogpt",
)
