"""The first-byte router of one external port: ``Router``, its public API, built of its parts.

``Router`` listens on an engine's external port, admits, classifies and relays; the owner
starts and stops it, points it at its byte upstreams (ggml-RPC, Hydra) and at a route table
(router/routes.py: every HTTP request goes to the Route it picks, whose gate holds, releases
and cuts it), and reads ``stats``. This module owns that API and the Router's configuration;
the work is done by collaborators it makes and wires together through their constructors:

- ``Ledger`` (router/ledger.py): the state the threads share, under one lock: the admitted
  connections and their descriptors, the stopping flag, every counter;
- ``Acceptor`` (router/acceptor.py): the listener and one *acceptor* thread (a ``selectors``
  loop) that accepts, reads each new connection's first bytes without blocking, enforces the
  first-byte timeout, the allow list and the bounded queues, and admits into the ledger;
- ``Relay`` (router/relay.py): the pooled workers the acceptor hands admitted connections to.
  Each HTTP connection gets one running an ``HttpSession`` (router/http.py: request-aware, h11),
  so the engine can hold, count, drain and cut requests; each ggml-RPC or Hydra connection gets
  two with blocking sockets, one per direction, moving bytes with ``os.splice`` (a kernel pipe,
  no copy through Python) or, as a fallback, ``recv_into``/``sendall``. ggml-RPC is the
  per-token path: it stays a byte splice. relay.py also says why threads and not asyncio;
- ``UpstreamPool`` (router/upstream.py): idle keep-alive connections to the HTTP upstreams;
- ``Traffic`` (router/traffic.py): what each route serves now, the tokens it generates as
  they stream, and the last requests (the HTTP sessions report into it).

The Router is also the ``SessionHost`` its HTTP sessions read their settings, route table,
upstream pool and counters from.

Invariants: a relaying connection is never dropped to admit another (new ones wait in a bounded
queue; silent ones are evicted first); admission is sized from the descriptors the process
really has, so an admitted relay does not die of EMFILE; every wait has a deadline except a relay
that is actually open (an HTTP request in flight, a ggml-RPC link a head holds), which ends on
EOF, error, a route's ``cut_inflight`` or ``stop()``.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hydra_supervisor.router import affinity, budget, limits
from hydra_supervisor.router.acceptor import Acceptor, Waker
from hydra_supervisor.router.budget import BodyBudget
from hydra_supervisor.router.conn import Conn, Upstreams, allow_mismatch, fmt_addr
from hydra_supervisor.router.gate import HOLD_TIMEOUT_S, MAX_HELD, Gate
from hydra_supervisor.router.http import HttpSession
from hydra_supervisor.router.ledger import FdCounts, Ledger, LedgerCounts
from hydra_supervisor.router.pump import BodyPump
from hydra_supervisor.router.relay import HTTP_MODES, PUMPS, Relay, WorkerPool
from hydra_supervisor.router.replies import JSONValue, RequestRecord
from hydra_supervisor.router.routes import Addr, Limiter, Route, RouteTable
from hydra_supervisor.router.traffic import Traffic
from hydra_supervisor.router.upstream import UpstreamPool

log = logging.getLogger("hydra.router")

_CONNECT_TIMEOUT = 3.0
_QUEUE_TIMEOUT = 30.0
_STOP_JOIN_S = 5.0

__all__ = ["HTTP_MODES", "PUMPS", "FdCounts", "Router", "RouterStats"]


class RouterStats(LedgerCounts):
    """``Router.counters()``: what the router counted since it was made (``stats()`` gives
    the same as a plain dict): the ledger's counts (``refused`` and ``events`` by reason;
    ``http`` by class, ``requests``, ``1xx``..``5xx``, ``cut``, ``retried``; ``by_kind`` by
    admitted kind) and what the router adds to them."""

    bytes: int
    held: int
    inflight: int
    pooled: int
    alive: bool
    acceptor_error: str | None
    cpus: str  # the CPUs its threads are pinned to, as the kernel lists them ("": not pinned)


class Router:
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
        tls_context: ssl.SSLContext | None = None,
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
        traffic: Traffic | None = None,
        retry_wait: float = 1.0,
        max_body: int = 64 << 20,
        body_budget: BodyBudget | None = None,
        request_timeout: float = 120.0,
        thread_factory: Callable[..., threading.Thread] = threading.Thread,
        cpus: frozenset[int] | None = None,
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
        if hold_timeout <= 0 or max_held < 1:
            raise ValueError("hold_timeout must be positive and max_held at least 1")
        self.bind_host = bind_host
        self.name = name
        # The CPUs its threads pin themselves to (router/affinity.py; None: not pinned).
        self.cpus = cpus
        thread_factory = affinity.pinned(thread_factory, cpus)
        self._req_port = port
        self._bound_port: int | None = None
        self._nofile = (0, 0)
        # What HTTP sessions read per request (SessionHost, router/upstream.py).
        self.idle_timeout = idle_timeout
        self.retry_wait = retry_wait
        self.max_body = max_body
        # Request bodies held in memory, all routers of the process together (router/budget.py).
        self.body_budget = body_budget if body_budget is not None else budget.PROCESS
        self.request_timeout = request_timeout
        self.request_defaults: dict[str, JSONValue] = {}
        # Live load and the request table (router/traffic.py): the daemon gives every port's
        # router its one Traffic; a router made alone keeps its own.
        self.traffic = traffic if traffic is not None else Traffic()
        self.hold_timeout = hold_timeout
        self._max_held = max_held
        # Every HTTP request goes where the table says (router/routes.py): a Route (its own
        # gate, upstream and limiter: the only place requests are held, drained or cut) or a
        # LocalReply. The router has no gate of its own: until a table is set, HTTP requests
        # get 503.
        self.table: RouteTable | None = table
        self._routes: list[Route] = []
        self._routes_lock = threading.Lock()  # new_route against stop(): no gate left running

        # The parts, wired through their constructors (module docstring).
        self.ledger = Ledger(name, max_active=max_active, on_request=on_request)
        self._waker = Waker()
        self.workers = WorkerPool(name, thread_factory)
        self.relay = Relay(
            self.ledger, self.workers, name=name, pump=pump, http_mode=http,
            connect_timeout=connect_timeout, idle_timeout=idle_timeout,
            rpc_idle_timeout=rpc_idle_timeout, session=self._http_session,
            raw_http_target=self.raw_http_target, wake=self._waker.wake)
        self.pool = UpstreamPool(self.relay.connect, self.relay.connect_once)
        # Response bodies still streaming, moved by one thread (router/pump.py).
        self.pump = BodyPump(name, thread_factory)
        self.acceptor = Acceptor(
            self.ledger, self.relay, self._waker, upstreams, name=name, allow=allow,
            first_byte_timeout=first_byte_timeout, queue_timeout=queue_timeout,
            evict_after=evict_after, max_pending=max_pending,
            max_pending_per_source=max_pending_per_source, max_waiting=max_waiting,
            tick=self._housekeep, thread_factory=thread_factory, tls_context=tls_context)

    # ---------------------------------------------------------------- public API

    def start(self) -> None:
        """Bind and start the acceptor. A stopped router may be started again."""
        if self.acceptor.listener is not None:
            raise RuntimeError("router already started")
        self._nofile = limits.raise_nofile()
        addr = self.acceptor.open(self.bind_host, self._req_port, self._nofile[0])
        reserved = self.acceptor.queued_fds() + 16 + 3  # queues, pool, own sockets
        fd_budget = limits.fd_budget(reserved)
        self.ledger.begin(fd_budget, self._nofile[0])
        self.workers.start()
        with self._routes_lock:
            routes = list(self._routes)
        for route in routes:
            route.gate.restart()
        self._bound_port = int(addr[1])
        self._req_port = self._bound_port  # port 0: a restart keeps the port it got
        self.acceptor.start()
        self.pump.start()  # never raises: without its thread, bodies move on sessions' threads
        per = limits.FDS_HTTP
        log.info(
            "router %s listening on %s (nofile %d/%d: room for ~%d HTTP connections; "
            "threads on CPU %s)",
            self.name, fmt_addr(addr), self._nofile[0], self._nofile[1],
            fd_budget // per, affinity.span(self.cpus) if self.cpus else "any",
        )
        if self.acceptor.tls_only:
            log.info("router %s: TLS only (mutual certificates); plain connections are refused",
                     self.name)
        why = allow_mismatch(self.bind_host, self.acceptor.allow)
        if why:
            log.warning("router %s: %s; no ggml-RPC or Hydra wire client can ever be let in",
                        self.name, why)
        if fd_budget // per < 64:
            log.warning("router %s: the open-file limit leaves room for only %d connections; "
                        "raise the hard limit (LimitNOFILE= in systemd)", self.name,
                        fd_budget // per)

    @property
    def port(self) -> int:
        """The bound port (also after stop(); a restart binds it again)."""
        if self._bound_port is None:
            raise RuntimeError("router not started")
        return self._bound_port

    @property
    def upstreams(self) -> Upstreams:
        return self.acceptor.upstreams

    def set_upstreams(self, u: Upstreams) -> None:
        """New connections and new HTTP requests use ``u``; open byte relays keep theirs."""
        self.acceptor.upstreams = u

    def new_route(self, name: str, limit: int | None = None, queue: int = 0) -> Route:
        """A lane of its own (gate, upstream, limiter) for a table to hand out; stopped and
        started with the router."""
        route = Route(name, Gate(self.hold_timeout, self._max_held),
                      limiter=Limiter(name, limit, queue) if limit else None)
        with self._routes_lock:
            self._routes.append(route)
            if self.ledger.stopping:
                route.gate.stop()
        return route

    def set_request_defaults(self, d: Mapping[str, JSONValue]) -> None:
        """T1 defaults added to completion request bodies that lack them (router/defaults.py)."""
        self.request_defaults = dict(d)

    def alive(self) -> bool:
        return self.acceptor.running() and not self.ledger.stopping

    @property
    def acceptor_error(self) -> str | None:
        """Why the acceptor gave up (after repeated failures), until the next start()."""
        return self.acceptor.error

    def stop(self, timeout: float = _STOP_JOIN_S) -> None:
        """Close the listener, every waiting connection and every relay; bounded by ``timeout``.
        The router can be started again afterwards."""
        with self._routes_lock:
            if self.acceptor.listener is None or not self.ledger.stop("router stopped"):
                return
            routes = list(self._routes)
        for route in routes:
            route.gate.stop()
        self._waker.wake()
        deadline = time.monotonic() + timeout
        self.acceptor.join(max(0.0, deadline - time.monotonic()))
        self.pump.stop(max(0.0, deadline - time.monotonic()))
        self.workers.stop(deadline)
        self.pool.close()
        self.acceptor.close()
        log.info("router %s stopped", self.name)

    def stats(self) -> dict[str, Any]:
        """``counters()`` as a plain dict (the owner adds its own counts to it)."""
        return dict(self.counters())

    def counters(self) -> RouterStats:
        c = self.ledger.counts()
        with self._routes_lock:
            routes = list(self._routes)
        return RouterStats(
            accepted=c["accepted"], bytes_up=c["bytes_up"], bytes_down=c["bytes_down"],
            refused=c["refused"], events=c["events"], open=c["open"],
            open_peak=c["open_peak"], pending=c["pending"],
            bytes=c["bytes_up"] + c["bytes_down"], by_kind=c["by_kind"], http=c["http"],
            fds=c["fds"], rpc_holder=c["rpc_holder"],
            held=sum(r.gate.held() for r in routes),
            inflight=sum(r.gate.inflight() for r in routes),
            pooled=self.pool.idle(), alive=self.alive(), acceptor_error=self.acceptor.error,
            cpus=affinity.span(self.cpus) if self.cpus else "")

    # ---------------------------------------------------------------- for the parts

    def raw_http_target(self) -> Addr | None:
        """Where ``http="raw"`` relays an HTTP connection's bytes: the upstream of the route
        the table gives a request without a model (no gate: a byte relay is not held)."""
        table = self.table
        sel = table(None, "", "") if table is not None else None
        return sel.http if isinstance(sel, Route) else None

    def _http_session(self, conn: Conn) -> None:
        """One HTTP connection, on a worker (the relay closes it after)."""
        HttpSession(self, conn).run()

    def _housekeep(self, now: float) -> None:
        """Once a second on the acceptor's thread: pooled upstream connections past their age
        or to an upstream no route has any more, and byte relays idle past their timeout."""
        keep = {r.http for r in self._routes}
        self.pool.reap(keep={k for k in keep if k is not None})
        self.relay.reap_idle(now)
