"""The process-wide bound on request-body bytes the routers hold in memory (``BodyBudget``).

``max_body`` bounds one request; this bounds them all at once. A body the router keeps whole
(one of at most ``STREAM_ABOVE`` bytes, or a larger one it must read for its ``model`` or its
T1 defaults) is charged here as it arrives and given back when its request ends; a body that
streams is charged only for the head it keeps (at most ``STREAM_ABOVE``). Past the budget a
request is answered 503 with ``Retry-After`` instead of being held (docs/router.md, "Bodies").

A thread-safe meter: session threads take and give bytes; nothing else is decided from it.
Every router in a process shares ``PROCESS`` unless it is given its own (tests).
"""

from __future__ import annotations

import threading

STREAM_ABOVE = 1 << 20  # a body over this streams upstream unless it must be read
DEFAULT_BUDGET = 128 << 20  # bytes of request bodies held at once, all routers together


class BodyBudget:
    """Bytes of request bodies held in memory now, against a limit."""

    def __init__(self, limit: int = DEFAULT_BUDGET) -> None:
        if limit < STREAM_ABOVE:
            raise ValueError(f"a body budget under {STREAM_ABOVE} bytes starves small requests")
        self.limit = limit
        self._lock = threading.Lock()
        self._used = 0
        self._peak = 0

    def take(self, n: int) -> bool:
        """Charge ``n`` bytes; False (nothing charged) when that would pass the limit."""
        with self._lock:
            if self._used + n > self.limit:
                return False
            self._used += n
            if self._used > self._peak:
                self._peak = self._used
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._used = max(0, self._used - n)

    def used(self) -> int:
        with self._lock:
            return self._used

    def peak(self) -> int:
        with self._lock:
            return self._peak


PROCESS = BodyBudget()
