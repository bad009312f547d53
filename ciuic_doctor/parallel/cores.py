"""How many cores this process may use: its CPU affinity, capped by a cgroup CPU quota when one is set.

`os.cpu_count()` is the machine's count; a Slurm step or a container sees fewer. Affinity
(`sched_getaffinity`) is what taskset and Slurm's cpu binding give; a quota (cgroup v2 `cpu.max`
"200000 100000" = 2 cores, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`) is what Docker's --cpus and
Kubernetes' limits give, without changing affinity: more workers than the quota only take turns.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """Cores this process may run on at once (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cgroup_quota(root: Path = CGROUP) -> float | None:
    """The CPU quota in cores of this process's cgroup (v2, else v1), or None when unlimited or unknown."""
    own = _own_cgroup()
    for folder in ([root / own.lstrip("/")] if own else []) + [root]:
        found = _v2_quota(folder / "cpu.max")
        if found is not None:
            return found
    return _v1_quota(root / "cpu")


def _own_cgroup() -> str | None:
    """This process's cgroup v2 path ("0::/user.slice/..."), None when there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    return next((line[3:] for line in lines if line.startswith("0::")), None)


def _v2_quota(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period) if int(period) > 0 and int(quota) > 0 else None
    except ValueError:
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
