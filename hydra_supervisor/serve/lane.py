"""One profile on a port: its route, its Deployment and the last good one, its Supervisor.

A Lane is the whole of one profile's serving state, and the only writer of its route's gate
(hold, release, unavailable) and upstream. Its operations, each answered with a SwitchReport
(reports.py) or a plain result:

  load(why)        make room on the node, start, wait until it serves (at start, on demand,
                   `hydra switch` through Node.activate)
  unload(why)      hold, drain (bounded), stop; with `cut`, what is still in flight is cut
  switch(dep)      re-point the lane to another layout: hold, drain, stop, wait for the GPU
                   memory, start the new layout, gate, release; a failure rolls back
  apply(dep)       a changed plan: nothing, the head alone, or everything (plandiff)
  restart(name)    a planned restart of one process (a peer restarts its pair): hold, drain
                   (bounded), restart, gate, release

keep_slots (keepslots.py) saves the head's slots before a change stops it. While its head is
not READY the lane holds its requests; it releases them when the head is READY again.
Everything here runs on the event-loop thread. The policy that differs between ports is a
value: `exit_on_fatal` (a hydra that serves one profile ends when its layout goes FATAL).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import psutil

from hydra_supervisor.config.profile import Profile
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import fleetplan, plandiff
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.plan import EngineSpec, Plan, Role
from hydra_supervisor.plan.ports import client_host
from hydra_supervisor.proc import gpumem, llamaerr
from hydra_supervisor.proc.managed import Fatal, ManagedProcess, State
from hydra_supervisor.proc.seams import Moved
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.proc.supervisor import Supervisor
from hydra_supervisor.router.routes import Addr, Limiter, Route
from hydra_supervisor.router.traffic import LaneTraffic
from hydra_supervisor.serve import keepslots, llamameta, progress, states
from hydra_supervisor.serve.clock import MONOTONIC, Clock, wall
from hydra_supervisor.serve.events import SAID, Event, Kind
from hydra_supervisor.serve.reports import (
    Busy,
    LayoutFailed,
    Phases,
    RestartFailed,
    Result,
    Stopped,
    SwitchReport,
    SwitchTimeouts,
)
from hydra_supervisor.serve.runner import Runner
from hydra_supervisor.serve.snapshot import (
    LaneStatus,
    ProcessStatus,
    SwitchStatus,
    frozen_map,
)
from hydra_supervisor.serve.states import LaneState

log = logging.getLogger("hydra")

FAIL_COOLDOWN = 10.0  # a lane whose load failed answers 503 this long before a retry
FAIL_COOLDOWN_MAX = 300.0  # ... doubled after each failure in a row, up to this


class Room(Protocol):
    """What a lane needs of the node (serve/node.py): room on its devices before it loads."""

    room_changed: asyncio.Event

    async def room_for(self, lane: Lane, force: bool = False) -> list[Stopped]: ...


class PortSide(Protocol):
    """What a lane needs of its port."""

    port: int
    host: str

    @property
    def url(self) -> str: ...

    def lane_changed(self, lane: Lane) -> None: ...

    def emit(self, event: Event) -> None: ...

    def set_rpc(self, addr: Addr | None) -> None: ...

    def traffic_of(self, profile: str) -> LaneTraffic:
        """What its router counted of `profile`'s requests (router/traffic.py)."""
        ...


def namespaced(dep: Deployment) -> Deployment:
    """Process names prefixed with the profile (`demo.head`), so the profiles of one hydra
    keep apart in the state dir's pids/ and logs/ and in `hydra restart` / `hydra logs`."""
    name = dep.profile

    def ren(e: EngineSpec) -> EngineSpec:
        return e if e.name.startswith(f"{name}.") else replace(e, name=f"{name}.{e.name}")

    plan = replace(dep.plan, engines=tuple(ren(e) for e in dep.plan.engines))
    return replace(dep, plan=plan,
                   solo_head=ren(dep.solo_head) if dep.solo_head is not None else None)


def needs_of(dep: Deployment) -> dict[str, int]:
    """Bytes per physical device the plan needs."""
    lay = dep.layout
    return fleetplan.needs_of([(p.device, p.need_bytes) for p in dep.plan.placements],
                              lay.devices if lay is not None else {})


class Lane:
    def __init__(self, port: PortSide, dep: Deployment, route: Route, *, state: StateDir,
                 profile: Profile | None = None, node: Room | None = None,
                 switch_timeouts: SwitchTimeouts | None = None,
                 make_supervisor: Callable[[Deployment, StateDir], Runner] = Supervisor,
                 clock: Clock = MONOTONIC, exit_on_fatal: bool = False,
                 load_wait: float = 120.0, standby: bool = False, seq_from: int = 0) -> None:
        """`load_wait`: a request that loads the lane waits for a whole load plus this long
        for room. `exit_on_fatal`: the policy of a hydra serving one profile (its FATAL ends
        hydra; its first load rides out the supervisor's restarts). `standby`: the port's
        standby layout (serve/standby.py). `seq_from`: its reports are numbered after this
        (the port's own, of a lane dropped before it)."""
        self.port = port
        self.route = route
        self.state = state
        self.node = node
        self.switch_timeouts = switch_timeouts or SwitchTimeouts()
        self.make_supervisor = make_supervisor  # seam: policy tests run fake supervisors
        self.clock = clock
        self.exit_on_fatal = exit_on_fatal
        self.standby = standby  # the port's standby layout (serve/standby.py)
        self.dep = self.own(dep)
        self.profile = profile if profile is not None else _profile_of(dep)
        self.needs = needs_of(self.dep)
        self.last_good: Deployment | None = None
        self.sup: Runner | None = None
        self.task: asyncio.Task[None] | None = None  # the running supervisor
        self.job: asyncio.Task[Any] | None = None  # a load or unload in progress
        self.lock = asyncio.Lock()  # one change at a time
        self.phase = LaneState.STOPPED
        self.switching: str | None = None
        self.switches: collections.deque[SwitchReport] = collections.deque(maxlen=20)
        self.switch_count = seq_from
        self.unkillable: list[str] = []
        # A request that loads its lane waits for the whole load (a big model on a slow
        # disk takes minutes), not just the router's usual hold; a failed load answers it
        # at once anyway.
        route.gate.hold_timeout = max(route.gate.hold_timeout, self.dep.timeouts.load
                                      + self.dep.timeouts.peer + load_wait)
        self.loaded_at: float | None = None
        self.error: str | None = None
        self.failed_at = float("-inf")
        self.fails = 0  # loads that failed in a row
        self.loads = 0
        self.unloads = 0
        self.drains_given_up = 0  # unloads abandoned: requests still in flight after the drain
        self.made_room: list[Stopped] = []  # what its last load stopped to make room, and why
        self.why = "not loaded yet"
        self.meta: dict[str, object] | None = None  # llama-server's own /v1/models meta
        self.meta_task: asyncio.Task[None] | None = None
        # its processes' last states, and those down since when (and whether one died): what
        # their lifecycle events say (`_tell`)
        self._seen: dict[str, State] = {}
        self._down: dict[str, tuple[float, bool]] = {}

    # -- who it is ------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.dep.profile

    def profile_or_name(self) -> tuple[str, tuple[str, ...]]:
        """(name, aliases): what the port's model lookup knows this lane by."""
        return self.name, self.aliases

    @property
    def running(self) -> bool:
        """A layout of it runs (its Supervisor exists: loading, serving or recovering)."""
        return self.sup is not None

    @property
    def running_plan(self) -> Plan | None:
        """The plan of the layout that runs now (None: nothing runs)."""
        return self.dep.plan if self.sup is not None else None

    @property
    def busy(self) -> bool:
        """A change (switch, reload, restart, load, unload) holds it now."""
        return self.lock.locked()

    def process_names(self) -> list[str]:
        """The names of its running processes (none when nothing runs)."""
        return [p.name for p in self.sup.procs] if self.sup is not None else []

    def take_settings(self, dep: Deployment, profile: Profile) -> None:
        """A reload's new settings (the caller applied them to a running layout, or they
        wait for the next load): its plan, profile, needs and request limits."""
        self.dep, self.profile = dep, profile
        self.fails = 0  # new settings: a failed lane may make room for itself again
        self.needs = needs_of(dep)
        self.route.limiter = (Limiter(self.name, profile.concurrency, profile.queue)
                              if profile.concurrency else None)

    @property
    def aliases(self) -> tuple[str, ...]:
        return tuple(getattr(self.profile, "aliases", ()) or ())

    @property
    def on_demand(self) -> bool:
        return bool(getattr(self.profile, "on_demand", True))

    @property
    def ttl(self) -> float | None:
        return getattr(self.profile, "ttl", None) or None

    @property
    def min_resident(self) -> float:
        return float(getattr(self.profile, "min_resident", 30.0))

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.device for e in self.dep.plan.engines))

    @property
    def cooldown(self) -> float:
        """How long a failed lane answers 503 before a request loads it again: doubled after
        each failure in a row, so a broken profile costs less and less."""
        return float(min(FAIL_COOLDOWN * 2.0 ** max(0, self.fails - 1), FAIL_COOLDOWN_MAX))

    def own(self, dep: Deployment) -> Deployment:
        """A Deployment as this lane runs it: its processes named after the profile
        (`demo.head`). The address it serves on is the port's, in no plan."""
        return namespaced(dep)

    def answers_to(self, ref: str) -> bool:
        """Whether a switch's `ref` (a profile name or its file) names this lane."""
        source = self.dep.plan.source
        return ref in (self.name, source) or (
            ref.endswith((".yaml", ".yml")) and Path(ref).resolve() == Path(source).resolve())

    def take_over(self, active: Lane) -> None:
        """A flip: this standby lane becomes the port's active one in `active`'s place; the
        port's switch history and the exit policy move with it, `active` stands by."""
        self.route.touch()
        self.switches, active.switches = active.switches, collections.deque(
            maxlen=active.switches.maxlen)
        self.switch_count = max(active.switch_count, self.switch_count)
        self.standby, active.standby = False, True
        self.exit_on_fatal, active.exit_on_fatal = active.exit_on_fatal, False

    async def _fetch_meta(self) -> None:
        """llama-server's own /v1/models `meta` of the loaded layout (vocabulary, context,
        parameters): /v1/models carries it. Best effort; nothing waits for it."""
        try:
            addr = self.head_addr()
            meta = await asyncio.to_thread(llamameta.fetch, addr) if addr is not None else None
        except Exception as exc:  # best effort: /v1/models goes without it
            log.debug("profile %s: no meta from llama-server's /v1/models: %s", self.name, exc)
            return
        if meta is not None and self.head_addr() == addr:
            self.meta = meta
            self._changed()

    def _to(self, phase: LaneState) -> None:
        states.check(self.phase, phase)
        self.phase = phase

    # -- the gate ---------------------------------------------------------------------------------

    def _set_upstream(self, dep: Deployment) -> None:
        spec = dep.plan.router
        self.route.http = spec.http if spec is not None else None
        if spec is not None and spec.rpc is not None:
            self.port.set_rpc(spec.rpc)  # a peer-only lane (mode: peer) lends ggml-RPC

    def _on_transition(self, mp: ManagedProcess) -> None:
        sup = self.sup
        if sup is None or mp not in sup.procs:
            return
        self.sync_gate()
        self._tell(mp, sup)

    def _emit(self, kind: Kind, subject: str, detail: str = "", *,
              seconds: float | None = None, frm: str | None = None) -> None:
        self.port.emit(Event(kind, subject, detail, seconds=seconds, frm=frm))

    def _tell(self, mp: ManagedProcess, sup: Runner) -> None:
        """A process's lifecycle event (serve/events.py) from its transition: it died or was
        stopped, went unhealthy, came back. Only while the lane serves and no change of it
        runs (a load, switch, restart or stop says what it did itself)."""
        name, st = mp.name, mp.state
        prev, self._seen[name] = self._seen.get(name), st
        if self.phase is not LaneState.SERVING or self.lock.locked() or sup.stopping.is_set():
            self._down.pop(name, None)
            return
        down = self._down.get(name)
        if st in (State.BACKOFF, State.FATAL) and (down is None or prev is State.STARTING):
            # a loss, or a restart of it that failed again (each attempt says why)
            self._down[name] = (down[0] if down else self.clock(), True)
            self._emit(Kind.DIED, name, mp.reason)
        elif st is State.STOPPING and down is None:
            self._down[name] = (self.clock(), True)
            self._emit(Kind.STOPPED, name, mp.reason)
        elif st is State.UNHEALTHY and down is None:
            self._down[name] = (self.clock(), False)
            self._emit(Kind.UNHEALTHY, name, mp.reason)
        elif st is State.READY and down is not None:
            del self._down[name]
            # a remote peer says where it answered (its device's spare: plan/spares.py)
            self._emit(Kind.RESTARTED if down[1] else Kind.HEALTHY, name,
                       mp.reason if not mp.spec.managed else "",
                       seconds=self.clock() - down[0])

    def _on_upstream_moved(self, kind: Moved, old: Addr, new_port: int) -> None:
        """The supervisor moved a process whose port another process took."""
        if kind is Moved.HTTP and self.route.http == old:
            self.route.http = (old[0], new_port)
        elif kind is Moved.RPC:
            spec = self.dep.plan.router
            if spec is not None and spec.rpc == old:  # the lent device only (mode: peer);
                self.port.set_rpc((old[0], new_port))  # a COMBINE's own peers stay private

    async def _before_head_swap(self, to: str) -> None:
        """The supervisor returns a degraded head to COMBINE: a planned swap, so hold new
        requests and let the SOLO head finish what it serves (bounded) before it stops."""
        self.route.hold(f"returning to {to.upper()} now that the peer is back")
        left = await asyncio.to_thread(self.route.wait_idle, self.switch_timeouts.drain)
        if left:
            n = self.route.cut_inflight(f"cut by the return to {to} after "
                                        f"{self.switch_timeouts.drain:.0f}s of draining",
                                        requeue=True)
            log.warning("return to %s: %d in-flight requests cut after the drain", to, n)

    def _changed(self) -> None:
        self.port.lane_changed(self)

    def sync_gate(self) -> None:
        """Hold new requests while the running head is not READY; release when it is."""
        r, sup = self.route, self.sup
        if sup is None or self.switching:
            return  # a change holds and releases itself
        if sup.fatal:
            r.set_unavailable(f"profile {sup.plan.profile} failed: {sup.fatal}", retry_after=30)
            r.release()
            return
        head = sup.head
        if head is None:  # a peer-only lane (mode: peer): ggml-RPC only, never HTTP
            r.set_unavailable(f"port {self.port.port} lends {sup.plan.engines[0].device} over "
                              "ggml-RPC (mode: peer); it serves no HTTP", retry_after=3600)
            r.release()
            return
        if head.state is State.READY:
            r.set_unavailable(None)
            r.release()
            if self.meta is None and (self.meta_task is None or self.meta_task.done()):
                self.meta_task = asyncio.create_task(self._fetch_meta())
        else:
            r.hold(self._hold_reason(head))

    @staticmethod
    def _hold_reason(head: ManagedProcess) -> str:
        if head.state is State.STARTING:
            return f"loading model ({head.reason})" if head.reason else "loading model"
        state = head.state.value.lower()
        return f"head {state}: {head.reason}" if head.reason else f"head {state}"

    def hold(self, reason: str, *, clear_refusal: bool = False) -> None:
        """New requests wait (a load is coming: on request, or once there is room beside the
        others); `clear_refusal`: a failure's 503 is lifted first, so they wait for the load
        instead. The Port and the Node ask; only the lane writes its route."""
        if clear_refusal:
            self.route.set_unavailable(None)
        self.route.hold(reason)

    def stopped_gate(self) -> None:
        """What a request for a lane that is not loaded meets."""
        if self.on_demand:
            self.hold(f"profile {self.name} is not loaded; loading it on request",
                      clear_refusal=True)
        else:
            self.route.set_unavailable(
                f"profile {self.name} is not loaded ({self.why}) and loads only with "
                f"`hydra switch {self.name}` (on_demand: false)", retry_after=30)

    # -- running one deployment ----------------------------------------------------------------

    def _launch(self, dep: Deployment, fail_fast: bool = False) -> Runner:
        """Run `dep`. `fail_fast` (a change): its first failed start ends the run at once
        (no backoff) so the caller can roll back."""
        sup = self.make_supervisor(dep, self.state)
        sup.fail_fast = fail_fast
        sup.traffic = self.route
        sup.on_upstream_moved = self._on_upstream_moved
        sup.on_replanned = self._adopt  # a lost peer moved onto a spare: the plan it runs
        sup.listeners.append(self._on_transition)
        sup.on_publish = self._changed
        sup.before_head_swap = self._before_head_swap
        self.sup = sup
        self._seen, self._down = {}, {}
        self.dep = dep
        self._set_upstream(dep)
        self.task = asyncio.create_task(self._run(sup))
        return sup

    async def _run(self, sup: Runner) -> None:
        try:
            await sup.run()
        finally:
            self.unkillable.extend(u for u in sup.unkillable if u not in self.unkillable)
        if sup is self.sup:
            self.sync_gate()
            self._changed()

    async def _ready(self, sup: Runner, timeout: float, patient: bool = False) -> None:
        """Wait until every process of `sup` is READY; a failure before that raises at once
        (a change does not sit through a crash loop: it rolls back). `patient` (the first
        load under `exit_on_fatal`): the supervisor's restarts run their course; only FATAL
        fails, and no deadline but its own."""
        deadline = self.clock() + timeout
        failing = (State.FATAL,) if patient else (State.BACKOFF, State.FATAL)
        while True:
            if sup.first_ready.is_set() and all(p.state is State.READY for p in sup.procs):
                return
            bad = next((p for p in sup.procs if p.state in failing), None)
            if bad is not None or sup.fatal or (self.task is not None and self.task.done()):
                who = bad or next((p for p in sup.procs if p.state is not State.READY),
                                  sup.procs[-1])
                msg = sup.fatal or f"{who.name}: {who.reason or 'stopped'}"
                line = llamaerr.from_log(getattr(who, "log_path", None))
                raise LayoutFailed(llamaerr.with_line(msg, line), who.log_tail())
            if not patient and self.clock() >= deadline:
                who = next((p for p in sup.procs if p.state is not State.READY), sup.procs[-1])
                raise LayoutFailed(f"{who.name} not ready within {timeout:.0f}s "
                                   f"({who.state.value}: {who.reason})", who.log_tail())
            await asyncio.sleep(0.05)

    async def _stop_current(self, reason: str) -> list[int]:
        """Stop the running layout; returns the pids it had (to wait for their GPU memory)."""
        sup, task = self.sup, self.task
        if sup is None:
            return []
        pids = [p.pid for p in sup.procs if p.pid is not None]
        self.meta = None  # the next layout's llama-server says its own
        sup.request_stop(reason)
        if task is not None:
            await task
        self.sup = None
        self.task = None
        log.info("stopped %s (%s)", sup.plan.profile, reason)
        return pids

    async def stop_layout(self, reason: str) -> list[int]:
        """Stop the running layout (the caller drained it) and wait until its GPU memory is
        released. Returns pids whose memory was not released."""
        pids = await self._stop_current(reason)
        return await gpumem.wait_released(pids, self.switch_timeouts.gpu_free)

    # -- loading and unloading (several profiles on a node) and changes ----------------------


    def _check_free(self) -> None:
        if self.lock.locked():
            raise Busy(f"a switch is already running on port {self.port.port} "
                       f"(to {self.switching}); try again when it is done")
        if self.phase in (LaneState.LOADING, LaneState.UNLOADING):
            raise Busy(f"profile {self.name} is {self.phase.value}; try again when it is "
                       "done")


    async def switch(self, dep: Deployment) -> SwitchReport:
        """Replace the running layout with `dep` (a port with one self: any profile)."""
        self._check_free()
        async with self.lock:
            return await self._switch(self.own(dep))


    async def _switch(self, dep: Deployment) -> SwitchReport:
        old = self.dep if self.sup is not None else None
        report = SwitchReport(to=dep.profile, frm=old.profile if old else None)
        phase = Phases(report)
        self.switching = dep.profile
        self._to(LaneState.SWITCHING)
        r = self.route
        started_new = False
        try:
            with phase("hold"):
                r.hold(f"switching to profile {dep.profile}")
            with phase("drain"):
                await self._drain(report, f"the switch to {dep.profile}")
            saved: dict[int, str] = {}
            if old is not None and old.keep_slots:
                with phase("save_slots"):
                    saved = await keepslots.save(self.head_addr, old)
            with phase("stop"):
                pids = await self._stop_current(f"switch to {dep.profile}")
            with phase("gpu_free"):
                left_pids = await gpumem.wait_released(pids, self.switch_timeouts.gpu_free)
                if left_pids:
                    report.notes.append(f"GPU memory of pids {left_pids} not released within "
                                        f"{self.switch_timeouts.gpu_free:.0f}s")
            report.restarted = [e.name for e in dep.plan.in_start_order()]
            with phase("start"):
                self._adopt(dep)
                sup = self._launch(dep, fail_fast=True)
                started_new = True
                await self._ready(sup, dep.timeouts.load + dep.timeouts.peer
                                  + self.switch_timeouts.gate_extra)
            if saved:
                with phase("restore_slots"):
                    await keepslots.restore(self.head_addr, self.state, old, dep, saved, report)
            with phase("release"):
                self.last_good = dep
                self.switching = None
                self._to(LaneState.SERVING)
                self.loaded_at = self.clock()
                self.sync_gate()
            report.result = Result.OK
        except (LayoutFailed, HydraError, OSError) as exc:
            report.failed_phase = phase.current
            report.error = str(exc)
            report.log_tail = getattr(exc, "tail", [])
            log.error("switch to %s failed in phase %s: %s", dep.profile, phase.current, exc,
                      extra=SAID)
            await self._rollback(old, report, phase, started_new)
        except asyncio.CancelledError:
            # hydra is stopping mid-switch: whatever runs is stopped by the caller's shutdown.
            report.result = Result.FAILED
            report.error = "hydra stopped during the switch"
            raise
        finally:
            self._finish(report, phase)
        return report


    async def apply(self, dep: Deployment) -> SwitchReport:
        """Run `dep` in place of the running layout, restarting only what changes (plandiff):
        nothing (a no-op), the head alone (its peers keep running), or everything (a switch).
        A different external address is refused."""
        self._check_free()
        dep = self.own(dep)
        cur, sup = self.dep, self.sup
        if sup is None:
            return await self.switch(dep)
        d = plandiff.diff(cur.plan, dep.plan)
        if d.change is plandiff.Change.REFUSED:
            raise HydraError(d.reason)
        if d.change is plandiff.Change.NONE and cur.policy == dep.policy \
                and cur.timeouts == dep.timeouts:
            rep = SwitchReport(to=dep.profile, frm=cur.profile, result=Result.NOOP)
            rep.notes.append("nothing changes")
            return rep
        if d.change is not plandiff.Change.HEAD:
            rep = await self.switch(dep)
            rep.restarted = list(d.restart)
            return rep
        async with self.lock:
            return await self._restart_head(cur, dep, sup, d.restart)


    async def _restart_head(self, old: Deployment, dep: Deployment, sup: Runner,
                            names: tuple[str, ...]) -> SwitchReport:
        report = SwitchReport(to=dep.profile, frm=old.profile, restarted=list(names))
        phase = Phases(report)
        self.switching = dep.profile
        self._to(LaneState.SWITCHING)
        r = self.route
        try:
            with phase("hold"):
                r.hold(f"restarting the head of {dep.profile} with new settings")
            with phase("drain"):
                await self._drain(report, f"the switch to {dep.profile}")
            saved = await keepslots.save(self.head_addr, old)
            with phase("restart_head"):
                sup.adopt_head(dep)
                self._adopt(dep)
                # fail fast: the first failed start of the new head ends the change (no
                # backoff), and the supervisor waits for the rollback below
                await sup.restart(names[0], fail_fast=True)
                await self._ready(sup, dep.timeouts.load)
            await keepslots.restore(self.head_addr, self.state, old, dep, saved, report)
            self.last_good = dep
            report.result = Result.OK
        except (LayoutFailed, HydraError, OSError, Fatal) as exc:
            report.failed_phase = phase.current
            report.error = str(exc)
            report.log_tail = getattr(exc, "tail", []) or _tail_of(sup, names[0])
            log.error("restart of %s with new settings failed in phase %s: %s",
                      dep.profile, phase.current, exc, extra=SAID)
            try:
                with phase("rollback"):
                    sup.adopt_head(old)
                    self._adopt(old)
                    await sup.restart(names[0], fail_fast=True)
                    await self._ready(sup, old.timeouts.load)
                    report.result = Result.ROLLED_BACK
            except (LayoutFailed, HydraError, OSError, Fatal) as exc2:
                # the old head did not come back in place: the last good layout afresh
                log.error("the old head of %s did not come back in place (%s); starting "
                          "the last good layout again", old.profile, exc2)
                await self._rollback(old, report, phase, started_new=True)
        finally:
            if self.phase is LaneState.SWITCHING:
                self._to(LaneState.SERVING)
            self._finish(report, phase)
            self.sync_gate()
        return report




    async def _drain(self, report: SwitchReport, by: str, to: str = "the new layout") -> None:
        """Wait (bounded: switch_timeouts.drain) until nothing is in flight; the route holds
        new requests meanwhile. `by`: the change that cuts what is left (`the switch to X`);
        `to`: where those without a response byte are sent again."""
        r = self.route
        left = await asyncio.to_thread(r.wait_idle, self.switch_timeouts.drain)
        if left:
            # Those without a response byte are sent again to the new layout once it serves
            # (held meanwhile, as after a crash); only partial responses are cut.
            report.cut = r.cut_inflight(f"cut by {by} after "
                                        f"{self.switch_timeouts.drain:.0f}s of draining",
                                        requeue=True)
            resent = max(0, left - report.cut)
            report.notes.append(f"{left} requests still in flight after the "
                                f"{self.switch_timeouts.drain:.0f}s drain: {report.cut} cut "
                                f"(partly answered), {resent} without a response byte sent "
                                f"again to {to}")


    async def _rollback(self, old: Deployment | None, report: SwitchReport, phase: Phases,
                        started_new: bool) -> None:
        with phase("rollback"):
            if started_new:
                await self._stop_current(f"switch to {report.to} failed")
            back = self.last_good or old
            if back is None:
                report.result = Result.FAILED
                self.switching = None
                self.error = report.error
                self.failed_at = self.clock()
                self._to(LaneState.FAILED)
                self.route.set_unavailable(f"profile {report.to} failed: {report.error}",
                                           retry_after=30)
                self.route.release()
                return
            try:
                self._adopt(back)
                sup = self._launch(back)
                await self._ready(sup, back.timeouts.load + back.timeouts.peer)
                report.result = Result.ROLLED_BACK
            except LayoutFailed as exc:
                report.result = Result.FAILED
                report.error = f"{report.error}; the rollback to {back.profile} failed too: {exc}"
            self.switching = None
            if self.phase is LaneState.SWITCHING:
                self._to(LaneState.SERVING)
            self.sync_gate()


    def _finish(self, report: SwitchReport, phase: Phases) -> None:
        """A change is over (whatever its result): record and announce it."""
        self.switching = None
        if self.phase is LaneState.SWITCHING:
            self._to(LaneState.SERVING if self.sup is not None else LaneState.FAILED)
        phase.done()
        self.record(report)


    # -- restart one process -------------------------------------------------------------------

    async def restart(self, name: str) -> SwitchReport:
        """`hydra restart NAME`, planned as a switch is: hold new requests, let those in flight
        finish (bounded by switch_timeouts.drain; what is left then is cut, or sent again when
        it had no response byte), restart the process (a peer with its head), wait until it
        serves, release the held requests to it. The report says what restarted
        (`restarted`), the phases, how long until it served again (`total_s`), what the drain
        did and what keep_slots restored (`notes`); a restart that fails raises RestartFailed
        after the rollback (its message says what serves now)."""
        sup = self.sup
        if sup is None:
            raise HydraError(f"profile {self.name} is not running: nothing to restart")
        names = [p.name for p in sup.procs]
        if name not in names and f"{self.name}.{name}" in names:
            name = f"{self.name}.{name}"  # the role alone (`head`): this lane's
        if name not in names:
            raise HydraError(f"no engine '{name}' in profile {sup.plan.profile}; "
                             f"engines: {', '.join(names)}")
        if self.lock.locked() or self.phase in (LaneState.LOADING, LaneState.UNLOADING):
            raise Busy(f"a change is running on profile {self.name} ({self.phase.value}); "
                       "try again after it")
        async with self.lock:
            return await self._restart(name, sup)

    async def _restart(self, name: str, sup: Runner) -> SwitchReport:
        dep = self.dep
        # A peer restarts with its head (a ggml-rpc-server serves one head): both do.
        head = sup.head
        proc = next((p for p in sup.procs if p.name == name), None)
        with_head = head is not None and proc is not None and proc is not head \
            and proc.spec.role is Role.PEER
        rep = SwitchReport(to=sup.plan.profile, frm=sup.plan.profile,
                           restarted=[name, *([head.name] if with_head and head else [])])
        phase = Phases(rep, self.clock)
        self.switching = sup.plan.profile  # the gate is this change's until it ends
        self._to(LaneState.SWITCHING)
        self._changed()
        try:
            with phase("hold"):
                self.route.hold(f"restarting {name} (hydra restart)")
            with phase("drain"):
                await self._drain(rep, f"the restart of {name}", "the restarted head")
            saved = await keepslots.save(self.head_addr, dep)
            with phase("restart"):
                await sup.restart(name, fail_fast=True)
                await self._ready(sup, sup.timeouts.load + sup.timeouts.peer)
            rep.result = Result.OK
            # before the release: a held request finds its cached prompt
            await keepslots.restore(self.head_addr, self.state, dep, dep, saved, rep)
        except (LayoutFailed, Fatal) as exc:
            raise RestartFailed(await self._restart_failed(name, sup, dep, exc, rep, phase)
                                ) from exc
        finally:
            if self.phase is LaneState.SWITCHING and self.switching is not None:
                # done, or cancelled (hydra stops): the gate is the head's again
                self.switching = None
                self._to(LaneState.SERVING)
                self.sync_gate()  # releases the held requests to the READY head
                self._changed()
        phase.done()
        self._emit(Kind.RESTARTED, name, "hydra restart", seconds=rep.total_s)
        return rep

    async def _restart_failed(self, name: str, sup: Runner, dep: Deployment,
                              exc: Exception, rep: SwitchReport, phase: Phases) -> str:
        """`hydra restart NAME` failed its first start: no backoff; the last good layout is
        started again from scratch (the switch's rollback). Returns the error to reply."""
        rep.error = str(exc)
        rep.failed_phase = "restart"
        rep.log_tail = getattr(exc, "tail", []) or _tail_of(sup, name)
        log.error("restart of %s failed: %s", name, exc, extra=SAID)
        try:
            await self._rollback(dep, rep, phase, started_new=True)
        finally:
            self._finish(rep, phase)
        if rep.result == Result.ROLLED_BACK:
            return (f"restart of {name} failed: {exc}; the last good layout was started "
                    "again and serves")
        return f"restart of {name} failed: {rep.error}"



    async def load(self, why: str, force: bool = False) -> bool:
        """Make room, start the layout, wait until it serves. False: it failed (its held
        requests got the reason; the others keep serving). `force` (hydra switch): it may stop
        others even after a failed load."""
        try:
            self._to(LaneState.LOADING)
            self.error = None
            self.route.set_unavailable(None)
            self.route.hold(f"loading profile {self.name} ({why})")
            self._changed()
            t0 = self.clock()
            self.made_room = []
            try:
                if self.node is not None:
                    self.made_room = await self.node.room_for(self, force)
                self.loads += 1
                log.info("loading profile %s (%s)", self.name, why)
                self.route.set_unavailable(None)
                self.route.hold(f"loading model for profile {self.name}")
                sup = self._launch(self.dep)
                self.sync_gate()
                await self._ready(sup, self.dep.timeouts.load + self.dep.timeouts.peer,
                                  patient=self.exit_on_fatal and self.last_good is None)
            except (LayoutFailed, HydraError, OSError) as exc:
                await self._fail(str(exc), getattr(exc, "tail", []))
                return False
            self._to(LaneState.SERVING)
            self.fails = 0
            self.loaded_at = self.clock()
            self.last_good = self.dep
            self.route.touch()  # a fresh load counts as a use (LRU)
            log.info("profile %s serving after %.2fs (%s)", self.name, self.clock() - t0, why)
            if not self.standby:  # (the standby says when it is ready: warmed up too)
                self._emit(Kind.LOADED, self.name, why, seconds=self.clock() - t0)
            self.sync_gate()
            if self.node is not None:
                self.node.room_changed.set()  # a loader waiting on this one may decide now
            return True
        finally:
            self.job = None
            self._changed()


    async def _fail(self, error: str, tail: list[str]) -> None:
        # The supervisor's reason says what it would do next ("; restart 1 in 1.0s"); a self
        # does not retry on its own, so that part goes. llama.cpp's own error line says why.
        error = re.sub(r"; restart \d+ in [0-9.]+s$", "", error)
        why = llamaerr.error_line(tail) or next(
            (line.strip() for line in reversed(tail) if line.strip()), None)
        error = llamaerr.with_line(error, why)
        log.error("profile %s failed to load: %s", self.name, error,
                  extra=None if self.standby else SAID)
        if not self.standby:  # (the standby says it failed)
            self._emit(Kind.LOAD_FAILED, self.name, error)
        sup = self.sup
        if self.exit_on_fatal and sup is not None and sup.fatal:
            # hydra ends on this (exit 1): the failed run (its FATAL reason, its processes'
            # last states and log tails) stays as the record status.json keeps
            if self.task is not None:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await self.task
        else:
            with contextlib.suppress(LayoutFailed, HydraError, OSError):
                await self.stop_layout(f"load of {self.name} failed")
        self.failed_at = self.clock()  # before the phase: whoever reads FAILED reads its time
        self.error = error
        self._to(LaneState.FAILED)
        self.fails += 1
        self.route.set_unavailable(f"profile {self.name} failed to load: {error}",
                                   retry_after=int(self.cooldown))
        self.route.release()
        if self.node is not None:
            self.node.room_changed.set()


    def went_fatal(self) -> bool:
        """A serving self whose layout went FATAL is failed (its route already answers 503
        with the reason; on demand, the next request after the cooldown loads it again)."""
        sup = self.sup
        if self.phase is not LaneState.SERVING or sup is None or not sup.fatal \
                or self.lock.locked():  # a change that failed fast: its rollback runs
            return False
        self.failed_at = self.clock()
        self.error = sup.fatal
        self._to(LaneState.FAILED)
        self.unkillable.extend(u for u in sup.unkillable if u not in self.unkillable)
        log.error("profile %s failed: %s", self.name, sup.fatal, extra=SAID)
        self._emit(Kind.FATAL, self.name, sup.fatal)
        if self.node is not None:
            self.node.room_changed.set()
        return True


    async def unload(self, why: str, cut: bool = False) -> int | None:
        """Drain (bounded) and stop a serving self; how many requests were cut, or None when it
        was not stopped. Without `cut`, requests still in flight after the drain keep it
        serving (None); with it, they are cut."""
        if self.phase is not LaneState.SERVING or self.lock.locked():
            return None  # a reload or `hydra restart` is restarting its processes
        self._to(LaneState.UNLOADING)
        self._changed()
        self.route.hold(f"profile {self.name} is stopping ({why})")
        drain = self.switch_timeouts.drain
        left = await asyncio.to_thread(self.route.wait_idle, drain)
        if left and not cut:
            self.drains_given_up += 1
            log.warning("profile %s not stopped (%s): %d requests still running after %.0fs",
                        self.name, why, left, drain)
            self._to(LaneState.SERVING)
            self.sync_gate()
            self._changed()
            return None
        cut_n = 0
        if left:
            cut_n = self.route.cut_inflight(f"cut: profile {self.name} stopped ({why}) after "
                                            f"{drain:.0f}s of draining")
        await self.stop_layout(why)
        self._to(LaneState.STOPPED)
        self.loaded_at = None
        self.unloads += 1
        self.why = why
        self.stopped_gate()
        log.info("profile %s stopped (%s)", self.name, why)
        if not self.standby:
            self._emit(Kind.UNLOADED, self.name, why + (f"; {cut_n} requests cut" if cut_n
                                                        else ""))
        if self.node is not None:
            self.node.room_changed.set()
        self._changed()
        return cut_n

    def _adopt(self, dep: Deployment) -> None:
        """The lane now runs `dep` (a switch may change its profile: the port re-indexes)."""
        renamed = dep.profile != self.dep.profile
        self.meta = None  # (fetched again once its head is READY)
        self.dep = dep
        self.needs = needs_of(dep)
        self.profile = _profile_of(dep) or self.profile
        if renamed:
            self.route.name = dep.profile
            self._changed()


    def head_addr(self) -> tuple[str, int] | None:
        """Where the running head answers HTTP, once it is READY (None before)."""
        sup = self.sup
        if sup is None or sup.head is None or sup.head.state is not State.READY:
            return None
        spec = sup.head.spec
        return (client_host(spec.host), spec.port)

    def record(self, report: SwitchReport) -> None:
        """Keep a finished change's report (status, metrics count them by seq) and log it."""
        self.switch_count += 1
        report.seq = self.switch_count
        report.at = wall()
        self.switches.append(report)
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in report.phases.items())
        log.info("switch %s -> %s: %s in %.2fs (%s)%s", report.frm, report.to, report.result,
                 report.total_s, phases, f"; {report.error}" if report.error else "")
        ok = report.result in (Result.OK, Result.NOOP)
        did = ("instant, nothing restarted" if report.instant else
               f"restarted {', '.join(report.restarted)}" if report.restarted else "")
        how = str(report.result).replace("_", " ")  # "rolled back", "failed"
        cut = f"{report.cut} requests cut" if report.cut else ""
        self._emit(Kind.SWITCHED if ok else Kind.SWITCH_FAILED, report.to,
                   "; ".join(x for x in (did if ok else f"{how}: {report.error}", cut) if x),
                   seconds=report.total_s, frm=report.frm)
        self._changed()

    async def shutdown(self, reason: str) -> None:
        """Stop the running layout. The Supervisor stays as the record of the last run (its
        FATAL reason, the processes' last states) for the final status.json."""
        if self.sup is not None:
            self.sup.request_stop(reason)
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.phase is not LaneState.FAILED and not (self.sup is not None and self.sup.fatal):
            self.switching = None
            self._to(LaneState.STOPPED)  # hydra stopped: not "recovering" (status.json)
            self.why = reason

    # -- status ---------------------------------------------------------------------------------

    def state_now(self) -> LaneState:
        """The published state: the phase, refined by the processes while it runs."""
        sup = self.sup
        if self.switching:
            return LaneState.SWITCHING
        if self.phase is not LaneState.SERVING or sup is None:
            return self.phase
        if sup.fatal:
            return LaneState.FAILED
        if sup.degraded:
            return LaneState.DEGRADED
        if all(p.state is State.READY for p in sup.procs):
            return LaneState.SERVING  # a peer-only lane (mode: peer) has no head
        if not sup.first_ready.is_set():
            return LaneState.LOADING
        return LaneState.RECOVERING

    def process_status(self, gpu: Mapping[int, int]) -> tuple[ProcessStatus, ...]:
        """Its running processes, with memory: resident (host) and GPU (NVML) per process."""
        sup = self.sup
        if sup is None:
            return ()
        ends = {c.device: c.endpoints for c in self.dep.peer_choices}
        return tuple(_process_status(p, gpu, sup.plan, ends) for p in sup.procs)

    def status(self, gpu: Mapping[int, int], *, name: str, state: str, default: bool,
               standby: str | None = None) -> LaneStatus:
        """The lane in the published status (serve/snapshot.py); its port gives the label
        (`name`), the state word (`port down` while the port refuses connections), whether it
        is the default, and the standby profile kept beside it. Its traffic (requests,
        tokens, in flight) is what its port's router counted (router/traffic.py); `queued`
        is its gate's and its limiter's: held there and waiting for a slot."""
        st = self.route.stats()
        tr = self.port.traffic_of(self.name)
        dep, sup = self.dep, self.sup
        prof = self.profile
        return LaneStatus(
            name=name, profile=self.name, role="standby" if self.standby else "active",
            state=state, phase=self.phase.value, mode=str(dep.plan.mode),
            model=dep.model_label, source=dep.plan.source, default=default,
            aliases=self.aliases, devices=self.devices,
            needs_mib=frozen_map({k: round(v / fleetplan.MIB) for k, v in self.needs.items()}),
            on_demand=self.on_demand, ttl=self.ttl, min_resident=self.min_resident,
            concurrency=prof.concurrency if prof is not None else None,
            queue=prof.queue if prof is not None else None,
            switching=self.switching, fatal=sup.fatal if sup is not None else None,
            degraded=sup.degraded if sup is not None else None,
            error=self.error, why=self.why, loads=self.loads, unloads=self.unloads,
            resident_s=(round(self.clock() - self.loaded_at, 1)
                        if self.loaded_at is not None else None),
            idle_s=st["idle_s"], requests=tr.requests,
            requests_last_min=tr.requests_last_min, held=st["held"],
            held_reason=st["held_reason"], inflight=st["inflight"], running=st["running"],
            waiting=st["waiting"], queued=st["held"] + (st["waiting"] or 0),
            tokens_per_s=tr.tokens_per_s, generated_tokens=tr.generated_tokens,
            prompt_tokens=tr.prompt_tokens, cut=tr.cut, standby=standby,
            processes=self.process_status(gpu),
            switches=tuple(SwitchStatus.of(r) for r in self.switches))


def _profile_of(dep: Deployment) -> Profile | None:
    lay = dep.layout
    return lay.profile if lay is not None else None

def _tail_of(sup: Runner, name: str) -> list[str]:
    mp = next((p for p in sup.procs if p.name == name), None)
    return mp.log_tail() if mp is not None else []


def _process_status(p: ManagedProcess, gpu: Mapping[int, int], plan: Plan,
                    endpoints: Mapping[str, tuple[str, ...]]) -> ProcessStatus:
    """One process as published; `endpoints`: each remote device with spares, its endpoints
    (the lane's deployment's choice: plan/spares.py)."""
    pid = p.pid
    rss = None
    if pid:
        with contextlib.suppress(psutil.Error):
            rss = psutil.Process(pid).memory_info().rss
    spec = p.spec
    load = None
    if spec.role is Role.HEAD:  # how far a load onto remote peers has got
        load = progress.remote_load(plan, p.state.value, p.remote_sent)
    return ProcessStatus(
        name=p.name, role=spec.role.value, state=p.state.value, pid=pid, host=spec.host,
        port=spec.port, device=spec.device, reason=p.reason, restarts=p.restarts,
        started=p.started_wall if p.alive else None, last_exit=p.last_exit,
        managed=spec.managed, log=str(p.log_path), warning=p.warning,
        first_failure_log=p.first_failure_log,
        log_tail=tuple(p.log_tail()) if p.state is State.FATAL else (),
        rss_bytes=rss, gpu_bytes=gpu.get(pid) if pid else None, remote_load=load,
        endpoints=() if spec.managed else endpoints.get(spec.device, ()),
        tls=not spec.managed and spec.tls is not None)
