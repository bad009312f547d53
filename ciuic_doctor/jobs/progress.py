"""Where the embedded job reports: its run directory (meta.json, the steps stream via watch) and the
progress lines rank 0 prints.

The job records its steps through the same watch code a user's script gets (`ciuic_doctor.watch`), so
`ciuic-doctor job` alone yields RUN/steps.rank<R>.jsonl, and under `ciuic-doctor watch` it joins the
session already recording. Progress lines are printed from the written records: on CUDA that costs no
device sync (a per-step `loss.item()` would), and a printed step is a step already on disk.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ciuic_doctor.jobs.options import JobOptions, TrainerView, World, median_step_s
from ciuic_doctor.rundir.store import RunDir, default_run_path

if TYPE_CHECKING:
    from ciuic_doctor.jobs.checkpoint import LoadTiming, SaveTiming
    from ciuic_doctor.jobs.spec import JobSpec


def _num(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, fmt)


def step_line(record: dict[str, Any], total: int) -> str:
    """One progress line for a steps record.

    >>> step_line({"step": 3, "loss": 6.5, "lr": 1e-4, "grad_norm": 1.25, "step_time_s": 0.08,
    ...            "skipped": True, "loss_scale": 65536.0, "loss_scale_next": 32768.0}, 40)
    'step 3/40  loss 6.5000  lr 1.00e-04  grad_norm 1.250  0.080 s  SKIPPED (scale now 32768)'
    """
    line = (
        f"step {record['step']}/{total}  loss {_num(record.get('loss'), '.4f')}  "
        f"lr {_num(record.get('lr'), '.2e')}  grad_norm {_num(record.get('grad_norm'), '.3f')}  "
        f"{_num(record.get('step_time_s'), '.3f')} s"
    )
    if record.get("skipped"):
        # watch records the scale the step used (loss_scale) and the one update() set (loss_scale_next)
        now = record.get("loss_scale_next", record.get("loss_scale"))
        line += f"  SKIPPED (scale now {_num(now, '.0f')})"
    if record.get("desync_ranks"):
        line += f"  DESYNC: ranks {record['desync_ranks']} differ from rank 0"
    return line


class JobProgress:
    def __init__(self, *, spec: JobSpec, world: World, options: JobOptions) -> None:
        self.spec = spec
        self.world = world
        self.options = options
        self.lead = world.rank == 0
        self.run: RunDir | None = None
        self.session: Any = None
        self.checkpoints: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self._start = time.perf_counter()
        self._finished = False
        self._failure: str | None = None  # the one line naming a dead or hung rank (jobs/liveness.py)

    def _print(self, text: str) -> None:
        if self.lead:
            print(text, flush=True)

    def open_run(self) -> RunDir:
        """The run directory (the watch session's when one is recording), with watch attached."""
        from ciuic_doctor import watch
        from ciuic_doctor.launch import agree_on_run_dir
        from ciuic_doctor.rundir.watch_end import process_fields

        active = watch.current()
        if active is not None:
            self.run = active.run
        else:
            self.run = RunDir.create(agree_on_run_dir(default_run_path("job", self.options.out)))
        if self.options.watch:
            # Attached before the model is wrapped in DDP: the weight checksum needs to see the wrapper.
            self.session = watch.attach(
                run=self.run,
                rank=self.world.rank,
                moe_every=self.options.moe_every,
                probe_fields={"script": "ciuic-doctor job", **process_fields()},
            )
            if self.lead:
                self.session.add_listener(self._on_record)
        return self.run

    def _on_record(self, record: dict[str, Any]) -> None:
        if isinstance(record.get("loss"), float):
            self.losses.append(record["loss"])
        self._print(step_line(record, self.spec.job.steps))

    def started(self, trainer: TrainerView) -> None:
        world = self.world
        info = {
            "world_size": world.world,
            "spec_world_size": self.spec.world_size,
            "global_batch": trainer.global_batch,
            "effective_lr": trainer.lr,
            "lr_scaling": self.spec.optim.lr_scaling,
            "precision": self.spec.precision.mode,
            "device": str(world.device),
            "backend": world.backend,
            "parameters": trainer.parameter_count,
            "steps": self.spec.job.steps,
            "injections": self.options.injections.describe() if self.options.injections.active else None,
            "watch": self.options.watch,
        }
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if local.isdigit() and int(local) > 0 and world.world % int(local) == 0:
            # how the ranks sat on nodes: verify re-runs a multi-node job on as many nodes
            info.update(nodes=world.world // int(local), procs_per_node=int(local))
        if self.lead and self.run is not None:
            self.run.update_meta(spec=self.spec.to_dict(), spec_source=self.spec.source, job_run=info)
            self._sign(info)
            if self.options.peak_tflops:  # the peak MFU is judged against
                self.run.update_meta(
                    mfu={"peak_tflops": self.options.peak_tflops, "source": "job --peak-tflops"}
                )
            self.run.record_probe("job", status="running")
            self.run.record_environment()  # watch has captured it already; --no-watch has not
        self._print(
            f"job {self.spec.job.name}: {trainer.parameter_count / 1e6:.2f} M parameters, "
            f"{world.world} rank(s) ({world.backend or 'no process group'}, {world.device}), "
            f"global batch {trainer.global_batch}, lr {trainer.lr:.2e} ({self.spec.optim.lr_scaling} rule), "
            f"{self.spec.precision.mode}, {self.spec.job.steps} steps -> {self.run.path if self.run else '-'}"
        )
        if self.options.injections.active:
            self._print(f"injected faults (demonstration): {self.options.injections.describe()}")

    def _sign(self, info: dict[str, Any]) -> None:
        """Sign what verify re-runs (the spec, world size, faults, backend) with this user's key, so
        `verify` re-runs this job without asking (ciuic_doctor/rundir/trust.py)."""
        from ciuic_doctor.rundir import trust

        values = {
            "spec": self.spec.to_dict(),
            **{k: info.get(k) for k in ("world_size", "injections", "backend")},
        }
        sig = trust.signature("job", values)
        if sig is not None and self.run is not None:
            self.run.update_meta(signatures={"job": sig})

    def resumed(self, timing: LoadTiming) -> None:
        self._print(f"resumed from {timing.path} at step {timing.step} (load {timing.load_s:.2f} s)")
        if self.lead and self.run is not None:
            self.run.update_meta(job_run={"resumed_from": timing.path, "resumed_step": timing.step})

    def set_step(self, step: int) -> None:
        if self.session is not None:
            self.session.set_step(step)

    def stepped(self, trainer: TrainerView, elapsed_s: float) -> None:
        if self.session is None and self.lead:  # no watch records to print from: read the loss here
            loss = float(trainer.last_loss)
            self.losses.append(loss)
            record = {"step": trainer.step, "loss": loss, "lr": None, "grad_norm": None}
            self._print(step_line({**record, "step_time_s": elapsed_s}, self.spec.job.steps))

    def saved(self, timing: SaveTiming) -> None:
        self.checkpoints.append(asdict(timing))
        self._print(
            f"checkpoint step {timing.step} -> {timing.path} ({timing.size_bytes / 2**20:.1f} MiB, "
            f"save {timing.save_s:.2f} s, barrier {timing.barrier_wait_s:.2f} s)"
        )

    def finished(self, trainer: TrainerView) -> None:
        loop_s = time.perf_counter() - self._start
        median = median_step_s(trainer.step_times_s)
        if self.lead and self.run is not None:
            self.run.update_meta(
                job_run={
                    "steps_done": trainer.step,
                    "loop_s": loop_s,
                    "median_step_s": median,
                    "checkpoints": self.checkpoints,
                }
            )
            self.run.record_probe("job", status="finished")
            self._watch_ended("finished")
        self._finished = True
        losses = f"; loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}" if self.losses else ""
        self._print(
            f"done: step {trainer.step} in {loop_s:.1f} s (median {_num(median, '.3f')} s/step){losses}; "
            f"records in {self.run.path if self.run else '-'}"
        )

    def _watch_ended(self, status: str) -> None:
        """The job's watch record ends with the job (it said `running` after a finished job)."""
        if self.options.watch and self.lead and self.run is not None and self.session is not None:
            self.run.record_probe("watch", script="ciuic-doctor job", status=status)

    def failed(self, message: str | None) -> None:
        """A peer died or stopped responding: `message` names it (recorded by close)."""
        self._failure = message

    def close(self) -> None:
        failure = {"message": self._failure} if self._failure else {}
        if not self._finished and (self.lead or failure) and self.run is not None:
            # closing while Ctrl-C propagates (close runs in the trainer's finally) is an interruption,
            # as README's statuses say, not a failure
            status = (
                "interrupted"
                if isinstance(sys.exc_info()[1], KeyboardInterrupt) and not failure
                else "failed"
            )
            self.run.record_probe("job", status=status, **failure)  # the records up to here stay
            self._watch_ended(status)
        if self.session is not None:
            self.session.close()
            self.session = None
        sys.stdout.flush()
