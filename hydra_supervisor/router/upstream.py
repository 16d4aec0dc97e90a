"""The HTTP leg's upstream side: pooled connections to the HTTP upstream, sending a request
through its gate, forwarding the response in the upstream's framing, retrying and cutting.

Each chunk the upstream sends is written to the client at once, so SSE token streams are not
buffered. ``Forwarding`` is a part of ``HttpSession`` (router/http.py), which reads the request
from the client and holds the state this part uses. ``SessionHost`` is what a session needs of
its router (its settings, table, pool and counters): the Router (router/core.py) is one, and
nothing here or in router/http.py imports it.

Failures: an upstream that refuses or closes before the first response byte gets the request
once more (after a short wait, or after the next release if the router got held meanwhile); a
reused keep-alive upstream connection that turned out stale is replaced at once, uncounted.
An upstream that dies mid-response ends an SSE response with an error event (the openai client
raises APIError on it) and closes the client connection.
"""

from __future__ import annotations

import collections
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import h11

from hydra_supervisor.router import head
from hydra_supervisor.router.gate import DEFAULT_RETRY_AFTER, Flight, Gate, Refusal
from hydra_supervisor.router.replies import JSONValue, Record, sse_error_event
from hydra_supervisor.router.routes import Route, RouteTable

if TYPE_CHECKING:
    from hydra_supervisor.router.conn import Conn

Addr = tuple[str, int]

RECV = 65536
# How long the empty chunked body after a 204 is waited for (router/head.py).
_TAIL_WAIT_S = 1.0
# Before a new upstream connection closed without answering is taken for a refusal on purpose,
# the upstream is probed after this pause (a dying process may hold its listener a moment).
_CLOSE_PROBE_DELAY_S = 0.05
# A request a planned change cut before any response byte is sent again at most this often
# (each change re-sends it once; a storm of switches must not keep one forever).
_MAX_REQUEUE = 3
_POOL_IDLE = 16  # idle upstream connections kept per target
# llama-server (cpp-httplib) closes an idle keep-alive connection after 5 s; reusing one near
# that edge races its close, so pooled connections retire earlier.
_POOL_AGE_S = 2.0


class UpstreamPool:
    """Idle keep-alive connections to the HTTP upstream, shared by all sessions."""

    def __init__(self, connect: Callable[[Addr], socket.socket]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._idle: dict[Addr, collections.deque[tuple[socket.socket, float]]] = {}

    def take(self, target: Addr) -> tuple[socket.socket, bool]:
        """(socket, reused). Raises OSError when a new connection cannot be made."""
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


class SessionHost(Protocol):
    """What an HTTP session (router/http.py, and ``Forwarding`` here) needs of its router:
    its settings and route table (read per request: the owner may change them any time), the
    upstream pool, and the counters it reports into. ``Router`` (router/core.py) is one."""

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
    def route_by_model(self) -> bool: ...
    @property
    def pool(self) -> UpstreamPool: ...

    def connect_once(self, target: Addr) -> socket.socket: ...
    def count_refused(self, reason: str, detail: str = "", log_it: bool = True) -> None: ...
    def count_event(self, reason: str, detail: str = "") -> None: ...
    def count_cut(self) -> None: ...
    def count_retried(self) -> None: ...
    def finish_request(self, rec: Record) -> None: ...


class ClientGone(Exception):
    """The client closed or broke its connection; the session ends without a reply."""


class _NotStarted(Exception):
    """The upstream failed before sending one response byte: the request may be sent again."""


_NO_BODY_METHODS = (b"GET", b"HEAD", b"DELETE", b"OPTIONS")
_POOLABLE_VERSIONS = (b"1.1",)  # upstream connections of these versions go back to the pool


class Forwarding:
    """The upstream side of ``HttpSession``: ``_forward`` and what it calls."""

    # The session's state this part uses (router/http.py sets it in HttpSession.__init__).
    r: SessionHost
    conn: Conn
    sock: socket.socket
    client_eof: bool
    keep: bool

    if TYPE_CHECKING:  # the session's (router/http.py)
        def _send_client(self, data: bytes) -> None: ...
        def _reply_error(self, rec: Record, status: int, message: str, kind: str,
                         retry_after: int | None = None, close: bool = False,
                         outcome: str = "error") -> None: ...
        def _refuse(self, rec: Record, refusal: Refusal, close: bool = False,
                    kind: str = "unavailable_error") -> None: ...

    # ------------------------------------------------------------ upstream side

    def _forward(self, fwd: Outgoing, rec: Record, route: Route) -> bool:
        """Send upstream: `route`'s upstream, through its gate."""
        gate = route.gate
        retried = False
        requeued = 0
        while True:
            target = route.http
            if target is None:
                self._refuse(rec, Refusal(503, "no http upstream configured",
                                          DEFAULT_RETRY_AFTER, "error", "upstream_down"))
                return True
            flight = gate.begin()
            try:
                return self._exchange(gate, flight, target, fwd, rec)
            except _NotStarted as e:
                why = str(e)
                fresh_close = e.args[1] if len(e.args) > 1 else False
            finally:
                gate.end(flight)
            if (flight.cut is not None and flight.requeue and not self.client_eof
                    and requeued < _MAX_REQUEUE):
                # A planned change (switch, reload) cut it before any response byte: like
                # a crash's retry, it waits for the new layout instead of a 503.
                requeued += 1
                self.r.count_retried()
                refusal = gate.wait_turn()
                if refusal is not None:
                    self._refuse(rec, refusal)
                    return True
                continue
            if flight.cut is not None:
                self.r.count_cut()
                self._reply_error(rec, 503, f"hydra router: request cut: {flight.cut}",
                                  "unavailable_error", retry_after=DEFAULT_RETRY_AFTER,
                                  outcome="cut")
                return True
            if self.client_eof:
                raise ClientGone("client closed; the upstream closed without answering")
            if (fresh_close and gate.held_reason is None and gate.refusal_now() is None
                    and self._upstream_listening(target)):
                # llama-server closed a new connection without a word while still serving: a
                # request it refuses on purpose. Sending it again would get the same; close
                # the client's connection as llama-server on its own port would have.
                self.conn.note(f"{why}; llama-server is up: its answer passed on as a close")
                rec.outcome, rec.reason = "error", why
                self.r.count_refused("upstream_closed", why)
                self.r.finish_request(rec)
                return False
            if retried:
                self._refuse(rec, Refusal(503, why, DEFAULT_RETRY_AFTER, "error",
                                          "upstream_down"))
                return True
            retried = True
            self.r.count_retried()
            refusal = gate.wait_turn(delay=self.r.retry_wait)
            if refusal is not None:
                self._refuse(rec, refusal)
                return True

    def _upstream_listening(self, target: Addr) -> bool:
        """Whether the upstream still accepts connections (a process that died does not)."""
        time.sleep(_CLOSE_PROBE_DELAY_S)  # a dying process may hold its listener a moment
        try:
            probe = self.r.connect_once(target)
        except OSError:
            return False
        probe.close()
        return True

    def _exchange(self, gate: Gate, flight: Flight, target: Addr, fwd: Outgoing,
                  rec: Record) -> bool:
        """One attempt. Raises _NotStarted when nothing came back (the caller may retry)."""
        for _ in range(2):  # a stale pooled connection is replaced once, at once
            try:
                sock, reused = self.r.pool.take(target)
            except OSError as e:
                raise _NotStarted(f"http upstream {target[0]}:{target[1]}: "
                                  f"{e.strerror or e}") from e
            if not gate.attach(flight, sock):
                sock.close()
                raise _NotStarted("cut")
            up = fwd.parser()
            try:
                sock.sendall(fwd.wire)
                first = self._first_response_bytes(sock)
                flight.answered = True
            except _NotStarted as e:
                sock.close()
                if reused and flight.cut is None and not self.client_eof:
                    continue
                raise _NotStarted(str(e), not reused) from e
            except OSError as e:
                sock.close()
                if reused and flight.cut is None and not self.client_eof:
                    continue
                raise _NotStarted(f"http upstream {target[0]}:{target[1]}: "
                                  f"{e.strerror or e}") from e
            except BaseException:
                sock.close()
                raise
            return self._relay_response(flight, target, sock, up, first, rec, fwd.poolable)
        raise _NotStarted(f"http upstream {target[0]}:{target[1]}: closed")

    def _first_response_bytes(self, sock: socket.socket) -> bytes:
        """Wait for the upstream's first bytes while watching the client. A client that shuts
        its side (a half-close, or gone: they look alike) is passed on as llama-server on its
        own port would see it: the upstream connection is half-closed too, and llama-server
        answers or stops, as it decides (it stops a completion whose client went away)."""
        poller = select.poll()
        cfd, ufd = self.sock.fileno(), sock.fileno()
        poller.register(ufd, select.POLLIN)
        if not self.client_eof:
            poller.register(cfd, select.POLLIN)
        while True:
            for fd, _ev in poller.poll():
                if fd == cfd:
                    try:
                        peek = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    except (BlockingIOError, InterruptedError):
                        peek = b"?"
                    except OSError:
                        peek = b""
                    poller.unregister(cfd)  # a pipelined next request: read it later
                    if not peek:
                        self.client_eof = True
                        try:
                            sock.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass
                    continue
                data = sock.recv(RECV)
                if not data:
                    raise _NotStarted("http upstream closed before answering")
                return data

    def _flush(self, out: list[bytes], rec: Record) -> None:
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self._send_client(data)
        rec.bytes_out += len(data)

    def _relay_response(self, flight: Flight, target: Addr, sock: socket.socket,
                        up: h11.Connection, data: bytes, rec: Record, poolable: bool) -> bool:
        """Forward one response: the head as the upstream wrote it (router/head.py), the body
        in the upstream's framing, each piece as it arrives (an SSE stream token by token)."""
        resp = _Framing()
        recv = sock.recv
        # What h11 already has parsed goes out in one write: a token chunk that arrived with
        # the terminal chunk leaves together with it (fewer syscalls, and the client sees the
        # response complete at once).
        out: list[bytes] = []
        try:
            up.receive_data(data)
            while True:
                ev = up.next_event()
                if ev is h11.NEED_DATA:
                    if out:
                        self._flush(out, rec)
                    try:
                        data = recv(RECV)
                    except OSError:
                        data = b""
                    up.receive_data(data)
                    continue
                if isinstance(ev, h11.Data):
                    out.append(head.chunk(ev.data) if resp.kind == "chunked" else ev.data)
                elif isinstance(ev, h11.Response):
                    rec.status = ev.status_code
                    resp.start(ev, rec.method == "HEAD")
                    if resp.kind == "eof":
                        self.keep = False  # the body ends with the connection
                    out.append(head.response_head(ev.http_version, ev.status_code, ev.reason,
                                                  ev.headers.raw_items(), close=not self.keep
                                                  or self.client_eof))
                elif isinstance(ev, h11.InformationalResponse):
                    if ev.status_code != 101:
                        out.append(head.informational_head(
                            ev.http_version, ev.status_code, ev.reason, ev.headers.raw_items()))
                elif isinstance(ev, h11.EndOfMessage):
                    if resp.kind == "chunked":
                        out.append(head.last_chunk(ev.headers.raw_items()))
                    elif resp.chunked_tail:
                        out.append(self._chunked_tail(sock, up))
                        poolable = False
                    self._flush(out, rec)
                    break
                elif isinstance(ev, h11.ConnectionClosed):
                    raise h11.RemoteProtocolError("upstream closed mid-response")
        except h11.RemoteProtocolError as e:
            sock.close()
            return self._cut(flight, resp, out, rec, str(e))
        except BaseException:
            sock.close()
            raise
        if (poolable and not self.client_eof and flight.cut is None
                and up.our_state is h11.DONE and up.their_state is h11.DONE):
            self.r.pool.give(target, sock)
        else:
            sock.close()
        self.r.finish_request(rec)
        return True

    def _cut(self, flight: Flight, resp: _Framing, out: list[bytes], rec: Record,
             why: str) -> bool:
        """The upstream went away mid-response (a crash, or cut_inflight). The client is told:
        before the head, a 502; in a chunked body (every SSE stream), an SSE error event and
        the last chunk, so the connection stays usable; otherwise the close says it."""
        reason = flight.cut or f"upstream closed mid-response ({why})"
        self.r.count_cut()
        rec.outcome, rec.reason = "cut", reason
        self.conn.note(f"response cut: {reason}")
        if not resp.started:
            self._reply_error(rec, 502, f"hydra router: {reason}", "server_error", outcome="cut")
            return True
        keep = False
        if resp.kind == "chunked":
            if resp.sse:
                out.append(head.chunk(sse_error_event(f"hydra router: {reason}")))
            out.append(head.last_chunk())
            keep = True
        elif resp.kind == "eof" and resp.sse:
            out.append(sse_error_event(f"hydra router: {reason}"))
        try:
            if out:
                self._flush(out, rec)
        except ClientGone:
            keep = False
        self.r.finish_request(rec)
        return keep

    def _chunked_tail(self, sock: socket.socket, up: h11.Connection) -> bytes:
        """The empty chunked body llama-server sends after a 204 it marked chunked (h11, by the
        RFC, reads no body there): a client that reads the framing it was given waits for it,
        so it is forwarded as sent. Bounded: a moment, a few KiB."""
        buf = bytes(up.trailing_data[0])
        deadline = time.monotonic() + _TAIL_WAIT_S
        while (end := head.empty_chunked_end(buf)) is None and len(buf) < 4096:
            left = deadline - time.monotonic()
            if left <= 0:
                return buf
            try:
                sock.settimeout(left)
                data = sock.recv(RECV)
            except OSError:
                return buf
            if not data:
                return buf
            buf += data
        return buf[:end] if end is not None else buf


class _Framing:
    """How the response being forwarded delimits its body."""

    __slots__ = ("kind", "sse", "started", "chunked_tail")

    def __init__(self) -> None:
        self.kind = ""  # "chunked" | "length" | "eof" | "none"
        self.sse = False
        self.started = False
        self.chunked_tail = False

    def start(self, ev: h11.Response, head_request: bool) -> None:
        self.started = True
        te = cl = False
        for k, v in ev.headers:
            if k == b"transfer-encoding":
                te = True
            elif k == b"content-length":
                cl = True
            elif k == b"content-type" and v.startswith(b"text/event-stream"):
                self.sse = True
        if head_request or ev.status_code in (204, 304):
            self.kind = "none"
            self.chunked_tail = te and ev.status_code in (204, 304)
        else:
            self.kind = "chunked" if te else "length" if cl else "eof"


class Outgoing:
    """A request as it goes upstream: the client's request line and header lines (names as
    sent, per-leg ones dropped), our own Content-Length, the whole body."""

    __slots__ = ("method", "wire", "poolable")

    def __init__(self, req: h11.Request, body: bytes, lent_host: bool) -> None:
        self.method = req.method
        hdrs = [(k, v) for k, v in req.headers.raw_items()
                if k.lower() not in head.HOP_REQUEST and not (lent_host and k.lower() == b"host")]
        length = len(body) if body or req.method not in _NO_BODY_METHODS else None
        self.wire = head.request_head(req.method, req.target, req.http_version, hdrs,
                                      length) + body
        # An HTTP/1.0 request goes up as 1.0 (so llama-server frames its answer for a 1.0
        # client), and llama-server then closes that connection.
        self.poolable = req.http_version in _POOLABLE_VERSIONS

    def parser(self) -> h11.Connection:
        """An h11 client that parses the response to this request (it needs the method: the
        answer to a HEAD has no body). Its own output is not sent; ``wire`` is."""
        up = h11.Connection(h11.CLIENT)
        up.send(h11.Request(method=self.method, target=b"/", headers=[(b"Host", b"upstream")]))
        up.send(h11.EndOfMessage())
        return up

