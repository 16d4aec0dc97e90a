"""A port whose router is not accepting connections is said everywhere, and hydra restarts it.

When a router's acceptor is not running every connection to the port is refused, whatever runs
behind it. Then the state word of the port's lane (or of every lane, or of the port without
a lane) is "port down" with a reason naming the port, `hydra status` exits 1,
hydra_router_alive reads 0, the STATUS= line says it and the watchdog stops pinging; the
daemon's port watch stops and starts the router again, and everything returns to serving. A
dead acceptor is simulated by stopping the router (alive() is then False, as after an acceptor
crash); the router itself is otherwise real where it matters (by model, daemon) and a fake
where one lane's port is tested (serve/port.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from hydra_supervisor.cli import cli, status_view
from hydra_supervisor.config.config import known_profiles
from hydra_supervisor.plan.ports import free_port
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.runtime.daemon import EXIT_PORT_DOWN, Daemon, Options
from hydra_supervisor.runtime.metrics import MetricsServer
from hydra_supervisor.runtime.notify import status_text
from hydra_supervisor.serve import portwatch, setup
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.portwatch import PortWatch
from hydra_supervisor.serve.reports import SwitchTimeouts
from hydra_supervisor.serve.snapshot import DaemonInfo, PortStatus, Snapshot
from hydra_supervisor.serve.states import LaneState
from tests.lane_fakes import (
    BEHAVIOUR,
    GIB,
    STARTED,
    FakeRouter,
    FakeSupervisor,
    FleetFake,
    dep,
    fdep,
    prof,
    until,
)
from tests.notify_listener import Listener

# -- the watch alone (fake router, fake clock) -----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_watch_says_down_waits_the_grace_restarts_and_backs_off() -> None:
    r = FakeRouter("127.0.0.1", 8080, None)
    r.start()
    clock = Clock()
    w = PortWatch("127.0.0.1:8080", r, grace=1.0, first_delay=2.0, max_delay=5.0, clock=clock)
    assert w.down() is None and not w.check()
    r.running = False  # the acceptor died
    assert w.down() == "router on 127.0.0.1:8080 is not accepting connections"
    assert w.check()  # noticed: the caller publishes the status
    assert not w.check() and r.calls[-1] == ("start", None)  # within the grace: nothing yet
    clock.t += 1.0
    r.fail_start = 3  # the port is taken for a while
    assert not w.check() and w.failed == 1 and w.next_try == clock.t + 2.0
    clock.t += 1.0
    assert not w.check() and w.failed == 1  # not due yet
    clock.t += 1.0
    assert not w.check() and w.failed == 2 and w.next_try == clock.t + 4.0
    clock.t += 4.0
    assert not w.check() and w.failed == 3 and w.next_try == clock.t + 5.0  # capped
    assert w.counts()["down_s"] == 7.0
    clock.t += 5.0
    assert w.check() and r.alive() and w.down() is None  # back
    assert w.counts() == {"recoveries": 1, "recovery_failures": 3, "down_s": None}
    # A later outage starts from the first delay again.
    r.running = False
    assert w.check()
    clock.t += 1.0
    r.fail_start = 1
    assert not w.check() and w.next_try == clock.t + 2.0
    # Closed on purpose: not down, not restarted.
    w.active = False
    assert w.down() is None and not w.check()


# -- one profile: a port with one lane (fake router, fake supervisors) ------------------------


def test_engine_says_port_down_and_comes_back_after_a_router_restart(tmp_path: Path) -> None:
    BEHAVIOUR.clear()
    STARTED.clear()
    eng = Port(StateDir(tmp_path), "127.0.0.1", 8080, node=Node({}), profiles=lambda: ["a"],
               make_supervisor=FakeSupervisor,
               make_router=FakeRouter,  # type: ignore[arg-type]
               switch_timeouts=SwitchTimeouts(drain=0.1, gpu_free=0.1), exit_on_fatal=True)
    eng.plan_lane(None, dep("a"))
    eng.open()
    r = eng.router
    assert isinstance(r, FakeRouter) and eng.watch is not None
    eng.watch.grace = 0.0

    async def go() -> None:
        await eng.start()
        lane = eng.only()
        assert lane is not None
        await until(lambda: lane.phase is LaneState.SERVING)
        assert eng.state_of(lane) == "serving" and eng.down() is None
        r.running = False  # the acceptor is not running: every connection is refused
        assert eng.state_of(lane) == "port down"
        st = eng.status({})
        assert st.lanes[0].state == "port down"
        assert st.down == "router on 127.0.0.1:8080 is not accepting connections"
        assert st.router is not None and st.router.alive is False
        assert status_text(snap_of(st)) == (
            "a: port down (router on 127.0.0.1:8080 is not accepting connections)")
        assert status_view.ports_down(snap_of(st)) == [st.down]
        # (the gate is the lane's route's now, not the router's)
        held = (lane.route.gate.held_reason, lane.route.gate.refusal_now())
        assert eng.check_port()  # noticed
        assert eng.check_port()  # grace 0: stopped and started again
        assert [c for c, _ in r.calls[-2:]] == ["stop", "start"]
        assert eng.state_of(lane) == "serving"
        assert (lane.route.gate.held_reason, lane.route.gate.refusal_now()) == held  # as it was
        st = eng.status({})
        assert st.down is None and st.router is not None and st.router.recoveries == 1
        assert status_view.ports_down(snap_of(st)) == []
        # Closed on purpose (hydra stopping): that is not a port to bring back.
        await eng.shutdown("test")
        eng.close()
        assert eng.down() is None and not eng.check_port()

    asyncio.run(go())


# -- several profiles on one port, by model (real router, fake supervisors) -------------------


class RowFake(FleetFake):
    """A fake supervisor whose processes have what `hydra status` prints."""

    def __init__(self, dep: Any, state: StateDir) -> None:
        super().__init__(dep, state)
        for p in self.procs:
            p.spec = replace(p.spec, device="gpu0", port=30200)


def make_fleet(tmp_path: Path) -> Port:
    BEHAVIOUR.clear()
    STARTED.clear()
    f = Port(StateDir(tmp_path), "127.0.0.1", 0,
             node=Node({"cuda0": 24 * GIB, "cuda1": 16 * GIB}, load_wait=5.0),
             allow=("127.0.0.0/8",),
             switch_timeouts=SwitchTimeouts(drain=0.2, gpu_free=0.1), load_wait=5.0,
             make_supervisor=RowFake)
    f.default = "a"
    f.plan_lane(prof("a"), fdep("a", 30200, gpu0=4))
    f.plan_lane(prof("b"), fdep("b", 30201, gpu1=4))
    return f


def connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def test_fleet_says_port_down_for_every_profile_and_comes_back(tmp_path: Path) -> None:
    f = make_fleet(tmp_path)
    f.open()
    assert f.watch is not None and f.router is not None
    f.watch.grace = 0.0

    async def go() -> None:
        await f.start(["a"])
        await asyncio.wait_for(f.started.wait(), 5)
        a, b = f.lanes["a"], f.lanes["b"]
        # (a fleet's "running" is "serving" now, here and below)
        assert f.state_of(a) == "serving" and f.state_of(b) == "stopped"
        b_hold = b.route.gate.held_reason
        assert f.router is not None
        f.router.stop()  # as if its acceptor had died
        assert not connects(f.port)
        down = f"router on 127.0.0.1:{f.port} is not accepting connections"
        assert f.down() == down and not f.alive()
        st = f.status()
        assert [x.state for x in st.lanes] == ["port down", "port down"]
        assert st.down == down
        assert [x.phase for x in st.lanes] == ["serving", "stopped"]
        assert st.router is not None and st.router.alive is False
        assert status_view.ports_down(snap_of(st)) == [down]
        assert f.check_port()  # noticed
        assert f.check_port()  # restarted
        assert f.alive() and f.down() is None and connects(f.port)
        assert f.state_of(a) == "serving" and f.state_of(b) == "stopped"
        assert a.phase is LaneState.SERVING and b.route.gate.held_reason == b_hold
        router = f.status().router
        assert router is not None and router.recoveries == 1

    async def main() -> None:
        try:
            await go()
        finally:
            await f.shutdown("test")
            f.close()

    asyncio.run(main())


# -- the daemon: status, exit code, metrics, STATUS=, watchdog, recovery on its tick -----------


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float | None:
    want = set(labels.items())
    found = [v for (n, lab), v in samples.items() if n == name and want <= lab]
    return found[0] if found else None


@pytest.fixture
def notify_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Listener]:
    addr = str(tmp_path / "notify.sock")
    lst = Listener(addr)
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a ping every 0.1 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setattr(portwatch, "CHECK_S", 0.05)
    yield lst
    lst.sock.close()


def hydra_status(state: Path, *args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli.main, ["status", *args], env={"HYDRA_STATE_DIR": str(state)})
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.output


async def until_or(run: asyncio.Task[int], cond: Callable[[], bool]) -> None:
    """Until `cond`, or the daemon's run ended (its error raised here at once)."""
    await until(lambda: run.done() or cond())
    if run.done():
        raise AssertionError(f"the daemon stopped: {run.result()}")


async def drive(d: Daemon, lst: Listener, router: Callable[[], Any],
                watch: Callable[[], PortWatch], serving_word: str) -> list[dict[str, str]]:
    """The common scenario: up and serving; the router dies; every surface says so; the
    daemon's port watch restarts it; every surface says serving again. Returns every notify
    message sent meanwhile."""
    assert d.metrics is not None
    sent: list[dict[str, str]] = []

    def take() -> list[dict[str, str]]:
        new = lst.drain()
        sent.extend(new)
        return new

    # The watchdog loop's looks at the port (a counter, so the test waits on looks taken, not
    # on time: a busy machine only makes it slower).
    looks = {"false": 0, "true": 0}
    alive = d._router_alive

    def counted() -> bool:
        ok = alive()
        looks["true" if ok else "false"] += 1
        return ok

    d._router_alive = counted  # type: ignore[method-assign]
    run = asyncio.create_task(d.run())

    async def until(cond: Callable[[], bool]) -> None:
        await until_or(run, cond)

    try:
        await until(lambda: d.ctl is not None and router() is not None and router().alive())
        w = watch()
        w.grace = 3600.0  # first look at the outage, then let the daemon mend it
        state = d.state.root
        await until(lambda: first_state(d.take()) == serving_word)
        code, text = await asyncio.to_thread(hydra_status, state)
        assert code == 0, text
        port = router().port
        down = f"router on 127.0.0.1:{port} is not accepting connections"

        router().stop()  # the acceptor is not running
        await until(lambda: w.down_since is not None)  # the daemon's tick saw it
        take()
        seen = looks["false"]
        await until(lambda: looks["false"] >= seen + 2)  # two periods that saw it down
        assert take() == []  # no WATCHDOG=1 while the port is down
        code, text = await asyncio.to_thread(hydra_status, state, "--json")
        live = json.loads(text)
        assert code == EXIT_PORT_DOWN == 1
        (st,) = live["daemon"]["ports"]
        assert {x["state"] for x in st["lanes"]} <= {"port down"}
        assert st["down"] == down and st["router"]["alive"] is False
        assert live["status"]["state"] == "port down" and live["status"]["down"] == down
        assert json.loads((state / "status.json").read_text())["state"] == "port down"
        code, text = await asyncio.to_thread(hydra_status, state)
        assert code == 1 and f"PORT DOWN: {down}" in text
        s = await asyncio.to_thread(scrape, f"http://127.0.0.1:{d.metrics.port}/metrics")
        assert value(s, "hydra_router_alive") == 0
        assert value(s, "hydra_engine_state", state="port down") == 1
        assert value(s, "hydra_router_recoveries_total") == 0

        w.grace = w.next_try = 0.0  # now the daemon's tick restarts it
        await until(lambda: router().alive() and w.down_since is None)
        await until(lambda: first_state(d.take()) == serving_word)
        assert w.restarts == 1
        code, _ = await asyncio.to_thread(hydra_status, state)
        assert code == 0
        assert json.loads((state / "status.json").read_text())["state"] != "port down"
        s = await asyncio.to_thread(scrape, f"http://127.0.0.1:{d.metrics.port}/metrics")
        assert value(s, "hydra_router_alive") == 1
        assert value(s, "hydra_engine_state", state="port down") == 0
        assert value(s, "hydra_router_recoveries_total") == 1
        assert await asyncio.to_thread(connects, port)
        await until(lambda: {"WATCHDOG": "1"} in take())  # pinging again
    finally:
        d.request_stop("test")
        await asyncio.wait_for(run, 20)
    take()
    return sent


def snap_of(port: PortStatus) -> Snapshot:
    return Snapshot(daemon=DaemonInfo(pid=1, started=0.0, state_dir="/s"), ports=(port,))


def first_state(snap: Snapshot) -> str:
    """The first lane's state word (the port's own, `idle` or `port down`, without a lane)."""
    p = snap.ports[0]
    return p.lanes[0].state if p.lanes else p.word()


def state_dir(tmp_path: Path) -> StateDir:
    st = StateDir(tmp_path / "state")
    st.ensure_writable()
    return st


def statuses(sent: list[dict[str, str]]) -> list[str]:
    return [m["STATUS"] for m in sent if "STATUS" in m and "STOPPING" not in m]


def test_daemon_one_port(tmp_path: Path, notify_env: Listener) -> None:
    opts = Options(profile=None, port=0, metrics_port=free_port())
    state = state_dir(tmp_path)
    ports, node = setup.build(state, [], node_file=None, profiles_dir=None,  # as hydra up
                              overrides={}, host=opts.host, port=opts.port,
                              profiles=lambda: list(known_profiles(opts.profiles_dir)))
    d = Daemon(state, opts, ports, node)
    p = ports[0]
    sent = asyncio.run(drive(d, notify_env, lambda: p.router, lambda: _watch(p.watch), "idle"))
    down = f"router on 127.0.0.1:{p.port} is not accepting connections"
    st = statuses(sent)
    i = st.index(f"no profile: port down ({down})")
    assert "no profile: idle" in st[i + 1:]  # back


def test_daemon_several_profiles(tmp_path: Path, notify_env: Listener) -> None:
    f = make_fleet(tmp_path)
    opts = Options(profile=None, port=0, metrics_port=free_port(), profiles=["a", "b"])
    d = Daemon(state_dir(tmp_path), opts, [f], f.node)
    # (a fleet's "running" is "serving" now)
    sent = asyncio.run(drive(d, notify_env, lambda: f.router, lambda: _watch(f.watch),
                             "serving"))
    down = f"router on 127.0.0.1:{f.port} is not accepting connections"
    st = statuses(sent)
    i = st.index(f"a: port down ({down}); b: port down ({down})")
    assert any(t.startswith("a: serving") for t in st[i + 1:])  # back


def _watch(w: PortWatch | None) -> PortWatch:
    assert w is not None
    return w


def test_metrics_export_the_routers_own_acceptor_restarts() -> None:
    snap = Snapshot.from_json({"daemon": {"pid": 1, "started": 0.0, "state_dir": "/s"},
                               "ports": [{
        "name": "port-8080", "host": "127.0.0.1", "port": 8080, "url": "http://127.0.0.1:8080",
        "router": {"alive": True, "events": {"acceptor_restart": 2}, "recoveries": 1,
                   "recovery_failures": 0},
        "lanes": [{"name": "port-8080", "profile": "demo", "state": "serving"}]}]})
    with MetricsServer("127.0.0.1", 0, snapshot=lambda: snap) as ms:
        s = scrape(ms.url)
    e = {"engine": "port-8080", "profile": "demo"}
    # The router series are the port's: labelled engine="port-8080" alone (they carried the
    # lane's profile too, which a switch changed).
    r = {"engine": "port-8080"}
    assert value(s, "hydra_router_events_total", **r, event="acceptor_restart") == 2
    assert value(s, "hydra_router_recoveries_total", **r) == 1
    assert value(s, "hydra_router_recovery_failures_total", **r) == 0
    assert not [k for k in s if k[0].startswith("hydra_router_") and "profile" in dict(k[1])]
    assert value(s, "hydra_engine_state", **e, state="port down") == 0
