"""Property-based fuzz of every stream's records and of meta.json: analyze and report never raise, and
every record that breaks its stream's schema is counted and named (issue 11: 42 crash sites before).

Each example replaces or deletes single fields of a few records of the base run (tests/fuzzkit.py) with
hostile JSON (wrong types, NaN/inf strings, huge integers, nested containers) and analyses the run.
benchmarks/fuzz_soak.py runs the same properties with many more examples.
"""

from __future__ import annotations

import pytest
from fuzzkit import BASE, BASE_META, DELETE, FILES, assert_counted, fields_of, write_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ciuic_doctor.analysis import run_all
from ciuic_doctor.report import build_report
from ciuic_doctor.rundir.store import RunDir

FUZZ_EXAMPLES = 100  # analyze: ~0.08 s each alone, 1 s under load; benchmarks/fuzz_soak.py runs thousands
REPORT_EXAMPLES = 4  # report renders every plot: ~1 s each alone, 15 s under load

hostile_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["nan", "inf", "-inf", "", "x", "1e308", "<script>", "0", "-1"])
    | st.text(max_size=8)
)
hostile_value = st.recursive(
    hostile_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def mutations(draw):
    """[(file, record index, field, new value or DELETE)], one to four of them."""
    out = []
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        name = draw(st.sampled_from(FILES))
        index = draw(st.integers(min_value=0, max_value=len(BASE[name]) - 1))
        field = draw(st.sampled_from(fields_of(name, index)))
        out.append((name, index, field, draw(st.one_of(st.just(DELETE), hostile_value))))
    return out


FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # CI sees the same examples every run; the soak script explores
)


@pytest.mark.slow
@FUZZ
@given(changes=mutations())
def test_analyze_never_raises_and_counts_every_bad_record(tmp_path, changes):
    folder = tmp_path / "run"
    invalid = write_run(folder, changes)
    run = RunDir.open(folder)
    findings = run_all(run)
    assert_counted(run, invalid, findings)
    assert all(f.verdict in ("pass", "warn", "fail", "not_run") for f in findings)
    assert [f.summary for f in findings if f.check == "analysis_error"] == []


meta_values = st.dictionaries(
    st.sampled_from(["run", "created", "env", "spec", "probes", "tool", "checkup", "job", "source", "x"]),
    hostile_value,
    max_size=4,
)


@pytest.mark.slow
@settings(FUZZ, max_examples=REPORT_EXAMPLES)
@given(changes=mutations(), meta_patch=meta_values)
def test_report_never_raises_on_bad_records_and_meta(tmp_path, changes, meta_patch):
    folder = tmp_path / "run"
    meta = {**BASE_META, **meta_patch}
    invalid = write_run(folder, changes, meta=meta)
    result = build_report(RunDir.open(folder), analyze=True)
    assert (folder / "report.html").is_file()
    assert_counted(RunDir.open(folder), invalid, result.findings)


@pytest.mark.parametrize(
    "meta_text",
    ["[1, 2]", "{", '"x"', '{"probes": [1], "env": {"cpu": 3, "devices": 5}, "spec": 7}', ""],
)
def test_analyze_survives_a_malformed_meta_json(tmp_path, meta_text):
    folder = tmp_path / "run"
    write_run(folder, [])
    (folder / "meta.json").write_text(meta_text)
    findings = run_all(RunDir.open(folder))
    assert [f.summary for f in findings if f.check == "analysis_error"] == []
    quality = [f for f in findings if f.check == "records_readable"]
    assert quality
    assert "meta.json" in quality[0].summary


def test_report_survives_a_malformed_meta_json(tmp_path):
    folder = tmp_path / "run"
    write_run(folder, [])
    (folder / "meta.json").write_text('{"probes": {"job": [1]}, "env": {"cpu": "x"}, "spec": {"optim": 3}}')
    result = build_report(RunDir.open(folder), analyze=True)
    assert (folder / "report.html").is_file()
    quality = [f for f in result.findings if f.check == "records_readable"]
    assert quality
    assert "meta.json" in quality[0].summary
