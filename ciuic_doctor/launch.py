"""Run a sub-command on N local ranks through torch's own launcher, and set up a rank once inside.

Outside torchrun, `comm-bench`, `job` and `checkup` call `launch_local`, which runs the same elastic agent
torchrun runs (`torch.distributed.launcher.api.elastic_launch`, c10d rendezvous on a free local port),
so the ranks see exactly the environment `torchrun --standalone --nproc-per-node N -m ciuic_doctor ...`
gives them. No home-made process launcher.

Inside a rank, `init_distributed` picks nccl with CUDA and gloo otherwise, and `agree_on_run_dir` makes
every rank write into rank 0's run directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Any, NoReturn

from ciuic_doctor.errors import ProbeFailed, UserError
from ciuic_doctor.rundir.store import RUN_DIR_ENV

# torch.distributed's default process-group timeout: 10 min for NCCL, 30 min for every other backend
# (reference/collectives.md). A spec's 30 s is a big reduction from either, not an increase.
PG_TIMEOUT_DEFAULT_S = {"nccl": 600.0, "gloo": 1800.0}


def default_pg_timeout_s(backend: str | None) -> float:
    """PyTorch's default timeout for `backend` (None or an unknown backend: the non-NCCL 1800 s)."""
    return PG_TIMEOUT_DEFAULT_S["nccl"] if backend == "nccl" else PG_TIMEOUT_DEFAULT_S["gloo"]


def in_torchrun() -> bool:
    """True inside a rank started by torchrun (or any launcher that sets the env:// variables)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return True
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def check_nproc(nproc: int, source: str = "--nproc") -> None:
    """Refuse more local ranks than CPUs: each rank is a process with its own threads, and --nproc 999
    started 229 ranks on 2 cores before the machine ran out of memory. torchrun has no such
    limit, for whoever means it."""
    cpus = os.cpu_count() or 1
    if nproc < 1:
        raise UserError(f"{source} must be at least 1, not {nproc}")
    if nproc > cpus:
        raise UserError(
            f"{source} {nproc}: more local ranks than this machine's {cpus} CPUs (at most {cpus})"
        )


def launch_local(
    nproc: int,
    argv: list[str],
    *,
    run_dir: Path,
    env: dict[str, str] | None = None,
    max_restarts: int = 0,
) -> None:
    """Run `python -m ciuic_doctor <argv>` on `nproc` local ranks and wait for all of them.

    Every rank gets $CIUIC_RUN_DIR=run_dir. Raises ProbeFailed naming the first rank that failed, with
    its exit code or signal; what the ranks wrote before that stays in the run directory.
    """
    check_nproc(nproc)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ[RUN_DIR_ENV] = str(Path(run_dir).resolve())
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # a killed rank's orphans (forkserver, workers) come back to us
    before = _descendants()  # a caller's own children are its business, not ours to end
    os.environ.update(env or {})
    # One OpenMP thread per rank unless the user says otherwise: N ranks × all cores each is the
    # oversubscription torchrun itself warns about (it sets OMP_NUM_THREADS=1 for nproc > 1).
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "ciuic_doctor", *argv)
    except ChildFailedError as exc:
        raise ProbeFailed(describe_failure(exc)) from None
    except SignalException as exc:
        # torch's agent turns Ctrl-C into SignalException, which reached the user as a traceback and
        # exit 1; the README promises 130 and every record kept.
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise Interrupted(exc.sigval) from None
    finally:
        reap_descendants(spare=before)


def allocation_spread(nproc_per_node: int | None, *, force: bool = False, gpus: int = 0) -> Any:
    """A cluster.Spread over every node of the Slurm allocation this process runs in (SLURM_JOB_ID set,
    or `force`: --slurm), or None outside one: then everything runs on this host as before.

    Ranks per node: `nproc_per_node`, else one per GPU (`gpus`), else 1 (a node's CPUs are the
    scheduler's to count, not this host's).
    """
    from ciuic_doctor.cluster import current
    from ciuic_doctor.cluster.spread import Spread

    scheduler = current(force)
    if scheduler is None:
        return None
    per_node = os.environ.get("SLURM_GPUS_PER_NODE", "")
    gpus = gpus or (int(per_node) if per_node.isdigit() else 0)
    alloc = scheduler.allocation()
    if alloc is None:
        raise UserError("--slurm: run inside an allocation (salloc -N 2 ..., or a batch script)")
    # In a task of a step (SLURM_STEP_ID is set under srun, not in a batch script or salloc's shell): with
    # several tasks each would start its own step over every node; alone (`srun --pty bash`) it holds
    # the CPUs its own step needs, so that step shares them (--overlap) instead of waiting forever.
    in_step = "SLURM_STEP_ID" in os.environ
    tasks = os.environ.get("SLURM_NTASKS", "1")
    if in_step and tasks.isdigit() and int(tasks) > 1:
        raise UserError(
            f"this runs once per allocation and starts one task per node itself, but it is one of {tasks} "
            "tasks of an srun step: run it from the salloc shell or the batch script, not under srun"
        )
    per_node = nproc_per_node or gpus or 1
    return Spread(
        scheduler=scheduler, alloc=alloc, nnodes=len(alloc.nodes), nproc_per_node=per_node, overlap=in_step
    )


def launch_nodes(spread: Any, argv: list[str], *, run_dir: Path, env: dict[str, str] | None = None) -> None:
    """Run `python -m ciuic_doctor <argv>` as `spread`'s ranks (one torchrun per node, one job step) and
    wait; every rank gets $CIUIC_RUN_DIR=run_dir (a folder every node sees). Its output is ours. Raises
    ProbeFailed when the step fails; Ctrl-C or SIGTERM cancels the step (cluster/spread.py)."""
    from ciuic_doctor.cluster import STEP_NAME_ENV

    full = {**os.environ, **(env or {}), RUN_DIR_ENV: str(Path(run_dir).resolve()), "PYTHONUNBUFFERED": "1"}
    if spread.nproc_per_node > 1:
        full.setdefault("OMP_NUM_THREADS", "1")
    name = os.environ.get(STEP_NAME_ENV) or spread.new_name(argv[0])
    # A caller that named the step (checkup) runs memwatch beside it: both share the nodes' CPUs
    spread.overlap = spread.overlap or bool(os.environ.get(STEP_NAME_ENV))
    full[STEP_NAME_ENV] = name  # memwatch finds the step's processes on each node by it
    result = spread.run(["-m", "ciuic_doctor", *argv], name=name, env=full, log=None, timeout_s=float("inf"))
    if result.exit_code != 0:
        raise ProbeFailed(f"the step on {spread.describe()} failed (srun exit code {result.exit_code})")


class Interrupted(ProbeFailed):
    """The launcher was stopped by a signal other than Ctrl-C (SIGTERM, SIGHUP): exit 128 + its number."""

    def __init__(self, sig: int) -> None:
        name = signal.Signals(sig).name
        super().__init__(f"stopped by {name}; every record measured so far is kept")
        self.exit_code = 128 + int(sig)


# ---- children die with their parent ------------------------------------------------------------------
LAUNCHER_ENV = "CIUIC_LAUNCHER_PID"  # our launcher's pid, for its ranks to die with it
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
REAP_GRACE_S = 3.0


def _prctl(option: int, value: int) -> bool:
    """Linux prctl(2) through libc; False where there is none (macOS) or it fails."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_launcher() -> None:
    """In a rank our launcher started: SIGTERM this rank when the launcher dies, even by SIGKILL.

    After kill -9 of `ciuic-doctor job` its ranks kept training. SIGTERM, not SIGKILL, so the
    rank's own exit shuts its DataLoader workers and forkserver down. A process whose parent is not the
    launcher (a DataLoader worker inheriting the variable) is left alone; so is a rank whose launcher is
    already gone, which exits now.
    """
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if not launcher.isdigit() or not in_torchrun():
        return
    if os.getppid() != int(launcher):
        if os.getppid() == 1:  # reparented to init: the launcher died before we got here
            os._exit(128 + signal.SIGTERM)
        return
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(launcher):  # it died between the check and the prctl
        os._exit(128 + signal.SIGTERM)


def _descendants() -> set[int]:
    try:
        import psutil
    except ImportError:
        return set()
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def reap_descendants(grace_s: float = REAP_GRACE_S, spare: set[int] | None = None) -> list[int]:
    """End every process still below this one but those in `spare` (SIGTERM, then SIGKILL after
    `grace_s`); their pids.

    With this process a child subreaper, the orphans of a rank killed with -9 (its forkserver, resource
    tracker, DataLoader workers) are reparented here and end with the run instead of living on.
    """
    try:
        import psutil
    except ImportError:
        return []
    try:
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in (spare or set())]
    except psutil.Error:
        return []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return [p.pid for p in left]


def describe_failure(exc: Any) -> str:
    """One line naming the failed rank(s), their host and exit code or signal."""
    host = socket.gethostname()
    parts = []
    for rank, failure in sorted(exc.failures.items()):
        how = (
            f"killed by signal {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exit code {failure.exitcode}"
        )
        parts.append(f"rank {rank} on {host} ({how})")
    return "ranks failed: " + "; ".join(parts) if len(parts) > 1 else f"{parts[0]} failed"


# made_process_group: set by init_distributed (one of our ranks) or by a watched script's own group;
# ran_user_code: set by watch before it runs a user's script in this process
_THIS_PROCESS = {"made_process_group": False, "flush_user_files": False, "ran_user_code": False}


def init_distributed(timeout_s: float, backend: str = "auto") -> tuple[int, int, str]:
    """Initialise the default process group from env:// and return (rank, world_size, backend).

    backend "auto": nccl when CUDA is available (binding the local device eagerly), gloo otherwise.
    """
    import datetime

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            if backend in ("auto", "nccl"):
                kwargs["device_id"] = torch.device("cuda", local_rank)
        kwargs["backend"] = backend if backend != "auto" else "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(**kwargs)
        _THIS_PROCESS["made_process_group"] = True
    return dist.get_rank(), dist.get_world_size(), dist.get_backend()


def note_user_process_group() -> None:
    """A watched script made a process group in this process: it ends through exit_rank_process too.

    watch's own cross-rank checksum is an all_gather, the collective in the abort's stack: a rank that a
    script re-ran under `watch --child` died that way (exit 250) in the suite. The script's open files
    are flushed first, since os._exit skips the interpreter's closing of them."""
    _THIS_PROCESS["made_process_group"] = True
    _THIS_PROCESS["flush_user_files"] = True


def _flush_open_files() -> None:
    import gc
    import io

    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, and torch.distributed.reduce_op's
        # deprecation wrapper warns on that read (a FutureWarning per rank that the script never caused)
        if issubclass(type(obj), io.IOBase):
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()


def exit_rank_process(code: int) -> None:
    """End a rank process that init_distributed set up, now, without Python's interpreter teardown.

    Why: gloo's worker threads free each finished collective, and the Python tensors it holds, on
    their own schedule, and the group outlives `destroy_process_group()` while anything (a DDP reducer)
    still holds it. A thread that does so while the interpreter is finalizing cannot take the GIL,
    and the process aborts: "terminate called without an active exception", SIGABRT, the stack in
    `pt_gloo_runloop` -> ~AsyncAllgatherWork -> take_gil (pytorch/pytorch#179291). checkpoint-check's
    rank 1, which leaves right after an all_gather_object while rank 0 still prints, died that way in 4
    runs of 25, after every record was written. Returns when this process made no process group (a
    plain command, or a user's script under watch).
    """
    if _THIS_PROCESS["made_process_group"]:
        _end_without_teardown(code, flush_user_files=_THIS_PROCESS["flush_user_files"])


def exit_command_process(code: int) -> None:
    """End a `ciuic-doctor` process (the console script, `python -m ciuic_doctor`) whose work is done.

    A rank ends as exit_rank_process says. A command that loaded pyarrow (report, compact, export,
    checkup: every Parquet and columnar read) ends without the teardown too: Arrow's native thread
    pools are torn down with the process while a worker thread is still joinable, and the process
    aborts with "terminate called without an active exception" after its last line was printed
    (apache/arrow#34314, open; `compact` exited -6 once in the suite's 2,140 tests). A process that ran
    a user's script (watch) keeps Python's own exit: the script's objects are finalized as it expects.
    Returns only then.
    """
    exit_rank_process(code)
    if "pyarrow" in sys.modules and not _THIS_PROCESS["ran_user_code"]:
        _end_without_teardown(code, flush_user_files=False)


def note_user_code() -> None:
    """watch runs a user's script in this process: its exit stays Python's (see exit_command_process)."""
    _THIS_PROCESS["ran_user_code"] = True


def _end_without_teardown(code: int, *, flush_user_files: bool) -> NoReturn:
    """What Python's exit does before its teardown, in its order: the threads that are not daemons are
    waited for, the atexit handlers run while the interpreter is whole (watch's last records, logging,
    multiprocessing's reaping of DataLoader workers), stdout and stderr are flushed; then the process
    ends without the teardown."""
    import atexit
    import threading

    # CPython's own exit calls this first: it wakes the idle workers of executors never shut down
    # (threading's own atexit list), then joins every thread that is not a daemon
    threading._shutdown()
    atexit._run_exitfuncs()  # CPython's own exit path calls the same function before finalizing
    if flush_user_files:
        _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def agree_on_run_dir(path: Path) -> Path:
    """Rank 0's choice of run directory, broadcast to every rank (timestamps differ between ranks)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return path
    holder = [str(path)]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])
