"""The first-byte router of one external port: ``Router``, its public API and its counters.

``Router`` listens on an engine's external port, admits, classifies and relays; the owner
starts and stops it, points it at its byte upstreams (ggml-RPC, Hydra) and at a route table
(router/routes.py: every HTTP request goes to the Route it picks, whose gate holds, releases
and cuts it), and reads ``stats``. This module owns that API, the Router's configuration and
state, and the counting every part reports into; the work is done by its parts:

- router/acceptor.py: one *acceptor* thread (a ``selectors`` loop) accepts, reads each new
  connection's first bytes without blocking, enforces the first-byte timeout, the allow list
  and the bounded queues;
- each admitted HTTP connection gets one pooled worker thread running an ``HttpSession``
  (router/http.py: request-aware, h11), so the engine can hold, count, drain and cut requests;
- router/relay.py: each admitted ggml-RPC or Hydra connection gets two pooled workers with
  blocking sockets, one per direction, moving bytes with ``os.splice`` (a kernel pipe, no copy
  through Python) or, as a fallback, ``recv_into``/``sendall``. ggml-RPC is the per-token path:
  it stays a byte splice. relay.py also says why threads and not asyncio.

Invariants: a relaying connection is never dropped to admit another (new ones wait in a bounded
queue; silent ones are evicted first); admission is sized from the descriptors the process
really has, so an admitted relay does not die of EMFILE; every wait has a deadline except a relay
that is actually open (an HTTP request in flight, a ggml-RPC link a head holds), which ends on
EOF, error, a route's ``cut_inflight`` or ``stop()``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

from hydra_supervisor.router import limits
from hydra_supervisor.router.acceptor import Acceptor
from hydra_supervisor.router.classify import Kind
from hydra_supervisor.router.conn import (
    Conn,
    Upstreams,
    allow_mismatch,
    fmt_addr,
    parse_allow,
)
from hydra_supervisor.router.gate import HOLD_TIMEOUT_S, MAX_HELD, Gate
from hydra_supervisor.router.http import HttpSession
from hydra_supervisor.router.relay import Relay, Task
from hydra_supervisor.router.replies import JSONValue, Record, RequestRecord
from hydra_supervisor.router.routes import Addr, Limiter, Route, RouteTable
from hydra_supervisor.router.upstream import UpstreamPool

log = logging.getLogger("hydra.router")

_CONNECT_TIMEOUT = 3.0
_QUEUE_TIMEOUT = 30.0
_STOP_JOIN_S = 5.0
_LOG_EVERY_S = 10.0

PUMPS = ("splice", "copy")
HTTP_MODES = ("aware", "raw")


class FdCounts(TypedDict):
    nofile: int  # the soft open-file limit in force
    budget: int  # descriptors admission may use for relays
    relays: int  # descriptors the admitted connections hold now


class RouterStats(TypedDict):
    """``Router.counters()``: what the router counted since it was made (``stats()`` gives
    the same as a plain dict). ``refused`` and ``events`` by reason; ``http`` by class
    (``requests``, ``1xx``..``5xx``, ``cut``, ``retried``); ``by_kind`` by admitted kind."""

    accepted: int
    bytes_up: int
    bytes_down: int
    refused: dict[str, int]
    events: dict[str, int]
    open: int
    open_peak: int
    pending: int
    bytes: int
    by_kind: dict[str, int]
    http: dict[str, int]
    fds: FdCounts
    held: int
    inflight: int
    pooled: int
    alive: bool
    acceptor_error: str | None


class Router(Acceptor, Relay):
    """First-byte router for one engine's external port. Runs its own threads; ``start`` and
    ``stop`` are blocking but bounded, so an asyncio supervisor calls them directly (they take
    milliseconds) or through ``asyncio.to_thread``. Every other public method is thread-safe and
    returns at once. HTTP requests are held, drained and cut per Route (router/routes.py):
    the router itself has no gate."""

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
        hold_timeout: float = HOLD_TIMEOUT_S,
        max_held: int = MAX_HELD,
        table: RouteTable | None = None,
        on_request: Callable[[RequestRecord], None] | None = None,
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
        self.request_defaults: dict[str, JSONValue] = {}
        if hold_timeout <= 0 or max_held < 1:
            raise ValueError("hold_timeout must be positive and max_held at least 1")
        self.hold_timeout = hold_timeout
        self._max_held = max_held
        # Every HTTP request goes where the table says (router/routes.py): a Route (its own
        # gate, upstream and limiter: the only place requests are held, drained or cut) or a
        # LocalReply. The router has no gate of its own: until a table is set, HTTP requests
        # get 503.
        self.table: RouteTable | None = table
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
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
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
        per = limits.FDS_HTTP
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

    def set_request_defaults(self, d: Mapping[str, JSONValue]) -> None:
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
        """``counters()`` as a plain dict (the owner adds its own counts to it)."""
        return dict(self.counters())

    def counters(self) -> RouterStats:
        with self._lock:
            bytes_up = self._c["bytes_up"] + sum(c.up for c in self._active.values())
            bytes_down = self._c["bytes_down"] + sum(c.down for c in self._active.values())
            accepted = self._c["accepted"]
            refused = dict(self._refused)
            events = dict(self._events)
            n_open = len(self._active)
            open_peak = self._open_peak
            pending = self._n_pending
            by_kind = dict(self._by_kind)
            http = dict(self._http)
            fds = FdCounts(nofile=self._nofile[0], budget=self._fd_budget,
                           relays=self._fds_active)
            routes = list(self._routes)
        return RouterStats(
            accepted=accepted, bytes_up=bytes_up, bytes_down=bytes_down, refused=refused,
            events=events, open=n_open, open_peak=open_peak, pending=pending,
            bytes=bytes_up + bytes_down, by_kind=by_kind, http=http, fds=fds,
            held=sum(r.gate.held() for r in routes),
            inflight=sum(r.gate.inflight() for r in routes),
            pooled=self.pool.idle(), alive=self.alive(), acceptor_error=self.acceptor_error)

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

    def raw_http_target(self) -> Addr | None:
        """Where ``http="raw"`` relays an HTTP connection's bytes: the upstream of the route
        the table gives a request without a model (no gate: a byte relay is not held)."""
        table = self.table
        sel = table(None, "", "") if table is not None else None
        return sel.http if isinstance(sel, Route) else None

    def _http_session(self, conn: Conn, ups: Upstreams) -> None:
        try:
            HttpSession(self, conn).run()
        except Exception:  # a bug in one session must not leak its sockets or kill the worker
            log.exception("router %s #%d: HTTP session failed", self.name, conn.id)
            conn.note("session error")
        finally:
            self._finish(conn)
