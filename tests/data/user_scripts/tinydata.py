"""The dataset of ddp_train.py, rebuildable for loader-sweep: `--dataset tinydata:build`."""

import torch
from torch.utils.data import TensorDataset


def build():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g))
