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


def test_real_resumed_run_merges_and_a_different_run_does_not():
    """slm-training v5 resumes v0 (step 140749 after 140699, same loss level); v12 is another run."""
    v0, v5, v12 = (REAL / "lightning" / f"slm-training-{v}" / "metrics.csv" for v in ("v0", "v5", "v12"))
    resumed = load([v0, v5])
    assert set(resumed.table["series"].unique()) == {0}
    assert not any(f.verdict in ("warn", "fail") for f in analyze_log(resumed))
    mixed = load([v0, v12])
    assert sorted(mixed.table["series"].unique()) == [0, 1]
    findings = analyze_log(mixed)
    assert not raised(findings, "divergence")
    assert [f.verdict for f in findings if f.check == "log_import"] == ["warn"]


def test_real_engines_and_scaler_config_are_read():
    rlhf = load(REAL / "deepspeed" / "dschat-step3-rlhf.log")
    assert (rlhf.engines, rlhf.series_names) == (2, ["actor", "critic"])
    per_engine = rlhf.table.groupby("series")["skipped"].sum().tolist()
    assert per_engine == [7, 7]  # SOURCES.md: 7 skips each
    dpo = load(REAL / "deepspeed" / "dschat-step2-dpo-opt-350m.log")
    assert (dpo.scaler["window_steps"], dpo.scaler["hysteresis"]) == (100, 2)
    assert dpo.table["step"].min() == 10  # the `step=0, skipped=0` start line is not a row
    [scaler] = [f for f in analyze_log(dpo) if f.check == "loss_scaler"]
    assert scaler.evidence["initial_scale"] == 65536  # where the log starts, not where it settled
    assert scaler.evidence["calibration_skipped"] == 4


def test_real_storm_gives_the_scale_the_log_shows():
    """DeepSpeed grows the scale silently: the storm starts from the 512 its first overflow attempted
    (SOURCES.md: 'scale 512 -> 8'), not from the 64 the last overflow before it left."""
    [storm] = raised(analyze_log(load(REAL / "deepspeed" / "dschat-step2-rm-opt-350m.log")), "overflow_storm")
    assert (storm.evidence["scale_before"], storm.evidence["scale_after"]) == (512, 8)
