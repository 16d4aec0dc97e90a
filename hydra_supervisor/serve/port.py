"""One external address: its Router, its lanes by name and alias, the model → lane lookup.

A port started with one profile is a port with one lane, `--no-profile` a port with none,
several profiles (`hydra up -p A -p B`) a port with a lane each, routed by the request's
`model` (`by_model`). The router asks `select` where each HTTP request goes:

- by model: the OpenAI `model` (a lane's name or alias; none: the default lane) picks the lane;
  `GET /v1/models` is answered here; an unknown model gets 404 naming the known ones; a
  request for a stopped lane loads it (unless `on_demand: false`) and waits, held, until it
  serves;
- one lane: every request goes to it (llama-server answers /v1/models itself, under the
  profile's name: the resolver passes `--alias`); none: 503 naming `hydra switch NAME`.

Everything here runs on the event loop, except `select` (router threads), which only reads
and posts work to the loop.

This module holds the Port itself (its address, router, lanes, lookup, start/shutdown,
switch_to, replace); its routing table and answers (`select`, the load a request asks for,
/v1/models) are in serve/port_routing.py, its status rows in serve/port_status.py (mixins: one
object, one set of fields).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hydra_supervisor.config.profile import Profile
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import plandiff
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.ports import host_port, url_for
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.proc.supervisor import Supervisor
from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.router.conn import Addr, Handoff
from hydra_supervisor.router.gate import Gate
from hydra_supervisor.router.routes import Limiter, Route
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.node import TICK, Node
from hydra_supervisor.serve.port_routing import PortRouting
from hydra_supervisor.serve.port_status import PortStatus
from hydra_supervisor.serve.portwatch import PortWatch
from hydra_supervisor.serve.reports import Result, SwitchReport, SwitchTimeouts
from hydra_supervisor.serve.states import LaneState

if TYPE_CHECKING:
    from hydra_supervisor.serve.standby import Standby

log = logging.getLogger("hydra")
DEFAULT_ALLOW = ("127.0.0.0/8", "::1/128")


class Port(PortRouting, PortStatus):
    """Its routing table and answers: port_routing.py; its status rows: port_status.py."""

    def __init__(self, state: StateDir, host: str, port: int, *, node: Node,
                 by_model: bool = False, allow: tuple[str, ...] = DEFAULT_ALLOW,
                 use_router: bool = True,
                 profiles: Callable[[], list[str]] | None = None,
                 switch_timeouts: SwitchTimeouts | None = None,
                 router_kwargs: dict[str, Any] | None = None, load_wait: float = 120.0,
                 clock: Callable[[], float] = time.monotonic,
                 make_router: Callable[..., Router] = Router,
                 make_supervisor: Callable[..., Any] | None = None) -> None:
        self.state = state
        self.host = host
        self.port = port
        self.node = node
        self.by_model = by_model
        self.allow = allow
        self.use_router = use_router
        self.profiles = profiles or (lambda: [])
        self.switch_timeouts = switch_timeouts or SwitchTimeouts()
        self.router_kwargs = dict(router_kwargs or {})
        self.load_wait = load_wait
        self.clock = clock
        self.make_router = make_router
        self.make_supervisor = make_supervisor or Supervisor
        self.lanes: dict[str, Lane] = {}
        self.lookup: dict[str, str] = {}  # model name or alias -> lane
        self.default: str | None = None
        self.router: Router | None = None
        self.watch: PortWatch | None = None
        self.hydra_upstream: Addr | Handoff | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = asyncio.Event()  # the start-up loads are over (served or not)
        self.ticks = 0  # policy passes done (ttl, parked requests): tests wait on it
        self.listeners: list[Callable[[], None]] = []
        self._tick_task: asyncio.Task[None] | None = None
        self._boot: asyncio.Task[None] | None = None
        self._created = int(time.time())
        self._rpc: Addr | None = None
        # Where requests go while the port has no lane (503 naming `hydra switch NAME`).
        self._none = Route("none", Gate(), where=f"port {port}")
        self._pending: list[tuple[Profile | None, Deployment]] = []
        # Reports of changes that left the port without a lane (a failed first switch).
        self.reports: collections.deque[SwitchReport] = collections.deque(maxlen=20)
        # The other layout of its one profile, kept loaded beside it (serve/standby.py).
        self.standby: Standby | None = None

    # -- lanes ----------------------------------------------------------------------------------

    def plan_lane(self, profile: Profile | None, dep: Deployment) -> None:
        """A lane to make when the port opens (its route needs the router)."""
        self._pending.append((profile, dep))

    def _new_route(self, name: str, profile: Profile | None) -> Route:
        conc = getattr(profile, "concurrency", None)
        queue = int(getattr(profile, "queue", 32))
        if self.router is not None:
            route = self.router.new_route(name, conc, queue)
        else:  # router: false: llama-server holds the port; the route only records
            route = Route(name, Gate(),
                          limiter=Limiter(name, conc, queue) if conc else None)
        route.where = f"port {self.port}"
        return route

    def add_lane(self, profile: Profile | None, dep: Deployment) -> Lane:
        name = dep.profile
        route = self._new_route(name, profile)
        lane = Lane(self, dep, route, state=self.state, profile=profile, node=self.node,
                    switch_timeouts=self.switch_timeouts, make_supervisor=self.make_supervisor,
                    clock=self.clock, exit_on_fatal=not self.by_model,
                    prefix_names=self.by_model,
                    load_wait=self.load_wait if self.by_model else None,
                    # The port's row (port-N) showed the reports of a lane dropped after a
                    # failed first switch; this lane numbers on from them, so metrics (which
                    # count by seq per row name) see its switches as new.
                    seq_from=max((r.seq for r in self.reports), default=0))
        self.lookup = self._names([*(x.profile_or_name() for x in self.lanes.values()),
                                   (lane.name, lane.aliases)])
        self.lanes[lane.name] = lane
        self.node.add(lane)
        if self.default is None:
            self.default = lane.name
        return lane

    def _names(self, labels: list[tuple[str, tuple[str, ...]]]) -> dict[str, str]:
        """Model name or alias -> lane; a name two lanes claim is refused."""
        seen: dict[str, str] = {}
        for name, aliases in labels:
            for label in (name, *aliases):
                other = seen.get(label)
                if other is not None and other != name:
                    raise HydraError(f"model name '{label}' is claimed by profiles {other} and "
                                     f"{name} on port {self.port}: give each a name of "
                                     "its own (aliases:)")
                seen[label] = name
        return seen

    def only(self) -> Lane | None:
        """The lane of a port that serves one profile (None: none yet, or several)."""
        if self.by_model or not self.lanes:
            return None
        return next(iter(self.lanes.values()))

    def wire_lane(self) -> Lane | None:
        """The lane the Hydra wire protocol addresses: the default lane."""
        return self.lanes.get(self.default) if self.default is not None else None

    def lane_changed(self, lane: Lane) -> None:
        """A lane changed (state, processes, or its profile after a switch)."""
        if lane.name not in self.lanes or self.lanes[lane.name] is not lane:
            old = next((n for n, x in self.lanes.items() if x is lane), None)
            if old is not None:  # a switch gave the lane another profile
                self.lanes = {(lane.name if n == old else n): x for n, x in self.lanes.items()}
                if self.default == old:
                    self.default = lane.name
                self.lookup = self._names([x.profile_or_name() for x in self.lanes.values()])
                self.node.rename(lane, old)
        if self.by_model:
            lane.went_fatal()
        self._announce()

    def _announce(self) -> None:
        for fn in self.listeners:
            fn()

    # -- the port ---------------------------------------------------------------------------------

    def open(self) -> None:
        """Bind the external port (the router). Without a router the head binds it itself."""
        planned = {d.profile for _, d in self._pending} | set(self.lanes)
        if self.by_model and self.default is not None and self.default not in planned:
            # a default no lane serves would fail every model-less request
            raise HydraError(f"default profile '{self.default}' is not served on port "
                             f"{self.port}")
        if self.use_router:
            self.router = self.make_router(self.host, self.port, Upstreams(), allow=self.allow,
                                           name=f"port {self.port}", **self.router_kwargs)
            self.router.route_by_model = self.by_model
            self.router.table = self.select
            self._idle_message()  # before the port opens: no request sees a port without one
            self.router.start()
            self.port = self.router.port  # --port 0: the port the kernel gave us
            self.watch = PortWatch(host_port(self.host, self.port), self.router)
        self._none.where = f"port {self.port}"
        for profile, dep in self._pending:
            lane = self.add_lane(profile, dep)
            if self.by_model:
                lane.stopped_gate()
        self._pending = []

    def _idle_message(self) -> None:
        names = ", ".join(self.profiles()) or "(none found)"
        self._none.set_unavailable(
            f"no profile is loaded on this hydra: run `hydra switch NAME` (profiles: {names})",
            retry_after=10)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.active = False  # down on purpose from now on
        if self.router is not None:
            self.router.stop()

    @property
    def url(self) -> str:
        """http://, or ggml-rpc:// for a port that only lends a device (mode: peer)."""
        lane = self.only()
        plan = lane.dep.plan if lane is not None else None
        if plan is not None and plan.router is not None and not plan.router.http:
            return url_for(self.host, self.port, scheme="ggml-rpc")
        return url_for(self.host, self.port)

    def alive(self) -> bool:
        return self.router is None or self.router.alive()

    def down(self) -> str | None:
        """Why the port refuses every connection (its router's acceptor is not running)."""
        return self.watch.down() if self.watch is not None else None

    def check_port(self) -> bool:
        """The daemon's tick: restart a router that stopped accepting (portwatch.py); True
        when the port went down or came back."""
        return self.watch.check() if self.watch is not None else False

    def _upstreams(self) -> Upstreams:
        return Upstreams(rpc=self._rpc, hydra=self.hydra_upstream)

    def set_rpc(self, addr: Addr | None) -> None:
        """ggml-RPC through this port (a lane that lends a device: mode: peer)."""
        self._rpc = addr
        if self.router is not None:
            self.router.set_upstreams(self._upstreams())

    def set_hydra_upstream(self, addr: Addr | Handoff | None) -> None:
        """The wire protocol's server (YH frames on this port)."""
        self.hydra_upstream = addr
        if self.router is not None:
            self.router.set_upstreams(self._upstreams())

    def set_request_defaults(self, d: dict[str, Any]) -> None:
        if self.router is not None:
            self.router.set_request_defaults(d)  # T1 defaults are the port's

    # -- the loop ---------------------------------------------------------------------------------

    async def start(self, initial: list[str] | None = None) -> None:
        """Start serving: one lane is started and followed; among several, the default and
        every `on_demand: false` lane load (as far as they fit together)."""
        self.loop = asyncio.get_running_loop()
        lane = self.only()
        if not self.by_model:
            if lane is not None:
                await lane.start()
                if self.standby is not None:
                    self.standby.follow()  # loads once the lane serves (in the background)
            self.started.set()
            return
        self._tick_task = asyncio.create_task(self._ticks())
        self._boot = asyncio.create_task(self._start_loads(
            initial if initial is not None else self.initial_names()))

    def initial_names(self) -> list[str]:
        """Loaded at start: the default lane, then every `on_demand: false` one."""
        rest = [n for n, x in self.lanes.items() if not x.on_demand and n != self.default]
        return [*([self.default] if self.default else []), *rest]

    async def _start_loads(self, names: list[str]) -> None:
        try:
            for name in names:
                lane = self.lanes[name]
                if lane.phase is not LaneState.STOPPED:
                    continue
                fits = self.node.fits_now(lane)
                if fits.verdict.name != "FITS" and name != self.default:
                    lane.why = f"did not fit at start ({fits.reason})"
                    log.info("profile %s not loaded at start: %s", name, fits.reason)
                    lane.stopped_gate()
                    continue
                lane.job = asyncio.current_task()
                await lane.load("at start")
        finally:
            self.started.set()
            self._announce()

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            now = self.clock()
            for lane in list(self.lanes.values()):
                if lane.job is not None:
                    continue
                if lane.phase is LaneState.STOPPED and lane.on_demand and lane.route.gate.held():
                    self._want(lane.name)  # requests parked while it was being stopped
                elif lane.phase is LaneState.SERVING and lane.ttl is not None \
                        and not lane.busy:
                    st = lane.route.stats()
                    idle = now - lane.route.last_used
                    if idle >= lane.ttl and not st["inflight"] and not st["held"] \
                            and not st["waiting"]:
                        task = asyncio.create_task(
                            lane.unload(f"idle {idle:.0f}s (ttl {lane.ttl:g}s)"))
                        lane.job = task
                        task.add_done_callback(functools.partial(_clear_job, lane))
                elif lane.went_fatal():
                    self._announce()
            self.ticks += 1

    def ready(self) -> bool:
        return self.started.is_set()

    async def switch_to(self, dep: Deployment) -> SwitchReport:
        """A port with one lane (or none): run `dep` in its place (any profile)."""
        if self.standby is not None:  # a flip when `dep` is the loaded standby
            flipped = await self.standby.before_switch(dep)
            if flipped is not None:
                return flipped
        lane = self.only()
        made = lane is None
        if lane is None:
            profile = dep.layout.profile if dep.layout is not None else None
            lane = self.add_lane(profile, dep)
        rep = await lane.switch(dep)
        if made and not lane.running:
            # The first switch of a port with no lane failed and had nothing to roll back to:
            # the port has no lane again (idle; its 503 names `hydra switch NAME`), as it was
            # before, not a failed lane of a profile nobody runs.
            self._drop(lane)
        if self.standby is not None:
            self.standby.after_switch(rep)
        return rep

    def _drop(self, lane: Lane) -> None:
        self.reports.extend(lane.switches)  # status and STATUS= still say what failed
        del self.lanes[lane.name]
        if self.node.lanes.get(lane.name) is lane:
            del self.node.lanes[lane.name]
        if self.default == lane.name:
            self.default = next(iter(self.lanes), None)
        self.lookup = self._names([x.profile_or_name() for x in self.lanes.values()])
        self._announce()

    async def apply_to(self, name: str, dep: Deployment) -> SwitchReport:
        """A new Deployment for a serving lane (the wire protocol's CONFIGURE and
        SET_EXPERT_MODE): run through its apply (plandiff)."""
        lane = self.lanes[name]
        if self.by_model and lane.phase is not LaneState.SERVING:
            raise HydraError(f"profile {name} is {lane.state_now().value}: nothing to "
                             "reconfigure")
        return await lane.apply(dep)

    def differs(self, lane: Lane, prof: Profile, dep: Deployment) -> bool:
        """Whether a re-read profile changes anything of `lane` (its plan, policies, knobs)."""
        new = lane.own(dep)
        d = plandiff.diff(lane.dep.plan, new.plan)
        same_addr = replace(prof, host=lane.profile.host, port=lane.profile.port) \
            if lane.profile is not None else prof
        return (d.change is not plandiff.Change.NONE or same_addr != lane.profile
                or new.policy != lane.dep.policy or new.timeouts != lane.dep.timeouts)

    async def replace(self, lane: Lane, new: tuple[Profile, Deployment]) -> str:
        """A reload of one lane among several: a serving lane restarts what changed (plandiff:
        the head alone, or everything); a stopped one uses the new plan at its next load."""
        prof, dep = new[0], lane.own(new[1])
        me = asyncio.current_task()
        while lane.job is not None and lane.job is not me:  # a load or an unload: let it finish
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(lane.job)
        lane.job = me  # no ttl unload, eviction or load of it meanwhile
        try:
            lookup = self._names([(prof.name, prof.aliases) if x is lane else
                                  x.profile_or_name() for x in self.lanes.values()])
            did = "not loaded: the new settings apply at its next load"
            if lane.phase is LaneState.SERVING:
                rep = await lane.apply(dep)
                if rep.result not in ("ok", "noop"):
                    raise HydraError(f"reload of {lane.name}: {rep.result}: {rep.error}")
                did = (f"restarted {', '.join(rep.restarted)} in {rep.total_s:.2f}s"
                       if rep.result == Result.OK else "routing settings only, nothing restarted")
            lane.take_settings(dep, prof)
            self.lookup = lookup
            if lane.phase is LaneState.STOPPED:
                lane.stopped_gate()
            self._announce()
            return did
        finally:
            lane.job = None

    async def shutdown(self, reason: str) -> None:
        for t in (self._tick_task, self._boot):
            if t is not None:
                t.cancel()
        jobs = [x.job for x in self.lanes.values() if x.job is not None
                and x.job is not asyncio.current_task()]
        for t in jobs:
            t.cancel()
        await asyncio.gather(*(t for t in (self._tick_task, self._boot, *jobs)
                               if t is not None), return_exceptions=True)
        await asyncio.gather(*(x.shutdown(reason) for x in self.lanes.values()),
                             *([self.standby.shutdown(reason)] if self.standby else []),
                             return_exceptions=True)

    @property
    def unkillable(self) -> list[str]:
        return [u for x in self.lanes.values() for u in x.unkillable]


def _clear_job(lane: Lane, _task: asyncio.Task[Any]) -> None:
    lane.job = None
