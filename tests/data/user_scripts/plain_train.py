"""A plain PyTorch training script with a setting of its own for everything watch observes.

Run as `plain_train.py [--api-token T] [--no-loader] [--fp16]`; tests/test_observed.py compares meta.json's
`observed` with the values below.
"""

import sys

import torch
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:  # guarded: forkserver workers import this file
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x, y = torch.randn(256, 16), torch.randn(256, 1)
    if "--no-loader" in sys.argv:
        batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 256, 8)]
    else:
        batches = DataLoader(
            TensorDataset(x, y),
            batch_size=8,
            shuffle=True,
            num_workers=1,
            prefetch_factor=3,
            persistent_workers=True,
            multiprocessing_context="forkserver",
        )
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.98),
        eps=1e-7,
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=64, pct_start=0.25)
    fp16 = "--fp16" in sys.argv  # fp16 autocast with a GradScaler of its own settings
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=50, enabled=fp16)
    accum = 2
    for i, (xb, yb) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb) / accum
        scaler.scale(loss).backward()
        if (i + 1) % accum == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
    print("trained", flush=True)


if __name__ == "__main__":
    main()
