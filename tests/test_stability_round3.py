"""Issue 24: logs people already have, judged as a practitioner would (one constructed log per class, each
of the shape of a public log cited in the closing note), and the new formats.

The curves are made from the numbers a person read off the public logs (a 20-point Megatron log's 12.0 ->
22.5 -> 12.6; a fine-tune climbing 0.12 -> 0.33 over 450 steps while its LR warms up, then dropping at an
epoch boundary; ...), written in the format's own line shapes (tests/logsynth_formats.py).
"""

from __future__ import annotations

import json

import logsynth as ls
import logsynth_formats as lf
import numpy as np
import pytest
from stability_helpers import decay, judged, one, raised

from ciuic_doctor.analysis.stability.events import merge_events
from ciuic_doctor.analysis.stats.spikes import Spike
from ciuic_doctor.importers import sniff

# ---- 1. a spike at the second logged point -----------------------------------------------------------


def test_spike_at_the_second_point_of_a_short_megatron_log(tmp_path):
    loss = np.array([12.0, 22.5, 12.6, *np.linspace(12.3, 9.1, 17)])
    loss[3:] *= np.exp(np.random.default_rng(3).normal(0, 0.005, 17))
    run = lf.curve_run(np.repeat(loss, 10))  # every 10 iterations: each row the interval's mean
    _, findings = judged(tmp_path, "train.log", ls.megatron_log(run, interval=10))
    [spike] = raised(findings, "loss_spike")
    assert spike.where["step"] == 20
    assert spike.evidence["peak"] == pytest.approx(22.5)
    assert spike.verdict == "warn"  # back at once, before the run had learned anything


def test_a_falling_start_is_not_a_spike_at_the_second_point(tmp_path):
    loss = np.array([12.0, 10.9, 10.1, *np.linspace(9.8, 7.0, 17)])
    _, findings = judged(
        tmp_path, "train.log", ls.megatron_log(lf.curve_run(np.repeat(loss, 10)), interval=10)
    )
    assert raised(findings, "loss_spike") == []


# ---- 2. a slow divergence hidden by an epoch-boundary drop, seen in the eval loss too -------------------


def trainer_state(steps, loss, lr, grad, evals) -> str:
    history = [
        {
            "epoch": s / 550,
            "grad_norm": float(g),
            "learning_rate": float(r),
            "loss": round(float(v), 4),
            "step": int(s),
        }
        for s, v, r, g in zip(steps, loss, lr, grad, strict=True)
    ]
    history += [{"epoch": s / 550, "eval_loss": v, "eval_runtime": 3.1, "step": s} for s, v in evals]
    history.sort(key=lambda e: e["step"])
    history.append({"epoch": 1.1, "step": 600, "train_loss": 0.2, "train_runtime": 900.0})
    return json.dumps({"global_step": 600, "log_history": history, "max_steps": 600})


def climbing_fine_tune(eval_values):
    steps = np.arange(5, 601, 5)
    rng = np.random.default_rng(5)
    loss = np.where(steps <= 100, 0.5 - (0.38 * steps / 100), 0.12 + 0.21 * (steps - 100) / 450)
    loss = np.where(steps > 550, 0.18, loss) * np.exp(rng.normal(0, 0.03, len(steps)))  # the epoch boundary
    lr = 2e-5 * steps / 600  # still warming up at the end
    grad = 0.8 * np.exp(rng.normal(0, 0.1, len(steps)))
    evals = list(zip([100, 200, 300, 400, 500, 600], eval_values, strict=True))
    return trainer_state(steps, loss, lr, grad, evals)


def test_slow_climb_hidden_by_an_epoch_boundary_drop_is_a_divergence(tmp_path):
    log, findings = judged(
        tmp_path, "trainer_state.json", climbing_fine_tune([0.30, 0.25, 0.28, 0.38, 0.50, 0.55])
    )
    assert [s for s, _ in log.eval_loss] == [100, 200, 300, 400, 500, 600]
    div = one(findings, "divergence")
    assert div.verdict == "fail", div.summary
    assert "climbed" in div.summary
    assert "epoch boundary" in div.summary
    assert "warming up" in div.summary  # the LR was still rising during the climb
    assert div.evidence["eval"]["ratio"] == pytest.approx(2.2)
    assert 100 <= div.where["step"] <= 200


def test_eval_loss_rising_while_train_falls_is_a_warning_about_overfitting(tmp_path):
    steps = np.arange(10, 1001, 10)
    loss = decay(len(steps), 2.0, 0.4, noise=0.02, seed=6, tau=30)
    text = trainer_state(steps, loss, np.full(len(steps), 1e-5), np.full(len(steps), 0.7),
                         [(200, 1.1), (400, 0.9), (600, 1.2), (800, 1.45), (1000, 1.6)])  # fmt: skip
    _, findings = judged(tmp_path, "trainer_state.json", text)
    div = one(findings, "divergence")
    assert div.verdict == "warn", div.summary
    assert "overfitting" in div.summary


def test_flat_eval_and_a_healthy_curve_do_not_diverge(tmp_path):
    steps = np.arange(10, 1001, 10)
    loss = decay(len(steps), 2.0, 0.4, noise=0.02, seed=7, tau=30)
    text = trainer_state(steps, loss, np.full(len(steps), 1e-5), np.full(len(steps), 0.7),
                         [(200, 1.1), (400, 0.9), (600, 0.88), (800, 0.9), (1000, 0.91)])  # fmt: skip
    _, findings = judged(tmp_path, "trainer_state.json", text)
    assert one(findings, "divergence").verdict == "pass"


# ---- 3. grad-norm outliers the loss never answered: one calm finding -----------------------------------


def test_isolated_grad_norm_outliers_without_a_loss_response_are_one_calm_finding(tmp_path):
    n = 3000
    loss = decay(n, 10.9, 3.3, noise=0.03, seed=8, tau=200)
    rng = np.random.default_rng(8)
    grad = 0.3 * np.exp(rng.normal(0, 0.12, n))
    spikes = np.arange(250, n, 230)[:12]
    grad[spikes] *= rng.uniform(4, 8, len(spikes))
    run = lf.curve_run(loss, grad_norm=grad, lr=np.full(n, 6e-4))
    _, findings = judged(tmp_path, "main.log", lf.llmc_main_log(run))
    assert sniff(tmp_path / "main.log") == "llmc"
    assert raised(findings, "grad_norm_spike") == []
    calm = one(findings, "grad_norm_outliers")
    assert calm.verdict == "pass"
    assert calm.evidence["count"] >= 10
    assert raised(findings, "loss_spike") == []


def test_a_grad_norm_spike_the_loss_answers_still_warns(tmp_path):
    n = 3000
    loss = decay(n, 10.9, 3.3, noise=0.01, seed=9, tau=200)
    loss[1505:1520] *= 1.8
    grad = 0.3 * np.exp(np.random.default_rng(9).normal(0, 0.1, n))
    grad[1500] *= 8
    _, findings = judged(tmp_path, "main.log", lf.llmc_main_log(lf.curve_run(loss, grad_norm=grad)))
    assert [f.where["step"] for f in raised(findings, "grad_norm_spike")] == [1500]
    [spike] = raised(findings, "loss_spike")
    assert spike.evidence["grad_norm_led"] is True


# ---- 4. one small bump near the floor: one event, sized in nats -----------------------------------------


def test_merged_spikes_are_one_event():
    common = {"magnitude": 2.6, "points": 3}
    a = Spike(
        start_step=500,
        peak_step=502,
        peak=0.09,
        baseline=0.035,
        recovered_after_steps=4,
        end_step=503,
        **common,
    )
    b = Spike(
        start_step=505,
        peak_step=505,
        peak=0.158,
        baseline=0.06,
        recovered_after_steps=3,
        end_step=507,
        **common,
    )
    [(event, parts)] = merge_events([a, b], np.arange(0, 1000))
    assert parts == 2
    assert event.start_step == 500
    assert event.peak == 0.158
    assert event.magnitude == pytest.approx(0.158 / 0.035)
    assert event.recovered_after_steps == 8
    slow = Spike(start_step=100, peak_step=100, peak=6.0, baseline=3.0, recovered_after_steps=450,
                 end_step=549, magnitude=2.0, points=450)  # fmt: skip
    fresh = Spike(start_step=500, peak_step=500, peak=9.0, baseline=4.0, recovered_after_steps=200,
                  end_step=699, magnitude=2.25, points=200)  # fmt: skip
    assert [parts for _, parts in merge_events([slow, fresh], np.arange(0, 1000))] == [1, 1]  # two events


def test_small_bump_near_the_floor_is_not_a_warning(tmp_path):
    n = 1000
    loss = 0.035 * np.exp(np.random.default_rng(10).normal(0, 0.05, n))
    loss[:100] = np.linspace(0.9, 0.035, 100)
    loss[500:507] = [0.06, 0.09, 0.158, 0.12, 0.09, 0.06, 0.045]  # at the epoch boundary
    steps = np.arange(1, n + 1)
    text = trainer_state(
        steps, loss, np.full(n, 1e-5), 0.5 * np.exp(np.random.default_rng(11).normal(0, 0.1, n)), []
    )
    _, findings = judged(tmp_path, "trainer_state.json", text)
    assert raised(findings, "loss_spike") == []
    calm = one(findings, "loss_outliers")
    assert calm.evidence["small_bumps"] == 1
    assert calm.evidence["largest_bump_nats"] < 0.2
    assert "nats" in calm.summary


# ---- 5. a log every 50 steps: one step's loss sampled, heavy-tailed noise, two real spikes ---------------


def test_sampled_log_noise_is_not_spikes_but_the_real_spikes_are(tmp_path):
    n = 20000
    rng = np.random.default_rng(12)
    loss = decay(n, 9.8, 5.5, noise=0.0, seed=12, tau=3000)
    rows = np.arange(49, n, 50)
    noise = np.exp(rng.normal(0, 0.1, len(rows)))
    blips = rng.choice(np.arange(20, len(rows) - 20), 8, replace=False)
    noise[blips] *= rng.uniform(1.6, 2.3, len(blips))  # one batch each, the next row back
    sampled = loss.copy()
    sampled[rows] *= noise
    for first, factor in ((8000, 3.0), (15000, 2.5)):  # real: four rows (200 steps) up
        sampled[first : first + 200] *= factor
    run = lf.curve_run(sampled)
    log, findings = judged(tmp_path, "metrics.csv", ls.lightning_csv(run, every=50))
    assert log.loss_kind == "sample"
    steps = sorted(f.where["step"] for f in raised(findings, "loss_spike"))
    assert steps == [8049, 15049], [f.summary for f in raised(findings, "loss_spike")]
    assert one(findings, "loss_outliers").evidence["hard_batches"] >= 4


# ---- 6. every line shape of a claimed format: DeepSpeed's pipeline engine --------------------------------


def test_deepspeed_pipeline_losses_are_read_and_judged(tmp_path):
    run = ls.make_run(2000, seed=13, spikes=((1200, 2.2, 30),))
    log, findings = judged(tmp_path, "pipe.log", lf.deepspeed_pipe_log(run))
    assert log.framework == "deepspeed"
    assert log.loss_kind == "sample"
    assert int(log.table["loss"].notna().sum()) == 200
    assert log.settings["global_batch_size"] == 256
    assert log.settings["clip_max_norm"] == 1.0
    assert one(findings, "divergence").verdict == "pass"
    [spike] = raised(findings, "loss_spike")
    assert spike.where["step"] == 1200


# ---- 8. severity: a blow-up above where the run started, rescued only by an LR cut ------------------------


def test_word_lm_blow_up_above_the_start_level_is_a_fail(tmp_path):
    batches, n = 2983, 4 * 2983
    loss = decay(n, 7.6, 5.2, noise=0.01, seed=14, tau=1500)
    lr = np.full(n, 20.0)
    lr[2 * batches :] = 5.0  # main.py divides the LR by 4 when the validation loss stops improving
    up = np.arange(5200, 2 * batches + 300)
    loss[up] = np.interp(up, [5200, 5400, 5600, 5800, 5966, 6266], [5.6, 12.0, 17.0, 15.0, 13.0, 5.4])
    run = lf.curve_run(loss, lr=lr / 1e5)  # the writer prints lr × 1e5
    _, findings = judged(tmp_path, "wordlm.txt", ls.wordlm_log(run, batches=batches))
    [spike] = raised(findings, "loss_spike")
    assert spike.verdict == "fail", spike.summary
    assert "LR was cut" in spike.summary
    assert "untrained" in spike.summary


# ---- the formats people training DeepSeek-class models have --------------------------------------------


def test_torchtitan_log_with_colours_ranks_and_validation(tmp_path):
    run = ls.make_run(300, seed=15, spikes=((200, 2.5, 10),))
    log, findings = judged(tmp_path, "titan.log", lf.torchtitan_log(run, ranks=2, val_every=50))
    assert sniff(tmp_path / "titan.log") == "torchtitan"
    assert log.rows == 600
    assert sorted(log.table["rank"].unique().tolist()) == [0, 1]
    assert log.table["grad_norm"].notna().all()
    assert len(log.eval_loss) == 6
    [spike] = raised(findings, "loss_spike")
    assert spike.where["step"] == 200
    plain, _ = judged(tmp_path, "plain.log", lf.torchtitan_log(run, color=False, every=10))
    assert plain.rows == 30
    assert plain.table["interval_steps"].median() == 10


@pytest.mark.parametrize("stdout", [False, True])
def test_llmc_main_log_and_stdout(tmp_path, stdout):
    run = ls.make_run(1000, seed=16)
    log, findings = judged(tmp_path, "llmc.log", lf.llmc_main_log(run, stdout=stdout))
    assert log.framework == "llm.c"
    assert log.rows == 1000
    assert log.table["grad_norm"].notna().all()
    assert log.table["lr"].notna().all()
    assert len(log.eval_loss) == (0 if stdout else 4)
    assert not [f for f in findings if f.verdict in ("warn", "fail")]


@pytest.mark.parametrize("train_loss", [True, False])
def test_modded_nanogpt_record(tmp_path, train_loss):
    run = ls.make_run(1000, seed=17)
    log, findings = judged(tmp_path, "record.txt", lf.modded_log(run, train_loss=train_loss))
    assert sniff(tmp_path / "record.txt") == "modded-nanogpt"
    assert log.rows == (1000 if train_loss else 8)
    assert bool(log.notes) != train_loss  # a record with val_loss only says it is judged on it
    assert one(findings, "divergence").verdict in ("pass", "not_run")
