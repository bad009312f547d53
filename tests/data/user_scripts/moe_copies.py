"""A tiny MoE language model (token embedding, a router named `gate` beside `experts`) that trains a
few steps and then does what training scripts do with their model: torch.save / torch.load it, pickle it,
deep-copy it for an EMA and update that copy in place. Exits 0 when all of it works; prints each step."""

import copy
import io
import pickle
import sys

import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, experts)
        self.top_k = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).topk(self.top_k, dim=-1).indices


class Block(nn.Module):
    def __init__(self, dim: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = Gate(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gate(x)
        return x + sum(e(x) for e in self.experts) / len(self.experts)


class TinyMoE(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def main() -> int:
    torch.manual_seed(0)
    model = TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        tokens = torch.randint(0, 50, (4, 6))
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"hooks on the model: {hooks(model)}", flush=True)
    buf = io.BytesIO()
    torch.save(model, buf)
    print("torch.save ok", flush=True)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    print(f"torch.load ok, hooks on the loaded model: {hooks(loaded)}", flush=True)
    blob = pickle.dumps(model)
    print(f"pickle ok, mentions ciuic: {b'ciuic' in blob}", flush=True)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p_ema, p in zip(ema.parameters(), model.parameters(), strict=True):
            p_ema.mul_(0.9).add_(p, alpha=0.1)
    print(f"deepcopy + EMA update ok, hooks on the copy: {hooks(ema)}", flush=True)
    ema(torch.randint(0, 50, (2, 6)))  # the copy runs a forward of its own
    return 0


if __name__ == "__main__":
    sys.exit(main())
