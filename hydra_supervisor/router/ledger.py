"""What the router's threads share: the connections admitted, the descriptors they hold, whether
the router is stopping, and the counters every part reports into.

``Ledger`` is that state, under one lock. The acceptor (router/acceptor.py) admits connections
into it against the descriptor budget and ``max_active``; the relay (router/relay.py) closes
them out of it; HTTP sessions (router/http.py) count their requests in it; the ``Router``
(router/core.py) resets it at start, flips it to stopping, and reads ``counts()`` for its stats.
Every operation that must not interleave with another thread's (a socket shut down while
another thread closes it, a slot taken while stop() sweeps the table) is one method here.
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TypedDict

from hydra_supervisor.router.classify import Kind
from hydra_supervisor.router.conn import Conn, fmt_addr
from hydra_supervisor.router.replies import Record, RequestRecord

log = logging.getLogger("hydra.router")

_LOG_EVERY_S = 10.0
# An idle keep-alive connection is closed for room only after this long idle: a client that is
# about to send its next request has usually sent it by then.
_IDLE_CLOSE_MIN_S = 0.05
# The builds remembered per source address (router/acceptor.py: a head's INFO request).
_MAX_BUILDS = 256
_MAX_BUILD_LABEL = 200


class FdCounts(TypedDict):
    nofile: int  # the soft open-file limit in force
    budget: int  # descriptors admission may use for relays
    relays: int  # descriptors the admitted connections hold now


class RpcHolder(TypedDict):
    """The head holding the port's rpc-server (``Ledger.rpc_holder``): its address, the
    build its hydra announced in an INFO request from that address (None: unknown, e.g. a
    plain llama-server), how long it has held it and the bytes each way so far."""

    addr: str
    build: str | None
    held_s: float
    bytes_up: int  # head → rpc-server (weights, tensors, graphs)
    bytes_down: int  # rpc-server → head


class LedgerCounts(TypedDict):
    """One consistent reading of the ledger (``Ledger.counts``)."""

    accepted: int
    bytes_up: int
    bytes_down: int
    refused: dict[str, int]
    events: dict[str, int]
    open: int
    open_peak: int
    pending: int
    by_kind: dict[str, int]
    http: dict[str, int]
    fds: FdCounts
    rpc_holder: RpcHolder | None


class Ledger:
    """The router's shared state, one lock: admitted connections and their descriptors (against
    the budget and ``max_active``), the stopping flag, and the counters. Thread-safe; every
    method returns at once."""

    def __init__(self, name: str, *, max_active: int | None,
                 on_request: Callable[[RequestRecord], None] | None = None) -> None:
        self.name = name
        self.max_active = max_active
        self._on_request = on_request
        self._lock = threading.Lock()
        # Written under the lock; read without it by loops that only need to notice it soon.
        self.stopping = False
        self._active: dict[int, Conn] = {}
        self._fds_active = 0
        self._fd_budget = 0
        self._nofile = 0
        self._open_peak = 0
        self._n_pending = 0
        self._c = {"accepted": 0, "bytes_up": 0, "bytes_down": 0}
        self._refused: collections.Counter[str] = collections.Counter()
        self._events: collections.Counter[str] = collections.Counter()
        self._http = {"requests": 0, "1xx": 0, "2xx": 0, "3xx": 0, "4xx": 0, "5xx": 0,
                      "cut": 0, "retried": 0}
        self._by_kind = {k.value: 0 for k in (Kind.RPC, Kind.HYDRA, Kind.HTTP)}
        self._log_marks: dict[str, tuple[float, int]] = {}
        # Builds announced by the hydra of each source address (its INFO request), newest
        # last; bounded: an old entry makes room.
        self._builds: dict[str, str] = {}

    # ---------------------------------------------------------------- start, stop

    def begin(self, fd_budget: int, nofile: int) -> None:
        """A (re)start: not stopping; admission sized to ``fd_budget`` descriptors."""
        with self._lock:
            self.stopping = False
            self._fd_budget = fd_budget
            self._nofile = nofile

    def stop(self, reason: str) -> bool:
        """Turn to stopping and shut every admitted connection down (their threads then end
        and close them). False when already stopping."""
        with self._lock:
            if self.stopping:
                return False
            self.stopping = True
            # Under the lock: finish() closes sockets under it, so no fd is reused under us.
            for conn in self._active.values():
                conn.note(reason)
                conn.shutdown_all()
        return True

    # ---------------------------------------------------------------- admitted connections

    def admit(self, conn: Conn, cost: int, room_for: int) -> bool:
        """Admit ``conn`` holding ``cost`` descriptors. False while stopping, or when
        ``max_active`` or the descriptor budget leave no room: up to ``room_for`` HTTP
        connections idle between requests are then closed to make some."""
        with self._lock:
            if self.stopping:
                return False
            full = self.max_active is not None and len(self._active) >= self.max_active
            if full or (self._fds_active + cost > self._fd_budget and self._active):
                # Wait for a relay to end rather than fail one with EMFILE; idle keep-alive
                # connections (between requests) are closed to make room, as HTTP allows.
                self._close_idle_locked(room_for)
                return False
            conn.cost = cost
            self._fds_active += cost
            self._active[conn.id] = conn
            self._open_peak = max(self._open_peak, len(self._active))
            assert conn.kind is not None
            self._by_kind[conn.kind.value] += 1
        return True

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

    def unadmit(self, conn: Conn) -> None:
        """Give back an admitted connection's slot that never ran (no thread for it)."""
        with self._lock:
            self._active.pop(conn.id, None)
            self._fds_active -= conn.cost
            conn.cost = 0

    def finish(self, conn: Conn) -> None:
        """Close an admitted connection's sockets, free its slot and keep its byte counts."""
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

    def attach_upstream(self, conn: Conn, upstream: socket.socket) -> bool:
        """``conn`` now has ``upstream`` (stop() shuts it down with the client); False when
        the router is stopping."""
        with self._lock:
            conn.upstream = upstream
            return not self.stopping

    def detach_client(self, conn: Conn) -> socket.socket | None:
        """The client socket as a new socket object the router no longer closes (a hand-off);
        None when the router is stopping (stop() may be shutting it down)."""
        with self._lock:
            if self.stopping:
                return None
            c = conn.client
            if isinstance(c, ssl.SSLSocket):  # the TLS session goes with it, not just the fd
                gone = socket.socket(c.family, c.type, c.proto)
                gone.close()
                conn.client = gone
                return c
            return socket.socket(c.family, c.type, c.proto, fileno=c.detach())

    def half_ended(self, conn: Conn) -> bool:
        """One of a relay's two directions ended; True when it was the last."""
        with self._lock:
            conn.halves -= 1
            return conn.halves == 0

    def each_active(self, fn: Callable[[Conn], None]) -> None:
        """``fn(conn)`` for every admitted connection, under the lock (so none of their
        sockets is closed meanwhile: ``fn`` may shut them down). ``fn`` must be quick."""
        with self._lock:
            for conn in self._active.values():
                fn(conn)

    def rpc_holder_conn(self) -> Conn | None:
        """The admitted ggml-RPC connection, if any: it holds the rpc-server (which serves one
        client at a time), so another one is not let through while it lasts."""
        with self._lock:
            return self._rpc_holder_locked()

    def _rpc_holder_locked(self) -> Conn | None:
        held = [c for c in self._active.values() if c.kind is Kind.RPC]
        return min(held, key=lambda c: c.id) if held else None

    def rpc_holder(self) -> RpcHolder | None:
        """Who holds the rpc-server now (address, build if announced, since, bytes)."""
        with self._lock:
            return self._holder_locked(time.monotonic())

    def _holder_locked(self, now: float) -> RpcHolder | None:
        conn = self._rpc_holder_locked()
        if conn is None:
            return None
        return RpcHolder(addr=fmt_addr(conn.peer), build=self._builds.get(conn.src),
                         held_s=round(max(0.0, now - conn.accepted), 3),
                         bytes_up=conn.up, bytes_down=conn.down)

    def note_build(self, src: str, build: str) -> None:
        """The hydra at ``src`` said its build (its INFO request's ``head``)."""
        with self._lock:
            self._builds.pop(src, None)
            self._builds[src] = build[:_MAX_BUILD_LABEL]
            while len(self._builds) > _MAX_BUILDS:
                del self._builds[next(iter(self._builds))]

    def set_pending(self, n: int) -> None:
        """Connections the acceptor holds, not yet admitted (silent or waiting)."""
        with self._lock:
            self._n_pending = n

    # ---------------------------------------------------------------- counting

    def count_accepted(self) -> None:
        with self._lock:
            self._c["accepted"] += 1

    def count_refused(self, reason: str, detail: str = "", log_it: bool = True) -> None:
        """Count a refused connection or request under ``reason`` (stats "refused")."""
        self._count(self._refused, reason, detail, log_it)

    def count_event(self, reason: str, detail: str = "", log_it: bool = True) -> None:
        """Count something survived, not refused (stats "events"): EMFILE waited out, a
        small pipe, a kernel accept failure."""
        self._count(self._events, reason, detail, log_it)

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
        """One HTTP request done: counted, logged (DEBUG), and given to ``on_request``; its
        entry in the router's Traffic ends. Once per request (a second call does nothing)."""
        if rec.done:
            return
        rec.done = True
        now = time.monotonic()
        if rec.tally is not None:
            rec.tally.end(rec.status, rec.ending())
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

    def log_close(self, conn: Conn) -> None:
        """The DEBUG line of a closed connection (admitted or not)."""
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

    def counts(self) -> LedgerCounts:
        """Everything counted, read at one instant (bytes include the open connections')."""
        with self._lock:
            bytes_up = self._c["bytes_up"] + sum(c.up for c in self._active.values())
            bytes_down = self._c["bytes_down"] + sum(c.down for c in self._active.values())
            return LedgerCounts(
                accepted=self._c["accepted"], bytes_up=bytes_up, bytes_down=bytes_down,
                refused=dict(self._refused), events=dict(self._events),
                open=len(self._active), open_peak=self._open_peak, pending=self._n_pending,
                by_kind=dict(self._by_kind), http=dict(self._http),
                fds=FdCounts(nofile=self._nofile, budget=self._fd_budget,
                             relays=self._fds_active),
                rpc_holder=self._holder_locked(time.monotonic()))
