"""The router's sockets: listen on an engine's external port, admit, classify, relay.

This module owns everything between the external listener and the engine's internal endpoints:

- one *acceptor* thread (a ``selectors`` loop) accepts, reads each new connection's first bytes
  without blocking, enforces the first-byte timeout, the allow list and the bounded wait queue;
- each admitted connection gets two *relay* workers (pooled threads) with blocking sockets, one
  per direction, moving bytes with ``os.splice`` (a kernel pipe, no copy through Python) or, as
  a fallback, ``recv_into``/``sendall``.

Why threads with blocking sockets and not asyncio: the ggml-RPC path is per-token, so the relay's
wake-up latency and CPU are paid on every decoded token. Measured (bench/router.py), a blocked
``recv``/``splice`` that the kernel wakes directly beats an event loop's epoll → callback →
write path in added latency and CPU; docs/router.md has the numbers. The threads release the GIL
while blocked, so the router lives happily inside the supervisor's asyncio process.

Invariants: a relaying connection is never dropped to admit another (new ones wait in a bounded
queue, are refused beyond it); every wait has a deadline except a relay that is actually open
(that one ends on EOF, error, the optional idle timeout, or ``stop()``); a missing or dead
upstream closes the client at once (HTTP clients get a 503 with a JSON reason).
"""

from __future__ import annotations

import collections
import fcntl
import ipaddress
import itertools
import json
import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra_supervisor.ports import self_connected
from hydra_supervisor.router.classify import MAX_PREFIX, Kind, classify

log = logging.getLogger("hydra.router")

Addr = tuple[str, int]

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
# Relay threads are pooled: starting a thread costs ~50-80 us of the new-connection latency, a
# hand-off to an idle one ~10 us. Idle workers beyond the cap, or idle too long, exit.
_MAX_IDLE_WORKERS = 64
_WORKER_IDLE_S = 30.0

PUMPS = ("splice", "copy")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Upstreams:
    """Where each protocol goes. ``None`` means "not available now": the client is closed
    (HTTP: 503). All targets are local by design: llama-server and ggml-rpc-server bind to
    127.0.0.1 only, and the router is the sole way in from outside."""

    http: Addr | None = None
    rpc: Addr | None = None
    hydra: Addr | None = None

    def __post_init__(self) -> None:
        for name in ("http", "rpc", "hydra"):
            addr = getattr(self, name)
            if addr is not None and not _is_loopback(addr[0]):
                raise ValueError(
                    f"router upstream {name}={addr[0]}:{addr[1]} is not a loopback address; "
                    "internal llama-server / ggml-rpc-server / control ports bind to 127.0.0.1"
                )

    def for_kind(self, kind: Kind) -> Addr | None:
        if kind is Kind.HTTP:
            return self.http
        if kind is Kind.RPC:
            return self.rpc
        if kind is Kind.HYDRA:
            return self.hydra
        return None


def _parse_allow(allow: Sequence[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    if isinstance(allow, str):
        raise TypeError("allow must be a sequence of CIDR strings, not one string")
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in allow)


def _source_ip(peer: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except (ValueError, IndexError, TypeError):
        return None
    # A dual-stack listener reports IPv4 clients as ::ffff:a.b.c.d; judge them as IPv4.
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _fmt_addr(peer: Any) -> str:
    try:
        host, port = peer[0], peer[1]
    except (IndexError, TypeError):
        return str(peer)
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _set_nodelay(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # not TCP (tests may hand us a socketpair); nothing to tune


def http_error_response(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response whose body matches llama-server's error JSON."""
    body = json.dumps(
        {"error": {"code": status, "message": message, "type": "unavailable_error"}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + body


class _Conn:
    """One client connection from accept to close. Mutated by the acceptor until admitted,
    then by its relay threads; ``abort`` may come from any thread (stop, idle reaper)."""

    __slots__ = (
        "id",
        "client",
        "peer",
        "accepted",
        "deadline",
        "prefix",
        "kind",
        "target",
        "upstream",
        "up",
        "down",
        "last",
        "reason",
        "halves",
    )

    def __init__(self, cid: int, client: socket.socket, peer: Any, now: float):
        self.id = cid
        self.client = client
        self.peer = peer
        self.accepted = now
        self.deadline = now
        self.prefix = b""
        self.kind: Kind | None = None
        self.target: Addr | None = None
        self.upstream: socket.socket | None = None
        self.up = 0  # bytes client → upstream
        self.down = 0  # bytes upstream → client
        self.last = now
        self.reason = ""
        self.halves = 2  # relay directions still running; the last one to end closes

    def note(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason

    def shutdown_all(self) -> None:
        # shutdown (not close) wakes threads blocked in recv/splice on these sockets without
        # freeing the fd under them; the relay thread closes once both directions are done.
        for s in (self.client, self.upstream):
            if s is None:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Router:
    """First-byte router for one engine's external port. Runs its own threads; ``start`` and
    ``stop`` are blocking but bounded, so an asyncio supervisor calls them directly (they take
    milliseconds) or through ``asyncio.to_thread``."""

    def __init__(
        self,
        bind_host: str,
        port: int,
        upstreams: Upstreams,
        *,
        allow: Sequence[str] = ("127.0.0.0/8", "::1/128"),
        first_byte_timeout: float = 10.0,
        idle_timeout: float | None = None,
        max_active: int = 512,
        max_pending: int = 128,
        name: str = "engine",
        queue_timeout: float = _QUEUE_TIMEOUT,
        connect_timeout: float = _CONNECT_TIMEOUT,
        pump: str = "splice",
    ) -> None:
        if max_active < 1 or max_pending < 1:
            raise ValueError("max_active and max_pending must be at least 1")
        if first_byte_timeout <= 0 or queue_timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if idle_timeout is not None and idle_timeout <= 0:
            raise ValueError("idle_timeout must be positive or None")
        if pump not in PUMPS:
            raise ValueError(f"pump must be one of {PUMPS}, not {pump!r}")
        if pump == "splice" and not hasattr(os, "splice"):
            pump = "copy"  # os.splice is Linux-only
        self.bind_host = bind_host
        self.name = name
        self._req_port = port
        self._upstreams = upstreams
        self._allow = _parse_allow(allow)
        self._first_byte_timeout = first_byte_timeout
        self._idle_timeout = idle_timeout
        self._max_active = max_active
        self._max_pending = max_pending
        self._queue_timeout = queue_timeout
        self._connect_timeout = connect_timeout
        self._pump_kind = pump

        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._stopping = False
        self._active: dict[int, _Conn] = {}
        self._threads: set[threading.Thread] = set()
        self._tasks: queue.SimpleQueue[tuple[Any, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._idle_workers = 0
        self._n_pending = 0
        self._c = {
            "total": 0,
            "refused": 0,
            "rejected": 0,
            "denied": 0,
            "timeouts": 0,
            "upstream_errors": 0,
            "bytes_up": 0,
            "bytes_down": 0,
        }
        self._by_kind = {k.value: 0 for k in (Kind.RPC, Kind.HYDRA, Kind.HTTP)}

    # ---------------------------------------------------------------- public API

    def start(self) -> None:
        if self._listener is not None:
            raise RuntimeError("router already started")
        infos = socket.getaddrinfo(
            self.bind_host or None,
            self._req_port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )
        family, _, _, _, sockaddr = infos[0]
        dual = family == socket.AF_INET6 and self.bind_host in ("::", "")
        # Backlog: the kernel holds connections we have not accepted yet; beyond max_pending we
        # accept and close, so a short backlog only bounds bursts between two accept batches.
        backlog = max(128, self._max_pending)
        listener = socket.create_server(
            sockaddr[:2], family=family, backlog=backlog, dualstack_ipv6=dual
        )
        listener.setblocking(False)
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"router-{self.name}-accept", daemon=True
        )
        self._acceptor.start()
        log.info("router %s listening on %s", self.name, _fmt_addr(listener.getsockname()))

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("router not started")
        return int(self._listener.getsockname()[1])

    @property
    def upstreams(self) -> Upstreams:
        return self._upstreams

    def set_upstreams(self, u: Upstreams) -> None:
        """New connections (those not yet relaying) use ``u``; open relays keep their upstream."""
        self._upstreams = u

    def stop(self, timeout: float = _STOP_JOIN_S) -> None:
        """Close the listener, every waiting connection and every relay; bounded by ``timeout``."""
        with self._lock:
            if self._listener is None or self._stopping:
                return
            self._stopping = True
            # Under the lock: _finish closes sockets under it, so no fd is reused under us.
            for conn in self._active.values():
                conn.note("router stopped")
                conn.shutdown_all()
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
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        log.info("router %s stopped", self.name)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            live_up = sum(c.up for c in self._active.values())
            live_down = sum(c.down for c in self._active.values())
            out: dict[str, Any] = dict(self._c)
            out["open"] = len(self._active)
            out["pending"] = self._n_pending
            out["bytes_up"] += live_up
            out["bytes_down"] += live_down
            out["bytes"] = out["bytes_up"] + out["bytes_down"]
            out["by_kind"] = dict(self._by_kind)
        return out

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
        ip = _source_ip(peer)
        if ip is None:
            return False
        return any(ip.version == net.version and ip in net for net in self._allow)

    def _accept_loop(self) -> None:
        listener, wake_r = self._listener, self._wake_r
        assert listener is not None and wake_r is not None
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, "listen")
        sel.register(wake_r, selectors.EVENT_READ, "wake")
        # Both dicts/deques are in deadline order because each has one fixed timeout.
        pending: dict[int, _Conn] = {}
        waiting: collections.deque[_Conn] = collections.deque()
        paused_until = 0.0
        idle_every = None if self._idle_timeout is None else min(1.0, self._idle_timeout / 4)
        next_idle = time.monotonic() + (idle_every or 0.0)
        try:
            while not self._stopping:
                now = time.monotonic()
                timeout: float | None = None
                marks = []
                if pending:
                    marks.append(next(iter(pending.values())).deadline)
                if waiting:
                    marks.append(waiting[0].deadline)
                if idle_every is not None:
                    marks.append(next_idle)
                if paused_until:
                    marks.append(paused_until)
                if marks:
                    timeout = max(0.0, min(marks) - now)
                for key, _ in sel.select(timeout):
                    if key.data == "listen":
                        if not self._accept_batch(sel, pending, waiting):
                            sel.unregister(listener)
                            paused_until = time.monotonic() + _EMFILE_BACKOFF_S
                    elif key.data == "wake":
                        try:
                            while wake_r.recv(4096):
                                pass
                        except (BlockingIOError, OSError):
                            pass
                    else:
                        conn = key.data
                        assert isinstance(conn, _Conn)
                        self._read_prefix(sel, conn, pending, waiting)
                now = time.monotonic()
                if paused_until and now >= paused_until:
                    paused_until = 0.0
                    sel.register(listener, selectors.EVENT_READ, "listen")
                while pending:
                    conn = next(iter(pending.values()))
                    if conn.deadline > now:
                        break
                    del pending[conn.id]
                    sel.unregister(conn.client)
                    self._drop(conn, "first-byte timeout", "timeouts")
                while waiting and waiting[0].deadline <= now:
                    conn = waiting.popleft()
                    self._busy(conn)
                self._admit(waiting)
                if idle_every is not None and now >= next_idle:
                    next_idle = now + idle_every
                    self._reap_idle(now)
                with self._lock:
                    self._n_pending = len(pending) + len(waiting)
        finally:
            sel.close()
            for conn in list(pending.values()) + list(waiting):
                self._drop(conn, "router stopped", None)
            with self._lock:
                self._n_pending = 0
            listener.close()

    def _accept_batch(
        self,
        sel: selectors.BaseSelector,
        pending: dict[int, _Conn],
        waiting: collections.deque[_Conn],
    ) -> bool:
        """Accept what the kernel has queued. False when out of descriptors (caller backs off)."""
        listener = self._listener
        assert listener is not None
        for _ in range(_ACCEPT_BATCH):
            try:
                client, peer = listener.accept()
            except BlockingIOError:
                return True
            except OSError as e:
                # EMFILE/ENFILE/ENOBUFS: the listener stays readable; back off instead of spinning.
                log.warning("router %s accept failed: %s", self.name, e)
                return False
            now = time.monotonic()
            conn = _Conn(next(self._ids), client, peer, now)
            with self._lock:
                self._c["total"] += 1
            if len(pending) + len(waiting) >= self._max_pending:
                self._drop(conn, "queue full", "refused")
                continue
            client.setblocking(False)
            _set_nodelay(client)
            conn.deadline = now + self._first_byte_timeout
            pending[conn.id] = conn
            sel.register(client, selectors.EVENT_READ, conn)
            # Clients usually send right after connecting: read now rather than after
            # another trip through select (saves tens of microseconds per connection).
            self._read_prefix(sel, conn, pending, waiting)
        return True

    def _read_prefix(
        self,
        sel: selectors.BaseSelector,
        conn: _Conn,
        pending: dict[int, _Conn],
        waiting: collections.deque[_Conn],
    ) -> None:
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
            del pending[conn.id]
            sel.unregister(conn.client)
            self._drop(conn, "client closed before first bytes", None)
            return
        conn.prefix += data
        kind = classify(conn.prefix[:MAX_PREFIX])
        if kind is Kind.NEED_MORE:
            return
        del pending[conn.id]
        sel.unregister(conn.client)
        if kind is Kind.REJECT:
            self._drop(conn, f"unrecognised first bytes {conn.prefix.hex()}", "rejected")
            return
        conn.kind = kind
        # Checked only for these kinds: HTTP is open, and the check costs microseconds.
        if kind in (Kind.RPC, Kind.HYDRA) and not self._is_allowed(conn.peer):
            # ggml-rpc-server has no authentication: from a source outside the allow list it
            # must be unreachable, so close without a word.
            self._drop(conn, f"{kind.value} from a source not allow-listed", "denied")
            return
        conn.deadline = time.monotonic() + self._queue_timeout
        waiting.append(conn)

    def _admit(self, waiting: collections.deque[_Conn]) -> None:
        while waiting:
            with self._lock:
                if self._stopping or len(self._active) >= self._max_active:
                    return
                conn = waiting.popleft()
                assert conn.kind is not None
                self._active[conn.id] = conn
                self._by_kind[conn.kind.value] += 1
            self._run(self._relay, conn, self._upstreams)

    # ---------------------------------------------------------------- worker pool

    def _run(self, fn: Any, *args: Any) -> None:
        """Run fn(*args) on an idle worker thread, or on a new one if none is idle."""
        with self._lock:
            if self._idle_workers > 0:
                # Reserve the idle worker under the lock, so a worker that times out now
                # sees the task in the queue and stays (see _worker).
                self._idle_workers -= 1
                self._tasks.put((fn, args))
                return
            t = threading.Thread(
                target=self._worker, args=(fn, args), name=f"router-{self.name}", daemon=True
            )
            self._threads.add(t)
        t.start()

    def _worker(self, fn: Any, args: tuple[Any, ...]) -> None:
        try:
            while True:
                fn(*args)
                with self._lock:
                    if self._stopping or self._idle_workers >= _MAX_IDLE_WORKERS:
                        return
                    self._idle_workers += 1
                while True:
                    try:
                        item = self._tasks.get(timeout=_WORKER_IDLE_S)
                        break
                    except queue.Empty:
                        with self._lock:
                            if self._tasks.empty():  # nobody reserved us: retire
                                self._idle_workers -= 1
                                return
                if item is None:
                    return
                fn, args = item
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _busy(self, conn: _Conn) -> None:
        """A classified connection waited longer than queue_timeout for a relay slot."""
        if conn.kind is Kind.HTTP:
            try:
                conn.client.send(
                    http_error_response(503, "Service Unavailable", "hydra router: too busy")
                )
            except OSError:
                pass  # best effort on a non-blocking socket; we close either way
        self._drop(conn, "waited too long for a relay slot", "timeouts")

    def _reap_idle(self, now: float) -> None:
        idle = self._idle_timeout
        assert idle is not None
        with self._lock:
            for conn in self._active.values():
                if now - conn.last > idle:
                    conn.note(f"idle > {idle:g}s")
                    conn.shutdown_all()

    def _drop(self, conn: _Conn, reason: str, counter: str | None) -> None:
        """Close a connection that never reached the relay; one debug line, like a relay."""
        conn.note(reason)
        if counter is not None:  # count before the close is visible to the client
            with self._lock:
                self._c[counter] += 1
        try:
            conn.client.close()
        except OSError:
            pass
        self._log_close(conn)

    def _log_close(self, conn: _Conn) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        kind = conn.kind.value if conn.kind is not None else "-"
        target = _fmt_addr(conn.target) if conn.target else "-"
        log.debug(
            "router %s #%d %s %s->%s open %.3fs up=%dB down=%dB closed: %s",
            self.name,
            conn.id,
            _fmt_addr(conn.peer),
            kind,
            target,
            time.monotonic() - conn.accepted,
            conn.up,
            conn.down,
            conn.reason or "done",
        )

    # ---------------------------------------------------------------- relay

    def _connect(self, target: Addr) -> socket.socket:
        # Not socket.create_connection: its getaddrinfo costs tens of microseconds per
        # connection, and targets are numeric loopback addresses anyway.
        host = "127.0.0.1" if target[0] == "localhost" else target[0]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            _set_nodelay(sock)
            sock.settimeout(self._connect_timeout)
            sock.connect((host, target[1]))
            sock.settimeout(None)
            if self_connected(sock):  # the upstream is down and we hold its port: let go
                raise ConnectionRefusedError(111, "upstream down (self-connect)")
        except OSError:
            sock.close()
            raise
        return sock

    def _relay(self, conn: _Conn, ups: Upstreams) -> None:
        """Connect upstream, then pump upstream → client here and client → upstream on a
        second worker. This way round because the first read usually carried the whole
        request already, so the answer is on the critical path, not the rest of the upload."""
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
            conn.shutdown_all()
            with self._lock:
                conn.halves -= 1
        self._pump(conn, upstream, conn.client, False)

    def _open_upstream(self, conn: _Conn, ups: Upstreams) -> socket.socket | None:
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
                conn, f"{conn.kind.value} upstream {_fmt_addr(target)}: {e.strerror or e}"
            )
            return None
        with self._lock:
            conn.upstream = upstream
            stopping = self._stopping
        if stopping:
            conn.note("router stopped")
            return None
        conn.client.settimeout(None)
        conn.last = time.monotonic()
        try:
            upstream.sendall(conn.prefix)
        except OSError as e:
            conn.note(f"upstream send failed: {e.strerror or e}")
            return None
        conn.up += len(conn.prefix)
        return upstream

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        """One direction until EOF or error; the last direction to end closes the connection,
        so a half-closed stream stays open for as long as its other direction flows."""
        try:
            if self._pump_kind == "splice":
                eof = self._pump_splice(conn, src, dst, upward)
            else:
                eof = self._pump_copy(conn, src, dst, upward)
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

    @staticmethod
    def _pump_copy(conn: _Conn, src: socket.socket, dst: socket.socket, upward: bool) -> bool:
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
    def _pump_splice(conn: _Conn, src: socket.socket, dst: socket.socket, upward: bool) -> bool:
        # socket → pipe → socket inside the kernel: no copy through Python and the GIL is
        # released for the whole wait.
        r, w = os.pipe()
        try:
            try:
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:
                pass  # over the per-user pipe budget: the default 64 KiB pipe still works
            cap = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
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
        finally:
            os.close(r)
            os.close(w)

    def _upstream_down(self, conn: _Conn, reason: str) -> None:
        """Upstream missing or refusing: close the client now; HTTP gets a 503 with the reason."""
        conn.note(reason)
        with self._lock:
            self._c["upstream_errors"] += 1
        if conn.kind is not Kind.HTTP:
            return
        client = conn.client
        try:
            client.settimeout(_LINGER_DRAIN_S)
            client.sendall(
                http_error_response(503, "Service Unavailable", f"hydra router: {reason}")
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

    def _finish(self, conn: _Conn) -> None:
        with self._lock:
            for s in (conn.client, conn.upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
            self._active.pop(conn.id, None)
            self._c["bytes_up"] += conn.up
            self._c["bytes_down"] += conn.down
        self._log_close(conn)
        self._wake()
