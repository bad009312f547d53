"""Name the rank that died or hung, once, instead of leaving every survivor with a socket error.

Every rank publishes through the rendezvous store (which the torchrun agent hosts, so it outlives any
worker) a heartbeat counter, bumped by a thread every HEARTBEAT_S, and the row it is on. When a
collective fails on a survivor — a peer's socket closed (it died) or the process-group timeout
expired (it hung) — the survivor watches the heartbeats for DEAD_AFTER_S: a rank whose counter does
not move is dead; a live rank still on an earlier row is hung. The first survivor to decide writes
its one-line verdict to the store (compare_set), prints it and exits non-zero; the others exit
quietly, so the user reads one message naming the rank and host.

The same thread is a watchdog for hangs the backend cannot see (a stuck device sync): no progress for
the timeout plus a grace period ends the process with the same diagnosis.

With `defer_sigterm` (comm-bench), SIGTERM ends the rank at its next step or tick, never in between:
the launcher SIGTERMs rank 0 about 0.1 s after a peer dies, and rank 0 may still be gathering and writing
the row every rank has just finished. Raised there, it lost that row and named it as the one the peer died
during. Deferring costs no reaction time: the handler cannot run inside a blocking collective anyway
(Python handlers run between bytecodes), and the Python between two ticks is milliseconds of bookkeeping.

Test hook (documented, off unless set): CIUIC_COMM_FAULT="RANK:BYTES:ACTION" makes rank RANK, before its
first row of BYTES bytes, `exit` (os._exit(3)), `kill` (SIGKILL itself), `hang` (block forever, its
heartbeat still beating) or `stop` (SIGSTOP itself: frozen whole, as `kill -STOP` leaves a process).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

HEARTBEAT_S = 0.5
DEAD_AFTER_S = 6 * HEARTBEAT_S  # six missed beats: a live rank beats by then even on an overloaded machine
STALL_GRACE_S = 10.0  # beyond the process-group timeout, so the backend's own timeout reports first
FAULT_ENV = "CIUIC_COMM_FAULT"
_PREFIX = "ciuic_comm/"


class Terminated(Exception):
    """SIGTERM arrived (the launcher stops the survivors when one worker fails, or the user stops it)."""


def default_store() -> Any | None:
    """The rendezvous store of the default process group, or None when it cannot be reached."""
    try:
        import torch.distributed as dist

        return dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store())
    except (AttributeError, RuntimeError, ValueError):
        return None


@dataclass(kw_only=True)
class Watch:
    """Heartbeat, progress and the single failure report for one rank of the benchmark."""

    store: Any | None
    rank: int
    world_size: int
    hosts: list[str]
    timeout_s: float
    row: int = 0
    label: str = "start-up"
    # The stall watchdog (no progress for timeout + STALL_GRACE_S ends the process): comm-bench's rows
    # are short; the job turns it off, its start-up (model build, DataLoader workers) is not a row.
    stall_watchdog: bool = True
    # SIGTERM acted on at the next step() or tick() (see the module docstring); the job's start-up is
    # long and has no ticks, so it keeps the immediate Terminated.
    defer_sigterm: bool = False
    command: str = "comm-bench"
    _last_progress: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    _reported: threading.Lock = field(default_factory=threading.Lock)
    _beats: int = 0
    _diagnosing: bool = False
    _terminating: bool = False

    def start(self) -> None:
        self._publish()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        threading.Thread(target=self._beat, name="ciuic-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def step(self, label: str) -> None:
        """Entering a new row: tell the other ranks where this one is."""
        self.row += 1
        self.label = label
        self.tick()
        self._publish()

    def tick(self) -> None:
        """Progress, and the point where a deferred SIGTERM ends the rank."""
        self._last_progress = time.monotonic()
        if self._terminating:
            raise Terminated("terminated by SIGTERM")

    # ---- the background thread ---------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # While diagnosing, finish the one message first: the launcher SIGTERMs every survivor as soon
        # as one worker exits, and waits (30 s in torch elastic) before it escalates to SIGKILL.
        if self._diagnosing:
            return
        if self.defer_sigterm:
            self._terminating = True
            return
        raise Terminated("terminated by SIGTERM")

    def _publish(self) -> None:
        if self.store is None:
            return
        with contextlib.suppress(Exception):  # the store's host may be gone: nothing to tell then
            self.store.set(f"progress/{self.rank}", f"{self.row}|{self.label}")
            self.store.set(f"beat/{self.rank}", str(self._beats))
            self.store.set(f"pid/{self.rank}", str(os.getpid()))

    def _beat(self) -> None:
        stall_after = self.timeout_s + STALL_GRACE_S
        while not self._stop.wait(HEARTBEAT_S):
            self._beats += 1
            if self.store is not None:
                with contextlib.suppress(Exception):
                    self.store.set(f"beat/{self.rank}", str(self._beats))
            if self.stall_watchdog and time.monotonic() - self._last_progress > stall_after:
                message = self.report(f"no progress for {stall_after:.0f} s")
                if message:
                    print(f"ciuic-doctor {self.command}: FAILED: {message}", file=sys.stderr, flush=True)
                os._exit(1)

    # ---- diagnosis ---------------------------------------------------------------------------
    def _read(self, kind: str) -> dict[int, str]:
        values: dict[int, str] = {}
        if self.store is None:
            return values
        for r in range(self.world_size):
            key = f"{kind}/{r}"
            with contextlib.suppress(Exception):
                if self.store.check([key]):
                    values[r] = self.store.get(key).decode()
        return values

    def _where(self, r: int) -> str:
        host = self.hosts[r] if r < len(self.hosts) else "?"
        return f"rank {r} on {host}"

    def diagnose(self, error: str) -> str:
        """One line naming the dead or hung rank(s), after watching their heartbeats."""
        if self.store is None:
            return f"{self.label} failed and the rendezvous store is unreachable: {error}"
        first = self._read("beat")
        alive = {self.rank}
        deadline = time.monotonic() + DEAD_AFTER_S
        while time.monotonic() < deadline and len(alive) < self.world_size:
            time.sleep(HEARTBEAT_S / 2)
            now = self._read("beat")
            alive |= {r for r, v in now.items() if first.get(r) != v}
        silent = [r for r in range(self.world_size) if r not in alive]
        if silent:
            return self._silent(silent)
        progress = self._read("progress")
        behind = []
        for r, value in sorted(progress.items()):
            row, _, label = value.partition("|")
            if r != self.rank and row.isdigit() and int(row) < self.row:
                behind.append(f"{self._where(r)} stopped making progress (last seen at {label})")
        if behind:
            return (
                f"{'; '.join(behind)}: it never joined {self.label} within the {self.timeout_s:g} s --timeout"
            )
        return f"{self.label} failed on {self._where(self.rank)}; every rank is alive: {error}"

    def _silent(self, ranks: list[int]) -> str:
        """Ranks without a heartbeat: "died" when this host sees the process gone; else "not responding"
        (a SIGSTOPped or frozen process beats no more either, and was called dead). A frozen
        rank on this host is killed, so the launcher does not wait out torch's 30 s grace for it: it cannot
        act on the SIGTERM that stops the others."""
        pids = self._read("pid")
        me = self.hosts[self.rank] if self.rank < len(self.hosts) else None
        died, frozen = [], []
        for r in ranks:
            pid = int(pids[r]) if pids.get(r, "").isdigit() else None
            local = pid is not None and r < len(self.hosts) and self.hosts[r] == me
            state = process_state(pid) if local and pid is not None else None
            if local and state in (None, "Z", "X"):
                died.append(r)
                continue
            frozen.append((r, pid if local else None, state))
        parts = []
        if died:
            who = ", ".join(self._where(r) for r in died)
            parts.append(f"{who} died during {self.label} (no heartbeat for {DEAD_AFTER_S:.0f} s)")
        for r, pid, state in frozen:
            how = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger"}.get(
                state or "", "alive but frozen"
            )
            if pid is None:
                why = f"no heartbeat for {DEAD_AFTER_S:.0f} s: dead or frozen"
            else:
                why = f"process {pid} {how}, no heartbeat for {DEAD_AFTER_S:.0f} s; killed to end the run"
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            parts.append(f"{self._where(r)} is not responding during {self.label} ({why})")
        return "; ".join(parts)

    def stored_failure(self) -> str | None:
        if self.store is None:
            return None
        with contextlib.suppress(Exception):
            if self.store.check(["failure"]):
                return self.store.get("failure").decode() or None
        return None

    def report(self, error: str) -> str | None:
        """Diagnose once; return the message if this rank is the one to print it, else None."""
        with self._reported:
            self._diagnosing = True
            if self.stored_failure():  # another survivor has already said it
                return None
            message = self.diagnose(error)
            if self.store is None:
                return message
            try:
                current = self.store.compare_set("failure", "", message)
            except Exception:  # the store is gone with its host: speak for ourselves
                return message
            current = current.decode() if isinstance(current, bytes) else str(current)
            return message if current == message else None


def process_state(pid: int) -> str | None:
    """The state letter of a local process from /proc (R, S, D, T, t, Z, ...); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0] if ")" in stat else None


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]


@dataclass(kw_only=True, frozen=True)
class Fault:
    rank: int
    bytes: int
    action: str


def fault_from_env() -> Fault | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    rank, size, action = spec.split(":")
    if action not in ("exit", "kill", "hang", "stop"):
        raise ValueError(f"{FAULT_ENV}: action must be exit, kill, hang or stop, not {action!r}")
    return Fault(rank=int(rank), bytes=int(size), action=action)


def inject(fault: Fault | None, rank: int, size_bytes: int) -> None:
    """The test hook: die or hang here if CIUIC_COMM_FAULT says so."""
    if fault is None or fault.rank != rank or fault.bytes != size_bytes:
        return
    print(
        f"[test hook {FAULT_ENV}] rank {rank}: {fault.action} at {size_bytes} bytes",
        file=sys.stderr,
        flush=True,
    )
    if fault.action == "exit":
        os._exit(3)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "stop":  # frozen whole, heartbeat thread included, as `kill -STOP` leaves it
        os.kill(os.getpid(), signal.SIGSTOP)
    threading.Event().wait()  # hang: block forever, heartbeat thread still beating
