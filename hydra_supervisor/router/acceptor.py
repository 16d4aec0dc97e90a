"""The router's acceptor: accept, read first bytes, classify, queue and admit.

One *acceptor* thread (a ``selectors`` loop) accepts, reads each new connection's first bytes
without blocking, enforces the first-byte timeout, the allow list and the bounded queues
(silent connections, classified ones waiting for a relay slot, refused ones lingering until the
client's EOF), evicts silent connections for room (a flood evicts its own; the per-source cap)
and admits a waiting connection when the ``Ledger`` (router/ledger.py) has room for it, handing
it to the ``Relays`` (router/relay.py's ``Relay``: pooled workers). One ggml-RPC connection at a
time holds the rpc-server; another is held back briefly and then refused (``_held_back``).
``Acceptor`` owns the listener and that thread; the ``Router`` (router/core.py) opens, starts
and closes it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from hydra_supervisor.router import limits, tls
from hydra_supervisor.router.classify import MAX_PREFIX, Kind, announced_build, classify
from hydra_supervisor.router.conn import (
    Conn,
    Pending,
    Queues,
    SockAddr,
    Upstreams,
    fmt_addr,
    parse_allow,
    set_keepalive,
    set_nodelay,
    source_ip,
    unwatch,
    watch,
)
from hydra_supervisor.router.gate import DEFAULT_RETRY_AFTER
from hydra_supervisor.router.ledger import Ledger
from hydra_supervisor.router.replies import http_error_response

log = logging.getLogger("hydra.router")

FIRST_READ = 64 * 1024
_ACCEPT_BATCH = 64
_EMFILE_BACKOFF_S = 0.1
_TICK_S = 1.0
# The acceptor restarts its loop after a failure; this many failures within the window end it.
_ACCEPTOR_MAX_FAILS = 5
_ACCEPTOR_FAIL_WINDOW_S = 10.0
# A ggml-RPC connection that comes while another holds the rpc-server waits this long for the
# holder to end before it is refused: a head's llama-server closes one connection and opens
# the next at once (device query, then load), and the router may see the new one before the
# old one's EOF. A second head is refused after it, never queued in the rpc-server.
RPC_HOLD_GRACE_S = 0.5


class Relays(Protocol):
    """Where the acceptor hands the connections it admits (router/relay.py's ``Relay``)."""

    def fd_cost(self, kind: Kind) -> int:
        """Descriptors a connection of ``kind`` holds once admitted."""
        ...

    def serve(self, conn: Conn, ups: Upstreams) -> None:
        """Run ``conn`` on a worker; RuntimeError when no thread can be started for it."""
        ...


class Waker:
    """Wakes the acceptor's select loop from other threads (a relay slot freed, stop): a
    socket pair, made when the acceptor opens and closed when it closes."""

    def __init__(self) -> None:
        self._r: socket.socket | None = None
        self._w: socket.socket | None = None

    def open(self) -> socket.socket:
        """A fresh pair; returns the end the acceptor selects on."""
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        self._r, self._w = r, w
        return r

    def wake(self) -> None:
        w = self._w
        if w is None:
            return
        try:
            w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake is already queued, or we are shutting down

    def close(self) -> None:
        for s in (self._r, self._w):
            if s is not None:
                s.close()
        self._r = self._w = None


class Acceptor:
    """The listener and the acceptor thread: admission into ``ledger``, admitted connections
    to ``relays``. ``upstreams`` (set by the router) go with each connection it admits;
    ``tick`` is called once a second on its thread (the router's housekeeping)."""

    def __init__(
        self,
        ledger: Ledger,
        relays: Relays,
        waker: Waker,
        upstreams: Upstreams,
        *,
        name: str,
        allow: Sequence[str],
        first_byte_timeout: float,
        queue_timeout: float,
        evict_after: float,
        max_pending: int,
        max_pending_per_source: int | None,
        max_waiting: int,
        tick: Callable[[float], None],
        thread_factory: Callable[..., threading.Thread],
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self.name = name
        self.ledger = ledger
        self.relays = relays
        self.waker = waker
        self.upstreams = upstreams
        self.tick = tick
        self._thread_factory = thread_factory
        self._allow = parse_allow(allow)
        self._first_byte_timeout = first_byte_timeout
        self._queue_timeout = queue_timeout
        self._evict_after = evict_after
        self._max_pending = max_pending
        self._pending_cap = max_pending  # sized from the open-file limit at open()
        self._max_per_source = (max_pending if max_pending_per_source is None
                                else min(max_pending_per_source, max_pending))
        self._max_waiting = max_waiting
        # TLS only (a peer profile's tls:): every connection must open with a ClientHello
        # from an allowed source; what it carries is classified once the handshake is done.
        self._tls = tls_context
        self._ids = itertools.count(1)
        self.listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._thread: threading.Thread | None = None
        # Why the acceptor gave up (after repeated failures), until the next start().
        self.error: str | None = None

    @property
    def tls_only(self) -> bool:
        """Whether the port takes TLS only (a peer profile's tls:)."""
        return self._tls is not None

    @property
    def allow(self) -> list[str]:
        """The allow list as CIDR strings."""
        return [str(n) for n in self._allow]

    # ---------------------------------------------------------------- lifecycle

    def open(self, bind_host: str, port: int, nofile: int) -> SockAddr:
        """Bind the listener (raises OSError: port taken, bad address) and size the silent
        queue to the soft open-file limit ``nofile``; returns the bound address."""
        infos = socket.getaddrinfo(
            bind_host or None,
            port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )
        family, _, _, _, sockaddr = infos[0]
        dual = family == socket.AF_INET6 and bind_host in ("::", "")
        # Backlog: the kernel holds connections we have not accepted yet (also while the
        # acceptor pauses because the waiting queue is full); the kernel caps it at somaxconn.
        listener = socket.create_server(
            sockaddr[:2], family=family, backlog=max(1024, self._max_pending), dualstack_ipv6=dual
        )
        listener.setblocking(False)
        # Every accepted socket inherits these from the listener (Linux copies them to each
        # child): no setsockopt per connection on the way to its first byte.
        set_nodelay(listener)
        set_keepalive(listener)
        self._wake_r = self.waker.open()
        # The silent queue holds descriptors too: under a low open-file limit it gets at most
        # an eighth of them, so that admitted relays keep the rest (1024 -> 128).
        soft = nofile if nofile > 0 else 1024
        self._pending_cap = max(16, min(self._max_pending, soft // 8))
        self.listener = listener
        bound: SockAddr = listener.getsockname()
        return bound

    def queued_fds(self) -> int:
        """Descriptors the acceptor's queues may hold at once (silent and waiting)."""
        return self._pending_cap + self._max_waiting

    def start(self) -> None:
        """Start the acceptor thread on the open listener; if it cannot start, the listener
        is closed again and the RuntimeError raised."""
        self.error = None
        thread = self._thread_factory(
            target=self._accept_loop, name=f"router-{self.name}-accept", daemon=True
        )
        try:
            thread.start()
        except RuntimeError:
            if self.listener is not None:
                self.listener.close()
            self.waker.close()
            self.listener = self._wake_r = None
            raise
        self._thread = thread

    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        """After the thread ended (it closes the listener): forget it; open() may follow."""
        self.waker.close()
        self.listener = self._wake_r = None
        self._thread = None

    # ---------------------------------------------------------------- acceptor

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
        listener, wake_r = self.listener, self._wake_r
        assert listener is not None and wake_r is not None
        q = Queues()
        fails: collections.deque[float] = collections.deque()
        try:
            while not self.ledger.stopping:
                try:
                    self._accept_run(listener, wake_r, q)
                    return
                except Exception as e:
                    now = time.monotonic()
                    fails.append(now)
                    while fails and now - fails[0] > _ACCEPTOR_FAIL_WINDOW_S:
                        fails.popleft()
                    self.ledger.count_event("acceptor_restart", log_it=False)
                    if len(fails) >= _ACCEPTOR_MAX_FAILS:
                        self.error = f"{type(e).__name__}: {e}"
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
            self.ledger.set_pending(0)
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
            while not self.ledger.stopping:
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
                if q.held_back:
                    marks.append(q.held_back[0].deadline)
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
                self._held_back(q, now)
                self._admit(q)
                if now >= next_tick:
                    next_tick = now + _TICK_S
                    self.tick(now)
                self.ledger.set_pending(len(q.pending) + len(q.waiting))
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
        self.ledger.count_refused(counter, why)
        self._linger(sel, q, victim, http_error_response(
            503, "hydra router: too many connections waiting, try again",
            DEFAULT_RETRY_AFTER))

    def _accept_batch(self, sel: selectors.BaseSelector, q: Queues) -> bool:
        """Accept what the kernel has queued. False when out of descriptors (caller backs off)."""
        listener = self.listener
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
                self.ledger.count_event("accept_failed", f"{e.strerror or e}")
                return False
            conn = Conn(next(self._ids), client, peer, now)
            self.ledger.count_accepted()
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
                self.ledger.count_refused("silent_source_limit", conn.src)
                conn.client.setblocking(False)
                self._linger(sel, q, conn, http_error_response(
                    503,
                    "hydra router: too many connections waiting from your address, try again",
                    DEFAULT_RETRY_AFTER))
                return
        conn.client.setblocking(False)  # TCP_NODELAY and keepalive: the listener's (open)
        conn.deadline = now + self._first_byte_timeout
        q.pending.add(conn)
        # Clients usually send right after connecting: read now rather than after another
        # trip through select (saves tens of microseconds per connection); the connection is
        # watched only when its first bytes are not all there yet.
        self._read_prefix(sel, conn, q)
        if conn.id in q.pending.all:
            watch(sel, conn)

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

    def _start_tls(self, sel: selectors.BaseSelector, conn: Conn, q: Queues) -> bool:
        """On a TLS-only port: a new connection must open with a ClientHello from an allowed
        source (anything else is closed before a byte of TLS is spent on it); its socket is
        then wrapped and the handshake runs here, non-blocking, within the first-byte
        timeout. True once the handshake is done (the decrypted bytes are then classified
        as a plain connection's are)."""
        if conn.tls is None:
            try:
                first = conn.client.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                first = b""
            if not first:
                self._unpend(sel, q.pending, conn)
                self._drop(conn, "client closed before first bytes", None)
                return False
            if first[0] != tls.HANDSHAKE:
                self._unpend(sel, q.pending, conn)
                self._drop(conn, f"plain connection on a TLS-only port (first byte "
                           f"{first[:1].hex()})", "tls_required")
                return False
            if not self._is_allowed(conn.peer):
                self._unpend(sel, q.pending, conn)
                self._drop(conn, "TLS from a source not allow-listed", "denied")
                return False
            assert self._tls is not None
            unwatch(sel, conn)
            conn.client = self._tls.wrap_socket(conn.client, server_side=True,
                                                do_handshake_on_connect=False)
            conn.tls = "handshake"
            sel.register(conn.client, selectors.EVENT_READ, conn)
        if conn.tls == "handshake":
            assert isinstance(conn.client, ssl.SSLSocket)
            try:
                conn.client.do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return False  # more of the client's flight to come (a few KB: it fits)
            except (ssl.SSLError, OSError) as e:
                self._unpend(sel, q.pending, conn)
                why = getattr(e, "reason", None) or e
                conn.note(f"TLS handshake failed: {why}")
                self.ledger.count_refused("tls_failed", conn.reason)
                # OpenSSL has written its alert (unknown CA, ...). Closing with the client's
                # first bytes unread would reset the connection, and a reset can destroy the
                # alert before the client reads it: linger as a refused HTTP client does.
                ssock = conn.client
                conn.client = socket.socket(ssock.family, ssock.type, ssock.proto,
                                            fileno=ssock.detach())
                self._linger(sel, q, conn, b"")
                return False
            conn.tls = "up"
        return True

    def _read_prefix(self, sel: selectors.BaseSelector, conn: Conn, q: Queues) -> None:
        if self._tls is not None and conn.tls != "up" and not self._start_tls(sel, conn, q):
            return
        try:
            # Classification needs MAX_PREFIX bytes at most, but taking whatever has arrived
            # (typically a whole HTTP request) lets the relay forward it in one write.
            data = conn.client.recv(FIRST_READ)
            if isinstance(conn.client, ssl.SSLSocket):
                while conn.client.pending():  # decrypted already: select would not see it
                    data += conn.client.recv(FIRST_READ)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
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
        if conn.tls is not None and kind is Kind.HTTP:
            # A TLS port is a peer host's: ggml-RPC and Hydra frames only.
            self._drop(conn, "HTTP inside TLS (a TLS port carries ggml-RPC and Hydra frames)",
                       "rejected")
            return
        if kind is Kind.HYDRA:  # a head's hydra asking INFO may say its build
            build = announced_build(conn.prefix)
            if build is not None:
                self.ledger.note_build(conn.src, build)
        # Checked only for these kinds: HTTP is open, and the check costs microseconds.
        if kind in (Kind.RPC, Kind.HYDRA) and not self._is_allowed(conn.peer):
            # ggml-rpc-server has no authentication: from a source outside the allow list it
            # must be unreachable, so close without a word.
            self._drop(conn, f"{kind.value} from a source not allow-listed", "denied")
            return
        conn.deadline = time.monotonic() + self._queue_timeout
        q.waiting.append(conn)

    def _admit(self, q: Queues) -> None:
        """Admit waiting connections, oldest first, while the ledger has room for them, and
        hand each to a worker (router/relay.py) with the upstreams of the moment. A ggml-RPC
        connection while another holds the rpc-server is held back instead (``_held_back``)."""
        waiting = q.waiting
        while waiting:
            conn = waiting[0]
            assert conn.kind is not None
            if conn.kind is Kind.RPC and self.ledger.rpc_holder_conn() is not None:
                waiting.popleft()
                conn.deadline = min(conn.deadline, time.monotonic() + RPC_HOLD_GRACE_S)
                q.held_back.append(conn)
                continue
            if not self.ledger.admit(conn, self.relays.fd_cost(conn.kind), len(waiting)):
                return  # stopping, or no room until a relay ends (its finish wakes us)
            waiting.popleft()
            try:
                self.relays.serve(conn, self.upstreams)
            except RuntimeError as e:  # Thread.start failed: out of threads or memory
                self._no_thread(conn, e)

    def _held_back(self, q: Queues, now: float) -> None:
        """ggml-RPC connections that came while another held the rpc-server: back to the
        front of the waiting queue once it is free; refused (closed, the rpc-server never
        sees them) when it is still held at their deadline. The one head that holds it is
        never disturbed, and the rpc-server's own accept queue never fills with heads that
        would wait there (a peer host's INFO names the holder: wire/, buildid.ask_info)."""
        if not q.held_back:
            return
        holder = self.ledger.rpc_holder()
        if holder is None:
            q.waiting.extendleft(reversed(q.held_back))
            q.held_back.clear()
            return
        while q.held_back and q.held_back[0].deadline <= now:
            conn = q.held_back.popleft()
            build = f" (build {holder['build']})" if holder["build"] else ""
            self._drop(conn, f"ggml-RPC refused: the rpc-server is held by {holder['addr']}"
                       f"{build}", "rpc_held")

    def _no_thread(self, conn: Conn, e: BaseException) -> None:
        """A connection we could not give a thread: 503 (HTTP) and close; the router goes on."""
        self.ledger.unadmit(conn)
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
            self.ledger.count_refused(counter, reason)
        try:
            conn.client.close()
        except OSError:
            pass
        self.ledger.log_close(conn)
