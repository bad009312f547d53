"""A DDP script for `checkup --nproc 2`: gloo with a 120 s timeout, 5 MiB buckets, SGD + StepLR."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(__file__))
from tinydata import build

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
torch.manual_seed(0)
model = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)), bucket_cap_mb=5
)
data = build()
loader = DataLoader(
    data,
    batch_size=4,
    sampler=DistributedSampler(data),
    num_workers=1,
    persistent_workers=True,
    prefetch_factor=3,
)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
for _epoch in range(3):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        opt.step()
        sched.step()
dist.destroy_process_group()
