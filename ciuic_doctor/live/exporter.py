"""`watch --metrics-port N`: start `ciuic-doctor export` beside the watched job, one per node.

Only the process that is local rank 0 (or the only process) starts it; under torchrun it attaches to the
agent (the rank's parent), so it serves every rank of the node. It runs in a process of its own,
detached from the job's process tree (started through a short-lived middle process, so it is not a
child of the rank: memwatch, hang --pid and top do not take it for a DataLoader worker), and it exits by
itself when the job does. Sampling in its own process keeps the GIL of the rank free: the job is never
slowed by the exporter's Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_DETACH = "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True)"


def should_start() -> bool:
    """True in the process that serves the node: local rank 0 under torchrun, else the only process."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def start_exporter(*, port: int, run_dir: Path, bind: str = "127.0.0.1") -> int:
    """Start the exporter for this node's job, listening on `bind` (loopback unless the user said
    otherwise: `watch --bind`); returns the PID it attaches to."""
    target = os.getppid() if "LOCAL_RANK" in os.environ else os.getpid()
    command = [sys.executable, "-m", "ciuic_doctor", "export", "--pid", str(target), "--run", str(run_dir),
               "--port", str(port), "--bind", bind]  # fmt: skip
    subprocess.run([sys.executable, "-c", _DETACH, *command], check=False, stdin=subprocess.DEVNULL)
    return target
