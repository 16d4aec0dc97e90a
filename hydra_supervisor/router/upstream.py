"""The HTTP leg's upstream connections, and what a session needs of its router.

``UpstreamPool``: idle keep-alive connections to the HTTP upstreams, shared by every session (a
reused one that turned out stale is replaced by the session at once). ``Outgoing``: a request
as it goes upstream. ``SessionHost``: what an HTTP session (router/http.py) needs of its router
(its settings, table and pool), with ``SessionCounts``: the counters it reports into (the
router's ``Ledger``, router/ledger.py) and its ``Traffic`` (router/traffic.py: live load and
the request table). The Router (router/core.py) is a ``SessionHost``, and
nothing here or in router/http.py imports it.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import h11

from hydra_supervisor.router import head
from hydra_supervisor.router.budget import BodyBudget
from hydra_supervisor.router.pump import BodyPump
from hydra_supervisor.router.replies import JSONValue, Record
from hydra_supervisor.router.routes import RouteTable
from hydra_supervisor.router.traffic import Traffic

Addr = tuple[str, int]

_POOL_IDLE = 16  # idle upstream connections kept per target
# llama-server (cpp-httplib) closes an idle keep-alive connection after 5 s; reusing one near
# that edge races its close, so pooled connections retire earlier.
_POOL_AGE_S = 2.0


class UpstreamPool:
    """Idle keep-alive connections to the HTTP upstream, shared by all sessions."""

    def __init__(self, connect: Callable[[Addr], socket.socket],
                 connect_once: Callable[[Addr], socket.socket]) -> None:
        self._connect = connect  # waits out a shortage of descriptors (bounded)
        self._connect_once = connect_once
        self._lock = threading.Lock()
        self._idle: dict[Addr, collections.deque[tuple[socket.socket, float]]] = {}

    def take(self, target: Addr, fresh: bool = False) -> tuple[socket.socket, bool]:
        """(socket, reused). Raises OSError when a new connection cannot be made. ``fresh``:
        a new connection (a streamed body cannot be sent again on a stale one)."""
        if fresh:
            return self._connect(target), False
        now = time.monotonic()
        while True:
            with self._lock:
                q = self._idle.get(target)
                item = q.pop() if q else None
            if item is None:
                return self._connect(target), False
            sock, since = item
            if now - since < _POOL_AGE_S and _still_open(sock):
                return sock, True
            sock.close()

    def listening(self, target: Addr) -> bool:
        """Whether ``target`` accepts a new connection now (one attempt, closed at once)."""
        try:
            probe = self._connect_once(target)
        except OSError:
            return False
        probe.close()
        return True

    def give(self, target: Addr, sock: socket.socket) -> None:
        drop: list[socket.socket] = []
        with self._lock:
            q = self._idle.setdefault(target, collections.deque())
            q.append((sock, time.monotonic()))
            while len(q) > _POOL_IDLE:
                drop.append(q.popleft()[0])
        for s in drop:
            s.close()

    def reap(self, keep: set[Addr] | frozenset[Addr] = frozenset()) -> None:
        """Close connections past their age, and every one not to ``keep`` (moved upstreams)."""
        now = time.monotonic()
        drop: list[socket.socket] = []
        with self._lock:
            for target in list(self._idle):
                q = self._idle[target]
                if target not in keep:
                    drop.extend(s for s, _ in q)
                    del self._idle[target]
                    continue
                while q and now - q[0][1] >= _POOL_AGE_S:
                    drop.append(q.popleft()[0])
        for s in drop:
            s.close()

    def idle(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._idle.values())

    def close(self) -> None:
        with self._lock:
            socks = [s for q in self._idle.values() for s, _ in q]
            self._idle.clear()
        for s in socks:
            s.close()


def _still_open(sock: socket.socket) -> bool:
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return False  # EOF, or bytes nobody asked for: not reusable either way


class SessionCounts(Protocol):
    """The counters an HTTP session reports into (the router's ``Ledger``)."""

    def count_refused(self, reason: str, detail: str = "", log_it: bool = True) -> None: ...
    def count_event(self, reason: str, detail: str = "", log_it: bool = True) -> None: ...
    def count_cut(self) -> None: ...
    def count_retried(self) -> None: ...
    def finish_request(self, rec: Record) -> None: ...


class SessionHost(Protocol):
    """What an HTTP session (router/http.py) needs of its router: its settings and route
    table (read per request: the owner may change them any time), the upstream pool, and
    the counters it reports into. ``Router`` (router/core.py) is one."""

    @property
    def port(self) -> int: ...
    @property
    def idle_timeout(self) -> float | None: ...
    @property
    def request_timeout(self) -> float: ...
    @property
    def max_body(self) -> int: ...
    @property
    def retry_wait(self) -> float: ...
    @property
    def request_defaults(self) -> Mapping[str, JSONValue]: ...
    @property
    def table(self) -> RouteTable | None: ...
    @property
    def pool(self) -> UpstreamPool: ...
    @property
    def ledger(self) -> SessionCounts: ...
    @property
    def traffic(self) -> Traffic: ...
    @property
    def body_budget(self) -> BodyBudget: ...
    @property
    def pump(self) -> BodyPump: ...


_NO_BODY_METHODS = (b"GET", b"HEAD", b"DELETE", b"OPTIONS")
_POOLABLE_VERSIONS = (b"1.1",)  # upstream connections of these versions go back to the pool
# Per leg, except that an HTTP/1.0 client's Connection / Keep-Alive go up as sent: then
# llama-server frames and keeps (or closes) its answer as it does for that client directly.
_HOP_10 = head.HOP_REQUEST - {b"connection", b"keep-alive"}


class Outgoing:
    """A request as it goes upstream: the client's request line and header lines (names as
    sent, per-leg ones dropped), then the body: whole with our own Content-Length, or, when
    it streams (``streamed``), the client's framing (its Content-Length, or chunked) and the
    part read so far (``wire``); the rest follows as the client sends it."""

    __slots__ = ("method", "wire", "poolable", "streamed", "chunked", "sent")

    def __init__(self, req: head.RequestHead, body: bytes, streamed: bool = False) -> None:
        self.method = req.method
        hop = _HOP_10 if req.version == b"1.0" else head.HOP_REQUEST
        hdrs = [(k, v) for k, v in req.headers if k.lower() not in hop]
        self.streamed = streamed
        self.chunked = streamed and req.chunked
        self.sent = 0  # bytes of a streamed body's rest taken from the client: no re-send
        if self.chunked:
            hdrs.append((b"Transfer-Encoding", b"chunked"))
            self.wire = head.request_head(req.method, req.target, req.version, hdrs,
                                          None) + head.chunk(body)
        else:
            if streamed:
                length: int | None = req.length
            else:
                length = len(body) if body or req.method not in _NO_BODY_METHODS else None
            self.wire = head.request_head(req.method, req.target, req.version, hdrs,
                                          length) + body
        # An HTTP/1.0 request goes up as 1.0 (so llama-server frames its answer for a 1.0
        # client), and its upstream connection is not reused.
        self.poolable = req.version in _POOLABLE_VERSIONS and not streamed

    def parser(self) -> h11.Connection:
        """An h11 client that parses the response to this request (it needs the method: the
        answer to a HEAD has no body). Its own output is not sent; ``wire`` is."""
        up = h11.Connection(h11.CLIENT)
        up.send(h11.Request(method=self.method, target=b"/", headers=[(b"Host", b"upstream")]))
        up.send(h11.EndOfMessage())
        return up
