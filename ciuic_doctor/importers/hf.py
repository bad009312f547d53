"""Hugging Face Trainer `trainer_state.json`: the `log_history` list.

Train entries carry `loss` (the mean since the previous log, rounded to 4 places), `learning_rate`,
`epoch`, `step` and, since transformers ~4.38, `grad_norm` (of the logged step). Eval entries (`eval_loss`,
...) give the eval loss (StepLog.eval_loss); the final summary entry (`train_runtime`, `train_loss`, ...)
is not a training step: it is counted as unread. Python's json writes NaN/Infinity literals, which
json.loads reads back as floats.
A run directory of checkpoints has one trainer_state.json per checkpoint; pass the latest.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import UserError
from ciuic_doctor.importers import StepLog, normalize


def load(path: Path) -> StepLog:
    if path.is_dir():
        path = path / "trainer_state.json"
    try:
        state = json.loads(path.read_bytes().decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        raise UserError(f"{path}: not valid JSON (expected a Trainer trainer_state.json)") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise UserError(f"{path}: no log_history list (expected a Trainer trainer_state.json)")
    rows = []
    evals: list[tuple[int, float]] = []
    for entry in history:
        if isinstance(entry, dict) and "eval_loss" in entry:
            step, value = _number(entry.get("step")), _number(entry.get("eval_loss"))
            if step is not None and value is not None and math.isfinite(step) and abs(step) < 2**62:
                evals.append((int(step), value))
        if not isinstance(entry, dict) or "loss" not in entry:
            continue
        step = _number(entry.get("step"))
        if step is None or not math.isfinite(step):
            continue
        loss = _number(entry.get("loss"))
        rows.append(
            {
                "step": step,
                "loss": loss,
                "nonfinite": int(loss is not None and not math.isfinite(loss)),
                "lr": _number(entry.get("learning_rate")),
                "grad_norm": _number(entry.get("grad_norm")),
            }
        )
    steps = [r["step"] for r in rows]
    intervals = [b - a if b > a else 1 for a, b in zip([0.0, *steps], steps, strict=False)]
    columns: dict[str, Any] = {
        k: [r[k] for r in rows] for k in ("step", "loss", "nonfinite", "lr", "grad_norm")
    }
    columns["interval_steps"] = intervals
    return StepLog(
        table=normalize(columns, source=f"hf:{path.name}"),
        read_lines=len(history),
        unread_lines=len(history) - len(rows) - len(evals),
        framework="hf",
        eval_loss=evals,
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None
