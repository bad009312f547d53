"""Lightning CSVLogger `lightning_logs/version_N/metrics.csv`.

The header is every metric name ever logged, alphabetical, with `epoch` and `step`; rows are sparse (a
train row leaves the val columns empty, and metrics logged by different calls at one step land in
different rows). A metric logged with both on_step and on_epoch appears as `<name>_step` and
`<name>_epoch`. The loss is the first of: `train_loss_step`, `train_loss`, `loss_step`, `loss`,
`train/loss`, a total (`total_loss`, `train_total_loss`, ...); else, of the train columns with "loss" in
their name, the total a model logs beside its components: the one named as an aggregate (`mean_loss`,
`avg_loss`, `sum_loss`: a PINN's metrics.csv logs four component losses and their `mean_loss`), else the
column that is the sum or the mean of the others on the rows that have them all, else the largest by
median (a sum of non-negative terms is at least each term; taking the first by the alphabet dated a spike
by a small component); an epoch mean (`train_loss_epoch`, `loss_epoch`) when no per-step column exists.
Learning rate: LearningRateMonitor's `lr-<Optimizer>`; grad norm: `grad_2.0_norm_total` (lightning's
grad_norm utility) or a column named like grad_norm; eval loss: `val_loss` (or a val* column with "loss"
in its name).
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from ciuic_doctor.errors import UserError
from ciuic_doctor.importers import StepLog, normalize

_LOSS_NAMES = ("train_loss_step", "train_loss", "loss_step", "loss", "train/loss", "train/loss_step")
_TOTAL_NAMES = tuple(
    f"{head}{name}{tail}"
    for name in ("total_loss", "loss_total")
    for head in ("", "train_", "train/")
    for tail in ("_step", "")
)
_EPOCH_NAMES = ("train_loss_epoch", "loss_epoch", "train/loss_epoch")
# a column named as the aggregate of the others: `mean_loss`, `loss_total`, `avg_loss`, `train/sum_loss`
_AGGREGATE = re.compile(r"(^|[_/])(total|mean|avg|average|sum|combined|overall)([_/]|$)")
SUM_TOLERANCE = 1e-3  # relative: the total equals the sum of its components up to the printed digits
_NONFINITE = ("nan", "inf", "-inf", "infinity", "-infinity", "+inf")
_VAL_NAMES = ("val_loss", "val_loss_epoch", "val/loss", "valid_loss", "validation_loss")
_GRAD_NAMES = ("grad_2.0_norm_total", "grad_norm", "grad_norm_step", "train/grad_norm", "grad_norm_total")


def load(path: Path) -> StepLog:
    import pandas as pd

    if path.is_dir():
        path = path / "metrics.csv"
    text = path.read_bytes().decode("utf-8", errors="replace").replace("\x00", "")
    try:
        frame = pd.read_csv(
            io.StringIO(text),
            dtype=str,
            keep_default_na=False,  # "nan" in a loss column is a finding, not a missing value
            on_bad_lines="skip",
            engine="python",
            quoting=csv.QUOTE_MINIMAL,
        )
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError, csv.Error):
        raise UserError(f"{path}: not a CSV file (expected a Lightning CSVLogger metrics.csv)") from None
    columns = [str(c) for c in frame.columns]
    frame.columns = columns
    lines = max(0, text.count("\n") - 1)
    if "step" not in columns:
        raise UserError(f"{path}: no `step` column (expected a Lightning CSVLogger metrics.csv)")
    loss_col = _loss_column(frame, columns)
    lr_col = _pick(columns, ("lr", "learning_rate"), lambda c: c.startswith(("lr-", "lr_")))
    grad_col = _pick(columns, _GRAD_NAMES, lambda c: "grad" in c.lower() and "norm" in c.lower())
    val_col = _pick(columns, _VAL_NAMES, lambda c: "loss" in c.lower() and c.lower().startswith("val"))
    used = [c for c in (loss_col, lr_col, grad_col) if c]
    numeric = {c: pd.to_numeric(frame[c].str.strip(), errors="coerce") for c in ["step", *used]}
    if loss_col:
        numeric["nonfinite"] = frame[loss_col].str.strip().str.lower().isin(_NONFINITE).astype(int)
    numeric_frame = pd.DataFrame(numeric).dropna(subset=["step"])
    # Metrics logged by separate calls at one step are separate rows: one row per step, first value each.
    grouped = numeric_frame.groupby("step", sort=False)
    by_step = grouped.first().reset_index()
    if loss_col:
        by_step["nonfinite"] = grouped["nonfinite"].max().to_numpy()
    if loss_col:
        rows = by_step[by_step[loss_col].notna() | (by_step["nonfinite"] > 0)]
    else:
        rows = by_step[by_step[grad_col].notna()] if grad_col else by_step.iloc[0:0]
    steps = rows["step"]
    loss = rows[loss_col] if loss_col else None
    evals: list[tuple[int, float]] = []
    if val_col:
        values = pd.DataFrame(
            {"step": numeric["step"], "loss": pd.to_numeric(frame[val_col].str.strip(), errors="coerce")}
        ).dropna()
        evals = [(int(a), float(b)) for a, b in zip(values["step"], values["loss"], strict=True)]
    epoch_mean = bool(loss_col) and str(loss_col).lower().endswith("_epoch")
    return StepLog(
        table=normalize(
            {
                "step": steps,
                "loss": loss,
                "nonfinite": rows["nonfinite"] if loss_col else None,
                "lr": rows[lr_col] if lr_col else None,
                "grad_norm": rows[grad_col] if grad_col else None,
                "interval_steps": steps.diff().where(lambda d: d > 0).fillna(steps.clip(lower=1)),
            },
            source=f"lightning:{path.name}",
        ),
        read_lines=lines,
        unread_lines=max(0, lines - len(rows)),
        framework="lightning",
        eval_loss=evals,
        loss_kind="mean" if epoch_mean else "sample",  # `_step` (or on_step) values are one step's
    )


def _is_train(name: str) -> bool:
    low = name.lower()
    return not (low.startswith(("val", "test")) or low.endswith("_epoch") or "/val" in low)


def _pick(columns: list[str], preferred: tuple[str, ...], fallback) -> str | None:
    for name in preferred:
        if name in columns:
            return name
    return next((c for c in columns if c not in ("step", "epoch") and fallback(c)), None)


def _loss_column(frame, columns: list[str]) -> str | None:
    """The run's total training loss (see the module doc): a known name, else the total among the train
    loss columns (the sum of the others, else the largest median), else an epoch mean."""
    import pandas as pd

    named = _pick(columns, _LOSS_NAMES + _TOTAL_NAMES, lambda c: False)
    if named:
        return named
    train = [c for c in columns if c not in ("step", "epoch") and "loss" in c.lower() and _is_train(c)]
    if len(train) <= 1:
        return train[0] if train else _pick(columns, _EPOCH_NAMES, lambda c: False)
    named = [c for c in train if _AGGREGATE.search(c.lower())]
    if len(named) == 1:
        return named[0]
    values = pd.DataFrame({c: pd.to_numeric(frame[c].str.strip(), errors="coerce") for c in train})
    together = values.dropna()
    for column in train:
        others = together.drop(columns=column)
        scale = together[column].abs().clip(lower=1e-12)
        for combined in (others.sum(axis=1), others.mean(axis=1)):
            if len(together) and ((together[column] - combined).abs() <= SUM_TOLERANCE * scale).all():
                return column
    medians = values.median()
    return str(medians.idxmax()) if medians.notna().any() else train[0]
