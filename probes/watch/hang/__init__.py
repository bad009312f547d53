"""The hang watchdog of one rank under `ciuic-doctor watch`: when the job stops, dump where and why, once.

A thread per rank watches two cheap signs of life: the time of the last optimizer step (a listener on the
watch session's records) and the count of completed collectives in Flight Recorder's per-group status
(`_dump_fr_trace` without entries: ~0.1 ms, polled every 0.5 s off the training thread). When neither moved
for `hang_after_s` and the main thread is not working either (hang.poll.still_moving: an evaluation is
not a hang), or when a collective raises (a timeout, a peer that reset the connection), it writes

    RUN/hang.rank<R>.json        why, when, the last step, Flight Recorder's group status, every thread's
                                 Python stack, and the state of the other ranks on this host
    RUN/hang.rank<R>.stacks.txt  the same stacks, as a person reads them
    RUN/hang.fr/rank<R>          Flight Recorder's own dump (torch's pickle, the file torchfrtrace reads)
    RUN/hang.rank<R>.last.json   the last Python collective issued (watch_hang_last: for a rank gloo aborts)

once per stall, without stopping the job; never while watch closes, and never over an earlier dump.
`kill -USR1 <rank pid>` (what `ciuic-doctor hang --pid` sends) asks for a dump at any time, through a
wake-up socket this thread reads, so it works while the main thread is blocked inside a collective. A
fatal signal (gloo aborts a rank sent another size) leaves faulthandler's stacks in hang.rank<R>.fatal.txt.

    >>> default_hang_after(step_times_s=[0.5] * 10, pg_timeout_s=600.0)
    30.0
    >>> default_hang_after(step_times_s=[40.0] * 10, pg_timeout_s=600.0)
    480.0
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ciuic_doctor.probes.watch import children as watch_children
from ciuic_doctor.probes.watch.hang.config import (  # noqa: F401 - part of this module's API
    DEFAULT_PG_TIMEOUT_S,
    FR_BUFFER_DEFAULT,
    PEER_SETTLE_S,
    POLL_S,
    HangConfig,
    arm_flight_recorder,
    default_hang_after,
)
from ciuic_doctor.probes.watch.hang.poll import (
    Look,
    _pg_timeout_s,
    fr_status,
    keep_earlier,
    rearm_as_group_rank,
    release_files,
    still_moving,
)
from ciuic_doctor.probes.watch.hang.waits import WaitRecord
from ciuic_doctor.probes.watch.hang.where import format_stacks, peer_states, start_ticks, thread_stacks
from ciuic_doctor.rundir.store import RunDir


def arm(session: Any, config: HangConfig | None = None) -> Callable[..., None]:
    """Start the watchdog for `session` (a probes.watch.WatchSession); returns `stop(exit_code=None)`."""
    config = config or HangConfig()
    arm_flight_recorder(config.fr_buffer)
    watchdog = HangWatchdog(run=session.run, rank=session.rank, config=config)
    session.add_listener(watchdog.on_step)
    watchdog.start()
    watch_children.on_first_rank_started(watchdog.step_aside)  # mp.spawn: the ranks arm their own
    return watchdog.stop


def arm_quietly(session: Any, settings: dict[str, Any] | None) -> Callable[..., None] | None:
    """`arm` for a rank the script started (mp.spawn); None when the launcher armed none, or on an error."""
    try:
        return arm(session, HangConfig(**settings)) if settings is not None else None
    except Exception as exc:
        print(f"ciuic-doctor watch: hang watchdog not armed in pid {os.getpid()}: {exc!r}", file=sys.stderr)
        return None


class HangWatchdog:
    """One rank's watchdog thread plus its three triggers (no progress, a collective error, SIGUSR1)."""

    def __init__(self, *, run: RunDir, rank: int, config: HangConfig) -> None:
        self.run = run
        self.rank = rank
        self.config = config
        self.host = socket.gethostname()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._step: int | None = None
        self._step_times: deque[float] = deque(maxlen=50)
        self._progress_t = time.monotonic()
        self._completed = 0
        self._started = False  # no judging before the first step or collective (start-up is not a hang)
        self._stalled_dump = False  # a no-progress dump was made for the current stall
        self._resume_pending = False
        self._error_dump = False
        self._pg_timeout_s: float | None = None
        self._thread = threading.Thread(target=self._loop, name="ciuic-hang-watchdog", daemon=True)
        self._undo: list[Callable[[], None]] = []
        self._wake_r: socket.socket | None = None
        self._pid = os.getpid()
        self._faulthandler_ours = False
        self._dumping = False
        self._terminating = False
        self._term_pending = False
        self._closing, self._armed_checked = False, False  # closing: stop() began, no stall is judged
        self._look: Look | None = None  # the main thread at the last poll of a stall; dumps so far:
        self._waits = WaitRecord(run, rank)  # hang.rank<R>.wait.json, for the live view
        self._dumps = 0  # a later one keeps the earlier (hang.rank<R>.earlier<k>.*)

    # ---- installing -----------------------------------------------------------------------------
    def start(self) -> None:
        from ciuic_doctor.rundir import safe_io

        safe_io.make_dir(self.run.path, "hang.fr")
        self._write_armed()
        self._install_fatal()
        self._install_error_hook()
        self._install_last_collective()
        self._install_signals()
        os.register_at_fork(
            before=self._before_fork, after_in_parent=self._after_fork, after_in_child=self._disarm_in_child
        )
        self._thread.start()

    def _before_fork(self) -> None:
        """No wake-up fd across a fork: a signal the child gets before it is disarmed would otherwise be
        written into the socket the rank's watchdog reads (and read as the rank's own)."""
        if self._wake_r is not None and not self._stop.is_set():
            with contextlib.suppress(ValueError):  # fork() from another thread: keep it
                signal.set_wakeup_fd(-1)

    def _after_fork(self) -> None:
        if self._wake_r is not None and not self._stop.is_set():
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)

    def _disarm_in_child(self) -> None:
        """A forked child (a DataLoader worker) inherits the signal handlers, the wake-up socket and
        faulthandler's file, not the thread: without this, SIGTERM to the worker (torchrun signals the
        whole process group) would write a dump in the rank's name and wake the rank's watchdog."""
        if self._pid != os.getpid() and not self._stop.is_set():
            self._stop.set()
            # The handlers stay: a SIGTERM that arrived before this ran is already pending for ours, and
            # resetting to SIG_DFL now would drop it; ours sees the other PID and dies of SIGTERM instead.
            with contextlib.suppress(Exception):
                if threading.current_thread() is threading.main_thread():
                    signal.set_wakeup_fd(-1)
                if self._faulthandler_ours:
                    faulthandler.disable()

    def stop(self, exit_code: int | None = None) -> None:
        """Disarm. A stall dumped earlier in a script that then exited 0 was a long pause (a final save,
        an evaluation), not a hang: it is marked resumed, so it is not judged as one."""
        self._closing = True  # first: the watchdog thread must not dump while watch closes
        self._stop.set()
        self._waits.clear()
        if exit_code == 0 and (self._stalled_dump or self._resume_pending):
            self._stalled_dump = self._resume_pending = False
            self._mark_resumed()
        for undo in reversed(self._undo):
            with contextlib.suppress(Exception):
                undo()
        self._undo.clear()

    def step_aside(self) -> None:  # this process launches the ranks (mp.spawn): they arm their own
        self.stop(None)
        release_files(self.run.path, self.rank)

    def _write_armed(self, world_size: int | None = None) -> None:
        self.run.write_json(
            f"hang.rank{self.rank}.armed.json",
            {
                "schema": 1,
                "t": time.time(),
                "rank": self.rank,
                "world_size": world_size or int(os.environ.get("WORLD_SIZE", "1")),
                "host": self.host,
                "pid": os.getpid(),
                "start_ticks": start_ticks(os.getpid()),
                "hang_after_s": self.config.hang_after_s,
                "fr_buffer": int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0),
            },
        )

    def _install_fatal(self) -> None:
        if faulthandler.is_enabled():  # the script's own faulthandler stays
            return
        from ciuic_doctor.rundir import safe_io

        path = self.run.path / f"hang.rank{self.rank}.fatal.txt"
        try:  # never through a symlink or hard link planted under its name (safe_io)
            fatal = os.fdopen(safe_io.open_truncated(path), "w")
        except OSError as exc:
            print(f"ciuic-doctor watch: rank {self.rank}: no fatal-signal stacks ({exc})", file=sys.stderr)
            return
        faulthandler.enable(file=fatal, all_threads=True)
        self._faulthandler_ours = True

        def undo() -> None:
            faulthandler.disable()
            fatal.close()

        self._undo.append(undo)

    def _install_error_hook(self) -> None:
        """torch logs every exception a c10d collective raises to its `c10d` logger before re-raising it
        (c10d_logger._exception_logger): a handler there sees the error in the failing thread, in time."""
        try:
            from torch.distributed import c10d_logger
        except ImportError:
            return
        watchdog = self

        class _OnCollectiveError(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                msg = record.msg
                if isinstance(msg, dict) and "error" in msg:
                    watchdog.dump("collective-error", error=str(msg["error"]), function=msg.get("func_name"))

        handler = _OnCollectiveError(level=logging.DEBUG)
        logger = c10d_logger._c10d_logger
        logger.addHandler(handler)
        self._undo.append(lambda: logger.removeHandler(handler))

    def _install_last_collective(self) -> None:
        from ciuic_doctor.probes.watch.hang.last import install

        self._undo.append(install(self.run.path / f"hang.rank{self.rank}.last.json"))

    def _install_signals(self) -> None:
        """SIGUSR1 asks for a dump; SIGTERM (torchrun stopping the others after one rank died) dumps first.

        Python runs its signal handlers in the main thread, which may be blocked in a collective for
        good. Its C-level handler also writes the signal number to the wake-up fd at once, from any
        thread: the watchdog thread waits on that socket, so the dump happens either way.
        """
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        if self._listen_through_watch_exit():
            return
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)
        previous_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
        previous_term = signal.getsignal(signal.SIGTERM)
        if previous_term == signal.SIG_DFL:  # a script's own SIGTERM handler stays as it is
            signal.signal(signal.SIGTERM, lambda signum, frame: self._on_term(main_thread=True))
        try:
            old_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        except ValueError:
            old_fd = -1
        if old_fd != -1:  # someone else's wake-up fd (asyncio): keep it, and take SIGUSR1 from Python
            signal.set_wakeup_fd(old_fd)
            signal.signal(signal.SIGUSR1, lambda signum, frame: self._request())
        else:
            self._wake_r, self._wake_w = read, write

        def undo() -> None:
            if old_fd == -1:
                signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGUSR1, previous_usr1)
            signal.signal(signal.SIGTERM, previous_term)
            read.close()
            write.close()

        self._undo.append(undo)

    def _listen_through_watch_exit(self) -> bool:
        """Under `ciuic-doctor watch` the process's one wakeup fd belongs to watch_exit's helper thread
        (it records a SIGTERM death in meta.json): take SIGUSR1 and SIGTERM from that thread instead, so a
        request still works while the main thread is blocked in a collective, and SIGTERM dumps first."""
        from ciuic_doctor.probes.watch import exit as watch_exit

        previous_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # the fd needs a handler
        undo_usr1 = watch_exit.on_signal(signal.SIGUSR1, self._request)
        if undo_usr1 is None:
            signal.signal(signal.SIGUSR1, previous_usr1)
            return False
        undo_term = watch_exit.on_signal(signal.SIGTERM, self._on_term_listener)

        def undo() -> None:
            undo_usr1()
            if undo_term is not None:
                undo_term()
            signal.signal(signal.SIGUSR1, previous_usr1)

        self._undo.append(undo)
        return True

    def _on_term_listener(self) -> None:
        """SIGTERM, on watch_exit's thread: dump once; watch_exit then records the end and exits 143."""
        if self._pid == os.getpid() and not self._terminating:
            self._terminating = True
            self.dump("terminated")

    def _request(self) -> None:
        threading.Thread(target=self.dump, args=("requested",), daemon=True).start()

    def _on_term(self, *, main_thread: bool) -> None:
        """Dump once, then die of SIGTERM as the process would have without us."""
        if self._pid != os.getpid():  # a forked child whose handler is not reset yet: die as before
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self._terminating:
            return
        self._terminating = True
        if self._dumping:  # the main thread was interrupted inside its own dump: finish it first
            self._term_pending = True
            return
        self.dump("terminated")
        self._die(main_thread=main_thread)

    @staticmethod
    def _die(*, main_thread: bool) -> None:
        sys.stderr.flush()
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        os._exit(128 + signal.SIGTERM)  # off the main thread the handler cannot be reset: exit code 143

    # ---- watching -------------------------------------------------------------------------------
    def on_step(self, record: dict[str, Any]) -> None:
        """The session's listener: one assignment per step (watch's overhead goal is <= 1 % of a step)."""
        self._step = record.get("step")
        if not self._armed_checked:
            self._armed_checked = True
            rearm_as_group_rank(self)
        if record.get("step_time_s"):
            self._step_times.append(record["step_time_s"])
        self._progressed()

    def _progressed(self) -> None:
        self._progress_t = time.monotonic()
        self._started = True
        self._look = None
        if self._stalled_dump:  # the stall ended: the watchdog thread notes it next to the dump (never
            self._stalled_dump = False  # here: the training thread must not wait for a dump in progress)
            self._resume_pending = True

    def hang_after_s(self) -> float:
        if self.config.hang_after_s is not None:
            return self.config.hang_after_s
        return default_hang_after(step_times_s=list(self._step_times), pg_timeout_s=self._pg_timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            signals = self._wait_for_signals(self.config.poll_s)
            if signal.SIGTERM in signals:
                self._on_term(main_thread=False)
            if signal.SIGUSR1 in signals:
                self.dump("requested")
                continue
            try:
                self._poll()
            except Exception as exc:  # never the user's training
                print(f"ciuic-doctor watch: hang watchdog stopped: {exc!r}", file=sys.stderr)
                return

    def _wait_for_signals(self, timeout_s: float) -> bytes:
        """The signal numbers Python's handler wrote to the wake-up socket within `timeout_s`."""
        if self._wake_r is None:  # SIGUSR1 comes through the Python handler instead
            self._stop.wait(timeout_s)
            return b""
        ready, _, _ = select.select([self._wake_r], [], [], timeout_s)
        if not ready:
            return b""
        try:
            return self._wake_r.recv(64)
        except OSError:
            return b""

    def _poll(self) -> None:
        if self._resume_pending:
            self._resume_pending = False
            self._mark_resumed()
        status = fr_status()
        self._waits.rank = self.rank
        with contextlib.suppress(Exception):  # the live view's hint: never the watchdog itself
            if not self._closing:
                self._waits.update(status)
        if status:  # {} before the first collective: no news
            completed = sum(max(0, int(s.get("last_completed_collective", -1))) for s in status.values())
            if completed > self._completed:
                if self._pg_timeout_s is None:
                    self._pg_timeout_s = _pg_timeout_s()
                self._completed = completed
                self._progressed()
        stalled_s = time.monotonic() - self._progress_t
        if self._closing or not self._started or self._stalled_dump or stalled_s <= self.hang_after_s():
            return
        moving = still_moving(self, status)
        if moving is None:
            return  # a second look one poll later decides, or it is working and nobody waits on it
        self._stalled_dump = True
        self.dump("no-progress", stalled_s=stalled_s, main_thread_moving=moving)

    # ---- dumping --------------------------------------------------------------------------------
    def dump(self, reason: str, **fields: Any) -> None:
        """Write this rank's dump; never raises (a failing dump is one line on stderr)."""
        if self._pid != os.getpid():
            return
        if reason == "collective-error":
            if self._error_dump:
                return
            self._error_dump = True
        with self._lock:
            if self._closing and reason in ("no-progress", "collective-error"):
                return  # watch is closing: the script has returned, nothing of it can be hung
            self._dumping = True
            try:
                self._dump(reason, **fields)
            except Exception as exc:
                print(f"ciuic-doctor watch: rank {self.rank}: hang dump failed: {exc!r}", file=sys.stderr)
            finally:
                self._dumping = False
        if self._term_pending:
            self._die(main_thread=threading.current_thread() is threading.main_thread())

    def _dump(self, reason: str, **fields: Any) -> None:
        t0 = time.perf_counter()
        stacks = thread_stacks()  # first: where every thread is now, before the slow parts below
        earlier, self._dumps = self._dumps, self._dumps + 1
        fr_file, status = self._write_flight_recorder(earlier)
        if reason in ("collective-error", "terminated"):
            time.sleep(PEER_SETTLE_S)  # a peer killed with -9 drops its sockets before the kernel reaps it
        peers = peer_states(self.run, self.rank, self.host)
        record = {
            "schema": 1,
            "t": time.time(),
            "host": self.host,
            "rank": self.rank,
            "pid": os.getpid(),
            "reason": reason,
            **fields,
            "hang_after_s": self.hang_after_s(),
            "pg_timeout_s": self._pg_timeout_s,
            "last_step": self._step,
            "since_progress_s": time.monotonic() - self._progress_t,
            "pg_status": status,
            "fr_file": fr_file,
            "threads": stacks,
            "peers": peers,
        }
        record["dump_s"] = time.perf_counter() - t0
        if earlier:  # moved aside only now: a rank killed during the slow parts above keeps its last dump
            keep_earlier(self.run.path, self.rank, earlier)
        self.run.write_text(f"hang.rank{self.rank}.stacks.txt", format_stacks(stacks))
        self.run.write_json(f"hang.rank{self.rank}.json", record)  # last: its presence means complete
        print(
            f"ciuic-doctor watch: rank {self.rank}: {reason}: hang dump in "
            f"{self.run.path / f'hang.rank{self.rank}.json'}",
            file=sys.stderr,
        )

    def _write_flight_recorder(self, index: int = 0) -> tuple[str | None, dict[str, Any] | None]:
        """This rank's Flight Recorder entries as torch dumps them, in a file of this dump's own (the
        first `hang.fr/rank<R>`, a later one `hang.fr/rank<R>.<index>`), so no dump's file is moved."""
        import pickle

        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None, None
        from torch._C._distributed_c10d import _dump_fr_trace

        from ciuic_doctor.rundir import safe_io

        raw = _dump_fr_trace(includeCollectives=True, includeStackTraces=True, onlyActive=False)
        safe_io.make_dir(self.run.path, "hang.fr")
        name = f"hang.fr/rank{self.rank}" + (f".{index}" if index else "")
        self.run.write_bytes(name, raw)  # O_EXCL temp file + rename, no symlink followed on the way
        return name, pickle.loads(raw).get("pg_status")  # torch's own bytes, in this process

    def _mark_resumed(self) -> None:
        from ciuic_doctor.rundir import safe_io

        path = self.run.path / f"hang.rank{self.rank}.json"
        with contextlib.suppress(OSError, ValueError), self._lock:
            record = json.loads(safe_io.read_bytes(path, max_bytes=safe_io.MAX_JSON_BYTES))
            if not isinstance(record, dict):
                return
            if record.get("reason") == "no-progress":
                record["resumed_t"] = time.time()
                self.run.write_json(path.name, record)
