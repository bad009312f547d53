"""`watch` under the real frameworks (issue 13): a Lightning `Trainer` (optimizer.step(closure),
gradient_clip_val, accumulate_grad_batches, bf16-mixed on CPU; devices=2 relaunching its own argv, and
under torchrun) and a transformers `Trainer` resumed from its checkpoint. Each run is compared with what
the framework itself saw: a Lightning callback's view at on_before_optimizer_step, HF's trainer_state.json.
"""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, torchrun

from ciuic_doctor.rundir.store import RunDir

pytest.importorskip("lightning")

# A Lightning script as its users write it; a callback writes the truth: at on_before_optimizer_step the
# closure has run backward (the micro-batch losses so far) and Lightning has not clipped yet, so the
# norm is what clip_grad_norm_ returns.
LIGHTNING = """\
import json, os, sys
import torch
import lightning as L

mode, out = sys.argv[1], sys.argv[2]

class Truth(L.Callback):
    def __init__(self):
        self.rows = []
    def on_before_optimizer_step(self, trainer, module, optimizer):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.rows.append({
            "global_step": trainer.global_step,
            "norm": torch.nn.utils.get_total_norm(grads).item(),
            "losses": module.micro,
            "lr": optimizer.param_groups[0]["lr"],
        })
        module.micro = []

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.micro = []
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.micro.append(loss.item())
        return loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g)
        data = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(data, batch_size=8)

torch.manual_seed(0)
truth = Truth()
kwargs = dict(
    accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=[truth],
)
if mode == "single":
    kwargs.update(devices=1, gradient_clip_val=0.05, accumulate_grad_batches=3, precision="bf16-mixed")
else:
    kwargs.update(devices=2, strategy="ddp", num_nodes=1, accumulate_grad_batches=2)
trainer = L.Trainer(**kwargs)
trainer.fit(Tiny())
with open(os.path.join(out, f"truth{trainer.global_rank}.json"), "w") as fh:
    json.dump(truth.rows, fh)
"""

# transformers' Trainer on a tiny GPT-2 built from a config (nothing downloaded).
HF = """\
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

out, max_steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
torch.manual_seed(0)
config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
g = torch.Generator().manual_seed(0)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (64, 16), generator=g)]
args = TrainingArguments(
    output_dir=out, max_steps=max_steps, logging_steps=1, save_steps=3, per_device_train_batch_size=4,
    learning_rate=1e-3, max_grad_norm=1.0, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
    disable_tqdm=True,
)
Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data).train(resume_from_checkpoint=resume)
"""


def steps_of(path) -> list[dict]:
    return sorted(RunDir.open(path).read("steps").records, key=lambda r: (r["rank"], r["step"]))


def assert_matches_lightning(records: list[dict], truth: list[dict], *, source: str) -> None:
    assert [r["step"] for r in records] == [row["global_step"] + 1 for row in truth]
    # Lightning divides each micro-batch loss by accumulate_grad_batches before backward: the sum watch
    # records is the mean of the losses training_step returned.
    means = [sum(row["losses"]) / len(row["losses"]) for row in truth]
    assert [r["loss"] for r in records] == pytest.approx(means, rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx([row["norm"] for row in truth], rel=1e-5)
    assert [r["backward_calls"] for r in records] == [len(row["losses"]) for row in truth]
    assert {r["grad_norm_source"] for r in records} == {source}
    assert [r["lr"] for r in records] == [row["lr"] for row in truth]


@pytest.mark.slow
def test_lightning_closure_clip_accumulation_bf16(tmp_path):
    script = tmp_path / "lit.py"
    script.write_text(LIGHTNING)
    out = tmp_path / "run"
    done = run_cli(
        "watch", "--out", str(out), "--", str(script), "single", str(tmp_path), cwd=tmp_path, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    truth = json.loads((tmp_path / "truth0.json").read_text())
    assert [len(row["losses"]) for row in truth] == [3, 3, 3, 3]  # accumulate_grad_batches=3
    records = steps_of(out)
    assert_matches_lightning(records, truth, source="clip")
    assert {r["clip_max_norm"] for r in records} == {0.05}


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["lightning", "torchrun"])
def test_lightning_ddp_two_devices_records_both_ranks(tmp_path, launch):
    """devices=2 without torchrun: Lightning re-runs its argv for rank 1, which watch follows (before,
    rank 0's step-1 checksum waited forever for it). Under torchrun each rank is already watched."""
    script = tmp_path / "lit.py"
    script.write_text(LIGHTNING)
    out = tmp_path / "run"
    argv = ("watch", "--out", str(out), "--", str(script), "ddp", str(tmp_path))
    if launch == "lightning":
        done = run_cli(*argv, cwd=tmp_path, timeout=300)
    else:
        done = torchrun(*argv, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = steps_of(out)
    for rank in (0, 1):
        truth = json.loads((tmp_path / f"truth{rank}.json").read_text())
        assert_matches_lightning([r for r in records if r["rank"] == rank], truth, source="computed")
    step1 = [r for r in records if r["step"] == 1]
    assert len(step1) == 2
    assert all(r["weights_checksum"] is not None and r["desync_ranks"] == [] for r in step1)
    assert RunDir.open(out).read_meta()["probes"]["watch"]["status"] == "finished"


@pytest.mark.slow
def test_hf_trainer_every_step_matches_trainer_state_also_after_resume(tmp_path):
    pytest.importorskip("accelerate")
    script = tmp_path / "hf.py"
    script.write_text(HF)
    hf_out = tmp_path / "hf"
    first = run_cli(
        "watch", "--out", str(tmp_path / "a"), "--", str(script), str(hf_out), "3", cwd=tmp_path, timeout=240
    )
    assert first.returncode == 0, first.stderr[-3000:]
    # --resume_from_checkpoint into a new run directory: HF counts 4..6, and so must watch.
    second = run_cli(
        "watch", "--out", str(tmp_path / "b"), "--", str(script), str(hf_out), "6",
        str(hf_out / "checkpoint-3"), cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    history = json.loads((hf_out / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    logged = {row["step"]: row for row in history if "loss" in row}
    records = steps_of(tmp_path / "a") + steps_of(tmp_path / "b")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] == sorted(logged)
    for record in records:
        row = logged[record["step"]]
        assert record["loss"] == pytest.approx(row["loss"], rel=1e-6)
        assert record["grad_norm"] == pytest.approx(row["grad_norm"], rel=1e-6)
        assert record["lr"] == pytest.approx(row["learning_rate"], rel=1e-9, abs=1e-12)
        assert record["grad_norm_source"] == "clip"
