"""GPU memory as NVML sees it from outside the training processes: per process and per device.

A thin wrapper over nvidia-ml-py (`import pynvml`; the PyPI package named `pynvml` is deprecated and
warns). It never imports torch, so memwatch can attach to a job without touching CUDA itself.

Why NVML and not torch.cuda: the allocator's own counters cannot see the CUDA context, cuBLAS
workspaces or NCCL buffers (the context alone is ~0.3–1 GB); NVML's per-process figure includes them,
so NVML − reserved is the "non-PyTorch" memory (reference/memory.md). Facts used here:

- per-process usage is `nvmlDeviceGetComputeRunningProcesses` plus `...GraphicsRunningProcesses`,
  field `usedGpuMemory`, which is None on MIG and on Windows WDDM (pynvml maps NVML's "not available"
  value to None);
- in a container NVML reports host PIDs, so they match the PIDs we see only with `--pid=host`.

`get()` initialises NVML once per process. Where there is no driver or library (a CPU box, a container
without the driver mounted) it returns a handle with `available=False` and the reason, and every query
answers "nothing" — callers record the reason once instead of failing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class DeviceMemory:
    """One GPU as the driver sees it (`nvmlDeviceGetMemoryInfo`)."""

    index: int
    total_bytes: int
    used_bytes: int


@dataclass(kw_only=True)
class ProcessGpuMemory:
    """What one PID holds on the GPUs, summed over every device it has a context on.

    `used_bytes` is None when the driver does not report it (MIG, WDDM) for any of its devices.
    `devices` lists every device index: a rank with a context on two devices is usually a rank that
    touched cuda:0 before calling set_device (another ~0.5 GB of context on GPU 0 per rank).
    """

    pid: int
    used_bytes: int | None
    devices: list[int] = field(default_factory=list)


class Nvml:
    """An opened NVML, or the reason it could not be opened (`available`, `reason`)."""

    def __init__(self, lib: Any = None, handles: list[Any] | None = None, reason: str | None = None) -> None:
        self._lib = lib
        self._handles = handles or []
        self.reason = reason

    @property
    def available(self) -> bool:
        return self._lib is not None

    @classmethod
    def open(cls) -> Nvml:
        """Initialise NVML; on any failure return an unavailable handle that says why."""
        try:
            import pynvml
        except ImportError:
            return cls(reason="nvidia-ml-py is not installed (pip install nvidia-ml-py)")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return cls(reason=f"NVML could not start: {exc} (no NVIDIA driver on this machine?)")
        except OSError as exc:  # a broken libnvidia-ml.so can fail below pynvml's own error types
            return cls(reason=f"NVML could not start: {exc}")
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as exc:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
            return cls(reason=f"NVML started but could not list devices: {exc}")
        return cls(lib=pynvml, handles=handles)

    def devices(self) -> list[DeviceMemory]:
        """Total and used memory of every device (empty when NVML is not available)."""
        out = []
        for index, handle in enumerate(self._handles):
            try:
                info = self._lib.nvmlDeviceGetMemoryInfo(handle)
            except self._lib.NVMLError:
                continue  # a device fallen off the bus: leave it out rather than stop sampling
            out.append(DeviceMemory(index=index, total_bytes=int(info.total), used_bytes=int(info.used)))
        return out

    def process_memory(self) -> dict[int, ProcessGpuMemory]:
        """GPU memory per PID over all devices, compute and graphics contexts together.

        A PID listed under both compute and graphics on one device (an OpenGL/CUDA interop process) is
        the same context; it is counted once per device, with the larger figure.
        """
        per_device: dict[tuple[int, int], int | None] = {}
        for index, handle in enumerate(self._handles):
            for query in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    listed = getattr(self._lib, query)(handle)
                except self._lib.NVMLError:
                    continue  # e.g. NOT_SUPPORTED for graphics on a compute-only board
                for proc in listed:
                    key = (int(proc.pid), index)
                    used = None if proc.usedGpuMemory is None else int(proc.usedGpuMemory)
                    previous = per_device.get(key)
                    per_device[key] = used if previous is None else max(previous, used or 0)
        result: dict[int, ProcessGpuMemory] = {}
        for (pid, index), used in sorted(per_device.items()):
            entry = result.setdefault(pid, ProcessGpuMemory(pid=pid, used_bytes=None))
            entry.devices.append(index)
            if used is not None:
                entry.used_bytes = (entry.used_bytes or 0) + used
        return result

    def device_figures(self) -> list[dict[str, Any]]:
        """Per device: UUID, utilisation (0-1: the share of the last sample period a kernel ran), memory
        used and total, board power (W) and SM clock (Hz), for `top` and `export`. A figure the board
        does not report (NOT_SUPPORTED on some boards and under MIG) is None; no devices without NVML."""
        out: list[dict[str, Any]] = []
        lib = self._lib
        for index, handle in enumerate(self._handles):

            def ask(call: str, *extra: Any, handle: Any = handle) -> Any:
                try:
                    return getattr(lib, call)(handle, *extra)
                except lib.NVMLError:
                    return None

            util, mem = ask("nvmlDeviceGetUtilizationRates"), ask("nvmlDeviceGetMemoryInfo")
            power_mw = ask("nvmlDeviceGetPowerUsage")
            clock_mhz = ask("nvmlDeviceGetClockInfo", lib.NVML_CLOCK_SM)
            uuid = ask("nvmlDeviceGetUUID")
            out.append(
                {
                    "index": index,
                    "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                    "utilization_ratio": None if util is None else util.gpu / 100,
                    "memory_used_bytes": None if mem is None else int(mem.used),
                    "memory_total_bytes": None if mem is None else int(mem.total),
                    "power_watts": None if power_mw is None else power_mw / 1000,
                    "sm_clock_hertz": None if clock_mhz is None else clock_mhz * 1e6,
                }
            )
        return out

    def close(self) -> None:
        if self._lib is not None:
            with contextlib.suppress(self._lib.NVMLError):
                self._lib.nvmlShutdown()
            self._lib = None
            self._handles = []
            self.reason = "closed"


_OPENED: Nvml | None = None


def get() -> Nvml:
    """The process's one NVML handle, opened on first use (NVML init costs ~10 ms; do it once)."""
    global _OPENED  # noqa: PLW0603 - one handle per process is the point
    if _OPENED is None:
        _OPENED = Nvml.open()
    return _OPENED
