"""A small MoE language model written the ways other code bases write routers:

    --kind btk      a `gate` beside `experts` returning (weights, indices) per sequence: [batch, seq, k]
    --kind chooser  the router is `dispatch`, class TokenChooser (a name watch does not recognise)

Each block routes every token to its top-2 of 4 experts (token id mod 4 and the next one), so the load
is known: every expert gets the same count.
"""

import argparse

import torch
from torch import nn


class BTKGate(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden) * 0.02)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (x @ self.weight.t()).softmax(-1)  # [B, T, E]
        weights, indices = scores.topk(self.top_k, dim=-1)  # [B, T, k]
        return weights, indices


class TokenChooser(BTKGate):
    pass


class Block(nn.Module):
    def __init__(self, hidden: int, kind: str, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        router = BTKGate(hidden, experts, top_k) if kind == "btk" else TokenChooser(hidden, experts, top_k)
        if kind == "btk":
            self.gate = router
        else:
            self.dispatch = router
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router = self.gate if hasattr(self, "gate") else self.dispatch
        weights, indices = router(x)
        out = torch.zeros_like(x)
        for slot in range(indices.shape[-1]):
            for e, expert in enumerate(self.experts):
                mask = (indices[..., slot] == e).unsqueeze(-1)
                out = out + mask * weights[..., slot : slot + 1] * expert(x)
        return x + out


class Model(nn.Module):
    def __init__(self, kind: str, vocab: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, kind) for _ in range(2))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("btk", "chooser"), default="btk")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Model(args.kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        ids = torch.randint(0, 64, (4, 8))
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
