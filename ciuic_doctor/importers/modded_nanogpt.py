"""modded-nanogpt (KellerJordan/modded-nanogpt) logs, as its `records/` folder keeps them: the training
script's source, then one line per step.

    step:0/6200 val_loss:10.8258 train_time:0ms step_avg:nanms              (eval, every val_loss_every)
    step:1/6200 train_loss:10.9184 train_time:216ms step_avg:nanms          (2024-10 .. 2024-11 records)
    step:1/1750 train_time:148ms step_avg:148.02ms                          (later records: no train loss)

Each train_loss is that step's (rank 0's batch, not averaged). Later records print the validation loss
only: those logs are judged on it (the import says so), since it is the one loss curve they have.
"""

from __future__ import annotations

from ciuic_doctor.importers._text import NUMBER, line_format

load = line_format(
    r"step:(?P<step>\d+)/\d+ train_loss:(?P<loss>" + NUMBER + r")",
    name="modded-nanogpt",
    framework="modded-nanogpt",
    eval_pattern=r"step:(?P<step>\d+)/\d+ val_loss:(?P<loss>" + NUMBER + r")",
    loss_kind="sample",
    eval_as_loss=True,
)
