"""The router on real sockets (127.0.0.1:0) against fake upstreams: routing, access control,
timeouts, queueing, half-close, upstream failures, and that it still serves afterwards.

These tests exercise the byte relay (the ggml-RPC and Hydra path), so their routers relay HTTP
as bytes too (``http="raw"``: echo upstreams are not HTTP servers) unless a test says otherwise.
HTTP goes to the upstream of the router's one route (``make_router(..., http_up=...)``: what a
port with one lane has); tests/test_router_http.py covers the request-aware HTTP leg."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.router.routes import Addr, Route
from hydra_supervisor.testing.routerhelp import (
    DEADLINE,
    HOST,
    EchoServer,
    FuncServer,
    connect,
    fake_hydra_handler,
    hydra_read_response,
    hydra_request,
    one_route,
    raise_nofile,
    recv_exact,
    recv_to_eof,
    wait_until,
)

PUMPS = ["splice", "copy"]
RPC_HELLO = bytes([0x0E]) + (0).to_bytes(8, "little")
GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

RouterFactory = Callable[..., Router]


@pytest.fixture
def make_router() -> Iterator[RouterFactory]:
    routers: list[Router] = []

    def make(
        upstreams: Upstreams | None = None, *, http_up: Addr | None = None, **kw: object
    ) -> Router:
        """A started router whose one route (see ``lane_of``) sends HTTP to ``http_up``."""
        kw.setdefault("http", "raw")
        r = Router(HOST, 0, upstreams or Upstreams(), **kw)  # type: ignore[arg-type]
        one_route(r, http_up)
        r.start()
        routers.append(r)
        return r

    yield make
    for r in routers:
        r.stop()


@pytest.fixture
def echoes() -> Iterator[dict[str, EchoServer]]:
    servers = {k: EchoServer(tag=f"{k}:".encode()) for k in ("http", "rpc", "hydra")}
    yield servers
    for s in servers.values():
        s.close()


def upstreams_of(e: dict[str, EchoServer]) -> Upstreams:
    """The byte-relay upstreams (ggml-RPC, Hydra); HTTP goes to ``e["http"]`` by the route."""
    return Upstreams(rpc=e["rpc"].addr, hydra=e["hydra"].addr)


def lane_of(r: Router) -> Route:
    """The one route ``make_router`` gave ``r`` (every HTTP request goes to it)."""
    assert r.table is not None
    route = r.table(None, "", "")
    assert isinstance(route, Route)
    return route


def roundtrip(port: int, payload: bytes, tag: bytes) -> None:
    with connect(port) as c:
        c.sendall(payload)
        assert recv_exact(c, len(tag) + len(payload)) == tag + payload


def assert_serves(router: Router, echo: EchoServer) -> None:
    """The router still routes a fresh HTTP connection after whatever the test did."""
    roundtrip(router.port, GET, echo.tag)


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize("pump", PUMPS)
def test_each_protocol_reaches_its_upstream(
    make_router: RouterFactory, echoes: dict[str, EchoServer], pump: str
) -> None:
    r = make_router(upstreams_of(echoes), http_up=echoes["http"].addr, pump=pump)
    roundtrip(r.port, GET, b"http:")
    roundtrip(r.port, RPC_HELLO, b"rpc:")
    roundtrip(r.port, hydra_request(0x41), b"hydra:")
    for method in (b"POST ", b"DELETE ", b"OPTIONS ", b"HEAD "):
        roundtrip(r.port, method + b"/x HTTP/1.1\r\n\r\n", b"http:")
    assert {k: s.accepted for k, s in echoes.items()} == {"http": 5, "rpc": 1, "hydra": 1}
    st = r.stats()
    assert st["by_kind"] == {"rpc": 1, "hydra": 1, "http": 5}
    assert st["accepted"] == 7 and st["refused"] == {}
    wait_until(lambda: r.stats()["open"] == 0, what="relays closed")
    sent = [GET, RPC_HELLO, hydra_request(0x41)]
    sent += [m + b"/x HTTP/1.1\r\n\r\n" for m in (b"POST ", b"DELETE ", b"OPTIONS ", b"HEAD ")]
    assert r.stats()["bytes_up"] == sum(len(b) for b in sent)


def test_prefix_split_over_several_segments(make_router: RouterFactory) -> None:
    echo = EchoServer()
    try:
        r = make_router(http_up=echo.addr)
        want = b"POST /v1 HTTP/1.1\r\n\r\n"
        with connect(r.port) as c:
            for part in (b"P", b"O", b"S", b"T", want[4:]):
                c.sendall(part)
                time.sleep(0.02)
            assert recv_exact(c, len(want)) == want
    finally:
        echo.close()


def test_hydra_protocol_through_router(make_router: RouterFactory) -> None:
    hydra = FuncServer(fake_hydra_handler)
    try:
        r = make_router(Upstreams(hydra=hydra.addr))
        with connect(r.port) as c:
            for op, key, payload in ((0x41, b"", b""), (0x30, b"3", b"state-bytes" * 1000)):
                c.sendall(hydra_request(op, key=key, payload=payload, trace=b"t-1"))
                status, meta, body = hydra_read_response(c)
                assert (status, meta, body) == (0, {"op": op, "key": key.decode()}, payload)
        assert not hydra.errors
    finally:
        hydra.close()


@pytest.mark.parametrize("pump", PUMPS)
def test_large_transfer_intact_both_ways(
    make_router: RouterFactory, echoes: dict[str, EchoServer], pump: str
) -> None:
    echo = EchoServer()
    try:
        r = make_router(http_up=echo.addr, pump=pump)
        data = b"POST " + os.urandom(16 << 20)
        got = bytearray()
        with connect(r.port) as c:
            c.settimeout(DEADLINE)

            def reader() -> None:
                while len(got) < len(data):
                    chunk = c.recv(1 << 20)
                    if not chunk:
                        return
                    got.extend(chunk)

            t = threading.Thread(target=reader)
            t.start()
            c.sendall(data)
            t.join(30)
            assert not t.is_alive()
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    finally:
        echo.close()


# --------------------------------------------------------------------------- hostile clients


def test_slowloris_no_first_byte(make_router: RouterFactory, echoes: dict[str, EchoServer]) -> None:
    r = make_router(upstreams_of(echoes), http_up=echoes["http"].addr, first_byte_timeout=0.3)
    t0 = time.monotonic()
    quiet = [connect(r.port) for _ in range(5)]
    try:
        for c in quiet:
            assert recv_to_eof(c, timeout=3) == b""
        assert time.monotonic() - t0 < 2.5
    finally:
        for c in quiet:
            c.close()
    wait_until(lambda: r.stats()["refused"].get("first_byte_timeout") == 5, what="5 timeouts")
    assert sum(s.accepted for s in echoes.values()) == 0
    assert_serves(r, echoes["http"])


def test_slowloris_partial_prefix(
    make_router: RouterFactory, echoes: dict[str, EchoServer]
) -> None:
    r = make_router(upstreams_of(echoes), http_up=echoes["http"].addr, first_byte_timeout=0.3)
    with connect(r.port) as c:
        c.sendall(b"GE")  # a valid start, then nothing
        assert recv_to_eof(c, timeout=3) == b""
    assert echoes["http"].accepted == 0
    assert_serves(r, echoes["http"])


@pytest.mark.parametrize(
    "garbage", [b"\x16\x03\x01\x00\xa5", b"\x00", b"SSH-2.0-x\r\n", b"YX"]
)
def test_garbage_first_bytes_closed_at_once(
    make_router: RouterFactory, echoes: dict[str, EchoServer], garbage: bytes
) -> None:
    r = make_router(upstreams_of(echoes), http_up=echoes["http"].addr)
    t0 = time.monotonic()
    with connect(r.port) as c:
        c.sendall(garbage)
        assert recv_to_eof(c, timeout=3) == b""
    assert time.monotonic() - t0 < 1.0  # not the 10 s first-byte timeout
    assert r.stats()["refused"] == {"rejected": 1}
    assert sum(s.accepted for s in echoes.values()) == 0
    assert_serves(r, echoes["http"])


def test_source_not_allow_listed(make_router: RouterFactory, echoes: dict[str, EchoServer]) -> None:
    # The test's source is 127.0.0.1; an allow list without loopback must keep ggml-RPC and
    # Hydra control away from their upstreams, while HTTP stays open.
    r = make_router(upstreams_of(echoes), http_up=echoes["http"].addr, allow=("10.0.0.0/8",))
    for payload in (RPC_HELLO, hydra_request(0x40, payload=b"{}")):
        with connect(r.port) as c:
            c.sendall(payload)
            assert recv_to_eof(c, timeout=3) == b""
    assert echoes["rpc"].accepted == 0 and echoes["hydra"].accepted == 0
    assert r.stats()["refused"] == {"denied": 2}
    assert_serves(r, echoes["http"])


def test_default_allow_list_admits_loopback(
    make_router: RouterFactory, echoes: dict[str, EchoServer]
) -> None:
    r = make_router(upstreams_of(echoes), http_up=echoes["http"].addr)
    roundtrip(r.port, RPC_HELLO, b"rpc:")
    assert "denied" not in r.stats()["refused"]


# --------------------------------------------------------------------------- capacity


def test_thousand_concurrent_connections(make_router: RouterFactory) -> None:
    n = 1000
    raise_nofile(16384)
    echo = EchoServer()
    clients: list[socket.socket] = []
    try:
        r = make_router(http_up=echo.addr, max_active=n + 24, max_pending=n + 24)
        for i in range(n):
            c = connect(r.port)
            c.sendall(b"GET /%d HTTP/1.1\r\n\r\n" % i)
            clients.append(c)
        for i, c in enumerate(clients):
            want = b"GET /%d HTTP/1.1\r\n\r\n" % i
            assert recv_exact(c, len(want), timeout=30) == want
        # All of them are relaying at once, none dropped; and each still works.
        assert r.stats()["open"] == n
        for i, c in enumerate(clients[::50]):
            c.sendall(b"ping%d" % i)
            assert recv_exact(c, len(b"ping%d" % i)) == b"ping%d" % i
        for c in clients:
            c.close()
        clients.clear()
        wait_until(lambda: r.stats()["open"] == 0, timeout=30, what="all relays closed")
        st = r.stats()
        assert st["accepted"] == n and st["refused"] == {} and st["by_kind"]["http"] == n
        assert_serves(r, echo)
    finally:
        for c in clients:
            c.close()
        echo.close()


def test_bounded_queue_never_drops_active(make_router: RouterFactory) -> None:
    echo = EchoServer()
    try:
        r = make_router(http_up=echo.addr, max_active=2, max_waiting=2)
        active = [connect(r.port) for _ in range(2)]
        for c in active:
            c.sendall(b"GET /a HTTP/1.1\r\n\r\n")
            recv_exact(c, len(b"GET /a HTTP/1.1\r\n\r\n"))
        waiting = [connect(r.port) for _ in range(2)]
        for c in waiting:
            c.sendall(b"GET /w HTTP/1.1\r\n\r\n")
        wait_until(lambda: r.stats()["pending"] == 2, what="two waiting")
        # Beyond the waiting queue: not refused, left in the kernel's backlog (not accepted).
        extra = connect(r.port)
        extra.sendall(b"GET /x HTTP/1.1\r\n\r\n")
        time.sleep(0.2)
        assert r.stats()["accepted"] == 4 and r.stats()["refused"] == {}
        # The active relays were not dropped to make room and still work.
        for c in active:
            c.sendall(b"still")
            assert recv_exact(c, 5) == b"still"
        # A waiting connection gets a slot as soon as an active one ends.
        active.pop().close()
        want = b"GET /w HTTP/1.1\r\n\r\n"
        # Which one: the order both were classified in, not necessarily the connect order.
        ready, _, _ = select.select(waiting, [], [], DEADLINE)
        assert len(ready) == 1
        assert recv_exact(ready[0], len(want)) == want
        # ... and the one in the backlog is accepted into the freed waiting place, then served.
        for c in active + waiting:
            c.close()
        assert recv_exact(extra, len(b"GET /x HTTP/1.1\r\n\r\n")) == b"GET /x HTTP/1.1\r\n\r\n"
        extra.close()
        wait_until(lambda: r.stats()["open"] == 0, what="relays closed")
        assert_serves(r, echo)
    finally:
        echo.close()


def test_queue_timeout_answers_http_503(make_router: RouterFactory) -> None:
    echo = EchoServer()
    try:
        r = make_router(http_up=echo.addr, max_active=1, queue_timeout=0.3)
        with connect(r.port) as busy:
            busy.sendall(GET)
            recv_exact(busy, len(GET))
            with connect(r.port) as c:
                c.sendall(GET)
                reply = recv_to_eof(c, timeout=3)
            assert reply.startswith(b"HTTP/1.1 503 ")
            assert b"\r\nRetry-After: " in reply
            assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 503
    finally:
        echo.close()


# --------------------------------------------------------------------------- half-close, failures


@pytest.mark.parametrize("pump", PUMPS)
def test_client_half_close_propagates(make_router: RouterFactory, pump: str) -> None:
    saw_eof = threading.Event()

    def until_eof_then_answer(conn: socket.socket) -> None:
        got = recv_to_eof(conn)  # returns only when the client's FIN came through the router
        saw_eof.set()
        conn.sendall(b"answer after EOF: " + str(len(got)).encode())

    up = FuncServer(until_eof_then_answer)
    try:
        r = make_router(http_up=up.addr, pump=pump)
        with connect(r.port) as c:
            c.sendall(b"POST /upload HTTP/1.1\r\n\r\n" + b"x" * 100_000)
            c.shutdown(socket.SHUT_WR)
            reply = recv_to_eof(c)
        assert saw_eof.is_set()
        assert reply == b"answer after EOF: %d" % (len(b"POST /upload HTTP/1.1\r\n\r\n") + 100_000)
        assert not up.errors
        assert_serves_func = EchoServer()
        try:
            lane_of(r).http = assert_serves_func.addr
            assert_serves(r, assert_serves_func)
        finally:
            assert_serves_func.close()
    finally:
        up.close()


def test_upstream_half_close_propagates(make_router: RouterFactory) -> None:
    got_after: list[bytes] = []

    def close_write_then_read(conn: socket.socket) -> None:
        conn.sendall(b"bye")
        conn.shutdown(socket.SHUT_WR)
        got_after.append(recv_to_eof(conn))

    up = FuncServer(close_write_then_read)
    try:
        r = make_router(Upstreams(rpc=up.addr))
        with connect(r.port) as c:
            c.sendall(RPC_HELLO)
            assert recv_to_eof(c) == b"bye"  # upstream's FIN reached us
            c.sendall(b"more after your FIN")  # our direction is still open
            c.shutdown(socket.SHUT_WR)
            wait_until(lambda: bool(got_after), what="upstream read to EOF")
        assert got_after == [RPC_HELLO + b"more after your FIN"]
    finally:
        up.close()


ECHO_CHILD = """
import socket, sys
s = socket.create_server(("127.0.0.1", 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept()
while d := c.recv(65536):
    c.sendall(d)
"""


def test_upstream_dies_mid_relay(make_router: RouterFactory) -> None:
    child = subprocess.Popen([sys.executable, "-c", ECHO_CHILD], stdout=subprocess.PIPE, text=True)
    echo = EchoServer()
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        r = make_router(Upstreams(rpc=(HOST, port)), http_up=echo.addr)
        with connect(r.port) as c:
            c.sendall(RPC_HELLO)
            assert recv_exact(c, len(RPC_HELLO)) == RPC_HELLO
            os.kill(child.pid, signal.SIGKILL)
            child.wait(DEADLINE)
            t0 = time.monotonic()
            assert recv_to_eof(c, timeout=5) == b""  # an EOF (or reset), not a hang
            assert time.monotonic() - t0 < 2.0
        wait_until(lambda: r.stats()["open"] == 0, what="relay closed")
        assert_serves(r, echo)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(DEADLINE)
        echo.close()


@pytest.mark.parametrize("http", ["raw", "aware"])
def test_upstream_down_http_gets_503_json(make_router: RouterFactory, http: str) -> None:
    with socket.socket() as s:  # a port with nobody listening
        s.bind((HOST, 0))
        dead = (HOST, int(s.getsockname()[1]))
    r = make_router(Upstreams(rpc=dead), http_up=dead, http=http, retry_wait=0.05)
    t0 = time.monotonic()
    with connect(r.port) as c:
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                  b"Connection: close\r\n\r\n{}")
        reply = recv_to_eof(c, timeout=5)
    assert time.monotonic() - t0 < 2.0
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"application/json" in head and b"\r\nretry-after: " in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == 503 and "Connection refused" in err["message"]
    # ggml-RPC client: an immediate close, no HTTP text on a binary protocol.
    t0 = time.monotonic()
    with connect(r.port) as c:
        c.sendall(RPC_HELLO)
        assert recv_to_eof(c, timeout=5) == b""
    assert time.monotonic() - t0 < 1.0
    assert r.stats()["refused"] == {"upstream_down": 2}


@pytest.mark.parametrize("http", ["raw", "aware"])
def test_missing_upstreams_close(make_router: RouterFactory, http: str) -> None:
    r = make_router(Upstreams(), http=http)
    with connect(r.port) as c:
        c.sendall(hydra_request(0x41))
        assert recv_to_eof(c, timeout=3) == b""
    with connect(r.port) as c:
        c.sendall(GET)
        c.shutdown(socket.SHUT_WR)
        assert recv_to_eof(c, timeout=3).startswith(b"HTTP/1.1 503 ")


# --------------------------------------------------------------------------- lifecycle


def test_a_moved_upstream_affects_new_connections_only(make_router: RouterFactory) -> None:
    old, new = EchoServer(b"old:"), EchoServer(b"new:")
    try:
        r = make_router(http_up=old.addr)
        with connect(r.port) as kept:
            kept.sendall(GET)
            assert recv_exact(kept, 4 + len(GET)) == b"old:" + GET
            lane_of(r).http = new.addr
            roundtrip(r.port, GET, b"new:")
            kept.sendall(b"x")
            assert recv_exact(kept, 1) == b"x"  # the open relay keeps its upstream
            assert old.accepted == 1 and new.accepted == 1
    finally:
        old.close()
        new.close()


def test_idle_timeout_closes_quiet_relay(make_router: RouterFactory) -> None:
    echo = EchoServer()
    try:
        r = make_router(http_up=echo.addr, idle_timeout=0.4)
        with connect(r.port) as c:
            c.sendall(GET)
            recv_exact(c, len(GET))
            t0 = time.monotonic()
            assert recv_to_eof(c, timeout=5) == b""
            assert 0.3 < time.monotonic() - t0 < 3.0
        assert_serves(r, echo)
    finally:
        echo.close()


def test_stop_is_bounded_with_open_relays(echoes: dict[str, EchoServer]) -> None:
    r = Router(HOST, 0, upstreams_of(echoes), http="raw")
    one_route(r, echoes["http"].addr)
    r.start()
    clients = []
    try:
        for _ in range(20):
            c = connect(r.port)
            c.sendall(GET)
            recv_exact(c, 5 + len(GET))
            clients.append(c)
        quiet = connect(r.port)  # pending, no first byte
        clients.append(quiet)
        t0 = time.monotonic()
        r.stop()
        assert time.monotonic() - t0 < 3.0
        for c in clients:
            assert recv_to_eof(c, timeout=3) == b""
        with pytest.raises(OSError):
            connect(r.port, timeout=1).close()
    finally:
        for c in clients:
            c.close()
        r.stop()


def test_one_debug_line_per_connection(
    make_router: RouterFactory, echoes: dict[str, EchoServer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="hydra.router")
    r = make_router(upstreams_of(echoes), http_up=echoes["http"].addr, name="e1")
    roundtrip(r.port, GET, b"http:")
    with connect(r.port) as c:
        c.sendall(b"\xff")
        recv_to_eof(c)
    wait_until(lambda: r.stats()["open"] == 0, what="relays closed")
    wait_until(
        lambda: len([m for m in caplog.messages if m.startswith("router e1 #")]) >= 2,
        what="close lines",
    )
    lines = [m for m in caplog.messages if m.startswith("router e1 #")]
    assert len(lines) == 2
    assert " http->127.0.0.1:" in lines[0] or " http->127.0.0.1:" in lines[1]
    assert any(f"up={len(GET)}B down={len(GET) + 5}B" in m for m in lines)
    assert any("unrecognised first bytes ff" in m for m in lines)


def test_upstreams_must_be_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        Upstreams(rpc=("10.1.2.3", 50052))
    Upstreams(rpc=("localhost", 2), hydra=("::1", 3))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        Router(HOST, 0, Upstreams(), max_active=0)
    with pytest.raises(ValueError):
        Router(HOST, 0, Upstreams(), allow=("not-a-cidr",))
    with pytest.raises(TypeError):
        Router(HOST, 0, Upstreams(), allow="127.0.0.0/8")
