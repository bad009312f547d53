"""Zero-code per-step recording inside a training process (`ciuic-doctor watch -- script.py`).

One record per optimizer step in RUN/steps.rank<R>.jsonl, from hooks on what every PyTorch training loop
already calls, so the user's script stays as it is:

- `torch.autograd.backward` (which `Tensor.backward` calls): the scalar loss and when backward started;
  for a GradScaler-scaled loss, the unscaled tensor that was handed to `scaler.scale`.
- `torch.nn.utils.clip_grad_norm_`: the total norm it returns and `max_norm`; a script that does not clip
  gets the same norm computed from the gradients before the optimizer step (`get_total_norm`).
- torch.optim's global optimizer step pre/post hooks: the step boundary and the LR.
- `torch.amp.GradScaler.scale/step/update`: scale and skipped. A skipped step never reaches the
  optimizer (no post hook fires), so with an enabled scaler the record is made in `update()`, from the
  scaler's found-inf flags: every skipped step is still a record.
- `DistributedDataParallel.__init__`: which parameters must be identical on which ranks, for the
  cross-rank weight checksum (an all_gather of one float64 sum at step 1 and every K steps).

Values that live on the device are read without a device sync (see watch_values). A bug in these hooks
must never break the user's training: the first exception disables recording with one line on stderr.
"""

from __future__ import annotations

import atexit
import functools
import os
import runpy
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ciuic_doctor.analysis.steps import differing_ranks
from ciuic_doctor.probes.watch_target import check_target
from ciuic_doctor.probes.watch_values import (
    PendingQueue,
    Replicas,
    UssSampler,
    cuda_memory,
    is_sharded,
    read_rss,
    start_copy,
)
from ciuic_doctor.store import RunDir

STREAM = "steps"
RECORD_KEYS = (
    "rank", "step", "t", "step_time_s", "pre_backward_s", "loss", "lr", "grad_norm", "grad_norm_source",
    "clip_max_norm", "loss_scale", "skipped", "backward_calls", "mem_allocated", "mem_reserved",
    "mem_active_peak", "alloc_retries", "rss", "uss", "weights_checksum", "desync_ranks",
)  # fmt: skip
_ACTIVE: dict[str, WatchSession] = {}  # "session": the one recording in this process


@dataclass(kw_only=True)
class WatchConfig:
    checksum_every: int = 10  # steps between cross-rank weight checksums (and at step 1)
    uss_every: int = 10  # fewest steps between USS reads (more when a read is costly)
    grad_norm: bool = True  # compute the norm when the script does not clip
    checksum: bool = True
    snapshot_on_leak: bool = False  # CUDA only: dump a memory snapshot when allocated memory keeps growing


@dataclass(kw_only=True)
class _Step:
    """What the current optimizer step has collected so far."""

    losses: list[torch.Tensor] = field(default_factory=list)
    backward_calls: int = 0
    t_first_backward: float | None = None
    grad_norm: torch.Tensor | None = None
    grad_norm_source: str | None = None
    clip_max_norm: float | None = None
    scaler: Any = None  # an enabled GradScaler that scaled this step's loss
    stepped: bool = False  # the primary optimizer's step ran

    @property
    def touched(self) -> bool:
        return self.backward_calls > 0 or self.stepped or self.scaler is not None


def current() -> WatchSession | None:
    """The session recording in this process, if any."""
    return _ACTIVE.get("session")


def attach(*, run: RunDir, rank: int | None = None, config: WatchConfig | None = None) -> WatchSession:
    """Start recording into `run` (or join the session already recording in this process)."""
    active = _ACTIVE.get("session")
    if active is not None:
        active._refs += 1
        return active
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    session = WatchSession(run=run, rank=rank, config=config or WatchConfig())
    session._install()
    _ACTIVE["session"] = session
    return session


class WatchSession:
    """The hooks of one process and the stream they write. Use `attach()`; close with `close()`."""

    def __init__(self, *, run: RunDir, rank: int, config: WatchConfig) -> None:
        self.run = run
        self.rank = rank
        self.config = config
        self.steps_written = 0
        self._refs = 1
        self._writer = run.writer(STREAM, rank=rank, per_rank_file=True)
        self._queue = PendingQueue(finish=self._write)
        self._uss = UssSampler(every=config.uss_every)
        self._step = _Step()
        self._step_no = 0
        self._t_prev_end: float | None = None
        self._primary: weakref.ref | None = None
        self._replicas: list[Replicas] = []
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._undo: list[Callable[[], None]] = []
        self._device: torch.device | None = None
        self._broken = False
        self._closed = False
        self._backward_depth = 0
        self._sharded: dict[int, bool] = {}  # id(optimizer) -> holds FSDP / DTensor shards
        self._snapshot = None
        if config.snapshot_on_leak and torch.cuda.is_available():
            from ciuic_doctor.probes.watch_snapshot import LeakSnapshot

            self._snapshot = LeakSnapshot(run=run, rank=rank)

    # ---- public ------------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """The number of steps already done (a resumed job): the next record is step + 1."""
        self._step_no = step

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener(record)` after each record is written (progress lines)."""
        self._listeners.append(listener)

    def watch_replicas(self, module: torch.nn.Module, group: Any = None) -> None:
        """Check that `module`'s parameters stay identical across the ranks of `group` (DDP does this)."""
        ref = weakref.ref(module)
        self._replicas.append(
            Replicas(params=lambda: list(m.parameters()) if (m := ref()) else [], group=group)
        )

    def close(self) -> None:
        """Stop recording once every `attach()` has been matched; pending records are written."""
        self._refs -= 1
        if self._refs > 0 or self._closed:
            return
        self._closed = True
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if not self._broken:
            if self._step.stepped:  # an enabled scaler whose update() never came: still a step
                # No collective here: the other ranks may be past their last step already.
                self._guarded(self._finalize, scaler=None, found_inf=None, gather=False)
            self._guarded(self._queue.flush)
        if self._snapshot is not None:
            self._guarded(self._snapshot.stop)
        self._writer.close()
        if _ACTIVE.get("session") is self:
            del _ACTIVE["session"]

    def __enter__(self) -> WatchSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- installing the hooks ----------------------------------------------------------------
    def _patch(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, functools.wraps(original)(make(original)))
        self._undo.append(lambda: setattr(owner, name, original))

    def _install(self) -> None:
        import torch.nn.utils.clip_grad as clip_module
        from torch.amp.grad_scaler import GradScaler
        from torch.nn.parallel import DistributedDataParallel
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        session = self

        def make_backward(original: Callable) -> Callable:
            def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
                # Re-entrant activation checkpointing calls backward inside backward: not a new loss.
                if session._backward_depth == 0:
                    session._guarded(session._on_backward, tensors)
                session._backward_depth += 1
                try:
                    return original(tensors, *args, **kwargs)
                finally:
                    session._backward_depth -= 1

            return backward

        def make_clip(original: Callable) -> Callable:
            def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
                total = original(*args, **kwargs)
                max_norm = kwargs.get("max_norm", args[1] if len(args) > 1 else None)
                session._guarded(session._on_clip, total, max_norm)
                return total

            return clip_grad_norm_

        def make_scale(original: Callable) -> Callable:
            def scale(scaler: Any, outputs: Any) -> Any:
                result = original(scaler, outputs)
                session._guarded(session._on_scale, scaler, outputs, result)
                return result

            return scale

        def make_scaler_step(original: Callable) -> Callable:
            def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                session._guarded(session._claim, optimizer)
                return original(scaler, optimizer, *args, **kwargs)

            return step

        def make_update(original: Callable) -> Callable:
            def update(scaler: Any, new_scale: Any = None) -> None:
                found_inf = session._guarded(session._found_inf, scaler) if new_scale is None else None
                original(scaler, new_scale)
                if scaler.is_enabled() and session._step.touched:
                    session._guarded(session._finalize, scaler=scaler, found_inf=found_inf)

            return update

        def make_ddp_init(original: Callable) -> Callable:
            def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
                original(ddp, *args, **kwargs)
                session._guarded(session.watch_replicas, ddp.module, getattr(ddp, "process_group", None))

            return __init__

        self._patch(torch.autograd, "backward", make_backward)
        clip = make_clip(clip_module.clip_grad_norm_)
        for owner in (clip_module, torch.nn.utils):
            original = owner.clip_grad_norm_
            owner.clip_grad_norm_ = functools.wraps(original)(clip)
            self._undo.append(functools.partial(setattr, owner, "clip_grad_norm_", original))
        self._patch(GradScaler, "scale", make_scale)
        self._patch(GradScaler, "step", make_scaler_step)
        self._patch(GradScaler, "update", make_update)
        self._patch(DistributedDataParallel, "__init__", make_ddp_init)
        pre = register_optimizer_step_pre_hook(lambda opt, a, k: self._guarded(self._pre_step, opt))
        post = register_optimizer_step_post_hook(lambda opt, a, k: self._guarded(self._post_step, opt))
        self._undo += [pre.remove, post.remove]
        atexit.register(self._at_exit)
        self._undo.append(functools.partial(atexit.unregister, self._at_exit))
        # issue 14: record what the script configured into meta.json "observed" (probes/watch_observe.py)
        from ciuic_doctor.probes import watch_observe

        self._undo += watch_observe.install(self)

    def _at_exit(self) -> None:
        if not self._closed:
            self._refs = 1
            self.close()

    def _guarded(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run a hook body; on an exception stop recording, never the user's training.

        The hooks themselves keep running after that: `_finalize` still counts steps and joins the
        checksum all_gather at the same steps as every other rank. A rank that silently dropped out of
        that schedule would leave the others waiting in the collective until the process-group timeout.
        """
        try:
            return fn(*args, **kwargs)
        except Exception:
            if self._broken:
                return None
            self._broken = True
            print(
                f"ciuic-doctor watch: recording stopped after an internal error (training continues):\n"
                f"{traceback.format_exc()}",
                file=sys.stderr,
            )
            return None

    # ---- hook bodies -------------------------------------------------------------------------
    def _claim(self, optimizer: Any) -> bool:
        """The first optimizer that steps is the one whose steps are recorded; others are ignored."""
        if self._primary is None or self._primary() is None:
            self._primary = weakref.ref(optimizer)
        return self._primary() is optimizer

    def _on_backward(self, tensors: Any) -> None:
        step = self._step
        if step.stepped:  # the last step stepped but its scaler never updated: close it first
            self._finalize(scaler=None, found_inf=None)
            step = self._step
        if isinstance(tensors, (list, tuple)) and len(tensors) == 1:
            tensors = tensors[0]
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            step.losses.append(getattr(tensors, "_ciuic_unscaled", tensors).detach())
            if self._device is None:  # the loss lives where the model does
                self._device = tensors.device
        step.backward_calls += 1
        if step.t_first_backward is None:
            step.t_first_backward = time.perf_counter()

    def _on_clip(self, total: Any, max_norm: Any) -> None:
        if isinstance(total, torch.Tensor):
            self._step.grad_norm = total.detach()
            self._step.grad_norm_source = "clip"
            self._step.clip_max_norm = float(max_norm) if max_norm is not None else None

    def _on_scale(self, scaler: Any, outputs: Any, result: Any) -> None:
        if scaler.is_enabled() and isinstance(outputs, torch.Tensor) and isinstance(result, torch.Tensor):
            result._ciuic_unscaled = outputs  # the loss as computed; backward() sees `result`
            self._step.scaler = scaler

    def _pre_step(self, optimizer: Any) -> None:
        if not self._claim(optimizer) or not self.config.grad_norm or self._step.grad_norm is not None:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sharded = self._sharded.get(id(optimizer))
        if sharded is None:
            sharded = self._sharded[id(optimizer)] = is_sharded(params)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads or sharded:  # a shard's norm is not the model's norm
            return
        norm = torch.nn.utils.get_total_norm(grads)
        # Fused optimizers unscale inside their kernel: their grads still carry the loss scale here.
        grad_scale = getattr(optimizer, "grad_scale", None)
        if isinstance(grad_scale, torch.Tensor):
            norm = norm / grad_scale.to(norm.device)
        self._step.grad_norm = norm.detach()
        self._step.grad_norm_source = "computed"

    def _post_step(self, optimizer: Any) -> None:
        if not self._claim(optimizer):
            return
        self._step.stepped = True
        if self._device is None:
            self._device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
        if self._step.scaler is None:
            self._finalize(scaler=None, found_inf=None)

    @staticmethod
    def _found_inf(scaler: Any) -> torch.Tensor | None:
        """Sum of the scaler's found-inf flags for this step, on the device (GradScaler internals)."""
        flags = [
            flag
            for state in getattr(scaler, "_per_optimizer_states", {}).values()
            for flag in state.get("found_inf_per_device", {}).values()
        ]
        if not flags:
            return None
        device = flags[0].device
        return sum((f.to(device, non_blocking=True).float() for f in flags[1:]), flags[0].float())

    # ---- one record per step -----------------------------------------------------------------
    def _finalize(self, *, scaler: Any, found_inf: torch.Tensor | None, gather: bool = True) -> None:
        step, self._step = self._step, _Step()
        self._step_no += 1
        gathered = None
        if gather and self.config.checksum and self._checksum_due(self._step_no):
            # A collective: every rank makes this call at the same step, recording or not.
            for replicas in self._replicas:
                gathered = replicas.gather_checksums()
                if gathered is not None:
                    break
        now = time.perf_counter()
        prev, self._t_prev_end = self._t_prev_end, now
        if self._broken:
            return
        optimizer = self._primary() if self._primary else None
        lr = optimizer.param_groups[0].get("lr") if optimizer is not None else None
        lazy: dict[str, torch.Tensor | None] = {
            "loss": _total(step.losses),
            "grad_norm": step.grad_norm,
            "loss_scale": scaler._scale.detach().clone() if scaler is not None else None,
            "found_inf": found_inf,
            "lr": lr.detach().clone() if isinstance(lr, torch.Tensor) else None,
        }
        step_time_s = now - prev if prev is not None else None
        record: dict[str, Any] = {
            "rank": self.rank,
            "step": self._step_no,
            "t": time.time(),
            "step_time_s": step_time_s,
            "pre_backward_s": (
                step.t_first_backward - prev if prev is not None and step.t_first_backward else None
            ),
            "lr": float(lr) if isinstance(lr, int | float) else None,
            "grad_norm_source": step.grad_norm_source,
            "clip_max_norm": step.clip_max_norm,
            "skipped": scaler is not None and found_inf is None and not step.stepped,
            "backward_calls": step.backward_calls,
            **cuda_memory(self._device),
            "rss": read_rss(),
            "uss": self._uss.sample(self._step_no, step_time_s),
        }
        if gathered is not None:
            lazy["checksums"], record["_checksum_ranks"], record["_checksum_me"] = gathered
        self._queue.push(start_copy(record, lazy))

    def _checksum_due(self, step: int) -> bool:
        every = max(1, self.config.checksum_every)
        return step == 1 or (step - 1) % every == 0

    def _write(self, pending: Any) -> None:
        values = pending.values()
        record = pending.record
        first = {key: vals[0] if vals else None for key, vals in values.items() if key != "checksums"}
        for key in ("loss", "grad_norm", "loss_scale", "lr"):
            if key in first:
                record[key] = first[key]
        if "found_inf" in first:
            record["skipped"] = bool(first["found_inf"] > 0)
        ranks, me = record.pop("_checksum_ranks", None), record.pop("_checksum_me", None)
        if "checksums" in values and ranks:
            record["weights_checksum"] = values["checksums"][ranks.index(me)] if me in ranks else None
            record["desync_ranks"] = differing_ranks(values["checksums"], ranks)
        full = {key: record.get(key) for key in RECORD_KEYS}
        self._writer.write(full)
        self.steps_written += 1
        if self._snapshot is not None:
            self._snapshot.observe(full["step"], full["mem_allocated"])
        for listener in self._listeners:
            listener(full)


def _total(losses: list[torch.Tensor]) -> torch.Tensor | None:
    """The step's loss: the one backward() loss, or the sum over micro-batches (each already divided by
    the accumulation count in a correct loop, so the sum is the mean loss)."""
    if not losses:
        return None
    total = losses[0]
    for loss in losses[1:]:
        total = total.float() + loss.float()
    return total


# ---- running a user's script the way `python script.py` would ------------------------------------
def run_script(argv: list[str]) -> int:
    """Run `script.py args...` or `-m module args...` in this process as __main__; its exit code.

    sys.argv is the script's own; sys.path[0] is the script's directory (for -m: the current directory),
    as `python` sets them. An exception is printed as Python prints it and gives exit code 1.
    """
    check_target(argv)
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    try:
        if argv[0] == "-m":
            sys.path[0] = os.getcwd()
            sys.argv = [argv[1], *argv[2:]]
            runner: Callable[[], Any] = functools.partial(
                runpy.run_module, argv[1], run_name="__main__", alter_sys=True
            )
        else:
            script = Path(argv[0])
            sys.argv = list(argv)
            sys.path[0] = str(script.resolve().parent)
            runner = functools.partial(runpy.run_path, str(script), run_name="__main__")
        try:
            runner()
        except SystemExit as exc:
            return _exit_code(exc.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            return 130
        except BaseException:
            traceback.print_exc()
            return 1
        return 0
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0


def _exit_code(code: Any) -> int:
    """SystemExit semantics: None is 0, an int is itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
