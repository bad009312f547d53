"""Zero-code per-step recording inside a training process (`ciuic-doctor watch -- script.py`).

One record per optimizer step (of every optimizer) in RUN/steps.rank<R>.jsonl, from hooks on what every
PyTorch training loop already calls, so the user's script stays as it is:

- `torch.autograd.backward` (which `Tensor.backward` calls): the scalar loss and when backward started;
  for a GradScaler-scaled loss, the unscaled tensor that was handed to `scaler.scale`. The backward calls
  since the last optimizer step (a "backward group") belong to the next optimizer that steps; a second
  optimizer that steps on the same gradients (no backward in between) gets the same group.
- `torch.nn.utils.clip_grad_norm_`: the total norm it returns and `max_norm` (and the same two from
  `torch.nn.utils.clip_grads_with_norm_`, through which accelerate ≥ 1.16 clips); a script that does not clip
  gets the norm computed from the gradients the step uses (`get_total_norm`): before the step, or, for
  `optimizer.step(closure)` (Lightning, LBFGS), right after the closure's first evaluation ran backward.
- torch.optim's global optimizer step pre/post hooks: the step boundary and the LR. A closure's later
  evaluations (LBFGS's line search) add no loss: the step's loss is the first one, what step() returns.
- `torch.optim.Optimizer.__init__`: each optimizer's index in creation order (`optimizer` in the record).
- `torch.amp.GradScaler.scale/step/update`: the scale the step used (`loss_scale`), the one update() set
  (`loss_scale_next`) and skipped. A skipped step never reaches the optimizer (no post hook fires), so
  with an enabled scaler the record is made in `update()`, from that optimizer's found-inf flags.
- `DistributedDataParallel.__init__`: which parameters must be identical on which ranks, for the
  cross-rank weight checksum (an all_gather of one float64 sum at step 1 and every K steps), taken only
  once every rank of the group has said, through the process group's store, that it is watched.

Values that live on the device are read without a device sync (see watch_values). A bug in these hooks
must never break the user's training: the first exception disables recording with one line on stderr.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ciuic_doctor.probes.watch import children as watch_children
from ciuic_doctor.probes.watch import frameworks as watch_frameworks
from ciuic_doctor.probes.watch import hooks as watch_hooks
from ciuic_doctor.probes.watch.records import RECORD_KEYS, STREAM, StepRecords  # noqa: F401 - re-exported
from ciuic_doctor.probes.watch.steps import (
    TRACED_GROUPS,
    Group,
    OptimizerState,
    backward_site,
    grad_norm,
    graph_parameters,
    optimizer_params,
)
from ciuic_doctor.probes.watch.target import exit_code, run_script  # noqa: F401 - the public runner
from ciuic_doctor.probes.watch.values import (
    PendingQueue,
    Replicas,
    UssSampler,
    is_sharded,
    last_step_and_segment,
)
from ciuic_doctor.rundir.store import RunDir

_ACTIVE: dict[str, WatchSession] = {}  # "session": the one recording in this process


@dataclass(kw_only=True)
class WatchConfig:
    checksum_every: int = 10  # steps between cross-rank weight checksums (and at step 1)
    uss_every: int = 10  # fewest steps between USS reads (more when a read is costly)
    grad_norm: bool = True  # compute the norm when the script does not clip
    checksum: bool = True
    snapshot_on_leak: bool = False  # CUDA only: dump a memory snapshot when allocated memory keeps growing
    agree_timeout_s: float = 60.0  # how long step 1 waits for every rank to say it is watched
    follow_children: bool = True  # mp.spawn ranks and re-executed argv record their own streams
    moe: bool = True  # expert load of MoE routers and tokens per step (probes/watch/moe.py)
    moe_every: int = 10  # steps between expert-load samples (and at step 1)


def current() -> WatchSession | None:
    """The session recording in this process, if any."""
    return _ACTIVE.get("session")


def attach(*, run: RunDir, rank: int | None = None, config: WatchConfig | None = None) -> WatchSession:
    """Start recording into `run` (or join the session already recording in this process).

    `rank` None: the process group's rank once one exists (mp.spawn ranks learn theirs in
    init_process_group), else $RANK, else 0; the stream file is opened at the first record.
    """
    active = _ACTIVE.get("session")
    if active is not None:
        active._refs += 1
        return active
    session = WatchSession(run=run, rank=rank, config=config or WatchConfig())
    session._install()
    _ACTIVE["session"] = session
    return session


# ---- processes the script starts (children.py patches the launchers; these run in the child) ------
def _forget_in_forked_child() -> None:
    session = current()
    if session is not None:
        session.forget_in_child()
    watch_children.forget_children()


os.register_at_fork(after_in_child=_forget_in_forked_child)


class WatchedTarget:
    """A multiprocessing target with watch attached around it (pickled by reference to this module): what
    children.install puts in place of the script's own target, so the child records its own stream."""

    watched = True  # children.install never wraps a target twice

    def __init__(
        self,
        target: Callable,
        *,
        run_path: str,
        config: dict[str, Any],
        index: int | None,
        hang: dict[str, Any] | None = None,
        script: list[str] | None = None,
    ):
        self.target = target
        self.run_path = run_path
        self.config = config
        self.index = index
        self.hang = hang  # the watchdog's settings (None: the launching process armed none)
        self.script = script  # the command line watch runs: the job's name in `observed`

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        watch_children.spawn_started(self.index)
        if self.script is not None:
            watch_children.set_target(self.script)
        active = current()
        if active is not None:  # a fork start: the parent's session was inherited
            active.forget_in_child()
        config = WatchConfig(**self.config)
        session = attach(run=RunDir(Path(self.run_path)), rank=None, config=config)
        from ciuic_doctor.probes.watch.hang import arm_quietly

        disarm = arm_quietly(session, self.hang)  # every rank has one, however it was started
        code = 1
        try:
            result = self.target(*args, **kwargs)
            code = 0
            return result
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            raise
        finally:
            if disarm is not None:
                disarm(code)
            session.close()
            from ciuic_doctor.probes.watch import observe as watch_observe

            watch_observe.write_meta()  # this rank's final `observed`, every step record flushed
            if session.steps_written:
                where = session.run.stream_path("steps", session.rank)
                print(
                    f"ciuic-doctor watch: rank {session.rank} (pid {os.getpid()}, started by the script): "
                    f"{session.steps_written} steps recorded in {where}",
                    file=sys.stderr,
                )


class WatchSession(StepRecords):
    """The hooks of one process and the stream they write. Use `attach()`; close with `close()`."""

    def __init__(self, *, run: RunDir, rank: int | None, config: WatchConfig) -> None:
        self.run = run
        self._rank = rank
        self.config = config
        self.steps_written = 0
        self.segment = 1
        self.checksum_note: str | None = None  # why the cross-rank checksum was skipped
        self._refs = 1
        self._pid = os.getpid()
        self._writer: Any = None  # opened at the first record, once the rank is known
        self._first_step = 0  # the run's last step on this rank when this session began
        self._queue = PendingQueue(finish=self._write)
        self._uss = UssSampler(every=config.uss_every)
        self._group = Group()
        self._optimizers: weakref.WeakKeyDictionary[Any, OptimizerState] = weakref.WeakKeyDictionary()
        self._created: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._n_created = 0
        self._primary: OptimizerState | None = None  # the first to step: its steps carry the checksum
        self._in_scaler_step: set[int] = set()  # id() of optimizers inside GradScaler.step
        self._awaiting_update: list[OptimizerState] = []
        self._reevaluating = 0  # inside a closure's second or later evaluation
        self._framework_step: Callable[[], int | None] | None = None
        self._replicas: list[Replicas] = []
        self._agreed: bool | None = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self._step_hooks: list[Callable[[int, bool], dict[str, Any] | None]] = []
        self._undo: list[Callable[[], None]] = []
        self._device: torch.device | None = None
        self._broken = False
        self._closed = False
        self._backward_depth = 0
        self._scaled = False  # a GradScaler scaled a loss: backward() may see a scaled one
        self._groups_traced = 0  # groups whose losses' graphs were walked (which parameters they reach)
        self._sharded: dict[int, bool] = {}  # id(optimizer) -> holds FSDP / DTensor shards
        self._snapshot = None
        if rank is not None:
            self._continue_run(rank)
        if config.snapshot_on_leak and torch.cuda.is_available():
            from ciuic_doctor.probes.watch.snapshot import LeakSnapshot

            self._snapshot = LeakSnapshot(run=run, rank=self.rank)

    # ---- public ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        if self._rank is None:
            return watch_children.resolve_rank()
        return self._rank

    def watched_target(self, target: Callable, *, index: int | None) -> WatchedTarget:
        """`target` (a process the script starts) wrapped so that its process records its own stream and
        arms its own hang watchdog."""
        return WatchedTarget(
            target,
            run_path=str(self.run.path),
            config=asdict(self.config),
            index=index,
            hang=watch_children.hang_settings(),
            script=watch_children.watched_argv(),
        )

    def set_step(self, step: int) -> None:
        """The number of steps already done (a resumed job): the next record is step + 1."""
        self._first_step = step
        for state in self._optimizers.values():
            state.count = 0

    def set_step_source(self, source: Callable[[], int | None] | None) -> None:
        """A framework's own counter of finished optimizer steps (HF `state.global_step`, Lightning
        `global_step`): the record of the step in progress is numbered source() + 1."""
        self._framework_step = source

    def add_step_hook(self, hook: Callable[[int, bool], dict[str, Any] | None]) -> None:
        """Call `hook(step, primary)` as each step ends, before its record is queued; the fields it returns
        join that record (`tokens`). `primary`: the first optimizer to step (one per step)."""
        self._step_hooks.append(hook)

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
        if not self._broken and os.getpid() == self._pid:
            # Steps whose scaler.update() never came are still steps. No collective here: the other
            # ranks may be past their last step already.
            self._guarded(self._flush_awaiting, gather=False)
            self._guarded(self._queue.flush)
        if self._snapshot is not None:
            self._guarded(self._snapshot.stop)
        self._close_stream()
        if _ACTIVE.get("session") is self:
            del _ACTIVE["session"]

    def forget_in_child(self) -> None:
        """In a forked child: undo the hooks and write nothing (the parent's stream is not ours)."""
        self._closed = self._broken = True
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
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
        from torch.amp.grad_scaler import GradScaler
        from torch.nn.parallel import DistributedDataParallel
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        session = self

        self._patch(torch.autograd, "backward", functools.partial(watch_hooks.backward, session))
        self._undo += watch_hooks.install_clip(session)
        self._patch(GradScaler, "scale", functools.partial(watch_hooks.scale, session))
        self._patch(GradScaler, "step", functools.partial(watch_hooks.scaler_step, session))
        self._patch(GradScaler, "update", functools.partial(watch_hooks.scaler_update, session))
        self._patch(DistributedDataParallel, "__init__", functools.partial(watch_hooks.ddp_init, session))
        self._patch(torch.optim.Optimizer, "__init__", functools.partial(watch_hooks.optimizer_init, session))
        pre = register_optimizer_step_pre_hook(lambda opt, a, k: self._guarded(self._pre_step, opt, a, k))
        post = register_optimizer_step_post_hook(lambda opt, a, k: self._guarded(self._post_step, opt))
        self._undo += [pre.remove, post.remove]
        self._undo.append(watch_frameworks.install(self))
        if self.config.follow_children:
            self._undo.append(watch_children.install(self))
        atexit.register(self._at_exit)
        self._undo.append(functools.partial(atexit.unregister, self._at_exit))
        # record what the script configured into meta.json "observed" (probes/watch/observe.py)
        from ciuic_doctor.probes.watch import observe as watch_observe

        self._undo += watch_observe.install(self)
        if self.config.moe:  # MoE router load and tokens per step
            from ciuic_doctor.probes.watch import moe as watch_moe

            self._undo += watch_moe.install(self)

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
    def _continue_run(self, rank: int) -> None:
        """Number this session's steps after the run's last one on this rank; it is the next segment."""
        last_step, last_segment = last_step_and_segment(self.run.stream_path(STREAM, rank))
        self._first_step, self.segment = last_step, last_segment + 1 if last_step else 1

    def _on_optimizer_created(self, optimizer: Any) -> None:
        if optimizer not in self._created:
            self._created[optimizer] = self._n_created
            self._n_created += 1

    def _state(self, optimizer: Any) -> OptimizerState:
        state = self._optimizers.get(optimizer)
        if state is None:
            if optimizer not in self._created:  # made before attach: numbered in the order it steps
                self._on_optimizer_created(optimizer)
            state = OptimizerState(
                ref=weakref.ref(optimizer), index=self._created[optimizer], name=type(optimizer).__name__
            )
            self._optimizers[optimizer] = state
            if self._primary is None:
                self._primary = state
        return state

    def _on_backward(self, tensors: Any) -> None:
        if self._group.sealed:
            if self._awaiting_update:
                self._flush_awaiting(stepped_only=True)  # a scaler that stepped but never updated
            self._group = Group()
        group = self._group
        if isinstance(tensors, (list, tuple)) and len(tensors) == 1:
            tensors = tensors[0]
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1 and not self._reevaluating:
            loss = getattr(tensors, "_ciuic_unscaled", tensors) if self._scaled else tensors  # a miss: ~1 us
            group.losses.append(loss.detach())
            if self._device is None:  # the loss lives where the model does
                self._device = tensors.device
            if self._groups_traced < TRACED_GROUPS and tensors.grad_fn is not None:
                if group.reached is None:
                    self._groups_traced += 1
                    group.reached = set()
                group.reached |= graph_parameters(tensors)
        if not self._reevaluating:
            group.sites[backward_site()] += 1
        group.backward_calls += 1
        if group.t_first_backward is None:
            group.t_first_backward = time.perf_counter()

    def _on_clip(self, total: Any, max_norm: Any) -> None:
        if isinstance(total, torch.Tensor) and not self._reevaluating:
            self._group.clip_norm = total.detach()
            self._group.clip_max_norm = float(max_norm) if max_norm is not None else None

    def _on_scale(self, scaler: Any, outputs: Any, result: Any) -> None:
        if scaler.is_enabled() and isinstance(outputs, torch.Tensor) and isinstance(result, torch.Tensor):
            result._ciuic_unscaled = outputs  # the loss as computed; backward() sees `result`
            self._scaled = True
            if self._group.sealed:
                self._flush_awaiting(stepped_only=True)
                self._group = Group()
            if self._group.scale_used is None:  # the scale this step's loss was multiplied by
                self._group.scale_used = scaler._scale.detach().clone()
            self._group.scaler = scaler

    def _on_scaler_step(self, optimizer: Any) -> None:
        self._await_update(self._state(optimizer))

    def _await_update(self, state: OptimizerState) -> None:
        if state not in self._awaiting_update:
            state.group = self._group
            self._group.sealed = True
            self._awaiting_update.append(state)

    def _pre_step(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        state = self._state(optimizer)
        state.grad_norm = None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if callable(closure):  # the closure runs backward inside step(): the norm comes after it
            watched = self._watched_closure(state, closure)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": watched}
            return (args[0], watched, *args[2:]), kwargs
        self._compute_norm(state, optimizer)
        return None

    def _watched_closure(self, state: OptimizerState, closure: Callable) -> Callable:
        calls = 0

        def watched_closure() -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:  # LBFGS's re-evaluations: step() returns the first evaluation's loss
                self._reevaluating += 1
                try:
                    return closure()
                finally:
                    self._reevaluating -= 1
            result = closure()
            optimizer = state.ref()
            if optimizer is not None:
                self._guarded(self._compute_norm, state, optimizer)
            return result

        return watched_closure

    def _compute_norm(self, state: OptimizerState, optimizer: Any) -> None:
        if not self.config.grad_norm or self._group.clip_norm is not None:
            return
        sharded = self._sharded.get(id(optimizer))
        if sharded is None:
            sharded = self._sharded[id(optimizer)] = is_sharded(optimizer_params(optimizer))
        norm = None if sharded else grad_norm(optimizer)  # a shard's norm is not the model's norm
        if norm is None:
            return
        state.grad_norm = norm

    def _post_step(self, optimizer: Any) -> None:
        state = self._state(optimizer)
        state.stepped = True
        if self._device is None:
            self._device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
        if id(optimizer) in self._in_scaler_step or self._group.scaler is not None:
            self._await_update(state)  # its record waits for scaler.update(): skipped or not
            return
        self._group.sealed = True
        self._finalize(state, self._group, scaler=None, found_inf=None)

    def _flush_awaiting(
        self, *, scaler: Any = None, found_inf: dict | None = None, gather: bool = True, stepped_only=False
    ) -> None:
        """Record the steps that waited for scaler.update() (or whose update never came)."""
        waiting, self._awaiting_update = self._awaiting_update, []
        for state in waiting:
            if stepped_only and not state.stepped:
                self._awaiting_update.append(state)
                continue
            flags = found_inf.get(id(state.ref())) if found_inf is not None else None
            self._finalize(state, state.group or self._group, scaler=scaler, found_inf=flags, gather=gather)
