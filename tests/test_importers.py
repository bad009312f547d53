"""Importers: every format and its version variants -> the normalized step table; bad input never crashes."""

from __future__ import annotations

import itertools
import json
import math

import logsynth as ls
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ciuic_doctor.errors import UserError
from ciuic_doctor.importers import COLUMNS, FORMATS, _text, load, sniff


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- Megatron ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["new", "old"])
@pytest.mark.parametrize("timestamps", [True, False])
def test_megatron_variants_read_every_interval(tmp_path, variant, timestamps):
    run = ls.make_run(300, seed=1, scaler="megatron")
    path = write(
        tmp_path, "train.log", ls.megatron_log(run, interval=10, variant=variant, timestamps=timestamps)
    )
    log = load(path)
    table = log.table
    assert list(table.columns) == list(COLUMNS)
    assert table["step"].tolist() == list(range(10, 301, 10))
    assert (table["interval_steps"] == 10).all()
    assert log.formats[str(path)] == "megatron"
    # LR printed with 3 or 6 significant decimals: both read back to that precision.
    assert table["lr"].iloc[-1] == pytest.approx(run.lr[299], rel=1e-3 if variant == "old" else 1e-6)
    assert table["t"].notna().all() == timestamps
    assert log.unread_lines > 5  # the argument dump, validation lines, timer blocks


def test_megatron_interval_with_every_iteration_skipped_has_no_loss(tmp_path):
    run = ls.make_run(60, seed=2, scaler="megatron")  # 2**32 needs 20 skips to calibrate
    log = load(write(tmp_path, "m.log", ls.megatron_log(run, interval=10)))
    first, second, third = log.table.iloc[0], log.table.iloc[1], log.table.iloc[2]
    assert first["skipped"] == 10
    assert math.isnan(first["loss"])
    assert math.isnan(first["grad_norm"])
    assert second["skipped"] == 10
    assert third["skipped"] == 0
    assert third["loss"] > 0
    assert first["loss_scale"] < 2.0**32  # the scale printed after the interval's halvings


def test_megatron_nan_iteration_is_counted_not_read_as_a_missing_loss(tmp_path):
    run = ls.make_run(50, seed=3, nan_steps=(23,))  # bf16: no scaler skips it
    log = load(write(tmp_path, "m.log", ls.megatron_log(run, interval=5)))
    row = log.table.set_index("step").loc[25]
    assert row["nonfinite"] == 1
    assert math.isnan(row["loss"])
    assert log.table["nonfinite"].sum() == 1


def test_megatron_rank_prefixes_and_interleaved_ranks(tmp_path):
    run = ls.make_run(100, seed=4)
    a = ls.megatron_log(run, prefix="[rank3]: ").splitlines()
    b = ls.megatron_log(run, prefix="7: ").splitlines()
    interleaved = [line for pair in zip(a, b, strict=True) for line in pair]
    log = load(write(tmp_path, "both.log", "\n".join(interleaved) + "\n"))
    assert sorted(log.table["rank"].dropna().unique().tolist()) == [3, 7]
    assert (log.table.groupby("rank")["step"].count() == 100).all()
    assert (log.table["interval_steps"] == 1).all()


def test_megatron_fork_with_other_field_order_goes_line_by_line(tmp_path):
    lines = [
        f"iteration {i:6d}/ 1000 | lm loss: {5 - i / 100:.6E} | learning rate: 1.000E-04 | "
        f"grad norm: 1.5 | loss scale: 4096.0 | number of skipped iterations: 0 |"
        for i in range(1, 41)
    ]
    log = load(write(tmp_path, "fork.log", "\n".join(lines) + "\n"), "megatron")
    assert log.rows == 40
    assert log.table["loss"].iloc[0] == pytest.approx(4.99)
    assert (log.table["loss_scale"] == 4096).all()


# ---- DeepSpeed, apex, fairseq ------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["int", "float", "deepscale"])
def test_deepspeed_overflow_lines_become_interval_skips(tmp_path, variant):
    run = ls.make_run(400, seed=5, scaler="deepspeed", storms=((200, 6, 3),))
    log = load(write(tmp_path, "ds.log", ls.deepspeed_log(run, variant=variant)))
    table = log.table.set_index("step")
    assert log.formats[str(tmp_path / "ds.log")] == "deepspeed"
    assert table.index.tolist() == list(range(10, 401, 10))
    assert table["skipped"].sum() == int(run.skipped.sum())
    # 2**16 -> 2**13 with hysteresis 2: one hysteresis skip, then three halvings, all in the first 10 steps.
    assert table.loc[10, "skipped"] == 4
    assert table.loc[10, "loss_scale"] == 8192
    # Storm skips at 200, 203, ..., 215 fall in the intervals ending at 200, 210 and 220.
    assert table.loc[[200, 210, 220], "skipped"].tolist() == [1, 3, 2]
    assert table["lr"].notna().all()
    assert log.precision == "fp16"
    assert log.min_scale == 1.0


def test_deepspeed_hysteresis_line_skips_without_lowering_the_scale(tmp_path):
    text = (
        "[2024-01-01 00:00:01,000] [INFO] [loss_scaler.py:190:update_scale] [deepspeed] OVERFLOW! Rank 0 "
        "Skipping step. Attempted loss scale: 65536, but hysteresis is 2. Reducing hysteresis to 1\n"
        "[2024-01-01 00:00:02,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=10, skipped=1, lr=[0.0001]\n"
    )
    log = load(write(tmp_path, "h.log", text))
    assert log.table["skipped"].tolist() == [1]
    assert log.table["loss_scale"].tolist() == [65536]


def test_deepspeed_already_at_minimum_is_an_event(tmp_path):
    run = ls.make_run(600, seed=6, scaler="deepspeed", collapse=300)
    log = load(write(tmp_path, "dead.log", ls.deepspeed_log(run)))
    [event] = log.events
    assert event["kind"] == "scale_at_minimum"
    assert event["step"] >= run.fatal_step
    assert log.table["loss_scale"].min() == 1


def test_deepspeed_ranks_printing_the_same_overflow_count_once(tmp_path):
    lines = []
    for rank in (0, 1, 2, 3):
        lines.append(
            f"[rank{rank}]: [deepspeed] OVERFLOW! Rank {rank} Skipping step. Attempted loss scale: 1024, "
            "reducing to 512"
        )
    lines.append("[rank0]: [Rank 0] step=5, skipped=1, lr=[1e-4], mom=[(0.9, 0.999)]")
    log = load(write(tmp_path, "ranks.log", "\n".join(lines) + "\n"), "deepspeed")
    assert log.table["skipped"].tolist() == [1]


def test_apex_and_fairseq_lines_without_steps(tmp_path):
    apex = "\n".join(
        f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to {2.0**k}"
        for k in (15, 14, 13)
    )
    log = load(write(tmp_path, "apex.log", "epoch 1\n" + apex + "\nloss 2.3\n"))
    assert log.framework == "apex"
    assert not log.steps_known
    assert log.table["loss_scale"].tolist() == [32768, 16384, 8192]
    assert log.unread_lines == 2
    fairseq = "\n".join(f"NOTE: overflow detected, setting loss scale to: {2.0**-k}" for k in range(1, 4))
    log = load(write(tmp_path, "fairseq.log", fairseq + "\n"), "deepspeed")
    assert log.framework == "fairseq"
    assert log.min_scale == pytest.approx(1e-4)
    assert log.table["skipped"].sum() == 3


# ---- HF Trainer and Lightning --------------------------------------------------------------------


@pytest.mark.parametrize("grad_norm", [True, False])
def test_hf_trainer_state_train_entries_only(tmp_path, grad_norm):
    run = ls.make_run(1000, seed=7, nan_steps=(503,))
    path = write(tmp_path, "trainer_state.json", ls.hf_state(run, logging_steps=10, grad_norm=grad_norm))
    log = load(path)
    table = log.table
    assert table["step"].tolist() == list(range(10, 1001, 10))
    assert log.unread_lines == 1  # the final summary; the two eval entries are the eval loss
    assert [step for step, _ in log.eval_loss] == [500, 1000]
    assert table["grad_norm"].notna().any() == grad_norm
    assert table.set_index("step").loc[510, "nonfinite"] == 1
    assert table["loss"].iloc[0] == pytest.approx(float(np.mean(run.loss[:10])), abs=1e-4)


@pytest.mark.parametrize("suffix", [True, False])
def test_lightning_sparse_rows_merge_by_step(tmp_path, suffix):
    run = ls.make_run(1000, seed=8, nan_steps=(300,))
    log = load(write(tmp_path, "metrics.csv", ls.lightning_csv(run, every=10, suffix=suffix)))
    table = log.table.set_index("step")
    assert table.index.tolist() == list(range(9, 1000, 10))
    assert table["lr"].notna().all()  # logged in rows of their own, merged
    assert table["grad_norm"].notna().all()
    assert table.loc[299, "nonfinite"] == 1
    assert table.loc[19, "loss"] == pytest.approx(run.loss[19])


# ---- ours --------------------------------------------------------------------------------------


def test_ours_reads_every_rank_file_and_the_job_spec(tmp_path):
    run = ls.make_run(200, seed=9, scaler="gradscaler", nan_steps=(50, 51))
    out = ls.write_ours(tmp_path / "run", run, ranks=2, clip_max_norm=0.5)
    log = load(out.path)
    assert log.rows == 400
    assert sorted(log.table["rank"].unique().tolist()) == [0, 1]
    assert log.clip_max_norm == 0.5
    assert log.precision == "fp16"
    assert log.table.groupby("step")["nonfinite"].max().loc[[50, 51]].tolist() == [1, 1]
    assert log.table["skipped"].sum() == 2 * int(run.skipped.sum())


def test_ours_torn_line_and_foreign_records(tmp_path):
    run = ls.make_run(100, seed=10)
    out = ls.write_ours(tmp_path / "run", run, ranks=1)
    path = out.path / "steps.rank0.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(10, json.dumps({"step": 1000, "loss": "nan", "note": "a, b: c"}))  # other keys, commas
    lines.insert(20, '{"kind": "checksum", "rank": 0}')  # not a step record
    lines.insert(30, "[1, 2, 3]")
    path.write_text("\n".join(lines) + '\n{"schema":1,"t":17')  # torn last line (kill -9)
    log = load(path)
    assert log.rows == 101
    assert log.unread_lines == 3
    extra = log.table.set_index("step").loc[1000]
    assert extra["nonfinite"] == 1
    assert log.table["step"].tolist()[:12] == [*range(1, 11), 1000, 11]  # file order kept


# ---- sniffing and errors -------------------------------------------------------------------------


def test_sniff_every_format(tmp_path):
    run = ls.make_run(50, seed=11, scaler="deepspeed")
    assert sniff(write(tmp_path, "a.log", ls.megatron_log(run))) == "megatron"
    assert sniff(write(tmp_path, "b.log", ls.deepspeed_log(run))) == "deepspeed"
    assert sniff(write(tmp_path, "trainer_state.json", ls.hf_state(run))) == "hf"
    assert sniff(write(tmp_path, "state.json", ls.hf_state(run))) == "hf"
    assert sniff(write(tmp_path, "metrics.csv", ls.lightning_csv(run))) == "lightning"
    assert sniff(ls.write_ours(tmp_path / "run", run).path) == "ours"


def test_unknown_things_are_one_user_error(tmp_path):
    with pytest.raises(UserError, match="known formats: auto, ours, megatron"):
        load(tmp_path, "tensorboard")
    with pytest.raises(UserError, match="not a training log"):
        load(write(tmp_path, "notes.txt", "hello\nworld\n"))
    with pytest.raises(UserError, match="no such file"):
        load(tmp_path / "missing.log")
    with pytest.raises(UserError, match=r"without steps\.jsonl"):
        load(tmp_path)
    with pytest.raises(UserError, match="no training steps found as megatron"):
        load(write(tmp_path, "empty.log", "nothing here\n"), "megatron")


# ---- fuzzing: arbitrary bytes and mangled real lines -----------------------------------------------

REAL_LINES = [
    " [2024-05-29 16:26:41] iteration       10/     100 | consumed samples:   5120 | learning rate: 1.5E-05 |"
    " global batch size:   512 | lm loss: 7.4E+00 | loss scale: 65536.0 | grad norm: 2.3 |"
    " number of skipped iterations:   0 | number of nan iterations:   0 |",
    "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768",
    "[Rank 0] step=40, skipped=2, lr=[5e-05], mom=[[0.9, 0.999]]",
    "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
    '{"schema":1,"rank":0,"step":3,"loss":"nan","skipped":true}',
    '{"log_history": [{"loss": 1.0, "step": 1}]}',
    "epoch,step,train_loss_step\n0,1,2.5",
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 1e400",
]


def _mangle(data: st.DataObject) -> bytes:
    parts = data.draw(
        st.lists(
            st.one_of(
                st.sampled_from(REAL_LINES),
                st.text(max_size=80),
                st.binary(max_size=80).map(lambda b: b.decode("latin-1")),
                st.sampled_from(REAL_LINES).map(lambda s: s.replace("|", "", 1)),
                st.sampled_from(REAL_LINES).map(lambda s: s.replace("1", "\x00").replace(":", "::")),
            ),
            max_size=12,
        )
    )
    sep = data.draw(st.sampled_from(["\n", "\r\n", "\r", ""]))
    return sep.join(parts).encode("utf-8", errors="surrogatepass")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_importers_survive_anything(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("fuzz")
    raw = data.draw(st.one_of(st.binary(max_size=400), st.none()))
    payload = _mangle(data) if raw is None else raw
    attempts = [("log.txt", fmt) for fmt in ("auto", *FORMATS)]
    attempts += [(name, "auto") for name in ("trainer_state.json", "metrics.csv", "steps.jsonl")]
    errors: list[str] = []
    for name, fmt in attempts:
        (folder / name).write_bytes(payload)
        try:
            log = load(folder / name, fmt)
        except UserError as exc:
            errors.append(str(exc))
            continue
        assert list(log.table.columns) == list(COLUMNS)
        assert log.unread_lines >= 0
    assert all("\n" not in message for message in errors)


# ---- big logs: byte ranges read in parallel ---------------------------------------------------------


def test_byte_ranges_read_every_line_exactly_once(tmp_path, monkeypatch):
    rng = np.random.default_rng(12)
    monkeypatch.setattr(_text, "CHUNK_BYTES", 7)
    for trial in range(60):
        lines = ["x" * int(n) for n in rng.integers(0, 25, size=int(rng.integers(0, 30)))]
        data = ("\n".join(lines) + ("\n" if trial % 2 else "")).encode()
        path = tmp_path / f"f{trial}.log"
        path.write_bytes(data)
        cuts = sorted({0, len(data), *rng.integers(0, len(data) + 1, size=4).tolist()})
        got = b"".join(b"".join(_text.byte_chunks(path, a, b)) for a, b in itertools.pairwise(cuts))
        assert got == (data if not data or data.endswith(b"\n") else data + b"\n")


@pytest.mark.parametrize("kind", ["megatron", "ours"])
def test_parallel_reading_gives_the_same_table(tmp_path, monkeypatch, kind):
    run = ls.make_run(3000, seed=13, scaler="gradscaler", nan_steps=(1234,))
    if kind == "ours":
        path = ls.write_ours(tmp_path / "run", run, ranks=1).path / "steps.rank0.jsonl"
    else:
        path = write(tmp_path, "train.log", ls.megatron_log(run, interval=1))
    monkeypatch.setenv("CIUIC_IMPORT_WORKERS", "1")
    single = load(path)
    monkeypatch.setattr(_text, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(_text, "CHUNK_BYTES", 50_000)
    monkeypatch.setenv("CIUIC_IMPORT_WORKERS", "3")
    assert _text.workers_for(path) == 3
    parallel = load(path)
    pd.testing.assert_frame_equal(single.table, parallel.table)
    assert (single.read_lines, single.unread_lines) == (parallel.read_lines, parallel.unread_lines)
