"""llm.c (karpathy/llm.c) logs: the `-o DIR` main.log its logger writes, and the stdout step lines.

    s:0 tel:11.0092                                   (validation loss: eval)
    s:0 trl:11.0091 lr:0.000001 norm:15.37            (train_gpt2.cu since 2024-05; `s:N trl:X` alone in
                                                       train_gpt2.py and the fp32 trainer)
    s:250 eval:0.2965                                 (HellaSwag accuracy: not a loss, not read)
    step    1/19560 | loss 11.010986 (+nanz)| norm 15.2477 (+nanz)| lr 8.57e-07 | 133.42 ms | ...   (stdout)
    step    1/19560 | train loss 11.010986 | norm 15.2477 | lr 8.57e-07 | (133.42 ms | 3929 tok/s)    (.py)
    val loss 11.009155                                (stdout eval: no step on the line, not read)

main.log numbers steps from 0, stdout from 1 (`step + 1`); each line is that one step's loss (mean over the
batch's tokens). Source: karpathy/llm.c llmc/logger.h and train_gpt2.cu / train_gpt2.py.
"""

from __future__ import annotations

from ciuic_doctor.importers._text import NUMBER, line_format

load = line_format(
    r"(?:s:(?P<step>\d+) trl:(?P<loss>" + NUMBER + r")(?: lr:(?P<lr>" + NUMBER + r"))?"
    r"(?: norm:(?P<grad_norm>" + NUMBER + r"))?"
    r"|step +(?P<step2>\d+)/\d+ \| (?:train )?loss (?P<loss2>" + NUMBER + r")[^|\n]*\|"
    r" norm (?P<grad_norm2>" + NUMBER + r")[^|\n]*\| lr (?P<lr2>" + NUMBER + r"))",
    name="llmc",
    framework="llm.c",
    eval_pattern=r"s:(?P<step>\d+) tel:(?P<loss>" + NUMBER + r")",
    loss_kind="sample",
)
