"""A Lightning script: Adam + CosineAnnealingLR per step, clipping, accumulation, bf16-mixed on CPU."""

import lightning
import torch
from torch.utils.data import DataLoader, TensorDataset


class Net(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.02)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


data = TensorDataset(torch.randn(128, 16), torch.randn(128, 1))
loader = DataLoader(data, batch_size=8, num_workers=0)
trainer = lightning.Trainer(
    max_steps=6,
    accelerator="cpu",
    devices=1,
    gradient_clip_val=0.3,
    accumulate_grad_batches=2,
    precision="bf16-mixed",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Net(), loader)
