"""Analyses: pure functions from a run directory's records to findings.

Each module here judges one probe's streams and exposes

    STREAMS: tuple[str, ...]                 the streams it reads (it runs when any is present)
    def analyze(run: RunDir) -> list[Finding]

`run_all` discovers the modules, runs those whose streams exist, and writes findings.json. A new
analysis is a new module; nothing here changes.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from types import ModuleType

from ciuic_doctor.findings import Finding, sort_findings
from ciuic_doctor.store import RunDir

FINDINGS_FILE = "findings.json"


def analysis_modules() -> list[ModuleType]:
    return [
        importlib.import_module(f"{__name__}.{info.name}")
        for info in pkgutil.iter_modules(__path__)
        if not info.name.startswith("_")
    ]


def run_all(run: RunDir) -> list[Finding]:
    """Every applicable analysis on `run`; findings.json is written and the findings returned."""
    findings: list[Finding] = []
    ran: list[str] = []
    for module in analysis_modules():
        if any(run.has_stream(stream) for stream in module.STREAMS):
            findings.extend(module.analyze(run))
            ran.append(module.__name__.rsplit(".", 1)[-1])
    findings = sort_findings(findings)
    run.write_json(
        FINDINGS_FILE,
        {"schema": 1, "created": time.time(), "analyses": ran, "findings": [f.to_dict() for f in findings]},
    )
    return findings


def load_findings(run: RunDir) -> list[Finding]:
    """findings.json of `run` (empty when it was never analysed)."""
    path = run.path / FINDINGS_FILE
    if not path.exists():
        return []
    return [Finding.from_dict(d) for d in run.read_json(FINDINGS_FILE).get("findings", [])]
