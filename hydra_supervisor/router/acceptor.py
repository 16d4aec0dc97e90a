"""The router's acceptor: accept, read first bytes, classify, queue and admit.

One *acceptor* thread (a ``selectors`` loop) accepts, reads each new connection's first bytes
without blocking, enforces the first-byte timeout, the allow list and the bounded queues
(silent connections, classified ones waiting for a relay slot, refused ones lingering until the
client's EOF), evicts silent connections for room (a flood evicts its own; the per-source cap)
and admits a waiting connection when the descriptor budget has room, handing it to a pooled
worker (router/relay.py). ``Acceptor`` is a part of ``Router`` (router/core.py), which holds
the state it reads and writes.
"""

from __future__ import annotations

import collections
import itertools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hydra_supervisor.router import limits
from hydra_supervisor.router.classify import MAX_PREFIX, Kind, classify
from hydra_supervisor.router.conn import (
    Conn,
    Network,
    Pending,
    Queues,
    SockAddr,
    Upstreams,
    fmt_addr,
    set_keepalive,
    set_nodelay,
    source_ip,
    unwatch,
)
from hydra_supervisor.router.gate import DEFAULT_RETRY_AFTER
from hydra_supervisor.router.replies import http_error_response
from hydra_supervisor.router.routes import Route
from hydra_supervisor.router.upstream import UpstreamPool

log = logging.getLogger("hydra.router")

FIRST_READ = 64 * 1024
_ACCEPT_BATCH = 64
_EMFILE_BACKOFF_S = 0.1
_TICK_S = 1.0
# An idle keep-alive connection is closed for room only after this long idle: a client that is
# about to send its next request has usually sent it by then.
_IDLE_CLOSE_MIN_S = 0.05
# The acceptor restarts its loop after a failure; this many failures within the window end it.
_ACCEPTOR_MAX_FAILS = 5
_ACCEPTOR_FAIL_WINDOW_S = 10.0


class Acceptor:
    """The acceptor thread's part of ``Router``: ``_accept_loop`` and what it calls."""

    # The Router's state this part uses (router/core.py sets it in Router.__init__).
    name: str
    acceptor_error: str | None
    pool: UpstreamPool
    _lock: threading.Lock
    _stopping: bool
    _listener: socket.socket | None
    _wake_r: socket.socket | None
    _wake_w: socket.socket | None
    _ids: itertools.count[int]
    _allow: tuple[Network, ...]
    _upstreams: Upstreams
    _routes: list[Route]
    _first_byte_timeout: float
    _queue_timeout: float
    _evict_after: float
    _pending_cap: int
    _max_per_source: int
    _max_waiting: int
    _max_active: int | None
    _http_mode: str
    _pump_kind: str
    _active: dict[int, Conn]
    _n_pending: int
    _fds_active: int
    _fd_budget: int
    _open_peak: int
    _c: dict[str, int]
    _events: collections.Counter[str]
    _by_kind: dict[str, int]

    if TYPE_CHECKING:  # the Router's (core.py) and the relay's (relay.py)
        def count_refused(self, reason: str, detail: str = "", log_it: bool = True) -> None: ...
        def count_event(self, reason: str, detail: str = "") -> None: ...
        def _log_close(self, conn: Conn) -> None: ...
        def _http_session(self, conn: Conn, ups: Upstreams) -> None: ...
        def _run(self, fn: Callable[..., None], *args: object) -> None: ...
        def _relay(self, conn: Conn, ups: Upstreams) -> None: ...
        def _reap_idle(self, now: float) -> None: ...

    # ---------------------------------------------------------------- acceptor

    def _wake(self) -> None:
        w = self._wake_w
        if w is None:
            return
        try:
            w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake is already queued, or we are shutting down

    def _is_allowed(self, peer: SockAddr) -> bool:
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
        q = Queues()
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

    def _accept_run(self, listener: socket.socket, wake_r: socket.socket, q: Queues) -> None:
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

    def _on_readable(self, sel: selectors.BaseSelector, q: Queues, conn: Conn) -> None:
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

    def _conn_failed(self, sel: selectors.BaseSelector, q: Queues, conn: Conn,
                     e: BaseException) -> None:
        log.warning("router %s #%d %s: dropped after an error in the acceptor: %s: %s",
                    self.name, conn.id, fmt_addr(conn.peer), type(e).__name__, e,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        q.forget(conn)
        unwatch(sel, conn)
        self._drop(conn, f"acceptor error: {type(e).__name__}: {e}", "conn_error")

    def _tick(self, now: float) -> None:
        keep = {r.http for r in self._routes}
        self.pool.reap(keep={k for k in keep if k is not None})
        self._reap_idle(now)

    def _unpend(self, sel: selectors.BaseSelector, pending: Pending, conn: Conn) -> None:
        pending.remove(conn)
        unwatch(sel, conn)

    def _room_at(self, pending: Pending, now: float) -> float:
        """When a new connection can be taken: now while the silent queue has room or holds a
        connection silent past ``evict_after``; else when its oldest gets there (until then new
        connections wait in the kernel's backlog, which loses nothing)."""
        if len(pending) < self._pending_cap or not pending.by_src:
            return now
        return pending.oldest_of_largest().accepted + self._evict_after

    def _evict_silent(self, sel: selectors.BaseSelector, q: Queues, victim: Conn,
                      why: str, counter: str) -> None:
        """Close a silent connection to make room: an HTTP client that was merely slow gets a
        503 with Retry-After (not a reset), then the connection lingers until EOF."""
        self._unpend(sel, q.pending, victim)
        victim.note(why)
        self.count_refused(counter, why)
        self._linger(sel, q, victim, http_error_response(
            503, "hydra router: too many connections waiting, try again",
            DEFAULT_RETRY_AFTER))

    def _accept_batch(self, sel: selectors.BaseSelector, q: Queues) -> bool:
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

    def _take(self, sel: selectors.BaseSelector, q: Queues, conn: Conn, now: float) -> None:
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

    def _linger(self, sel: selectors.BaseSelector, q: Queues, conn: Conn,
                reply: bytes) -> None:
        """Answer ``reply`` (best effort, non-blocking), half-close, and keep reading what the
        client still sends until its EOF or ``limits.LINGER_DRAIN_S``: closing with unread bytes
        would turn into a reset that destroys the reply before the client reads it."""
        try:
            conn.client.send(reply)
            conn.client.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(conn, conn.reason or "closed", None)
            return
        conn.deadline = time.monotonic() + limits.LINGER_DRAIN_S
        q.lingering.append(conn)
        q.linger_ids.add(conn.id)
        try:
            sel.register(conn.client, selectors.EVENT_READ, conn)
        except (KeyError, ValueError, OSError):
            pass

    def _linger_read(self, sel: selectors.BaseSelector, q: Queues, conn: Conn) -> None:
        try:
            data = conn.client.recv(FIRST_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._unlinger(sel, q, conn)

    def _unlinger(self, sel: selectors.BaseSelector, q: Queues, conn: Conn) -> None:
        q.forget(conn)
        unwatch(sel, conn)
        self._drop(conn, conn.reason or "closed", None)

    def _read_prefix(self, sel: selectors.BaseSelector, conn: Conn, q: Queues) -> None:
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
            return limits.FDS_HTTP
        return limits.FDS_SPLICE if self._pump_kind == "splice" else limits.FDS_HTTP

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
                fn: Callable[[Conn, Upstreams], None] = self._http_session
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
