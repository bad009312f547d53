"""The embedded job's training loop: the seed article's loop (tricks 4, 5 and 7), done right.

- DDP under torchrun: gloo on CPU, nccl on CUDA (or the spec's backend), gradient buckets of
  `distributed.bucket_cap_mb`, `broadcast_buffers=False` (the model's buffers are constants: the
  per-forward broadcast DDP does by default would only add a collective to every step).
- AdamW with weight decay on matrices only (norm weights are not decayed, as in GPT/LLaMA recipes).
- The LR: `base_lr` scaled by the spec's rule for the global batch actually trained,
  sqrt (the seed's formula: base · sqrt(global / reference)) or linear (Goyal et al. 2017), driven by
  OneCycleLR (max_lr = that LR, pct_start = warmup_pct, total_steps = steps, cos annealing). Momentum
  cycling is off: it would override the spec's betas.
- Gradient clipping with `clip_grad_norm_` (after `unscale_` under fp16: clipping scaled gradients
  clips nothing).
- Precision: fp32; bf16 autocast; fp16 autocast + `torch.amp.GradScaler(init_scale, growth_interval)`
  (CPU too). Gradient accumulation with DDP's `no_sync` on all but the last micro-batch.
- Periodic checkpoints (rank 0 writes, then a barrier) and full resume: see checkpoint.py.

Every rank initialises the model from the same seed; the data differ by rank through the
DistributedSampler, never through a per-rank seed.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ciuic_doctor.errors import UserError
from ciuic_doctor.jobs.balance import LoadBalancer
from ciuic_doctor.jobs.data import batches_per_epoch, make_loader
from ciuic_doctor.jobs.inject import Injections
from ciuic_doctor.jobs.model import build_model, parameter_count
from ciuic_doctor.jobs.options import JobOptions, World
from ciuic_doctor.jobs.spec import JobSpec

PRECISION_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def setup_distributed(spec: JobSpec) -> World:
    """Join the process group when started by torchrun (env:// variables set); else a world of one."""
    from ciuic_doctor.launch import in_torchrun, init_distributed

    if not in_torchrun():
        return World(device=torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    # The spec's NCCL_* / other env must be in place before the process group exists.
    os.environ.update(spec.distributed.env)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank, world, backend = init_distributed(spec.distributed.timeout_s, spec.distributed.backend)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    return World(rank=rank, world=world, local_rank=local_rank, backend=backend, device=device)


def effective_lr(spec: JobSpec, world: int) -> tuple[float, int]:
    """(LR, global batch): base_lr scaled from the reference batch by the spec's rule.

    >>> from ciuic_doctor.jobs.spec import load_spec, with_updates
    >>> spec = with_updates(load_spec(), {"batch.per_process": 64, "batch.reference": 256})
    >>> effective_lr(spec, 16)  # 64 x 16 = 1024 = 4 x 256: sqrt rule doubles the LR
    (0.02, 1024)
    """
    global_batch = spec.batch.per_process * spec.batch.grad_accum * world
    ratio = global_batch / spec.batch.reference
    factor = {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[spec.optim.lr_scaling]
    return spec.optim.base_lr * factor, global_batch


def warmup_pct(pct: float, total_steps: int) -> float:
    """OneCycleLR's pct_start, nudged for very short runs.

    OneCycleLR divides by (pct_start · total_steps − 1): exactly one warm-up step divides by zero. A run
    that short (a test) gets 1.5 warm-up steps, or a fraction of one below 3 steps.
    """
    if pct * total_steps > 1.0:
        return pct
    return 1.5 / total_steps if total_steps >= 3 else 0.1


def _no_buffer_sync(ddp_class: type) -> dict[str, bool]:
    """DDP's switch for the per-forward buffer broadcast: `forward_sync_buffers` where it exists
    (torch >= 2.13 deprecates `broadcast_buffers`), else `broadcast_buffers`."""
    if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _optimizer(spec: JobSpec, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": spec.optim.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    betas = tuple(spec.optim.betas)
    if spec.optim.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    if spec.optim.name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas)
    return torch.optim.SGD(groups, lr=lr, momentum=betas[0])


class Trainer:
    """Model, optimizer, schedule, scaler and data of one rank; `train_step()` runs one optimizer step."""

    def __init__(self, spec: JobSpec, world: World, *, total_steps: int, injections: Injections) -> None:
        self.spec = spec
        self.world = world
        self.rank = world.rank
        self.total_steps = total_steps
        self.injections = injections
        self.step = 0
        self.micro_batches = 0  # micro-batches consumed by this rank since the start of training
        self.step_times_s: list[float] = []
        self.lr, self.global_batch = effective_lr(spec, world.world)

        self.module = build_model(spec, world.device)
        injections.apply_to_model(self.module)  # moe-bias plants an unbalanced router
        self.balancer = LoadBalancer(self.module)  # DeepSeek-V3's bias update: a balanced default
        self.model: torch.nn.Module = self.module
        if world.backend is not None:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(
                self.module,
                device_ids=[world.device.index] if world.device.type == "cuda" else None,
                bucket_cap_mb=spec.distributed.bucket_cap_mb,
                **_no_buffer_sync(DistributedDataParallel),
            )
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = _optimizer(spec, self.module, self.lr)
        self.scheduler = torch.optim.lr_scheduler.OneCycleLR(
            self.optimizer,
            max_lr=self.lr,
            total_steps=total_steps,
            pct_start=warmup_pct(spec.optim.warmup_pct, total_steps),
            cycle_momentum=False,
        )
        self.mode = spec.precision.mode
        self.scaler = torch.amp.GradScaler(
            world.device.type,
            init_scale=spec.precision.init_scale,
            growth_interval=spec.precision.growth_interval,
            enabled=self.mode == "fp16",
        )
        self.loader, self.sampler = make_loader(spec, world.rank, world.world)
        self.batches_per_epoch = batches_per_epoch(self.sampler, spec.batch.per_process)
        if self.batches_per_epoch < 1:
            raise UserError("the dataset is smaller than one batch per rank: lower batch.per_process")
        self._iterator: Any = None

    @property
    def parameter_count(self) -> int:
        return parameter_count(self.module)

    # ---- data ----------------------------------------------------------------------------------
    def data_position(self) -> tuple[int, int]:
        """(sampler epoch, samples of that epoch already consumed by this rank)."""
        epoch, batches = divmod(self.micro_batches, self.batches_per_epoch)
        return epoch, batches * self.spec.batch.per_process

    def _next_batch(self) -> torch.Tensor:
        while True:
            if self._iterator is None:
                self.sampler.set_position(*self.data_position())
                self._iterator = iter(self.loader)
            try:
                batch = next(self._iterator)
                break
            except StopIteration:  # next epoch: data_position() moves on
                if self.loader.persistent_workers:
                    self._iterator = None  # the loader resets its workers for the next epoch
                else:
                    self.stop_workers()  # the next epoch forks new ones: see stop_workers
        self.micro_batches += 1
        return batch.to(self.world.device, non_blocking=self.loader.pin_memory)

    # ---- one optimizer step ----------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step (grad_accum micro-batches); returns its wall time in seconds."""
        start = time.perf_counter()
        step = self.step + 1
        accum = self.spec.batch.grad_accum
        dtype = PRECISION_DTYPES[self.mode]
        self.injections.before_forward(step, self.rank, self.module)
        for micro in range(accum):
            batch = self._next_batch()
            last = micro == accum - 1
            no_sync = self.model.no_sync if (not last and self.model is not self.module) else None
            with no_sync() if no_sync else contextlib.nullcontext():
                with torch.autocast(
                    self.world.device.type, dtype=dtype or torch.float32, enabled=bool(dtype)
                ):
                    loss = self.model(input_ids=batch, labels=batch).loss / accum
                self.scaler.scale(loss).backward()
        self.injections.after_backward(step, self.params)
        self.scaler.unscale_(self.optimizer)  # no-op unless fp16: clip the true gradients
        if self.spec.optim.clip_max_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.spec.optim.clip_max_norm)
        factor = self.injections.lr_factor(step)
        saved = [group["lr"] for group in self.optimizer.param_groups]
        if factor != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] *= factor
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.balancer.step()
        for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
        with warnings.catch_warnings():
            # A skipped first step (fp16 overflow) makes OneCycleLR warn that it stepped before the
            # optimizer did; the schedule must still advance one step per iteration.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        self.last_loss = loss.detach() * accum
        elapsed = time.perf_counter() - start
        self.step_times_s.append(elapsed)
        return elapsed

    # ---- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        epoch, start_index = self.data_position()
        return {
            "step": self.step,
            "micro_batches": self.micro_batches,
            "sampler": {"epoch": epoch, "start_index": start_index},
            "world_size": self.world.world,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "spec": self.spec.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["spec"].get("model") != self.spec.to_dict()["model"]:
            raise UserError("--resume: the checkpoint was made with a different [model]")
        total = state["scheduler"].get("total_steps")
        if total != self.total_steps:
            raise UserError(
                f"--resume: the checkpoint's LR schedule runs {total} steps; pass --steps {total}"
            )
        if state["world_size"] != self.world.world:
            print(
                f"note: checkpoint from {state['world_size']} ranks resumed on {self.world.world}: "
                "the data order differs from an uninterrupted run",
                file=sys.stderr,
            )
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.micro_batches = int(state["micro_batches"])
        self._iterator = None  # the next batch comes from the restored position (workers are reused)

    def stop_workers(self) -> None:
        """Stop the DataLoader's worker processes now, and wait for its queue threads to end.

        Why not just drop the iterator: its workers would then stop in `__del__`, at a moment nobody
        chooses, and its index queues' feeder threads end later still. With multiprocessing_context
        "fork", a new DataLoader forking while such a thread exits can hand its child CPython 3.11's
        thread-list lock held, and the child hangs in `os.fork()` (its stack ends in
        PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept); checkpoint-check, which builds a trainer
        per resume variant, hung so. Stopping here also frees the workers' memory when close() says so.
        """
        # With persistent_workers the loader keeps the same iterator as its own `_iterator`.
        iterator = self._iterator or getattr(self.loader, "_iterator", None)
        self._iterator = None
        if getattr(self.loader, "_iterator", None) is not None:
            self.loader._iterator = None
        shutdown = getattr(iterator, "_shutdown_workers", None)  # the multi-process iterator only
        if shutdown is None:
            return
        shutdown()
        for queue in getattr(iterator, "_index_queues", []):
            feeder = getattr(queue, "_thread", None)
            if feeder is not None:
                feeder.join(timeout=10)

    def close(self) -> None:
        self.stop_workers()


# ---- the job as a whole ---------------------------------------------------------------------------
def run_job(spec: JobSpec, options: JobOptions) -> int:
    """Train `spec` in this process (one rank of torchrun, or a world of one); returns the exit code."""
    from ciuic_doctor.errors import ProbeFailed
    from ciuic_doctor.jobs import checkpoint as ckpt
    from ciuic_doctor.jobs import liveness
    from ciuic_doctor.jobs.progress import JobProgress

    total_steps = spec.job.steps
    if total_steps < 1:
        raise UserError(f"--steps must be at least 1, not {total_steps}")
    resume = ckpt.resolve_resume(options.resume) if options.resume else None
    world = setup_distributed(spec)
    progress = JobProgress(spec=spec, world=world, options=options)
    watch = liveness.start_watch(world.rank, world.world, spec.distributed.timeout_s)
    try:
        options.injections.check(world=world.world, precision=spec.precision.mode)
        run = progress.open_run()
        trainer = Trainer(spec, world, total_steps=total_steps, injections=options.injections)
        progress.started(trainer)
        if resume is not None:
            progress.resumed(ckpt.load_checkpoint(resume, trainer))
        progress.set_step(trainer.step)
        directory = run.path / "checkpoints"
        every = spec.checkpoint.every_steps
        while trainer.step < total_steps:
            if watch is not None:
                watch.step(f"step {trainer.step + 1}")
            elapsed = trainer.train_step()
            progress.stepped(trainer, elapsed)
            if every and trainer.step % every == 0:
                progress.saved(ckpt.save_checkpoint(trainer, directory, keep=spec.checkpoint.keep))
        progress.finished(trainer)
        trainer.close()
    except (RuntimeError, liveness.Terminated) as exc:
        if watch is None or not liveness.is_peer_failure(exc):
            raise
        message = liveness.report(watch, exc)
        progress.failed(message or watch.stored_failure())
        if message and not liveness.parent_reports():
            raise ProbeFailed(message) from None
        return 1
    finally:
        if watch is not None:
            watch.stop()
        progress.close()
        if world.backend is not None and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m ciuic_doctor.jobs.train [job options]`: the job in this process (under torchrun, one
    rank), never launching ranks itself; the form to run under `ciuic-doctor watch -- -m ...`."""
    import argparse

    from ciuic_doctor.jobs import options as job_options

    parser = argparse.ArgumentParser(prog="python -m ciuic_doctor.jobs.train", description=main.__doc__)
    job_options.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        spec, options = job_options.resolve(args)
        return run_job(spec, options)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
