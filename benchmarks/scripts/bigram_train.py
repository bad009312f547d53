"""A fast tiny training script of the public shape (a character bigram language model, as in lectures and
tutorials): an embedding table of vocab × vocab, batch 32 × 8 tokens, AdamW, and every `--eval-every`
steps an evaluation of `--eval-iters` batches on each split. Steps of a few tens of milliseconds make
watch's own per-step cost visible. Random tokens stand in for text: the cost does not depend on them.

Prints `loop_s=<wall> cpu_s=<process CPU> steps=<n>` for the training loop alone (start-up excluded).
"""

import argparse
import time

import torch
from torch.nn import functional as F  # noqa: N812 - the tutorials spell it so


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--eval-every", type=int, default=300)
    parser.add_argument("--eval-iters", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="sequences a step (the lecture's 32)")
    parser.add_argument("--block", type=int, default=8, help="tokens a sequence (the lecture's 8)")
    args = parser.parse_args()
    torch.manual_seed(1337)
    vocab, batch, block = 65, args.batch, args.block
    data = torch.randint(vocab, (200_000,))
    split = int(0.9 * len(data))
    parts = {"train": data[:split], "val": data[split:]}

    def get_batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        part = parts[name]
        ix = torch.randint(len(part) - block, (batch,))
        return torch.stack([part[i : i + block] for i in ix]), torch.stack(
            [part[i + 1 : i + block + 1] for i in ix]
        )

    model = torch.nn.Embedding(vocab, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @torch.no_grad()
    def estimate() -> None:
        for name in parts:
            for _ in range(args.eval_iters):
                x, y = get_batch(name)
                F.cross_entropy(model(x).view(-1, vocab), y.view(-1))

    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        if step % args.eval_every == 0:
            estimate()
        x, y = get_batch("train")
        loss = F.cross_entropy(model(x).view(-1, vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    print(f"loop_s={time.perf_counter() - wall:.4f} cpu_s={time.process_time() - cpu:.4f} steps={args.steps}")


if __name__ == "__main__":
    main()
