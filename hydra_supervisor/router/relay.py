"""The router's sockets: listen on an engine's external port, admit, classify, relay.

This module owns everything between the external listener and the engine's internal endpoints:

- one *acceptor* thread (a ``selectors`` loop) accepts, reads each new connection's first bytes
  without blocking, enforces the first-byte timeout, the allow list and the bounded queues;
- each admitted HTTP connection gets one pooled worker thread running an ``HttpSession``
  (router/http.py: request-aware, h11), so the engine can hold, count, drain and cut requests;
- each admitted ggml-RPC or Hydra connection gets two pooled workers with blocking sockets, one
  per direction, moving bytes with ``os.splice`` (a kernel pipe, no copy through Python) or, as a
  fallback, ``recv_into``/``sendall``. ggml-RPC is the per-token path: it stays a byte splice.

Why threads with blocking sockets and not asyncio: the ggml-RPC path is per-token, so the relay's
wake-up latency and CPU are paid on every decoded token. Measured (bench/router.py), a blocked
``recv``/``splice`` that the kernel wakes directly beats an event loop's epoll → callback →
write path in added latency and CPU; docs/router.md has the numbers. The threads release the GIL
while blocked, so the router lives happily inside the supervisor's asyncio process.

Invariants: a relaying connection is never dropped to admit another (new ones wait in a bounded
queue; silent ones are evicted first); admission is sized from the descriptors the process
really has, so an admitted relay does not die of EMFILE; every wait has a deadline except a relay
that is actually open (an HTTP request in flight, a ggml-RPC link a head holds), which ends on
EOF, error, ``cut_inflight`` or ``stop()``.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hydra_supervisor.plan.ports import self_connected
from hydra_supervisor.router import limits
from hydra_supervisor.router.classify import MAX_PREFIX, Kind, classify
from hydra_supervisor.router.conn import (
    Addr,
    Conn,
    Handoff,
    Pending,
    Upstreams,
    allow_mismatch,
    fmt_addr,
    parse_allow,
    set_keepalive,
    set_nodelay,
    source_ip,
)
from hydra_supervisor.router.gate import DEFAULT_RETRY_AFTER, Gate
from hydra_supervisor.router.http import HttpSession, Record, UpstreamPool, http_error_response
from hydra_supervisor.router.routes import Limiter, Route, RouteTable

log = logging.getLogger("hydra.router")


# Relay copy buffer (copy pump) and kernel pipe size (splice pump). Large enough that a bulk
# transfer is not syscall-bound; small messages (ggml-RPC commands) are unaffected by either.
COPY_BUFFER = 256 * 1024
PIPE_SIZE = 1024 * 1024

FIRST_READ = 64 * 1024
_CONNECT_TIMEOUT = 3.0
_QUEUE_TIMEOUT = 30.0
# After a 503 we half-close and read what the client still sends, so that closing with unread
# data does not turn into a RST that destroys the 503 before the client reads it.
_LINGER_DRAIN_S = 1.0
_LINGER_DRAIN_BYTES = 1 << 20
_ACCEPT_BATCH = 64
_EMFILE_BACKOFF_S = 0.1
_STOP_JOIN_S = 5.0
_TICK_S = 1.0
# Relay threads are pooled: starting a thread costs ~50-80 us of the new-connection latency, a
# hand-off to an idle one ~10 us. Idle workers beyond the cap, or idle too long, exit.
_MAX_IDLE_WORKERS = 64
_WORKER_IDLE_S = 30.0
# Descriptors per admitted relay: client + upstream; a spliced relay adds two pipes (4 fds).
_FDS_HTTP = 2
_FDS_SPLICE = 6
_LOG_EVERY_S = 10.0
# An idle keep-alive connection is closed for room only after this long idle: a client that is
# about to send its next request has usually sent it by then.
_IDLE_CLOSE_MIN_S = 0.05
_EMFILE = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# The acceptor restarts its loop after a failure; this many failures within the window end it.
_ACCEPTOR_MAX_FAILS = 5
_ACCEPTOR_FAIL_WINDOW_S = 10.0

PUMPS = ("splice", "copy")
HTTP_MODES = ("aware", "raw")


def _unwatch(sel: selectors.BaseSelector, conn: Conn) -> None:
    """Stop selecting on ``conn`` (already gone from the selector, or closed: nothing to do)."""
    try:
        sel.unregister(conn.client)
    except (KeyError, ValueError, OSError):
        pass


class _Queues:
    """What the acceptor holds between its runs: silent connections (``pending``), classified
    ones waiting for a relay slot (``waiting``), and refused ones lingering until the client's
    EOF (``lingering``); each in deadline order because each has one fixed timeout."""

    def __init__(self) -> None:
        self.pending = Pending()
        self.waiting: collections.deque[Conn] = collections.deque()
        self.lingering: collections.deque[Conn] = collections.deque()
        self.linger_ids: set[int] = set()

    def forget(self, conn: Conn) -> None:
        self.pending.remove(conn)
        if conn.id in self.linger_ids:
            self.linger_ids.discard(conn.id)
            try:
                self.lingering.remove(conn)
            except ValueError:
                pass

    def everyone(self) -> list[Conn]:
        return [*self.pending.all.values(), *self.waiting, *self.lingering]

    def reregister(self, sel: selectors.BaseSelector) -> list[Conn]:
        """Register the silent and lingering connections with a new selector; returns (and
        forgets) those whose socket cannot be registered any more."""
        lost = []
        for conn in [*self.pending.all.values(), *self.lingering]:
            try:
                sel.register(conn.client, selectors.EVENT_READ, conn)
            except (KeyError, ValueError, OSError):
                self.forget(conn)
                lost.append(conn)
        return lost


class Router:
    """First-byte router for one engine's external port. Runs its own threads; ``start`` and
    ``stop`` are blocking but bounded, so an asyncio supervisor calls them directly (they take
    milliseconds) or through ``asyncio.to_thread``. Every other public method is thread-safe and
    returns at once, except ``wait_idle`` (bounded by its timeout)."""

    def __init__(
        self,
        bind_host: str,
        port: int,
        upstreams: Upstreams,
        *,
        allow: Sequence[str] = ("127.0.0.0/8", "::1/128"),
        first_byte_timeout: float = 10.0,
        idle_timeout: float | None = 300.0,
        rpc_idle_timeout: float | None = None,
        max_active: int | None = None,
        max_pending: int = 1024,
        max_pending_per_source: int | None = None,
        evict_after: float = 1.0,
        max_waiting: int = 256,
        name: str = "engine",
        queue_timeout: float = _QUEUE_TIMEOUT,
        connect_timeout: float = _CONNECT_TIMEOUT,
        pump: str = "splice",
        http: str = "aware",
        hold_timeout: float = 120.0,
        max_held: int = 1024,
        on_request: Callable[[dict[str, Any]], None] | None = None,
        retry_wait: float = 1.0,
        max_body: int = 64 << 20,
        request_timeout: float = 120.0,
        thread_factory: Callable[..., threading.Thread] = threading.Thread,
    ) -> None:
        if max_active is not None and max_active < 1:
            raise ValueError("max_active must be at least 1 (or None: sized from the fd limit)")
        if max_pending < 1 or max_waiting < 1 or (
                max_pending_per_source is not None and max_pending_per_source < 1):
            raise ValueError("max_pending, max_pending_per_source and max_waiting must be >= 1")
        if evict_after < 0:
            raise ValueError("evict_after must be >= 0")
        if first_byte_timeout <= 0 or queue_timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if request_timeout <= 0 or retry_wait < 0 or max_body < 0:
            raise ValueError("request_timeout must be positive, retry_wait and max_body >= 0")
        for label, t in (("idle_timeout", idle_timeout), ("rpc_idle_timeout", rpc_idle_timeout)):
            if t is not None and t <= 0:
                raise ValueError(f"{label} must be positive or None")
        if pump not in PUMPS:
            raise ValueError(f"pump must be one of {PUMPS}, not {pump!r}")
        if http not in HTTP_MODES:
            raise ValueError(f"http must be one of {HTTP_MODES}, not {http!r}")
        if pump == "splice" and not hasattr(os, "splice"):
            pump = "copy"  # os.splice is Linux-only
        self.bind_host = bind_host
        self.name = name
        self._req_port = port
        self._upstreams = upstreams
        self._allow = parse_allow(allow)
        self._first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self._rpc_idle_timeout = rpc_idle_timeout
        self._max_active = max_active
        self._max_pending = max_pending
        self._pending_cap = max_pending  # sized from the open-file limit at start()
        self._max_per_source = (max_pending if max_pending_per_source is None
                                else min(max_pending_per_source, max_pending))
        self._evict_after = evict_after
        self._max_waiting = max_waiting
        self._queue_timeout = queue_timeout
        self._connect_timeout = connect_timeout
        self._pump_kind = pump
        self._http_mode = http
        self._on_request = on_request
        self.retry_wait = retry_wait
        self.max_body = max_body
        self.request_timeout = request_timeout
        self._thread_factory = thread_factory
        self.request_defaults: dict[str, Any] = {}
        self.gate = Gate(hold_timeout, max_held)
        self.hold_timeout = hold_timeout
        self._max_held = max_held
        # Routing by model (router/routes.py): None sends every HTTP request to `upstreams.http`
        # through `gate`; a table picks a Route (its own gate and upstream) per request.
        self.table: RouteTable | None = None
        # Whether the table picks by the request's `model` (the body is read for it); a port
        # with one lane routes every request to it without reading bodies.
        self.route_by_model = True
        self._routes: list[Route] = []
        self.pool = UpstreamPool(self._connect)

        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._bound_port: int | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._stopping = False
        self._active: dict[int, Conn] = {}
        self._threads: set[threading.Thread] = set()
        self._tasks: queue.SimpleQueue[tuple[Any, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._idle_workers = 0
        self._n_pending = 0
        self._fds_active = 0
        self._open_peak = 0
        self._fd_budget = 0
        self._nofile = (0, 0)
        self._c = {"accepted": 0, "bytes_up": 0, "bytes_down": 0}
        self._refused: collections.Counter[str] = collections.Counter()
        self._events: collections.Counter[str] = collections.Counter()
        self._http = {"requests": 0, "1xx": 0, "2xx": 0, "3xx": 0, "4xx": 0, "5xx": 0,
                      "cut": 0, "retried": 0}
        self._by_kind = {k.value: 0 for k in (Kind.RPC, Kind.HYDRA, Kind.HTTP)}
        self._log_marks: dict[str, tuple[float, int]] = {}
        # Why the acceptor gave up (after repeated failures), until the next start().
        self.acceptor_error: str | None = None

    # ---------------------------------------------------------------- public API

    def start(self) -> None:
        """Bind and start the acceptor. A stopped router may be started again."""
        if self._listener is not None:
            raise RuntimeError("router already started")
        self._nofile = limits.raise_nofile()
        infos = socket.getaddrinfo(
            self.bind_host or None,
            self._req_port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )
        family, _, _, _, sockaddr = infos[0]
        dual = family == socket.AF_INET6 and self.bind_host in ("::", "")
        # Backlog: the kernel holds connections we have not accepted yet (also while the
        # acceptor pauses because the waiting queue is full); the kernel caps it at somaxconn.
        listener = socket.create_server(
            sockaddr[:2], family=family, backlog=max(1024, self._max_pending), dualstack_ipv6=dual
        )
        listener.setblocking(False)
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        # The silent queue holds descriptors too: under a low open-file limit it gets at most
        # an eighth of them, so that admitted relays keep the rest (1024 -> 128).
        soft = self._nofile[0] if self._nofile[0] > 0 else 1024
        self._pending_cap = max(16, min(self._max_pending, soft // 8))
        reserved = self._pending_cap + self._max_waiting + 16 + 3  # queues, pool, own sockets
        with self._lock:
            self._stopping = False
            self.acceptor_error = None
            self._tasks = queue.SimpleQueue()
            self._idle_workers = 0
            self._fd_budget = limits.fd_budget(reserved)
        self.gate.restart()
        for route in self._routes:
            route.gate.restart()
        self._listener, self._wake_r, self._wake_w = listener, wake_r, wake_w
        self._bound_port = int(listener.getsockname()[1])
        self._req_port = self._bound_port  # port 0: a restart keeps the port it got
        acceptor = self._thread_factory(
            target=self._accept_loop, name=f"router-{self.name}-accept", daemon=True
        )
        try:
            acceptor.start()
        except RuntimeError:
            for s in (listener, wake_r, wake_w):
                s.close()
            self._listener = None
            raise
        self._acceptor = acceptor
        per = _FDS_HTTP
        log.info(
            "router %s listening on %s (nofile %d/%d: room for ~%d HTTP connections)",
            self.name, fmt_addr(listener.getsockname()), self._nofile[0], self._nofile[1],
            self._fd_budget // per,
        )
        why = allow_mismatch(self.bind_host, [str(n) for n in self._allow])
        if why:
            log.warning("router %s: %s; no ggml-RPC or Hydra wire client can ever be let in",
                        self.name, why)
        if self._fd_budget // per < 64:
            log.warning("router %s: the open-file limit leaves room for only %d connections; "
                        "raise the hard limit (LimitNOFILE= in systemd)", self.name,
                        self._fd_budget // per)

    @property
    def port(self) -> int:
        """The bound port (also after stop(); a restart binds it again)."""
        if self._bound_port is None:
            raise RuntimeError("router not started")
        return self._bound_port

    @property
    def upstreams(self) -> Upstreams:
        return self._upstreams

    def set_upstreams(self, u: Upstreams) -> None:
        """New connections and new HTTP requests use ``u``; open byte relays keep theirs."""
        self._upstreams = u

    def hold(self, reason: str) -> None:
        """Park new HTTP requests (read whole, not sent) until release(); bounded per request
        by hold_timeout and in number by max_held (then 503 with Retry-After)."""
        self.gate.hold(reason)
        log.info("router %s: holding new requests (%s)", self.name, reason)

    def release(self) -> None:
        """Send parked requests upstream (to the current upstreams)."""
        held = self.gate.held()
        self.gate.release()
        log.info("router %s: released (%d requests were held)", self.name, held)

    def set_unavailable(self, reason: str | None, retry_after: int = DEFAULT_RETRY_AFTER) -> None:
        """New (and parked) HTTP requests get 503 ``reason`` with Retry-After; None clears."""
        self.gate.set_unavailable(reason, retry_after)
        log.info("router %s: %s", self.name,
                 f"unavailable: {reason}" if reason is not None else "available")

    def inflight(self) -> int:
        """HTTP requests sent upstream whose response has not completed."""
        return self.gate.inflight()

    def wait_idle(self, timeout: float) -> int:
        """Block until no HTTP request is in flight or ``timeout``; returns how many still are."""
        return self.gate.wait_idle(timeout)

    def cut_inflight(self, reason: str, requeue: bool = False) -> int:
        """Abort in-flight HTTP requests (streams end with an SSE error event); how many.
        `requeue`: those without a response byte are sent again instead (gate.py)."""
        n = self.gate.cut_inflight(reason, requeue)
        if n:
            log.info("router %s: cut %d in-flight requests (%s)", self.name, n, reason)
        return n

    def new_route(self, name: str, limit: int | None = None, queue: int = 0) -> Route:
        """A lane of its own (gate, upstream, limiter) for a table to hand out; stopped and
        started with the router."""
        route = Route(name, Gate(self.hold_timeout, self._max_held),
                      limiter=Limiter(name, limit, queue) if limit else None)
        with self._lock:
            self._routes.append(route)
            if self._stopping:
                route.gate.stop()
        return route

    def set_request_defaults(self, d: dict[str, Any]) -> None:
        """T1 defaults added to completion request bodies that lack them (router/defaults.py)."""
        self.request_defaults = dict(d)

    def alive(self) -> bool:
        a = self._acceptor
        return a is not None and a.is_alive() and not self._stopping

    def stop(self, timeout: float = _STOP_JOIN_S) -> None:
        """Close the listener, every waiting connection and every relay; bounded by ``timeout``.
        The router can be started again afterwards."""
        with self._lock:
            if self._listener is None or self._stopping:
                return
            self._stopping = True
            # Under the lock: _finish closes sockets under it, so no fd is reused under us.
            for conn in self._active.values():
                conn.note("router stopped")
                conn.shutdown_all()
        self.gate.stop()
        for route in self._routes:
            route.gate.stop()
        self._wake()
        deadline = time.monotonic() + timeout
        if self._acceptor is not None:
            self._acceptor.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for _ in range(self._idle_workers):
                self._tasks.put(None)  # idle workers exit on this
            self._idle_workers = 0
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.pool.close()
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        self._listener = self._wake_r = self._wake_w = None
        self._acceptor = None
        log.info("router %s stopped", self.name)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            live_up = sum(c.up for c in self._active.values())
            live_down = sum(c.down for c in self._active.values())
            out: dict[str, Any] = dict(self._c)
            out["refused"] = dict(self._refused)
            out["events"] = dict(self._events)
            out["open"] = len(self._active)
            out["open_peak"] = self._open_peak
            out["pending"] = self._n_pending
            out["bytes_up"] += live_up
            out["bytes_down"] += live_down
            out["bytes"] = out["bytes_up"] + out["bytes_down"]
            out["by_kind"] = dict(self._by_kind)
            out["http"] = dict(self._http)
            out["fds"] = {"nofile": self._nofile[0], "budget": self._fd_budget,
                          "relays": self._fds_active}
        out["held"] = self.gate.held()
        out["inflight"] = self.gate.inflight()
        out["pooled"] = self.pool.idle()
        out["alive"] = self.alive()
        out["acceptor_error"] = self.acceptor_error
        return out

    # ---------------------------------------------------------------- for sessions

    def count_refused(self, reason: str, detail: str = "", log_it: bool = True) -> None:
        """Count a refused connection or request under ``reason`` (stats "refused")."""
        self._count(self._refused, reason, detail, log_it)

    def count_event(self, reason: str, detail: str = "") -> None:
        """Count something survived, not refused (stats "events"): EMFILE waited out, a
        small pipe, a kernel accept failure."""
        self._count(self._events, reason, detail, True)

    def _count(
        self, table: collections.Counter[str], reason: str, detail: str, log_it: bool
    ) -> None:
        # At most one INFO line per reason per _LOG_EVERY_S, saying how many were not logged.
        now = time.monotonic()
        with self._lock:
            table[reason] += 1
            if not log_it:
                return
            last, since = self._log_marks.get(reason, (-1e9, 0))
            if now - last < _LOG_EVERY_S:
                self._log_marks[reason] = (last, since + 1)
                return
            self._log_marks[reason] = (now, 0)
        more = f" (+{since} more since the last line)" if since else ""
        log.info("router %s %s: %s%s%s", self.name,
                 "refused" if table is self._refused else "note", reason,
                 f": {detail}" if detail else "", more)

    def count_cut(self) -> None:
        with self._lock:
            self._http["cut"] += 1

    def count_retried(self) -> None:
        with self._lock:
            self._http["retried"] += 1

    def finish_request(self, rec: Record) -> None:
        now = time.monotonic()
        with self._lock:
            self._http["requests"] += 1
            cls = f"{rec.status // 100}xx"
            if cls in self._http:
                self._http[cls] += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("router %s %s %s %d %.3fs in=%dB out=%dB %s%s", self.name, rec.method,
                      rec.path, rec.status, now - rec.started, rec.bytes_in, rec.bytes_out,
                      rec.outcome, f" ({rec.reason})" if rec.reason else "")
        cb = self._on_request
        if cb is not None:
            try:
                cb(rec.as_dict(now))
            except Exception:  # a callback's bug must not end the client's connection
                log.exception("router %s: on_request callback failed", self.name)

    # ---------------------------------------------------------------- acceptor

    def _wake(self) -> None:
        w = self._wake_w
        if w is None:
            return
        try:
            w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake is already queued, or we are shutting down

    def _is_allowed(self, peer: Any) -> bool:
        ip = source_ip(peer)
        if ip is None:
            return False
        return any(ip.version == net.version and ip in net for net in self._allow)

    def _accept_loop(self) -> None:
        """The acceptor thread. No exception ends it: one connection's failure is that
        connection's alone (logged, counted), and a failure of the loop itself restarts the
        loop at once with the same queues (counted as ``events["acceptor_restart"]``). Only
        failures in a row (``_ACCEPTOR_MAX_FAILS`` within ``_ACCEPTOR_FAIL_WINDOW_S``) end it:
        the listener is then closed, so clients are refused rather than left hanging in the
        backlog, and ``alive()`` turns False for the owner to see (hydra status, watchdog)."""
        listener, wake_r = self._listener, self._wake_r
        assert listener is not None and wake_r is not None
        q = _Queues()
        fails: collections.deque[float] = collections.deque()
        try:
            while not self._stopping:
                try:
                    self._accept_run(listener, wake_r, q)
                    return
                except Exception as e:
                    now = time.monotonic()
                    fails.append(now)
                    while fails and now - fails[0] > _ACCEPTOR_FAIL_WINDOW_S:
                        fails.popleft()
                    with self._lock:
                        self._events["acceptor_restart"] += 1
                    if len(fails) >= _ACCEPTOR_MAX_FAILS:
                        self.acceptor_error = f"{type(e).__name__}: {e}"
                        log.exception(
                            "router %s: acceptor failed %d times in %gs; giving up: the port "
                            "refuses connections until the router is restarted", self.name,
                            len(fails), _ACCEPTOR_FAIL_WINDOW_S)
                        return
                    log.exception("router %s: acceptor failed; restarted", self.name)
                    if len(fails) > 1:
                        time.sleep(0.01 * len(fails))  # not a busy loop on a repeating failure
        finally:
            for conn in q.everyone():
                self._drop(conn, "router stopped", None)
            with self._lock:
                self._n_pending = 0
            listener.close()

    def _accept_run(self, listener: socket.socket, wake_r: socket.socket, q: _Queues) -> None:
        """One run of the acceptor's select loop over the queues ``q`` (kept across runs)."""
        sel = selectors.DefaultSelector()
        try:
            sel.register(wake_r, selectors.EVENT_READ, "wake")
            for lost in q.reregister(sel):  # after a restart: connections whose socket died
                self._drop(lost, "lost in an acceptor restart", "acceptor_restart")
            listening = False
            paused_until = 0.0
            next_tick = time.monotonic() + _TICK_S
            while not self._stopping:
                now = time.monotonic()
                room_at = self._room_at(q.pending, now)
                want = (not paused_until and len(q.waiting) < self._max_waiting
                        and room_at <= now)
                if want != listening:
                    if want:
                        sel.register(listener, selectors.EVENT_READ, "listen")
                    else:
                        sel.unregister(listener)
                    listening = want
                marks = [next_tick]
                first = q.pending.first()
                if first is not None:
                    marks.append(first.deadline)
                if room_at > now:
                    marks.append(room_at)
                if q.waiting:
                    marks.append(q.waiting[0].deadline)
                if q.lingering:
                    marks.append(q.lingering[0].deadline)
                if paused_until:
                    marks.append(paused_until)
                timeout = max(0.0, min(marks) - now)
                for key, _ in sel.select(timeout):
                    if key.data == "listen":
                        if not self._accept_batch(sel, q):
                            paused_until = time.monotonic() + _EMFILE_BACKOFF_S
                    elif key.data == "wake":
                        try:
                            while wake_r.recv(4096):
                                pass
                        except (BlockingIOError, OSError):
                            pass
                    else:
                        assert isinstance(key.data, Conn)
                        self._on_readable(sel, q, key.data)
                now = time.monotonic()
                if paused_until and now >= paused_until:
                    paused_until = 0.0
                while (conn := q.pending.first()) is not None and conn.deadline <= now:
                    self._unpend(sel, q.pending, conn)
                    self._drop(conn, "first-byte timeout", "first_byte_timeout")
                while q.waiting and q.waiting[0].deadline <= now:
                    self._busy(q.waiting.popleft())
                while q.lingering and q.lingering[0].deadline <= now:
                    self._unlinger(sel, q, q.lingering[0])
                self._admit(q.waiting)
                if now >= next_tick:
                    next_tick = now + _TICK_S
                    self._tick(now)
                with self._lock:
                    self._n_pending = len(q.pending) + len(q.waiting)
        finally:
            sel.close()

    def _on_readable(self, sel: selectors.BaseSelector, q: _Queues, conn: Conn) -> None:
        """Bytes (or EOF) from a connection the acceptor still holds. A connection evicted
        earlier in the same select pass is not read again; a failure here is this
        connection's alone."""
        try:
            if conn.id in q.linger_ids:
                self._linger_read(sel, q, conn)
            elif conn.id in q.pending.all:
                self._read_prefix(sel, conn, q)
        except Exception as e:
            self._conn_failed(sel, q, conn, e)

    def _conn_failed(self, sel: selectors.BaseSelector, q: _Queues, conn: Conn,
                     e: BaseException) -> None:
        log.warning("router %s #%d %s: dropped after an error in the acceptor: %s: %s",
                    self.name, conn.id, fmt_addr(conn.peer), type(e).__name__, e,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        q.forget(conn)
        _unwatch(sel, conn)
        self._drop(conn, f"acceptor error: {type(e).__name__}: {e}", "conn_error")

    def _tick(self, now: float) -> None:
        keep = {self._upstreams.http, *(r.http for r in self._routes)}
        self.pool.reap(keep={k for k in keep if k is not None})
        self._reap_idle(now)

    def _unpend(self, sel: selectors.BaseSelector, pending: Pending, conn: Conn) -> None:
        pending.remove(conn)
        _unwatch(sel, conn)

    def _room_at(self, pending: Pending, now: float) -> float:
        """When a new connection can be taken: now while the silent queue has room or holds a
        connection silent past ``evict_after``; else when its oldest gets there (until then new
        connections wait in the kernel's backlog, which loses nothing)."""
        if len(pending) < self._pending_cap or not pending.by_src:
            return now
        return pending.oldest_of_largest().accepted + self._evict_after

    def _evict_silent(self, sel: selectors.BaseSelector, q: _Queues, victim: Conn,
                      why: str, counter: str) -> None:
        """Close a silent connection to make room: an HTTP client that was merely slow gets a
        503 with Retry-After (not a reset), then the connection lingers until EOF."""
        self._unpend(sel, q.pending, victim)
        victim.note(why)
        self.count_refused(counter, why)
        self._linger(sel, q, victim, http_error_response(
            503, "hydra router: too many connections waiting, try again",
            DEFAULT_RETRY_AFTER))

    def _accept_batch(self, sel: selectors.BaseSelector, q: _Queues) -> bool:
        """Accept what the kernel has queued. False when out of descriptors (caller backs off)."""
        listener = self._listener
        assert listener is not None
        for _ in range(_ACCEPT_BATCH):
            if len(q.waiting) >= self._max_waiting:
                return True  # the rest stay in the kernel's backlog until a slot frees
            now = time.monotonic()
            if len(q.pending) >= self._pending_cap:
                # Full of silent connections: evict the oldest of the address with the most of
                # them (a flood evicts its own), but only one silent past `evict_after`: a
                # client that connected a moment ago is about to speak.
                victim = q.pending.oldest_of_largest()
                if now - victim.accepted < self._evict_after:
                    return True  # wait in the backlog: _room_at says when to look again
                self._evict_silent(sel, q, victim, "evicted: silent while the queue was full",
                                   "silent_evicted")
            try:
                client, peer = listener.accept()
            except BlockingIOError:
                return True
            except OSError as e:
                # EMFILE/ENFILE/ENOBUFS: the listener stays readable; back off instead of spinning.
                self.count_event("accept_failed", f"{e.strerror or e}")
                return False
            conn = Conn(next(self._ids), client, peer, now)
            with self._lock:
                self._c["accepted"] += 1
            try:
                self._take(sel, q, conn, now)
            except Exception as e:
                self._conn_failed(sel, q, conn, e)
        return True

    def _take(self, sel: selectors.BaseSelector, q: _Queues, conn: Conn, now: float) -> None:
        if q.pending.from_source(conn.src) >= self._max_per_source:
            # An operator-set cap per address (off by default: one address may be a NAT or
            # a load balancer with thousands of clients behind it).
            victim = q.pending.oldest_of(conn.src)
            if now - victim.accepted >= self._evict_after:
                self._evict_silent(sel, q, victim,
                                   "evicted: too many silent connections from its address",
                                   "silent_source_limit")
            else:
                conn.note("too many silent connections from its address")
                self.count_refused("silent_source_limit", conn.src)
                conn.client.setblocking(False)
                self._linger(sel, q, conn, http_error_response(
                    503,
                    "hydra router: too many connections waiting from your address, try again",
                    DEFAULT_RETRY_AFTER))
                return
        conn.client.setblocking(False)
        set_nodelay(conn.client)
        set_keepalive(conn.client)
        conn.deadline = now + self._first_byte_timeout
        q.pending.add(conn)
        sel.register(conn.client, selectors.EVENT_READ, conn)
        # Clients usually send right after connecting: read now rather than after
        # another trip through select (saves tens of microseconds per connection).
        self._read_prefix(sel, conn, q)

    def _linger(self, sel: selectors.BaseSelector, q: _Queues, conn: Conn,
                reply: bytes) -> None:
        """Answer ``reply`` (best effort, non-blocking), half-close, and keep reading what the
        client still sends until its EOF or ``_LINGER_DRAIN_S``: closing with unread bytes
        would turn into a reset that destroys the reply before the client reads it."""
        try:
            conn.client.send(reply)
            conn.client.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(conn, conn.reason or "closed", None)
            return
        conn.deadline = time.monotonic() + _LINGER_DRAIN_S
        q.lingering.append(conn)
        q.linger_ids.add(conn.id)
        try:
            sel.register(conn.client, selectors.EVENT_READ, conn)
        except (KeyError, ValueError, OSError):
            pass

    def _linger_read(self, sel: selectors.BaseSelector, q: _Queues, conn: Conn) -> None:
        try:
            data = conn.client.recv(FIRST_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._unlinger(sel, q, conn)

    def _unlinger(self, sel: selectors.BaseSelector, q: _Queues, conn: Conn) -> None:
        q.forget(conn)
        _unwatch(sel, conn)
        self._drop(conn, conn.reason or "closed", None)

    def _read_prefix(self, sel: selectors.BaseSelector, conn: Conn, q: _Queues) -> None:
        try:
            # Classification needs MAX_PREFIX bytes at most, but taking whatever has arrived
            # (typically a whole HTTP request) lets the relay forward it in one write.
            data = conn.client.recv(FIRST_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            data = b""
            conn.note(f"client error before first bytes: {e.strerror or e}")
        if not data:
            self._unpend(sel, q.pending, conn)
            self._drop(conn, "client closed before first bytes", None)
            return
        conn.prefix += data
        kind = classify(conn.prefix[:MAX_PREFIX])
        if kind is Kind.NEED_MORE:
            return
        self._unpend(sel, q.pending, conn)
        if kind is Kind.REJECT:
            self._drop(conn, f"unrecognised first bytes {conn.prefix[:16].hex()}", "rejected")
            return
        conn.kind = kind
        # Checked only for these kinds: HTTP is open, and the check costs microseconds.
        if kind in (Kind.RPC, Kind.HYDRA) and not self._is_allowed(conn.peer):
            # ggml-rpc-server has no authentication: from a source outside the allow list it
            # must be unreachable, so close without a word.
            self._drop(conn, f"{kind.value} from a source not allow-listed", "denied")
            return
        conn.deadline = time.monotonic() + self._queue_timeout
        q.waiting.append(conn)

    def _fd_cost(self, kind: Kind) -> int:
        if kind is Kind.HTTP and self._http_mode == "aware":
            return _FDS_HTTP
        return _FDS_SPLICE if self._pump_kind == "splice" else _FDS_HTTP

    def _admit(self, waiting: collections.deque[Conn]) -> None:
        while waiting:
            conn = waiting[0]
            assert conn.kind is not None
            cost = self._fd_cost(conn.kind)
            with self._lock:
                if self._stopping:
                    return
                full = self._max_active is not None and len(self._active) >= self._max_active
                if full or (self._fds_active + cost > self._fd_budget and self._active):
                    # Wait for a relay to end rather than fail one with EMFILE; idle keep-alive
                    # connections (between requests) are closed to make room, as HTTP allows.
                    self._close_idle_locked(len(waiting))
                    return
                waiting.popleft()
                conn.cost = cost
                self._fds_active += cost
                self._active[conn.id] = conn
                self._open_peak = max(self._open_peak, len(self._active))
                self._by_kind[conn.kind.value] += 1
            if conn.kind is Kind.HTTP and self._http_mode == "aware":
                conn.session = True
                fn: Any = self._http_session
            else:
                fn = self._relay
            try:
                self._run(fn, conn, self._upstreams)
            except RuntimeError as e:  # Thread.start failed: out of threads or memory
                self._no_thread(conn, e)

    def _close_idle_locked(self, want: int) -> None:
        """Close up to ``want`` HTTP connections idle between requests, longest idle first.
        Not an active connection: an HTTP/1.1 server may close an idle keep-alive connection
        at any time, and clients reconnect (the openai client retries such a request)."""
        now = time.monotonic()
        idle = [c for c in self._active.values()
                if c.idle_since is not None and now - c.idle_since >= _IDLE_CLOSE_MIN_S]
        idle.sort(key=lambda c: c.idle_since or 0.0)
        for conn in idle[:want]:
            conn.idle_since = None
            conn.note("idle keep-alive closed to admit a waiting connection")
            self._events["idle_closed_for_room"] += 1
            try:
                conn.client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _no_thread(self, conn: Conn, e: BaseException) -> None:
        """A connection we could not give a thread: 503 (HTTP) and close; the router goes on."""
        with self._lock:
            self._active.pop(conn.id, None)
            self._fds_active -= conn.cost
            conn.cost = 0
        if conn.kind is Kind.HTTP:
            try:
                conn.client.send(http_error_response(
                    503, "hydra router: out of threads, try again",
                    DEFAULT_RETRY_AFTER))
            except OSError:
                pass
        self._drop(conn, f"no relay thread: {e}", "thread_start")

    # ---------------------------------------------------------------- worker pool

    def _run(self, fn: Any, *args: Any) -> None:
        """Run fn(*args) on an idle worker thread, or on a new one if none is idle.
        Raises RuntimeError when a new thread cannot be started."""
        with self._lock:
            if self._idle_workers > 0:
                # Reserve the idle worker under the lock, so a worker that times out now
                # sees the task in the queue and stays (see _worker).
                self._idle_workers -= 1
                self._tasks.put((fn, args))
                return
        t = limits.start_thread(
            self._thread_factory, target=self._worker, args=(fn, args, self._tasks),
            name=f"router-{self.name}", daemon=True,
        )
        with self._lock:
            if t.is_alive():
                self._threads.add(t)

    def _worker(self, fn: Any, args: tuple[Any, ...], tasks: queue.SimpleQueue[Any]) -> None:
        with self._lock:
            self._threads.add(threading.current_thread())
        try:
            while True:
                fn(*args)
                with self._lock:
                    if self._stopping or self._idle_workers >= _MAX_IDLE_WORKERS:
                        return
                    self._idle_workers += 1
                while True:
                    try:
                        item = tasks.get(timeout=_WORKER_IDLE_S)
                        break
                    except queue.Empty:
                        with self._lock:
                            if tasks.empty():  # nobody reserved us: retire
                                self._idle_workers -= 1
                                return
                if item is None:
                    return
                fn, args = item
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _busy(self, conn: Conn) -> None:
        """A classified connection waited longer than queue_timeout for a relay slot."""
        if conn.kind is Kind.HTTP:
            try:
                conn.client.send(
                    http_error_response(503, "hydra router: too busy",
                                        DEFAULT_RETRY_AFTER)
                )
            except OSError:
                pass  # best effort on a non-blocking socket; we close either way
        self._drop(conn, "waited too long for a relay slot", "queue_timeout")

    def _reap_idle(self, now: float) -> None:
        """Byte relays with no traffic past their idle timeout. HTTP sessions time their own
        idleness; ggml-RPC links have none by default (a head may be quiet for hours)."""
        with self._lock:
            for conn in self._active.values():
                if conn.session:
                    continue
                idle = self.idle_timeout if conn.kind is Kind.HTTP else self._rpc_idle_timeout
                if idle is not None and now - conn.last > idle:
                    conn.note(f"idle > {idle:g}s")
                    conn.shutdown_all()

    def _drop(self, conn: Conn, reason: str, counter: str | None) -> None:
        """Close a connection that never reached the relay; one debug line, like a relay."""
        conn.note(reason)
        if counter is not None:  # count before the close is visible to the client
            self.count_refused(counter, reason)
        try:
            conn.client.close()
        except OSError:
            pass
        self._log_close(conn)

    def _log_close(self, conn: Conn) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        kind = conn.kind.value if conn.kind is not None else "-"
        target = fmt_addr(conn.target) if conn.target else "-"
        log.debug(
            "router %s #%d %s %s->%s open %.3fs up=%dB down=%dB closed: %s",
            self.name,
            conn.id,
            fmt_addr(conn.peer),
            kind,
            target,
            time.monotonic() - conn.accepted,
            conn.up,
            conn.down,
            conn.reason or "done",
        )

    # ---------------------------------------------------------------- HTTP sessions

    def _http_session(self, conn: Conn, ups: Upstreams) -> None:
        conn.target = ups.http
        try:
            HttpSession(self, conn).run()
        except Exception:  # a bug in one session must not leak its sockets or kill the worker
            log.exception("router %s #%d: HTTP session failed", self.name, conn.id)
            conn.note("session error")
        finally:
            self._finish(conn)

    # ---------------------------------------------------------------- relay

    def _connect(self, target: Addr) -> socket.socket:
        """Connect to a local upstream. Out of descriptors is waited out (bounded by the
        connect timeout) rather than failing an admitted connection at once."""
        deadline = time.monotonic() + self._connect_timeout
        while True:
            try:
                return self._connect_once(target)
            except OSError as e:
                if e.errno not in _EMFILE or time.monotonic() >= deadline:
                    raise
                self.count_event("emfile_wait", f"{e.strerror or e}")
                time.sleep(0.05)

    def _connect_once(self, target: Addr) -> socket.socket:
        # Not socket.create_connection: its getaddrinfo costs tens of microseconds per
        # connection, and targets are numeric loopback addresses anyway.
        host = "127.0.0.1" if target[0] == "localhost" else target[0]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            set_nodelay(sock)
            sock.settimeout(self._connect_timeout)
            sock.connect((host, target[1]))
            sock.settimeout(None)
            if self_connected(sock):  # the upstream is down and we hold its port: let go
                raise ConnectionRefusedError(111, "upstream down (self-connect)")
        except OSError:
            sock.close()
            raise
        return sock

    def _relay(self, conn: Conn, ups: Upstreams) -> None:
        """Connect upstream, then pump upstream → client here and client → upstream on a
        second worker. This way round because the first read usually carried the whole
        request already, so the answer is on the critical path, not the rest of the upload."""
        handoff = ups.hydra_handoff if conn.kind is Kind.HYDRA else None
        if handoff is not None:
            self._hand_off(conn, handoff)
            return
        try:
            upstream = self._open_upstream(conn, ups)
        except BaseException:
            self._finish(conn)
            raise
        if upstream is None:
            self._finish(conn)
            return
        try:
            self._run(self._pump, conn, conn.client, upstream, True)
        except RuntimeError as e:  # "can't start new thread": out of threads or memory
            conn.note(f"no relay thread: {e}")
            self.count_refused("thread_start", str(e))
            conn.shutdown_all()
            with self._lock:
                conn.halves -= 1
        self._pump(conn, upstream, conn.client, False)

    def _hand_off(self, conn: Conn, to: Handoff) -> None:
        """Give the client socket itself to an in-process server (hydra's wire server), with
        the client's address and the bytes read so far: nothing is relayed, and the server
        authenticates the client, not the router. The connection then leaves the router."""
        sock: socket.socket | None = None
        try:
            with self._lock:  # not while stop() shuts this connection's socket down
                if not self._stopping:
                    c = conn.client
                    sock = socket.socket(c.family, c.type, c.proto, fileno=c.detach())
            if sock is None:
                conn.note("router stopped")
                return
            sock.settimeout(None)
            conn.up += len(conn.prefix)
            conn.note("handed to the wire server")
            try:
                to.adopt(sock, conn.peer, conn.prefix)
            except Exception as e:  # the server's failure is this connection's alone
                log.warning("router %s #%d: wire hand-off failed: %s: %s", self.name, conn.id,
                            type(e).__name__, e)
                conn.note(f"wire hand-off failed: {e}")
                self.count_refused("upstream_down", f"wire hand-off: {e}")
                sock.close()
        finally:
            self._finish(conn)  # the detached client socket is no longer the router's

    def _open_upstream(self, conn: Conn, ups: Upstreams) -> socket.socket | None:
        """Connect to the connection's upstream and forward the classified prefix.
        None when that failed; the client has then been answered (HTTP 503) or closed."""
        assert conn.kind is not None
        target = ups.for_kind(conn.kind)
        conn.target = target
        if target is None:
            self._upstream_down(conn, f"no {conn.kind.value} upstream configured")
            return None
        try:
            upstream = self._connect(target)
        except OSError as e:
            self._upstream_down(
                conn, f"{conn.kind.value} upstream {fmt_addr(target)}: {e.strerror or e}"
            )
            return None
        with self._lock:
            conn.upstream = upstream
            stopping = self._stopping
        if stopping:
            conn.note("router stopped")
            return None
        if conn.kind is Kind.RPC:  # a head that vanished must not hold the rpc-server
            set_keepalive(conn.client, rpc=True)
        conn.client.settimeout(None)
        conn.last = time.monotonic()
        try:
            upstream.sendall(conn.prefix)
        except OSError as e:
            conn.note(f"upstream send failed: {e.strerror or e}")
            return None
        conn.up += len(conn.prefix)
        return upstream

    def _pump(self, conn: Conn, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        """One direction until EOF or error; the last direction to end closes the connection,
        so a half-closed stream stays open for as long as its other direction flows."""
        try:
            pipe = self._pipe() if self._pump_kind == "splice" else None
            try:
                if pipe is not None:
                    eof = self._pump_splice(conn, src, dst, upward, pipe)
                else:
                    eof = self._pump_copy(conn, src, dst, upward)
            finally:
                if pipe is not None:
                    os.close(pipe[0])
                    os.close(pipe[1])
        except OSError as e:
            side = "client" if upward else "upstream"
            conn.note(f"{side} error: {e.strerror or e}")
            conn.shutdown_all()
        else:
            if eof:
                conn.note("client closed" if upward else "upstream closed")
                # Propagate the half-close: the other side sees EOF and may still answer.
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        finally:
            with self._lock:
                conn.halves -= 1
                last = conn.halves == 0
            if last:
                self._finish(conn)

    def _pipe(self) -> tuple[int, int, int] | None:
        """(read fd, write fd, capacity) for the splice pump, or None to use the copy pump:
        out of descriptors, or a pipe too small to be worth it (an unprivileged user past
        pipe-user-pages-soft gets one page). Never a reason to fail the relay."""
        try:
            r, w = os.pipe()
        except OSError as e:
            self.count_event("pipe_unavailable", f"{e.strerror or e}; copying instead")
            return None
        cap = limits.pipe_capacity(w, PIPE_SIZE)
        if cap < limits.MIN_PIPE:
            os.close(r)
            os.close(w)
            self.count_event("pipe_small", f"pipe of {cap} bytes; copying instead")
            return None
        return r, w, cap

    @staticmethod
    def _pump_copy(conn: Conn, src: socket.socket, dst: socket.socket, upward: bool) -> bool:
        buf = bytearray(COPY_BUFFER)
        view = memoryview(buf)
        recv_into, sendall, clock = src.recv_into, dst.sendall, time.monotonic
        while True:
            n = recv_into(buf)
            if not n:
                return True
            sendall(view[:n])
            if upward:
                conn.up += n
            else:
                conn.down += n
            conn.last = clock()

    @staticmethod
    def _pump_splice(
        conn: Conn, src: socket.socket, dst: socket.socket, upward: bool,
        pipe: tuple[int, int, int],
    ) -> bool:
        # socket → pipe → socket inside the kernel: no copy through Python and the GIL is
        # released for the whole wait.
        r, w, cap = pipe
        sfd, dfd = src.fileno(), dst.fileno()
        splice, clock = os.splice, time.monotonic
        while True:
            n = splice(sfd, w, cap)
            if not n:
                return True
            left = n
            while left:
                left -= splice(r, dfd, left)
            if upward:
                conn.up += n
            else:
                conn.down += n
            conn.last = clock()

    def _upstream_down(self, conn: Conn, reason: str) -> None:
        """Upstream missing or refusing: close the client now; HTTP gets a 503 with the reason."""
        conn.note(reason)
        self.count_refused("upstream_down", reason)
        if conn.kind is not Kind.HTTP:
            return
        client = conn.client
        try:
            client.settimeout(_LINGER_DRAIN_S)
            client.sendall(
                http_error_response(503, f"hydra router: {reason}",
                                    DEFAULT_RETRY_AFTER)
            )
            client.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + _LINGER_DRAIN_S
            drained = 0
            while drained < _LINGER_DRAIN_BYTES and time.monotonic() < deadline:
                client.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = client.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass  # the client went away first; nothing left to tell it

    def _finish(self, conn: Conn) -> None:
        with self._lock:
            for s in (conn.client, conn.upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
            if self._active.pop(conn.id, None) is not None:
                self._fds_active -= conn.cost
            self._c["bytes_up"] += conn.up
            self._c["bytes_down"] += conn.down
        self._log_close(conn)
        self._wake()
