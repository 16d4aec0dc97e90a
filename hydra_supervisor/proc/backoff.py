"""Restart budget and backoff for one process: pure, with the clock passed in.

Why a unit of its own: the rules are easy to get subtly wrong (a "stable" mark that never
clears, a window no slow attempt can ever fill) and each must be pinned by a test that runs in
microseconds. The caller passes `now` (a monotonic reading) to every call; nothing here sleeps
or reads a clock.

Rules:
- a failure after a run that stayed READY for `stable_after` seconds starts a fresh incident:
  the delay goes back to `backoff_initial` and the consecutive count to 1. The READY mark is
  consumed by that failure, so the next failure is judged on its own run only;
- delay = backoff_initial * 2^(consecutive-1), capped at backoff_max;
- FATAL when `max_failures` failures fall within `window` seconds (a flapping process), or when
  `max_failures` failures happen in a row without a stable run in between (however long each
  attempt took: a 3-minute load that fails five times must end too).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from hydra_supervisor.config.profile import RestartPolicy


@dataclass(frozen=True)
class Verdict:
    """What to do after one failure: wait `delay` seconds and retry, or give up (`fatal`)."""

    delay: float
    fatal: str | None  # the reason for giving up, or None
    consecutive: int


@dataclass
class Backoff:
    policy: RestartPolicy
    failures: collections.deque[float] = field(default_factory=collections.deque)
    consecutive: int = 0
    ready_at: float | None = None

    def ready(self, now: float) -> None:
        """The process reached READY (its run starts counting towards stable_after)."""
        self.ready_at = now

    def stable(self, now: float) -> bool:
        return self.ready_at is not None and now - self.ready_at >= self.policy.stable_after

    def reset(self) -> None:
        """A planned restart or a fresh deployment: forget the history."""
        self.failures.clear()
        self.consecutive = 0
        self.ready_at = None

    def failure(self, now: float) -> Verdict:
        p = self.policy
        if self.stable(now):
            self.consecutive = 0
        self.ready_at = None  # consumed: the next failure is judged on its own run
        self.failures.append(now)
        while self.failures and now - self.failures[0] > p.window:
            self.failures.popleft()
        self.consecutive += 1
        fatal = None
        if len(self.failures) >= p.max_failures:
            fatal = f"{len(self.failures)} failures within {p.window:.0f}s, giving up"
        elif self.consecutive >= p.max_failures:
            fatal = (f"{self.consecutive} failures in a row without a stable run "
                     f"({p.stable_after:.0f}s READY), giving up")
        return Verdict(self.delay(), fatal, self.consecutive)

    def delay(self) -> float:
        """Capped exponential: backoff_initial doubled per consecutive failure."""
        return float(min(self.policy.backoff_initial * 2 ** max(self.consecutive - 1, 0),
                         self.policy.backoff_max))
