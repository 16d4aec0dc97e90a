"""systemd notify on a real datagram $NOTIFY_SOCKET (a path and an abstract '@' name): the
messages arrive as systemd would read them, the watchdog pings stop when the health condition
turns false, and nothing happens outside systemd."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hydra_supervisor.runtime.notify import (
    Notifier,
    monotonic_usec,
    ready_when,
    status_text,
    watchdog_loop,
)
from hydra_supervisor.serve.snapshot import DaemonInfo, LaneStatus, PortStatus, Snapshot
from tests.notify_listener import DEADLINE, Listener


@pytest.fixture
def path_listener(tmp_path: Path) -> Iterator[tuple[str, Listener]]:
    addr = str(tmp_path / "notify.sock")
    lst = Listener(addr)
    yield addr, lst
    lst.sock.close()


@pytest.fixture
def abstract_listener() -> Iterator[tuple[str, Listener]]:
    name = f"hydra-test-{uuid.uuid4().hex}"
    lst = Listener("\0" + name)
    yield "@" + name, lst
    lst.sock.close()


def test_messages_on_a_path_socket(path_listener: tuple[str, Listener]) -> None:
    addr, lst = path_listener
    n = Notifier.from_env({"NOTIFY_SOCKET": addr})
    assert n.enabled and n.watchdog_interval() is None
    assert n.ready("serving demo at http://127.0.0.1:8080")
    assert lst.recv() == {"READY": "1", "STATUS": "serving demo at http://127.0.0.1:8080"}
    assert n.status("switching to\nmoe35b")  # a newline would end the field: one line
    assert lst.recv() == {"STATUS": "switching to moe35b"}
    before = monotonic_usec()
    assert n.reloading("reloading")
    msg = lst.recv()
    assert msg["RELOADING"] == "1" and msg["STATUS"] == "reloading"
    assert before <= int(msg["MONOTONIC_USEC"]) <= monotonic_usec()
    assert n.stopping()
    assert lst.recv() == {"STOPPING": "1"}
    assert n.watchdog()
    assert lst.recv() == {"WATCHDOG": "1"}
    assert n.extend_timeout(90)
    assert lst.recv() == {"EXTEND_TIMEOUT_USEC": "90000000"}
    n.close()


def test_abstract_socket_name(abstract_listener: tuple[str, Listener]) -> None:
    addr, lst = abstract_listener
    n = Notifier.from_env({"NOTIFY_SOCKET": addr})
    assert n.ready()
    assert lst.recv() == {"READY": "1"}


def test_not_under_systemd_is_a_no_op() -> None:
    n = Notifier.from_env({})
    assert not n.enabled
    assert not n.ready() and not n.watchdog() and not n.stopping()
    assert n.watchdog_interval() is None
    asyncio.run(asyncio.wait_for(watchdog_loop(n, lambda: True), 1))  # returns at once


def test_gone_socket_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                          ) -> None:
    n = Notifier(str(tmp_path / "nobody-listens.sock"))
    assert not n.ready() and not n.watchdog()
    assert sum("notify" in r.message for r in caplog.records) == 1  # once, not per message


def test_watchdog_env() -> None:
    pid = str(os.getpid())
    n = Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": pid})
    assert n.watchdog_interval() == 30.0 and n.watchdog_period() == 15.0
    # no WATCHDOG_PID: the watchdog is ours
    assert Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "2000000"}
                             ).watchdog_interval() == 2.0
    # another process's watchdog (e.g. inherited from a parent under systemd): not ours
    other = Notifier.from_env({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "2000000",
                               "WATCHDOG_PID": "1"})
    assert other.watchdog_interval() is None
    assert Notifier.from_env({"WATCHDOG_USEC": "bogus"}).watchdog_interval() is None


def test_from_env_unsets_the_variables_for_children(path_listener: tuple[str, Listener]
                                                   ) -> None:
    """llama.cpp children inherit hydra's environment: they must not see NOTIFY_SOCKET."""
    addr, lst = path_listener
    code = (
        "import os\n"
        "from hydra_supervisor.runtime.notify import Notifier\n"
        "n = Notifier.from_env()\n"
        "assert 'NOTIFY_SOCKET' not in os.environ and 'WATCHDOG_USEC' not in os.environ\n"
        "assert n.watchdog_interval() == 4.0\n"
        "n.ready('child')\n"
    )
    env = {**os.environ, "NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "4000000"}
    env.pop("WATCHDOG_PID", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert lst.recv() == {"READY": "1", "STATUS": "child"}


def test_watchdog_pings_only_while_alive(path_listener: tuple[str, Listener]) -> None:
    addr, lst = path_listener
    n = Notifier(addr, watchdog_usec=100_000)  # WatchdogSec=0.1: a ping every 50 ms
    healthy = {"v": True}

    async def scenario() -> tuple[list[dict[str, str]], list[dict[str, str]],
                                  list[dict[str, str]]]:
        stop = asyncio.Event()
        task = asyncio.create_task(watchdog_loop(n, lambda: healthy["v"], stop))
        await asyncio.sleep(0.5)
        first = lst.drain()  # pings so far
        healthy["v"] = False  # e.g. the router's acceptor thread died
        await asyncio.sleep(0.01)
        lst.drain()  # a ping sent before the flag flipped
        await asyncio.sleep(0.5)
        silent = lst.drain()
        healthy["v"] = True
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.wait_for(task, DEADLINE)
        again = lst.drain()
        return first, silent, again

    t0 = time.monotonic()
    first, silent, again = asyncio.run(scenario())
    assert len(first) >= 3 and all(m == {"WATCHDOG": "1"} for m in first)
    assert silent == []
    assert again and all(m == {"WATCHDOG": "1"} for m in again)
    assert time.monotonic() - t0 < DEADLINE


def test_status_text_from_a_snapshot() -> None:
    def port(n: int, url: str, *lanes: LaneStatus) -> PortStatus:
        return PortStatus(name=f"port-{n}", host="h", port=n, url=url, lanes=lanes)

    daemon = DaemonInfo(pid=1, started=0.0, state_dir="/s")
    snap = Snapshot(daemon=daemon, ports=(
        port(8080, "http://127.0.0.1:8080",
             LaneStatus(name="main", profile="demo", state="serving")),
        port(8081, "http://127.0.0.1:8081"),
        port(1, "http://h:1", LaneStatus(name="c", profile="moe", state="degraded",
                                         degraded="peer lost: serving SOLO"))))
    assert status_text(snap) == ("demo: serving at http://127.0.0.1:8080; no profile: idle; "
                                 "moe: degraded at http://h:1 (peer lost: serving SOLO)")
    assert status_text(Snapshot(daemon=daemon)) == "no engines"


def test_status_is_sent_once_per_change(path_listener: tuple[str, Listener]) -> None:
    addr, lst = path_listener
    n = Notifier(addr)
    assert n.status("demo: starting") and not n.status("demo: starting")
    assert n.status("demo: serving")
    assert lst.drain() == [{"STATUS": "demo: starting"}, {"STATUS": "demo: serving"}]


def test_ready_only_once_the_condition_holds(path_listener: tuple[str, Listener]) -> None:
    addr, lst = path_listener
    n = Notifier(addr)
    healthy = {"v": False}

    async def scenario() -> tuple[list[dict[str, str]], bool]:
        task = asyncio.create_task(ready_when(n, lambda: healthy["v"],
                                              lambda: "demo: serving", poll=0.01))
        await asyncio.sleep(0.3)
        before = lst.drain()  # still loading: nothing sent
        healthy["v"] = True  # e.g. the head's /health answered 200
        return before, await asyncio.wait_for(task, DEADLINE)

    before, sent = asyncio.run(scenario())
    assert before == [] and sent
    assert lst.recv() == {"READY": "1", "STATUS": "demo: serving"}

    async def stopped_first() -> bool:
        stop = asyncio.Event()
        task = asyncio.create_task(ready_when(n, lambda: False, stop=stop, poll=0.01))
        await asyncio.sleep(0.05)
        stop.set()
        return await asyncio.wait_for(task, DEADLINE)

    assert asyncio.run(stopped_first()) is False
    assert lst.drain() == []
