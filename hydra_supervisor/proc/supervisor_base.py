"""The Supervisor's state and its plumbing: the fields every part of it reads (the Deployment,
the ManagedProcesses, the events, the callbacks the lane sets), publishing its status, the small
helpers (clock, a stop-aware sleep, a race), and stopping or killing one process.

SupervisorBase is the first of a chain of classes, each in its own module (supervisor_base →
watching → starting → supervisor.Supervisor), rather than free functions or a separate object:
the Supervisor is the single owner of its processes, and every part reads and writes the same
state (head, peers, degraded, fail_fast, the seams); a chain keeps each method as it was
(`self._kill(...)`) and lets each module type-check against only what sits below it."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.plan import Role
from hydra_supervisor.plan.ports import client_host
from hydra_supervisor.proc import process
from hydra_supervisor.proc.health import Gated as Traffic
from hydra_supervisor.proc.managed import RUNNING, ManagedProcess, State
from hydra_supervisor.proc.seams import Seams, UpstreamMoved
from hydra_supervisor.proc.state import StateDir

log = logging.getLogger("hydra")


class SupervisorBase:
    """The Supervisor's fields, status, helpers and one-process stop (see the module's doc)."""

    def __init__(self, deployment: Deployment, state: StateDir, *,
                 seams: Seams | None = None) -> None:
        self.deployment = deployment
        plan = self.plan = deployment.plan
        self.seams = seams or Seams()
        self.state = state
        self.timeouts = deployment.timeouts
        self.on_peer_loss = deployment.on_peer_loss
        self.model_label = deployment.model_label
        self.solo_head = deployment.solo_head  # the head as SOLO, for on_peer_loss: degrade
        self.pick_port = deployment.pick_port
        self.pick_internal_port = deployment.pick_internal_port
        self.stopping = asyncio.Event()
        self.first_ready = asyncio.Event()
        self.fatal: str | None = None
        self.degraded: str | None = None
        self.stop_reason: str | None = None  # why the run ended (stop asked, FATAL, bug)
        self.unkillable: list[str] = []
        self.recovery: asyncio.Future[bool] | None = None
        # The lane's traffic, read by the stall rule (its gate's flights; health.flights);
        # None: no router in front (router: false).
        self.traffic: Traffic | None = None
        # Told when a process moves to another port because another process took its own:
        # (kind "http" | "rpc", the old address, the new port). The lane re-points its route.
        self.on_upstream_moved: UpstreamMoved | None = None
        # Called on every transition (the lane holds its route while the head is not READY).
        self.listeners: list[Callable[[ManagedProcess], None]] = []
        # When set, called instead of writing status.json (the daemon owns that file then).
        self.on_publish: Callable[[], None] | None = None
        # Awaited before a head swap the supervisor decides itself (degraded SOLO → COMBINE):
        # the lane makes it a planned switch (hold, drain; Lane._before_head_swap). Arg: "combine".
        self.before_head_swap: Callable[[str], Awaitable[None]] | None = None
        self._requests: asyncio.Queue[tuple[str, asyncio.Future[None], bool]] = asyncio.Queue()
        # A planned change's start: the first failure ends it (ChangeFailed) instead of backing
        # off (the caller rolls back). Cleared once everything is READY.
        self.fail_fast = False
        self._shutdown: asyncio.Task[None] | None = None
        self._spawned: set[int] = set()
        self._connect_probed: dict[str, int] = {}  # remote peer -> head pid it was probed under
        self._in_d: dict[str, tuple[int, float, float]] = {}  # peer -> (pid, since, CPU) in D
        self.procs = [
            ManagedProcess(spec=spec, binary=deployment.binaries.get(spec.program, spec.program),
                           log_path=state.log_path(spec.name), policy=deployment.policy,
                           on_change=self._changed, clock=self.seams.clock)
            for spec in plan.in_start_order()
        ]
        # A peer-only engine (mode: peer) has no head: it serves its device to another host.
        self.head = next((p for p in self.procs if p.spec.role is Role.HEAD), None)
        self.combine_head = self.head.spec if self.head else None
        self.peers = [p for p in self.procs if p.spec.role is Role.PEER]

    # -- status -----------------------------------------------------------------------------

    def _changed(self, mp: ManagedProcess, transition: bool) -> None:
        self.publish()
        if not transition:
            return
        for listener in list(self.listeners):
            try:
                listener(mp)
            except Exception:  # noqa: BLE001 - foreign code must not break the supervisor
                log.exception("listener %r failed on %s", listener, mp.name)

    def snapshot(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "pid": os.getpid(), "profile": plan.profile, "source": plan.source,
            "mode": plan.mode, "model": self.model_label,
            "url": (f"ggml-rpc://{plan.host}:{plan.port}"
                    if plan.router and not plan.router.http
                    else f"http://{client_host(plan.host)}:{plan.port}"),
            "fatal": self.fatal, "degraded": self.degraded, "stopped": self.stop_reason,
            "unkillable": list(self.unkillable), "updated": time.time(),
            "engines": [p.row() for p in self.procs],
        }

    def publish(self) -> None:
        if self.on_publish is not None:  # under a lane, the daemon publishes its whole status
            self.on_publish()
            return
        try:
            self.state.write_status(self.snapshot())
        except OSError as exc:  # a full or read-only state dir must not stop the serving
            log.warning("cannot write status: %s", exc)

    # -- small helpers ----------------------------------------------------------------------

    def _now(self) -> float:
        return self.seams.clock()

    async def _sleep(self, seconds: float) -> None:
        """Sleep, cut short by a stop request."""
        await self._race(self.seams.sleep(seconds), self.stopping.wait())

    @staticmethod
    async def _race(*aws: Awaitable[Any]) -> None:
        tasks = [asyncio.ensure_future(a) for a in aws]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _managed_pids(self) -> set[int]:
        """Every child this supervisor started (each leads its own process group)."""
        return self._spawned

    async def _kill(self, mp: ManagedProcess, *, now: bool = False) -> process.Stopped:
        res = process.Stopped(None)
        if mp.child is not None:
            if now:
                res = await process.kill_now(mp.child, sleep=self.seams.sleep)
            else:
                res = await process.stop(mp.child, self.timeouts.stop_grace,
                                         sleep=self.seams.sleep)
            if res.code is not None:
                mp.last_exit = res.code
        if res.stuck:
            self.unkillable.append(f"{mp.name}: {res.stuck}")
            log.error("%s: %s", mp.name, res.stuck)
        else:
            self.state.forget_child(mp.name)
        return res

    async def _stop_one(self, mp: ManagedProcess, reason: str, *, now: bool = False,
                        show_exit: bool = True) -> None:
        if mp.state in RUNNING:
            mp.to(State.STOPPING, reason)
        res = await self._kill(mp, now=now) if mp.spec.managed else process.Stopped(None)
        if res.stuck:
            if mp.state is not State.FATAL:
                mp.to(State.FATAL, f"{reason}; could not be stopped: {res.stuck}")
            return
        if mp.state is State.STOPPING:
            mp.to(State.STOPPED, reason if res.code is None or not show_exit
                  else f"{reason}; {process.describe_exit(res.code)}")
        elif mp.state is State.BACKOFF:
            mp.to(State.STOPPED, reason)
