"""Routes: several upstreams behind one router port, picked per HTTP request (by its `model`).

A Route is what one profile on a shared port has in the router: its own Gate (hold, release,
unavailable, in-flight flights, so one profile can load or drain while the others serve), its
own HTTP upstream, and an optional Limiter (at most N requests upstream, M more waiting, 429
past that). The router asks a *table* (a callable the engine side provides) for the route of
each request once it has read the request's method, path and `model`; the table may also answer
the request itself (a LocalReply: `/v1/models`, or 404 for an unknown model).

No sockets here; every method is thread-safe (session threads call them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

from hydra_supervisor.router.gate import DEFAULT_RETRY_AFTER, Gate, Refusal
from hydra_supervisor.router.replies import JSONValue

Addr = tuple[str, int]
log = logging.getLogger("hydra.router")


@dataclass(frozen=True)
class LocalReply:
    """The router answers the request itself with this JSON (no upstream is involved)."""

    status: int
    body: Mapping[str, JSONValue] | Sequence[JSONValue]  # a JSON object or array
    counter: str = "local"  # the stats "refused" reason (statuses >= 400) it is counted under


class RouteStats(TypedDict):
    """``Route.stats()``: one lane's counters in its port's router."""

    requests: int
    held: int
    inflight: int
    held_reason: str | None
    idle_s: float
    running: int | None  # with a limiter: requests upstream now, and waiting for a slot
    waiting: int | None


class Limiter:
    """At most `limit` requests upstream at once; `queue` more wait (bounded by their timeout);
    past that a request is refused with 429 at once."""

    def __init__(self, name: str, limit: int, queue: int) -> None:
        if limit < 1 or queue < 0:
            raise ValueError("limit must be at least 1 and queue at least 0")
        self.name = name
        self.limit = limit
        self.queue = queue
        self._cond = threading.Condition()
        self._running = 0
        self._waiting = 0

    def acquire(self, timeout: float) -> Refusal | None:
        with self._cond:
            if self._running < self.limit and self._waiting == 0:
                self._running += 1
                return None
            if self._waiting >= self.queue:
                return self._too_many()
            self._waiting += 1
            deadline = time.monotonic() + timeout
            try:
                while self._running >= self.limit:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return Refusal(
                            429, f"profile {self.name}: waited {timeout:g}s for one of its "
                            f"{self.limit} request slots", 1, "held_timeout", "queue_timeout")
                    self._cond.wait(left)
                self._running += 1
                return None
            finally:
                self._waiting -= 1

    def _too_many(self) -> Refusal:
        return Refusal(429, f"profile {self.name} is busy: {self._running} requests running "
                       f"and {self._waiting} waiting (concurrency {self.limit}, queue "
                       f"{self.queue})", 1, "error", "queue_full")

    def release(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify()

    def counts(self) -> tuple[int, int]:
        with self._cond:
            return self._running, self._waiting


@dataclass
class Route:
    """One lane's way through its port's router: its gate, its HTTP upstream, its limiter.

    The lane that owns it (serve/lane.py) is the only writer of its gate and upstream; router
    session threads read them. `where` names the port in log lines."""

    name: str
    gate: Gate
    http: Addr | None = None
    limiter: Limiter | None = None
    last_used: float = field(default_factory=time.monotonic)  # monotonic: request start/end
    requests: int = 0
    where: str = ""
    # The clock of last_used and idle (its owner's policy clock; tests move one).
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def label(self) -> str:
        return f"{self.where} / {self.name}" if self.where else self.name

    def hold(self, reason: str) -> None:
        """Park new requests of this lane until release() (bounded: gate.py)."""
        same = self.gate.held_reason == reason
        self.gate.hold(reason)
        if not same:
            log.info("router %s: holding new requests (%s)", self.label, reason)

    def release(self) -> None:
        held = self.gate.held()
        self.gate.release()
        log.info("router %s: released (%d requests were held)", self.label, held)

    def set_unavailable(self, reason: str | None, retry_after: int = DEFAULT_RETRY_AFTER) -> None:
        """New (and parked) requests get 503 `reason` with Retry-After; None clears."""
        if reason != self.gate.unavailable_reason():
            log.info("router %s: %s", self.label,
                     f"unavailable: {reason}" if reason is not None else "available")
        self.gate.set_unavailable(reason, retry_after)

    def wait_idle(self, timeout: float) -> int:
        return self.gate.wait_idle(timeout)

    def cut_inflight(self, reason: str, requeue: bool = False) -> int:
        n = self.gate.cut_inflight(reason, requeue)
        if n:
            log.info("router %s: cut %d in-flight requests (%s)", self.label, n, reason)
        return n

    def touch(self) -> None:
        with self._lock:
            self.last_used = self.clock()

    def started(self) -> None:
        with self._lock:
            self.last_used = self.clock()
            self.requests += 1

    def active(self) -> bool:
        """A request of this lane runs, is held at its gate or waits for a slot now."""
        waiting = self.limiter.counts()[1] if self.limiter else 0
        return bool(self.gate.inflight() or self.gate.held() or waiting)

    def last_active(self) -> float:
        """When the lane last had nothing in flight (now, while something is): what its idle
        time, its ttl and the node's least-recently-used order count from."""
        now = self.clock()
        return now if self.active() else min(self.last_used, now)

    def idle_for(self) -> float:
        """Seconds since the lane last had nothing in flight (0 while a request runs)."""
        return max(0.0, self.clock() - self.last_active())

    def stats(self) -> RouteStats:
        running, waiting = self.limiter.counts() if self.limiter else (None, None)
        return {"requests": self.requests, "held": self.gate.held(),
                "inflight": self.gate.inflight(), "held_reason": self.gate.held_reason,
                "idle_s": round(self.idle_for(), 3),
                "running": running, "waiting": waiting}


class RouteTable(Protocol):
    """The router's question per request: (model or None, method, path) -> a route, or an
    answer. An immutable value its owner publishes (serve/table.py); `needs_model`: whether
    the request's `model` can change the answer (the body is read for it first)."""

    @property
    def needs_model(self) -> bool: ...

    def __call__(self, model: str | None, method: str, path: str, /) -> Route | LocalReply: ...


@dataclass(frozen=True)
class FnTable:
    """A table made of a plain function (benches and tests): `needs_model` says whether the
    router must read the request's `model` before it asks."""

    fn: Callable[[str | None, str, str], Route | LocalReply]
    needs_model: bool = True

    def __call__(self, model: str | None, method: str, path: str, /) -> Route | LocalReply:
        return self.fn(model, method, path)


def one_route_table(route: Route) -> FnTable:
    """Every request to `route`, without reading bodies (a port with one lane)."""
    return FnTable(lambda _model, _method, _path: route, needs_model=False)
