"""The control API's transport: HTTP + JSON on a 0600 unix socket, handlers run on the loop."""

from __future__ import annotations

import asyncio
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from hydra_supervisor.runtime import control


def test_round_trip_runs_handlers_on_the_loop_thread(tmp_path: Path) -> None:
    seen: list[str] = []

    async def status(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        seen.append(threading.current_thread().name)
        return 200, {"ok": True, "echo": body}

    async def boom(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        raise RuntimeError("bug")

    async def go() -> None:
        loop = asyncio.get_running_loop()
        path = tmp_path / "control.sock"
        srv = control.ControlServer(path, loop, {("GET", "/status"): status,
                                                 ("POST", "/switch"): status,
                                                 ("POST", "/boom"): boom})
        srv.start()
        try:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            code, reply = await asyncio.to_thread(control.call, path, "GET", "/status")
            assert (code, reply["ok"]) == (200, True)
            code, reply = await asyncio.to_thread(control.call, path, "POST", "/switch",
                                                  {"profile": "demo"})
            assert reply["echo"] == {"profile": "demo"}
            code, reply = await asyncio.to_thread(control.call, path, "POST", "/nope")
            assert code == 404 and "no such control route" in reply["error"]
            code, reply = await asyncio.to_thread(control.call, path, "POST", "/boom")
            assert code == 500 and "bug" in reply["error"]
        finally:
            srv.stop()
        assert not path.exists()

    asyncio.run(go())
    assert seen == ["MainThread", "MainThread"]


def test_nothing_listening_is_not_running(tmp_path: Path) -> None:
    with pytest.raises(control.NotRunning):
        control.call(tmp_path / "control.sock", "GET", "/status")
    # a stale socket file of a dead hydra
    import socket
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "stale.sock"))
    s.close()
    with pytest.raises(control.NotRunning):
        control.call(tmp_path / "stale.sock", "GET", "/status")
