"""The router's worker threads and its byte relay: ggml-RPC and Hydra connections, both ways.

``WorkerPool``: pooled threads that run what the acceptor admits. ``Relay``: what runs on them.
Each admitted ggml-RPC or Hydra connection gets two workers with blocking sockets, one per
direction, moving bytes with ``os.splice`` (a kernel pipe, no copy through Python) or, as a
fallback, ``recv_into``/``sendall``. ggml-RPC is the per-token path: it stays a byte splice. A
Hydra connection's socket is handed to hydra's in-process wire server instead. An HTTP
connection runs on one worker the session the ``Router`` gives (router/http.py); ``finish``
closes every admitted connection.

Why threads with blocking sockets and not asyncio: the ggml-RPC path is per-token, so the relay's
wake-up latency and CPU are paid on every decoded token. Measured (bench/router.py), a blocked
``recv``/``splice`` that the kernel wakes directly beats an event loop's epoll → callback →
write path in added latency and CPU; docs/router.md has the numbers. The threads release the GIL
while blocked, so the router lives happily inside the supervisor's asyncio process.

The acceptor (router/acceptor.py) hands ``Relay`` the connections it admitted; the router's
shared state (admitted connections, stopping, counters) is the ``Ledger`` (router/ledger.py).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable

from hydra_supervisor.plan.ports import self_connected
from hydra_supervisor.router import limits, tls
from hydra_supervisor.router.classify import Kind
from hydra_supervisor.router.conn import (
    Addr,
    Conn,
    Handoff,
    Upstreams,
    fmt_addr,
    set_keepalive,
    set_nodelay,
)
from hydra_supervisor.router.gate import DEFAULT_RETRY_AFTER
from hydra_supervisor.router.ledger import Ledger
from hydra_supervisor.router.replies import http_error_response

log = logging.getLogger("hydra.router")


# Relay copy buffer (copy pump) and kernel pipe size (splice pump). Large enough that a bulk
# transfer is not syscall-bound; small messages (ggml-RPC commands) are unaffected by either.
COPY_BUFFER = 256 * 1024
PIPE_SIZE = 1024 * 1024

# Relay threads are pooled: starting a thread costs ~50-80 us of the new-connection latency, a
# hand-off to an idle one ~10 us. Idle workers beyond the cap, or idle too long, exit.
_MAX_IDLE_WORKERS = 64
_WORKER_IDLE_S = 30.0
_EMFILE = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

PUMPS = ("splice", "copy")
HTTP_MODES = ("aware", "raw")

# What a pooled worker is handed: a function and its arguments (None: exit).
Task = tuple[Callable[..., None], tuple[object, ...]]


class WorkerPool:
    """Pooled worker threads (small stacks, router/limits.py): ``run`` hands a function to an
    idle one or starts a new one. Stopped, and started again, with the router."""

    def __init__(self, name: str, thread_factory: Callable[..., threading.Thread]) -> None:
        self.name = name
        self._thread_factory = thread_factory
        self._lock = threading.Lock()
        self._stopping = False
        self._threads: set[threading.Thread] = set()
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._idle_workers = 0

    def start(self) -> None:
        """A (re)start: a fresh task queue (workers left from a previous run keep theirs)."""
        with self._lock:
            self._stopping = False
            self._tasks = queue.SimpleQueue()
            self._idle_workers = 0

    def run(self, fn: Callable[..., None], *args: object) -> None:
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

    def _worker(self, fn: Callable[..., None], args: tuple[object, ...],
                tasks: queue.SimpleQueue[Task | None]) -> None:
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

    def stop(self, deadline: float) -> None:
        """Idle workers exit, busy ones after their task; joined until ``deadline`` (the
        router has shut their connections down already)."""
        with self._lock:
            self._stopping = True
            for _ in range(self._idle_workers):
                self._tasks.put(None)  # idle workers exit on this
            self._idle_workers = 0
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


class Relay:
    """What the workers run for admitted connections: the byte relay (ggml-RPC; HTTP with
    ``http="raw"``), the Hydra wire hand-off, and HTTP sessions (``session``, the router's);
    connecting to the local upstreams; closing an admitted connection (``finish``)."""

    def __init__(
        self,
        ledger: Ledger,
        workers: WorkerPool,
        *,
        name: str,
        pump: str,
        http_mode: str,
        connect_timeout: float,
        idle_timeout: float | None,
        rpc_idle_timeout: float | None,
        session: Callable[[Conn], None],
        raw_http_target: Callable[[], Addr | None],
        wake: Callable[[], None],
    ) -> None:
        self.name = name
        self.ledger = ledger
        self.workers = workers
        self.pump_kind = pump
        self.http_mode = http_mode
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._rpc_idle_timeout = rpc_idle_timeout
        self._session = session  # runs one HTTP connection's session to its end
        self._raw_http_target = raw_http_target  # where http="raw" relays HTTP bytes
        self._wake = wake  # a slot freed: the acceptor looks at its waiting queue again

    # ---------------------------------------------------------------- for the acceptor

    def fd_cost(self, kind: Kind) -> int:
        """Descriptors a connection of ``kind`` holds once admitted (router/limits.py)."""
        if kind is Kind.HTTP and self.http_mode == "aware":
            return limits.FDS_HTTP
        return limits.FDS_SPLICE if self.pump_kind == "splice" else limits.FDS_HTTP

    def serve(self, conn: Conn, ups: Upstreams) -> None:
        """Run an admitted connection on a worker: an HTTP session, or the byte relay to
        ``ups``. Raises RuntimeError when no thread can be started for it."""
        if conn.kind is Kind.HTTP and self.http_mode == "aware":
            conn.session = True
            self.workers.run(self._run_session, conn)
        else:
            self.workers.run(self._relay, conn, ups)

    def reap_idle(self, now: float) -> None:
        """Byte relays with no traffic past their idle timeout. HTTP sessions time their own
        idleness; ggml-RPC links have none by default (a head may be quiet for hours)."""
        http_idle, rpc_idle = self._idle_timeout, self._rpc_idle_timeout

        def reap(conn: Conn) -> None:
            if conn.session:
                return
            idle = http_idle if conn.kind is Kind.HTTP else rpc_idle
            if idle is not None and now - conn.last > idle:
                conn.note(f"idle > {idle:g}s")
                conn.shutdown_all()

        self.ledger.each_active(reap)

    def _run_session(self, conn: Conn) -> None:
        try:
            self._session(conn)
        except Exception:  # a bug in one session must not leak its sockets or kill the worker
            log.exception("router %s #%d: HTTP session failed", self.name, conn.id)
            conn.note("session error")
        finally:
            self.finish(conn)

    # ---------------------------------------------------------------- relay

    def connect(self, target: Addr) -> socket.socket:
        """Connect to a local upstream. Out of descriptors is waited out (bounded by the
        connect timeout) rather than failing an admitted connection at once."""
        deadline = time.monotonic() + self._connect_timeout
        while True:
            try:
                return self.connect_once(target)
            except OSError as e:
                if e.errno not in _EMFILE or time.monotonic() >= deadline:
                    raise
                self.ledger.count_event("emfile_wait", f"{e.strerror or e}")
                time.sleep(0.05)

    def connect_once(self, target: Addr) -> socket.socket:
        """One attempt to connect to a local upstream (no wait for descriptors); an HTTP
        session probes whether its upstream still listens with it."""
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
            self.finish(conn)
            raise
        if upstream is None:
            self.finish(conn)
            return
        if conn.tls is not None:
            self._pump_tls(conn, upstream)
            return
        try:
            self.workers.run(self._pump, conn, conn.client, upstream, True)
        except RuntimeError as e:  # "can't start new thread": out of threads or memory
            conn.note(f"no relay thread: {e}")
            self.ledger.count_refused("thread_start", str(e))
            conn.shutdown_all()
            self.ledger.half_ended(conn)
        self._pump(conn, upstream, conn.client, False)

    def _hand_off(self, conn: Conn, to: Handoff) -> None:
        """Give the client socket itself to an in-process server (hydra's wire server), with
        the client's address and the bytes read so far: nothing is relayed, and the server
        authenticates the client, not the router. The connection then leaves the router."""
        try:
            sock = self.ledger.detach_client(conn)  # None while stop() shuts it down
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
                self.ledger.count_refused("upstream_down", f"wire hand-off: {e}")
                sock.close()
        finally:
            self.finish(conn)  # the detached client socket is no longer the router's

    def _open_upstream(self, conn: Conn, ups: Upstreams) -> socket.socket | None:
        """Connect to the connection's upstream and forward the classified prefix.
        None when that failed; the client has then been answered (HTTP 503) or closed."""
        assert conn.kind is not None
        target = self._raw_http_target() if conn.kind is Kind.HTTP else ups.for_kind(conn.kind)
        conn.target = target
        if target is None:
            self._upstream_down(conn, f"no {conn.kind.value} upstream configured")
            return None
        try:
            upstream = self.connect(target)
        except OSError as e:
            self._upstream_down(
                conn, f"{conn.kind.value} upstream {fmt_addr(target)}: {e.strerror or e}"
            )
            return None
        if not self.ledger.attach_upstream(conn, upstream):
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
            pipe = self._pipe() if self.pump_kind == "splice" else None
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
            if self.ledger.half_ended(conn):
                self.finish(conn)

    def _pump_tls(self, conn: Conn, upstream: socket.socket) -> None:
        """A TLS client (a peer host's TLS-only port): both directions on this one worker
        (router/tls.py says why); the first EOF ends the connection."""
        try:
            conn.note(tls.pump(conn.client, upstream, conn))
        except (OSError, ValueError) as e:  # ValueError: a TLS socket closed under it
            conn.note(f"TLS relay error: {getattr(e, 'strerror', None) or e}")
        finally:
            conn.shutdown_all()
            self.finish(conn)

    def _pipe(self) -> tuple[int, int, int] | None:
        """(read fd, write fd, capacity) for the splice pump, or None to use the copy pump:
        out of descriptors, or a pipe too small to be worth it (an unprivileged user past
        pipe-user-pages-soft gets one page). Never a reason to fail the relay."""
        try:
            r, w = os.pipe()
        except OSError as e:
            self.ledger.count_event("pipe_unavailable", f"{e.strerror or e}; copying instead")
            return None
        cap = limits.pipe_capacity(w, PIPE_SIZE)
        if cap < limits.MIN_PIPE:
            os.close(r)
            os.close(w)
            self.ledger.count_event("pipe_small", f"pipe of {cap} bytes; copying instead")
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
        self.ledger.count_refused("upstream_down", reason)
        if conn.kind is not Kind.HTTP:
            return
        client = conn.client
        try:
            client.settimeout(limits.LINGER_DRAIN_S)
            client.sendall(
                http_error_response(503, f"hydra router: {reason}",
                                    DEFAULT_RETRY_AFTER)
            )
            client.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + limits.LINGER_DRAIN_S
            drained = 0
            while drained < limits.LINGER_DRAIN_BYTES and time.monotonic() < deadline:
                client.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = client.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass  # the client went away first; nothing left to tell it

    def finish(self, conn: Conn) -> None:
        """Close an admitted connection and free its slot; the acceptor looks again."""
        self.ledger.finish(conn)
        self.ledger.log_close(conn)
        self._wake()
