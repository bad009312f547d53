"""Fault injection for demonstrations and tests: make the embedded job fail in known ways, on purpose.

Every fault is one the probes must find in a real job; injecting it into a real run (real DDP, real
GradScaler, real allocator) is how the tests prove they do, without fakes.

    leak=<MB per step>           keep MB more memory alive every step (device memory on CUDA, else host)
    spike=<step>:<lr factor>     multiply the LR of one optimizer step, e.g. spike=20:50
    overflow=<step>[:<count>]    make the gradients non-finite for <count> (default 1) steps from <step>,
                                 so the GradScaler really skips them and halves its scale (fp16 only)
    slow-rank=<rank>:<ms>        that rank sleeps <ms> before every forward (a slow input pipeline/host)
    desync=<step>                rank 1 nudges its weights at <step>, after DDP's initial broadcast, so the
                                 replicas silently differ from then on (the cross-rank checksum finds it)
    moe-bias=<layer>:<e>[+<e>...][:<bias>]
                                 add <bias> (default 1.0) to the routing scores of experts <e> in decoder
                                 layer <layer>'s router (DeepSeek-V3's e_score_correction_bias, the knob its
                                 load balancing turns): those experts take every token's top-k slots, the
                                 rest of their groups' share and none of the others' (expert_imbalance names
                                 them; experts never chosen show as dead_experts)

Pass several as repeated `--inject` options or comma-separated: `--inject leak=4,spike=10:20`.

>>> inj = parse_injections(["leak=4", "spike=10:20,overflow=5:2", "moe-bias=2:3+7"])
>>> inj.leak_mb_per_step, inj.lr_factor(10), sorted(inj.overflow_steps), inj.moe_bias
(4.0, 20.0, [5, 6], {2: ([3, 7], 1.0)})
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ciuic_doctor.errors import UserError

KINDS = ("leak", "spike", "overflow", "slow-rank", "desync", "moe-bias")
DESYNC_RANK = 1  # the rank whose weights drift; rank 0 is the reference DDP broadcasts from
DESYNC_DELTA = 1e-3  # added to one weight tensor: invisible in the loss, plain in a checksum


@dataclass(kw_only=True)
class Injections:
    leak_mb_per_step: float = 0.0
    spikes: dict[int, float] = field(default_factory=dict)  # step -> LR factor
    overflow_steps: set[int] = field(default_factory=set)
    slow_ranks: dict[int, float] = field(default_factory=dict)  # rank -> ms per step
    desync_step: int | None = None
    moe_bias: dict[int, tuple[list[int], float]] = field(default_factory=dict)  # layer -> (experts, bias)
    _leaked: list[Any] = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        return bool(
            self.leak_mb_per_step
            or self.spikes
            or self.overflow_steps
            or self.slow_ranks
            or self.desync_step
            or self.moe_bias
        )

    def describe(self) -> dict[str, Any]:
        """What is injected, for meta.json (so a report never mistakes a demo fault for a real one)."""
        return {
            "leak_mb_per_step": self.leak_mb_per_step or None,
            "spikes": {str(k): v for k, v in self.spikes.items()} or None,
            "overflow_steps": sorted(self.overflow_steps) or None,
            "slow_ranks": {str(k): v for k, v in self.slow_ranks.items()} or None,
            "desync_step": self.desync_step,
            "moe_bias": {str(k): {"experts": e, "bias": b} for k, (e, b) in self.moe_bias.items()} or None,
        }

    def check(self, *, world: int, precision: str) -> None:
        """Refuse injections this job cannot carry out (a UserError, before any training)."""
        if self.overflow_steps and precision != "fp16":
            raise UserError(
                "--inject overflow needs precision fp16 (a GradScaler to skip the step); add --precision fp16"
            )
        if self.desync_step is not None and world < 2:
            raise UserError("--inject desync needs at least 2 ranks (use --nproc 2)")
        for rank in self.slow_ranks:
            if rank >= world:
                raise UserError(f"--inject slow-rank={rank}: no such rank in a world of {world}")

    def apply_to_model(self, model: Any) -> None:
        """moe-bias: raise the planted experts' routing scores in the named layers' routers (every rank
        alike; the bias is a buffer DDP never broadcasts). UserError when the layer has no such router."""
        import torch

        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer, (experts, bias) in self.moe_bias.items():
            gate = (
                getattr(getattr(layers[layer], "mlp", None), "gate", None)
                if layers and layer < len(layers)
                else None
            )
            correction = getattr(gate, "e_score_correction_bias", None)
            if not isinstance(correction, torch.Tensor):
                raise UserError(
                    f"--inject moe-bias={layer}:...: decoder layer {layer} has no DeepSeek-V3 MoE router "
                    f"(the model's MoE layers: first_k_dense_replace .. num_hidden_layers - 1)"
                )
            for expert in experts:
                if expert >= correction.numel():
                    raise UserError(
                        f"--inject moe-bias: no expert {expert} in layer {layer} ({correction.numel()})"
                    )
            with torch.no_grad():
                correction[experts] += bias

    # ---- effects, called by the training loop -------------------------------------------------
    def lr_factor(self, step: int) -> float:
        return self.spikes.get(step, 1.0)

    def before_forward(self, step: int, rank: int, model: Any) -> None:
        """slow-rank sleeps; desync perturbs rank 1's weights once; leak allocates and keeps memory."""
        delay_ms = self.slow_ranks.get(rank)
        if delay_ms:
            time.sleep(delay_ms / 1000)
        if self.desync_step == step and rank == DESYNC_RANK:
            import torch

            with torch.no_grad():
                next(model.parameters()).add_(DESYNC_DELTA)
        if self.leak_mb_per_step:
            import torch

            device = next(model.parameters()).device
            # ones, not empty: the pages must be touched to count in RSS (empty memory is never faulted in).
            count = int(self.leak_mb_per_step * (1 << 20)) // 4
            self._leaked.append(torch.ones(count, dtype=torch.float32, device=device))

    def after_backward(self, step: int, params: list[Any]) -> None:
        """overflow: one inf in the gradients, as an fp16 overflow makes, on every rank alike."""
        if step in self.overflow_steps:
            for param in params:
                if param.grad is not None:
                    param.grad.view(-1)[0] = float("inf")
                    return


def _whole(text: str, what: str, *, name: str = "step", first: int = 1) -> int:
    """A step (counted from 1) or a rank (`name="rank", first=0`) of an --inject item; UserError if not."""
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"--inject {what}: {name} {text!r} is not a whole number") from None
    if value < first:
        raise UserError(f"--inject {what}: {name}s count from {first}, got {value}")
    return value


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--inject {what}: {text!r} is not a number") from None
    if not value > 0:
        raise UserError(f"--inject {what}: must be greater than 0, got {text}")
    return value


def parse_injections(items: list[str] | None) -> Injections:
    """Parse `--inject` values (see the module docstring); malformed ones raise UserError."""
    inj = Injections()
    for item in (part.strip() for raw in items or [] for part in raw.split(",")):
        if not item:
            continue
        kind, sep, value = item.partition("=")
        if not sep or kind not in KINDS:
            raise UserError(f"--inject {item!r}: expected one of {', '.join(k + '=...' for k in KINDS)}")
        head, _, tail = value.partition(":")
        if kind == "leak":
            inj.leak_mb_per_step = _number(value, item)
        elif kind == "spike":
            if not tail:
                raise UserError(f"--inject {item}: expected spike=<step>:<lr factor>")
            inj.spikes[_whole(head, item)] = _number(tail, item)
        elif kind == "overflow":
            first = _whole(head, item)
            count = _whole(tail, item) if tail else 1
            inj.overflow_steps.update(range(first, first + count))
        elif kind == "slow-rank":
            if not tail:
                raise UserError(f"--inject {item}: expected slow-rank=<rank>:<ms>")
            inj.slow_ranks[_whole(head, item, name="rank", first=0)] = _number(tail, item)
        elif kind == "moe-bias":
            experts, _, bias = tail.partition(":")
            if not experts:
                raise UserError(f"--inject {item}: expected moe-bias=<layer>:<expert>[+<expert>...][:<bias>]")
            chosen = [_whole(e, item, name="expert", first=0) for e in experts.split("+")]
            inj.moe_bias[_whole(head, item, name="layer", first=0)] = (
                chosen,
                _number(bias, item) if bias else 1.0,
            )
        else:
            inj.desync_step = _whole(value, item)
    return inj
