"""How every stability check writes its findings: probe "stability", evidence made JSON-friendly (numpy
scalars to Python, floats to 6 significant digits), and numbers short enough for a sentence.

Split from `stability/checks.py` so that the check modules (`stability.checks`, `stability.scaler_findings`)
share it from below.
"""

from __future__ import annotations

import math
from typing import Any

from ciuic_doctor.rundir.findings import Finding

PROBE = "stability"


def _finding(check: str, verdict: str, summary: str, evidence: dict | None = None, step: int | None = None):
    where = {"step": int(step)} if step is not None else {}
    return Finding(probe=PROBE, check=check, verdict=verdict, summary=summary,
                   evidence=_clean(evidence or {}), where=where)  # fmt: skip


def _clean(value: Any) -> Any:
    """JSON-friendly evidence: numpy scalars to Python, floats to 6 significant digits."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    return value


def _g(value: float) -> str:
    return f"{value:.4g}"


def _times(ratio: float) -> str:
    """A ratio for a sentence: 3 significant digits, so a 1e308 loss is "1e+308×", not 300 digits."""
    return f"{ratio:.3g}×"
