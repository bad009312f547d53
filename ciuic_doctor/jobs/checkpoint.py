"""Checkpoints of the embedded job: the seed article's trick 7, done right, and timed.

Save: every rank contributes its own RNG states (all_gather_object), rank 0 alone writes the file, then
all ranks meet at a barrier, so no rank can read or overwrite a half-written checkpoint. The file is
written under a temporary name and renamed: a crash during a save leaves the previous checkpoint whole.

Load: every rank reads the file itself with `torch.load(weights_only=True)` onto the CPU. The seed
broadcasts a pickled checkpoint from rank 0 instead: that pickles (and on a big model, copies) the whole
state through the process group, and unpickling arbitrary objects is code execution if the file was
tampered with; `weights_only=True` refuses anything but tensors and plain containers.

A checkpoint holds everything a resumed run needs to continue bit-identically: model, optimizer,
scheduler and GradScaler states, every rank's Python / NumPy / torch / CUDA RNG states, the step, and
the sampler's epoch and position. `save_checkpoint` and `load_checkpoint` return their timings, which
checkpoint-check measures.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ciuic_doctor.errors import UserError
from ciuic_doctor.jobs.options import TrainerView

FORMAT = 1
_NAME = re.compile(r"^step(\d+)\.pt$")


@dataclass(kw_only=True)
class SaveTiming:
    path: str
    step: int
    save_s: float  # rank 0: building the state + writing the file; other ranks: 0
    size_bytes: int
    barrier_wait_s: float  # time this rank waited at the barrier after the save
    gather_s: float  # collecting every rank's RNG states


@dataclass(kw_only=True)
class LoadTiming:
    path: str
    step: int
    load_s: float  # torch.load + restoring every state
    size_bytes: int


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rng_state() -> dict[str, Any]:
    """This process's RNG states in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": list(random.getstate()),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        # This rank's own device only: get_rng_state_all() would create a CUDA context on every
        # visible GPU from every rank (~0.3-1 GB each) just to read generators it never uses.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> list[str]:
    """Restore each generator `state` holds (a checkpoint may lack some); return which, as "rng.<name>"."""
    restored = []
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        restored.append("rng.python")
    if "numpy" in state:
        np_state = state["numpy"]
        keys = np.asarray(np_state["keys"]).astype(np.uint32)
        np.random.set_state(
            (np_state["kind"], keys, np_state["pos"], np_state["has_gauss"], np_state["gauss"])
        )
        restored.append("rng.numpy")
    if "torch" in state:
        torch.set_rng_state(state["torch"])
        restored.append("rng.torch")
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
        restored.append("rng.cuda")
    return restored


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step{step:06d}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def resolve_resume(path: str | Path) -> Path:
    """`--resume` takes a checkpoint file, or a directory (checkpoints/ or its run) for the latest in it."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for directory in (path, path / "checkpoints"):
            found = list_checkpoints(directory)
            if found:
                return found[-1][1]
        raise UserError(f"--resume {path}: no step*.pt checkpoint in this directory")
    raise UserError(f"--resume {path}: no such file or directory")


def save_checkpoint(trainer: TrainerView, directory: Path, *, keep: int = 2) -> SaveTiming:
    """Save `trainer` (rank 0 writes; every rank must call this), keep the newest `keep` files."""
    step = trainer.step
    path = checkpoint_path(directory, step)
    start = time.perf_counter()
    local_rng = rng_state()
    if _distributed():
        rngs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, local_rng)
    else:
        rngs = [local_rng]
    gather_s = time.perf_counter() - start
    save_s = 0.0
    size_bytes = 0
    if trainer.rank == 0:
        start = time.perf_counter()
        directory.mkdir(parents=True, exist_ok=True)
        state = {"format": FORMAT, **trainer.state_dict(), "rng": rngs}
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        size_bytes = path.stat().st_size
        for _, old in list_checkpoints(directory)[: -max(1, keep)]:
            old.unlink(missing_ok=True)
        save_s = time.perf_counter() - start
    start = time.perf_counter()
    if _distributed():
        dist.barrier()
    barrier_wait_s = time.perf_counter() - start
    if trainer.rank != 0:
        size_bytes = path.stat().st_size if path.exists() else 0
    return SaveTiming(
        path=str(path),
        step=step,
        save_s=save_s,
        size_bytes=size_bytes,
        barrier_wait_s=barrier_wait_s,
        gather_s=gather_s,
    )


def load_checkpoint(path: Path, trainer: TrainerView) -> LoadTiming:
    """Restore `trainer` from `path` on this rank (every rank reads the file itself)."""
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():  # torch's note on a foreign pickle protocol: noise before our line
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # weights_only refused to run what the pickle asks for (a malicious file): safe, and one line
        raise UserError(
            f"--resume {path}: refused: its pickle calls code a safe load (weights_only) does not run; "
            "not a checkpoint of the embedded job"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"--resume {path}: cannot load ({first})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"--resume {path}: not a checkpoint of the embedded job")
    trainer.load_state_dict(state)
    rngs = state.get("rng") or []
    if trainer.rank < len(rngs):
        set_rng_state(rngs[trainer.rank])
    return LoadTiming(
        path=str(path),
        step=int(state["step"]),
        load_s=time.perf_counter() - start,
        size_bytes=path.stat().st_size,
    )
