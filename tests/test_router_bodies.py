"""Request bodies and client half-closes through the router, against raw-socket upstreams (issue
30; no llama-server: tests/test_http_edges.py compares with the real one).

- a body over 1 MiB streams: the upstream sees its first bytes before the client sent it all;
- an early answer (the upstream answers before reading the body, then closes) reaches the
  client as sent, never a 503, and the body is not sent again;
- the process-wide budget of bytes held answers 503 with Retry-After past it;
- pipelined requests followed by a half-close are all answered;
- a client that half-closes mid-response is passed on to the upstream at once.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.router.budget import BodyBudget
from hydra_supervisor.router.routes import FnTable
from hydra_supervisor.testing.front_door import Reader, connect, request, send_all
from hydra_supervisor.testing.routerhelp import HOST, FuncServer, one_route, wait_until

DEADLINE = 10.0


def _head(c: socket.socket) -> tuple[bytes, bytes] | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = c.recv(65536)
        if not d:
            return None
        buf += d
    i = buf.index(b"\r\n\r\n") + 4
    return buf[:i], buf[i:]


def _length(h: bytes) -> int:
    for line in h.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _reply(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


class Upstream:
    """Answers each request with the number of body bytes it read; records when it saw the
    first body bytes; ``/early`` answers 401 at once and closes with the body unread; ``/sse``
    streams events until its client's half-close (recorded)."""

    def __init__(self) -> None:
        self.first_body_at: list[float] = []
        self.saw_eof = threading.Event()
        self.requests = 0
        self.server = FuncServer(self.handle)

    def handle(self, c: socket.socket) -> None:
        while (got := _head(c)) is not None:
            h, rest = got
            self.requests += 1
            if b" /early " in h:
                c.sendall(_reply(b"no key", b"401 Unauthorized", b"Connection: close\r\n"))
                return
            if b" /sse " in h:
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n")
                c.settimeout(0.05)
                for _ in range(2000):
                    ev = b'data: {"content":"x"}\n\n'
                    c.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
                    try:
                        if c.recv(1) == b"":
                            self.saw_eof.set()
                            return
                    except TimeoutError:
                        pass
                return
            n = _length(h)
            got_n = len(rest)
            if got_n:
                self.first_body_at.append(time.monotonic())
            while got_n < n:
                d = c.recv(1 << 20)
                if not d:
                    return
                if got_n == 0:
                    self.first_body_at.append(time.monotonic())
                got_n += len(d)
            c.sendall(_reply(str(got_n).encode()))

    @property
    def addr(self) -> tuple[str, int]:
        return self.server.addr


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    u = Upstream()
    yield u
    u.server.close()


@pytest.fixture
def make_router() -> Iterator[Callable[..., Router]]:
    made: list[Router] = []

    def make(addr: tuple[str, int], **kw: object) -> Router:
        r = Router(HOST, 0, Upstreams(), name="bodies", **kw)  # type: ignore[arg-type]
        one_route(r, addr)
        r.start()
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


def _upload(port: int, path: bytes, size: int, pause_after: int | None = None,
            pause: threading.Event | None = None) -> tuple[int | None, bytes, str]:
    sock = connect(port, 30.0)
    reader = Reader(sock)
    how = ["ok"]

    def send() -> None:
        held = pause_after
        try:
            sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                         % (path, size))
            left, block = size, b"x" * (1 << 20)
            while left:
                if held is not None and pause is not None and size - left >= held:
                    pause.wait(30.0)
                    held = None
                n = min(left, len(block))
                sock.sendall(block[:n])
                left -= n
        except OSError as e:
            how[0] = type(e).__name__

    t = threading.Thread(target=send, daemon=True)
    t.start()
    with sock:
        resp = reader.read_response("POST", 30.0)
        t.join(30.0)
    return (resp.status if resp else None), (resp.body if resp else b""), how[0]


def test_a_large_body_streams(upstream: Upstream, make_router: Callable[..., Router]) -> None:
    r = make_router(upstream.addr)
    go = threading.Event()
    result: list[tuple[int | None, bytes, str]] = []
    t = threading.Thread(target=lambda: result.append(
        _upload(r.port, b"/x", 8 << 20, pause_after=4 << 20, pause=go)), daemon=True)
    t.start()
    # The upstream sees body bytes while the client holds the second half back.
    wait_until(lambda: upstream.first_body_at or None, DEADLINE, "body bytes upstream")
    go.set()
    t.join(30.0)
    assert result and result[0][:2] == (200, str(8 << 20).encode()), result
    wait_until(lambda: r.body_budget.used() == 0 or None, DEADLINE, "the budget given back")


def test_early_answer_passes_through(upstream: Upstream,
                                     make_router: Callable[..., Router]) -> None:
    r = make_router(upstream.addr)
    for size in (10, 6 << 20):
        status, body, _how = _upload(r.port, b"/early", size)
        assert (status, body) == (401, b"no key"), size
    assert upstream.requests == 2  # never sent again
    assert r.stats()["http"]["retried"] == 0


def test_budget_past_its_limit_answers_503(upstream: Upstream,
                                           make_router: Callable[..., Router]) -> None:
    """A JSON body the router must read whole (several profiles: its model routes it) is
    charged to the budget; past it: 503 with Retry-After."""
    budget = BodyBudget(1 << 20)
    r = make_router(upstream.addr, body_budget=budget)
    route = r.new_route("other")
    route.http = upstream.addr
    r.table = FnTable(lambda _m, _meth, _p: route, needs_model=True)
    body = json.dumps({"prompt": "x" * (3 << 20), "model": "m"}).encode()
    sock = connect(r.port)
    reader = Reader(sock)
    with sock:
        threading.Thread(target=send_all, args=(sock, request(
            "POST", "/completion", body, headers=[("Content-Type", "application/json")])),
            daemon=True).start()
        resp = reader.read_response("POST", DEADLINE)
    assert resp is not None and resp.status == 503, resp
    assert resp.header("retry-after") is not None and b"budget" in resp.body
    wait_until(lambda: budget.used() == 0 or None, DEADLINE, "the budget given back")


@pytest.mark.parametrize("n", [2, 3])
def test_pipelined_then_half_closed(upstream: Upstream, make_router: Callable[..., Router],
                                    n: int) -> None:
    r = make_router(upstream.addr)
    for _ in range(20):
        sock = connect(r.port)
        reader = Reader(sock)
        with sock:
            sock.sendall(b"".join(request("GET", f"/{i}") for i in range(n)))
            sock.shutdown(socket.SHUT_WR)
            got = []
            while (resp := reader.read_response("GET", DEADLINE)) is not None:
                got.append(resp.status)
        assert got == [200] * n


def test_half_close_mid_stream_reaches_the_upstream(upstream: Upstream,
                                                    make_router: Callable[..., Router]) -> None:
    r = make_router(upstream.addr)
    sock = connect(r.port)
    reader = Reader(sock)
    with sock:
        sock.sendall(request("POST", "/sse", b"{}"))
        resp = reader.read_head(DEADLINE)
        assert resp is not None and resp.status == 200
        reader.take_exactly(64, DEADLINE)
        sock.shutdown(socket.SHUT_WR)
        assert upstream.saw_eof.wait(1.0), "the half-close did not reach the upstream in 1 s"
        deadline = time.monotonic() + DEADLINE
        while reader._fill(deadline):  # noqa: SLF001 - the test's own reader: to the close
            pass
        assert b'"error"' not in reader.buf  # nothing added by the router


def test_defaults_merged_into_a_large_body(upstream: Upstream,
                                           make_router: Callable[..., Router]) -> None:
    """A 2 MiB completion body while T1 defaults are set: read whole (within MAX_INSPECT)
    and merged, as a small one is."""
    r = make_router(upstream.addr)
    r.set_request_defaults({"temperature": 0.5})
    obj = {"prompt": "x" * (2 << 20)}
    merged = json.dumps({**obj, "temperature": 0.5}, separators=(",", ":")).encode()
    sock = connect(r.port)
    reader = Reader(sock)
    with sock:
        threading.Thread(target=send_all, args=(sock, request(
            "POST", "/completion", json.dumps(obj).encode())), daemon=True).start()
        resp = reader.read_response("POST", DEADLINE)
    assert resp is not None and resp.status == 200 and resp.body == str(len(merged)).encode()

