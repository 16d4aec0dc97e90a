"""The router's byte relay and its worker threads: ggml-RPC and Hydra connections, both ways.

Each admitted ggml-RPC or Hydra connection gets two pooled workers with blocking sockets, one
per direction, moving bytes with ``os.splice`` (a kernel pipe, no copy through Python) or, as a
fallback, ``recv_into``/``sendall``. ggml-RPC is the per-token path: it stays a byte splice. A
Hydra connection's socket is handed to hydra's in-process wire server instead. The same worker
pool runs the HTTP sessions (router/http.py); ``_finish`` closes every admitted connection.

Why threads with blocking sockets and not asyncio: the ggml-RPC path is per-token, so the relay's
wake-up latency and CPU are paid on every decoded token. Measured (bench/router.py), a blocked
``recv``/``splice`` that the kernel wakes directly beats an event loop's epoll → callback →
write path in added latency and CPU; docs/router.md has the numbers. The threads release the GIL
while blocked, so the router lives happily inside the supervisor's asyncio process.

``Relay`` is a part of ``Router`` (router/core.py), which holds the state it reads and writes.
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
from typing import TYPE_CHECKING

from hydra_supervisor.plan.ports import self_connected
from hydra_supervisor.router import limits
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

# What a pooled worker is handed: a function and its arguments (None: exit).
Task = tuple[Callable[..., None], tuple[object, ...]]


class Relay:
    """The workers' part of ``Router``: the pool, the byte relay, closing a connection."""

    # The Router's state this part uses (router/core.py sets it in Router.__init__).
    name: str
    idle_timeout: float | None
    _lock: threading.Lock
    _stopping: bool
    _active: dict[int, Conn]
    _c: dict[str, int]
    _fds_active: int
    _connect_timeout: float
    _rpc_idle_timeout: float | None
    _pump_kind: str
    _idle_workers: int
    _tasks: queue.SimpleQueue[Task | None]
    _thread_factory: Callable[..., threading.Thread]
    _threads: set[threading.Thread]

    if TYPE_CHECKING:  # the Router's (core.py) and the acceptor's (acceptor.py)
        def count_refused(self, reason: str, detail: str = "", log_it: bool = True) -> None: ...
        def count_event(self, reason: str, detail: str = "") -> None: ...
        def _log_close(self, conn: Conn) -> None: ...
        def raw_http_target(self) -> Addr | None: ...
        def _wake(self) -> None: ...

    # ---------------------------------------------------------------- worker pool

    def _run(self, fn: Callable[..., None], *args: object) -> None:
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

    # ---------------------------------------------------------------- relay

    def _connect(self, target: Addr) -> socket.socket:
        """Connect to a local upstream. Out of descriptors is waited out (bounded by the
        connect timeout) rather than failing an admitted connection at once."""
        deadline = time.monotonic() + self._connect_timeout
        while True:
            try:
                return self.connect_once(target)
            except OSError as e:
                if e.errno not in _EMFILE or time.monotonic() >= deadline:
                    raise
                self.count_event("emfile_wait", f"{e.strerror or e}")
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
        target = self.raw_http_target() if conn.kind is Kind.HTTP else ups.for_kind(conn.kind)
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
