"""One test per class of mistake the doctor made on real logs (issue 12), each on a generated log that has
it: the engine's start line, several engines, the scaler's configured window, rounded values, short logs,
placeholders, an imported log as a run directory, mixed runs, the import summary, benign outliers, and the
two formats people paste in bug reports (nanoGPT, word_language_model)."""

from __future__ import annotations

import json

import logsynth as ls
import numpy as np
import pytest
from conftest import run_cli

from ciuic_doctor.analysis.stability import analyze_log
from ciuic_doctor.importers import load, sniff


def raised(findings, check):
    return [f for f in findings if f.check == check and f.verdict in ("warn", "fail")]


def one(findings, check):
    [found] = [f for f in findings if f.check == check]
    return found


def judged(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    log = load(path)
    return log, analyze_log(log)


# ---- 1. DeepSpeed's start line ------------------------------------------------------------------------


def test_engine_start_line_does_not_hide_the_calibration(tmp_path):
    run = ls.make_run(2000, seed=101, scaler="deepspeed")
    _, plain = judged(tmp_path, "plain.log", ls.deepspeed_log(run))
    log, started = judged(tmp_path, "started.log", ls.deepspeed_log(run, start_line=True))
    assert log.table["step"].min() == 10  # the start line is the count's origin, not a row
    ev = one(started, "loss_scaler").evidence
    assert ev["calibration_skipped"] == one(plain, "loss_scaler").evidence["calibration_skipped"] == 4
    assert ev["initial_scale"] == 65536  # what the first overflow attempted, not a later scale
    assert raised(started, "overflow_storm") == []
    assert one(started, "loss_scaler").verdict == "pass"


# ---- 2. several engines in one log --------------------------------------------------------------------


def test_two_engines_are_two_series_judged_apart(tmp_path):
    actor = ls.make_run(600, seed=102, scaler="deepspeed", peak_lr=1e-5, safe_scale=2.0**10, warmup=100)
    critic = ls.make_run(600, seed=103, scaler="deepspeed", peak_lr=5e-6, safe_scale=2.0**12, warmup=100)
    text = ls.deepspeed_engines_log({"actor": actor, "critic": critic})
    log, findings = judged(tmp_path, "step3.log", text)
    assert log.engines == 2
    assert log.series_names == ["actor", "critic"]
    table = log.table
    for k, run in enumerate((actor, critic)):
        rows = table[table["series"] == k]
        assert len(rows) == 60  # every step= line of each engine, none dropped
        assert rows["skipped"].sum() == run.skipped.sum()  # each engine's own overflows
    scaler = one(findings, "loss_scaler")
    assert scaler.verdict == "pass", scaler.summary
    assert set(scaler.evidence["series"]) == {"actor", "critic"}
    assert scaler.evidence["series"]["actor"]["calibration_skipped"] == 7  # hysteresis + 64Ki -> 1Ki
    assert scaler.evidence["series"]["critic"]["calibration_skipped"] == 5
    assert raised(findings, "overflow_storm") == []
    assert "2 engines (actor, critic)" in one(findings, "log_import").summary


# ---- 3. the scaler's configured window ----------------------------------------------------------------


@pytest.mark.parametrize("printed", [True, False])
def test_skips_at_the_configured_window_are_the_scaler_working(tmp_path, printed):
    run = ls.make_run(3000, seed=104, scaler="deepspeed", scaler_window=100)
    after = int(run.skipped[10:].sum())
    assert after > 40  # two skips every ~100 steps: 2 % of the steps
    config = {"scale_window": 100} if printed else None
    _, findings = judged(tmp_path, "ds.log", ls.deepspeed_log(run, config=config))
    scaler = one(findings, "loss_scaler")
    assert scaler.verdict == "pass", scaler.summary
    assert scaler.evidence["suggest_bf16"] is False
    assert (
        scaler.evidence["config"]["window_steps"] == 100
        if printed
        else 90 <= scaler.evidence["config"]["window_steps"] <= 110
    )
    assert scaler.evidence["config"]["source"]["window_steps"] == ("log" if printed else "inferred")
    assert scaler.evidence["config"]["hysteresis"] == 2
    assert "probing as configured" in scaler.summary
    assert raised(findings, "overflow_storm") == []


def test_skips_far_above_the_configured_rate_still_warn(tmp_path):
    run = ls.make_run(3000, seed=105, scaler="deepspeed", scaler_window=100,
                      storms=((1000, 6, 15), (2000, 6, 15)))  # fmt: skip
    _, findings = judged(tmp_path, "ds.log", ls.deepspeed_log(run, config={"scale_window": 100}))
    assert one(findings, "loss_scaler").verdict == "warn"
    storms = [f.where["step"] for f in raised(findings, "overflow_storm")]
    assert len(storms) == 2  # (a storm may start at the probe's own skips just before it)
    assert all(abs(got - want) <= 30 for got, want in zip(storms, (1000, 2000), strict=True))


# ---- 4. rounded values --------------------------------------------------------------------------------


def test_rounded_losses_near_zero_are_not_spikes(tmp_path):
    run = ls.make_run(2000, seed=106, start=0.0006, floor=0.0001, noise=0.3)
    log, findings = judged(tmp_path, "trainer_state.json", ls.hf_state(run, logging_steps=10))
    values = set(np.round(log.table["loss"].dropna(), 4))
    assert values <= {0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.0006, 0.0007, 0.0008, 0.0009, 0.001}
    assert raised(findings, "loss_spike") == []
    assert raised(findings, "divergence") == []
    assert all(f.verdict != "fail" for f in findings)


# ---- 5. short logs --------------------------------------------------------------------------------------


def short_run(n: int, loss: np.ndarray) -> ls.Run:
    run = ls.make_run(n, seed=107)
    run.loss = loss
    return run


def test_short_log_that_climbs_has_diverged(tmp_path):
    loss = np.geomspace(11.65, 20.44, 62) * np.exp(np.random.default_rng(1).normal(0, 0.01, 62))
    _, findings = judged(tmp_path, "train.log", ls.megatron_log(short_run(62, loss)))
    div = one(findings, "divergence")
    assert div.verdict == "fail", div.summary
    assert "did not diverge" not in div.summary


def test_spike_in_the_first_points_of_a_short_log(tmp_path):
    rng = np.random.default_rng(2)
    loss = np.geomspace(12.4, 7.8, 49) * np.exp(rng.normal(0, 0.01, 49))
    loss[2:12] *= np.linspace(3.3, 1.1, 10)  # 12.4 -> 41 at the third point, back by the 13th
    _, findings = judged(tmp_path, "train.log", ls.megatron_log(short_run(49, loss)))
    [spike] = raised(findings, "loss_spike")
    assert spike.where["step"] == 3
    assert spike.verdict == "warn"
    assert raised(findings, "divergence") == []


def test_too_short_to_judge_says_not_run_with_the_reason(tmp_path):
    loss = np.linspace(10.0, 9.0, 12)
    _, findings = judged(tmp_path, "train.log", ls.megatron_log(short_run(12, loss)))
    div = one(findings, "divergence")
    assert (div.verdict, div.summary) == ("not_run", "too short: 12 loss points (need 16)")
    assert one(findings, "loss_spike").verdict == "pass"  # 12 points: judged with the whole-log σ
    _, tiny = judged(tmp_path, "tiny.log", ls.megatron_log(short_run(5, np.linspace(10.0, 9.0, 5))))
    assert one(tiny, "loss_spike").verdict == "not_run"
    assert "too short: 5" in one(tiny, "loss_spike").summary


# ---- 6. placeholders and label variants -----------------------------------------------------------------


def test_pipeline_engine_lm_loss_and_placeholders(tmp_path):
    run = ls.make_run(300, seed=108)
    log, findings = judged(tmp_path, "pipe.out", ls.megatron_pipeline_log(run))
    assert int(log.table["loss"].notna().sum()) == 300  # `lm-loss:` read
    assert log.table["grad_norm"].isna().all()  # `grad norm: 0.000` is not a value
    assert log.table["loss_scale"].isna().all()  # nor is `loss scale: -1.0`
    clipping = one(findings, "clipping")
    assert (clipping.verdict, clipping.summary) == ("not_run", "no grad norm in this log")
    assert one(findings, "loss_scaler").verdict == "not_run"
    assert "fp16" in one(findings, "loss_scaler").summary
    assert log.scaler == {"hysteresis": 2, "window_steps": 1000, "source": "log"}


# ---- 7. an imported log is a run directory --------------------------------------------------------------


@pytest.mark.slow
def test_imported_log_reports_and_reanalyses_like_a_run(tmp_path):
    run = ls.make_run(1500, seed=109, scaler="megatron", spikes=((800, 2.0, 30),))
    log_path = tmp_path / "train.log"
    log_path.write_text(ls.megatron_log(run))
    out = tmp_path / "imported"
    done = run_cli("stability", str(log_path), "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    direct = {(f["check"], f["verdict"], f["summary"]) for f in json.loads(done.stdout)}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"]["import"]["formats"] == {str(log_path): "megatron"}
    assert (out / "steps.jsonl").is_file()
    done = run_cli("analyze", str(out), "--json")
    again = {
        (f["check"], f["verdict"], f["summary"]) for f in json.loads(done.stdout) if f["probe"] == "stability"
    }
    assert again == direct
    done = run_cli("report", "--reanalyze", str(out), "--quiet")
    assert done.returncode == 0, done.stderr
    html = (out / "report.html").read_text()
    assert "loss, grad norm and loss scale with spikes" in html
    kept = json.loads((out / "findings.json").read_text())["findings"]
    assert [f["where"]["step"] for f in kept if f["check"] == "loss_spike" and f["verdict"] == "warn"] == [
        800
    ]


# ---- 8 and 9. several paths, and the import summary ----------------------------------------------------


def test_separate_runs_are_not_merged_into_a_divergence(tmp_path):
    low = ls.make_run(1500, seed=110, start=4.0, floor=1.0)
    high = ls.make_run(1500, seed=111, start=11.0, floor=6.0)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "trainer_state.json").write_text(ls.hf_state(low))
    (tmp_path / "b" / "trainer_state.json").write_text(ls.hf_state(high))
    log = load([tmp_path / "a" / "trainer_state.json", tmp_path / "b" / "trainer_state.json"])
    assert sorted(log.table["series"].unique()) == [0, 1]
    findings = analyze_log(log)
    assert raised(findings, "divergence") == []
    imported = one(findings, "log_import")
    assert imported.verdict == "warn"
    assert "separate run" in imported.summary


def test_resumed_run_in_two_files_is_one_run(tmp_path):
    run = ls.make_run(3000, seed=112)
    text = ls.lightning_csv(run).splitlines()
    header, rows = text[0], text[1:]
    half = len(rows) // 2
    (tmp_path / "v0").mkdir()
    (tmp_path / "v1").mkdir()
    (tmp_path / "v0" / "metrics.csv").write_text("\n".join([header, *rows[:half]]) + "\n")
    (tmp_path / "v1" / "metrics.csv").write_text("\n".join([header, *rows[half:]]) + "\n")
    log = load([tmp_path / "v0", tmp_path / "v1"])
    assert set(log.table["series"].unique()) == {0}
    findings = analyze_log(log)
    assert one(findings, "log_import").verdict == "pass"
    assert "one resumed run" in log.notes[0]
    assert [f for f in findings if f.verdict in ("warn", "fail")] == []


def test_different_formats_are_kept_apart(tmp_path):
    run = ls.make_run(1500, seed=113, scaler="megatron")
    (tmp_path / "train.log").write_text(ls.megatron_log(run))
    (tmp_path / "trainer_state.json").write_text(
        ls.hf_state(ls.make_run(1500, seed=114, start=3.0, floor=1.0))
    )
    log = load([tmp_path / "train.log", tmp_path / "trainer_state.json"])
    assert "formats differ" in " ".join(log.notes)
    assert one(analyze_log(log), "log_import").verdict == "warn"


def test_json_carries_the_import_summary(tmp_path):
    actor = ls.make_run(300, seed=115, scaler="deepspeed", peak_lr=1e-5)
    critic = ls.make_run(300, seed=116, scaler="deepspeed", peak_lr=5e-6)
    path = tmp_path / "rlhf.log"
    path.write_text(ls.deepspeed_engines_log({"actor": actor, "critic": critic}))
    done = run_cli("stability", str(path), "--json")
    assert done.returncode == 0, done.stderr
    [imported] = [f for f in json.loads(done.stdout) if f["check"] == "log_import"]
    ev = imported["evidence"]
    assert ev["formats"] == {str(path): "deepspeed"}
    assert (ev["rows"], ev["engines"], ev["series"]) == (60, 2, ["actor", "critic"])
    assert 0 < ev["unread_lines"] < ev["read_lines"]  # the PPO loss lines are not step records


# ---- 10. benign outliers --------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_led", [False, True])
def test_short_outliers_without_a_grad_norm_lead_are_one_calm_finding(tmp_path, grad_led):
    outliers = tuple(range(1000, 2600, 200))  # 8 of them
    run = ls.make_run(
        3000, seed=117, noise=0.08, grad_spikes=tuple((s - 3, 6.0) for s in outliers) if grad_led else ()
    )
    run.loss[np.array(outliers) - 1] *= 2.2  # one step each, back the next
    _, findings = judged(tmp_path, "trainer_state.json", ls.hf_state(run, logging_steps=1))
    if grad_led:  # a grad-norm spike before each: instability the grad norm saw coming, one warning each
        assert [f.where["step"] for f in raised(findings, "loss_spike")] == list(outliers)
        return
    assert raised(findings, "loss_spike") == []
    calm = one(findings, "loss_outliers")
    assert calm.verdict == "pass"
    assert calm.evidence["count"] == 8
    assert calm.evidence["steps"] == list(outliers)
    assert "hard batches" in calm.summary


# ---- logs people paste in bug reports ------------------------------------------------------------------


def test_nanogpt_stdout_is_sniffed_and_judged(tmp_path):
    run = ls.make_run(2000, seed=118, spikes=((1200, 2.5, 40),))
    path = tmp_path / "out.txt"
    path.write_text(ls.nanogpt_log(run))
    assert sniff(path) == "nanogpt"
    findings = analyze_log(load(path))
    assert [f.where["step"] for f in raised(findings, "loss_spike")] == [1200]


def test_word_language_model_nan_is_a_dead_run(tmp_path):
    run = ls.make_run(6000, seed=119, nan_steps=tuple(range(150, 6001)))
    path = tmp_path / "notes.md"
    path.write_text(ls.wordlm_log(run))
    assert sniff(path) == "wordlm"
    log = load(path)
    assert log.table["step"].tolist()[:2] == [200, 400]
    findings = analyze_log(log)
    assert one(findings, "nonfinite_loss").verdict == "fail"
    assert one(findings, "divergence").verdict == "fail"


def test_a_progress_line_printed_twice_is_not_a_second_engine(tmp_path):
    run = ls.make_run(600, seed=120, scaler="deepspeed")
    lines = ls.deepspeed_log(run).splitlines()
    doubled = [x for line in lines for x in ([line, line] if "step=" in line else [line])]
    log, findings = judged(tmp_path, "twice.log", "\n".join(doubled) + "\n")
    assert log.engines == 1
    assert log.table["skipped"].sum() == run.skipped.sum()
    assert one(findings, "loss_scaler").verdict == "pass"


def test_engines_without_names_in_the_log_are_numbered(tmp_path):
    actor = ls.make_run(300, seed=121, scaler="deepspeed", peak_lr=1e-5)
    critic = ls.make_run(300, seed=122, scaler="deepspeed", peak_lr=5e-6)
    text = ls.deepspeed_engines_log({"actor": actor, "critic": critic}).split("\n", 1)[1]  # no command line
    log, findings = judged(tmp_path, "anon.log", text)
    assert log.series_names == ["engine 0", "engine 1"]
    assert "engine 0: " in one(findings, "loss_scaler").summary


def test_each_optimizer_of_a_watched_script_is_its_own_series(tmp_path):
    """watch records a step per optimizer (a GAN's D at loss ~0.7 and G at ~2.5, issue 13): merged into one
    curve they would alternate 3.6x every step; judged apart, only G's one-step spike at 120 is found."""
    from ciuic_doctor.analysis import stability
    from ciuic_doctor.rundir.store import RunDir

    rng = np.random.default_rng(0)
    run = RunDir.create(tmp_path / "gan")
    with run.writer("steps", rank=0, per_rank_file=True) as steps:
        for step in range(1, 201):
            for optimizer, level in enumerate((0.7, 2.5)):
                loss = level * (1 + 0.05 * rng.standard_normal()) + (
                    20.0 if (optimizer, step) == (1, 120) else 0
                )
                steps.write(
                    {"step": step, "loss": loss, "lr": 2e-4, "grad_norm": 1.0, "optimizer": optimizer}
                )
    findings = {f.check: f for f in stability.analyze(run)}
    spike = findings["loss_spike"]
    assert spike.verdict == "warn"
    assert spike.where["step"] == 120
    assert spike.where["series"] == ["optimizer 1"]
    assert findings["divergence"].where["series"] == ["optimizer 0", "optimizer 1"]
    # ...and the report draws them as two curves, not one interleaved line
    from ciuic_doctor.report import plots

    svg = plots.stability_plot(run.read("steps").records, list(findings.values()))
    assert "optimizer 0" in svg
    assert "optimizer 1" in svg
