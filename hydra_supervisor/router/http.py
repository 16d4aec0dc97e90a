"""The router's request-aware HTTP leg: one session thread per client connection, h11 both ways.

Why request-aware: the engine needs request boundaries to hold requests during a restart, count
and drain what is in flight, retry a request whose upstream died before answering, merge T1
defaults into bodies, end a cut stream with an error the client can read, and log one record
per request. h11 (a maintained sans-IO HTTP/1.1 parser) does the framing; this module does the
I/O with blocking sockets, like the rest of the router (docs/router.md says why threads).

Per client connection: read a request's head (parsed as llama-server parses it,
router/head.py) and its body (whole up to 1 MiB, or when the router must read it; a larger
body streams: its first MiB is kept and the rest goes upstream as it arrives, within a
process-wide budget of bytes held, router/budget.py), ask the route table where it goes and
that route's gate whether it may go upstream (it may park there while its lane is held), send
it on a pooled upstream connection while watching for an early answer, and forward the
response as it arrives: each chunk the upstream sends is written to the client at once, so
SSE token streams are not buffered. The client is watched all along: its half-close or close
is passed on to llama-server at once (which stops generating). Keep-alive on both legs is
independent: a client's idle keep-alive connection holds no upstream connection (llama-server's
HTTP threads are a fixed pool; an idle connection would pin one).

Failures: an upstream that refuses or closes before the first response byte gets the request
once more (after a short wait, or after the next release if the router got held meanwhile); a
reused keep-alive upstream connection that turned out stale is replaced at once, uncounted.
An upstream that dies mid-response ends an SSE response with an error event (the openai client
raises APIError on it) and closes the client connection.

router/upstream.py holds the upstream pool, the request as it goes upstream, ``SessionHost``
(what a session needs of its router) and ``SessionCounts`` (the counters it reports into);
router/replies.py what the router writes itself.
"""

from __future__ import annotations

import json
import select
import socket
import time
from typing import TYPE_CHECKING

import h11

from hydra_supervisor.router import defaults as request_defaults
from hydra_supervisor.router import head
from hydra_supervisor.router.budget import STREAM_ABOVE, BodyBudget
from hydra_supervisor.router.conn import fmt_addr
from hydra_supervisor.router.gate import DEFAULT_RETRY_AFTER, Flight, Gate, Refusal
from hydra_supervisor.router.pump import (
    CLIENT_GONE,
    OK,
    RECV,
    BodyFraming,
    BodyJob,
    FramingError,
    take,
)
from hydra_supervisor.router.replies import (
    LLAMA_BAD_BODY,
    LLAMA_BAD_REQUEST,
    Record,
    error_body,
    json_response,
    sse_error_event,
)
from hydra_supervisor.router.routes import LocalReply, Route, RouteTable
from hydra_supervisor.router.upstream import Addr, Outgoing, SessionHost

if TYPE_CHECKING:
    from hydra_supervisor.router.conn import Conn

MAX_HEAD = 64 * 1024  # h11's bound on a chunk-size line (heads are bounded by router/head.py)
# After a reply that ends the connection early (413 before the upload): how long and how much
# of what the client still sends is read, so that the close is not a reset.
_LINGER_S = 1.0
_LINGER_BYTES = 4 << 20
# How long the empty chunked body after a 204 is waited for (router/head.py).
_TAIL_WAIT_S = 1.0
# Before a new upstream connection closed without answering is taken for a refusal on purpose,
# the upstream is probed after this pause (a dying process may hold its listener a moment).
_CLOSE_PROBE_DELAY_S = 0.05
# A request a planned change cut before any response byte is sent again at most this often
# (each change re-sends it once; a storm of switches must not keep one forever).
_MAX_REQUEUE = 3


class ClientGone(Exception):
    """The client closed or broke its connection; the session ends without a reply."""


class _NotStarted(Exception):
    """The upstream failed before sending one response byte: the request may be sent again.
    `fresh_close`: a new connection (not a reused keep-alive one) closed without answering."""

    def __init__(self, message: str, fresh_close: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.fresh_close = fresh_close

    def __str__(self) -> str:
        return self.message


class HttpSession:
    """Serves one client connection until it closes, idles out, or the router stops.

    h11 parses (one ``h11.Connection`` per request, fed the bytes the previous one left);
    heads and framing are written here (router/head.py), so the client sees llama-server's
    header names, order and framing (docs/router.md, "Transparency")."""

    def __init__(self, router: SessionHost, conn: Conn) -> None:
        self.r = router
        self.counts = router.ledger
        self.conn = conn
        self.sock = conn.client
        self.buf = bytearray(conn.prefix)  # received, not given to a parser yet
        conn.up += len(conn.prefix)
        self.h = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.client_eof = False  # the client shut its side: answer, then close
        self.keep = True  # the client's connection may carry another request
        self.upstream_shut = False  # the client's half-close was passed on upstream
        self.origin = b""  # the request's Origin (the router's own replies echo it, as CORS)
        self._timeout: float | None = -1.0  # what the client socket has; -1: not set yet

    def _set_timeout(self, t: float | None) -> None:
        # settimeout() costs a fcntl when the mode changes; skip it when nothing changes.
        if t != self._timeout:
            self.sock.settimeout(t)
            self._timeout = t

    # ------------------------------------------------------------ client side

    def run(self) -> None:
        while self._one_request():
            pass

    def _recv_client(self, timeout: float | None) -> bytes:
        self._set_timeout(timeout)
        try:
            data = self.sock.recv(RECV)
        except TimeoutError:
            raise
        except OSError as e:
            raise ClientGone(f"client error: {e.strerror or e}") from e
        self.conn.up += len(data)
        self.conn.last = time.monotonic()
        return data

    def _read_head(self) -> bytes | None:
        """The next request's head, or None when the client closed. Between requests the wait
        is ``idle_timeout``; from a request's first byte its head must come within
        ``request_timeout`` (a head sent a byte at a time holds no thread forever). Requests
        already received are served even after the client shut its side (pipelining and a
        half-close: each is answered, as llama-server answers them)."""
        deadline: float | None = None
        while True:
            end = head.head_end(self.buf)  # HeadError past llama-server's limits
            if end is not None:
                raw = bytes(self.buf[:end])
                del self.buf[:end]
                return raw
            if self.client_eof:
                if self.buf and self.buf != b"\r\n":
                    # llama-server answers a head cut short by the client's close with 400.
                    raise head.HeadError(400, "client closed mid-head")
                return None
            if not self.buf.strip(b"\r\n"):
                # Marked idle while blocked here: the acceptor may close this connection to
                # admit a waiting one when descriptors run short (Ledger.admit).
                self.conn.idle_since = time.monotonic()
                try:
                    data = self._recv_client(self.r.idle_timeout)
                finally:
                    self.conn.idle_since = None
            else:
                if deadline is None:
                    deadline = time.monotonic() + self.r.request_timeout
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    raise TimeoutError
                data = self._recv_client(timeout)
            if not data:
                self.client_eof = True
                continue
            self.buf += data

    def _next_client_event(
            self, deadline: float) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        """The next h11 event of the request being read (its body)."""
        while True:
            ev = self.h.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            if self.client_eof:
                raise ClientGone("client closed mid-request")
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise TimeoutError
            data = self._recv_client(timeout)
            if not data:
                self.client_eof = True
            self.h.receive_data(data)

    def _send_client(self, data: bytes) -> None:
        try:
            # Usually all of it fits the socket's buffer: one send, no poll (a socket with a
            # timeout polls before every send); the rest, if any, with the client's timeout.
            try:
                n = self.sock.send(data, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                n = 0
            if n < len(data):
                self._set_timeout(self.r.idle_timeout)
                self.sock.sendall(memoryview(data)[n:])
        except OSError as e:  # includes TimeoutError: a client that stopped reading
            raise ClientGone(f"client error: {e.strerror or e}") from e
        self.conn.down += len(data)
        self.conn.last = time.monotonic()

    def _one_request(self) -> bool:
        """Serve one request; True when the connection can carry another."""
        try:
            raw = self._read_head()
        except TimeoutError:
            if self.buf.strip(b"\r\n"):
                self.conn.note("request head not received in time")
                self.counts.count_refused("request_timeout")
            else:
                self.conn.note(f"idle > {self.r.idle_timeout:g}s")
                self.counts.count_event("idle_timeout")
            return False
        except ClientGone as e:
            self.conn.note(str(e))
            return False
        except head.HeadError as e:
            self._bad_request(e.status, str(e))
            return False
        if raw is None:
            self.conn.note("client closed")
            return False
        try:
            req = head.parse_request(raw)
        except head.HeadError as e:
            self._bad_request(e.status, str(e))
            return False
        self.h = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.h.receive_data(req.h11_head() + bytes(self.buf))
        self.buf.clear()
        if self.client_eof:
            self.h.receive_data(b"")
        try:
            ev = self.h.next_event()  # the canonical head (router/head.py): always a Request
        except h11.RemoteProtocolError as e:
            self._bad_request(400, f"unexpected: h11 refused the head: {e}")
            return False
        if not isinstance(ev, h11.Request):
            self._bad_request(400, f"unexpected: h11 read {ev!r}")
            return False
        self.keep = req.keep_alive
        self.origin = next((v for k, v in req.headers if k.lower() == b"origin"), b"")
        rec = Record(req.method.decode("latin-1"), request_defaults.path_of(req.target),
                     time.monotonic(), port=self.r.port)
        rec.tally = self.r.traffic.begin(rec.port, rec.method, rec.path,
                                         fmt_addr(self.conn.peer))
        held = _Held(self.r.body_budget)
        try:
            done = self._serve(req, rec, held)
        except ClientGone as e:
            self.conn.note(str(e))
            rec.outcome = "error" if rec.outcome == "ok" else rec.outcome
            rec.reason = str(e)
            rec.ended = rec.ended or "client_gone"
            self.counts.finish_request(rec)
            return False
        finally:
            held.release()
            if not rec.done:  # every request that began ends once (a bug's exception too)
                self.counts.finish_request(rec)
        if not done or not self.keep:
            return False
        if self.h.their_state is not h11.DONE:
            return False
        rest, closed = self.h.trailing_data
        self.buf = bytearray(rest)
        self.client_eof = self.client_eof or closed
        return True

    def _serve(self, req: head.RequestHead, rec: Record, held: _Held) -> bool:
        """Serve ``req``; False when the connection must close after what was written."""
        deadline = time.monotonic() + self.r.request_timeout
        if req.method == b"CONNECT" or any(k.lower() == b"upgrade" for k, _ in req.headers):
            self._reply_error(rec, 501, "hydra router: upgrade/CONNECT not supported",
                              "not_supported_error", close=True)
            return False
        if req.length is not None and req.length > self.r.max_body:
            self.counts.count_refused("body_too_large")
            self._reply_error(rec, 413, f"hydra router: request body over {self.r.max_body} bytes",
                              "invalid_request_error", close=True)
            self._linger()
            return False
        table = self.r.table
        # A port that routes without reading bodies knows the route now: a refused request
        # (its lane unavailable) is answered without waiting for a large upload. (The route
        # is asked again once the body is read: a standby flip may change it meanwhile.)
        early = table(None, rec.method, rec.path) if table is not None and not \
            table.needs_model else None
        if table is None:
            refusal: Refusal | None = Refusal(503, "hydra router: no route table is set",
                                              DEFAULT_RETRY_AFTER, "error", "upstream_down")
        elif isinstance(early, Route):
            refusal = early.gate.refusal_now()
            if refusal is not None:  # the profile's refusal (loading, stopped): its record
                rec.route = early.name
                if rec.tally is not None:
                    rec.tally.routed(early.name, None)
        else:
            refusal = None
        try:
            if refusal is not None:
                # Read (and dropped, up to twice max_body) so the client reads this answer
                # rather than a broken pipe; a whole body keeps the connection usable.
                complete = self._drain_body(deadline, 2 * self.r.max_body)
                self._refuse(rec, refusal, close=not complete)
                return complete
            body, complete = self._read_body(deadline, STREAM_ABOVE, held)
            if not complete and self._must_read(req, body, table):
                # Read on up to what the router reads at all (router/defaults.py: a body
                # over MAX_INSPECT is neither merged nor read for its model): such a body
                # then streams too, with what was read as its head.
                more, complete = self._read_body(
                    deadline, min(self.r.max_body, request_defaults.MAX_INSPECT) - len(body),
                    held)
                body += more
        except TimeoutError:
            self.conn.note("request not received in time")
            self.counts.count_refused("request_timeout")
            self._reply_error(rec, 408, "hydra router: request not received in time",
                              "timeout_error", close=True)
            return False
        except h11.RemoteProtocolError as e:
            self._bad_request(400, str(e), rec, LLAMA_BAD_BODY)
            return False
        except _OverBudget as e:
            self.counts.count_refused("body_budget", str(e))
            self._reply_error(rec, 503, f"hydra router: {e}", "unavailable_error",
                              retry_after=DEFAULT_RETRY_AFTER, close=True)
            self._linger()
            return False
        rec.bytes_in = len(body)
        assert table is not None  # refused above
        if not complete:
            # Over STREAM_ABOVE and not needed whole: routed by its head and streamed.
            sel = early if early is not None else table(None, rec.method, rec.path)
            if isinstance(sel, LocalReply):
                complete = self._drain_body(deadline, 2 * self.r.max_body)
                self.keep = self.keep and complete
                self._local_reply(rec, sel)
                return complete
            return self._routed(Outgoing(req, body, streamed=True), rec, sel)
        if req.method == b"POST":
            merged, rec.model = request_defaults.merge(rec.path, body, self.r.request_defaults)
            if merged is not None:
                body = merged
        fwd = Outgoing(req, body)
        if rec.model is None and req.method == b"POST" and table.needs_model:
            rec.model, readable = request_defaults.model_in(body)
            if not readable:
                # llama-server would read this body (a JSON parser without a depth limit);
                # ours cannot, and must not guess which model it names.
                self.counts.count_refused("bad_request", "unreadable JSON body")
                self._reply_error(rec, 400, "hydra router: cannot read \"model\" from this JSON "
                                  "body (nested too deeply or malformed)",
                                  "invalid_request_error")
                return True
        sel = table(rec.model, rec.method, rec.path)
        if isinstance(sel, LocalReply):
            self._local_reply(rec, sel)
            return True
        return self._routed(fwd, rec, sel)

    def _must_read(self, req: head.RequestHead, first: bytes, table: RouteTable | None) -> bool:
        """Whether a body over STREAM_ABOVE must be read whole: a JSON object POSTed where
        the router reads it (for its ``model``, on a port with several profiles; for T1
        defaults, on a completion endpoint while defaults are set)."""
        if req.method != b"POST" or not request_defaults.looks_like_object(first):
            return False
        if table is not None and table.needs_model:
            return True
        return bool(self.r.request_defaults) and request_defaults.takes_defaults(
            request_defaults.path_of(req.target))

    def _routed(self, fwd: Outgoing, rec: Record, route: Route) -> bool:
        """A request the table sent to `route`: its limiter, then its gate, then upstream."""
        rec.route = route.name
        if rec.tally is not None:
            rec.tally.routed(route.name, rec.model)
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
                return self._forward(fwd, rec, route)
            finally:
                if lim is not None:
                    lim.release()
        finally:
            route.touch()

    def _local_reply(self, rec: Record, reply: LocalReply) -> None:
        if reply.status >= 400:
            err = reply.body.get("error") if isinstance(reply.body, dict) else None
            msg = err.get("message", "") if isinstance(err, dict) else ""
            self.counts.count_refused(reply.counter, detail=msg)
        rec.status = reply.status
        rec.outcome = "ok" if reply.status < 400 else "error"
        rec.ended = "ok" if reply.status < 400 else "refused"
        self._send_json(rec, reply.status, json.dumps(reply.body).encode(), [])

    def _send_json(self, rec: Record, status: int, body: bytes,
                   extra: list[tuple[bytes, bytes]]) -> None:
        """A whole JSON response the router writes itself; the request's record ends here."""
        close = any(k == b"Connection" for k, _ in extra)
        if not close and (not self.keep or self.h.their_state is not h11.DONE):
            extra = [*extra, (b"Connection", b"close")]
        try:
            out = json_response(status, body, extra, with_body=rec.method != "HEAD",
                                origin=self.origin)
            self._send_client(out)
            rec.bytes_out += len(out)
        finally:
            self.counts.finish_request(rec)

    def _read_body(self, deadline: float, limit: int, held: _Held) -> tuple[bytes, bool]:
        """(body, True) when the body ends within ``limit`` bytes; else (what was read, a
        little over ``limit``, False): the rest is still the client's to send. Every byte kept
        is charged to the process-wide budget (``_OverBudget`` past it)."""
        parts: list[bytes] = []
        size = 0
        if self.h.client_is_waiting_for_100_continue:
            self._send_client(b"HTTP/1.1 100 Continue\r\n\r\n")
        while size <= limit:
            ev = self._next_client_event(deadline)
            if isinstance(ev, h11.Data):
                held.take(len(ev.data))
                size += len(ev.data)
                parts.append(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                return b"".join(parts), True
            elif isinstance(ev, h11.ConnectionClosed):
                raise ClientGone("client closed mid-request")
        return b"".join(parts), False

    def _drain_body(self, deadline: float, limit: int) -> bool:
        """Read the request's body and drop it; True when it ended within ``limit`` bytes."""
        size = 0
        if self.h.their_state is h11.DONE:
            return True
        if self.h.client_is_waiting_for_100_continue:
            self._send_client(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            while size <= limit:
                ev = self._next_client_event(deadline)
                if isinstance(ev, h11.Data):
                    size += len(ev.data)
                elif isinstance(ev, h11.EndOfMessage):
                    return True
                else:
                    return False
        except (TimeoutError, h11.RemoteProtocolError, ClientGone):
            return False
        return False

    def _linger(self) -> None:
        """After a reply that closes the connection early: half-close and read what the client
        still sends for a moment, so the close is not a reset that destroys the reply."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + _LINGER_S
            drained = 0
            while drained < _LINGER_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._set_timeout(left)
                data = self.sock.recv(RECV)
                if not data:
                    break
                drained += len(data)
        except OSError:
            pass

    def _bad_request(self, status: int, message: str, rec: Record | None = None,
                     answer: bytes = LLAMA_BAD_REQUEST) -> None:
        """A request llama-server would refuse as malformed (router/head.py): answered with
        the bytes llama-server answers it with (its bare 400) and closed, or, status 0,
        closed without a word as llama-server closes it. `rec`: its record, when it has one."""
        self.conn.note(f"bad request: {message}")
        if rec is not None:
            rec.status, rec.outcome, rec.ended, rec.reason = status, "error", "refused", message
            self.counts.finish_request(rec)
        self.counts.count_refused("bad_request", message)
        if status == 0:
            return
        try:
            self._send_client(answer)
        except ClientGone:
            return
        self._linger()

    def _reply_error(self, rec: Record, status: int, message: str, kind: str,
                     retry_after: int | None = None, close: bool = False,
                     outcome: str = "error") -> None:
        extra: list[tuple[bytes, bytes]] = []
        if retry_after is not None:
            extra.append((b"Retry-After", str(retry_after).encode()))
        if close:
            extra.append((b"Connection", b"close"))
        rec.status, rec.outcome, rec.reason = status, outcome, message
        if outcome != "cut":
            rec.ended = "refused"  # the router answered it instead of llama-server
        self._send_json(rec, status, error_body(status, message, kind), extra)

    def _refuse(self, rec: Record, refusal: Refusal, close: bool = False,
                kind: str = "unavailable_error") -> None:
        self.counts.count_refused(refusal.counter, detail=refusal.message)
        self._reply_error(rec, refusal.status, f"hydra router: {refusal.message}",
                          kind, retry_after=refusal.retry_after, close=close,
                          outcome=refusal.outcome)

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
            if rec.tally is not None:
                rec.tally.upstream()
            try:
                return self._exchange(gate, flight, target, fwd, rec)
            except _NotStarted as e:
                why = e.message
                fresh_close = e.fresh_close
            finally:
                gate.end(flight)
            if (flight.cut is not None and flight.requeue and not self.client_eof
                    and not fwd.sent and requeued < _MAX_REQUEUE):
                # A planned change (switch, reload) cut it before any response byte: like
                # a crash's retry, it waits for the new layout instead of a 503.
                requeued += 1
                self.counts.count_retried()
                refusal = gate.wait_turn()
                if refusal is not None:
                    self._refuse(rec, refusal)
                    return True
                continue
            if flight.cut is not None and fwd.sent:
                self.counts.count_cut()
                self._reply_error(rec, 503, f"hydra router: request cut: {flight.cut}",
                                  "unavailable_error", retry_after=DEFAULT_RETRY_AFTER,
                                  close=True, outcome="cut")
                return False
            if flight.cut is not None:
                self.counts.count_cut()
                self._reply_error(rec, 503, f"hydra router: request cut: {flight.cut}",
                                  "unavailable_error", retry_after=DEFAULT_RETRY_AFTER,
                                  outcome="cut")
                return True
            if self.client_eof:
                raise ClientGone("client closed; the upstream closed without answering")
            if fwd.sent:
                # Part of a streamed body went up and is gone: it is never sent again.
                return self._upload_lost(rec, target, why)
            if (fresh_close and gate.held_reason is None and gate.refusal_now() is None
                    and self._upstream_listening(target)):
                # llama-server closed a new connection without a word while still serving: a
                # request it refuses on purpose. Sending it again would get the same; close
                # the client's connection as llama-server on its own port would have.
                self.conn.note(f"{why}; llama-server is up: its answer passed on as a close")
                rec.outcome, rec.reason = "error", why
                self.counts.count_refused("upstream_closed", why)
                self.counts.finish_request(rec)
                return False
            if retried:
                self._refuse(rec, Refusal(503, why, DEFAULT_RETRY_AFTER, "error",
                                          "upstream_down"))
                return True
            retried = True
            self.counts.count_retried()
            refusal = gate.wait_turn(delay=self.r.retry_wait)
            if refusal is not None:
                self._refuse(rec, refusal)
                return True

    def _upload_lost(self, rec: Record, target: Addr, why: str) -> bool:
        """The upstream went away while a streamed body was going up, without answering.
        llama-server still listening: it closed on purpose, and the client sees the close it
        would have seen; otherwise a 502 says why. Either way the connection closes."""
        self.keep = False
        if self._upstream_listening(target):
            self.conn.note(f"{why}; llama-server is up: its answer passed on as a close")
            rec.outcome, rec.reason = "error", why
            self.counts.count_refused("upstream_closed", why)
            self.counts.finish_request(rec)
            return False
        self.counts.count_cut()
        self._reply_error(rec, 502, f"hydra router: {why} (during the upload)", "server_error",
                          close=True, outcome="cut")
        return False

    def _upstream_listening(self, target: Addr) -> bool:
        """Whether the upstream still accepts connections (a process that died does not)."""
        time.sleep(_CLOSE_PROBE_DELAY_S)  # a dying process may hold its listener a moment
        return self.r.pool.listening(target)

    def _exchange(self, gate: Gate, flight: Flight, target: Addr, fwd: Outgoing,
                  rec: Record) -> bool:
        """One attempt. Raises _NotStarted when nothing came back (the caller may retry)."""
        for _ in range(2):  # a stale pooled connection is replaced once, at once
            try:
                sock, reused = self.r.pool.take(target, fresh=fwd.streamed)
            except OSError as e:
                raise _NotStarted(f"http upstream {target[0]}:{target[1]}: "
                                  f"{e.strerror or e}") from e
            if not gate.attach(flight, sock):
                sock.close()
                raise _NotStarted("cut")
            self.upstream_shut = False
            try:
                first = self._send_request(sock, fwd, rec)
                # The response's parser is made while the upstream works on the request,
                # not before the request goes up: off the first byte's path.
                up = fwd.parser()
                early = first is not None
                if first is None:
                    first = self._first_response_bytes(sock)
                flight.answered = True
            except _NotStarted as e:
                sock.close()
                if reused and flight.cut is None and not self.client_eof:
                    continue
                raise _NotStarted(e.message, not reused) from e
            except OSError as e:
                sock.close()
                if reused and flight.cut is None and not self.client_eof and not fwd.sent:
                    continue
                raise _NotStarted(f"http upstream {target[0]}:{target[1]}: "
                                  f"{e.strerror or e}") from e
            except BaseException:
                sock.close()
                raise
            if early:
                # llama-server answered before it read the whole request (a 401 from
                # --api-key, a 404): its answer goes to the client as sent, and the rest of
                # the body is never sent upstream. The client's rest is read and dropped, as
                # llama-server drains an unread body after such an answer, so the client
                # reads the answer (no reset); then the connection closes if the answer is
                # an error (llama-server closes after every one) or the body did not end.
                self.counts.count_event("early_answer")
            done = self._relay_response(flight, target, sock, up, first, rec, fwd.poolable
                                        and not early)
            if early and not self._drain_body(time.monotonic() + self.r.request_timeout,
                                              2 * self.r.max_body):
                self.keep = False
            return done
        raise _NotStarted(f"http upstream {target[0]}:{target[1]}: closed")

    def _send_request(self, sock: socket.socket, fwd: Outgoing, rec: Record) -> bytes | None:
        """Write the request upstream: ``fwd.wire`` and, for a streamed body, the rest as the
        client sends it. The upstream is watched all along: the response bytes it sends before
        the whole request is written (an early answer) are returned, and nothing more of the
        request is sent; None once all of it was written. A client that has shut its side is
        passed on at the end (the upstream connection half-closed: llama-server then answers
        or stops, as it does for that client directly). OSError when the upstream fails;
        _NotStarted when it closed without answering."""
        view = memoryview(fwd.wire)
        # A whole request usually fits the socket's buffer: one send, no poll.
        try:
            pos = sock.send(view, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            pos = 0
        ufd, cfd = sock.fileno(), self.sock.fileno()
        poller = select.poll()
        more = fwd.streamed  # the client's body has more to come
        deadline = time.monotonic() + self.r.request_timeout
        umask = 0
        watching_client = False
        if pos < len(view) or more:
            while True:
                if pos == len(view):
                    if not more:
                        break
                    piece, more = self._next_body_piece(fwd)
                    if piece:
                        fwd.sent += len(piece)  # taken from the client: never sent again
                        view, pos = memoryview(piece), 0
                        continue
                    if not more:
                        break
                m = select.POLLIN | (select.POLLOUT if pos < len(view) else 0)
                if m != umask:
                    poller.register(ufd, m)
                    umask = m
                want_client = pos == len(view)  # nothing to write: the client's next bytes
                if want_client != watching_client:
                    if want_client:
                        poller.register(cfd, select.POLLIN)
                    else:
                        poller.unregister(cfd)
                    watching_client = want_client
                # Waiting for the client's body has its deadline; waiting for llama-server to
                # take it has none (its HTTP threads may all be busy for minutes), as before
                # (a cut or a stop shuts the upstream socket, which ends the wait).
                wait_ms: float | None = None
                if watching_client:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ClientGone("client stopped sending its request body")
                    wait_ms = left * 1000
                for fd, ev in poller.poll(wait_ms):
                    if fd == ufd:
                        if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                            data = self._early_bytes(sock)
                            if data is not None:
                                return data
                        elif ev & select.POLLOUT:
                            try:
                                n = sock.send(view[pos:], socket.MSG_DONTWAIT)
                            except (BlockingIOError, InterruptedError):
                                continue
                            except OSError:
                                data = self._early_bytes(sock, quiet=True)
                                if data:
                                    return data
                                raise
                            pos += n
                    elif fd == cfd:
                        try:
                            data = self.sock.recv(RECV, socket.MSG_DONTWAIT)
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError as e:
                            raise ClientGone(f"client error: {e.strerror or e}") from e
                        self.conn.up += len(data)
                        if not data:
                            self.client_eof = True
                        self.h.receive_data(data)
        rec.bytes_in += fwd.sent
        if self.client_eof:
            self._client_shut(sock)
        return None

    def _next_body_piece(self, fwd: Outgoing) -> tuple[bytes, bool]:
        """(the next piece of a streamed body for the upstream, in its framing (b"": h11
        needs the client's next bytes), whether more follows)."""
        while True:
            ev = self.h.next_event()
            if ev is h11.NEED_DATA:
                if self.client_eof:
                    raise ClientGone("client closed mid-request")
                return b"", True
            if isinstance(ev, h11.Data):
                if ev.data:
                    return (head.chunk(ev.data) if fwd.chunked else ev.data), True
                continue
            if isinstance(ev, h11.EndOfMessage):
                return (head.last_chunk() if fwd.chunked else b""), False
            raise ClientGone("client closed mid-request")

    @staticmethod
    def _early_bytes(sock: socket.socket, quiet: bool = False) -> bytes | None:
        """What the upstream sent while the request was still going up (None: nothing yet).
        A close or reset without a byte raises _NotStarted (``quiet``: gives b"")."""
        try:
            data = sock.recv(RECV, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            if quiet:
                return b""
            raise _NotStarted(f"http upstream: {e.strerror or e}") from e
        if not data and not quiet:
            raise _NotStarted("http upstream closed before answering")
        return data

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
                        self._client_shut(sock)
                    continue
                data = sock.recv(RECV)
                if not data:
                    raise _NotStarted("http upstream closed before answering")
                return data

    def _can_continue(self) -> bool:
        """Whether the client's connection may carry another request after this response:
        kept alive, and not shut by the client unless requests it sent are still waiting."""
        return self.keep and (not self.client_eof or bool(self.h.trailing_data[0]))

    def _watcher(self, sock: socket.socket) -> select.poll:
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN)
        p.register(self.sock.fileno(), select.POLLIN)
        return p

    def _recv_watching(self, sock: socket.socket, watch: select.poll) -> bytes:
        """The upstream's next bytes (b"" at its close), watching the client meanwhile."""
        ufd, cfd = sock.fileno(), self.sock.fileno()
        while True:
            for fd, _ev in watch.poll():
                if fd == cfd:
                    try:
                        peek = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as e:
                        raise ClientGone(f"client error: {e.strerror or e}") from e
                    watch.unregister(cfd)  # a pipelined next request: read it later
                    if not peek:
                        self._client_shut(sock)
                    continue
                if fd == ufd:
                    try:
                        return sock.recv(RECV)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        return b""

    def _client_shut(self, sock: socket.socket) -> None:
        """The client shut its side: so is the upstream connection's (llama-server answers a
        short request, and stops a generation whose client went, as for its own client)."""
        self.client_eof = True
        self.upstream_shut = True
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _flush(self, out: list[bytes], rec: Record) -> None:
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self._send_client(data)
        rec.bytes_out += len(data)

    def _relay_response(self, flight: Flight, target: Addr, sock: socket.socket,
                        up: h11.Connection, data: bytes, rec: Record, poolable: bool) -> bool:
        """Forward one response: the head as the upstream wrote it (router/head.py), then the
        body in the upstream's framing, each piece as it arrives (an SSE stream token by
        token). The head and what came with it are written here; a body still coming is moved
        by the router's body pump (router/pump.py), and this thread waits for its end."""
        resp = _Framing()
        tally = rec.tally
        # What is parsed already goes out in one write: a token chunk that arrived with the
        # head, or with the terminal chunk, leaves together with it.
        out: list[bytes] = []
        body: BodyFraming | None = None
        # The client is watched while the response comes: a client that shuts its side (or
        # goes) mid-response is passed on to llama-server at once, which stops generating
        # and frees its slot, as it does when its own client goes.
        watch = None if self.client_eof else self._watcher(sock)
        try:
            up.receive_data(data)
            while True:
                ev = up.next_event()
                if ev is h11.NEED_DATA:
                    if out:
                        self._flush(out, rec)
                    if watch is not None and not self.client_eof:
                        data = self._recv_watching(sock, watch)
                    else:
                        try:
                            data = sock.recv(RECV)
                        except OSError:
                            data = b""
                    up.receive_data(data)
                    continue
                if isinstance(ev, h11.Response):
                    rec.status = ev.status_code
                    resp.start(ev, rec.method == "HEAD")
                    if tally is not None:
                        tally.head(ev.status_code, resp.sse)
                    if resp.kind == "eof":
                        self.keep = False  # the body ends with the connection
                    elif ev.status_code >= 400 and b"close" in head.tokens(
                            ev.headers, b"connection"):
                        # llama-server closes every connection after an error answer; so
                        # does the client's (a close on a success is its leg's own, as
                        # when its keep-alive count runs out: that one stays per leg).
                        self.keep = False
                    out.append(head.response_head(ev.http_version, ev.status_code, ev.reason,
                                                  ev.headers.raw_items(),
                                                  close=not self._can_continue()))
                    if resp.kind != "none":
                        body = BodyFraming(resp.kind, resp.length)
                        break
                elif isinstance(ev, h11.InformationalResponse):
                    if ev.status_code != 101:
                        out.append(head.informational_head(
                            ev.http_version, ev.status_code, ev.reason, ev.headers.raw_items()))
                elif isinstance(ev, h11.EndOfMessage):  # a body-less answer (HEAD, 204, 304)
                    if resp.chunked_tail:
                        out.append(self._chunked_tail(sock, up))
                        poolable = False
                    self._flush(out, rec)
                    break
                elif isinstance(ev, h11.ConnectionClosed):
                    raise h11.RemoteProtocolError("upstream closed mid-response")
            if body is not None:
                # A stream's head goes to the client before the events that came with it are
                # read and counted: its first byte waits for nothing else (llama-server
                # writes its head on its own too). A body of known length goes with its head
                # in one write: the client waits for all of it anyway.
                if out and body.kind != "length":
                    self._flush(out, rec)
                # The body, read by the framing here and not by h11 (it costs a fraction).
                rest, closed = up.trailing_data
                if rest and (piece := take(body, bytes(rest), tally)):
                    out.append(piece)
                if not body.done and closed:
                    if body.kind != "eof":
                        raise h11.RemoteProtocolError("upstream closed mid-response")
                    body.done = True
                if out:
                    self._flush(out, rec)
                if not body.done:
                    self._pump_body(sock, body, rec)
                poolable = poolable and not body.extra and body.kind != "eof"
        except (h11.RemoteProtocolError, FramingError) as e:
            sock.close()
            if self.upstream_shut and flight.cut is None:
                # The client shut its side and llama-server, told so, stopped mid-response:
                # what it sent goes to the client as it is, with nothing added (its own
                # client would see the same), and the connection closes.
                self.keep = False
                rec.outcome, rec.ended, rec.reason = "error", "client_gone", str(e)
                try:
                    if out:
                        self._flush(out, rec)
                finally:
                    self.counts.finish_request(rec)
                return False
            return self._cut(flight, resp, out, rec, str(e))
        except BaseException:
            sock.close()
            raise
        if (poolable and not self.client_eof and flight.cut is None
                and up.our_state is h11.DONE):
            self.r.pool.give(target, sock)
        else:
            sock.close()
        self.counts.finish_request(rec)
        return True

    def _pump_body(self, sock: socket.socket, body: BodyFraming, rec: Record) -> None:
        """The rest of the body, moved by the router's pump while this thread waits.
        Raises ClientGone (the client went or stopped reading) or RemoteProtocolError (the
        upstream closed or was cut first)."""
        conn = self.conn

        def sent(n: int) -> None:
            conn.down += n
            conn.last = time.monotonic()

        job = BodyJob(sock, self.sock, body, rec.tally, watch=not self.client_eof,
                      send_timeout=self.r.idle_timeout, on_sent=sent)
        self._set_timeout(0.0)
        sock.setblocking(False)
        try:
            # A stream goes to the pump; a body of known length moves here (router/pump.py).
            self.r.pump.run(job, here=body.kind == "length")
        finally:
            sock.setblocking(True)
            rec.bytes_out += job.sent
        if job.client_shut:
            self.client_eof = True
            self.upstream_shut = True
        if job.result == CLIENT_GONE:
            raise ClientGone(job.why)
        if job.result != OK:
            raise h11.RemoteProtocolError(job.why or job.result)

    def _cut(self, flight: Flight, resp: _Framing, out: list[bytes], rec: Record,
             why: str) -> bool:
        """The upstream went away mid-response (a crash, or cut_inflight). The client is told:
        before the head, a 502; in a chunked body (every SSE stream), an SSE error event and
        the last chunk, so the connection stays usable; otherwise the close says it."""
        reason = flight.cut or f"upstream closed mid-response ({why})"
        self.counts.count_cut()
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
        self.counts.finish_request(rec)
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

    __slots__ = ("kind", "sse", "started", "chunked_tail", "length")

    def __init__(self) -> None:
        self.kind = ""  # "chunked" | "length" | "eof" | "none"
        self.sse = False
        self.started = False
        self.chunked_tail = False
        self.length = 0  # the Content-Length of a "length" body (h11 checked it)

    def start(self, ev: h11.Response, head_request: bool) -> None:
        self.started = True
        te = cl = False
        for k, v in ev.headers:
            if k == b"transfer-encoding":
                te = True
            elif k == b"content-length":
                cl = True
                self.length = int(v)
            elif k == b"content-type" and v.startswith(b"text/event-stream"):
                self.sse = True
        if head_request or ev.status_code in (204, 304):
            self.kind = "none"
            self.chunked_tail = te and ev.status_code in (204, 304)
        else:
            self.kind = "chunked" if te else "length" if cl else "eof"


class _OverBudget(Exception):
    """Keeping this body would pass the process-wide budget of request bytes held."""


class _Held:
    """The bytes of one request's body charged to the process-wide budget (router/budget.py),
    given back when the request ends."""

    __slots__ = ("budget", "n")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.n = 0

    def take(self, n: int) -> None:
        if not self.budget.take(n):
            raise _OverBudget(f"request bodies held in memory would pass the router's budget "
                              f"({self.budget.limit >> 20} MiB, all requests together)")
        self.n += n

    def release(self) -> None:
        if self.n:
            self.budget.give(self.n)
            self.n = 0
