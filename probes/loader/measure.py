"""One DataLoader measurement, run in a forked child that a watchdog can kill.

Why a child: a hung `__getitem__` with num_workers=0 runs in the main process, where DataLoader's own
`timeout=` does not apply and no exception can interrupt C code. The child sends a heartbeat per batch
through a pipe; the parent kills the child's whole process group (the child and its DataLoader workers)
when no batch arrives within `timeout_s` + a grace. Workers that crash or hang are caught first by
DataLoader itself (its SIGCHLD handler and `timeout=`), which gives the more precise message.

What one measurement records (all per configuration and round):
- `epoch_start_s`: iterator creation (forking the workers) to the first batch = what a loader *without*
  persistent workers pays at every epoch start; `persistent_restart_s`: the same for the second epoch
  of a persistent loader. Both excluded from the throughput.
- warm-up: the first 3 × num_workers + 1 batches (three turns of every worker, plus one) are excluded:
  a new worker's first batches pay its start-up and the copy-on-write faults of a freshly forked
  process; on 2 cores the first 2-3 turns ran up to 10x slower than the rest.
- `samples_per_s` over whole groups of max(1, num_workers) batches (one turn of the round-robin over the
  workers, so the window does not end in the middle of a turn), timed by when the batches were
  *produced* (see `_measure`): timed as the loop took them (`taken_samples_per_s`, kept for
  comparison), short windows on a busy 2-core node read up to 3x what 2 cores can produce, because a
  descheduled loop finds workers × prefetch_factor batches waiting. `group_s` per group for the noise;
  `batch_latency_p50_ms`/`p99_ms`: how long the loop waited in `next()` for each batch.
- worker USS/PSS/RSS growth (psutil, /proc/PID/smaps_rollup) from the end of warm-up to the end of the
  window, and `shm_need_bytes` = workers × prefetch_factor × batch bytes.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import time
from dataclasses import asdict, dataclass
from multiprocessing import connection
from typing import Any

import psutil  # imported before the fork: importing it mid-measurement stalled the loop by ~50 ms

REAP_TIMEOUT_S = 10.0  # SIGKILL cannot be ignored; this only bounds a wait on a frozen kernel


def watchdog_s(timeout_s: float) -> float:
    """The parent's limit between two heartbeats: DataLoader's own timeout plus a grace (1-5 s), so
    DataLoader's more precise message wins whenever workers are involved."""
    return timeout_s + min(5.0, max(1.0, timeout_s))


@dataclass(kw_only=True, frozen=True)
class LoaderConfig:
    """One point of the grid. persistent_workers is not a grid axis: within an epoch it changes nothing,
    so every measurement reports both restart costs instead (see module docstring)."""

    num_workers: int
    prefetch_factor: int | None = None
    pin_memory: bool = False

    @property
    def id(self) -> str:
        if self.num_workers == 0:
            return "w0-pin" if self.pin_memory else "w0"
        return f"w{self.num_workers}-p{self.prefetch_factor}" + ("-pin" if self.pin_memory else "")

    def as_record(self) -> dict[str, Any]:
        return {**asdict(self), "persistent_workers": self.num_workers > 0, "config": self.id}


@dataclass(kw_only=True)
class Plan:
    """How long to measure, at least `min_groups` groups after warm-up and then either a window of
    `window_s` seconds, or whatever is left of a time slot of `slot_s` seconds for the whole measurement
    (start-up and warm-up included: their cost differs between configurations and is not known before,
    so a slot is what keeps a sweep inside its budget)."""

    batch_size: int
    window_s: float | None = None
    slot_s: float | None = None
    min_groups: int = 3
    timeout_s: float = 60.0
    step_ms: float = 0.0  # modelled accelerator step per batch: the CPU is free meanwhile, so a wait
    device: str | None = None  # copy each batch there (pin_memory only matters with one)
    seed: int = 0


class SteerableSampler:
    """Indices over a shuffled dataset, cycling, until `limit`. The measuring loop lowers the limit once
    it knows the group time (the DataLoader draws indices lazily, a few batches ahead), so the window
    lasts as planned and the epoch ends exactly where the measurement does: nothing prefetched is left
    to drain before the second epoch's restart is timed."""

    def __init__(self, length: int, *, batch_size: int, seed: int) -> None:
        import torch

        self.order = torch.randperm(length, generator=torch.Generator().manual_seed(seed)).tolist()
        self.batch_size = batch_size
        self.limit = 1 << 62
        self.drawn = 0

    def __iter__(self):
        self.drawn = 0
        while self.drawn < self.limit:
            index = self.order[self.drawn % len(self.order)]
            self.drawn += 1
            yield index

    def __len__(self) -> int:
        return self.limit

    def end_after(self, *, warmup: int, group: int, groups: int) -> None:
        """End the epoch after warm-up + `groups` whole groups, or at the next group boundary after
        what the loader has already drawn."""
        drawn_batches = -(-self.drawn // self.batch_size)
        groups = max(groups, -(-(drawn_batches - warmup) // group))
        self.limit = (warmup + groups * group) * self.batch_size


def _pids(iterator: Any) -> list[int]:
    return [w.pid for w in getattr(iterator, "_workers", [])]


def _memory(pids: list[int]) -> dict[int, tuple[int, int, int]]:
    """(uss, pss, rss) bytes per live worker pid (about 0.1 ms each, from /proc/PID/smaps_rollup)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            info = psutil.Process(pid).memory_full_info()
            out[pid] = (info.uss, getattr(info, "pss", info.uss), info.rss)
    return out


def _growth(before: dict, after: dict) -> dict[str, Any]:
    common = [pid for pid in after if pid in before]
    if not common:
        return {}
    names = ("worker_uss_growth_bytes", "worker_pss_growth_bytes", "worker_rss_growth_bytes")
    result: dict[str, Any] = {
        name: max(after[p][i] - before[p][i] for p in common) for i, name in enumerate(names)
    }
    result["worker_uss_bytes"] = max(after[p][0] for p in common)
    return result


def batch_nbytes(batch: Any) -> int:
    """Bytes of every tensor in a (nested) batch."""
    if hasattr(batch, "element_size") and hasattr(batch, "nelement"):
        return int(batch.element_size() * batch.nelement())
    if isinstance(batch, dict):
        return sum(batch_nbytes(v) for v in batch.values())
    if isinstance(batch, list | tuple):
        return sum(batch_nbytes(v) for v in batch)
    return 0


def _to_device(batch: Any, device: str, non_blocking: bool) -> Any:
    if hasattr(batch, "to"):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: _to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return [_to_device(v, device, non_blocking) for v in batch]
    return batch


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def timed_collate(samples: list[Any]) -> tuple[Any, float]:
    """default_collate, and the moment the batch was ready (CLOCK_MONOTONIC is one clock for every
    process on the machine, so a worker's stamp compares with the main process's)."""
    from torch.utils.data import default_collate

    return default_collate(samples), time.monotonic()


def _measure(conn: connection.Connection, dataset: Any, cfg: LoaderConfig, plan: Plan) -> dict[str, Any]:
    """The child's work: build the loader, time it, and return the record fields.

    The rate is taken from when batches were *produced* (stamped by `timed_collate`), not from when the
    loop took them: a loop that was descheduled for a moment finds up to workers × prefetch_factor
    batches waiting, and taking them in a burst would read as throughput the pipeline cannot sustain.
    Production itself is throttled to the loop's pace whenever the loop is the bottleneck (workers get
    a new index only when a batch is taken), so it is the steady-state rate either way.
    """
    from torch.utils.data import DataLoader, IterableDataset

    workers = cfg.num_workers
    group = max(1, workers)
    warmup = 3 * workers + 1
    iterable = isinstance(dataset, IterableDataset)
    sampler = None if iterable else SteerableSampler(len(dataset), batch_size=plan.batch_size, seed=plan.seed)
    loader = DataLoader(
        dataset,
        batch_size=plan.batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=timed_collate,
        num_workers=workers,
        prefetch_factor=cfg.prefetch_factor if workers else None,
        pin_memory=cfg.pin_memory,
        persistent_workers=workers > 0,
        timeout=plan.timeout_s if workers else 0,
    )
    step_s = plan.step_ms / 1000.0
    if plan.device:  # create the device context now, or the first batch's time would include it
        import torch

        torch.zeros(1, device=plan.device)
    t_child = time.monotonic()
    produced: list[float] = []

    def fetch(iterator: Any) -> tuple[Any, float]:
        t0 = time.monotonic()
        batch, ready = next(iterator)
        waited = time.monotonic() - t0
        produced.append(ready)
        if plan.device:
            batch = _to_device(batch, plan.device, cfg.pin_memory)
        conn.send(("beat", None))
        if step_s:
            time.sleep(step_s)  # the accelerator's step: the CPU is free meanwhile (not synchronisation)
        return batch, waited

    iterator = iter(loader)
    conn.send(("pids", _pids(iterator)))  # so the parent can wait for the workers' end after killing them
    first, _ = fetch(iterator)
    epoch_start_s = time.monotonic() - t_child
    nbytes = batch_nbytes(first)
    for _ in range(warmup - 1):
        fetch(iterator)
    pids = _pids(iterator)
    mem_before = _memory(pids)
    if plan.window_s is not None:
        target_s = plan.window_s
    else:
        target_s = max(0.0, (plan.slot_s or 0.0) - (time.monotonic() - t_child))
    waits: list[float] = []
    taken_s: list[float] = []  # per group, as the loop took them: only to steer the window
    group_s: list[float] = []  # per group, as produced: the rate
    ready_mark = max(produced[-group:])  # the last warm-up group was complete
    t_window = t_group = time.monotonic()
    while True:
        try:
            _, waited = fetch(iterator)
        except StopIteration:
            break
        waits.append(waited)
        if len(waits) % group == 0:
            now = time.monotonic()
            taken_s.append(now - t_group)
            t_group = now
            ready = max(produced[-group:])
            group_s.append(max(0.0, ready - ready_mark))  # worker skew can reorder; the sum telescopes
            ready_mark = max(ready_mark, ready)
            # Steer the window to about target_s by the mean group time so far (a single group can
            # be served from the prefetch buffer and would mislead).
            wanted = max(plan.min_groups, math.ceil(target_s * len(taken_s) / max(sum(taken_s), 1e-6)))
            if sampler is not None:
                sampler.end_after(warmup=warmup, group=group, groups=wanted)
            if iterable and len(group_s) >= wanted:
                break
    if plan.device and plan.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    elapsed = time.monotonic() - t_window
    usable = len(group_s) * group  # whole groups only
    produced_s = sum(group_s)
    result: dict[str, Any] = {
        "status": "ok",
        "warmup_batches": warmup,
        "window_target_s": round(target_s, 6),
        "window_batches": usable,
        "samples": usable * plan.batch_size,
        "elapsed_s": round(produced_s, 6),
        "window_wall_s": round(elapsed, 6),
        "samples_per_s": usable * plan.batch_size / produced_s if produced_s > 0 else 0.0,
        "taken_samples_per_s": usable * plan.batch_size / sum(taken_s) if sum(taken_s) > 0 else 0.0,
        "group_s": [round(g, 6) for g in group_s],
        "batch_latency_p50_ms": round(1000 * _percentile(waits, 0.5), 3) if waits else None,
        "batch_latency_p99_ms": round(1000 * _percentile(waits, 0.99), 3) if waits else None,
        "epoch_start_s": round(epoch_start_s, 6),
        "persistent_restart_s": None,
        "batch_bytes": nbytes,
        "shm_need_bytes": workers * (cfg.prefetch_factor or 0) * nbytes,
        "worker_pids": len(pids),
        **_growth(mem_before, _memory(pids)),
    }
    if workers and not iterable:  # the epoch ended exactly here: a second one shows the persistent restart
        t0 = time.monotonic()
        fetch(iter(loader))
        result["persistent_restart_s"] = round(time.monotonic() - t0, 6)
    return result


def one_line(exc: BaseException) -> str:
    """An exception as one line: type, first line and (for a DataLoader worker's) the original error."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    # A worker's exception arrives as "Caught X in DataLoader worker process 0.\nOriginal Traceback..."
    # whose last line is the original error: keep the first and the last line.
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text = f"{text} ... {lines[-1]}"
    return f"{type(exc).__name__}: {text}"[:500]


def _classify(message: str) -> str:
    if "timed out" in message:
        return "timeout"
    if "DataLoader worker" in message and ("killed by signal" in message or "exited unexpectedly" in message):
        return "worker_crashed"
    return "error"


def _kill_group(pid: int, workers: list[int]) -> None:
    """SIGKILL the measuring child's process group (the child and its workers) and return only once
    they are all dead, so no measurement's processes overlap the next one's."""
    pidfds = []
    for worker in workers:  # a pidfd turns readable when its process exits: an event, not a poll loop
        with contextlib.suppress(OSError, AttributeError):
            pidfds.append(os.pidfd_open(worker))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    deadline = time.monotonic() + REAP_TIMEOUT_S
    for fd in pidfds:
        with contextlib.suppress(OSError):
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        os.close(fd)


def _exit_reason(pid: int) -> str:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "the measuring process vanished"
    if os.WIFSIGNALED(status):
        return f"the measuring process was killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"the measuring process exited with code {os.waitstatus_to_exitcode(status)} before reporting"


def measure(dataset: Any, cfg: LoaderConfig, plan: Plan) -> dict[str, Any]:
    """Measure `cfg` in a watched child; always returns a dict with `status` (ok, timeout,
    worker_crashed, crashed, error) and `wall_s`, never raises for what the dataset does."""
    receiver, sender = connection.Pipe(duplex=False)
    t0 = time.perf_counter()
    # Ctrl-C / SIGTERM wait until the fork is over: a KeyboardInterrupt raised inside an at-fork hook
    # (logging registers one) is printed and swallowed, and the sweep would go on as if nothing came.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        raise
    if pid == 0:  # the child: own process group, so the parent can kill it with its workers
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            receiver.close()
            os.setpgid(0, 0)
            # One intra-op thread in the forked child: if the parent ever ran a parallel op, its OpenMP
            # pool does not survive the fork and the child's first parallel op (randperm of 100 000
            # indices here, or the user's dataset) deadlocks. DataLoader workers run one thread too.
            import torch

            torch.set_num_threads(1)
            sender.send(("done", _measure(sender, dataset, cfg, plan)))
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                sender.send(("error", one_line(exc)))
        finally:
            os._exit(0)  # skip atexit and worker joins: the parent kills the group
    sender.close()
    with contextlib.suppress(OSError):  # also here, so no race with the child's own setpgid
        os.setpgid(pid, pid)
    result: dict[str, Any]
    workers: list[int] = []
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a pending Ctrl-C is raised here, in the try
        while True:
            if not receiver.poll(watchdog_s(plan.timeout_s)):
                result = {
                    "status": "timeout",
                    "error": f"watchdog: no batch for {watchdog_s(plan.timeout_s):g} s",
                }
                break
            try:
                kind, payload = receiver.recv()
            except EOFError:
                result = {"status": "crashed", "error": _exit_reason(pid)}
                break
            if kind == "pids":
                workers = payload
            elif kind == "done":
                result = payload
                break
            elif kind == "error":
                result = {"status": _classify(payload), "error": payload}
                break
    finally:
        receiver.close()
        _kill_group(pid, workers)
    result["wall_s"] = round(time.perf_counter() - t0, 6)
    return result
