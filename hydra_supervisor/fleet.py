"""Several profiles behind one external port, routed by the request's `model` (docs/routing.md).

A Fleet owns one port's Router and one Engine per profile served there. Each profile has a
Route of its own in the router (gate, upstream, optional concurrency limit), so one profile can
load, drain or stop while the others serve. The router asks `select` where each request goes:
the OpenAI `model` field (the profile's name or one of its aliases; none: the default profile)
picks the profile; `GET /v1/models` is answered here; an unknown model gets 404 naming the
known ones.

Lifecycle of a profile (its Phase): STOPPED -> LOADING -> RUNNING -> UNLOADING -> STOPPED, and
FAILED when a load fails or the running layout goes FATAL. A request for a STOPPED profile
loads it (unless `on_demand: false`) and waits, held in its route, until it serves. Before a
load the profile needs room on its devices (fleetplan.make_room): it fits beside what runs, or
the least recently used profiles that share its devices stop first, each after its in-flight
requests drain (bounded; an eviction whose requests do not drain is given up, never cut), and
never one inside its `min_resident` window. A profile unloads after `ttl` seconds without
requests. `activate` (hydra switch) is the explicit form: it stops every profile that shares
the target's devices (drained, then cut) and loads the target; if that fails, they come back.

Everything here runs on the event loop, except `select` (router threads), which only reads
and hands work to the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from hydra_supervisor import deployment, fleetplan, gpumem, llamaerr, plandiff
from hydra_supervisor.config import Profile
from hydra_supervisor.deployment import Deployment
from hydra_supervisor.engine import (
    Engine,
    EngineBusy,
    LayoutFailed,
    SwitchReport,
    SwitchTimeouts,
)
from hydra_supervisor.errors import HydraError
from hydra_supervisor.ports import host_port, url_for
from hydra_supervisor.portwatch import PortWatch
from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.router.conn import Addr, Handoff
from hydra_supervisor.router.routes import Limiter, LocalReply, Route
from hydra_supervisor.router.view import RouteView
from hydra_supervisor.state import StateDir
from hydra_supervisor.supervisor import Supervisor

log = logging.getLogger("hydra")
# How long a router thread waits for the loop to take a request's load (it is then held).
_DEMAND_WAIT_S = 5.0

FAIL_COOLDOWN = 10.0  # a profile whose load failed answers 503 this long before a retry
FAIL_COOLDOWN_MAX = 300.0  # ... doubled after each failure in a row, up to this
TICK = 0.25  # ttl checks, held requests of stopped profiles, waiting for room
MODEL_PATHS = ("/v1/models", "/models")


class Phase(Enum):
    STOPPED = "stopped"
    LOADING = "loading"
    RUNNING = "running"
    UNLOADING = "unloading"
    FAILED = "failed"


def namespaced(dep: Deployment) -> Deployment:
    """Process names prefixed with the profile (`demo.head`), so the profiles of one hydra
    keep apart in the state dir's pids/ and logs/ and in `hydra restart` / `hydra logs`."""
    name = dep.profile

    def ren(e: Any) -> Any:
        return e if e.name.startswith(f"{name}.") else replace(e, name=f"{name}.{e.name}")

    plan = replace(dep.plan, engines=tuple(ren(e) for e in dep.plan.engines))
    return replace(dep, plan=plan,
                   solo_head=ren(dep.solo_head) if dep.solo_head is not None else None)


@dataclass
class Member:
    profile: Profile
    dep: Deployment
    route: Route
    view: RouteView
    engine: Engine
    needs: dict[str, int]
    phase: Phase = Phase.STOPPED
    loaded_at: float | None = None
    error: str | None = None
    failed_at: float = float("-inf")
    fails: int = 0  # loads that failed in a row (0: the last one served, or none yet)
    loads: int = 0
    unloads: int = 0
    why: str = "not loaded yet"
    task: asyncio.Task[Any] | None = None

    @property
    def name(self) -> str:
        return self.profile.name

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.device for e in self.dep.plan.engines))

    @property
    def ttl(self) -> float | None:
        return self.profile.ttl or None

    @property
    def cooldown(self) -> float:
        """How long a failed profile answers 503 before a request loads it again: doubled
        after each failure in a row, so a broken profile costs less and less."""
        return min(FAIL_COOLDOWN * 2 ** max(0, self.fails - 1), FAIL_COOLDOWN_MAX)


# llama-server's router mode words, in /v1/models' "status": {"value": ...} (clients that
# manage models read these; hydra's own "state" says more).
_STATUS = {Phase.STOPPED: "unloaded", Phase.LOADING: "loading", Phase.RUNNING: "loaded",
           Phase.UNLOADING: "unloading", Phase.FAILED: "failed"}


def _needs(dep: Deployment) -> dict[str, int]:
    """Bytes per physical device the profile's plan needs."""
    lay = dep.layout
    return fleetplan.needs_of([(p.device, p.need_bytes) for p in dep.plan.placements],
                              lay.devices if lay is not None else {})


def _shape(reason: str) -> str:
    """A room reason without its numbers (seconds left, MiB short): what makes it news."""
    return re.sub(r"[0-9][0-9,.]*", "N", reason)


def _clear_task(m: Member, _task: asyncio.Task[Any]) -> None:
    m.task = None


class Pool:
    """What every Fleet of one hydra shares: the devices' capacity and every profile on every
    port (two ports may use one GPU: room is made node-wide)."""

    def __init__(self, capacity: dict[str, int]) -> None:
        self.capacity = capacity
        self.members: dict[str, Member] = {}
        self.owners: dict[str, Fleet] = {}
        self.room_changed = asyncio.Event()

    def planned_ports(self, but: Member) -> frozenset[int]:
        """Ports the other profiles' plans hold (a re-plan of `but` must not take them)."""
        return frozenset(e.port for o in self.members.values() if o is not but
                         for e in o.dep.plan.engines if e.managed)

    def add(self, m: Member, owner: Fleet) -> None:
        if m.name in self.members:
            first = self.members[m.name].dep.plan.source
            raise HydraError(f"two profiles are named {m.name} ({first} and "
                             f"{m.dep.plan.source}): profile names must differ")
        self.members[m.name] = m
        self.owners[m.name] = owner


class Fleet:
    def __init__(self, state: StateDir, host: str, port: int,
                 members: list[tuple[Profile, Deployment]], *, default: str,
                 pool: Pool, allow: tuple[str, ...],
                 switch_timeouts: SwitchTimeouts | None = None,
                 router_kwargs: dict[str, Any] | None = None, load_wait: float = 120.0,
                 clock: Callable[[], float] = time.monotonic,
                 make_router: Callable[..., Router] = Router,
                 make_supervisor: Callable[..., Any] | None = None) -> None:
        self.state = state
        self.host = host
        self.port = port
        self.allow = allow
        self.default = default
        self.pool = pool
        self.switch_timeouts = switch_timeouts or SwitchTimeouts()
        self.router_kwargs = dict(router_kwargs or {})
        self.load_wait = load_wait
        self.clock = clock
        self.make_router = make_router
        self.make_supervisor = make_supervisor  # seam: policy tests run fake supervisors
        self._specs = members
        self.members: dict[str, Member] = {}
        self.lookup: dict[str, str] = {}  # model name or alias -> profile
        self.router: Router | None = None
        self.watch: PortWatch | None = None  # the router accepting connections (open())
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = asyncio.Event()  # the start-up loads are over (served or not)
        self.listeners: list[Callable[[], None]] = []
        self._tick_task: asyncio.Task[None] | None = None
        self._boot: asyncio.Task[None] | None = None
        self._created = int(time.time())
        self.unkillable: list[str] = []
        self.lookup = self._names([p for p, _ in self._specs])
        if self.default not in {p.name for p, _ in self._specs}:
            raise HydraError(f"default profile '{self.default}' is not served on port "
                             f"{self.port}")

    def _names(self, profiles: list[Profile]) -> dict[str, str]:
        """Model name or alias -> profile; a name two profiles claim is refused."""
        seen: dict[str, str] = {}
        for prof in profiles:
            for label in (prof.name, *prof.aliases):
                other = seen.get(label)
                if other is not None and other != prof.name:
                    raise HydraError(f"model name '{label}' is claimed by profiles {other} and "
                                     f"{prof.name} on port {self.port}: give each a name of "
                                     "its own (aliases:)")
                seen[label] = prof.name
        return seen

    # -- the port -----------------------------------------------------------------------------

    def open(self) -> None:
        self.router = self.make_router(self.host, self.port, Upstreams(), allow=self.allow,
                                       name=f"port {self.port}", **self.router_kwargs)
        self.router.start()
        self.port = self.router.port
        self.watch = PortWatch(host_port(self.host, self.port), self.router)
        r = self.router
        for prof, dep in self._specs:
            dep = self._own(dep)
            route = r.new_route(prof.name, prof.concurrency, prof.queue)
            # A request that loads its profile waits for the whole load (a big model on a slow
            # disk takes minutes), not just the router's usual hold; a failed load answers it
            # at once anyway.
            route.gate.hold_timeout = max(route.gate.hold_timeout, dep.timeouts.load
                                          + dep.timeouts.peer + self.load_wait)
            view = RouteView(r, route)
            eng = Engine(self.state, self.host, self.port, allow=self.allow,
                         switch_timeouts=self.switch_timeouts,
                         make_router=lambda *a, _v=view, **k: _v,
                         make_supervisor=self.make_supervisor or Supervisor)
            eng.open()
            eng.listeners.append(self._engine_changed)
            m = Member(prof, dep, route, view, eng, _needs(dep))
            self.members[prof.name] = m
            self.pool.add(m, self)
            self._stopped_gate(m)
        r.table = self.select

    def _own(self, dep: Deployment) -> Deployment:
        """A Deployment as this fleet runs it: processes named after the profile, the plan on
        the port the router holds."""
        return deployment.bound_to(namespaced(dep), self.port)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.active = False  # down on purpose from now on
        if self.router is not None:
            self.router.stop()

    @property
    def url(self) -> str:
        return url_for(self.host, self.port)

    def alive(self) -> bool:
        return self.router is not None and self.router.alive()

    def down(self) -> str | None:
        """Why the port refuses every connection (its router's acceptor is not running), or
        None: then every profile here says "port down", whatever its phase."""
        return self.watch.down() if self.watch is not None else None

    def check_port(self) -> bool:
        """The daemon's tick: restart a router that stopped accepting (portwatch.py); True
        when the port went down or came back."""
        return self.watch.check() if self.watch is not None else False

    def set_hydra_upstream(self, addr: Addr | Handoff | None) -> None:
        """The wire protocol's server (YH frames on this port)."""
        if self.router is not None:
            self.router.set_upstreams(Upstreams(hydra=addr))

    # -- routing (router threads) ----------------------------------------------------------------

    def select(self, model: str | None, method: str, path: str) -> Route | LocalReply:
        if method == "GET" and path in MODEL_PATHS:
            return LocalReply(200, self.models_json())
        if not model and method in ("GET", "HEAD"):
            idle = self._idle_default(path)
            if idle is not None:
                return idle
        name = self.default if not model else self.lookup.get(model)
        if name is None:
            known = ", ".join(sorted(self.lookup))
            return LocalReply(404, {"error": {
                "code": 404, "type": "not_found_error",
                "message": f"model '{model}' is not served here; known models: {known}"}},
                counter="unknown_model")
        m = self.members[name]
        if m.profile.on_demand and m.phase in (Phase.STOPPED, Phase.FAILED):
            self._demand(m)
        return m.route

    def _idle_default(self, path: str) -> LocalReply | None:
        """A GET without a model while the default profile is not loaded (a health checker,
        a monitor): answered here, so polling does not load (or keep loaded) a profile."""
        m = self.members[self.default]
        if m.phase not in (Phase.STOPPED, Phase.FAILED):
            return None
        states = {n: self.state_of(o) for n, o in self.members.items()}
        if path == "/health":
            return LocalReply(200, {"status": "ok", "profiles": states})
        if path == "/slots":
            return LocalReply(200, [])
        return LocalReply(503, {"error": {
            "code": 503, "type": "unavailable_error",
            "message": f"the default profile {m.name} is not loaded ({m.error or m.why}); a "
                       "request naming a model loads it (GET /v1/models lists them)"}},
            counter="default_not_loaded")

    def name_for(self, model: str | None) -> str:
        """The profile a request's `model` went to (metrics label); the model itself if none."""
        if not model:
            return self.default
        return self.lookup.get(model, model)

    def _demand(self, m: Member) -> None:
        """A request for a stopped or failed profile (a router thread): the loop decides and
        acts (the fleet is the only writer of its routes' gates, on the loop's thread); this
        thread waits for that, bounded, so that the request meets the gate as the loop left it
        (held for the load, or still answering the failure during its cooldown)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:  # (tests route from the loop's own thread: it cannot wait for itself)
            self._demand_now(m.name, later=True)
            return
        fut = asyncio.run_coroutine_threadsafe(self._demand_on_loop(m.name), loop)
        try:
            fut.result(_DEMAND_WAIT_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            log.warning("profile %s: the loop did not take its load request within %gs",
                        m.name, _DEMAND_WAIT_S)

    async def _demand_on_loop(self, name: str) -> None:
        self._demand_now(name)

    def _demand_now(self, name: str, later: bool = False) -> None:
        """(The loop's thread.) The gate is set at once; the load starts now or, ``later``,
        on the loop's next turn."""
        m = self.members.get(name)
        if m is None:
            return
        if m.phase is Phase.FAILED:
            if self.clock() - m.failed_at < m.cooldown:
                return  # its route answers 503 with the failure until the cooldown is over
            # Before the request reaches the gate: it must wait for the load, not get the 503.
            m.route.gate.set_unavailable(None)
            m.route.gate.hold(f"loading profile {m.name} (on request, after a failure)")
        if later and self.loop is not None:
            self.loop.call_soon(self._want, name)
        else:
            self._want(name)

    # -- loading and unloading -------------------------------------------------------------------

    def _want(self, name: str) -> None:
        m = self.members[name]
        if m.task is None and m.phase in (Phase.STOPPED, Phase.FAILED):
            m.task = asyncio.create_task(self._load(m, "on request"))

    def _stopped_gate(self, m: Member) -> None:
        """What a request for a profile that is not loaded meets."""
        if m.profile.on_demand:
            m.route.gate.set_unavailable(None)
            m.route.gate.hold(f"profile {m.name} is not loaded; loading it on request")
        else:
            m.route.gate.set_unavailable(
                f"profile {m.name} is not loaded ({m.why}) and loads only with "
                f"`hydra switch {m.name}` (on_demand: false)", retry_after=30)

    def _occupants(self, but: Member) -> list[fleetplan.Occupant]:
        out = []
        for o in self.pool.members.values():
            if o is but or o.phase in (Phase.STOPPED, Phase.FAILED):
                continue
            loaded = o.loaded_at if o.loaded_at is not None else self.clock()
            out.append(fleetplan.Occupant(
                o.name, o.needs, o.route.last_used, loaded + o.profile.min_resident,
                movable=o.phase is Phase.RUNNING and not o.engine.lock.locked()))
        return out

    async def _room_for(self, m: Member, force: bool = False) -> None:
        """Wait until `m` fits, stopping what must go. A profile whose last load failed does
        not stop others to try again (each retry would evict a healthy profile): it loads
        beside what runs, or waits for `hydra switch` (`force`)."""
        deadline = self.clock() + self.load_wait
        waiting = ""
        while True:
            self.pool.room_changed.clear()  # before deciding: a change after it wakes us
            room = fleetplan.make_room(self.pool.capacity, self._occupants(m), m.needs,
                                       self.clock(), m.name)
            if room.verdict is fleetplan.Verdict.FITS:
                return
            if room.verdict is fleetplan.Verdict.NEVER:
                raise HydraError(room.reason)
            if room.verdict is fleetplan.Verdict.EVICT and m.fails and not force:
                raise HydraError(
                    f"its last load failed, and it does not stop {', '.join(room.victims)} "
                    f"to try again ({room.reason or 'no room beside them'}); "
                    f"`hydra switch {m.name}` does, or it loads once there is room")
            if room.verdict is fleetplan.Verdict.EVICT:
                for name in room.victims:
                    owner = self.pool.owners[name]
                    if await owner._unload(self.pool.members[name],
                                           f"making room for {m.name}") is None:
                        break  # still busy after the drain: decide again
                else:
                    continue
            if self.clock() >= deadline:
                raise HydraError(f"no room within {self.load_wait:.0f}s: {room.reason}")
            if waiting != _shape(room.reason):  # the countdown alone is not news
                waiting = _shape(room.reason)
                log.info("profile %s: %s", m.name, room.reason)
            m.route.gate.hold(f"loading profile {m.name}: {room.reason}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.pool.room_changed.wait(), TICK)

    async def _load(self, m: Member, why: str, force: bool = False) -> bool:
        """Make room, start the profile's layout, wait until it serves. False: it failed (its
        held requests got the reason; the others keep serving). `force` (hydra switch): it
        may stop others even after a failed load."""
        try:
            m.phase = Phase.LOADING
            m.error = None
            m.route.gate.set_unavailable(None)
            m.view.hold(f"loading profile {m.name} ({why})")
            self._announce()
            t0 = self.clock()
            try:
                await self._room_for(m, force)
                m.loads += 1
                log.info("loading profile %s (%s)", m.name, why)
                await m.engine.start(m.dep)
                await m.engine.wait_ready(m.dep.timeouts.load + m.dep.timeouts.peer)
            except (LayoutFailed, HydraError, OSError) as exc:
                await self._fail(m, str(exc), getattr(exc, "tail", []))
                return False
            m.phase = Phase.RUNNING
            m.fails = 0
            m.loaded_at = self.clock()
            m.route.touch()  # a fresh load counts as a use (LRU)
            log.info("profile %s serving after %.2fs (%s)", m.name, self.clock() - t0, why)
            m.engine.sync_gate()
            self.pool.room_changed.set()  # a loader waiting on this one may decide now
            return True
        finally:
            m.task = None
            self._announce()

    async def _fail(self, m: Member, error: str, tail: list[str]) -> None:
        # The supervisor's reason says what it would do next ("; restart 1 in 1.0s"); the
        # fleet does not retry on its own, so that part goes. llama.cpp's own error line (the
        # log's "error" lines, else its last line) says why.
        error = re.sub(r"; restart \d+ in [0-9.]+s$", "", error)
        why = llamaerr.error_line(tail) or next(
            (line.strip() for line in reversed(tail) if line.strip()), None)
        error = llamaerr.with_line(error, why)
        log.error("profile %s failed to load: %s", m.name, error)
        with contextlib.suppress(LayoutFailed, HydraError, OSError):
            await m.engine.stop_layout(f"load of {m.name} failed")
        m.failed_at = self.clock()  # before the phase: whoever reads FAILED reads its time
        m.error = error
        m.phase = Phase.FAILED
        m.fails += 1
        m.route.gate.set_unavailable(f"profile {m.name} failed to load: {error}",
                                     retry_after=int(m.cooldown))
        m.route.gate.release()
        self.pool.room_changed.set()

    async def _unload(self, m: Member, why: str, cut: bool = False) -> int | None:
        """Drain (bounded) and stop a running profile; how many requests were cut, or None
        when it was not stopped. Without `cut`, requests still in flight after the drain keep
        it running (None); with it, they are cut."""
        if m.phase is not Phase.RUNNING or m.engine.lock.locked():
            return None  # a reload or `hydra restart` is restarting its processes
        m.phase = Phase.UNLOADING
        self._announce()
        m.view.hold(f"profile {m.name} is stopping ({why})")
        drain = self.switch_timeouts.drain
        left = await asyncio.to_thread(m.route.gate.wait_idle, drain)
        if left and not cut:
            log.warning("profile %s not stopped (%s): %d requests still running after %.0fs",
                        m.name, why, left, drain)
            m.phase = Phase.RUNNING
            m.engine.sync_gate()
            self._announce()
            return None
        cut_n = 0
        if left:
            cut_n = m.view.cut_inflight(f"cut: profile {m.name} stopped ({why}) after "
                                        f"{drain:.0f}s of draining")
        await m.engine.stop_layout(why)
        m.phase = Phase.STOPPED
        m.loaded_at = None
        m.unloads += 1
        m.why = why
        self._stopped_gate(m)
        log.info("profile %s stopped (%s)", m.name, why)
        self.pool.room_changed.set()
        self._announce()
        return cut_n

    # -- the loop ---------------------------------------------------------------------------------

    async def start(self, initial: list[str]) -> None:
        self.loop = asyncio.get_running_loop()
        self._tick_task = asyncio.create_task(self._ticks())
        self._boot = asyncio.create_task(self._start_loads(initial))

    def initial_names(self) -> list[str]:
        """Loaded at start: the default profile, then every `on_demand: false` one."""
        rest = [n for n, m in self.members.items()
                if not m.profile.on_demand and n != self.default]
        return [self.default, *rest]

    async def _start_loads(self, names: list[str]) -> None:
        """The default profile, and every `on_demand: false` one, as far as they fit together
        (none is stopped for another at start)."""
        try:
            for name in names:
                m = self.members[name]
                if m.phase is not Phase.STOPPED:
                    continue
                fits = fleetplan.make_room(self.pool.capacity, self._occupants(m), m.needs,
                                           self.clock(), name)
                if fits.verdict is not fleetplan.Verdict.FITS and name != self.default:
                    m.why = f"did not fit at start ({fits.reason})"
                    log.info("profile %s not loaded at start: %s", name, fits.reason)
                    self._stopped_gate(m)
                    continue
                m.task = asyncio.current_task()
                await self._load(m, "at start")
        finally:
            self.started.set()
            self._announce()

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            now = self.clock()
            for m in self.members.values():
                if m.task is not None:
                    continue
                if m.phase is Phase.STOPPED and m.profile.on_demand and m.route.gate.held():
                    self._want(m.name)  # requests parked while it was being stopped
                elif m.phase is Phase.RUNNING and m.ttl is not None \
                        and not m.engine.lock.locked():
                    st = m.route.stats()
                    idle = now - m.route.last_used
                    if idle >= m.ttl and not st["inflight"] and not st["held"] \
                            and not st["waiting"]:
                        task = asyncio.create_task(
                            self._unload(m, f"idle {idle:.0f}s (ttl {m.ttl:g}s)"))
                        m.task = task
                        task.add_done_callback(functools.partial(_clear_task, m))
                elif self._went_fatal(m):
                    self._announce()

    def _engine_changed(self) -> None:
        for m in self.members.values():
            self._went_fatal(m)
        self._announce()

    def _went_fatal(self, m: Member) -> bool:
        """A running profile whose layout went FATAL is failed (its route already answers
        503 with the reason; the next request after the cooldown loads it again)."""
        sup = m.engine.sup
        if m.phase is not Phase.RUNNING or sup is None or not sup.fatal \
                or m.engine.lock.locked():  # a change that failed fast: its rollback runs
            return False
        m.failed_at = self.clock()
        m.error = sup.fatal
        m.phase = Phase.FAILED
        self.unkillable.extend(u for u in sup.unkillable if u not in self.unkillable)
        log.error("profile %s failed: %s", m.name, sup.fatal)
        self.pool.room_changed.set()
        return True

    def _announce(self) -> None:
        for fn in self.listeners:
            fn()

    # -- explicit control -------------------------------------------------------------------------

    async def activate(self, name: str) -> dict[str, Any]:
        """`hydra switch NAME`: stop the profiles that share its devices (drained, then cut),
        load it; if it fails, bring the stopped ones back."""
        m = self.members.get(name)
        if m is None:
            raise HydraError(f"profile {name} is not served on port {self.port}; it serves "
                             f"{', '.join(self.members)}")
        if m.phase is Phase.RUNNING:
            return {"to": name, "from": None, "result": "noop",
                    "reason": f"{name} is already serving"}
        if m.task is not None or any(o.phase is Phase.UNLOADING
                                     for o in self.pool.members.values()):
            raise EngineBusy(f"profile {name} is loading or another profile is stopping on "
                             f"port {self.port}; try again when it is done")
        t0 = self.clock()
        report: dict[str, Any] = {"to": name, "result": "ok", "phases": {}, "notes": [],
                                  "error": None, "failed_phase": None, "log_tail": [],
                                  "cut": 0}
        sharing = [o for o in self.pool.members.values() if o is not m
                   and o.phase is Phase.RUNNING and set(o.needs) & set(m.needs)]
        report["from"] = ", ".join(o.name for o in sharing) or None
        stopped = []
        for o in sharing:
            cut = await self.pool.owners[o.name]._unload(o, f"hydra switch {name}", cut=True)
            if cut is not None:
                stopped.append(o)
                report["cut"] += cut
        report["phases"]["stop"] = self.clock() - t0
        t1 = self.clock()
        m.task = asyncio.current_task()
        ok = await self._load(m, "hydra switch", force=True)
        report["phases"]["start"] = self.clock() - t1
        if not ok:
            report["result"] = "rolled_back" if stopped else "failed"
            report["failed_phase"] = "start"
            report["error"] = m.error
            report["log_tail"] = next(
                (p.log_tail() for p in (m.engine.sup.procs if m.engine.sup else [])
                 if p.log_tail()), [])
            for o in stopped:
                o.task = asyncio.current_task()
                if not await self.pool.owners[o.name]._load(o, f"rollback of the switch to {name}"):
                    report["result"] = "failed"
        report["total_s"] = round(self.clock() - t0, 3)
        report["phases"] = {k: round(v, 3) for k, v in report["phases"].items()}
        return report

    def differs(self, m: Member, prof: Profile, dep: Deployment) -> bool:
        """Whether a re-read profile changes anything of `m` (its plan, policies or knobs)."""
        new = self._own(dep)
        d = plandiff.diff(m.dep.plan, new.plan)
        same_addr = replace(prof, host=m.profile.host, port=m.profile.port)
        return (d.change is not plandiff.Change.NONE or same_addr != m.profile
                or new.policy != m.dep.policy or new.timeouts != m.dep.timeouts)

    async def replace(self, m: Member, new: tuple[Profile, Deployment]) -> str:
        """A reload: a running profile restarts what changed (plandiff: the head alone, or
        everything); a stopped one uses the new plan at its next load. Says what it did."""
        prof, dep = new[0], self._own(new[1])
        me = asyncio.current_task()
        while m.task is not None and m.task is not me:  # a load or an unload: let it finish
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(m.task)
        m.task = me  # no ttl unload, eviction or load of it meanwhile
        try:
            return await self._replace(m, prof, dep)
        finally:
            m.task = None

    async def _replace(self, m: Member, prof: Profile, dep: Deployment) -> str:
        lookup = self._names([prof if o is m else o.profile for o in self.members.values()])
        did = "not loaded: the new settings apply at its next load"
        if m.phase is Phase.RUNNING:
            rep = await m.engine.apply(dep)
            if rep.result not in ("ok", "noop"):
                raise HydraError(f"reload of {m.name}: {rep.result}: {rep.error}")
            did = (f"restarted {', '.join(rep.restarted)} in {rep.total_s:.2f}s"
                   if rep.result == "ok" else "routing settings only, nothing restarted")
        m.dep, m.profile = dep, prof
        m.fails = 0  # new settings: a failed profile may make room for itself again
        self.lookup = lookup
        m.needs = _needs(dep)
        m.route.limiter = (Limiter(m.name, prof.concurrency, prof.queue)
                           if prof.concurrency else None)
        if m.phase is Phase.STOPPED:
            self._stopped_gate(m)
        self._announce()
        return did

    async def apply_to(self, name: str, dep: Deployment) -> SwitchReport:
        """A new Deployment for a running profile from outside the fleet (the wire protocol's
        CONFIGURE and SET_EXPERT_MODE): run through its engine (plandiff), then recorded."""
        m = self.members[name]
        dep = self._own(dep)
        if m.phase is not Phase.RUNNING:
            raise HydraError(f"profile {name} is {m.phase.value}: nothing to reconfigure")
        rep = await m.engine.apply(dep)
        if rep.result in ("ok", "noop"):
            m.dep, m.needs = dep, _needs(dep)
        return rep

    async def shutdown(self, reason: str) -> None:
        for t in (self._tick_task, self._boot):
            if t is not None:
                t.cancel()
        tasks = [m.task for m in self.members.values() if m.task is not None
                 and m.task is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*(t for t in (self._tick_task, self._boot, *tasks)
                               if t is not None), return_exceptions=True)
        await asyncio.gather(*(m.engine.shutdown(reason) for m in self.members.values()),
                             return_exceptions=True)
        for m in self.members.values():
            self.unkillable.extend(u for u in m.engine.unkillable if u not in self.unkillable)

    def ready(self) -> bool:
        return self.started.is_set()

    # -- status -----------------------------------------------------------------------------------

    def state_of(self, m: Member) -> str:
        if self.down():
            return "port down"  # no request reaches any profile here (fleet.phase: its phase)
        if m.phase is Phase.RUNNING:
            word = m.engine.state_word()
            return "running" if word == "serving" else word
        return m.phase.value

    def models_json(self) -> dict[str, Any]:
        data = []
        for m in self.members.values():
            data.append({
                "id": m.name, "object": "model", "created": self._created, "owned_by": "hydra",
                "state": self.state_of(m), "status": {"value": _STATUS[m.phase]},
                "aliases": list(m.profile.aliases),
                "default": m.name == self.default, "devices": list(m.devices),
                "mode": m.dep.plan.mode, "model": m.dep.model_label,
                "on_demand": m.profile.on_demand, "error": m.error})
        return {"object": "list", "data": data}

    def member_snapshot(self, m: Member, gpu: dict[int, int] | None = None) -> dict[str, Any]:
        snap = m.engine.snapshot(gpu)
        now = self.clock()
        st = m.route.stats()
        snap.update({
            "name": f"port-{self.port}/{m.name}", "profile": m.name,
            "source": m.dep.plan.source, "mode": m.dep.plan.mode, "model": m.dep.model_label,
            "url": self.url, "state": self.state_of(m), "down": self.down(),
            "fleet": {
                "port": self.port, "phase": m.phase.value, "default": m.name == self.default,
                "aliases": list(m.profile.aliases), "on_demand": m.profile.on_demand,
                "ttl": m.ttl, "min_resident": m.profile.min_resident,
                "concurrency": m.profile.concurrency, "queue": m.profile.queue,
                "devices": list(m.devices),
                "needs_mib": {k: round(v / fleetplan.MIB) for k, v in m.needs.items()},
                "loads": m.loads, "unloads": m.unloads, "error": m.error, "why": m.why,
                "resident_s": round(now - m.loaded_at, 1) if m.loaded_at is not None else None,
                "idle_s": st["idle_s"], "requests": st["requests"], "held": st["held"],
                "held_reason": st["held_reason"],
                "inflight": st["inflight"], "running": st["running"],
                "waiting": st["waiting"]},
        })
        return snap

    def snapshot(self) -> list[dict[str, Any]]:
        """A row per profile; the port's router counters ride on the first row only (they are
        the port's, not a profile's: metrics must not count them once per profile)."""
        # one NVML session for every profile's processes (none when nothing runs)
        running = any(m.engine.sup is not None for m in self.members.values())
        gpu = gpumem.used_by_pid() if running else {}
        rows = [self.member_snapshot(m, gpu) for m in self.members.values()]
        for row in rows[1:]:
            row["router"] = None
        if rows and isinstance(rows[0].get("router"), dict) and self.watch is not None:
            rows[0]["router"].update(self.watch.counts())
        return rows
