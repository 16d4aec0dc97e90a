"""Keeps an external port accepting connections: notices when its router's acceptor is not
running, says so, and restarts the router.

A Port (serve/port.py; one lane, none, or several routed by model) owns one external address
and its Router.
If the router's acceptor is not running, every connection to the port is refused although the
processes behind it are fine. The owner's PortWatch makes that visible and short-lived:

  down()    why the port refuses connections ("router on 127.0.0.1:8080 is not accepting
            connections"), or None; what status (the state word "port down"), the STATUS= line
            and `hydra status`'s exit code say
  check()   on the daemon's tick (the event loop's thread): a router not alive for `grace`
            seconds is stopped and started again (the same port; the router keeps its gates,
            upstreams and routes across a restart). stop() and start() block, bounded (the
            router joins its threads with a timeout). A restart that fails is tried again after
            a delay that doubles up to `max_delay`, for as long as the port is down. Each
            outage is logged once when seen, once when the port is back.

Only the router's own start/stop are used: whatever made the acceptor stop, a fresh start binds
the port again. (The router may also restart its acceptor itself; alive() is False only while
no acceptor runs, so the grace lets such a restart finish first.)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("hydra")

CHECK_S = 0.5  # how often the daemon checks every port
GRACE_S = 1.0  # a router not alive this long is restarted
FIRST_DELAY_S = 1.0  # after a failed restart; doubled per failure
MAX_DELAY_S = 30.0


class RouterLike(Protocol):
    def alive(self) -> bool: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...


class PortWatch:
    def __init__(self, where: str, router: RouterLike, *, grace: float = GRACE_S,
                 first_delay: float = FIRST_DELAY_S, max_delay: float = MAX_DELAY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.where = where  # host:port, as the reason names it
        self.router = router
        self.grace = grace
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.clock = clock
        self.active = True  # False once the owner closed the port on purpose
        self.down_since: float | None = None
        self.next_try = 0.0
        self.delay = first_delay
        self.restarts = 0  # router restarts that brought the port back
        self.failed = 0  # restarts that did not
        self.last_error: str | None = None

    def down(self) -> str | None:
        """Why the port refuses every connection, or None while it accepts them."""
        if not self.active or self.router.alive():
            return None
        return f"router on {self.where} is not accepting connections"

    def counts(self) -> dict[str, Any]:
        """For the snapshot's router row (metrics: hydra_router_recoveries_total...)."""
        return {"recoveries": self.restarts, "recovery_failures": self.failed,
                "down_s": (round(self.clock() - self.down_since, 1)
                           if self.down_since is not None else None)}

    def check(self) -> bool:
        """One tick: note the port going down or coming back, and restart a router that has
        been down for `grace` seconds (when its retry is due). True when the port's state
        changed (the caller publishes the status)."""
        if not self.active:
            return False
        now = self.clock()
        if self.router.alive():
            if self.down_since is None:
                return False
            log.warning("router on %s accepts connections again (down %.1fs)", self.where,
                        now - self.down_since)
            self._reset()
            return True
        if self.down_since is None:
            self.down_since = now
            self.next_try = now + self.grace
            log.error("router on %s is not accepting connections (its acceptor is not "
                      "running): every connection to the port is refused; restarting the "
                      "router", self.where)
            return True
        if now < self.next_try:
            return False
        return self._restart(now)

    def _restart(self, now: float) -> bool:
        open_n = 0
        with contextlib.suppress(Exception):  # only for the log line
            open_n = int(self.router.stats().get("open") or 0)
        error: str | None = None
        try:
            self.router.stop()
            self.router.start()
        except (OSError, RuntimeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error is None and self.router.alive():
            self.restarts += 1
            log.warning("router on %s restarted after %.1fs down (%d connections still "
                        "relayed were closed; %d restarts since hydra started)", self.where,
                        now - (self.down_since or now), open_n, self.restarts)
            self._reset()
            return True
        self.failed += 1
        error = error or "its acceptor stopped again at once"
        if error != self.last_error:  # once per outage and kind of failure, not every retry
            log.error("router on %s: restart failed (%s); trying again in %.0fs", self.where,
                      error, self.delay)
        self.last_error = error
        self.next_try = now + self.delay
        self.delay = min(self.delay * 2, self.max_delay)
        return False

    def _reset(self) -> None:
        self.down_since = None
        self.delay = self.first_delay
        self.last_error = None
