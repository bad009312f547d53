"""What made watch's step cheaper keeps what it wrote and what it guarantees: `store.dumps` writes the
characters the json.dumps path wrote (reference below) for any record, a CPU value is read as the copy
path read it, and a watched job killed with SIGKILL mid-run keeps a whole record of every step it
finished (each record is one os.write as the step ends, never held back)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic_doctor.machine.envinfo import scrub
from ciuic_doctor.probes.watch.values import USS_COST_BUDGET, UssSampler, start_copy
from ciuic_doctor.rundir import store


def reference(record):
    """store.dumps as it was: json.dumps with NaN refused, then the record walked to write NaN as text."""
    try:
        text = json.dumps(record, default=store._json_default, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(store._finite(record), default=store._json_default, separators=(",", ":"))
    return scrub(text)


def outcome(fn, record):
    try:
        return fn(record)
    except Exception as exc:  # both must fail alike (an int past Python's digit limit, a cycle)
        return type(exc).__name__


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
    | st.sampled_from(["AdamW", "computed", "nöde-01", "\u2028", '"quoted"\\', "--hf-token=abc1234"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
)
keys = st.text(max_size=12) | st.sampled_from(["step", "loss", "t", "HF_TOKEN", "tokens", "ünï"])


@settings(max_examples=600, deadline=None, derandomize=True)
@given(st.dictionaries(keys, values, max_size=30))
def test_dumps_writes_what_json_dumps_wrote(record):
    assert outcome(store.dumps, record) == outcome(reference, record)


def test_dumps_of_step_records_and_their_edge_values():
    step = {
        "schema": 1, "t": 1796432953.4516194, "host": "vm", "rank": 0, "step": 2,
        "step_time_s": 0.0021681050002, "loss": float("nan"), "lr": float("inf"), "grad_norm": -math.inf,
        "clip_max_norm": None, "skipped": False, "rss": 2**63 + 1, "optimizer_class": "AdamW",
        "desync_ranks": [1, 3], "loss_scale": torch.tensor(65536.0),
        "weights_checksum": torch.tensor(float("nan"), dtype=torch.float64), "path": Path("/tmp/x"),
        7: "int key",
    }  # fmt: skip
    line = store.dumps(step)
    assert line == reference(step)
    parsed = json.loads(line)
    assert (parsed["loss"], parsed["lr"], parsed["grad_norm"]) == ("nan", "inf", "-inf")
    assert (parsed["loss_scale"], parsed["weights_checksum"], parsed["7"]) == (65536.0, "nan", "int key")
    assert outcome(store.dumps, {"rss": 10**5000}) == outcome(reference, {"rss": 10**5000}) == "ValueError"
    cycle: dict = {}
    cycle["self"] = cycle
    assert outcome(store.dumps, cycle) == outcome(reference, cycle)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(2.5),
        torch.tensor([0.125]),
        torch.tensor([1.0, float("nan"), 3.0]),
        torch.tensor(7, dtype=torch.int64),
        torch.tensor(True),
        torch.tensor(1.1, dtype=torch.bfloat16),
        torch.tensor(3.0, requires_grad=True) * 2,
    ],
)
def test_a_cpu_value_is_read_as_the_copy_path_read_it(tensor):
    expected = tensor.detach().reshape(-1).tolist()
    got = start_copy({}, {"loss": tensor, "lr": None, "grad_norm": torch.tensor(0.5)}).values()
    assert repr(got["loss"]) == repr(expected)  # repr: nan == nan, and the Python types too
    assert got["grad_norm"] == [0.5]
    assert "lr" not in got


KILLED = """
import sys, torch
model = torch.nn.Linear(8, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
step = 0
while True:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    print(f"step {step}", flush=True)
"""


@pytest.mark.parametrize("step_time_s", [0.002, 0.025, 1.0])
def test_uss_reads_stay_within_their_share_of_the_step_time(step_time_s):
    """A real read of this (torch) process's USS sets how many steps pass before the next one: its
    amortised cost is at most USS_COST_BUDGET of the step, and never more often than every 10 steps."""
    sampler = UssSampler(every=10)
    assert sampler.sample(1, step_time_s) > 0
    interval = sampler._next_step - 1
    assert interval >= 10
    assert sampler._cost_s / interval <= USS_COST_BUDGET * step_time_s or interval == 10
    assert sampler.sample(interval, step_time_s) is None  # not due yet
    assert interval == max(10, math.ceil(sampler._cost_s / (USS_COST_BUDGET * step_time_s)))


def test_sigkill_mid_run_keeps_a_whole_record_of_every_finished_step(tmp_path):
    """The script runs flat out; SIGKILL lands wherever it is, after it said it finished step 200."""
    script = tmp_path / "train.py"
    script.write_text(KILLED)
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "ciuic_doctor", "watch", "--out", str(run), "--", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    finished = 0
    try:
        for line in proc.stdout:
            finished = int(line.split()[1])
            if finished >= 200:
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert finished >= 200, proc.stderr.read() if proc.stderr and not proc.stderr.closed else finished
    lines = (run / "steps.rank0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line whole: one os.write each
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(steps) + 1))
    assert len(steps) >= finished  # every step the script saw finish is on disk (it may have done more)
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in records)
