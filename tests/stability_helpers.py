"""What the stability test files share: a log judged end to end, and the findings a test looks at."""

from __future__ import annotations

import numpy as np

from ciuic_doctor.analysis.stability import analyze_log
from ciuic_doctor.importers import load


def judged(tmp_path, name: str, text: str):
    """(the imported log, its stability findings) of `text` written to tmp_path/name."""
    path = tmp_path / name
    path.write_text(text)
    log = load(path)
    return log, analyze_log(log)


def raised(findings, check):
    """The warn and fail findings of `check`."""
    return [f for f in findings if f.check == check and f.verdict in ("warn", "fail")]


def one(findings, check):
    """The one finding of `check` (a test fails when there are none or several)."""
    [finding] = [f for f in findings if f.check == check]
    return finding


def decay(n: int, start: float, floor: float, *, noise: float, seed: int, tau: float = 300.0) -> np.ndarray:
    """A loss curve: exponential decay from `start` to `floor`, with log-normal noise of σ `noise`."""
    rng = np.random.default_rng(seed)
    t = np.arange(n, dtype=float)
    return (floor + (start - floor) * np.exp(-t / tau)) * np.exp(rng.normal(0, noise, n))
