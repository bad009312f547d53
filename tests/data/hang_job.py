"""A small gloo training loop that hangs on purpose at step HANG_STEP on rank HANG_RANK (tests only).

    torchrun --nproc-per-node 2 -m ciuic_doctor watch -- tests/data/hang_job.py MODE

MODE: none | skip (no gradient all_reduce that step) | size (one element more) | loader (load_batch
sleeps) | kill (SIGKILL itself) | stop (SIGSTOP itself while saving a checkpoint).
Each step: load_batch, forward, backward, all_reduce of the flat gradient, SGD step, all_reduce of the
loss (what a loop logging the mean loss does), so every step issues two collectives from two lines.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

MODE = sys.argv[1] if len(sys.argv) > 1 else "none"
HANG_STEP = int(os.environ.get("HANG_STEP", "4"))
HANG_RANK = int(os.environ.get("HANG_RANK", "1"))
STEPS = int(os.environ.get("HANG_STEPS", "400"))
PG_TIMEOUT_S = float(os.environ.get("HANG_PG_TIMEOUT", "6"))


def culprit(step: int, rank: int, mode: str) -> bool:
    return mode == MODE and step == HANG_STEP and rank == HANG_RANK


def load_batch(step: int, rank: int) -> torch.Tensor:
    if culprit(step, rank, "loader"):
        time.sleep(3600)  # a storage read that never returns
    if culprit(step, rank, "kill"):
        # Die once the peer is surely past step 3: SIGKILL resets this rank's sockets, and a reset drops the
        # bytes the peer has not read yet, so a peer still finishing step 3's loss all_reduce would fail
        # there (line 62) instead of waiting in step 4's gradient all_reduce (seen once under CI load).
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.randn(8, 16)


def save_checkpoint(step: int, rank: int) -> None:
    if culprit(step, rank, "stop"):
        os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    rank = dist.get_rank()
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, STEPS + 1):
        batch = load_batch(step, rank)
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        if culprit(step, rank, "size"):
            flat = torch.cat([flat, torch.zeros(1)])
        if not culprit(step, rank, "skip"):
            dist.all_reduce(flat)  # the gradient all_reduce
        optimizer.step()
        dist.all_reduce(loss.detach())  # the logged mean loss
        save_checkpoint(step, rank)
        time.sleep(0.01)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
