"""Logs judged as a practitioner would, round 4: one constructed log per class, of the shape of the public
logs the classes were found on (numbers read off those logs; the logs themselves stay out of the repo).

1. a Megatron log of 4-5 iterations that blows up (12.5 -> 40.8, 14.1 -> 76.8) and stays up
2. per-step losses with 3-4.75x single-step outliers (hard batches) while the loss still falls fast
3. a flat noisy band: "ends 1.5x its best" against one lucky minimum
4. a Lightning CSV whose total loss is not called `train_loss`
5. llm.c: a small loss blip beside one grad-norm reading, two adjacent outliers that come straight back
"""

from __future__ import annotations

import csv
import io

import logsynth as ls  # noqa: F401  (the classes below use both generators)
import logsynth_formats as lf  # noqa: F401
import numpy as np
import pytest

from ciuic_doctor.analysis.stability import analyze_log
from ciuic_doctor.importers import load


def judged(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    log = load(path)
    return log, analyze_log(log)


def raised(findings, check):
    return [f for f in findings if f.check == check and f.verdict in ("warn", "fail")]


def one(findings, check):
    [finding] = [f for f in findings if f.check == check]
    return finding


def decay(n: int, start: float, floor: float, *, noise: float, seed: int, tau: float = 300.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n, dtype=float)
    return (floor + (start - floor) * np.exp(-t / tau)) * np.exp(rng.normal(0, noise, n))


# ---- 4. a Lightning CSV without `train_loss` --------------------------------------------------------


def lightning_components(n: int, *, total: str | None) -> tuple[str, int]:
    """A per-batch CSV with a small auxiliary loss (its own blip at step 150) and the main loss (a spike at
    step 600 that lasts); `total` names a column that is their sum (None: no total logged)."""
    main = decay(n, 6.0, 2.0, noise=0.01, seed=4, tau=150)
    main[600:640] *= 1.9
    aux = 0.05 * np.exp(np.random.default_rng(5).normal(0, 0.01, n))
    aux[150] *= 6
    rows = []
    for i in range(n):
        row = {
            "epoch": 0,
            "step": i,
            "train_aux_loss": repr(float(aux[i])),
            "train_ce_loss": repr(float(main[i])),
        }
        if total:
            row[total] = repr(float(main[i] + aux[i]))
        rows.append(row)
    header = sorted({key for row in rows for key in row})
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue(), 600


@pytest.mark.parametrize("total", [None, "train_sum_loss", "total_loss"])
def test_lightning_takes_the_total_loss_not_the_first_component(tmp_path, total):
    text, spike_step = lightning_components(1000, total=total)
    log, findings = judged(tmp_path, "metrics.csv", text)
    assert log.table["loss"].median() > 1.0  # the main/total loss, not the 0.05 auxiliary one
    [spike] = raised(findings, "loss_spike")
    assert spike.where["step"] == spike_step
