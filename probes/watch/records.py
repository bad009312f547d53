"""One record per optimizer step: what watch writes to RUN/steps.rank<R>.jsonl, and when.

`StepRecords` is the part of `session.WatchSession` that turns a finished optimizer step into a record:
the step number (the framework's own counter when it has one), the timings, the device values copied
without a sync (written one step later, values.PendingQueue), memory, and every `checksum_every` steps
the replicas' weight checksums (a collective every watched rank calls at the same step).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

from ciuic_doctor.probes.watch import children as watch_children
from ciuic_doctor.probes.watch.steps import Group, OptimizerState, merge_values, norm_source, total_loss
from ciuic_doctor.probes.watch.values import agree_watched, cuda_memory, read_rss, start_copy

STREAM = "steps"
RECORD_KEYS = (
    "rank", "step", "t", "step_time_s", "pre_backward_s", "loss", "lr", "grad_norm", "grad_norm_source",
    "clip_max_norm", "loss_scale", "skipped", "backward_calls", "mem_allocated", "mem_reserved",
    "mem_active_peak", "alloc_retries", "rss", "uss", "weights_checksum", "desync_ranks",
    "optimizer", "optimizer_class", "loss_scale_next", "segment", "tokens",
)  # fmt: skip


class StepRecords:
    """Mixed into WatchSession; the attributes it reads (`_queue`, `_writer`, `config`...) are its."""

    def _finalize(
        self, state: OptimizerState, group: Group, *, scaler: Any, found_inf: Any, gather: bool = True
    ) -> None:
        stepped, state.stepped, state.group = state.stepped, False, None
        grad_norm, state.grad_norm = state.grad_norm, None
        state.count += 1
        if self._rank is None:  # a spawned rank: its process group exists by its first step
            self._rank = watch_children.resolve_rank()
            self._continue_run(self._rank)
        step_no = self._step_number(state)
        gathered = None
        if gather and state is self._primary and self.config.checksum and self._checksum_due(state.count):
            gathered = self._checksums()  # a collective: every watched rank calls it at the same step
        now = time.perf_counter()
        prev, state.t_prev_end = state.t_prev_end, now
        if self._broken:
            return
        optimizer = state.ref()
        lr = optimizer.param_groups[0].get("lr") if optimizer is not None else None
        lazy: dict[str, torch.Tensor | None] = {
            "loss": total_loss(group.losses),
            "grad_norm": group.clip_norm if group.clip_norm is not None else grad_norm,
            "loss_scale": group.scale_used,
            "loss_scale_next": scaler._scale.detach().clone() if scaler is not None else None,
            "found_inf": found_inf,
            "lr": lr.detach().clone() if isinstance(lr, torch.Tensor) else None,
        }
        step_time_s = now - prev if prev is not None else None
        t_backward = group.t_first_backward
        pre_backward_s = t_backward - prev if prev is not None and t_backward and t_backward > prev else None
        record: dict[str, Any] = {
            "step": step_no,
            "t": time.time(),
            "step_time_s": step_time_s,
            "pre_backward_s": pre_backward_s,
            "lr": float(lr) if isinstance(lr, int | float) else None,
            "grad_norm_source": norm_source(group, grad_norm),
            "clip_max_norm": group.clip_max_norm,
            "skipped": scaler is not None and found_inf is None and not stepped,
            "backward_calls": group.backward_calls,
            **cuda_memory(self._device),
            "rss": read_rss(),
            "uss": self._uss.sample(state.count, step_time_s),
            "optimizer": state.index,
            "optimizer_class": state.name,
            "segment": self.segment,
        }  # fmt: skip
        for hook in self._step_hooks:  # tokens the model saw this step
            record.update(self._guarded(hook, step_no, state is self._primary) or {})
        if gathered is not None:
            lazy["checksums"], record["_checksum_ranks"], record["_checksum_me"] = gathered
        self._queue.push(start_copy(record, lazy))

    def _step_number(self, state: OptimizerState) -> int:
        if self._framework_step is not None:
            done = self._framework_step()
            if isinstance(done, int):
                return done + 1
        return self._first_step + state.count

    def _checksum_due(self, count: int) -> bool:
        every = max(1, self.config.checksum_every)
        return count == 1 or (count - 1) % every == 0

    def _checksums(self) -> Any:
        """The replicas' checksums, once every rank of their group has said it is watched (else never)."""
        for replicas in self._replicas:
            if self._agreed is None:
                self._agreed, self.checksum_note = agree_watched(replicas.group, self.config.agree_timeout_s)
                if self.checksum_note:
                    print(f"ciuic-doctor watch: rank {self.rank}: {self.checksum_note}", file=sys.stderr)
            if not self._agreed:
                return None
            gathered = replicas.gather_checksums()
            if gathered is not None:
                return gathered
        return None

    def _close_stream(self) -> None:
        """Close the steps file; in the process that wrote it, leave the file's columnar part for the report
        (`frames.file_parts`: 12-17 ms for 1,000 steps, once the script is done; the first report of a
        10,000-rank job then reads 10,000 parts instead of parsing 5.3 GB of JSON)."""
        if self._writer is None:
            return
        self._writer.close()
        if not self._broken and os.getpid() == self._pid and self.steps_written:
            from ciuic_doctor.rundir.frames import part_writer

            part_writer.write_at_exit(self._writer.path, STREAM, copies=_world_size())

    def _write(self, pending: Any) -> None:
        values = pending.values()
        record = pending.record
        merge_values(record, values)
        if self._writer is None:  # opened at the first record: a spawned rank knows its rank by then
            self._writer = self.run.writer(STREAM, rank=self.rank, per_rank_file=True)
        record["rank"] = self.rank
        full = {key: record.get(key) for key in RECORD_KEYS}
        self._writer.write(full)
        self.steps_written += 1
        if self._snapshot is not None:
            self._snapshot.observe(full["step"], full["mem_allocated"])
        for listener in self._listeners:
            listener(full)


def _world_size() -> int:
    """How many ranks write a steps file like this one (torchrun's WORLD_SIZE, else the process group's)."""
    try:
        if (size := int(os.environ.get("WORLD_SIZE") or 0)) > 0:
            return size
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    except (ValueError, RuntimeError):
        return 1
