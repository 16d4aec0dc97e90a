"""One profile on a port: its route, its Deployment and the last good one, its Supervisor.

A Lane is the only writer of its route's gate (hold, release, unavailable) and upstream. This
module holds who it is, its gate, running and following one layout, and its published state;
its operations, each answered with a SwitchReport (reports.py) or a plain result:

  start(dep)       run a layout and follow it through restarts (hydra up with one profile)
  load(why)        make room on the node, start, wait until it serves (on demand, at start)
  unload(why)      hold, drain (bounded), stop; with `cut`, what is still in flight is cut
  switch(dep)      hold, drain, stop, wait for the GPU memory, start the new layout, gate,
                   release; on failure the last good layout comes back
  apply(dep)       a changed plan: nothing, the head alone, or everything (plandiff)
  restart(name)    a planned restart of one process (a peer restarts its pair)

load and unload are in loading.py; switch, apply, restart and their rollback in change.py;
keep_slots in keepslots.py (the Lane's methods call them).

While its head is not READY the lane holds its requests; it releases them when the head is
READY again. Everything here runs on the event-loop thread (router threads call `demand`,
which posts to the loop). Behaviour that differs for a port started with one profile (exit
when the layout goes FATAL; processes named without the profile) is a flag, not a path.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from hydra_supervisor.config.profile import Profile
from hydra_supervisor.plan import fleetplan
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.plan import Plan, Role
from hydra_supervisor.plan.ports import client_host
from hydra_supervisor.proc import gpumem, llamaerr
from hydra_supervisor.proc.managed import ManagedProcess, State
from hydra_supervisor.proc.seams import Moved
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.proc.supervisor import Supervisor
from hydra_supervisor.router.routes import Addr, Limiter, Route
from hydra_supervisor.serve import change, loading, progress, states
from hydra_supervisor.serve.reports import (
    LayoutFailed,
    SwitchReport,
    SwitchTimeouts,
)
from hydra_supervisor.serve.runner import Runner
from hydra_supervisor.serve.states import LaneState

if TYPE_CHECKING:
    from hydra_supervisor.serve.node import Node

log = logging.getLogger("hydra")

FAIL_COOLDOWN = 10.0  # a lane whose load failed answers 503 this long before a retry
FAIL_COOLDOWN_MAX = 300.0  # ... doubled after each failure in a row, up to this


class PortSide(Protocol):
    """What a lane needs of its port."""

    port: int
    host: str

    @property
    def url(self) -> str: ...

    def lane_changed(self, lane: Lane) -> None: ...

    def set_rpc(self, addr: Addr | None) -> None: ...


def namespaced(dep: Deployment) -> Deployment:
    """Process names prefixed with the profile (`demo.head`), so the profiles of one hydra
    keep apart in the state dir's pids/ and logs/ and in `hydra restart` / `hydra logs`."""
    name = dep.profile

    def ren(e: Any) -> Any:
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
                 profile: Profile | None = None, node: Node | None = None,
                 switch_timeouts: SwitchTimeouts | None = None,
                 make_supervisor: Callable[[Deployment, StateDir], Runner] = Supervisor,
                 clock: Callable[[], float] = time.monotonic,
                 exit_on_fatal: bool = False, prefix_names: bool = False,
                 load_wait: float | None = None, seq_from: int = 0) -> None:
        """`load_wait`: the lane loads on request (a port routed by model): its held requests
        wait for a whole load plus this long for room. `seq_from`: its reports are numbered
        after this (the port's own, of a lane dropped before it)."""
        self.port = port
        self.route = route
        self.state = state
        self.node = node
        self.switch_timeouts = switch_timeouts or SwitchTimeouts()
        self.make_supervisor = make_supervisor  # seam: policy tests run fake supervisors
        self.clock = clock
        # One profile on its port: its FATAL ends hydra (exit 1), its processes are named
        # without the profile ("head"), and a switch replaces its profile.
        self.exit_on_fatal = exit_on_fatal
        self.prefix_names = prefix_names
        self.standby = False  # the port's standby layout (serve/standby.py), not its active one
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
        self._switch_count = seq_from
        self.unkillable: list[str] = []
        if load_wait is not None:
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
        self.why = "not loaded yet"
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

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
        """A Deployment as this lane runs it: on the port's address, processes named after the
        profile when the port serves several."""
        from hydra_supervisor.plan import deployment  # deployment imports layout: keep it lazy

        if self.prefix_names:
            dep = namespaced(dep)
        if dep.plan.router is not None:
            dep = deployment.bound_to(dep, self.port.port)
        return dep

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
        sup.listeners.append(self._on_transition)
        sup.on_publish = self._changed
        sup.before_head_swap = self._before_head_swap
        self.sup = sup
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

    async def _ready(self, sup: Runner, timeout: float) -> None:
        """Wait until every process of `sup` is READY; a failure before that raises at once
        (a change does not sit through a crash loop: it rolls back)."""
        deadline = time.monotonic() + timeout
        while True:
            if sup.first_ready.is_set() and all(p.state is State.READY for p in sup.procs):
                return
            bad = next((p for p in sup.procs
                        if p.state in (State.BACKOFF, State.FATAL)), None)
            if bad is not None or sup.fatal or (self.task is not None and self.task.done()):
                who = bad or next((p for p in sup.procs if p.state is not State.READY),
                                  sup.procs[-1])
                msg = sup.fatal or f"{who.name}: {who.reason or 'stopped'}"
                line = llamaerr.from_log(getattr(who, "log_path", None))
                raise LayoutFailed(llamaerr.with_line(msg, line), who.log_tail())
            if time.monotonic() >= deadline:
                who = next((p for p in sup.procs if p.state is not State.READY), sup.procs[-1])
                raise LayoutFailed(f"{who.name} not ready within {timeout:.0f}s "
                                   f"({who.state.value}: {who.reason})", who.log_tail())
            await asyncio.sleep(0.05)

    async def wait_ready(self, timeout: float) -> None:
        if self.sup is None:
            raise LayoutFailed("nothing is running", [])
        await self._ready(self.sup, timeout)

    async def _stop_current(self, reason: str) -> list[int]:
        """Stop the running layout; returns the pids it had (to wait for their GPU memory)."""
        sup, task = self.sup, self.task
        if sup is None:
            return []
        pids = [p.pid for p in sup.procs if p.pid is not None]
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

    async def start(self) -> None:
        """hydra up with one profile: run the layout and follow it (the supervisor restarts
        what dies, with backoff); requests are held until the head is ready."""
        self._to(LaneState.SERVING)
        self.route.set_unavailable(None)
        self.route.hold(f"loading model for profile {self.name}")
        self.loads += 1
        self.loaded_at = self.clock()
        self.last_good = self.dep
        self._launch(self.dep)
        self.sync_gate()

    # -- loading and unloading (several profiles on a node): serve/loading.py ----------------

    async def load(self, why: str, force: bool = False) -> bool:
        """Make room, start the layout, wait until it serves. False: it failed (its held
        requests got the reason; the others keep serving). `force` (hydra switch): it may stop
        others even after a failed load."""
        return await loading.load(self, why, force)

    def went_fatal(self) -> bool:
        """A serving lane whose layout went FATAL is failed (see loading.went_fatal)."""
        return loading.went_fatal(self)

    async def unload(self, why: str, cut: bool = False) -> int | None:
        """Drain (bounded) and stop a serving lane; how many requests were cut, or None when it
        was not stopped (see loading.unload)."""
        return await loading.unload(self, why, cut)

    # -- changes: serve/change.py -----------------------------------------------------------------

    async def switch(self, dep: Deployment) -> SwitchReport:
        """Replace the running layout with `dep` (a port with one lane: any profile)."""
        return await change.switch(self, dep)

    async def apply(self, dep: Deployment) -> SwitchReport:
        """Run `dep` in place of the running layout, restarting only what changes (plandiff)."""
        return await change.apply(self, dep)

    async def restart(self, name: str) -> SwitchReport:
        """A planned restart of one process (`hydra restart NAME`)."""
        return await change.restart(self, name)

    def _adopt(self, dep: Deployment) -> None:
        """The lane now runs `dep` (a switch may change its profile: the port re-indexes)."""
        renamed = dep.profile != self.dep.profile
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
        self._switch_count += 1
        report.seq = self._switch_count
        self.switches.append(report)
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in report.phases.items())
        log.info("switch %s -> %s: %s in %.2fs (%s)%s", report.frm, report.to, report.result,
                 report.total_s, phases, f"; {report.error}" if report.error else "")
        self._changed()

    async def shutdown(self, reason: str) -> None:
        """Stop the running layout. The Supervisor stays as the record of the last run (its
        FATAL reason, the processes' last states) for the final status.json."""
        if self.sup is not None:
            self.sup.request_stop(reason)
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

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

    def process_rows(self, gpu: dict[int, int]) -> list[dict[str, Any]]:
        """The supervisor's rows plus memory: resident (host) and GPU (NVML) per process."""
        sup = self.sup
        if sup is None:
            return []
        rows = []
        for p in sup.procs:
            row = p.row()
            pid = row.get("pid")
            row["rss_bytes"] = None
            if pid:
                with contextlib.suppress(psutil.Error):
                    row["rss_bytes"] = psutil.Process(pid).memory_info().rss
            row["gpu_bytes"] = gpu.get(pid) if pid else None
            if p.spec.role is Role.HEAD:  # how far a load onto remote peers has got
                row["remote_load"] = progress.remote_load(sup.plan, row)
            rows.append(row)
        return rows

    def requests_last_min(self) -> int | None:
        """Requests of this lane in about the last minute, from its route's counter sampled at
        each snapshot (status --watch asks every second; None until two samples exist)."""
        now = time.monotonic()
        total = self.route.requests
        if not self._samples or now - self._samples[-1][0] >= 1.0:
            self._samples.append((now, total))
        while self._samples and now - self._samples[0][0] > 60.0:
            self._samples.popleft()
        if not self._samples or now - self._samples[0][0] < 1.0:
            return None
        return total - self._samples[0][1]

    def lane_row(self) -> dict[str, Any]:
        """Lane facts for the snapshot (the port adds its own)."""
        st = self.route.stats()
        now = self.clock()
        return {
            "phase": self.phase.value, "aliases": list(self.aliases),
            "on_demand": self.on_demand, "ttl": self.ttl, "min_resident": self.min_resident,
            "concurrency": getattr(self.profile, "concurrency", None),
            "queue": getattr(self.profile, "queue", None),
            "devices": list(self.devices),
            "needs_mib": {k: round(v / fleetplan.MIB) for k, v in self.needs.items()},
            "loads": self.loads, "unloads": self.unloads, "error": self.error, "why": self.why,
            "resident_s": round(now - self.loaded_at, 1) if self.loaded_at is not None else None,
            "idle_s": st["idle_s"], "requests": st["requests"], "held": st["held"],
            "held_reason": st["held_reason"], "inflight": st["inflight"],
            "running": st["running"], "waiting": st["waiting"]}


def _profile_of(dep: Deployment) -> Profile | None:
    lay = dep.layout
    return lay.profile if lay is not None else None
