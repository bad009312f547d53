"""A training script whose input pipeline is the bottleneck, for `watch --set` and `verify` (issue 21).

Each sample takes SAMPLE_S to load (a sleep: it costs no CPU, so a loaded machine does not blur it) and
each step "computes" for COMPUTE_S after backward (a sleep too). By default the script loads in the
main process (num_workers 0): every step waits the whole ~200 ms of its batch before forward. Four
workers make a batch every ~50 ms, ready before the step asks for it: `num_workers=4` helps the time
before backward. The sleeps are large enough that a machine at load 15 (every Python step ~50 ms
slower) keeps them apart.

    slow_loader_train.py [--workers N] [--fp16] [--pg] [--no-loader] [--no-clip]

--workers N: N loader workers (prefetch 2, persistent, fork); --fp16: autocast + an enabled
GradScaler(init_scale=256, growth_interval=50); --pg: a one-rank gloo process group (timeout 1800 s);
--no-loader: plain tensors, no DataLoader; --no-clip: no clip_grad_norm_.
"""

import datetime
import os
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

SAMPLE_S = 0.025
COMPUTE_S = 0.100


class SlowData(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(SAMPLE_S)
        g = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=g)


def main() -> None:
    torch.manual_seed(0)
    if "--pg" in sys.argv:
        import torch.distributed as dist

        store = os.path.join(tempfile.mkdtemp(), "pg")
        timeout = datetime.timedelta(seconds=1800)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    workers = int(sys.argv[sys.argv.index("--workers") + 1]) if "--workers" in sys.argv else 0
    if "--no-loader" in sys.argv:
        batches = (torch.randn(8, 16) for _ in range(512))
    elif workers:
        batches = DataLoader(
            SlowData(), batch_size=8, num_workers=workers, prefetch_factor=2, persistent_workers=True,
            multiprocessing_context="fork",
        )  # fmt: skip
    else:
        batches = DataLoader(SlowData(), batch_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    fp16 = "--fp16" in sys.argv
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=50, enabled=fp16)
    for xb in batches:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = model(xb).float().pow(2).mean()
        scaler.scale(loss).backward()
        time.sleep(COMPUTE_S)
        scaler.unscale_(opt)
        if "--no-clip" not in sys.argv:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    print("trained", flush=True)


if __name__ == "__main__":
    main()
