"""The router's request-aware HTTP leg: one session thread per client connection, h11 both ways.

Why request-aware: the engine needs request boundaries to hold requests during a restart, count
and drain what is in flight, retry a request whose upstream died before answering, merge T1
defaults into bodies, end a cut stream with an error the client can read, and log one record
per request. h11 (a maintained sans-IO HTTP/1.1 parser) does the framing; this module does the
I/O with blocking sockets, like the rest of the router (docs/router.md says why threads).

Per client connection: read a request (head and body, bounded by ``max_body``), ask the gate
whether it may go upstream (it may park here while the router is held), send it on a pooled
upstream connection, and forward the response as it arrives: each chunk the upstream sends is
written to the client at once, so SSE token streams are not buffered. Keep-alive on both legs is
independent: a client's idle keep-alive connection holds no upstream connection (llama-server's
HTTP threads are a fixed pool; an idle connection would pin one).

Failures: an upstream that refuses or closes before the first response byte gets the request
once more (after a short wait, or after the next release if the router got held meanwhile); a
reused keep-alive upstream connection that turned out stale is replaced at once, uncounted.
An upstream that dies mid-response ends an SSE response with an error event (the openai client
raises APIError on it) and closes the client connection.
"""

from __future__ import annotations

import collections
import errno
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import h11

from hydra_supervisor.router import defaults as request_defaults
from hydra_supervisor.router.gate import DEFAULT_RETRY_AFTER, Flight, Gate, Refusal
from hydra_supervisor.router.routes import LocalReply, Route

if TYPE_CHECKING:
    from hydra_supervisor.router.conn import Conn
    from hydra_supervisor.router.relay import Router

Addr = tuple[str, int]

RECV = 65536
MAX_HEAD = 64 * 1024
# Hop-by-hop headers (RFC 9110 7.6.1) are per leg; framing headers are rewritten per leg by h11.
_HOP_REQ = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"upgrade",
        b"transfer-encoding",
        b"content-length",
        b"expect",
    }
)
_HOP_RESP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"trailer", b"upgrade"})
_POOL_IDLE = 16  # idle upstream connections kept per target
# llama-server (cpp-httplib) closes an idle keep-alive connection after 5 s; reusing one near
# that edge races its close, so pooled connections retire earlier.
_POOL_AGE_S = 2.0
_EMFILE = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def error_body(status: int, message: str, kind: str = "unavailable_error") -> bytes:
    return json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()


def http_error_response(
    status: int, reason: str, message: str, retry_after: int | None = None
) -> bytes:
    """A complete HTTP/1.1 error response whose body matches llama-server's error JSON."""
    body = json.dumps(
        {"error": {"code": status, "message": message, "type": "unavailable_error"}}
    ).encode()
    retry = f"Retry-After: {retry_after}\r\n" if retry_after is not None else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{retry}"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + body


def sse_error_event(message: str) -> bytes:
    """The event that ends a cut stream; the openai client raises APIError on an "error" key."""
    err = {"error": {"message": message, "type": "server_error", "code": 502}}
    return b"data: " + json.dumps(err).encode() + b"\n\n"


@dataclass
class Record:
    method: str
    path: str
    started: float
    status: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    model: str | None = None
    outcome: str = "ok"
    reason: str = ""

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "duration_s": round(now - self.started, 6),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "model": self.model,
            "outcome": self.outcome,
        }


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


class _ClientGone(Exception):
    """The client closed or broke its connection; the session ends without a reply."""


class _NotStarted(Exception):
    """The upstream failed before sending one response byte: the request may be sent again."""


class HttpSession:
    """Serves one client connection until it closes, idles out, or the router stops."""

    def __init__(self, router: Router, conn: Conn) -> None:
        self.r = router
        self.conn = conn
        self.sock = conn.client
        self.h = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.h.receive_data(conn.prefix)
        conn.up += len(conn.prefix)
        self._timeout: float | None = -1.0  # what the client socket has; -1: not set yet

    def _set_timeout(self, t: float | None) -> None:
        # settimeout() costs a fcntl when the mode changes; skip it when nothing changes.
        if t != self._timeout:
            self.sock.settimeout(t)
            self._timeout = t

    # ------------------------------------------------------------ client side

    def run(self) -> None:
        while self._one_request():
            try:
                self.h.start_next_cycle()
            except h11.LocalProtocolError:
                return  # one side wants the connection closed

    def _recv_client(self, timeout: float | None) -> bytes:
        self._set_timeout(timeout)
        try:
            data = self.sock.recv(RECV)
        except TimeoutError:
            raise
        except OSError as e:
            raise _ClientGone(f"client error: {e.strerror or e}") from e
        self.conn.up += len(data)
        self.conn.last = time.monotonic()
        return data

    def _next_client_event(self, deadline: float | None, idle: bool) -> Any:
        """The next h11 event from the client. ``idle``: between requests (idle_timeout)."""
        while True:
            ev = self.h.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            if idle and self.h.trailing_data[0]:
                # Part of the next request is here: it is no longer idle, and the rest must come
                # within request_timeout (a head sent a byte at a time holds no thread forever).
                idle = False
                deadline = time.monotonic() + self.r.request_timeout
            if idle:
                # Marked idle while blocked here: the acceptor may close this connection to
                # admit a waiting one when descriptors run short (router/relay.py).
                self.conn.idle_since = time.monotonic()
                try:
                    data = self._recv_client(self.r.idle_timeout)
                finally:
                    self.conn.idle_since = None
                self.h.receive_data(data)
                continue
            assert deadline is not None
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise TimeoutError
            self.h.receive_data(self._recv_client(timeout))

    def _send_client(self, data: bytes) -> None:
        try:
            self._set_timeout(self.r.idle_timeout)
            self.sock.sendall(data)
        except OSError as e:  # includes TimeoutError: a client that stopped reading
            raise _ClientGone(f"client error: {e.strerror or e}") from e
        self.conn.down += len(data)
        self.conn.last = time.monotonic()

    def _one_request(self) -> bool:
        """Serve one request; True when the connection can carry another."""
        try:
            ev = self._next_client_event(None, idle=True)
        except TimeoutError:
            if self.h.trailing_data[0]:
                self.conn.note("request head not received in time")
                self.r.count_refused("request_timeout")
            else:
                self.conn.note(f"idle > {self.r.idle_timeout:g}s")
                self.r.count_event("idle_timeout")
            return False
        except _ClientGone as e:
            self.conn.note(str(e))
            return False
        except h11.RemoteProtocolError as e:
            self._protocol_error(e)
            return False
        if isinstance(ev, h11.ConnectionClosed):
            self.conn.note("client closed")
            return False
        assert isinstance(ev, h11.Request)
        rec = Record(ev.method.decode("latin-1"), request_defaults.path_of(ev.target),
                     time.monotonic())
        try:
            return self._serve(ev, rec)
        except _ClientGone as e:
            self.conn.note(str(e))
            rec.outcome = "error" if rec.outcome == "ok" else rec.outcome
            rec.reason = str(e)
            self.r.finish_request(rec)
            return False

    def _serve(self, req: h11.Request, rec: Record) -> bool:
        deadline = time.monotonic() + self.r.request_timeout
        if req.method == b"CONNECT" or any(k == b"upgrade" for k, _ in req.headers):
            self._reply_error(rec, 501, "hydra router: upgrade/CONNECT not supported",
                              "not_supported_error", close=True)
            return False
        refusal = self.r.gate.refusal_now()
        try:
            body, complete = self._read_body(deadline, self.r.max_body)
        except TimeoutError:
            self.conn.note("request not received in time")
            self.r.count_refused("request_timeout")
            self._reply_error(rec, 408, "hydra router: request not received in time",
                              "timeout_error", close=True)
            return False
        except h11.RemoteProtocolError as e:
            self._protocol_error(e)
            return False
        rec.bytes_in = len(body)
        if refusal is not None:
            # The body was read (up to the bound) so the client reads this answer rather than
            # a broken pipe; a whole body keeps the connection usable.
            self._refuse(rec, refusal, close=not complete)
            return complete
        if not complete:
            self.r.count_refused("body_too_large")
            self._reply_error(rec, 413, f"hydra router: request body over {self.r.max_body} bytes",
                              "invalid_request_error", close=True)
            return False
        if req.method == b"POST":
            merged, rec.model = request_defaults.merge(rec.path, body, self.r.request_defaults)
            if merged is not None:
                body = merged
        table = self.r.table
        if table is None:
            refusal = self.r.gate.wait_turn()
            if refusal is not None:
                self._refuse(rec, refusal)
                return True
            return self._forward(req, body, rec, None)
        if rec.model is None and req.method == b"POST":
            rec.model = request_defaults.model_of(body)  # embeddings, rerank, infill...
        sel = table(rec.model, rec.method, rec.path)
        if isinstance(sel, LocalReply):
            self._local_reply(rec, sel)
            return True
        return self._routed(req, body, rec, sel)

    def _routed(self, req: h11.Request, body: bytes, rec: Record, route: Route) -> bool:
        """A request the table sent to `route`: its limiter, then its gate, then upstream."""
        route.started()
        lim = route.limiter
        try:
            if lim is not None:
                refusal = lim.acquire(route.gate.hold_timeout)
                if refusal is not None:
                    self._refuse(rec, refusal, kind="rate_limit_error")
                    return True
            try:
                refusal = route.gate.wait_turn()
                if refusal is not None:
                    self._refuse(rec, refusal)
                    return True
                return self._forward(req, body, rec, route)
            finally:
                if lim is not None:
                    lim.release()
        finally:
            route.touch()

    def _local_reply(self, rec: Record, reply: LocalReply) -> None:
        if reply.status >= 400:
            err = reply.body.get("error") if isinstance(reply.body, dict) else None
            msg = err.get("message", "") if isinstance(err, dict) else ""
            self.r.count_refused(reply.counter, detail=msg)
        rec.status = reply.status
        rec.outcome = "ok" if reply.status < 400 else "error"
        self._send_json(rec, reply.status, json.dumps(reply.body).encode(), [])

    def _send_json(self, rec: Record, status: int, body: bytes,
                   extra: list[tuple[bytes, bytes]]) -> None:
        """A whole JSON response the router writes itself; the request's record ends here."""
        headers = [(b"Content-Type", b"application/json; charset=utf-8"),
                   (b"Content-Length", str(len(body)).encode()), *extra]
        try:
            if self.h.our_state is h11.SEND_RESPONSE:
                out = self.h.send(h11.Response(status_code=status, headers=headers)) or b""
                if rec.method != "HEAD":  # a HEAD response has the headers, no body
                    out += self.h.send(h11.Data(data=body)) or b""
                out += self.h.send(h11.EndOfMessage()) or b""
                self._send_client(out)
                rec.bytes_out += len(out)
        finally:
            self.r.finish_request(rec)

    def _read_body(self, deadline: float, limit: int) -> tuple[bytes, bool]:
        parts: list[bytes] = []
        size = 0
        if self.h.client_is_waiting_for_100_continue:
            cont = h11.InformationalResponse(status_code=100, headers=[])
            self._send_client(self.h.send(cont) or b"")
        while True:
            ev = self._next_client_event(deadline, idle=False)
            if isinstance(ev, h11.Data):
                size += len(ev.data)
                if size <= limit:
                    parts.append(ev.data)
                elif size > 2 * limit:  # read and dropped enough to answer; stop listening
                    return b"", False
            elif isinstance(ev, h11.EndOfMessage):
                return (b"".join(parts), True) if size <= limit else (b"", False)
            elif isinstance(ev, h11.ConnectionClosed):
                raise _ClientGone("client closed mid-request")

    def _protocol_error(self, e: h11.RemoteProtocolError) -> None:
        status = getattr(e, "error_status_hint", 400)
        self.conn.note(f"bad request: {e}")
        self.r.count_refused("bad_request")
        body = error_body(status, f"hydra router: bad request: {e}", "invalid_request_error")
        head = (f"HTTP/1.1 {status} Bad Request\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        try:
            self._send_client(head + body)
        except _ClientGone:
            pass

    def _reply_error(self, rec: Record, status: int, message: str, kind: str,
                     retry_after: int | None = None, close: bool = False,
                     outcome: str = "error") -> None:
        extra: list[tuple[bytes, bytes]] = []
        if retry_after is not None:
            extra.append((b"Retry-After", str(retry_after).encode()))
        if close:
            extra.append((b"Connection", b"close"))
        rec.status, rec.outcome, rec.reason = status, outcome, message
        self._send_json(rec, status, error_body(status, message, kind), extra)

    def _refuse(self, rec: Record, refusal: Refusal, close: bool = False,
                kind: str = "unavailable_error") -> None:
        self.r.count_refused(refusal.counter, detail=refusal.message)
        self._reply_error(rec, refusal.status, f"hydra router: {refusal.message}",
                          kind, retry_after=refusal.retry_after, close=close,
                          outcome=refusal.outcome)

    # ------------------------------------------------------------ upstream side

    def _forward(self, req: h11.Request, body: bytes, rec: Record,
                 route: Route | None) -> bool:
        """Send upstream: `route`'s upstream through its gate, or (no route table) the
        router's own."""
        gate = self.r.gate if route is None else route.gate
        headers = [(k, v) for k, v in req.headers if k not in _HOP_REQ]
        if not any(k == b"host" for k, _ in headers):
            headers.append((b"host", b"localhost"))
        if body or req.method not in (b"GET", b"HEAD", b"DELETE", b"OPTIONS"):
            headers.append((b"content-length", str(len(body)).encode()))
        retried = False
        while True:
            target = self.r.upstreams.http if route is None else route.http
            if target is None:
                self._refuse(rec, Refusal(503, "no http upstream configured",
                                          DEFAULT_RETRY_AFTER, "error", "upstream_down"))
                return True
            flight = gate.begin()
            try:
                return self._exchange(gate, flight, target, req, headers, body, rec)
            except _NotStarted as e:
                why = str(e)
            finally:
                gate.end(flight)
            if flight.cut is not None:
                self.r.count_cut()
                self._reply_error(rec, 503, f"hydra router: request cut: {flight.cut}",
                                  "unavailable_error", retry_after=DEFAULT_RETRY_AFTER,
                                  outcome="cut")
                return True
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

    def _exchange(self, gate: Gate, flight: Flight, target: Addr, req: h11.Request,
                  headers: list[tuple[bytes, bytes]], body: bytes, rec: Record) -> bool:
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
            up = h11.Connection(h11.CLIENT)
            try:
                out = up.send(h11.Request(method=req.method, target=req.target,
                                          headers=headers)) or b""
                if body:
                    out += up.send(h11.Data(data=body)) or b""
                out += up.send(h11.EndOfMessage()) or b""
                sock.sendall(out)
                first = self._first_response_bytes(sock)
            except _NotStarted:
                sock.close()
                if reused and flight.cut is None:
                    continue
                raise
            except OSError as e:
                sock.close()
                if reused and flight.cut is None:
                    continue
                raise _NotStarted(f"http upstream {target[0]}:{target[1]}: "
                                  f"{e.strerror or e}") from e
            except BaseException:
                sock.close()
                raise
            return self._relay_response(flight, target, sock, up, first, rec)
        raise _NotStarted(f"http upstream {target[0]}:{target[1]}: closed")

    def _first_response_bytes(self, sock: socket.socket) -> bytes:
        """Wait for the upstream's first bytes while watching the client, whose going away
        (a user cancelling a long completion) must reach llama-server, which then stops."""
        poller = select.poll()
        cfd, ufd = self.sock.fileno(), sock.fileno()
        poller.register(ufd, select.POLLIN)
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
                    if not peek:
                        raise _ClientGone("client closed while waiting for the response")
                    poller.unregister(cfd)  # a pipelined next request: read it later
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
                        up: h11.Connection, data: bytes, rec: Record) -> bool:
        h = self.h
        sse = False
        head_sent = False
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
                    out.append(h.send(ev) or b"")
                elif isinstance(ev, h11.Response):
                    rec.status = ev.status_code
                    hdrs = [(k, v) for k, v in ev.headers if k not in _HOP_RESP]
                    sse = any(k == b"content-type" and v.startswith(b"text/event-stream")
                              for k, v in hdrs)
                    out.append(h.send(h11.Response(status_code=ev.status_code, headers=hdrs,
                                                   reason=ev.reason)) or b"")
                    head_sent = True
                elif isinstance(ev, h11.InformationalResponse):
                    if ev.status_code != 101:
                        out.append(h.send(ev) or b"")
                elif isinstance(ev, h11.EndOfMessage):
                    out.append(h.send(h11.EndOfMessage()) or b"")
                    self._flush(out, rec)
                    break
                elif isinstance(ev, h11.ConnectionClosed):
                    raise h11.RemoteProtocolError("upstream closed mid-response")
        except h11.RemoteProtocolError as e:
            sock.close()
            reason = flight.cut or f"upstream closed mid-response ({e})"
            self.r.count_cut()
            rec.outcome, rec.reason = "cut", reason
            self.conn.note(f"response cut: {reason}")
            if out and head_sent:
                try:
                    self._flush(out, rec)
                except _ClientGone:
                    pass
            if not head_sent:
                self._reply_error(rec, 502, f"hydra router: {reason}", "server_error",
                                  close=True, outcome="cut")
                return False
            if sse:
                try:
                    out.append(h.send(h11.Data(data=sse_error_event(f"hydra router: {reason}")))
                               or b"")
                    out.append(h.send(h11.EndOfMessage()) or b"")
                    self._flush(out, rec)
                except (h11.LocalProtocolError, _ClientGone):
                    pass  # a Content-Length body cannot carry the event; the close says it
            self.r.finish_request(rec)
            return False
        except BaseException:
            sock.close()
            raise
        if up.our_state is h11.DONE and up.their_state is h11.DONE and flight.cut is None:
            self.r.pool.give(target, sock)
        else:
            sock.close()
        self.r.finish_request(rec)
        return h.our_state is h11.DONE and h.their_state is h11.DONE
