"""The node: the devices' room, shared by every lane of every port (two ports may use one GPU).

Before a lane loads, it needs room on its devices (fleetplan.make_room): it fits beside what
runs, or the least recently used lanes that share its devices stop first — each through its own
`unload` (drained; an eviction whose requests do not drain is given up, never cut), and never
one inside its `min_resident` window. `activate` (hydra switch NAME among several profiles) is
the explicit form: every lane that shares the target's devices stops (drained, then cut) and
the target loads; if that fails, they come back. The node evicts only through lanes' public
operations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import fleetplan
from hydra_supervisor.serve.clock import MONOTONIC, Clock
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.reports import Busy, Phases, Result, SwitchReport
from hydra_supervisor.serve.states import LaneState

log = logging.getLogger("hydra")

TICK = 0.25  # ttl checks, held requests of stopped lanes, waiting for room


def _shape(reason: str) -> str:
    """A room reason without its numbers (seconds left, MiB short): what makes it news."""
    return re.sub(r"[0-9][0-9,.]*", "N", reason)


class Node:
    def __init__(self, capacity: dict[str, int], *, load_wait: float = 120.0,
                 clock: Clock = MONOTONIC) -> None:
        """`clock`: the one clock of the serving policy (ports and lanes read it too)."""
        self.capacity = capacity
        self.load_wait = load_wait
        self.clock = clock
        self.lanes: dict[str, Lane] = {}
        self.room_changed = asyncio.Event()

    def add(self, lane: Lane) -> None:
        if lane.name in self.lanes and self.lanes[lane.name] is not lane:
            first = self.lanes[lane.name].dep.plan.source
            raise HydraError(f"two profiles are named {lane.name} ({first} and "
                             f"{lane.dep.plan.source}): profile names must differ")
        self.lanes[lane.name] = lane

    def remove(self, lane: Lane) -> None:
        if self.lanes.get(lane.name) is lane:
            del self.lanes[lane.name]

    def rename(self, lane: Lane, old: str) -> None:
        if self.lanes.get(old) is lane:
            del self.lanes[old]
        self.lanes[lane.name] = lane

    def planned_ports(self, but: Lane | None = None) -> frozenset[int]:
        """Ports the other lanes' plans hold (a re-plan of `but` must not take them)."""
        return frozenset(e.port for o in self.lanes.values() if o is not but
                         for e in o.dep.plan.engines if e.managed)

    def occupants(self, but: Lane) -> list[fleetplan.Occupant]:
        out = []
        for o in self.lanes.values():
            if o is but or o.phase in (LaneState.STOPPED, LaneState.FAILED):
                continue
            loaded = o.loaded_at if o.loaded_at is not None else self.clock()
            out.append(fleetplan.Occupant(
                o.name, o.needs, o.route.last_used, loaded + o.min_resident,
                movable=o.phase is LaneState.SERVING and not o.busy,
                standby=o.standby))  # a standby layout goes first (serve/standby.py)
        return out

    def fits_now(self, lane: Lane) -> fleetplan.Room:
        return fleetplan.make_room(self.capacity, self.occupants(lane), lane.needs,
                                   self.clock(), lane.name)

    async def room_for(self, lane: Lane, force: bool = False) -> None:
        """Wait until `lane` fits, stopping what must go. A lane whose last load failed does
        not stop others to try again (each retry would evict a healthy profile): it loads
        beside what runs, or waits for `hydra switch` (`force`)."""
        deadline = self.clock() + self.load_wait
        waiting = ""
        while True:
            self.room_changed.clear()  # before deciding: a change after it wakes us
            room = self.fits_now(lane)
            if room.verdict is fleetplan.Verdict.FITS:
                return
            if room.verdict is fleetplan.Verdict.NEVER:
                raise HydraError(room.reason)
            if room.verdict is fleetplan.Verdict.EVICT and lane.fails and not force:
                raise HydraError(
                    f"its last load failed, and it does not stop {', '.join(room.victims)} "
                    f"to try again ({room.reason or 'no room beside them'}); "
                    f"`hydra switch {lane.name}` does, or it loads once there is room")
            if room.verdict is fleetplan.Verdict.EVICT:
                for name in room.victims:
                    if await self.lanes[name].unload(f"making room for {lane.name}") is None:
                        break  # still busy after the drain: decide again
                else:
                    continue
            if self.clock() >= deadline:
                raise HydraError(f"no room within {self.load_wait:.0f}s: {room.reason}")
            if waiting != _shape(room.reason):  # the countdown alone is not news
                waiting = _shape(room.reason)
                log.info("profile %s: %s", lane.name, room.reason)
            lane.hold(f"loading profile {lane.name}: {room.reason}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.room_changed.wait(), TICK)

    async def activate(self, lane: Lane) -> SwitchReport:
        """`hydra switch NAME` among several profiles: stop the lanes that share its devices
        (drained, then cut), load it; if it fails, bring the stopped ones back."""
        if lane.phase is LaneState.SERVING:
            return SwitchReport(to=lane.name, frm=None, result=Result.NOOP,
                                reason=f"{lane.name} is already serving")
        if lane.job is not None or any(o.phase is LaneState.UNLOADING
                                       for o in self.lanes.values()):
            raise Busy(f"profile {lane.name} is loading or another profile is stopping on "
                       f"port {lane.port.port}; try again when it is done")
        sharing = [o for o in self.lanes.values() if o is not lane
                   and o.phase is LaneState.SERVING and set(o.needs) & set(lane.needs)]
        report = SwitchReport(to=lane.name, frm=", ".join(o.name for o in sharing) or None)
        phase = Phases(report)
        stopped = []
        with phase("stop"):
            for o in sharing:
                cut = await o.unload(f"hydra switch {lane.name}", cut=True)
                if cut is not None:
                    stopped.append(o)
                    report.cut += cut
        lane.job = asyncio.current_task()
        with phase("start"):
            ok = await lane.load("hydra switch", force=True)
        report.result = Result.OK
        if not ok:
            report.result = Result.ROLLED_BACK if stopped else "failed"
            report.failed_phase = "start"
            report.error = lane.error
            report.log_tail = next(
                (p.log_tail() for p in (lane.sup.procs if lane.sup else []) if p.log_tail()),
                [])
            for o in stopped:
                o.job = asyncio.current_task()
                if not await o.load(f"rollback of the switch to {lane.name}"):
                    report.result = Result.FAILED
        phase.done()
        lane.record(report)
        return report
