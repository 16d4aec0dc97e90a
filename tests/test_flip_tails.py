"""Flips without tails (issue 31): the daemon holds one NVML initialisation for its life (its
snapshots neither init nor shut NVML down), and a switch's reply is written before the
snapshot of what it changed is built. Fake supervisors and a fake router (fast, no processes:
tests/test_standby_policy.py's port with a standby pair); a fake pynvml counts the calls.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from hydra_supervisor.plan import devices
from hydra_supervisor.proc import gpumem
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.runtime import control_client
from hydra_supervisor.runtime.daemon import Daemon, Options
from hydra_supervisor.serve.snapshot import Snapshot
from tests.test_standby_policy import active, make, run, sb, until


class _NvmlError(Exception):
    pass


def fake_pynvml(used: dict[int, int] | None = None) -> ModuleType:
    """A pynvml with one GPU whose processes hold `used` bytes; counts init and shutdown."""
    m = ModuleType("pynvml")
    calls = {"init": 0, "shutdown": 0}
    procs = [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in (used or {}).items()]

    def init() -> None:
        calls["init"] += 1

    def shutdown() -> None:
        calls["shutdown"] += 1

    m.calls = calls  # type: ignore[attr-defined]
    m.NVMLError = _NvmlError  # type: ignore[attr-defined]
    m.nvmlInit = init  # type: ignore[attr-defined]
    m.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: procs  # type: ignore[attr-defined]
    return m


def test_a_held_nvml_reads_without_init_or_shutdown_per_reading() -> None:
    fake = fake_pynvml({41: 3 << 20, 42: 5 << 20})
    nvml = devices.Nvml(load=lambda: fake)
    for _ in range(5):
        assert gpumem.used_by_pid(nvml) == {41: 3 << 20, 42: 5 << 20}
        assert gpumem.holders({42, 43}, nvml) == {42}
    assert fake.calls == {"init": 1, "shutdown": 0}  # type: ignore[attr-defined]
    nvml.close()
    assert fake.calls == {"init": 1, "shutdown": 1}  # type: ignore[attr-defined]
    # without a holder each reading is a session of its own (init + shutdown), as before
    absent = devices.Nvml(load=lambda: None)
    assert gpumem.used_by_pid(absent) == {} and gpumem.holders({1}, absent) is None


def test_the_daemons_snapshots_and_flips_do_not_init_nvml_each_time(tmp_path: Path) -> None:
    port = make(tmp_path)
    d = Daemon(StateDir(tmp_path / "state"), Options(profile=None), [port], port.node)
    fake = fake_pynvml()
    d.nvml = devices.Nvml(load=lambda: fake)

    async def body() -> None:
        await until(lambda: sb(port).ready())
        assert any(lane.running for lane in d.lanes())  # so every snapshot reads NVML
        for _ in range(5):
            d.take()
        for want in ("moe-s", "moe-c", "moe-s"):
            rep = await d.switch(want)  # each flip publishes snapshots (Port.announce)
            assert rep["result"] == "ok" and rep["instant"] is True
            await until(lambda: sb(port).ready())
        assert active(port).name == "moe-s"
        assert fake.calls == {"init": 1, "shutdown": 0}  # type: ignore[attr-defined]

    run(port, body)
    d.nvml.close()
    assert fake.calls == {"init": 1, "shutdown": 1}  # type: ignore[attr-defined]


def test_the_switch_reply_is_written_before_the_post_switch_snapshot(tmp_path: Path) -> None:
    """A snapshot builder that blocks the loop until the client has its reply (bounded): with
    the snapshot built before the reply (inside the flip, as before), the reply cannot come
    while it blocks, and it waits out its deadline."""
    port = make(tmp_path)
    d = Daemon(StateDir(tmp_path / "state"), Options(profile=None), [port], port.node)
    order: list[str] = []
    replied = threading.Event()
    armed = threading.Event()

    def slow_take() -> Snapshot:
        if armed.is_set():
            order.append("snapshot")
            if not replied.wait(5.0):  # blocks the loop: a reply behind it cannot come
                order.append("snapshot timed out")
        return Daemon.take(d)

    d.take = slow_take  # type: ignore[method-assign]

    def client(sock: Path) -> dict[str, Any]:
        code, rep = control_client.call(sock, "POST", "/switch", {"profile": "moe-s"},
                                        timeout=30)
        order.append("reply")
        replied.set()
        assert code == 200, rep
        return rep

    async def body() -> None:
        await until(lambda: sb(port).ready())
        ctl = d.control_server(asyncio.get_running_loop())
        ctl.start()
        try:
            armed.set()
            t0 = time.monotonic()
            rep = await asyncio.to_thread(client, ctl.path)
            assert rep["result"] == "ok" and rep["instant"] is True, rep
            await until(lambda: "snapshot" in order)  # published after it, not dropped
            # the reply never waited for the snapshot (which the client's thread may write
            # down first: the server publishes as soon as it has written the reply)
            assert "snapshot timed out" not in order, order
            assert sorted(order) == ["reply", "snapshot"], order
            assert time.monotonic() - t0 < 4.0
            snap, _ = d.publisher.get(max_age=60.0)
            assert snap is not None
            assert [lane.profile for _, lane in snap.lanes()][0] == "moe-s"
        finally:
            armed.clear()
            ctl.stop()

    run(port, body)
