"""The node: the devices' room, shared by every lane of every port (two ports may use one GPU).

Before a lane loads, it needs room on its devices (fleetplan.make_room): it fits beside what
runs, or the least recently used lanes that share its devices stop first — each through its own
`unload` (drained; an eviction whose requests do not drain is given up, never cut), and never
one inside its `min_resident` window. `activate` (hydra switch NAME among several profiles) is
the explicit form: the lanes that do not fit beside the target stop (least recently used first,
drained, then cut; min_resident does not hold an operator back), lanes that fit beside it keep
serving, and the target loads; if that fails, the stopped ones come back. Every stop says why
(`Stopped`: which device, what the target needs, what was free). The node evicts only through
lanes' public operations.
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
from hydra_supervisor.serve.reports import Busy, Phases, Result, Stopped, SwitchReport
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

    def occupants(self, but: Lane, force: bool = False) -> list[fleetplan.Occupant]:
        """What holds device memory beside `but`. `force` (an operator's switch): no lane is
        kept for its min_resident window."""
        out = []
        for o in self.lanes.values():
            if o is but or o.phase in (LaneState.STOPPED, LaneState.FAILED):
                continue
            loaded = o.loaded_at if o.loaded_at is not None else self.clock()
            out.append(fleetplan.Occupant(
                o.name, o.needs, o.route.last_active(),
                float("-inf") if force else loaded + o.min_resident,
                movable=o.phase is LaneState.SERVING and not o.busy,
                standby=o.standby))  # a standby layout goes first (serve/standby.py)
        return out

    def why_stopped(self, lane: Lane, victim: str) -> str:
        """Why `victim` must stop for `lane` (decided before anything stopped): the device
        `lane` is short on beside it, what `lane` needs there and what is free (a clause for a
        reply's message)."""
        other = self.lanes.get(victim)
        occupants = self.occupants(lane)
        short = fleetplan.shortfall(self.capacity, occupants, lane.needs)
        used: dict[str, int] = {}
        for o in occupants:
            for k, n in o.needs.items():
                used[k] = used.get(k, 0) + n
        keys = [k for k in sorted(short)
                if other is None or other.needs.get(k, 0)] or sorted(short)
        where = "; ".join(
            f"{lane.name} needs {lane.needs.get(k, 0) / fleetplan.MIB:,.0f} MiB of "
            f"{_device(k)}, {max(0, self.capacity.get(k, 0) - used.get(k, 0)) / fleetplan.MIB:,.0f}"
            " MiB free" for k in keys)
        return f"it did not fit beside {lane.name} ({where})"

    def fits_now(self, lane: Lane) -> fleetplan.Room:
        return fleetplan.make_room(self.capacity, self.occupants(lane), lane.needs,
                                   self.clock(), lane.name)

    async def room_for(self, lane: Lane, force: bool = False) -> list[Stopped]:
        """Wait until `lane` fits, stopping what must go; returns what it stopped and why. A
        lane whose last load failed does not stop others to try again (each retry would evict
        a healthy profile): it loads beside what runs, or waits for `hydra switch` or
        `hydra load` (`force`)."""
        deadline = self.clock() + self.load_wait
        waiting = ""
        stopped: list[Stopped] = []
        while True:
            self.room_changed.clear()  # before deciding: a change after it wakes us
            room = self.fits_now(lane)
            if room.verdict is fleetplan.Verdict.FITS:
                return stopped
            if room.verdict is fleetplan.Verdict.NEVER:
                raise HydraError(room.reason)
            if room.verdict is fleetplan.Verdict.EVICT and lane.fails and not force:
                raise HydraError(
                    f"its last load failed, and it does not stop {', '.join(room.victims)} "
                    f"to try again ({room.reason or 'no room beside them'}); "
                    f"`hydra switch {lane.name}` does, or it loads once there is room")
            if room.verdict is fleetplan.Verdict.EVICT:
                for name in room.victims:
                    why = self.why_stopped(lane, name)
                    if await self.lanes[name].unload(f"making room for {lane.name}") is None:
                        break  # still busy after the drain: decide again
                    stopped.append(Stopped(name, why))
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
        """`hydra switch NAME` among several profiles: stop the lanes that do not fit beside
        it (drained, then cut; those that fit keep serving), load it; if it fails, bring the
        stopped ones back."""
        if lane.phase is LaneState.SERVING:
            return SwitchReport(to=lane.name, frm=None, result=Result.NOOP,
                                reason=f"{lane.name} is already serving")
        if lane.job is not None or any(o.phase is LaneState.UNLOADING
                                       for o in self.lanes.values()):
            raise Busy(f"profile {lane.name} is loading or another profile is stopping on "
                       f"port {lane.port.port}; try again when it is done")
        room = fleetplan.make_room(self.capacity, self.occupants(lane, force=True),
                                   lane.needs, self.clock(), lane.name)
        if room.verdict is fleetplan.Verdict.WAIT:
            raise Busy(f"no room for {lane.name} now ({room.reason}); try again when it is "
                       "done")
        victims = room.victims if room.verdict is fleetplan.Verdict.EVICT else ()
        why = {name: self.why_stopped(lane, name) for name in victims}
        report = SwitchReport(to=lane.name, frm=", ".join(victims) or None)
        phase = Phases(report)
        stopped = []
        with phase("stop") if victims else contextlib.nullcontext():
            for name in victims:
                o = self.lanes[name]
                cut = await o.unload(f"hydra switch {lane.name}: {why[name]}", cut=True)
                if cut is not None:
                    stopped.append(o)
                    report.cut += cut
                    report.stopped.append(Stopped(name, why[name], cut))
        lane.job = asyncio.current_task()
        with phase("start"):
            ok = await lane.load("hydra switch", force=True)
        report.stopped += lane.made_room  # (something else took the room meanwhile)
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

    async def load(self, lane: Lane) -> SwitchReport:
        """`hydra load NAME`: load it beside what serves, stopping only what does not fit
        (as a load on request does: least recently used first, drained, never cut, never
        inside min_resident), even after a failed load. A lane already serving: a no-op."""
        if lane.phase is LaneState.SERVING:
            return SwitchReport(to=lane.name, frm=None, result=Result.NOOP,
                                reason=f"{lane.name} is already serving")
        if lane.job is not None or lane.phase is not LaneState.STOPPED \
                and lane.phase is not LaneState.FAILED:
            raise Busy(f"profile {lane.name} is {lane.state_now().value}; try again when "
                       "it is done")
        report = SwitchReport(to=lane.name, frm=None)
        phase = Phases(report)
        lane.job = asyncio.current_task()
        with phase("start"):
            ok = await lane.load("hydra load", force=True)
        report.stopped = list(lane.made_room)
        report.frm = ", ".join(x.profile for x in report.stopped) or None
        report.result = Result.OK if ok else Result.FAILED
        if not ok:
            report.failed_phase = "start"
            report.error = lane.error
            report.log_tail = next(
                (p.log_tail() for p in (lane.sup.procs if lane.sup else []) if p.log_tail()),
                [])
        phase.done()
        lane.record(report)
        return report


def _device(key: str) -> str:
    """A physical device key (fleetplan.device_key) as a reader says it."""
    return "host memory" if key == "host" else key
