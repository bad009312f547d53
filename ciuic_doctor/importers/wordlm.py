"""PyTorch examples `word_language_model` stdout (main.py), as people paste it in bug reports.

    | epoch   1 |   200/ 2983 batches | lr 20.00 | ms/batch 45.12 | loss  7.62 | ppl  2049.37
    | end of epoch   1 | time: 35.58s | valid loss  5.82 | valid ppl   336.49     (eval: StepLog.eval_loss)

`loss` is the mean over the last log_interval batches (printed with 2 decimals); the step is the batch
counted over epochs, (epoch − 1) × batches per epoch + batch. `lr` is printed. `loss nan` (the model's
loss went NaN, e.g. lr 20 with RNN_RELU) is a finding, not a missing value. The end-of-epoch validation
loss belongs to the last batch logged before it.
"""

from __future__ import annotations

from ciuic_doctor.importers._text import NUMBER, line_format

load = line_format(
    r"\| epoch +(?P<epoch>\d+) \| +(?P<batch>\d+)/ *(?P<batches>\d+) batches \| lr +(?P<lr>[-+0-9.eE]+) \|"
    r"[^\n]*?\| loss +(?P<loss>" + NUMBER + r") \|",
    name="wordlm",
    framework="pytorch-examples",
    eval_pattern=r"\| end of epoch +\d+ \|[^\n]*?\| valid loss +(?P<loss>" + NUMBER + r") \|",
    loss_kind="mean",
)
