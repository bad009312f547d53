"""What a checkpoint costs each rank: save time, the others' wait at the barrier, load time and the host
memory a load takes, for the two ways a DDP job loads, measured side by side.

Save, as the seed article's trick 7 and the embedded job do it: every rank hands rank 0 its RNG states,
rank 0 writes the file, every rank waits at a barrier. The others' `barrier_wait_s` is rank 0's save
time: a wait inside a collective, so it is bounded by the process-group timeout.

Load:
  every_rank       each rank reads the file itself with torch.load(weights_only=True) onto the CPU
                   (what the embedded job does);
  rank0_broadcast  the seed's way: rank 0 reads it, broadcast_object_list pickles it to the others. Every
                   rank still ends up with a full copy, plus the pickled bytes while it unpickles them,
                   and the receivers unpickle with plain pickle: the weights_only guard is gone.
                   benchmarks/checkpoint_cost.py (2 gloo ranks, 16-256 MiB): the broadcast took about
                   6x as long as every rank reading the file, and added about 4x the checkpoint's size
                   to its worst rank's RSS against 1x.

Peak host memory during a load: Linux's VmHWM, reset just before the load by writing "5" to
/proc/self/clear_refs (exact), and RSS sampled every 2 ms by a thread (portable; can miss a short peak);
the larger of the two is recorded.

User functions given with --save / --load (checkpoint_options.py) are timed the same way: save on rank 0
between the RNG gather and the barrier, load on every rank or on rank 0 for the broadcast.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ciuic_doctor.errors import ProbeFailed

if TYPE_CHECKING:
    from ciuic_doctor.jobs.train import Trainer

RSS_SAMPLE_S = 0.002


# ---- the save and load functions (resolved by checkpoint_options) --------------------------------------
def torch_save(state: dict[str, Any], path: str) -> None:
    """The default save: torch.save under a temporary name, renamed (a crash leaves no torn file)."""
    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def torch_load(path: str) -> Any:
    """The default load: torch.load(weights_only=True) onto the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)


@dataclass(kw_only=True)
class Methods:
    save: Callable[[dict[str, Any], str], None] | None = None  # None: the embedded job's save_checkpoint
    load: Callable[[str], Any] = torch_load
    save_name: str = "embedded (rank 0 torch.save + barrier)"
    load_name: str = "torch.load(weights_only=True)"

    @classmethod
    def from_options(cls, save: str | None, load: str | None) -> Methods:
        from ciuic_doctor.probes.checkpoint.options import resolve_callable

        methods = cls()
        if save:
            methods.save, methods.save_name = resolve_callable(save, "--save", 2), save
        if load:
            methods.load, methods.load_name = resolve_callable(load, "--load", 1), load
        return methods

    def write(self, state: dict[str, Any], path: Path) -> None:
        (self.save or torch_save)(state, str(path))


# ---- agreement between ranks -----------------------------------------------------------------------
def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(error: str | None, what: str) -> None:
    """Every rank learns whether any rank failed `what`, and all raise the same ProbeFailed, so no rank
    is left waiting in the next collective for one that gave up."""
    errors = [error]
    if distributed():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        rank, message = failed[0]
        raise ProbeFailed(f"{what} failed on rank {rank}: {message}")


def barrier() -> None:
    if distributed():
        dist.barrier()


def path_bytes(path: Path) -> int:
    """Size of a checkpoint file, or of every file under it when a save wrote a directory."""
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return 0


# ---- peak memory -----------------------------------------------------------------------------------
def tensor_bytes(obj: Any, depth: int = 0) -> int:
    """Bytes of tensor data in a loaded checkpoint: what a load must hold at least, in a fresh process.

    RSS growth alone understates it in a warm process: glibc reuses heap freed by earlier saves and
    loads, which a resumed job's new process does not have.
    """
    if torch.is_tensor(obj):
        return obj.untyped_storage().nbytes()
    if depth > 8:
        return 0
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v, depth + 1) for v in obj)
    return 0


def _read_status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@contextlib.contextmanager
def peak_rss() -> Iterator[dict[str, Any]]:
    """Measure this process's peak RSS over the block: {before_bytes, peak_bytes, method}."""
    import psutil

    process = psutil.Process()
    out: dict[str, Any] = {"before_bytes": process.memory_info().rss}
    try:  # Linux >= 4.0: reset VmHWM to the current RSS, read it back afterwards
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        hwm_ok = True
    except OSError:
        hwm_ok = False
    sampled = [out["before_bytes"]]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(RSS_SAMPLE_S):
            sampled.append(process.memory_info().rss)

    thread = threading.Thread(target=sample, name="ciuic-rss-sampler", daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()
        sampled.append(process.memory_info().rss)
        hwm = _read_status_kb("VmHWM") if hwm_ok else None
        out["peak_bytes"] = max(*sampled, hwm or 0)
        out["method"] = "VmHWM + sampled" if hwm else f"sampled every {RSS_SAMPLE_S * 1e3:g} ms"


# ---- measurements ----------------------------------------------------------------------------------
def measure_save(trainer: Trainer, directory: Path, methods: Methods, repeat: int) -> dict[str, Any]:
    """One checkpoint of `trainer` the job's way (every rank calls this); the record of this rank."""
    from ciuic_doctor.jobs import checkpoint as ckpt

    if methods.save is None:
        timing = ckpt.save_checkpoint(trainer, directory, keep=1)
        path, save_s, wait_s, gather_s = (
            Path(timing.path),
            timing.save_s,
            timing.barrier_wait_s,
            timing.gather_s,
        )
    else:
        path = directory / f"user-step{trainer.step:06d}.ckpt"
        start = time.perf_counter()
        local = ckpt.rng_state()
        rngs: list[Any] = [local]
        if distributed():
            rngs = [None] * dist.get_world_size()
            dist.all_gather_object(rngs, local)
        gather_s = time.perf_counter() - start
        save_s, error = 0.0, None
        if trainer.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            try:
                methods.save({"format": ckpt.FORMAT, **trainer.state_dict(), "rng": rngs}, str(path))
            except Exception as exc:
                error = f"--save {methods.save_name} raised {type(exc).__name__}: {exc}"
            save_s = time.perf_counter() - start
        start = time.perf_counter()
        barrier()
        wait_s = time.perf_counter() - start
        agree(error, "the save")
    return {
        "kind": "save",
        "method": methods.save_name,
        "repeat": repeat,
        "step": trainer.step,
        "save_s": save_s,
        "barrier_wait_s": wait_s,
        "gather_s": gather_s,
        "size_bytes": path_bytes(path),
        "path": str(path),
    }


def _load_record(
    method: str, repeat: int, path: Path, mem: dict[str, Any], held: int, **times: Any
) -> dict[str, Any]:
    return {
        "kind": "load",
        "method": method,
        "repeat": repeat,
        **times,
        "peak_rss_bytes": mem["peak_bytes"],
        "rss_delta_bytes": max(0, mem["peak_bytes"] - mem["before_bytes"]),
        "held_bytes": held,
        "rss_before_bytes": mem["before_bytes"],
        "rss_method": mem["method"],
        "size_bytes": path_bytes(path),
    }


def measure_every_rank_load(path: Path, methods: Methods, repeat: int) -> dict[str, Any]:
    """Every rank reads the file itself, all starting together."""
    barrier()
    gc.collect()
    error = None
    with peak_rss() as mem:
        start = time.perf_counter()
        try:
            state = methods.load(str(path))
        except Exception as exc:
            state, error = None, f"{methods.load_name} raised {type(exc).__name__}: {exc}"
        load_s = time.perf_counter() - start
    held = tensor_bytes(state)
    del state
    gc.collect()
    agree(error, "the load")
    return _load_record("every_rank", repeat, path, mem, held, load_s=load_s)


def measure_broadcast_load(path: Path, methods: Methods, rank: int, repeat: int) -> dict[str, Any]:
    """The seed's load: rank 0 reads, broadcast_object_list hands every rank its own unpickled copy."""
    barrier()
    gc.collect()
    error = None
    with peak_rss() as mem:
        start = time.perf_counter()
        holder: list[Any] = [None]
        if rank == 0:
            try:
                holder[0] = methods.load(str(path))
            except Exception as exc:
                error = f"{methods.load_name} raised {type(exc).__name__}: {exc}"
        read_s = time.perf_counter() - start
        dist.broadcast_object_list(holder, src=0)
        load_s = time.perf_counter() - start
    held = tensor_bytes(holder[0])
    del holder
    gc.collect()
    agree(error, "the rank-0 load")
    # Rank 0 spends read_s reading and the rest sending; the others wait read_s inside the broadcast.
    return _load_record(
        "rank0_broadcast",
        repeat,
        path,
        mem,
        held,
        load_s=load_s,
        read_s=read_s if rank == 0 else None,
        broadcast_wait_s=None if rank == 0 else load_s,
    )
