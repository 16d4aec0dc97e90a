"""The front door under connection pressure (issue 19): bursts of new connections from one
address, silent connections beside prompt ones, slowloris, and an acceptor that fails.

The first three run against a real ``hydra up --profile demo`` (its router with the defaults
hydra gives it, llama-server with Gemma behind), shared by the module to keep the file short
(about a minute on a busy 2-core box, most of it the start). The rest use a bare Router in
front of the in-process stand-in llama-server (testing/sse_upstream.py).

What "answered" means here: a 200, or a 503 that carries Retry-After (the router may refuse
when it must, and says when to come back). A reset, a close without a response, or no answer
within the deadline is a failure: a client cannot tell it from a dead server.
"""

from __future__ import annotations

import collections
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest

from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.serve.snapshot import Snapshot
from hydra_supervisor.testing.front_door import answered, ask, burst, connect, request
from hydra_supervisor.testing.harness import Up, free_port, make_env, status_json
from hydra_supervisor.testing.routerhelp import HOST, one_route, wait_until
from hydra_supervisor.testing.sse_upstream import StandIn


@dataclass
class Demo:
    up: Up
    port: int
    env: dict[str, str]

    def tail(self) -> str:
        """The end of hydra's own output, for a failure message."""
        return "hydra up output (tail):\n" + self.up.output()[-3000:]

    def status(self) -> dict[str, Any]:
        """`hydra status --json`: ``status`` (the single-engine view) and ``daemon`` (the
        snapshot, whose engine rows carry the router's stats)."""
        st = status_json(self.env)
        assert st.get("running") and st.get("status") and st.get("daemon"), st
        return st


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """One `hydra up --profile demo` for the module; everything it started is gone after."""
    tmp = tmp_path_factory.mktemp("front-door-burst")
    env = make_env(tmp)
    port = free_port()
    up = Up(env, ["--profile", "demo", "--port", str(port)], tmp)
    try:
        up.wait_ready()
        yield Demo(up, port, env)
    finally:
        children = list(up.children)
        if up.proc.poll() is None:
            up.stop()
        up.kill_everything()
        _gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"processes outlived hydra up: {alive}"


def _health() -> bytes:
    return request("GET", "/health")


def _tokenize(i: int) -> bytes:
    return request("POST", "/tokenize", json.dumps({"content": f"hello {i}"}).encode(),
                   headers=[("Content-Type", "application/json")])


def _health_or_tokenize(i: int) -> tuple[bytes, str]:
    return (_health(), "GET") if i % 2 else (_tokenize(i), "POST")


def _serving(demo: Demo) -> None:
    """The port answers a fresh request, and hydra still reports the engine serving through
    a live router."""
    assert ask(demo.port, _health()) == "200", f"the port is dead after the test\n{demo.tail()}"
    st = demo.status()
    assert st["status"]["state"] == "serving", st["status"]
    port = Snapshot.from_json(st["daemon"]).ports[0]
    assert not port.down, port.down
    router = port.router
    assert router is not None and router.alive is True, router


# --------------------------------------------------------------------------- hydra up


@pytest.mark.slow
def test_burst_of_new_connections(demo: Demo) -> None:
    """Rounds of 256 simultaneous new connections from 127.0.0.1 (GET /health and tiny
    POST /tokenize): every one answered, no resets; the port and the router alive after."""
    rounds, n = 5, 256
    totals: collections.Counter[str] = collections.Counter()
    for _ in range(rounds):
        totals += burst(demo.port, n, _health_or_tokenize)
    failed = {w: c for w, c in totals.items() if not answered(w)}
    assert not failed, (f"{sum(failed.values())} of {rounds * n} not answered: {dict(totals)}"
                        f"\n{demo.tail()}")
    _serving(demo)


@pytest.mark.slow
def test_silent_connections_do_not_cost_prompt_ones(demo: Demo) -> None:
    """40 connections send one byte ("G") and stall; then 40 more from the same address send
    whole requests at once: all 40 are answered (a silent connection may be evicted, a prompt
    one must not be), and the port is alive after."""
    silent: list[socket.socket] = []
    try:
        for _ in range(40):
            s = connect(demo.port)
            s.sendall(b"G")
            silent.append(s)
        words = burst(demo.port, 40, lambda i: (_health(), "GET"))
        assert words == {"200": 40}, f"{dict(words)}\n{demo.tail()}"
    finally:
        for s in silent:
            s.close()
    _serving(demo)


class Drip:
    """Slowloris: ``n`` connections each sending one byte of a never-ending request head every
    ``period`` seconds, from one thread. Notes which the server has closed (EOF or reset)."""

    HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000

    def __init__(self, port: int, n: int, period: float = 0.5) -> None:
        self.socks = [connect(port) for _ in range(n)]
        for s in self.socks:
            s.setblocking(False)  # one thread serves them all: never wait on one
        self.pos = [0] * n
        self.closed_at: dict[int, float] = {}
        self.answers: collections.Counter[bytes] = collections.Counter()
        self.period = period
        self.ticks = 0  # rounds of one byte per open connection
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, s in enumerate(self.socks):
                if i in self.closed_at:
                    continue
                if self._gone(s):
                    self.closed_at[i] = time.monotonic() - self.t0
                    continue
                try:
                    self.pos[i] += s.send(self.HEAD[self.pos[i]:self.pos[i] + 1])
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    self.closed_at[i] = time.monotonic() - self.t0
            self.ticks += 1
            self._stop.wait(self.period)

    def _gone(self, s: socket.socket) -> bool:
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        if data:  # an answer (e.g. 408) before the close
            self.answers[data.split(b"\r\n", 1)[0]] += 1
            return False
        return True

    def closed(self) -> int:
        return len(self.closed_at)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)
        for s in self.socks:
            s.close()


@pytest.mark.slow
def test_slowloris_does_not_starve_normal_requests(demo: Demo) -> None:
    """100 connections sending one header byte every 0.5 s; meanwhile 20 normal requests are
    answered promptly, and the port is alive after. (That the slow ones are closed in the end
    is checked on a bare router with short timeouts below: with hydra's defaults it takes the
    request timeout, 120 s.)"""
    drip = Drip(demo.port, 100)
    try:
        words: collections.Counter[str] = collections.Counter()
        pace = threading.Event()  # never set: spreads the requests over the drip's first 5 s
        for i in range(20):
            words[ask(demo.port, _health() if i % 2 else _tokenize(i),
                      "GET" if i % 2 else "POST", timeout=10.0)] += 1
            pace.wait(0.25)
        assert drip.ticks >= 8, f"the drip fell behind: {drip.ticks} rounds in 5 s"
        assert words == {"200": 20}, f"{dict(words)}\n{demo.tail()}"
    finally:
        drip.stop()
    _serving(demo)


# --------------------------------------------------------------------------- bare router


@pytest.fixture
def standin() -> Iterator[StandIn]:
    s = StandIn()
    yield s
    s.close()


@pytest.fixture
def routers() -> Iterator[list[Router]]:
    made: list[Router] = []
    yield made
    for r in made:
        r.stop()


def test_slowloris_closed_by_timeouts(standin: StandIn, routers: list[Router]) -> None:
    """The slow heads are closed by the router's own deadlines (first byte, then the whole
    request head), and normal requests are served meanwhile."""
    router = Router(HOST, 0, Upstreams(), name="slow",
                    first_byte_timeout=2.0, request_timeout=3.0)
    one_route(router, standin.addr)
    router.start()
    routers.append(router)
    drip = Drip(router.port, 100)
    try:
        for _ in range(10):
            assert ask(router.port, _health(), timeout=10.0) == "200"
        # Every slow one is closed by: eviction as silent, the first-byte timeout (2 s), or
        # the request timeout (3 s after its first bytes); with margin for a busy machine.
        wait_until(lambda: drip.closed() == 100, timeout=20.0,
                   what=f"all 100 slow connections closed (now {drip.closed()})")
    finally:
        drip.stop()
    assert ask(router.port, _health()) == "200"
    refused = router.stats()["refused"]
    assert sum(refused.values()) >= 100, refused
    assert router.alive()


def _tick_failing(router: Router, times: int | None) -> list[float]:
    """Make the acceptor loop's periodic tick raise ``times`` times (None: always)."""
    calls: list[float] = []
    real = router.acceptor.tick

    def tick(now: float) -> None:
        calls.append(now)
        if times is None or len(calls) <= times:
            raise RuntimeError("injected acceptor failure")
        real(now)

    router.acceptor.tick = tick
    return calls


def test_acceptor_failure_restarted(standin: StandIn, routers: list[Router]) -> None:
    """The accept loop fails once (a bug, injected): the router restarts its acceptor, keeps
    serving on the same port, counts it (stats()["events"]["acceptor_restart"]), and alive()
    stays True."""
    router = Router(HOST, 0, Upstreams(), name="acceptor-once")
    one_route(router, standin.addr)
    calls = _tick_failing(router, 1)
    router.start()
    routers.append(router)
    assert ask(router.port, _health()) == "200"
    wait_until(lambda: len(calls) >= 1, timeout=10.0, what="the acceptor's tick ran")
    wait_until(lambda: router.stats()["events"].get("acceptor_restart", 0) >= 1,
               timeout=10.0, what="acceptor_restart counted")
    for _ in range(3):
        assert ask(router.port, _health()) == "200"
    assert router.alive()


def test_acceptor_failing_every_time_reports_dead(standin: StandIn,
                                                   routers: list[Router]) -> None:
    """The accept loop fails every time: the router does not restart it forever; alive() turns
    False (so `hydra`'s watchdog stops pinging systemd), and stop() is still bounded."""
    router = Router(HOST, 0, Upstreams(), name="acceptor-always")
    one_route(router, standin.addr)
    _tick_failing(router, None)
    router.start()
    wait_until(lambda: not router.alive(), timeout=30.0, what="alive() False")
    t0 = time.monotonic()
    router.stop()
    assert time.monotonic() - t0 < 6.0

