"""The stability doctor on real public training logs (../shared/real-logs/), each judged by a person.

labels.json says per file what the doctor must find (`must`: a check raised at a step, within `tol`),
must not raise (`must_not`: no warn/fail of that check), must not warn on (`not_warn`), at most how many
warnings of a check (`max_warn`), `no_fail` (exit 0), the least rows it must read (`loss_rows_min`), and
`clean_error_or` (a clean one-line error, or one of these checks raised). The files are not copied into
the project: the tests skip where ../shared is absent, as on a user's clone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ciuic_doctor.analysis.stability import analyze_log
from ciuic_doctor.errors import UserError
from ciuic_doctor.importers import load

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "real-logs"
LABELS = json.loads((REAL / "labels.json").read_text()) if (REAL / "labels.json").is_file() else {}
pytestmark = pytest.mark.skipif(not LABELS, reason="../shared/real-logs is not here (a user's clone)")


def raised(findings, check):
    return [f for f in findings if f.check == check and f.verdict in ("warn", "fail")]


@pytest.mark.parametrize("name", sorted(LABELS) or ["none"])
def test_real_log_judged_as_a_person_judged_it(name):
    label = LABELS[name]
    path = REAL / name
    if "clean_error_or" in label:  # a format the tool may not claim: a clean error is an answer too
        try:
            log = load(path)
        except UserError:
            return
    else:
        log = load(path)
    findings = analyze_log(log)
    table = "\n".join(f"{f.verdict} {f.check} {f.where} {f.summary}" for f in findings)
    for want in label.get("must", []):
        hits = raised(findings, want["check"])
        steps = [f.where.get("step") for f in hits]
        assert any(abs(s - want["step"]) <= want["tol"] for s in steps if s is not None), f"{want}\n{table}"
    for check in label.get("must_not", []):
        assert not raised(findings, check), f"{name}: {check} raised\n{table}"
    for check in label.get("not_warn", []):
        assert not raised(findings, check), f"{name}: {check} warned\n{table}"
    for check, most in label.get("max_warn", {}).items():
        assert len(raised(findings, check)) <= most, f"{name}: {check}\n{table}"
    if label.get("no_fail"):
        assert all(f.verdict != "fail" for f in findings), table
    if "loss_rows_min" in label:
        assert int(log.table["loss"].notna().sum()) >= label["loss_rows_min"], table
    if "clean_error_or" in label:
        assert any(raised(findings, c) for c in label["clean_error_or"]), table
    assert all(f.verdict in ("pass", "warn", "fail", "not_run") for f in findings)
