"""Has a stopped process's GPU memory really been released? (NVML per-process accounting)

A CUDA process's memory is returned to the device a moment after the process exits (the driver
tears its context down asynchronously); starting the next layout before that can fail with out
of memory. A switch therefore waits until none of the old pids holds memory on any GPU, bounded
by a deadline. Without NVML (CPU machines, no driver) there is nothing to wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import ModuleType

from hydra_supervisor.plan import devices


def _session(nvml: devices.Nvml | None) -> contextlib.AbstractContextManager[
        ModuleType | None]:
    """The owner's held NVML (the daemon's), else a session of its own for this reading."""
    return nvml.session() if nvml is not None else devices.nvml_session()


def holders(pids: set[int], nvml: devices.Nvml | None = None) -> set[int] | None:
    """Which of `pids` still hold memory on a GPU; None when NVML is not available."""
    with _session(nvml) as pynvml:
        if pynvml is None:
            return None
        try:
            held: set[int] = set()
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    if p.pid in pids:
                        held.add(p.pid)
            return held
        except pynvml.NVMLError:
            return None


def used_by_pid(nvml: devices.Nvml | None = None) -> dict[int, int]:
    """GPU memory (bytes, all GPUs together) held by each process; empty without NVML.
    `nvml`: the owner's held initialisation (the daemon's snapshots), else one per call."""
    with _session(nvml) as pynvml:
        if pynvml is None:
            return {}
        out: dict[int, int] = {}
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    out[p.pid] = out.get(p.pid, 0) + int(p.usedGpuMemory or 0)
        except pynvml.NVMLError:
            return {}
        return out


async def wait_released(pids: list[int], timeout: float, interval: float = 0.1) -> list[int]:
    """Wait until no pid of `pids` holds GPU memory; returns those that still do at the end."""
    if not pids:
        return []
    want = set(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = await asyncio.to_thread(holders, want)
        if not left:  # None (no NVML) or empty: nothing to wait for
            return []
        if time.monotonic() >= deadline:
            return sorted(left)
        await asyncio.sleep(interval)
