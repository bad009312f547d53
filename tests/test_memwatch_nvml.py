"""NVML through nvidia-ml-py: the real library on this driverless machine, and the per-process logic on
a stand-in `pynvml` module shaped like the real one (no GPU here; the real path runs where one is)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from ciuic_doctor.machine import nvml
from ciuic_doctor.probes.memwatch import sampler as memwatch

MIB = 2**20


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a driver is present: NVML opens")
def test_no_driver_is_recorded_as_not_available_with_the_reason():
    handle = nvml.Nvml.open()
    assert handle.available is False
    assert "NVML" in handle.reason
    assert handle.devices() == []
    assert handle.process_memory() == {}


class _NVMLError(Exception):
    pass


def _proc(pid: int, used: int | None) -> types.SimpleNamespace:
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


def _fake_pynvml(compute: dict[int, list], graphics: dict[int, list], *, init_error: bool = False):
    """A module with the pynvml calls nvml.py makes; `compute`/`graphics`: device index -> processes."""
    module = types.ModuleType("pynvml")
    module.NVMLError = _NVMLError

    def init():
        if init_error:
            raise _NVMLError("Driver Not Loaded")

    def graphics_processes(handle):
        if handle not in graphics:
            raise _NVMLError("Not Supported")
        return graphics[handle]

    module.nvmlInit = init
    module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: 2
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=81559 * MIB, used=(h + 1) * 1000 * MIB
    )
    module.nvmlDeviceGetComputeRunningProcesses = lambda h: compute.get(h, [])
    module.nvmlDeviceGetGraphicsRunningProcesses = graphics_processes
    return module


def test_per_process_memory_over_devices(monkeypatch):
    fake = _fake_pynvml(
        compute={
            0: [_proc(10, 30_000 * MIB), _proc(11, 500 * MIB)],
            1: [_proc(11, 31_000 * MIB), _proc(12, None)],
        },
        graphics={0: [_proc(10, 30_000 * MIB)]},  # the same context listed twice on device 0: counted once
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    handle = nvml.Nvml.open()
    assert handle.available
    per_pid = handle.process_memory()
    assert per_pid[10].used_bytes == 30_000 * MIB
    assert per_pid[10].devices == [0]
    # rank 11 touched cuda:0 before set_device: a second context on GPU 0
    assert per_pid[11].used_bytes == 31_500 * MIB
    assert per_pid[11].devices == [0, 1]
    assert per_pid[12].used_bytes is None  # MIG / WDDM: the driver does not say
    assert [d.total_bytes for d in handle.devices()] == [81559 * MIB] * 2


def test_init_failure_keeps_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml({}, {}, init_error=True))
    handle = nvml.Nvml.open()
    assert not handle.available
    assert "Driver Not Loaded" in handle.reason


def _watch_with(monkeypatch, tmp_path, fake) -> Path:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml, "_OPENED", None)  # a fresh handle over the stand-in library
    return tmp_path / "run"


def test_samples_carry_nvml_bytes_of_the_watched_process(monkeypatch, tmp_path, sleeper):
    fake = _fake_pynvml(compute={1: [_proc(sleeper.pid, 2_000 * MIB)]}, graphics={})
    run = _watch_with(monkeypatch, tmp_path, fake)
    config = memwatch.MemwatchConfig(pid=sleeper.pid, interval_s=0.05, duration_s=0.2)
    result = memwatch.watch(config, run, progress=lambda line: None)
    samples = [json.loads(line) for line in (run / "memwatch.jsonl").read_text().splitlines()]
    assert result.nvml_reason is None
    assert samples
    assert all(s["gpu_bytes"] == 2_000 * MIB for s in samples)
    assert all(s["gpu_devices"] == [1] and s["gpu_total_bytes"] == 81559 * MIB for s in samples)
    assert result.roles["rank 0"].gpu_peak == 2_000 * MIB


def test_nvml_pids_from_another_pid_namespace_are_noted_once(monkeypatch, tmp_path, sleeper):
    """In a container without --pid=host NVML reports host PIDs that do not exist in here."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    fake = _fake_pynvml(compute={0: [_proc(pid_max + 5, 2_000 * MIB)]}, graphics={})
    run = _watch_with(monkeypatch, tmp_path, fake)
    config = memwatch.MemwatchConfig(pid=sleeper.pid, interval_s=0.05, duration_s=0.2)
    result = memwatch.watch(config, run, progress=lambda line: None)
    assert len(result.notes) == 1
    assert "--pid=host" in result.notes[0]
    events = [json.loads(line) for line in (run / "memwatch_events.jsonl").read_text().splitlines()]
    assert sum(e["kind"] == "note" for e in events) == 1
