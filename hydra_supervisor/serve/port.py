"""One external address: its Router, its lanes by name and alias, the default lane, the
routing table it publishes, its standby pair, and its status rows.

Every port works one way, with 0..N lanes (N = 1 is the common case, not a mode): a lane per
profile served on the address, the request's `model` picks it (serve/table.py), the default
lane answers requests without one, a stopped lane loads on request. `hydra up -p demo` is a
port with one lane named `demo`, its processes `demo.head`, `demo.peer-cuda1`; `--no-profile`
a port with none. What differs between ports is policy, as values: `exit_on_fatal` (a hydra
that serves one profile ends, exit 1, when its layout goes FATAL, so a service manager
restarts it; among several a failed profile is marked failed and the others serve on).

Everything here runs on the event loop. Router threads read only the `RouteTable` the port
publishes after each change (`_publish`), and post a request for a stopped lane's load to the
loop (`ask_load`), which decides.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from hydra_supervisor.config.profile import Profile, TlsFiles
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import plandiff
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.plan import Address
from hydra_supervisor.plan.ports import host_port, url_for
from hydra_supervisor.proc import gpumem
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.proc.supervisor import Supervisor
from hydra_supervisor.router import Router, Upstreams, tls
from hydra_supervisor.router.conn import Addr, Handoff
from hydra_supervisor.router.gate import Gate
from hydra_supervisor.router.routes import Limiter, LocalReply, Route
from hydra_supervisor.router.traffic import LaneTraffic
from hydra_supervisor.serve import states
from hydra_supervisor.serve.clock import wall
from hydra_supervisor.serve.events import Event, Sink
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.node import TICK, Node
from hydra_supervisor.serve.portwatch import PortWatch
from hydra_supervisor.serve.reports import (
    Busy,
    Phases,
    Result,
    Stopped,
    SwitchReport,
    SwitchTimeouts,
    UnloadReport,
)
from hydra_supervisor.serve.snapshot import PortStatus, RouterCounters, SwitchStatus, parse
from hydra_supervisor.serve.standby import Standby
from hydra_supervisor.serve.states import LaneState
from hydra_supervisor.serve.table import Entry, RouteTable

log = logging.getLogger("hydra")
DEFAULT_ALLOW = ("127.0.0.0/8", "::1/128")
DEMAND_WAIT_S = 5.0  # how long a router thread waits for the loop to take a request's load


class Port:
    def __init__(self, state: StateDir, host: str, port: int, *, node: Node,
                 allow: tuple[str, ...] = DEFAULT_ALLOW, tls_files: TlsFiles | None = None,
                 use_router: bool = True,
                 exit_on_fatal: bool = False,
                 profiles: Callable[[], list[str]] | None = None,
                 switch_timeouts: SwitchTimeouts | None = None,
                 router_kwargs: dict[str, Any] | None = None, load_wait: float = 120.0,
                 make_router: Callable[..., Router] = Router,
                 make_supervisor: Callable[..., Any] | None = None) -> None:
        """`exit_on_fatal`: the policy of a hydra that serves one profile (its FATAL ends
        hydra, exit 1). The clock is the node's (one clock for every policy)."""
        self.state = state
        self.host = host
        self.port = port
        self.node = node
        self.allow = allow
        self.tls_files = tls_files  # a peer profile's tls: the router takes TLS only
        self.use_router = use_router
        self.exit_on_fatal = exit_on_fatal
        self.profiles = profiles or (lambda: [])
        self.switch_timeouts = switch_timeouts or SwitchTimeouts()
        self.router_kwargs = dict(router_kwargs or {})
        self.load_wait = load_wait
        self.clock = node.clock
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
        self.sinks: list[Sink] = []  # who hears its lanes' lifecycle events (serve/events.py)
        self.table = RouteTable()
        self._tick_task: asyncio.Task[None] | None = None
        self._boot: asyncio.Task[None] | None = None
        self._created = int(wall())
        self._rpc: Addr | None = None
        # Where requests go while the port has no lane (503 naming `hydra switch NAME`).
        self._none = Route("none", Gate(), where=f"port {port}")
        self._pending: list[tuple[Profile | None, Deployment]] = []
        # Reports of changes that left the port without a lane (a failed first switch).
        self.reports: list[SwitchReport] = []
        # The other layout of its one lane's model, kept loaded beside it (serve/standby.py).
        self.standby: Standby | None = None

    # -- lanes ----------------------------------------------------------------------------------

    def plan_lane(self, profile: Profile | None, dep: Deployment) -> None:
        """A lane to make when the port opens (its route needs the router)."""
        self._pending.append((profile, dep))

    def planned(self) -> list[Deployment]:
        """The layouts of its lanes (made, or to make when it opens)."""
        return [*(d for _, d in self._pending), *(x.dep for x in self.lanes.values())]

    def new_route(self, name: str, profile: Profile | None) -> Route:
        """A route for a lane of this port (the router's, or a recording one without it)."""
        conc = profile.concurrency if profile is not None else None
        queue = profile.queue if profile is not None else 32
        if self.router is not None:
            route = self.router.new_route(name, conc, queue)
        else:  # router: false: llama-server holds the port; the route only records
            route = Route(name, Gate(),
                          limiter=Limiter(name, conc, queue) if conc else None)
        route.where = f"port {self.port}"
        route.clock = self.clock  # its idle time and the ttl on the policy's clock
        route.touch()
        return route

    def make_lane(self, profile: Profile | None, dep: Deployment, *,
                  standby: bool = False) -> Lane:
        """A lane of this port (not yet in its table: `add_lane`, or the standby's)."""
        route = self.new_route(dep.profile, profile)
        return Lane(self, dep, route, state=self.state, profile=profile,
                    node=self.node, switch_timeouts=self.switch_timeouts,
                    make_supervisor=self.make_supervisor, clock=self.clock,
                    exit_on_fatal=self.exit_on_fatal and not standby,
                    load_wait=self.load_wait, standby=standby,
                    seq_from=max((r.seq for r in self.reports), default=0))

    def add_lane(self, profile: Profile | None, dep: Deployment) -> Lane:
        lane = self.make_lane(profile, dep)
        self.lookup = self._names([*(x.profile_or_name() for x in self.lanes.values()),
                                   (lane.name, lane.aliases)])
        self.node.add(lane)
        self.lanes[lane.name] = lane
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
        """The lane of a port with exactly one (None: none, or several)."""
        return next(iter(self.lanes.values())) if len(self.lanes) == 1 else None

    def default_lane(self) -> Lane | None:
        """The lane requests without a model go to (the wire protocol's lane too)."""
        return self.lanes.get(self.default) if self.default is not None else None

    def every_lane(self) -> list[Lane]:
        """Its lanes, and its standby's when one is loaded (restart, kill, status)."""
        sb = self.standby.lane if self.standby is not None else None
        return [*self.lanes.values(), *([sb] if sb is not None else [])]

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
        if lane.name in self.lanes:
            lane.went_fatal()
        self.announce()

    def announce(self) -> None:
        """Publish the routing table, then tell the listeners (the daemon's snapshot)."""
        self._publish()
        for fn in self.listeners:
            fn()

    def emit(self, event: Event) -> None:
        """A lifecycle event of one of its lanes or its standby (the loop): to every sink."""
        for fn in self.sinks:
            try:
                fn(event)
            except Exception:  # a sink's bug must not break the change that said it
                log.exception("event sink failed on %s", event)

    # -- the routing table (built here, read by router threads) ---------------------------------

    def _publish(self) -> None:
        entries = {}
        for name, lane in self.lanes.items():
            word = self.state_of(lane)
            entries[name] = Entry(
                name=name, route=lane.route, state=word,
                loadable=lane.on_demand and lane.phase in (LaneState.STOPPED,
                                                           LaneState.FAILED),
                failed=lane.phase is LaneState.FAILED,
                reason=lane.error or lane.why)
        mine = self.every_lane()
        elsewhere = frozenset(label for o in self.node.lanes.values()
                              if o not in mine and not o.standby
                              for label in (o.name, *o.aliases))
        self.table = RouteTable(
            entries=MappingProxyType(entries), lookup=MappingProxyType(dict(self.lookup)),
            default=self.default, none=self._none, models=self.models_json(),
            ask_load=self._ask_load, elsewhere=elsewhere)
        if self.router is not None:
            self.router.table = self.table

    def select(self, model: str | None, method: str, path: str) -> Route | LocalReply:
        """Where a request goes, from the published table (any thread)."""
        return self.table.select(model, method, path)

    def _ask_load(self, name: str) -> None:
        """A request for a stopped or failed lane (a router thread): the loop decides and acts
        (the lane is the only writer of its gate); this thread waits for that, bounded, so the
        request meets the gate as the loop left it (held for the load, or still answering the
        failure during its cooldown)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:  # (tests route from the loop's own thread: it cannot wait for itself)
            self.demand(name, later=True)
            return
        fut = asyncio.run_coroutine_threadsafe(self._demand_on_loop(name), loop)
        try:
            fut.result(DEMAND_WAIT_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            log.warning("profile %s: the loop did not take its load request within %gs",
                        name, DEMAND_WAIT_S)

    async def _demand_on_loop(self, name: str) -> None:
        self.demand(name)

    def demand(self, name: str, later: bool = False) -> None:
        """(The loop.) A request asks for lane `name`: a stopped lane loads; a failed one
        loads once its cooldown is over. The gate is set at once; the load starts now or,
        ``later``, on the loop's next turn."""
        lane = self.lanes.get(name)
        if lane is None or not lane.on_demand or lane.job is not None \
                or lane.phase not in (LaneState.STOPPED, LaneState.FAILED):
            return
        if lane.phase is LaneState.FAILED:
            if self.clock() - lane.failed_at < lane.cooldown:
                return  # its route answers 503 with the failure until the cooldown is over
            # Before the request reaches the gate: it must wait for the load, not get the 503.
            lane.hold(f"loading profile {lane.name} (on request, after a failure)",
                      clear_refusal=True)
        if later and self.loop is not None:
            self.loop.call_soon(self._want, name)
        else:
            self._want(name)

    def _want(self, name: str) -> None:
        lane = self.lanes.get(name)
        if lane is not None and lane.job is None \
                and lane.phase in (LaneState.STOPPED, LaneState.FAILED):
            lane.job = asyncio.create_task(self._load_on_request(lane))

    async def _load_on_request(self, lane: Lane) -> None:
        if await lane.load("on request") and self.standby is not None \
                and lane is self.only():
            self.standby.follow()  # unloaded with it (hydra unload): it comes back with it

    # -- the port ---------------------------------------------------------------------------------

    def open(self) -> None:
        """Bind the external port (the router). Without a router the head binds it itself."""
        planned = {d.profile for _, d in self._pending} | set(self.lanes)
        if self.default is not None and self.default not in planned:
            # a default no lane serves would fail every model-less request
            raise HydraError(f"default profile '{self.default}' is not served on port "
                             f"{self.port}")
        if self.use_router:
            kw = dict(self.router_kwargs)
            if self.tls_files is not None:  # HydraError (error/fix) when a file does not load
                kw["tls_context"] = tls.server_context(self.tls_files)
            self.router = self.make_router(self.host, self.port, Upstreams(), allow=self.allow,
                                           name=f"port {self.port}", **kw)
            self._idle_message()  # before the port opens: no request sees a port without one
            self._publish()
            self.router.start()
            self.port = self.router.port  # --port 0: the port the kernel gave us
            self.watch = PortWatch(host_port(self.host, self.port), self.router)
        self._none.where = f"port {self.port}"
        for profile, dep in self._pending:
            lane = self.add_lane(profile, dep)
            lane.stopped_gate()
        self._pending = []
        self._publish()

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
    def address(self) -> Address:
        """The external address this port serves on (after `open`, the port its router really
        bound: `--port 0` asks for any free one). Planning for this port takes it as a value
        (deployment.prepare's `external`); no plan carries it."""
        return Address(self.host, self.port)

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

    def traffic_of(self, profile: str) -> LaneTraffic:
        """What the port's router counted of `profile`'s requests (router/traffic.py); none
        without a router (router: false: llama-server holds the port)."""
        if self.router is None:
            return LaneTraffic()
        return self.router.traffic.lane(self.port, profile)

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
        """(The loop.) T1 sampling defaults of the port's requests (the wire's CONFIGURE)."""
        if self.router is not None:
            self.router.set_request_defaults(dict(d))

    # -- the loop ---------------------------------------------------------------------------------

    async def start(self, initial: list[str] | None = None) -> None:
        """Start serving: the default lane and every `on_demand: false` lane load (as far as
        they fit together), in the background; the others load on request."""
        self.loop = asyncio.get_running_loop()
        self._publish()
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
                ok = await lane.load("at start")
                if ok and self.standby is not None and lane.name == self.default:
                    self.standby.follow()  # loads once the lane serves (in the background)
        finally:
            self.started.set()
            self.announce()

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            for lane in list(self.lanes.values()):
                if lane.job is not None:
                    continue
                if lane.phase is LaneState.STOPPED and lane.on_demand \
                        and lane.route.gate.held():
                    self._want(lane.name)  # requests parked while it was being stopped
                elif lane.phase is LaneState.SERVING and lane.ttl is not None \
                        and not lane.busy:
                    idle = lane.route.idle_for()  # from when nothing was in flight
                    if idle >= lane.ttl and not lane.route.active():
                        task = asyncio.create_task(
                            lane.unload(f"idle {idle:.0f}s (ttl {lane.ttl:g}s)"))
                        lane.job = task
                        task.add_done_callback(functools.partial(_clear_job, lane))
                elif lane.went_fatal():
                    self.announce()
            self.ticks += 1

    def ready(self) -> bool:
        return self.started.is_set()

    def fatal(self) -> str | None:
        """Why hydra must end (exit 1): a lane under the `exit_on_fatal` policy failed and no
        change of it runs (a change rolls back first). None otherwise."""
        for lane in self.lanes.values():
            if lane.exit_on_fatal and lane.phase is LaneState.FAILED and not lane.busy \
                    and lane.job is None:
                return lane.error or "failed"
        return None

    # -- changes --------------------------------------------------------------------------------

    def names(self, ref: str) -> Lane | None:
        """The lane (or loaded standby) a switch's `ref` names: a profile name or its file."""
        for lane in self.every_lane():
            if lane.answers_to(ref):
                return lane
        return None

    async def switch(self, lane: Lane) -> SwitchReport:
        """`hydra switch NAME` for a lane of this port: a no-op when it serves; a flip when it
        is the loaded standby; else the lanes sharing its devices stop (drained, then cut) and
        it loads (Node.activate), and if that fails they come back."""
        if self.standby is not None and self.standby.lane is lane:
            if self.standby.ready():
                return await self.flip()
            raise Busy(f"the standby {lane.name} cannot take over now "
                       f"({self.standby.not_instant() or 'busy'})")
        if lane.phase is LaneState.SERVING:
            return SwitchReport(to=lane.name, frm=None, result=Result.NOOP,
                                reason=f"{lane.name} is already serving (`hydra reload` "
                                       f"applies an edited profile, `hydra restart` restarts)")
        if self.standby is not None and lane.name == self.default:
            await self.standby.drop(f"switch to {lane.name}")
        report = await self.node.activate(lane)
        if self.standby is not None and lane.name == self.default:
            self.standby.follow()
        return report

    async def load(self, lane: Lane) -> SwitchReport:
        """`hydra load NAME` for a lane of this port: loaded beside what serves, stopping only
        what does not fit (Node.load); a no-op when it serves (the loaded standby too)."""
        sb = self.standby
        if sb is not None and sb.lane is lane:
            active = self.only()
            return SwitchReport(to=lane.name, frm=None, result=Result.NOOP,
                                reason=f"{lane.name} is already loaded as the standby of "
                                       f"{active.name if active else 'this port'} "
                                       f"(`hydra switch {lane.name}` flips to it)")
        await self._settle(lane)
        report = await self.node.load(lane)
        if report.result == Result.OK and sb is not None and lane is self.only():
            sb.follow()
        return report

    async def load_standby(self) -> SwitchReport:
        """`hydra load NAME` for the standby profile of this port's lane, not loaded now
        (unloaded, or it did not fit at start): load it beside its active lane, stopping
        nothing."""
        sb = self.standby
        assert sb is not None
        name = sb.wanted() or "?"
        report = SwitchReport(to=name, frm=None)
        phase = Phases(report, self.clock)
        with phase("start"):
            sb.follow()
            task = sb.task
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(task)
        phase.done()
        lane = sb.lane
        if lane is not None and lane.phase is LaneState.SERVING:
            report.result = Result.OK
        else:
            report.result = Result.FAILED
            report.failed_phase = "start"
            report.error = f"standby {name}: {sb.why or 'not loaded'}"
        return report

    async def unload(self, lane: Lane, why: str) -> UnloadReport:
        """`hydra unload NAME` for a lane of this port: hold, drain (bounded), cut what is
        left, stop; it stays routable (the next request for it loads it again, unless
        `on_demand: false`). A lane that is loading or stopping is waited for first; the
        standby of a pair is dropped with its active lane (it comes back with it)."""
        t0 = self.clock()
        out = UnloadReport()
        sb = self.standby
        if sb is not None and sb.lane is lane:
            active = self.only()
            sb.why = f"unloaded ({why}); `hydra load {lane.name}` loads it again"
            dropped = await sb.drop(why, keep_why=True)
            out.stopped.append(Stopped(
                lane.name, f"the standby of {active.name if active else 'this port'}; "
                           f"`hydra load {lane.name}` loads it beside it again", dropped))
            out.total_s = self.clock() - t0
            return out
        was = lane.state_now()
        await self._settle(lane)
        if lane.phase in (LaneState.STOPPED, LaneState.FAILED):
            out.not_loaded[lane.name] = (
                f"failed: {lane.error}" if lane.phase is LaneState.FAILED and lane.error
                else f"stopped: {lane.why}")
            return out
        if lane.busy:
            raise Busy(f"a change is running on profile {lane.name} (a reload or "
                       "`hydra restart`); try again when it is done")
        if was in (LaneState.LOADING, LaneState.UNLOADING):
            out.notes.append(f"{lane.name} was {was.value}; it was stopped once that was over")
        if sb is not None and sb.lane is not None and lane is self.only():
            pair = sb.lane.name
            pair_cut = await sb.drop(f"{why} ({lane.name}, its active layout)")
            out.stopped.append(Stopped(pair, f"the standby of {lane.name} goes with it "
                                             "(it comes back when it loads again)", pair_cut))
        lane.job = asyncio.current_task()  # no ttl, eviction or on-request load meanwhile
        try:
            cut = await lane.unload(why, cut=True)
        finally:
            lane.job = None
        if cut is None:
            raise Busy(f"profile {lane.name} is {lane.state_now().value}; try again")
        out.stopped.insert(0, Stopped(lane.name, why, cut))
        out.on_demand[lane.name] = lane.on_demand
        out.total_s = self.clock() - t0
        return out

    async def _settle(self, lane: Lane) -> None:
        """Wait until a load or unload of `lane` in progress is over (bounded by a whole load
        and a drain)."""
        deadline = self.clock() + lane.dep.timeouts.load + lane.dep.timeouts.peer \
            + self.switch_timeouts.drain + self.load_wait
        me = asyncio.current_task()
        while (lane.job is not None and lane.job is not me) \
                or lane.phase in (LaneState.LOADING, LaneState.UNLOADING):
            if self.clock() > deadline:
                raise Busy(f"profile {lane.name} is still {lane.state_now().value}; "
                           "try again when it is done")
            job = lane.job
            if job is not None and job is not me:
                await asyncio.wait({job}, timeout=TICK)
            else:
                await asyncio.sleep(TICK)

    async def switch_in(self, dep: Deployment) -> SwitchReport:
        """`hydra switch PROFILE` for a profile this port does not serve: its default lane
        takes the profile (hold, drain, stop, start, gate, release; a failure rolls back), or,
        on a port with no lane, a lane is made for it (and dropped again if it fails)."""
        if self.standby is not None:
            if self.standby.ready_for(dep.profile):
                return await self.flip()  # it became ready while the switch was planned
            await self.standby.before_switch(dep)
        lane = self.default_lane()
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
        self.reports = [*self.reports, *lane.switches][-20:]  # status still says what failed
        del self.lanes[lane.name]
        self.node.remove(lane)
        if self.default == lane.name:
            self.default = next(iter(self.lanes), None)
        self.lookup = self._names([x.profile_or_name() for x in self.lanes.values()])
        self.announce()

    async def flip(self) -> SwitchReport:
        """Re-point the port to its loaded standby in one step; the old layout stands by
        (serve/standby.py prepares it; the port's table changes here)."""
        sb = self.standby
        assert sb is not None
        return await sb.flip(self._swap)

    def _swap(self, active: Lane, target: Lane) -> None:
        """One published table re-points every new request to `target`."""
        target.take_over(active)
        self.lanes = {target.name: target}
        self.default = target.name
        self.lookup = {label: target.name for label in (target.name, *target.aliases)}
        self.node.add(target)
        self.announce()

    async def apply_to(self, name: str, dep: Deployment) -> SwitchReport:
        """A new Deployment for a serving lane (the wire protocol's CONFIGURE and
        SET_EXPERT_MODE): run through its apply (plandiff)."""
        lane = self.lanes[name]
        if lane.phase is not LaneState.SERVING:
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

    async def replace(self, lane: Lane, new: tuple[Profile, Deployment]) -> tuple[
            str, SwitchReport | None]:
        """A reload of one lane: a serving lane restarts what changed (plandiff: the head
        alone, or everything; a failure rolls back and keeps the old settings); a stopped one
        uses the new plan at its next load. Returns what it did, and the report of a change
        that ran (its result says whether it failed)."""
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
            rep = None
            if lane.phase is LaneState.SERVING:
                rep = await lane.apply(dep)
                if rep.result not in (Result.OK, Result.NOOP):
                    back = "rolled back" if rep.result == Result.ROLLED_BACK else "failed"
                    return f"{back}: {rep.error}", rep  # the old settings stay
                did = (f"restarted {', '.join(rep.restarted)} in {rep.total_s:.2f}s"
                       if rep.result == Result.OK else "routing settings only, nothing restarted")
            lane.take_settings(dep, prof)
            self.lookup = lookup
            if lane.phase is LaneState.STOPPED:
                lane.stopped_gate()
            self.announce()
            return did, rep
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

    # -- answers and status rows (the loop) -------------------------------------------------------

    def state_of(self, lane: Lane) -> str:
        if self.down():
            return states.PORT_DOWN  # no request reaches any lane here (phase: its own)
        return lane.state_now().value

    def models_json(self) -> dict[str, Any]:
        """/v1/models: hydra's list, one shape on every port; a loaded layout carries
        llama-server's own `meta` (vocabulary, context, parameters)."""
        data: list[dict[str, Any]] = []
        for lane in self.lanes.values():
            data.append({
                "id": lane.name, "object": "model", "created": self._created,
                "owned_by": "hydra", "state": self.state_of(lane),
                "status": {"value": states.MODEL_STATUS[lane.state_now()]},
                "aliases": list(lane.aliases), "default": lane.name == self.default,
                "devices": list(lane.devices), "mode": lane.dep.plan.mode,
                "model": lane.dep.model_label, "on_demand": lane.on_demand,
                "error": lane.error, "standby": False,
                **({"meta": dict(lane.meta)} if lane.meta is not None else {})})
        if self.standby is not None:
            data += self.standby.models(self._created)
        return {"object": "list", "data": data}

    def router_status(self) -> RouterCounters | None:
        """The port's router counters (held/inflight: every route's gate) and hydra's restarts
        of it; None without a router (router: false)."""
        if self.router is None:
            return None
        st: dict[str, object] = dict(self.router.stats())
        if self.watch is not None:
            st.update(self.watch.counts())
        return parse(RouterCounters, st)

    def status(self, gpu: Mapping[int, int] | None = None) -> PortStatus:
        """The port in the published status (serve/snapshot.py): its address, router
        counters and lanes, the standby's beside its active one. `gpu`: NVML's bytes per pid
        when the caller has read them."""
        if gpu is None:
            running = any(x.running for x in self.every_lane())
            gpu = gpumem.used_by_pid() if running else {}
        sb = self.standby
        pair = sb.wanted() if sb is not None else None  # the standby of the port's one lane
        lanes = [lane.status(gpu, name=f"port-{self.port}/{lane.name}",
                             state=self.state_of(lane), default=lane.name == self.default,
                             standby=pair)
                 for lane in self.lanes.values()]
        if sb is not None and self.lanes:
            extra = sb.status(gpu, f"port-{self.port}/standby", self.state_of)
            if extra is not None:
                lanes.append(extra)
        return PortStatus(name=f"port-{self.port}", host=self.host, port=self.port,
                          url=self.url, alive=self.alive(), down=self.down(),
                          default=self.default, router=self.router_status(),
                          lanes=tuple(lanes), tls=self.tls_files is not None,
                          switches=tuple(SwitchStatus.of(r) for r in self.reports))


def _clear_job(lane: Lane, _task: asyncio.Task[Any]) -> None:
    lane.job = None
