"""Resume fidelity: does a run restarted from the checkpoint continue the run that never stopped?

The reference trains N steps, checkpoints, and trains M more, recording every rank's loss per step and,
after the M steps, a fingerprint of everything a continuing run carries: parameters, optimizer state,
LR, GradScaler scale and growth tracker, Python / NumPy / torch / CUDA RNG states, step and data
position. Each variant then restarts in a fresh Trainer from the checkpoint (as saved, or with state
removed by `--drop`), trains the same M steps and records the same. On CPU a complete checkpoint gives
bit-identical losses and fingerprints; the fingerprint also catches state whose effect on the loss does
not show within M steps (an RNG nothing drew from yet, a GradScaler growth tracker without an overflow).

A restart is a new process: before each variant the RNGs are set the way a new process finds them
(Python and NumPy seeded from OS entropy, torch's default generator at its fixed start seed), so state the
checkpoint lacks is not silently inherited from the reference run in this process.

`restore` is tolerant: it restores whatever the checkpoint holds (Trainer.load_state_dict requires every
key) and leaves the rest as a fresh Trainer has it, which is what a job with that checkpoint would get.
The embedded job's checkpoint as saved is restored by the job's own `load_checkpoint`, so its real
resume path is what gets tested.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ciuic_doctor.jobs.checkpoint import set_rng_state
from ciuic_doctor.probes.checkpoint.options import DROPPABLE, Variant

if TYPE_CHECKING:
    from ciuic_doctor.jobs.train import Trainer

# c10's default_rng_seed_val: the seed torch's default CPU and CUDA generators start from in a new process.
TORCH_START_SEED = 67280421310721


def without(state: dict[str, Any], drop: tuple[str, ...]) -> dict[str, Any]:
    keys = {key for name in drop for key in DROPPABLE[name]}
    return {k: v for k, v in state.items() if k not in keys}


# ---- fingerprint -----------------------------------------------------------------------------------
def _digest(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """sha256 of the raw bytes (exact comparison) and a float64 sum of squares (comparison within a
    tolerance, where kernels are not bit-deterministic)."""
    sha = hashlib.sha256()
    sumsq = 0.0
    for tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        sha.update(flat.view(torch.uint8).numpy().tobytes())
        if flat.is_floating_point():
            sumsq += float(flat.double().square().sum())
    return {"sha256": sha.hexdigest()[:32], "sumsq": sumsq}


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = optimizer.state_dict()
    tensors: list[torch.Tensor] = []
    for index in sorted(state["state"]):
        for key in sorted(state["state"][index]):
            value = state["state"][index][key]
            tensors.append(value if torch.is_tensor(value) else torch.tensor(float(value)))
    return tensors


def _hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def rng_fingerprint() -> dict[str, str | None]:
    """A hash of each RNG's state in this process."""
    _kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "rng.python": _hash_bytes(repr(random.getstate()).encode()),
        "rng.numpy": _hash_bytes(keys.tobytes() + repr((pos, has_gauss, gauss)).encode()),
        "rng.torch": _hash_bytes(torch.get_rng_state().numpy().tobytes()),
        # This rank's own device only: get_rng_state_all() would create a CUDA context on every GPU.
        "rng.cuda": (
            _hash_bytes(torch.cuda.get_rng_state().numpy().tobytes()) if torch.cuda.is_initialized() else None
        ),
    }


def fingerprint(trainer: Trainer) -> dict[str, Any]:
    """Everything a continuing run carries, in comparable form (see the module docstring)."""
    scaler = trainer.scaler.state_dict() if trainer.scaler.is_enabled() else None
    return {
        "params": _digest(list(trainer.module.parameters())),
        "optimizer": _digest(_optimizer_tensors(trainer.optimizer)),
        "lr": [float(group["lr"]) for group in trainer.optimizer.param_groups],
        "scaler": None if scaler is None else [float(scaler["scale"]), int(scaler["_growth_tracker"])],
        **rng_fingerprint(),
        "step": trainer.step,
        "data_position": [*trainer.data_position(), trainer.micro_batches],
    }


# ---- restart -------------------------------------------------------------------------------------------
def fresh_process_rng() -> None:
    """The RNG states a newly started process has (see the module docstring)."""
    random.seed()  # Python seeds from os.urandom at start-up
    np.random.seed()  # NumPy's global RandomState: OS entropy
    torch.manual_seed(TORCH_START_SEED)  # also seeds every CUDA generator


def restore(trainer: Trainer, state: dict[str, Any]) -> list[str]:
    """Restore what `state` holds into a fresh `trainer`; return what was restored."""
    done: list[str] = []
    if "model" in state:
        trainer.module.load_state_dict(state["model"])
        done.append("model")
    if "optimizer" in state:
        trainer.optimizer.load_state_dict(state["optimizer"])
        done.append("optimizer")
    if "scheduler" in state:
        trainer.scheduler.load_state_dict(state["scheduler"])
        done.append("scheduler")
    if state.get("scaler"):
        trainer.scaler.load_state_dict(state["scaler"])
        done.append("scaler")
    trainer.step = int(state.get("step", 0))
    if "micro_batches" in state:
        trainer.micro_batches = int(state["micro_batches"])
        done.append("sampler")
    elif isinstance(state.get("sampler"), dict):
        sampler = state["sampler"]
        batches = int(sampler.get("start_index", 0)) // trainer.spec.batch.per_process
        trainer.micro_batches = int(sampler.get("epoch", 0)) * trainer.batches_per_epoch + batches
        done.append("sampler")
    trainer._iterator = None  # the next batch comes from the restored data position
    rngs = state.get("rng")
    if isinstance(rngs, list | tuple) and trainer.rank < len(rngs) and isinstance(rngs[trainer.rank], dict):
        done += set_rng_state(rngs[trainer.rank])
    elif isinstance(rngs, dict):  # one RNG state for all ranks (only rank 0's was saved)
        done += set_rng_state(rngs)
    return done


def train_steps(trainer: Trainer, steps: int) -> list[float]:
    """`steps` optimizer steps; each rank's own loss per step."""
    losses = []
    for _ in range(steps):
        trainer.train_step()
        losses.append(float(trainer.last_loss))
    return losses


@dataclass(kw_only=True)
class Restart:
    losses: list[float]
    fingerprint: dict[str, Any]
    restored: list[str]
    restore_s: float
    present: dict[str, str] | None  # what the loaded checkpoint holds (None: read by the job's loader)


def restart(
    make_trainer: Any, variant: Variant, path: Path, load: Any, steps: int, *, job_loader: bool
) -> Restart:
    """A fresh Trainer from `path`, `steps` more steps (every rank calls this)."""
    from ciuic_doctor.jobs import checkpoint as ckpt
    from ciuic_doctor.probes.checkpoint.cost import agree
    from ciuic_doctor.probes.checkpoint.inspection import classify

    fresh_process_rng()
    trainer = make_trainer()
    try:
        start = time.perf_counter()
        present, restored, error = None, [], None
        try:
            if job_loader:
                ckpt.load_checkpoint(path, trainer)  # the embedded job's own resume path
                restored = ["model", "optimizer", "scheduler", "scaler", "sampler", "rng"]
            else:
                state = load(str(path))
                if not isinstance(state, dict):
                    raise TypeError(f"the load returned {type(state).__name__}, not a dict")
                restored = restore(trainer, state)
                present = classify(state)[0]
                del state
        except Exception as exc:  # a user's load, or a checkpoint the restore cannot use
            error = f"{type(exc).__name__}: {exc}"
        restore_s = time.perf_counter() - start
        agree(error, f"restoring the {variant.name} checkpoint")
        losses = train_steps(trainer, steps)
        return Restart(
            losses=losses,
            fingerprint=fingerprint(trainer),
            restored=restored,
            restore_s=restore_s,
            present=present,
        )
    finally:
        trainer.close()
