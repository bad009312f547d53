"""Cost of watch's settings hooks (probes/watch/observe.py) per optimizer step, side by side in one run.

Blocks of `optimizer.step()` on a model whose step costs almost nothing alternate with the hooks
installed and removed, so what is left between the two is the hooks' own cost: the global post-step
hook (the LR the step ran, the --steps count) on every step. The constructor hooks run once per object
and are not in the loop. Rank 1 is used so that no meta.json is written (only rank 0 writes it).

    .venv/bin/python benchmarks/watch_observe_cost.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from types import SimpleNamespace


def main(rounds: int = 10, steps: int = 2000) -> None:
    import torch

    from ciuic_doctor.probes.watch import observe as watch_observe
    from ciuic_doctor.rundir.store import RunDir

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with tempfile.TemporaryDirectory() as tmp:
        session = SimpleNamespace(rank=1, run=RunDir.create(tmp), add_listener=lambda listener: None)

        def block() -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            return (time.perf_counter() - t0) / steps * 1e6

        off, on = [], []
        for _ in range(rounds):
            off.append(block())
            undo = watch_observe.install(session)
            on.append(block())
            for restore in reversed(undo):
                restore()
    without, with_hooks = statistics.median(off), statistics.median(on)
    print(f"optimizer.step on a 5-parameter model, {rounds} rounds x {steps} steps each way:")
    print(f"  without the settings hooks: {without:.1f} us/step")
    print(f"  with the settings hooks:    {with_hooks:.1f} us/step")
    cost = with_hooks - without
    print(f"  hooks' own cost: {cost:.1f} us/step (inside the noise when near 0)")
    print(f"  on a 0.1 s training step that is a ratio of {1 + max(cost, 0.0) / 1e5:.5f} (goal <= 1.01)")


if __name__ == "__main__":
    main()
