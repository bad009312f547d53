"""nanoGPT's train.py stdout: one line per log_interval iterations, as people paste it in bug reports.

    found vocab_size = 50304 (inside data/openwebtext/meta.pkl)     (ln 50304 = 10.83: a uniform guess)
    iter 100: loss 4.2314, time 152.31ms, mfu 38.12%
    step 250: train loss 3.9812, val loss 4.0127          (the eval line: StepLog.eval_loss, not a step)

The loss is the last micro-batch's (×gradient_accumulation_steps, printed to 4 places): one step's sample,
not an interval mean; `iter` counts optimizer steps from 0. Python prints a NaN loss as `nan`, which is a
finding, not a missing value.
"""

from __future__ import annotations

import re
from pathlib import Path

from ciuic_doctor.importers._config import head_text
from ciuic_doctor.importers._text import NUMBER, line_format

_load = line_format(
    r"iter (?P<step>\d+): loss (?P<loss>" + NUMBER + r")(?:, time [0-9.]+ ?ms)?",
    name="nanogpt",
    framework="nanogpt",
    eval_pattern=r"step (?P<step>\d+): train loss [^,\n]*, val loss (?P<loss>" + NUMBER + r")",
    loss_kind="sample",
)
_VOCAB = re.compile(r"vocab_size = (\d+)|defaulting to vocab_size of GPT-2 to (\d+)")


def load(path: Path):  # -> StepLog
    log = _load(path)
    found = _VOCAB.search(head_text(path, 1 << 16))
    if found:
        log.vocab_size = int(found.group(1) or found.group(2))
    return log
