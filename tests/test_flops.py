"""FLOPs per token in each named convention, the peak table, and the MFU / throughput / goodput findings.

The DeepSeek-V3 figures are docs/mfu.md's hand derivation; the config values are the published ones
(arXiv 2412.19437 and its config.json), written here: nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest

from ciuic_doctor.mfu.flops import ConfigError, flops_per_token, shape_from_config
from ciuic_doctor.mfu.peak import peak_tflops

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
}  # fmt: skip
# docs/mfu.md, "Hand derivation": GFLOP per token at seq 4096
HAND = {
    0: {"ciuic": 250.45, "ciuic_full": 281.15, "torchtitan": 281.16, "megatron": 249.81},
    1: {"ciuic": 260.64, "torchtitan": 281.16, "megatron": 259.99},
}


@pytest.mark.parametrize("mtp", [0, 1])
def test_deepseek_v3_matches_the_hand_derivation_in_every_convention(mtp):
    flops = flops_per_token(DEEPSEEK_V3, seq_len=4096, mtp_layers=mtp)
    for convention, gflop in HAND[mtp].items():
        assert flops.get(convention) / 1e9 == pytest.approx(gflop, rel=0.02), convention
    # the conventions really differ: attention halved or not is ~30 GFLOP, 12 %
    assert flops.torchtitan / flops.ciuic == pytest.approx(281.16 / HAND[mtp]["ciuic"], rel=0.02)


def test_deepseek_v3_parameter_counts_are_the_published_671b_total_37b_active():
    shape = shape_from_config(DEEPSEEK_V3, mtp_layers=0)
    assert shape.total_params() / 1e9 == pytest.approx(671, rel=0.01)
    assert shape.active_params() / 1e9 == pytest.approx(37, rel=0.02)
    assert (shape.moe_layers, shape.dense_layers) == (58, 3)


def test_the_config_s_mtp_depth_is_used_unless_the_caller_says_what_runs():
    assert flops_per_token(DEEPSEEK_V3, seq_len=4096).shape.mtp_layers == 1
    assert flops_per_token(DEEPSEEK_V3, seq_len=4096, mtp_layers=0).shape.mtp_layers == 0


def test_llama_style_dense_is_6n_plus_attention_in_torchtitan_s_convention():
    llama = {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    }  # fmt: skip
    seq = 2048
    flops = flops_per_token(llama, seq_len=seq)
    d, f, layers, vocab = 4096, 11008, 32, 32000
    n = layers * (4 * d * d + 3 * d * f + 2 * d) + d + vocab * d  # without the embedding; with norms
    assert flops.torchtitan == 6 * n + 6 * layers * 32 * (128 + 128) * seq
    assert flops.shape.total_params() == n + vocab * d  # LLaMA-7B: 6.74 B
    assert flops.shape.total_params() / 1e9 == pytest.approx(6.74, rel=0.01)
    assert flops.ciuic == pytest.approx(flops.torchtitan - 3 * layers * 32 * 256 * seq, rel=1e-4)


def test_mixtral_and_qwen2_moe_configs_count_top_k_experts():
    mixtral = {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2,
    }  # fmt: skip
    shape = shape_from_config(mixtral)
    assert shape.total_params() / 1e9 == pytest.approx(46.7, rel=0.01)  # Mixtral 8x7B
    assert shape.active_params() / 1e9 == pytest.approx(12.9, rel=0.01)
    qwen = {
        "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
    }  # fmt: skip
    shape = shape_from_config(qwen)
    assert shape.total_params() / 1e9 == pytest.approx(14.3, rel=0.01)  # Qwen1.5-MoE-A2.7B
    assert shape.active_params() / 1e9 == pytest.approx(2.7, rel=0.03)


def test_a_config_without_the_sizes_is_one_clear_error():
    with pytest.raises(ConfigError, match="hidden_size"):
        flops_per_token({"num_hidden_layers": 2}, seq_len=16)


def test_peak_table_knows_h200_from_h20_and_says_why_when_it_does_not_know():
    assert peak_tflops("NVIDIA H200", "bf16").tflops == 989
    assert peak_tflops("NVIDIA H20", "bf16").tflops == 148
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16").device == "H100 SXM"
    assert peak_tflops("NVIDIA H100 PCIe", "bf16").tflops == 756
    assert peak_tflops("NVIDIA H800", "fp8").tflops == 1979
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp16").tflops == 312
    assert peak_tflops("AMD Instinct MI300X", "bf16").tflops == 1307
    assert peak_tflops("NVIDIA B200", "bf16").tflops == 2250
    assert "no fp8" in peak_tflops("NVIDIA A100-SXM4-80GB", "fp8").reason
    unknown = peak_tflops("Some New Chip", "bf16")
    assert unknown.tflops is None
    assert "--peak-tflops" in unknown.reason
    assert peak_tflops(None, "bf16").tflops is None
    assert peak_tflops(None, "bf16", given=100.0).source == "--peak-tflops"


# ---- the findings on constructed records ----------------------------------------------------------
def _run_dir(tmp_path, *, device=None, peak=None, tokens=512):
    from ciuic_doctor.rundir.store import RunDir

    run = RunDir.create(tmp_path / "run")
    tiny = {**DEEPSEEK_V3, "hidden_size": 128, "num_hidden_layers": 4, "first_k_dense_replace": 1}
    meta = {
        "model": {"config": tiny, "seq_len": 64, "mtp_layers_run": 0},
        "spec": {"precision": {"mode": "bf16"}},
    }
    if device:
        meta["env"] = {"devices": [{"name": device}]}
    if peak:
        meta["mfu"] = {"peak_tflops": peak}
    run.update_meta(**meta)
    writer = run.writer("steps", rank=0, per_rank_file=True)
    t = 1000.0
    for step in range(1, 21):
        t += 0.1
        writer.write({"step": step, "t": t, "step_time_s": 0.1, "tokens": tokens, "rank": 0})
    writer.close()
    return run


def _findings(run):
    from ciuic_doctor.analysis import throughput

    return {f.check: f for f in throughput.analyze(run)}


def test_mfu_is_not_run_on_cpu_without_a_peak_and_says_its_convention_with_one(tmp_path):
    cpu = _findings(_run_dir(tmp_path / "a"))
    assert cpu["mfu"].verdict == "not_run"
    assert "--peak-tflops" in cpu["mfu"].summary
    assert "causal attention halved" in cpu["mfu"].summary
    assert cpu["throughput"].verdict == "pass"
    assert cpu["throughput"].evidence["tokens_per_s"] == pytest.approx(5120)
    h100 = _findings(_run_dir(tmp_path / "b", device="NVIDIA H100 80GB HBM3"))["mfu"]
    assert h100.verdict == "pass"
    assert "ciuic convention" in h100.summary
    flops = h100.evidence["flops"]["flops_per_token"]
    assert h100.evidence["mfu"]["ciuic"] == pytest.approx(flops["ciuic"] * 5120 / 989e12)
    assert h100.evidence["mfu"]["torchtitan"] > h100.evidence["mfu"]["ciuic"]
    given = _findings(_run_dir(tmp_path / "c", peak=100.0))["mfu"]
    assert given.verdict == "pass"
    assert given.evidence["peak_source"] == "--peak-tflops"
    json.dumps(given.to_dict())  # findings.json must take it


def test_mfu_not_run_names_what_is_missing_in_a_sentence(tmp_path):
    from ciuic_doctor.analysis.throughput import mfu_finding

    rates = {0: 5120.0}
    both = mfu_finding(rates, {}).summary
    assert both == (
        "MFU not computed: the model's config and sequence length are not recorded "
        "(meta.json model.config, model.seq_len)"
    )
    no_seq = mfu_finding(rates, {"model": {"config": {"hidden_size": 8}}}).summary
    assert "the model's sequence length is not recorded" in no_seq
    assert mfu_finding({}, {}).summary == "MFU not computed: no token counts in the step records"
    assert " no the " not in both + no_seq


def test_goodput_leaves_out_start_up_skipped_steps_and_stalls():
    from ciuic_doctor.analysis.throughput import goodput, goodput_finding

    rows, t = [], 100.0
    for step in range(1, 22):
        step_s = {1: 5.0, 8: 1.1, 12: 0.1}.get(step, 0.1)  # warm-up, a 1 s stall (checkpoint), a skip
        t += step_s
        rows.append({"step": step, "t": t, "step_time_s": step_s, "skipped": step == 12})
    good = goodput(rows, created=90.0)
    assert good["startup_s"] == pytest.approx(15.0)  # created at 90, step 1 ended at 105
    assert good["productive_s"] == pytest.approx(18 * 0.1 + 0.1)  # 19 kept steps after step 1, one capped
    assert good["over_typical_s"] == pytest.approx(1.0)
    assert good["skipped_s"] == pytest.approx(0.1)
    assert good["goodput_after_startup"] == pytest.approx(1.9 / 3.0)
    finding = goodput_finding({0: good})
    assert finding.verdict == "warn"
    assert "1.0 s in steps longer than the typical" in finding.summary


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", 1e9), ("hidden_size", 10**200), ("vocab_size", -1), ("kv_lora_rank", "abc")],
)
def test_a_hostile_config_is_refused_before_anything_is_counted(tmp_path, field, value):
    """A config is data from a run directory: `num_hidden_layers: 1e9` built a billion-entry list
    (analyze > 90 s), `hidden_size: 10**200` overflowed a float ("please report it")."""
    import time

    start = time.perf_counter()
    with pytest.raises(ConfigError, match=field):
        flops_per_token({**DEEPSEEK_V3, field: value}, seq_len=4096)
    assert time.perf_counter() - start < 1.0
    run = _run_dir(tmp_path, peak=100.0)
    meta = run.read_meta()
    meta["model"]["config"][field] = value
    run.update_meta(model=meta["model"])
    mfu = _findings(run)["mfu"]
    assert mfu.verdict == "not_run"
    assert mfu.summary.startswith(f"MFU not computed: {field} must be a whole number from 0 to ")


@pytest.mark.parametrize("peak", [1e-9, 1e-3])
def test_mfu_above_100_percent_is_a_fail_that_says_an_input_is_wrong(tmp_path, peak):
    mfu = _findings(_run_dir(tmp_path, peak=peak))["mfu"]
    assert mfu.evidence["mfu"]["ciuic"] > 1
    assert mfu.verdict == "fail"
    assert "above 100 %" in mfu.summary
    assert "an input is wrong" in mfu.summary


def test_a_recorded_peak_that_is_not_a_positive_number_gives_no_mfu():
    for bad in (0.0, -5.0, float("inf"), float("nan")):
        peak = peak_tflops("NVIDIA H100 80GB HBM3", "bf16", given=bad)
        assert peak.tflops is None
        assert "not a positive number" in peak.reason
