"""Children that die with the process that started them, even when it is killed with -9.

checkup's phases, verify's A/B runs and the Slurm steps they start all hand `die_with_parent()` to
`subprocess.Popen(preexec_fn=...)`: the child asks the kernel for SIGTERM when its parent dies
(Linux PR_SET_PDEATHSIG). SIGTERM, not SIGKILL, so the child ends in order: torchrun passes it on to its
ranks, srun cancels its job step, a rank's exit takes its DataLoader workers with it.

>>> arm = die_with_parent()
>>> arm is None or callable(arm)
True
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """Popen's preexec_fn that arms PR_SET_PDEATHSIG(SIGTERM) in the child; None where there is no prctl.

    libc's prctl is looked up here, before the fork: the child only makes one call. A parent that died
    between the fork and the prctl is noticed (the child's parent is no longer this process) and the
    child exits at once, as SIGTERM would have made it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(128 + signal.SIGTERM)

    return arm
