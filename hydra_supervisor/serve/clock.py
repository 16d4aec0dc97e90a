"""The one clock of the serving policy: every Port, Lane, Node, standby and report reads it.

A `Clock` is a callable that answers monotonic seconds. Production passes `MONOTONIC` (the
event loop's own clock, `time.monotonic`); tests pass a clock they move themselves, so a
policy never depends on how long the machine has been up (a CI machine booted two minutes ago
reads a monotonic clock near 120 s). `wall()` is for the few timestamps a reader shows as a
date (`created` in /v1/models, `at` of a switch), never for a decision.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds (any origin: only differences mean something)."""

    def __call__(self) -> float: ...


MONOTONIC: Clock = time.monotonic


def wall() -> float:
    """Seconds since the epoch, for display only."""
    return time.time()
