"""The stability doctor on realistic logs in every format: planted events found at their step, clean runs
clean, real fp16 overflow from the embedded job in test_stability_job.py."""

from __future__ import annotations

import json
import math

import logsynth as ls
import numpy as np
import pytest
from conftest import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic_doctor.analysis.stability import analyze_log
from ciuic_doctor.importers import load, normalize
from ciuic_doctor.rundir.findings import Finding

N = 2000
SCALER = {"ours": "gradscaler", "megatron": "megatron", "megatron10": "megatron", "deepspeed": "deepspeed"}
INTERVAL = {"megatron10": 10, "hf": 10, "lightning": 10, "deepspeed": 10}


def write(tmp_path, kind: str, run: ls.Run):
    """`run` as the file(s) `kind` would leave behind; returns the path to give the importer."""
    if kind == "ours":
        return ls.write_ours(tmp_path / "run", run, ranks=2).path
    writers = {
        "megatron": ("train.log", lambda: ls.megatron_log(run)),
        "megatron10": (
            "train.log",
            lambda: ls.megatron_log(run, interval=10, variant="old", timestamps=False),
        ),
        "deepspeed": ("ds.log", lambda: ls.deepspeed_log(run)),
        "hf": ("trainer_state.json", lambda: ls.hf_state(run, logging_steps=10)),
        "lightning": ("metrics.csv", lambda: ls.lightning_csv(run, every=10)),
    }
    name, text = writers[kind]
    path = tmp_path / name
    path.write_text(text())
    return path


def row_step(kind: str, step: int) -> int:
    """The step label of the logged row that covers optimizer step `step` in `kind`'s log."""
    interval = INTERVAL.get(kind, 1)
    end = math.ceil(step / interval) * interval
    return end - 1 if kind == "lightning" else end  # Lightning logs the 0-based global_step


def findings_for(tmp_path, kind: str, run: ls.Run, **kwargs) -> list[Finding]:
    return analyze_log(load(write(tmp_path, kind, run)), **kwargs)


def raised(findings: list[Finding], check: str | None = None) -> list[Finding]:
    return [f for f in findings if f.verdict in ("warn", "fail") and (check is None or f.check == check)]


def one(findings: list[Finding], check: str) -> Finding:
    [found] = [f for f in findings if f.check == check]
    return found


# ---- clean runs: nothing raised ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ours", "megatron", "megatron10", "deepspeed", "hf", "lightning"])
@pytest.mark.parametrize(("seed", "noise"), [(21, 0.01), (22, 0.05)])
def test_clean_run_raises_nothing(tmp_path, kind, seed, noise):
    run = ls.make_run(N, seed=seed, noise=noise, scaler=SCALER.get(kind))
    findings = findings_for(tmp_path, kind, run)
    assert raised(findings) == []
    ran = {f.check for f in findings if f.verdict == "pass"}
    if kind != "deepspeed":
        assert {"loss_spike", "divergence", "nonfinite_loss"} <= ran
    if kind in SCALER:
        assert {"loss_scaler", "overflow_storm", "scale_collapse"} <= ran


def test_clean_run_with_gaps_and_a_restart_raises_nothing(tmp_path):
    run = ls.make_run(N, seed=23, scaler="megatron")
    lines = ls.megatron_log(run).splitlines()
    kept = [line for line in lines if not any(f"iteration {s:8d}/" in line for s in range(700, 1000))]
    restart = [line for line in lines if any(f"iteration {s:8d}/" in line for s in range(1400, 1450))]
    (tmp_path / "a.log").write_text("\n".join(kept[: len(kept) // 2]) + "\n")
    (tmp_path / "b.log").write_text("\n".join(restart + kept[len(kept) // 2 :]) + "\n")
    log = load([tmp_path / "a.log", tmp_path / "b.log"])
    assert raised(analyze_log(log)) == []


# ---- spikes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ours", "megatron", "megatron10", "hf", "lightning"])
def test_planted_spikes_found_at_their_step(tmp_path, kind):
    run = ls.make_run(
        N, seed=31, spikes=((700, 2.0, 40), (1500, 1.6, 3)), grad_led=5, scaler=SCALER.get(kind)
    )
    findings = findings_for(tmp_path, kind, run)
    spikes = raised(findings, "loss_spike")
    assert [f.where["step"] for f in spikes] == [row_step(kind, 700), row_step(kind, 1500)]
    slow, sharp = spikes
    assert slow.verdict == "warn"
    assert slow.evidence["recovered_after_steps"] > sharp.evidence["recovered_after_steps"]
    assert slow.evidence["magnitude"] > 1.3
    assert slow.evidence["peak"] > slow.evidence["baseline"]
    if kind in ("ours", "megatron"):  # a per-step grad norm: its spike 5 steps earlier is seen leading
        assert [f.evidence["grad_norm_led"] for f in spikes] == [True, True]
        grad = [f.where["step"] for f in raised(findings, "grad_norm_spike")]
        assert grad == [695, 1495]
    assert raised(findings, "divergence") == []


def test_loss_spike_without_grad_norm_spike_is_not_grad_led(tmp_path):
    run = ls.make_run(N, seed=32, spikes=((900, 1.8, 20),))
    [spike] = raised(findings_for(tmp_path, "megatron", run), "loss_spike")
    assert spike.evidence["grad_norm_led"] is False
    assert spike.where["step"] == 900


def test_spike_during_warmup_and_on_a_noisy_high_loss_curve(tmp_path):
    run = ls.make_run(N, seed=33, start=11.0, floor=6.0, noise=0.06, spikes=((120, 2.5, 10), (1300, 2.2, 30)))
    spikes = raised(findings_for(tmp_path, "megatron", run), "loss_spike")
    assert [f.where["step"] for f in spikes] == [120, 1300]


def test_unrecovered_spike_fails(tmp_path):
    run = ls.make_run(N, seed=34, spikes=((1985, 2.0, 10**6),))
    [spike] = raised(findings_for(tmp_path, "megatron", run), "loss_spike")
    assert spike.verdict == "fail"
    assert spike.evidence["recovered_after_steps"] is None
    assert spike.where["step"] == 1985


def test_interleaved_ranks_report_one_spike(tmp_path):
    run = ls.make_run(N, seed=35, spikes=((1100, 2.0, 20),))
    a, b = (
        ls.megatron_log(run, prefix="[rank0]: ").splitlines(),
        ls.megatron_log(run, prefix="[rank4]: ").splitlines(),
    )
    path = tmp_path / "both.log"
    path.write_text("\n".join(line for pair in zip(a, b, strict=True) for line in pair) + "\n")
    spikes = raised(analyze_log(load(path)), "loss_spike")
    assert [f.where["step"] for f in spikes] == [1100]


# ---- divergence and non-finite losses -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ours", "megatron10", "hf"])
def test_divergence_found_at_its_onset(tmp_path, kind):
    run = ls.make_run(N, seed=41, diverge=1400, scaler=SCALER.get(kind))
    findings = findings_for(tmp_path, kind, run)
    [div] = raised(findings, "divergence")
    assert div.verdict == "fail"
    assert abs(div.where["step"] - 1400) <= 100
    assert div.evidence["ratio"] > 3
    assert raised(findings, "loss_spike") == []


def test_nan_loss_in_megatron_bf16_and_in_our_steps(tmp_path):
    run = ls.make_run(N, seed=42, nan_steps=(900, 1601))
    nonfinite = one(findings_for(tmp_path, "megatron10", run), "nonfinite_loss")
    assert nonfinite.verdict == "warn"
    assert nonfinite.where["step"] == 900
    assert nonfinite.evidence["steps"] == [900, 1610]
    ours = one(findings_for(tmp_path, "ours", run), "nonfinite_loss")
    assert ours.evidence["steps"] == [900, 1601]
    assert not ours.evidence["persistent"]


def test_run_that_ends_in_nan_fails_twice(tmp_path):
    run = ls.make_run(N, seed=43, nan_steps=tuple(range(1950, N + 1)))
    findings = findings_for(tmp_path, "hf", run)
    assert one(findings, "nonfinite_loss").verdict == "fail"
    div = one(findings, "divergence")
    assert div.verdict == "fail"
    assert div.where["step"] == 1950
    assert div.evidence["nonfinite_tail"] is True


# ---- loss scaler -----------------------------------------------------------------------------------


def test_gradscaler_calibration_and_advice(tmp_path):
    run = ls.make_run(N, seed=51, scaler="gradscaler")
    scaler = one(findings_for(tmp_path, "ours", run), "loss_scaler")
    ev = scaler.evidence
    assert scaler.verdict == "pass"
    assert (ev["calibration_steps"], ev["calibration_skipped"], ev["skipped_after_calibration"]) == (3, 3, 0)
    assert ev["steady_scale"] == 8192
    assert ev["suggested_init_scale"] == 8192
    assert ev["suggest_bf16"] is False
    assert ev["precision"] == "fp16"
    assert "init_scale=8192" in scaler.summary


def test_megatron_calibration_from_two_to_the_32(tmp_path):
    run = ls.make_run(N, seed=52, scaler="megatron")
    ev = one(findings_for(tmp_path, "megatron", run), "loss_scaler").evidence
    assert (ev["calibration_steps"], ev["calibration_skipped"]) == (20, 20)  # 1 hysteresis + 19 halvings
    assert ev["skipped_after_calibration"] == 2  # the growth attempt at ~1020 overflows twice (hysteresis 2)


@pytest.mark.parametrize("kind", ["ours", "megatron", "megatron10", "deepspeed"])
def test_overflow_storm_found_and_bf16_advised(tmp_path, kind):
    run = ls.make_run(N, seed=53, scaler=SCALER[kind], storms=((1200, 8, 5),))
    findings = findings_for(tmp_path, kind, run)
    [storm] = raised(findings, "overflow_storm")
    assert storm.where["step"] == row_step(kind, 1200)
    assert storm.evidence["skipped"] == 8
    assert storm.evidence["scale_after"] < storm.evidence["scale_before"]
    scaler = one(findings, "loss_scaler")
    assert scaler.verdict == "warn"
    assert scaler.evidence["suggest_bf16"] is True
    assert scaler.evidence["overflows_near_lr_peak"] is False
    assert raised(findings, "scale_collapse") == []


def test_storm_at_the_lr_peak_blames_the_lr(tmp_path):
    run = ls.make_run(N, seed=54, scaler="gradscaler", warmup=200, storms=((205, 8, 4),))
    scaler = one(findings_for(tmp_path, "ours", run), "loss_scaler")
    assert scaler.evidence["overflows_near_lr_peak"] is True
    assert "LR peak" in scaler.summary


@pytest.mark.parametrize("kind", ["ours", "megatron", "deepspeed"])
def test_scale_collapse_found(tmp_path, kind):
    run = ls.make_run(N, seed=55, scaler=SCALER[kind], collapse=1500)
    [truth] = run.truth["scale_collapse"]
    findings = findings_for(tmp_path, kind, run)
    collapse = one(findings, "scale_collapse")
    assert collapse.verdict == "fail"
    assert collapse.where["step"] == row_step(kind, truth)
    assert collapse.evidence["fatal"] is (kind == "deepspeed")
    assert one(findings, "loss_scaler").evidence["suggest_bf16"] is True


def test_bf16_megatron_has_no_scaler_to_judge(tmp_path):
    run = ls.make_run(N, seed=56)  # prints loss scale 1.0, as Megatron does for bf16
    findings = findings_for(tmp_path, "megatron", run)
    assert {f.verdict for f in findings if f.check in ("loss_scaler", "scale_collapse")} == {"not_run"}


# ---- clipping --------------------------------------------------------------------------------------


def test_clipping_judged_against_healthy_grad_norms(tmp_path):
    run = ls.make_run(N, seed=61, grad_spikes=((1300, 8.0),))
    log = load(write(tmp_path, "ours", run))  # meta.json says clip_max_norm = 1.0
    fine = one(analyze_log(log), "clipping")
    assert fine.verdict == "pass"
    assert fine.evidence["clip_max_norm"] == 1.0
    assert fine.evidence["suggested_max_norm"] == 1.0
    tight = one(analyze_log(log, clip_max_norm=0.2), "clipping")
    assert tight.verdict == "warn"
    assert tight.evidence["clipped_fraction"] > 0.9
    assert 0.45 < tight.evidence["suggested_max_norm"] < 0.8  # above 99 % of healthy steps (~0.35-0.6)
    loose = one(analyze_log(log, clip_max_norm=50.0), "clipping")
    assert loose.verdict == "warn"
    assert "above every spike" in loose.summary
    unknown = one(analyze_log(load(write(tmp_path, "megatron", run))), "clipping")
    assert unknown.verdict == "not_run"
    assert unknown.evidence["suggested_max_norm"] > 0


# ---- bad tables never crash the analysis -------------------------------------------------------------

values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -1.0, 1e-300, 1e300])
)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-5, 400), values, values, values, values, st.integers(0, 3), st.integers(0, 2)),
        max_size=300,
    )
)
def test_fuzz_analysis_on_arbitrary_tables(rows):
    columns = ["step", "loss", "lr", "grad_norm", "loss_scale", "skipped", "nonfinite"]
    data = {c: [r[i] for r in rows] for i, c in enumerate(columns)}
    from ciuic_doctor.importers import StepLog

    log = StepLog(table=normalize(data), min_scale=1.0, clip_max_norm=1.0)
    for finding in analyze_log(log):
        json.dumps(finding.to_dict(), allow_nan=True)
        assert finding.verdict in ("pass", "warn", "fail", "not_run")


# ---- the command -------------------------------------------------------------------------------------


def test_command_table_json_and_exit_codes(tmp_path):
    clean = write(tmp_path, "megatron", ls.make_run(N, seed=71, scaler="megatron"))
    done = run_cli("stability", str(clean))
    assert done.returncode == 0, done.stderr
    assert "read 2000 rows (megatron; steps 1..2000)" in done.stdout
    assert "loss_spike" in done.stdout
    diverged = tmp_path / "div"
    diverged.mkdir()
    path = write(diverged, "hf", ls.make_run(N, seed=72, diverge=1200))
    done = run_cli("stability", str(path), "--json")
    assert done.returncode == 1
    findings = json.loads(done.stdout)
    assert {tuple(sorted(f)) for f in findings} == {
        ("check", "evidence", "probe", "summary", "verdict", "where")
    }
    assert any(f["check"] == "divergence" and f["verdict"] == "fail" for f in findings)


def test_command_bad_input_is_one_line(tmp_path):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(256)) * 40)
    for args in (["--format", "tensorboard", str(garbage)], [str(garbage)], [str(tmp_path / "none.log")]):
        done = run_cli("stability", *args)
        assert done.returncode == 2
        assert "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    done = run_cli("stability", "--format", "tensorboard", str(garbage))
    assert "megatron, deepspeed, hf, lightning" in done.stderr


def test_command_out_merges_and_analyze_includes_stability(tmp_path):
    run = ls.make_run(N, seed=73, scaler="gradscaler", storms=((1000, 6, 4),))
    out = ls.write_ours(tmp_path / "run", run, ranks=1)
    other = {
        "probe": "comm",
        "check": "busbw",
        "verdict": "pass",
        "summary": "ok",
        "evidence": {},
        "where": {},
    }
    out.write_json("findings.json", {"schema": 1, "analyses": ["comm"], "findings": [other]})
    for _ in range(2):
        done = run_cli("stability", str(out.path), "--out", str(out.path))
        assert done.returncode == 0, done.stderr
    saved = out.read_json("findings.json")
    probes = [f["probe"] for f in saved["findings"]]
    assert probes.count("comm") == 1
    assert [f["check"] for f in saved["findings"]].count("overflow_storm") == 1
    assert set(saved["analyses"]) == {"comm", "stability"}
    done = run_cli("analyze", str(out.path), "--json")
    checks = {f["check"] for f in json.loads(done.stdout) if f["probe"] == "stability"}
    assert {"loss_spike", "overflow_storm", "loss_scaler", "clipping"} <= checks


def test_storm_window_counts_steps_not_rows():
    """Five skips in 100 steps is a storm whether the log has a row per step or per 50 steps."""
    table = normalize(
        {
            "step": np.arange(50, 2001, 50),
            "loss": np.full(40, 2.0),
            "loss_scale": np.full(40, 4096.0),
            "skipped": [0] * 20 + [3, 2] + [0] * 18,
            "interval_steps": np.full(40, 50),
        }
    )
    from ciuic_doctor.importers import StepLog

    [storm] = raised(analyze_log(StepLog(table=table, min_scale=1.0)), "overflow_storm")
    assert storm.where["step"] == 1050


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.one_of(st.none(), st.integers(0, 3)), st.integers(0, 6), st.floats(0.5, 9.0)),
        min_size=1,
        max_size=40,
    ),
    st.booleans(),
)
def test_fold_skips_drop_duplicates_only_when_no_rank_step_repeats(rows, in_order):
    """fold's shortcut (rows in (rank, step) order without repeats: nothing to drop) gives the curve
    drop_duplicates gives, on any rows: repeats (the later one wins), unsorted ranks, missing ranks."""
    from ciuic_doctor.analysis.stability import curve as _stability_curve

    if in_order:  # watch's own files: sorted by rank, then step, no repeats
        rows = sorted({(r, s): v for r, s, v in rows}.items(), key=lambda kv: (kv[0][0] is not None, kv[0]))
        rows = [(r, s, v) for (r, s), v in rows]
    table = normalize({"rank": [r for r, _, _ in rows], "step": [s for _, s, _ in rows],
                       "loss": [v for _, _, v in rows]})  # fmt: skip
    folded = _stability_curve.fold(table)
    reference = _stability_curve.fold(table.drop_duplicates(subset=["rank", "step"], keep="last"))
    for name in ("step", "loss", "interval", "skipped"):
        np.testing.assert_array_equal(getattr(folded, name), getattr(reference, name))
    assert folded.ranks == reference.ranks


def test_fold_keeps_the_later_of_a_repeated_step_even_in_order():
    """A step written twice in a row (a resumed rank re-running it) is one step, the later record's."""
    from ciuic_doctor.analysis.stability.curve import fold

    table = normalize({"rank": [0, 0, 0, 1, 1], "step": [1, 1, 2, 1, 2], "loss": [1.0, 3.0, 2.0, 5.0, 4.0]})
    curve = fold(table)
    assert curve.step.tolist() == [1, 2]
    assert curve.loss.tolist() == [4.0, 3.0]  # step 1: (3.0 + 5.0) / 2, the first 1.0 dropped
