"""Whether an HTTP request may go upstream now: hold/release, unavailability, in-flight requests.

The engine holds the router while its head is not serving (restart, switch) and releases it when
the head is ready again; requests that arrive meanwhile are parked here, bounded in time
(``hold_timeout``) and number (``max_held``). ``set_unavailable`` answers at once instead (no
model loaded, say). Requests sent upstream are registered as *flights*, so the engine can wait
for them to drain (``wait_idle``) or abort them (``cut_inflight``).

No sockets are read or written here; a flight only knows how to shut its upstream socket down
(which wakes the session thread blocked on it), and ``owed_for`` asks the kernel about those
sockets (TCP_INFO, FIONREAD) for the supervisor's stall rule. One ``threading.Condition`` guards
everything, so every method is safe from any thread, and the non-blocking ones return in
microseconds.
"""

from __future__ import annotations

import fcntl
import itertools
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_RETRY_AFTER = 5
HOLD_TIMEOUT_S = 120.0  # how long a held request waits for its release (then 503)
MAX_HELD = 1024  # how many requests one gate holds at once (then 503 at once)


@dataclass(frozen=True)
class Refusal:
    """Why a request is answered by the router instead of going upstream."""

    status: int
    message: str
    retry_after: int
    outcome: str  # the on_request record's outcome: held_timeout | error
    counter: str  # the stats "refused" reason it is counted under


class Flight:
    """One HTTP request sent upstream whose response has not completed."""

    __slots__ = ("id", "upstream", "attached", "cut", "answered", "requeue")

    def __init__(self, fid: int) -> None:
        self.id = fid
        self.upstream: socket.socket | None = None
        self.attached: float | None = None  # the gate's clock when the upstream socket came
        self.cut: str | None = None  # set by cut_inflight: why it was aborted
        self.answered = False  # the upstream sent a response byte (set by the session)
        self.requeue = False  # cut by a planned change before any response byte: send again

    def abort(self) -> None:
        s = self.upstream
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the session thread; it closes the fd
            except OSError:
                pass


@dataclass(frozen=True)
class Wire:
    """What the kernel says of one upstream socket, without touching its bytes."""

    sent_ago: float  # seconds since a data byte last went to the upstream (TCP_INFO)
    recv_ago: float  # seconds since a data byte last came from the upstream (TCP_INFO)
    unread: int  # bytes the upstream sent that the router has not read yet (FIONREAD)


def read_wire(sock: socket.socket) -> Wire | None:
    """`sock`'s Wire from the kernel; None when it is closed or closing this instant."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        # struct tcp_info: tcpi_last_data_sent at byte 44, tcpi_last_data_recv at 52 (in ms)
        sent, recv = struct.unpack_from("=I4xI", info, 44)
        (unread,) = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))
    except (OSError, ValueError, struct.error):
        return None
    return Wire(sent / 1000.0, recv / 1000.0, unread)


def owed(wire: Wire | None, attached_ago: float) -> float:
    """Seconds one request in flight has been owed a byte by its upstream: since the later of
    the last byte of its request going up (nothing is owed while the request itself is still
    being sent: a slow upload) and the last byte that came back — and at most since the
    request got its socket (a pooled connection's clocks are older than the request). Bytes
    the upstream sent that wait unread (a slow client holding the router back) mean it owes
    nothing; a socket closing this instant neither."""
    if wire is None or wire.unread:
        return 0.0
    return max(0.0, min(attached_ago, wire.sent_ago, wire.recv_ago))


class Gate:
    def __init__(self, hold_timeout: float = HOLD_TIMEOUT_S, max_held: int = MAX_HELD, *,
                 clock: Callable[[], float] = time.monotonic,
                 wire: Callable[[socket.socket], Wire | None] = read_wire) -> None:
        if hold_timeout <= 0 or max_held < 1:
            raise ValueError("hold_timeout must be positive and max_held at least 1")
        self.hold_timeout = hold_timeout
        self.max_held = max_held
        self._clock = clock  # owed_for's clock (the attach times); waits use time.monotonic
        self._wire = wire
        self._cond = threading.Condition()
        self._held_reason: str | None = None
        self._unavailable: tuple[str, int] | None = None
        self._stopping = False
        self._held = 0
        self._flights: dict[int, Flight] = {}
        self._ids = itertools.count(1)

    # ------------------------------------------------------------ engine side

    def hold(self, reason: str) -> None:
        with self._cond:
            self._held_reason = reason or "held"

    def release(self) -> None:
        with self._cond:
            self._held_reason = None
            self._cond.notify_all()

    def set_unavailable(self, reason: str | None, retry_after: int = DEFAULT_RETRY_AFTER) -> None:
        with self._cond:
            self._unavailable = None if reason is None else (reason, max(0, int(retry_after)))
            self._cond.notify_all()  # parked requests get the 503 now, not at their timeout

    @property
    def held_reason(self) -> str | None:
        return self._held_reason

    def unavailable_reason(self) -> str | None:
        with self._cond:
            return self._unavailable[0] if self._unavailable is not None else None

    def held(self) -> int:
        with self._cond:
            return self._held

    def inflight(self) -> int:
        with self._cond:
            return len(self._flights)

    def owed_for(self) -> float | None:
        """How long the upstream has owed a byte: the longest any request in flight has waited
        for one (`owed`: since its request went up or the last byte came back, as the kernel
        saw it on its upstream socket) — the oldest request owed something, however many new
        ones go up meanwhile. None when no request in flight has its upstream socket yet.
        Read-only, and it asks the head nothing, so a head frozen mid-request is seen too: the
        supervisor's stall rule reads it (proc/watching.py, docs/supervision.md)."""
        now = self._clock()
        with self._cond:
            socks = [(f.upstream, f.attached) for f in self._flights.values()
                     if f.upstream is not None and f.attached is not None]
        if not socks:
            return None
        return max(owed(self._wire(sock), now - attached) for sock, attached in socks)

    def wait_idle(self, timeout: float) -> int:
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._flights:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return len(self._flights)

    def cut_inflight(self, reason: str, requeue: bool = False) -> int:
        """Abort every flight; how many were cut. `requeue` (a planned change whose drain
        ran out): a flight with no response byte yet is not cut but sent again once the gate
        lets it (held meanwhile, like a crash's retry); only partial responses count."""
        with self._cond:
            flights = list(self._flights.values())
            cut = 0
            for f in flights:
                f.cut = reason or "cut"
                f.requeue = requeue and not f.answered
                cut += not f.requeue
                f.abort()
            return cut

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            for f in self._flights.values():
                f.cut = f.cut or "router stopped"
                f.abort()
            self._cond.notify_all()

    def restart(self) -> None:
        with self._cond:
            self._stopping = False

    # ------------------------------------------------------------ session side

    def refusal_now(self) -> Refusal | None:
        """The 503 a new request gets without waiting (unavailable, stopping), or None."""
        with self._cond:
            return self._refusal_locked()

    def _refusal_locked(self) -> Refusal | None:
        if self._stopping:
            return Refusal(503, "router stopping", DEFAULT_RETRY_AFTER, "error", "stopping")
        if self._unavailable is not None:
            msg, after = self._unavailable
            return Refusal(503, msg, after, "error", "unavailable")
        return None

    def wait_turn(self, delay: float = 0.0) -> Refusal | None:
        """Block while the router is held (parked, bounded); None means "go upstream now".

        ``delay`` first waits that long (the retry of a request whose upstream refused: give the
        engine a moment to notice and hold); a stop or set_unavailable ends the wait early."""
        with self._cond:
            if delay > 0:
                end = time.monotonic() + delay
                while self._refusal_locked() is None:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            refusal = self._refusal_locked()
            if refusal is not None or self._held_reason is None:
                return refusal
            if self._held >= self.max_held:
                return Refusal(
                    503,
                    f"{self._held_reason} (already {self.max_held} requests waiting)",
                    DEFAULT_RETRY_AFTER,
                    "error",
                    "held_full",
                )
            self._held += 1
            deadline = time.monotonic() + self.hold_timeout
            try:
                while self._held_reason is not None:
                    refusal = self._refusal_locked()
                    if refusal is not None:
                        return refusal
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return Refusal(
                            503,
                            f"{self._held_reason} (request held {self.hold_timeout:g}s)",
                            DEFAULT_RETRY_AFTER,
                            "held_timeout",
                            "held_timeout",
                        )
                    self._cond.wait(left)
                return self._refusal_locked()
            finally:
                self._held -= 1

    def begin(self) -> Flight:
        with self._cond:
            f = Flight(next(self._ids))
            self._flights[f.id] = f
            return f

    def attach(self, flight: Flight, upstream: socket.socket) -> bool:
        """Give the flight its upstream socket; False if it was cut meanwhile."""
        now = self._clock()
        with self._cond:
            flight.upstream = upstream
            flight.attached = now
            return flight.cut is None

    def end(self, flight: Flight) -> None:
        with self._cond:
            flight.upstream = None
            if self._flights.pop(flight.id, None) is not None and not self._flights:
                self._cond.notify_all()
