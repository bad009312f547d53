"""torchtitan's train.py log (the reference trainer for DeepSeek-V3 and Llama 3/4 in PyTorch): one line per
`metrics.log_freq` steps, coloured with ANSI escapes unless `--metrics.disable_color_printing`.

    [rank0]:[titan] 2025-07-21 15:57:42,774 - root - INFO - step:  3  loss:  4.9925  grad_norm:  2.6422
        memory:  0.00GiB(0.00%)  tps: 30,768  tflops: 3.15  mfu: 0.32%              (one line)
    [titan] 2026-05-18 16:04:50,821 - root - INFO - validate step: 20  loss:  3.5440  memory: ...  (eval)

The loss is the step's global average over every rank's tokens (`%8.5f` since 2026-02, `%7.4f` before),
the grad norm the step's total norm (absent before 2025, where `wps:` stood for `tps:`). Without
`--local-ranks-filter` every rank prints the same line; the launcher's `[rankN]:` prefix tells them apart.
The escapes (`\\x1b[31m` ... `\\x1b[39m`, 24-bit `\\x1b[38;2;180;60;0m`) are removed before reading; any
logging prefix is allowed before `step:` (torchtitan's own `[titan] ... - root - INFO - `, or a wrapper's such
as ezpz's `[2025-09-11 14:09:46,954794][I][components/metrics:437:log] `).
Source: pytorch/torchtitan torchtitan/components/metrics.py (MetricsProcessor.log / log_validation).
"""

from __future__ import annotations

from ciuic_doctor.importers._text import NUMBER, line_format

load = line_format(
    r"(?:[^\n]*?[ \]])?(?<!validate )step: *(?P<step>\d+) +loss: *(?P<loss>" + NUMBER + r")"
    r"(?: +grad_norm: *(?P<grad_norm>" + NUMBER + r"))?",
    name="torchtitan",
    framework="torchtitan",
    eval_pattern=r"(?:[^\n]*?[ \]])?validate step: *(?P<step>\d+) +loss: *(?P<loss>" + NUMBER + r")",
    loss_kind="sample",
)
