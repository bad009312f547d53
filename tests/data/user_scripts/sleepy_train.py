"""A training loop that takes its time: `--sleep S` seconds a step (default 0.5), `--steps N` steps
(default 1000), `--hang` sleeps for good before the first step. For verify's process-hygiene tests."""

import argparse
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--sleep", type=float, default=0.5)
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--hang", action="store_true")
args = parser.parse_args()
if args.hang:
    time.sleep(3600)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(args.steps):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(args.sleep)
