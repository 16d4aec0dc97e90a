"""A head host's local tunnel to a TLS-only peer (docs/multi-host.md "Over a network you do
not trust").

llama-server's ``--rpc`` speaks plain TCP only, so a head whose remote peer takes TLS points
``--rpc`` at ``TlsTunnel``: a listener on 127.0.0.1 (a port the kernel picks) whose every
connection is relayed over TLS to the peer's router (this host's certificate; the peer's
verified against the CA), both ways, by router/tls.py's one-thread pump. hydra's own probes
(HELLO, INFO) speak TLS to the peer directly (rpcproto.probe, buildid.ask_info), so they name
the real endpoint and say what TLS refused.

Who may use it: the tunnel carries this host's certificate, so a connection to it is taken
only from a socket owned by hydra's own user (its owner read from /proc/net/tcp, as `ss -e`
does): another local user cannot reach the peer through it. Connections refused so are
counted (``refused``) and logged.

Lifecycle: the Starter (proc/starting.py) starts one tunnel per TLS peer before the head that
uses it first starts, keeps it across that head's restarts (the head's argv keeps its
address), and the Supervisor closes it once the head has stopped for good. Threads: one
accepts, one per connection moves bytes; they decide nothing. The last TLS failure is kept as
a string (``last_error``) for the log and for a head that fails to start.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.plan.ports import endpoint_parts
from hydra_supervisor.router import tls
from hydra_supervisor.router.conn import set_keepalive, set_nodelay

log = logging.getLogger("hydra")

CONNECT_TIMEOUT_S = 10.0  # TCP connect plus the TLS handshake to the peer
_JOIN_S = 2.0
PROC_NET_TCP = "/proc/net/tcp"


def socket_owner(client_port: int, server_port: int, table: str = PROC_NET_TCP) -> int | None:
    """The uid owning the loopback socket 127.0.0.1:``client_port`` connected to
    127.0.0.1:``server_port`` (a line of the kernel's TCP table), or None when it is not there
    (already closed, or no such table)."""
    want_local = f"0100007F:{client_port:04X}"
    want_remote = f"0100007F:{server_port:04X}"
    try:
        with open(table, encoding="ascii") as f:
            next(f, None)  # the header
            for line in f:
                cols = line.split()
                if len(cols) > 7 and cols[1] == want_local and cols[2] == want_remote:
                    return int(cols[7])
    except OSError:
        return None
    return None


class _Counts:
    __slots__ = ("up", "down", "last")

    def __init__(self) -> None:
        self.up = 0
        self.down = 0
        self.last = 0.0


class TlsTunnel:
    """127.0.0.1:``port`` (plain) → ``endpoint`` (TLS with ``files``); see the module doc."""

    def __init__(self, endpoint: str, files: TlsFiles, *,
                 connect_timeout: float = CONNECT_TIMEOUT_S,
                 thread_factory: Callable[..., threading.Thread] = threading.Thread) -> None:
        host, port = endpoint_parts(endpoint)
        self.endpoint = endpoint
        self._target = (host.strip("[]"), port)
        self.files = files
        self._connect_timeout = connect_timeout
        self._thread_factory = thread_factory
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._open: set[socket.socket] = set()  # sockets of connections being relayed
        self._stopping = False
        self.port = 0
        self.last_error: str | None = None  # the last TLS failure with the peer (one line)
        self.connections = 0  # connections relayed since start
        self.refused = 0  # connections from a socket of another user, closed at once
        self._uid = os.getuid()

    @property
    def local(self) -> str:
        """``127.0.0.1:PORT``: what the head's --rpc names instead of the endpoint."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> str:
        """Load the TLS files (HydraError with error/fix when one does not load), bind,
        start accepting; returns ``local``. OSError when no port can be bound."""
        tls.client_context(self.files)
        listener = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.port = int(listener.getsockname()[1])
        self._listener = listener
        self._stopping = False
        t = self._thread_factory(target=self._accept_loop, args=(listener,),
                                 name=f"tunnel-{self.port}", daemon=True)
        t.start()
        with self._lock:
            self._threads.add(t)
        log.info("TLS tunnel %s -> %s (mutual TLS, CA %s)", self.local, self.endpoint,
                 self.files.ca)
        return self.local

    def running(self) -> bool:
        return self._listener is not None and not self._stopping

    def stop(self) -> None:
        """Close the listener and every relayed connection; join the threads (bounded)."""
        with self._lock:
            self._stopping = True
            listener, self._listener = self._listener, None
            socks = list(self._open)
            threads = list(self._threads)
        for s in ([listener] if listener is not None else []) + socks:
            try:  # wakes a thread blocked in accept or select (the plain socket's shutdown:
                # conn.py's shutdown_all says why)
                socket.socket.shutdown(s, socket.SHUT_RDWR)
            except OSError:
                pass
        if listener is not None:
            listener.close()
        for t in threads:
            if t is not threading.current_thread():
                t.join(_JOIN_S)

    # ---------------------------------------------------------------- threads

    def _accept_loop(self, listener: socket.socket) -> None:
        try:
            while not self._stopping:
                try:
                    client, peer = listener.accept()
                except OSError:
                    if self._stopping:
                        return
                    continue  # out of descriptors, or a connection reset before accept
                owner = socket_owner(int(peer[1]), self.port)
                if owner != self._uid:
                    self.refused += 1
                    log.warning("TLS tunnel %s: connection from 127.0.0.1:%s refused: its "
                                "socket belongs to uid %s, not hydra's (%d)", self.local,
                                peer[1], "unknown" if owner is None else owner, self._uid)
                    client.close()
                    continue
                set_nodelay(client)
                t = self._thread_factory(target=self._relay, args=(client,),
                                         name=f"tunnel-{self.port}-conn", daemon=True)
                with self._lock:
                    if self._stopping:
                        client.close()
                        return
                    self._open.add(client)
                    self._threads.add(t)
                try:
                    t.start()
                except RuntimeError as e:  # out of threads: this connection's failure
                    log.warning("TLS tunnel %s: no thread for a connection: %s", self.local, e)
                    self._forget(client, t)
                    client.close()
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _forget(self, sock: socket.socket, thread: threading.Thread | None = None) -> None:
        with self._lock:
            self._open.discard(sock)
            if thread is not None:
                self._threads.discard(thread)

    def _relay(self, client: socket.socket) -> None:
        me = threading.current_thread()
        upstream: socket.socket | None = None
        try:
            try:
                upstream = tls.connect(*self._target, self.files, self._connect_timeout)
            except OSError as e:
                said = tls.explain_line(e, self.endpoint, self.files)
                if said is not None:
                    self.last_error = said
                log.warning("TLS tunnel %s -> %s: %s", self.local, self.endpoint,
                            said or f"cannot connect: {e.strerror or e}")
                return
            with self._lock:
                if self._stopping:
                    return
                self._open.add(upstream)
            set_keepalive(upstream, rpc=True)  # a peer host that vanished is noticed
            self.connections += 1
            counts = _Counts()
            try:
                why = tls.pump(client, upstream, counts)
            except (OSError, ValueError) as e:  # ValueError: a TLS socket closed under it
                said = tls.explain_line(e, self.endpoint, self.files)
                if said is not None:
                    self.last_error = said
                why = said or f"error: {getattr(e, 'strerror', None) or e}"
            log.debug("TLS tunnel %s -> %s: %s after %d bytes up, %d down", self.local,
                      self.endpoint, why, counts.up, counts.down)
        finally:
            for s in (client, upstream):
                if s is not None:
                    self._forget(s)
                    s.close()
            self._forget(client, me)
