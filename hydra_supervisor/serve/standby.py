"""A port's standby layout: the other layout of its one profile's model, kept loaded beside it.

A profile names the layout it switches with (`standby: NAME`, another profile of the same
model: the SOLO of a COMBINE, or the other way round). When the node's room fits both (the
node's capacity, the same numbers eviction decides with: fleetplan), the port keeps the
standby loaded as a second lane — its own processes and ports (an rpc-server serves one head,
so a COMBINE standby runs its own peers), named after its profile (`demo-moe.head`) — and warms
it with one short completion. A switch to it (`hydra switch`, the control API, the wire
protocol's SET_EXPERT_MODE) is a *flip*: the port's lane table is swapped in one assignment,
so `Port.select` hands every new request to the target's route at once; requests in flight on
the old layout finish there (its processes keep running); nothing restarts; the old layout is
now the standby. With `keep_slots` the flip first copies the KV slots across (save on the old
head, restore on the target: measured in docs/measurements.md; it costs more than the flip).

When both do not fit, nothing is loaded beside the active layout; a switch to the standby
reloads as before, and its report says why it was not instant (`not_instant`: which device,
how many MiB short). A switch to any other profile stops the standby first (the eviction takes
the standby before anything else; fleetplan orders standby occupants first node-wide too).
A standby whose process dies is restarted by its own supervisor; the active lane is not
touched (its gate is its own, and the port does not route to it). A standby lane never ends
hydra (`exit_on_fatal` moves with the flip).

Everything here runs on the event loop; `ready_for` and `for_mode` only read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import requests

from hydra_supervisor.config.profile import Profile
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import deployment, fleetplan
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.plan import Address
from hydra_supervisor.serve import keepslots, states
from hydra_supervisor.serve.clock import Clock
from hydra_supervisor.serve.events import SAID, Event, Kind
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.reports import Busy, Phases, Result, SwitchReport
from hydra_supervisor.serve.snapshot import LaneStatus, frozen_map
from hydra_supervisor.serve.states import LaneState

log = logging.getLogger("hydra")

WARM_TIMEOUT = 120.0  # one short completion on a freshly loaded standby (a slow CPU)
MIB = fleetplan.MIB

# (profile, the port's address, ports to leave alone) -> its Deployment (planned in a thread)
Prepare = Callable[[str, Address, frozenset[int]], Deployment]
Warm = Callable[[Lane], Awaitable[float]]  # seconds the warm-up request took


class StandbyPort(Protocol):
    """What the standby needs of its port (serve/port.py)."""

    host: str
    port: int
    node: Node
    clock: Clock

    @property
    def url(self) -> str: ...

    @property
    def address(self) -> Address: ...

    def only(self) -> Lane | None: ...

    def make_lane(self, profile: Profile | None, dep: Deployment, *,
                  standby: bool = False) -> Lane: ...

    def announce(self) -> None: ...

    def emit(self, event: Event) -> None: ...


class Standby:
    def __init__(self, port: StandbyPort, *, prepare: Prepare | None = None,
                 warm: Warm | None = None, node_file: str | None = None,
                 profiles_dir: str | None = None, overrides: dict[str, Any] | None = None,
                 slot_dir: Path | None = None) -> None:
        self.port = port
        self.node_file = node_file
        self.profiles_dir = profiles_dir
        self.overrides = {k: v for k, v in (overrides or {}).items() if k != "profile"}
        self.slot_dir = slot_dir
        self._prepare = prepare or self._prepare_default
        self._warm = warm or functools.partial(_warm_head, clock=port.clock)
        self.lane: Lane | None = None
        self.pair: frozenset[str] | None = None  # the active profile and its standby
        self.name: str | None = None  # the standby profile wanted now
        self.why: str | None = None  # why it is not loaded (did not fit, failed, ...)
        self.needs: dict[str, int] = {}  # what it needs per device (planned), loaded or not
        self.warm_s: float | None = None
        self.flips = 0
        self.task: asyncio.Task[None] | None = None
        self._pending: str | None = None  # why the switch in progress is not instant

    # -- what runs --------------------------------------------------------------------------------

    def _active(self) -> Lane | None:
        return self.port.only()

    def wanted(self) -> str | None:
        """The standby profile of the active lane: the other of the pair it was flipped
        within, else the one its profile declares."""
        active = self._active()
        if active is None:
            return None
        if self.pair is not None and active.name in self.pair and len(self.pair) == 2:
            return next(n for n in self.pair if n != active.name)
        return getattr(active.profile, "standby", None) or None

    def ready(self) -> bool:
        """The standby is loaded, warm and serving, and neither lane is in a change."""
        lane, active = self.lane, self._active()
        return (lane is not None and active is not None and self.warm_s is not None
                and lane.state_now() is LaneState.SERVING and lane.job is None
                and not lane.lock.locked() and not active.lock.locked())

    def ready_for(self, ref: str) -> bool:
        """Whether a switch to `ref` (a profile name or file) can flip now."""
        lane = self.lane
        return lane is not None and self.ready() and lane.answers_to(ref)

    def for_mode(self, mode: str) -> str | None:
        """SET_EXPERT_MODE: the standby's name when it runs the wanted mode ("solo" or
        "combined") of the active lane's model and can flip now."""
        lane, active = self.lane, self._active()
        if lane is None or active is None or not self.ready():
            return None
        want = "solo" if mode == "solo" else "combine"
        if lane.dep.plan.mode == want and lane.dep.plan.model_path == active.dep.plan.model_path:
            return lane.name
        return None

    def not_instant(self, ref: str | None = None) -> str | None:
        """Why a switch to `ref` (None: to the standby) cannot flip, when `ref` is the
        declared standby; None when it can, or `ref` is some other profile."""
        name = self.wanted()
        if name is None or (ref is not None and ref != name and
                            (self.lane is None or not self.lane.answers_to(ref))):
            return None
        if self.ready():
            return None
        if self.why:
            return f"standby {name}: {self.why}"
        lane = self.lane
        if lane is None:
            return f"standby {name} is not loaded yet"
        return f"standby {name} is {lane.state_now().value}" + (
            " (warming up)" if lane.state_now() is LaneState.SERVING else "")

    # -- keeping it loaded ---------------------------------------------------------------------

    def follow(self) -> None:
        """After the active lane started or switched: (re)load the standby it wants, in the
        background (a switch's reply does not wait for it)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.task = asyncio.create_task(self._ensure())

    async def _ensure(self) -> None:
        try:
            await self._ensure_now()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not end hydra; the active lane serves
            log.exception("standby: %s", exc)
            self.why = f"internal error: {exc}"
            self.port.emit(Event(Kind.STANDBY_FAILED, self.name or "?", self.why))
            self.port.announce()

    async def _ensure_now(self) -> None:
        active = self._active()
        if active is None:
            return
        # The active layout first: the standby never slows its load (bounded by its timeout).
        clock = self.port.clock
        deadline = clock() + active.dep.timeouts.load + active.dep.timeouts.peer + 30
        while active.state_now() is not LaneState.SERVING or active.lock.locked():
            if active is not self._active() or active.state_now() is LaneState.FAILED \
                    or clock() > deadline:
                return
            await asyncio.sleep(0.1)
        name = self.wanted()
        lane = self.lane
        if lane is not None and lane.name == name and lane.phase is LaneState.SERVING \
                and self.warm_s is not None:
            return  # already the one (a flip keeps the pair)
        if self.lane is not None:
            await self.drop(f"{active.name} has another standby ({name})" if name
                            else f"{active.name} has no standby")
        self.name, self.why, self.needs, self.warm_s = name, None, {}, None
        if name is None:
            self.pair = None
            self.port.announce()
            return
        self.pair = frozenset({active.name, name})
        try:
            # planned in a thread from plain values: the address, the ports to leave alone
            reserved = self.port.node.planned_ports(but=active) | frozenset(
                e.port for e in active.dep.plan.engines if e.managed)
            dep = await asyncio.to_thread(self._prepare, name, self.port.address, reserved)
        except HydraError as exc:
            self._not_loaded(f"cannot be planned: {exc}")
            return
        if dep.plan.router is None or active.dep.plan.router is None:
            self._not_loaded("needs hydra's router on the port (router: false lets one "
                             "llama-server bind it: there is no second layout to flip to)")
            return
        if dep.plan.model_path != active.dep.plan.model_path:
            self._not_loaded(f"runs another model ({dep.plan.model_path}) than {active.name} "
                             f"({active.dep.plan.model_path}); a standby is the other layout "
                             "of the same model")
            return
        prof = dep.layout.profile if dep.layout is not None else None
        lane = self.port.make_lane(prof, dep, standby=True)
        self.needs = dict(lane.needs)
        short = self.shortfall(lane)
        if short:
            self._not_loaded(f"does not fit beside {active.name}: {short}")
            return
        self.lane = lane
        self.port.node.add(lane)
        started = clock()
        ok = await lane.load(f"standby of {active.name}")
        if not ok:
            self.why = f"failed to load: {lane.error}"
            self.port.emit(Event(Kind.STANDBY_FAILED, lane.name, self.why))
            await self.drop("its load failed", keep_why=True)
            return
        warm = ""
        try:
            self.warm_s = await self._warm(lane)
            log.info("standby %s of %s loaded and warm (warm-up %.2fs); a switch to it is "
                     "instant", lane.name, active.name, self.warm_s)
        except (OSError, requests.RequestException, HydraError) as exc:
            self.warm_s = 0.0  # it serves; the first request after a flip warms it instead
            log.warning("standby %s: warm-up request failed (%s); it serves anyway",
                        lane.name, exc)
            warm = f"; its warm-up request failed ({exc})"
        self.port.emit(Event(Kind.STANDBY_READY, lane.name,
                             f"beside {active.name}: `hydra switch {lane.name}` is instant{warm}",
                             seconds=clock() - started))
        self.port.announce()

    def _not_loaded(self, why: str) -> None:
        self.why = why
        log.warning("standby %s not loaded: %s", self.name, why, extra=SAID)
        self.port.emit(Event(Kind.STANDBY_FAILED, self.name or "?", f"not loaded: {why}"))
        self.port.announce()

    def shortfall(self, lane: Lane) -> str | None:
        """None when `lane` fits beside everything the node runs; else which device and how
        many MiB short (never an eviction: a standby does not stop anything to load)."""
        node = self.port.node
        occ = node.occupants(lane)
        short = fleetplan.shortfall(node.capacity, occ, lane.needs)
        if not short:
            return None
        used = {k: sum(o.needs.get(k, 0) for o in occ) for k in short}
        return "; ".join(
            f"{k}: {v / MIB:,.0f} MiB short (needs {lane.needs[k] / MIB:,.0f} MiB, "
            f"{used[k] / MIB:,.0f} of {node.capacity[k] / MIB:,.0f} MiB in use)"
            for k, v in sorted(short.items()))

    def _prepare_default(self, name: str, external: Address,
                         reserved: frozenset[int]) -> Deployment:
        """Plan `name` on the port's address, on ports no other layout holds (a thread: plain
        values only)."""
        return deployment.prepare(
            name, node_file=self.node_file, profiles_dir=self.profiles_dir,
            overrides=self.overrides, external=external, slot_dir=self.slot_dir,
            reserved=reserved)

    async def drop(self, why: str, keep_why: bool = False) -> int:
        """Stop the standby (drained, then cut; an old layout may still finish streams);
        how many of its requests were cut."""
        task, lane = self.task, self.lane
        self.lane, self.warm_s = None, None
        if not keep_why:
            self.why = None
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if lane is None:
            return 0
        cut = None
        if lane.phase is LaneState.SERVING and not lane.lock.locked():
            cut = await lane.unload(why, cut=True)
        else:
            await lane.shutdown(why)
        self.port.node.remove(lane)
        self.port.announce()
        return cut or 0

    async def shutdown(self, reason: str) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        if self.lane is not None:
            await self.lane.shutdown(reason)

    # -- switching -------------------------------------------------------------------------------

    async def before_switch(self, dep: Deployment) -> None:
        """A port's switch to `dep` that is not a flip (hydra switch after planning, or its
        first switch): the standby goes first when the switch leaves the pair (room for the
        new profile), and why it was not instant rides on the report."""
        self._pending = self.not_instant(dep.profile)
        active = self._active()
        if self.lane is not None and (active is None or dep.profile != active.name):
            await self.drop(f"switch to {dep.profile}")
        if active is None or dep.profile not in (self.pair or frozenset()):
            self.pair = None  # a new profile: its own standby (declared), if any

    def after_switch(self, report: SwitchReport) -> None:
        why, self._pending = self._pending, None
        if why is not None:
            report.instant = False
            report.not_instant = why
            report.notes.append(f"not instant: {why}")
        if self._active() is not None:
            self.follow()

    async def flip(self, swap: Callable[[Lane, Lane], None]) -> SwitchReport:
        """Re-point the port to the standby in one step (`swap(active, standby)`: the port's
        own operation); the old layout stands by."""
        sb, active = self.lane, self._active()
        if sb is None or active is None or not self.ready():
            raise Busy(f"the standby cannot take over now ({self.not_instant() or 'busy'})")
        report = SwitchReport(to=sb.name, frm=active.name, result=Result.RUNNING)
        phase = Phases(report)
        if active.dep.keep_slots and sb.dep.keep_slots:
            async with active.lock:  # no other change of the old head while it saves
                with phase("save_slots"):
                    saved = await keepslots.save(active.head_addr, active.dep)
                if saved:
                    with phase("restore_slots"):
                        await keepslots.restore(sb.head_addr, sb.state, active.dep, sb.dep,
                                                saved, report)
        with phase("flip"):
            inflight = active.route.gate.inflight()
            swap(active, sb)
            self.lane = active
            self.name = active.name
            self.pair = frozenset({active.name, sb.name})
            self.flips += 1
        report.result = Result.OK
        report.instant = True
        report.notes.append(f"instant: {sb.name} was loaded and warm; {active.name} finishes "
                            f"its {inflight} request(s) in flight and stands by")
        phase.done()
        sb.record(report)
        log.info("flipped port %s: %s -> %s in %.1f ms (nothing restarted)", self.port.port,
                 active.name, sb.name, report.phases.get("flip", 0.0) * 1000)
        return report

    # -- status ---------------------------------------------------------------------------------

    def status(self, gpu: Mapping[int, int], name: str,
               state_of: Callable[[Lane], str]) -> LaneStatus | None:
        """The standby in the published status, beside the active lane (role standby): its
        lane's status when it is loaded, else the profile it wants with why it is not
        (`why`), and its planned MiB per device; None when the active lane has none."""
        want, active = self.wanted(), self._active()
        if want is None or active is None:
            return None
        lane = self.lane
        if lane is not None:
            # (the port's switch history stays on the active lane's status)
            base = replace(lane.status(gpu, name=name, state=state_of(lane), default=False),
                           switches=())
        else:
            base = LaneStatus(name=name, profile=want, needs_mib=frozen_map(_mib(self.needs)))
        return replace(base, role="standby", standby_of=active.name, why=self.why,
                       warm_s=self.warm_s, flips=self.flips)

    def models(self, created: int) -> list[dict[str, Any]]:
        """/v1/models entries of the standby (the port's lane entries say standby: false)."""
        name, lane = self.wanted(), self.lane
        if name is None:
            return []
        state = lane.state_now() if lane is not None else LaneState.STOPPED
        return [{"id": name, "object": "model", "created": created,
                 "owned_by": "hydra", "state": state.value,
                 "status": {"value": states.MODEL_STATUS[state]}, "standby": True,
                 "mode": lane.dep.plan.mode if lane is not None else None,
                 "devices": list(lane.devices) if lane is not None else [],
                 "error": self.why}]


def _mib(needs: dict[str, int]) -> dict[str, int]:
    return {k: round(v / MIB) for k, v in needs.items()}


async def _warm_head(lane: Lane, clock: Clock) -> float:
    """One short completion straight to the standby's head: its first request pays for
    the first graph build and page faults, not the first user request after a flip."""
    addr = lane.head_addr()
    if addr is None:
        raise HydraError(f"{lane.name}: its head is not ready")
    host = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
    url = f"http://{host}:{addr[1]}/completion"

    def go() -> float:
        t0 = clock()
        r = requests.post(url, json={"prompt": "Hello", "n_predict": 1, "cache_prompt": False},
                          timeout=WARM_TIMEOUT)
        r.raise_for_status()
        return clock() - t0

    return await asyncio.to_thread(go)


def plan_both(active: Any, standby: Any) -> dict[str, Any]:
    """`hydra plan`: both layouts' bytes per physical device (layout.Layout each), against
    what the node offers, and whether they fit together (the standby is then kept loaded)."""
    def needs(lay: Any) -> dict[str, int]:
        return fleetplan.needs_of([(p.device, p.need_bytes) for p in lay.plan.placements],
                                  lay.devices)

    a, b = needs(active), needs(standby)
    cap = fleetplan.capacity_of(active.devices)
    occ = [fleetplan.Occupant(active.plan.profile, a, 0.0, 0.0)]
    short = fleetplan.shortfall(cap, occ, b)
    return {"active": {"profile": active.plan.profile, "mode": active.plan.mode,
                       "needs_mib": _mib(a)},
            "standby": {"profile": standby.plan.profile, "mode": standby.plan.mode,
                        "needs_mib": _mib(b)},
            "capacity_mib": {k: v // MIB for k, v in cap.items() if k in {*a, *b}},
            "same_model": active.plan.model_path == standby.plan.model_path,
            "short_mib": {k: round(v / MIB) for k, v in short.items()},
            "fits": not short}
