"""A loader-bound script as users write it: the dataset sleeps 5 ms an item (a disk or decode stand-in),
num_workers=0, a tiny model. `--load-ms 0` makes the same script compute-bound (the control)."""

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Sleepy(Dataset):
    def __init__(self, load_ms: float) -> None:
        self.load_s = load_ms / 1000

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int):
        if self.load_s:
            time.sleep(self.load_s)
        return torch.randn(64), torch.randn(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--load-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Sleepy(args.load_ms), batch_size=8, num_workers=0)
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step + 1 >= args.steps:
            break


if __name__ == "__main__":
    main()
