"""What the watched script really configured, recorded into meta.json under `observed`.

`ciuic-doctor watch` hooks the constructors every training loop goes through, so the report can describe
the user's job instead of the embedded DeepSeek one:

- `DataLoader.__init__` / `__iter__`: workers, prefetch, pinning, persistence, batch size, sampler,
  multiprocessing context; the loader iterated last before the first step is the training loader.
- `Optimizer.__init__` and the first optimizer step: class, defaults, and per param group the lr, betas,
  eps and weight decay the first step ran with (after the scheduler's own initial change, e.g. OneCycleLR's
  max_lr / 25).
- `LRScheduler.__init__`: the class and the arguments of the outermost constructor (read from its frame).
- `GradScaler.__init__`, `autocast.__init__`: loss scaling and the autocast dtype.
- `init_process_group`, `DistributedDataParallel.__init__`: backend, timeout, world, wrapper, bucket;
  FSDP from its sharded parameters at the first step.
- The step records (watch's listener): LR per step, clip max_norm, backward calls per step.
- `torch.manual_seed`: the seed set before the first step.
- NCCL / TORCH distributed environment, parameter count, the script and its argv (secrets redacted).

The record uses the job spec's section and key names (jobs/default.toml) plus a few keys the spec has
no room for (`optim.class`, `optim.scheduler`, `dataloader.sampler`...); `ciuic_doctor.jobs.observed`
turns it
into a JobSpec. Every hook calls the original first and records after, inside `Observer.guarded`: a bug
here never changes what the script does.

    undo = install(session)      # from WatchSession._install; undo callables for close()
    observed()                   # the record so far (plain JSON types)
"""

from __future__ import annotations

import datetime
import functools
import inspect
import multiprocessing
import os
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ciuic_doctor.machine.envinfo import redact_env
from ciuic_doctor.probes.watch.observe.values import _name, _plain, hyper_parameters, yielding_sampler
from ciuic_doctor.probes.watch.steps import accumulated
from ciuic_doctor.probes.watch.warn_origin import call_as_caller

# The variables a job sets to tune its collectives (the spec's [distributed.env]); launcher-set ones
# (TORCHELASTIC_*, RANK, MASTER_ADDR) describe the launch, not the job's settings.
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "PYTORCH_CUDA_ALLOC_CONF")
OPTIM_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum")
DDP_DEFAULT_BUCKET_MB = 25.0  # DistributedDataParallel's bucket_cap_mb=None means 25 MiB
_STOP: dict[str, int | None] = {"after_steps": None}


def stop_after(steps: int | None) -> None:
    """Stop the watched script with SystemExit(0) right after its `steps`-th optimizer step (`--steps`)."""
    _STOP["after_steps"] = steps


class Observer:
    """The facts gathered in this process; one per watch session."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.loaders: list[dict[str, Any]] = []
        self._loader_index: dict[int, int] = {}  # id(loader) -> index in self.loaders
        self._last_iterated: int | None = None
        self.train_loader: int | None = None
        self.optimizers: list[dict[str, Any]] = []
        self._optimizer_index: dict[int, int] = {}
        self._primary: int | None = None  # id of the first optimizer that stepped
        self.schedulers: list[dict[str, Any]] = []
        self.scaler: dict[str, Any] | None = None
        self.autocast: dict[str, Any] | None = None
        self.process_group: dict[str, Any] = {}
        self.wrapper: dict[str, Any] = {}
        self.parameters: int | None = None
        self.steps = 0
        self.lr: dict[str, Any] = {}
        self.backward_calls: Counter[int] = Counter()
        self.accumulation: Counter[int] = Counter()  # micro-batches per step (steps.accumulated)
        self._param_owner: dict[int, int] = {}  # id(parameter) -> index of the optimizer that steps it
        self._owned: dict[int, tuple[int, frozenset[int]]] = {}  # id(optimizer) -> (count, param ids)
        self.coupled: set[tuple[int, int]] = set()  # (i, j): optimizer i's loss reaches j's parameters
        self.clip_max_norms: Counter[float | None] = Counter()
        self.records = 0
        self.param_dtype: str | None = None
        self.broken = False
        self.seed: int | None = None
        self.argv: list[str] = []  # the script's, read at the first step (watch sets sys.argv after attach)
        self.env = _distributed_env()

    def guarded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a hook body; on an exception stop observing (one line on stderr), never the step records
        nor the user's training."""
        if self.broken:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.broken = True
            where = traceback.extract_tb(exc.__traceback__)[-1]
            print(
                f"ciuic-doctor watch: settings no longer observed after an internal error ({exc!r} at "
                f"{Path(where.filename).name}:{where.lineno}); step records and training continue",
                file=sys.stderr,
            )
            return None

    # ---- constructors ------------------------------------------------------------------------
    def on_loader(self, loader: Any) -> None:
        batch_size = loader.batch_size
        if batch_size is None:  # a batch_sampler was given
            batch_size = getattr(loader.batch_sampler, "batch_size", None)
        context = loader.multiprocessing_context
        start_method = context.get_start_method() if context is not None else None
        workers = int(loader.num_workers)
        self._loader_index[id(loader)] = len(self.loaders)
        self.loaders.append(
            {
                "num_workers": workers,
                "prefetch_factor": loader.prefetch_factor if workers > 0 else None,
                "pin_memory": bool(loader.pin_memory),
                "persistent_workers": bool(loader.persistent_workers),
                # No context given: workers start the way multiprocessing's default does (fork on Linux
                # before Python 3.14).
                "multiprocessing_context": start_method or multiprocessing.get_start_method(),
                "batch_size": batch_size,
                "sampler": _name(yielding_sampler(loader)),
                "batch_sampler": type(loader.batch_sampler).__name__ if loader.batch_sampler else None,
                "drop_last": bool(loader.drop_last),
                "dataset": type(loader.dataset).__name__,
            }
        )

    def on_iter(self, loader: Any) -> None:
        self._last_iterated = id(loader)

    def on_optimizer(self, optimizer: Any) -> None:
        self._optimizer_index[id(optimizer)] = len(self.optimizers)
        self.optimizers.append(
            {
                "class": type(optimizer).__name__,
                # every hyper-parameter the class takes (LBFGS's max_iter, Adafactor's beta2_decay ...)
                "defaults": hyper_parameters(optimizer.defaults),
                "fused": bool(optimizer.defaults.get("fused")),
                # As the script set them: OneCycleLR's cycle_momentum rewrites betas[0] before step 1.
                "groups_at_init": [
                    {
                        **{k: _plain(g[k]) for k in OPTIM_KEYS if k in g},
                        "numel": sum(p.numel() for p in g["params"]),
                    }
                    for g in optimizer.param_groups
                ],
            }
        )

    def on_scheduler(self, scheduler: Any, frame: Any) -> None:
        """`frame` is the outermost constructor's frame: its arguments are the scheduler's arguments."""
        if any(entry["_id"] == id(scheduler) for entry in self.schedulers):
            return  # a subclass constructor calling its parent's: one scheduler
        arguments: dict[str, Any] = {}
        if frame is not None:
            code = frame.f_code
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            arguments = {
                n: _plain(frame.f_locals[n]) for n in names[1:] if n in frame.f_locals and n != "optimizer"
            }
        self.schedulers.append({"_id": id(scheduler), "class": type(scheduler).__name__, **arguments})

    def on_seed(self, seed: Any, *args: Any, **kwargs: Any) -> None:
        if self.seed is None and self._primary is None:  # the seed training starts from
            self.seed = int(seed)

    def on_scaler(self, scaler: Any) -> None:
        if not scaler.is_enabled():  # a disabled scaler keeps none of its settings
            self.scaler = {"enabled": False}
            return
        self.scaler = {
            "enabled": True,
            "init_scale": float(scaler._init_scale),
            "growth_factor": float(scaler._growth_factor),
            "backoff_factor": float(scaler._backoff_factor),
            "growth_interval": int(scaler._growth_interval),
        }

    def on_autocast(self, autocast: Any) -> None:
        if self.autocast is None and getattr(autocast, "_enabled", False):
            self.autocast = {
                "device_type": str(autocast.device),
                "dtype": str(autocast.fast_dtype).removeprefix("torch."),
            }

    def on_process_group(self, bound: dict[str, Any]) -> None:
        import torch.distributed as dist

        timeout = bound.get("timeout")
        backend = str(dist.get_backend()) if dist.is_initialized() else bound.get("backend")
        self.process_group = {
            "backend": backend,
            "timeout_s": timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None,
            "world_size": dist.get_world_size() if dist.is_initialized() else None,
        }

    def on_wrapper(self, name: str, module: Any, options: dict[str, Any]) -> None:
        if not self.wrapper:  # the outermost wrapper is built last; keep the first (the model's)
            self.wrapper = {"wrapper": name, **{k: _plain(v) for k, v in options.items()}}
            if isinstance(module, torch.nn.Module):
                self.parameters = sum(p.numel() for p in module.parameters())

    # ---- steps -------------------------------------------------------------------------------
    def on_first_step(self, optimizer: Any) -> None:
        """The settings the first step ran with (schedulers have changed the lr by now)."""
        self.argv = [*sys.argv]
        if self._last_iterated in self._loader_index:
            self.train_loader = self._loader_index[self._last_iterated]
        index = self._optimizer_index.get(id(optimizer))
        if index is None:  # built before watch was attached
            self.on_optimizer(optimizer)
            index = len(self.optimizers) - 1
        entry = self.optimizers[index]
        groups = []
        for group in optimizer.param_groups:
            params = group["params"]
            groups.append(
                {
                    **{k: _plain(group[k]) for k in OPTIM_KEYS if k in group},
                    "params": len(params),
                    "numel": sum(p.numel() for p in params),
                }
            )
        entry["param_groups"] = groups
        params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
        trainable = sum(p.numel() for p in params.values())
        entry["parameters"] = trainable
        if not self.wrapper and (wrapper := sharded_wrapper(list(params.values()))):
            self.wrapper = {"wrapper": wrapper, "parameters_are_shards": True}
        if self.parameters is None:
            self.parameters = trainable
        first = next(iter(params.values()), None)
        self.param_dtype = str(first.dtype).removeprefix("torch.") if first is not None else None
        self.env = _distributed_env()  # as the first step saw it (a script may export NCCL_* itself)
        if not self.process_group:
            self._process_group_made_before_watch()

    def _process_group_made_before_watch(self) -> None:
        """A process group created before watch attached (the explicit attach() form): its backend and
        world are still readable; its timeout is not (no public getter), so it stays unobserved."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.process_group = {
                "backend": str(dist.get_backend()),
                "timeout_s": None,
                "timeout_known": False,
                "world_size": dist.get_world_size(),
            }

    def on_any_step(self, optimizer: Any) -> None:
        """Every optimizer's step: the micro-batches it accumulated, and whether its loss reaches another
        optimizer's parameters (adversarial objectives: a GAN's generator loss goes through D)."""
        index = self._optimizer_index.get(id(optimizer))
        if index is None:  # built before watch was attached
            self.on_optimizer(optimizer)
            index = len(self.optimizers) - 1
        group = getattr(self.session, "_group", None)
        if group is None:
            return
        if group.sites:
            self.accumulation[accumulated(group)] += 1
        mine = self._params_of(optimizer)
        if group.reached:
            for pid in group.reached - mine:
                other = self._param_owner.get(pid)
                if other is not None and other != index:
                    self.coupled.add((index, other))

    def _params_of(self, optimizer: Any) -> frozenset[int]:
        """ids of its parameters, gathered again only when their count changes (not every step)."""
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        cached = self._owned.get(id(optimizer))
        if cached is not None and cached[0] == count:
            return cached[1]
        mine = frozenset(id(p) for g in optimizer.param_groups for p in g["params"])
        index = self._optimizer_index[id(optimizer)]
        for pid in mine:
            self._param_owner.setdefault(pid, index)
        self._owned[id(optimizer)] = (count, mine)
        return mine

    def on_step(self, optimizer: Any) -> None:
        self.on_any_step(optimizer)
        if self._primary is None:
            self._primary = id(optimizer)
            self.on_first_step(optimizer)
            self.steps = 1
            self._lr_seen(optimizer)
            self.guarded(self.write_meta)
        elif self._primary == id(optimizer):
            self.steps += 1
            self._lr_seen(optimizer)
        else:
            return
        limit = _STOP["after_steps"]
        if limit is not None and self.steps >= limit:
            print(f"ciuic-doctor watch: stopping after {self.steps} optimizer steps", file=sys.stderr)
            raise SystemExit(0)  # unwinds the script; close() writes the records still pending

    def _lr_seen(self, optimizer: Any) -> None:
        lr = optimizer.param_groups[0].get("lr")
        if isinstance(lr, torch.Tensor):
            if lr.device.type != "cpu":
                return  # reading it would sync the device every step
            lr = lr.item()
        if not isinstance(lr, int | float):
            return
        lr = float(lr)
        seen = self.lr
        if not seen:
            seen.update(first=lr, peak=lr, peak_step=self.steps, min=lr, last=lr)
        if lr > seen["peak"]:
            seen.update(peak=lr, peak_step=self.steps)
        seen["min"] = min(seen["min"], lr)
        seen["last"] = lr
        seen["steps"] = self.steps

    def on_record(self, record: dict[str, Any]) -> None:
        """watch's listener: one call per written step record."""
        self.records += 1
        calls = record.get("backward_calls")
        if isinstance(calls, int) and calls > 0:
            self.backward_calls[calls] += 1
        clip = record.get("clip_max_norm")
        self.clip_max_norms[float(clip) if isinstance(clip, int | float) else None] += 1

    # ---- the record --------------------------------------------------------------------------
    def observed(self) -> dict[str, Any]:
        from ciuic_doctor.probes.watch.observe.sections import build

        return build(self)

    def write_meta(self) -> None:
        """Rank 0's record goes into meta.json `observed`; another rank's into RUN/observed.rank<R>.json
        (`ciuic_doctor.jobs.observed.merge_ranks` notes where they disagree). A process that stepped nothing
        (mp.spawn's launcher: its ranks are its children) never replaces a record that has steps."""
        run, rank = self.session.run, self.session.rank
        if rank != 0:
            if self.steps:
                run.write_json(f"observed.rank{rank}.json", self.observed())
            return
        if not self.steps:
            existing = run.read_meta().get("observed")
            if isinstance(existing, dict) and (existing.get("job") or {}).get("steps_recorded"):
                return
        run.update_meta(observed=self.observed())


_OBSERVERS: list[Observer] = []


def observed() -> dict[str, Any]:
    """The record of the last session in this process ({} when none was started)."""
    return _OBSERVERS[-1].observed() if _OBSERVERS else {}


def write_meta() -> None:
    """Write the last session's record into meta.json (rank 0), e.g. after close() flushed every step."""
    if _OBSERVERS:
        _OBSERVERS[-1].guarded(_OBSERVERS[-1].write_meta)


def install(session: Any) -> list[Callable[[], None]]:
    """Hook the constructors for `session`; the undo callables restore them (the last writes meta.json)."""
    from torch.amp.autocast_mode import autocast
    from torch.amp.grad_scaler import GradScaler
    from torch.optim.lr_scheduler import LRScheduler
    from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook
    from torch.utils.data import DataLoader

    observer = Observer(session)
    _OBSERVERS.append(observer)
    undo: list[Callable[[], None]] = []
    guarded = observer.guarded

    def after(owner: Any, name: str, record: Callable[..., None]) -> None:
        """Wrap owner.name so that `record(*args, **kwargs)` runs after the original, guarded."""
        original = owner.__dict__[name]

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = call_as_caller(original, *args, **kwargs)  # its warnings keep the script's line
            guarded(record, *args, **kwargs)
            return result

        setattr(owner, name, wrapper)
        undo.append(functools.partial(setattr, owner, name, original))

    after(DataLoader, "__init__", lambda loader, *a, **k: observer.on_loader(loader))
    after(DataLoader, "__iter__", lambda loader, *a, **k: observer.on_iter(loader))
    after(Optimizer, "__init__", lambda optimizer, *a, **k: observer.on_optimizer(optimizer))
    after(GradScaler, "__init__", lambda scaler, *a, **k: observer.on_scaler(scaler))
    after(autocast, "__init__", lambda ac, *a, **k: observer.on_autocast(ac))

    def on_scheduler(scheduler: Any, *args: Any, **kwargs: Any) -> None:
        observer.on_scheduler(scheduler, _constructor_frame(type(scheduler)))

    after(LRScheduler, "__init__", on_scheduler)
    # torch.manual_seed is torch.random.manual_seed (HF set_seed and Lightning seed_everything call it).
    original_seed = torch.manual_seed
    after(torch.random, "manual_seed", observer.on_seed)
    torch.manual_seed = torch.random.manual_seed
    undo.append(functools.partial(setattr, torch, "manual_seed", original_seed))
    _hook_distributed(observer, after, undo)
    handle = register_optimizer_step_post_hook(lambda opt, a, k: _step_hook(observer, opt))
    session.add_listener(lambda record: guarded(observer.on_record, record))

    def finish() -> None:
        handle.remove()
        guarded(observer.write_meta)

    undo.insert(0, finish)  # undone last: the record is complete by then
    return undo


def _step_hook(observer: Observer, optimizer: Any) -> None:
    observer.guarded(observer.on_step, optimizer)  # SystemExit (--steps) is no Exception: it passes


def _hook_distributed(observer: Observer, after: Callable[..., None], undo: list) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    import torch.distributed.distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel

    signature = inspect.signature(c10d.init_process_group)

    def on_init(*args: Any, **kwargs: Any) -> None:
        from ciuic_doctor.launch import note_user_process_group

        note_user_process_group()  # end this process without gloo's teardown abort (see there)
        observer.on_process_group(dict(signature.bind_partial(*args, **kwargs).arguments))

    # Scripts call it as dist.init_process_group or through c10d (Lightning, accelerate): both names, one
    # wrapper (torch.distributed re-exports c10d's function, so the two are one object until patched).
    after(c10d, "init_process_group", on_init)
    original = dist.__dict__.get("init_process_group")
    dist.init_process_group = c10d.init_process_group
    undo.append(functools.partial(setattr, dist, "init_process_group", original))
    ddp_signature = inspect.signature(DistributedDataParallel.__init__)

    def on_ddp(ddp: Any, *args: Any, **kwargs: Any) -> None:
        bound = ddp_signature.bind_partial(ddp, *args, **kwargs).arguments
        bucket = bound.get("bucket_cap_mb")
        options = {
            "bucket_cap_mb": float(bucket) if bucket is not None else DDP_DEFAULT_BUCKET_MB,
            **{
                k: bound[k]
                for k in ("find_unused_parameters", "gradient_as_bucket_view", "static_graph")
                if k in bound
            },
        }
        observer.on_wrapper("DistributedDataParallel", ddp.module, options)

    after(DistributedDataParallel, "__init__", on_ddp)
    # FSDP is read from its parameters at the first step (sharded_wrapper), not hooked: importing
    # torch.distributed.fsdp at attach would cost every watched script 1-4 s.


def sharded_wrapper(params: list[Any]) -> str | None:
    """FSDP1 holds FlatParameters, FSDP2 (fully_shard) DTensors; None for unsharded parameters."""
    if any(getattr(p, "_is_flat_param", False) for p in params):
        return "FullyShardedDataParallel"
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in params):
            return "fully_shard (FSDP2, DTensor parameters)"
    return None


def _constructor_frame(cls: type) -> Any:
    """The frame of `cls.__init__` (the outermost constructor) on the current stack, if any."""
    init = inspect.unwrap(cls.__init__)
    code = getattr(init, "__code__", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def _distributed_env() -> dict[str, str]:
    return redact_env({k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)})
