"""What a lane needs of the Supervisor that runs its layout: a Protocol, not its attributes.

The Lane (lane.py) starts one Runner per layout (`make_supervisor(dep, state)`), wires its
typed callbacks (a process changed, a moved upstream, a planned head swap, publish) and reads
its processes' states. supervisor.Supervisor is the real one; policy tests pass fakes that
satisfy the same Protocol (tests/test_engine_policy.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from hydra_supervisor.plan.deployment import Deployment, Timeouts
from hydra_supervisor.plan.plan import Plan
from hydra_supervisor.proc.health import Gated
from hydra_supervisor.proc.managed import ManagedProcess
from hydra_supervisor.proc.seams import UpstreamMoved


class Runner(Protocol):
    plan: Plan
    timeouts: Timeouts
    model_label: str
    procs: list[ManagedProcess]
    head: ManagedProcess | None
    first_ready: asyncio.Event
    stopping: asyncio.Event
    fatal: str | None
    degraded: str | None
    unkillable: list[str]
    fail_fast: bool
    # seams the lane sets before run()
    traffic: Gated | None
    on_upstream_moved: UpstreamMoved | None
    on_replanned: Callable[[Deployment], None] | None
    listeners: list[Callable[[ManagedProcess], None]]
    on_publish: Callable[[], None] | None
    before_head_swap: Callable[[str], Awaitable[None]] | None

    async def run(self) -> None: ...

    async def restart(self, name: str, fail_fast: bool = False) -> None: ...

    def adopt_head(self, deployment: Deployment) -> None: ...

    def request_stop(self, reason: str) -> None: ...

    def kill_all_now(self) -> None: ...
