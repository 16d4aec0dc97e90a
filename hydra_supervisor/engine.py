"""One external port and what serves it: the Router, the running Deployment, the last good one.

The Engine is the long-lived owner of an engine's external port. Its Router stays up for the
whole life of hydra; Deployments come and go under it:

  start(dep)        run a Deployment (or none: a model-less engine answers 503 naming the
                    profiles and `hydra switch NAME`)
  switch(dep)       hold new requests, drain in-flight ones, stop the old layout, wait until its
                    GPU memory is free, start the new one (peers first), health-gate, release;
                    on any failure stop what was started, bring the last good layout back and
                    release to it. One switch at a time (a second gets EngineBusy).
  restart(name)     a planned restart of one process (a peer restarts its pair)

While the head of the running layout is not READY (loading, restarting after a crash or a
peer loss, UNHEALTHY) the router holds new HTTP requests instead of sending them into it, and
releases them when the head is READY again.

Everything here runs on the event-loop thread: control handlers (threads) hand their calls
over with asyncio.run_coroutine_threadsafe, so every child is forked by the loop's thread
(PR_SET_PDEATHSIG follows the forking thread).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from hydra_supervisor import gpumem, llamaerr, plandiff
from hydra_supervisor.deployment import Deployment
from hydra_supervisor.errors import HydraError
from hydra_supervisor.ports import client_host, host_port, url_for
from hydra_supervisor.portwatch import PortWatch
from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.router.conn import Addr, Handoff
from hydra_supervisor.state import StateDir
from hydra_supervisor.supervisor import Fatal, ManagedProcess, State, Supervisor
from hydra_supervisor.wire import slots

log = logging.getLogger("hydra")

DEFAULT_ALLOW = ("127.0.0.0/8", "::1/128")
SLOT_TIMEOUT = 120.0  # one slot's save or restore (a long context on a slow disk)


class EngineBusy(HydraError):
    """A switch (or restart) is already running on this engine."""


class RestartFailed(HydraError):
    """`hydra restart NAME` did not bring the process back (the layout was started again)."""


@dataclass(frozen=True)
class SwitchTimeouts:
    drain: float = 30.0  # in-flight requests may finish this long, then they are cut
    gpu_free: float = 30.0  # the old processes' GPU memory must be released within this
    gate_extra: float = 0.0  # added to the new layout's own load timeout


@dataclass
class SwitchReport:
    """What a switch did, phase by phase; the API reply and hydra.log carry it."""

    to: str
    frm: str | None
    result: str = "running"  # ok | rolled_back | failed | noop
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    failed_phase: str | None = None
    log_tail: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cut: int = 0
    total_s: float = 0.0
    restarted: list[str] = field(default_factory=list)
    seq: int = 0  # 1, 2, … per engine, set when it is recorded (metrics count by it)

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "to": self.to, "from": self.frm, "result": self.result,
                "phases": {k: round(v, 3) for k, v in self.phases.items()},
                "total_s": round(self.total_s, 3), "error": self.error,
                "failed_phase": self.failed_phase, "log_tail": self.log_tail,
                "notes": self.notes, "cut": self.cut, "restarted": self.restarted}


class _Phases:
    """Times each phase of a switch (monotonic) into a report."""

    def __init__(self, report: SwitchReport) -> None:
        self.report = report
        self.t0 = time.monotonic()
        self.current: str | None = None

    @contextlib.contextmanager
    def __call__(self, name: str) -> Any:
        self.current = name
        start = time.monotonic()
        try:
            yield
        finally:
            self.report.phases[name] = self.report.phases.get(name, 0.0) + \
                time.monotonic() - start

    def done(self) -> None:
        self.report.total_s = time.monotonic() - self.t0


class LayoutFailed(Exception):
    """A layout did not become ready; the message says which process and why."""

    def __init__(self, message: str, tail: list[str]) -> None:
        super().__init__(message)
        self.tail = tail


class Engine:
    """Owns one external port: its Router, the running Supervisor, the last good Deployment."""

    def __init__(self, state: StateDir, host: str, port: int, *,
                 allow: tuple[str, ...] = DEFAULT_ALLOW, use_router: bool = True,
                 profiles: Callable[[], list[str]] | None = None,
                 switch_timeouts: SwitchTimeouts | None = None,
                 router_kwargs: dict[str, Any] | None = None,
                 make_supervisor: Callable[[Deployment, StateDir], Supervisor] = Supervisor,
                 make_router: Callable[..., Router] = Router) -> None:
        self.state = state
        self.make_supervisor = make_supervisor  # seams: policy tests use fakes
        self.make_router = make_router
        self.host = host
        self.port = port
        self.allow = allow
        self.use_router = use_router
        self.profiles = profiles or (lambda: [])
        self.switch_timeouts = switch_timeouts or SwitchTimeouts()
        self.router_kwargs = router_kwargs or {}
        self.router: Router | None = None
        self.watch: PortWatch | None = None  # the router accepting connections (open())
        self.dep: Deployment | None = None
        self.last_good: Deployment | None = None
        self.sup: Supervisor | None = None
        self.task: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.switching: str | None = None
        self.switches: collections.deque[SwitchReport] = collections.deque(maxlen=20)
        self._switch_count = 0  # every switch recorded so far (the deque keeps the last 20)
        self.listeners: list[Callable[[], None]] = []  # told on every change (status, notify)
        self.hydra_upstream: Addr | Handoff | None = None  # the wire server, when it runs
        self.unkillable: list[str] = []  # children that survived SIGKILL (D state), reported
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    # -- the port -----------------------------------------------------------------------------

    def open(self) -> None:
        """Bind the external port (the router). Without a router the head binds it itself."""
        if not self.use_router:
            return
        self.router = self.make_router(self.host, self.port, Upstreams(), allow=self.allow,
                                       name=f"port {self.port}", **self.router_kwargs)
        self._idle_message()  # before the port opens: no request sees an engine without one
        self.router.start()
        self.port = self.router.port  # --port 0: the port the kernel gave us
        self.watch = PortWatch(host_port(self.host, self.port), self.router)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.active = False  # down on purpose from now on
        if self.router is not None:
            self.router.stop()

    def port_down(self) -> str | None:
        """Why the external port refuses every connection (its router's acceptor is not
        running), or None. (A profile among several on one port sees the shared router.)"""
        return self.watch.down() if self.watch is not None else None

    def check_port(self) -> bool:
        """The daemon's tick: restart a router that stopped accepting (portwatch.py); True
        when the port went down or came back."""
        return self.watch.check() if self.watch is not None else False

    @property
    def url(self) -> str:
        """http://, or ggml-rpc:// for a peer-only engine (mode: peer: no HTTP at all)."""
        plan = self.dep.plan if self.dep is not None else None
        if plan is not None and plan.router is not None and not plan.router.http:
            return url_for(self.host, self.port, scheme="ggml-rpc")
        return url_for(self.host, self.port)

    def _idle_message(self) -> None:
        if self.router is None:
            return
        names = ", ".join(self.profiles()) or "(none found)"
        self.router.set_unavailable(
            f"no profile is loaded on this hydra: run `hydra switch NAME` (profiles: {names})",
            retry_after=10)

    def _upstreams(self, dep: Deployment) -> Upstreams:
        spec = dep.plan.router
        if spec is None:
            return Upstreams(hydra=self.hydra_upstream)
        return Upstreams(http=spec.http, rpc=spec.rpc, hydra=self.hydra_upstream)

    # -- following the head --------------------------------------------------------------------

    def _on_transition(self, mp: ManagedProcess) -> None:
        sup = self.sup
        if sup is None or mp not in sup.procs:
            return
        self._sync_gate()

    async def _before_head_swap(self, to: str) -> None:
        """The supervisor returns a degraded head to COMBINE: a planned swap, so hold new
        requests and let the SOLO head finish what it serves (bounded) before it stops."""
        if self.router is None:
            return
        self.router.hold(f"returning to {to.upper()} now that the peer is back")
        left = await asyncio.to_thread(self.router.wait_idle, self.switch_timeouts.drain)
        if left:
            n = self.router.cut_inflight(f"cut by the return to {to} after "
                                         f"{self.switch_timeouts.drain:.0f}s of draining",
                                         requeue=True)
            log.warning("return to %s: %d in-flight requests cut after the drain", to, n)

    def _published(self) -> None:
        for fn in self.listeners:
            fn()

    def _sync_gate(self) -> None:
        """Hold new requests while the running head is not READY; release when it is."""
        r, sup = self.router, self.sup
        if r is None or sup is None or self.switching:
            return  # a switch holds and releases itself
        if sup.fatal:
            r.set_unavailable(f"profile {sup.plan.profile} failed: {sup.fatal}", retry_after=30)
            r.release()
            return
        head = sup.head
        if head is None:  # a peer-only engine (mode: peer): ggml-RPC only, never HTTP
            r.set_unavailable(f"port {self.port} lends {sup.plan.engines[0].device} over "
                              "ggml-RPC (mode: peer); it serves no HTTP", retry_after=3600)
            r.release()
            return
        if head.state is State.READY:
            r.set_unavailable(None)
            r.release()
        else:
            r.hold(self._hold_reason(head))

    def sync_gate(self) -> None:
        """Set the router from the head's state now (after someone else changed it)."""
        self._sync_gate()

    @staticmethod
    def _hold_reason(head: ManagedProcess) -> str:
        if head.state is State.STARTING:
            return f"loading model ({head.reason})" if head.reason else "loading model"
        state = head.state.value.lower()
        return f"head {state}: {head.reason}" if head.reason else f"head {state}"

    # -- running one deployment ----------------------------------------------------------------

    def _launch(self, dep: Deployment, fail_fast: bool = False) -> Supervisor:
        """Run `dep`. `fail_fast` (a change): its first failed start ends the run at once
        (no backoff) so the caller can roll back."""
        sup = self.make_supervisor(dep, self.state)
        sup.fail_fast = fail_fast
        sup.router = self.router
        sup.listeners.append(self._on_transition)
        sup.on_publish = self._published
        sup.before_head_swap = self._before_head_swap
        self.sup = sup
        self.dep = dep
        if self.router is not None:
            self.router.set_upstreams(self._upstreams(dep))
        self.task = asyncio.create_task(self._run(sup))
        return sup

    async def _run(self, sup: Supervisor) -> None:
        try:
            await sup.run()
        finally:
            self.unkillable.extend(sup.unkillable)
        if sup is self.sup:
            self._sync_gate()
            for fn in self.listeners:
                fn()

    async def _ready(self, sup: Supervisor, timeout: float) -> None:
        """Wait until every process of `sup` is READY; a failure before that raises at once
        (a switch does not sit through a crash loop: it rolls back)."""
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
        released; the engine is idle afterwards. Returns pids whose memory was not released."""
        pids = await self._stop_current(reason)
        left = await gpumem.wait_released(pids, self.switch_timeouts.gpu_free)
        self.dep = None
        return left

    async def wait_ready(self, timeout: float) -> None:
        """Until every process of the running layout is READY; LayoutFailed on a failure."""
        if self.sup is None:
            raise LayoutFailed("nothing is running", [])
        await self._ready(self.sup, timeout)

    async def start(self, dep: Deployment | None) -> None:
        """Initial start: the router is open; requests are held until the head is ready."""
        if dep is None:
            self._idle_message()
            return
        if self.router is not None:
            self.router.set_unavailable(None)
            self.router.hold(f"loading model for profile {dep.profile}")
        self._launch(dep)
        self._sync_gate()

    # -- switch ---------------------------------------------------------------------------------

    def check_servable(self, dep: Deployment) -> None:
        """Refuse, before anything stops, a layout this engine cannot run on its port: a
        `router: false` profile (its llama-server would bind the port the router holds), or
        a profile with a router on an engine whose llama-server binds the port itself."""
        if self.use_router and dep.plan.router is None:
            raise HydraError(
                f"profile {dep.profile} has `router: false` (llama-server binds the external "
                f"port itself), but this hydra's router holds port {self.port}: it cannot be "
                "switched to, reloaded into or served beside other profiles; remove "
                f"`router: false`, or stop hydra and start it with `hydra up -p {dep.profile}`")
        if not self.use_router and dep.plan.router is not None:
            raise HydraError("this hydra was started with `router: false` (llama-server binds "
                             "the external port itself); switching to a profile with a router "
                             "needs a restart of hydra")

    async def switch(self, dep: Deployment) -> SwitchReport:
        if self.lock.locked():
            raise EngineBusy(f"a switch is already running on port {self.port} "
                             f"(to {self.switching}); try again when it is done")
        self.check_servable(dep)
        async with self.lock:
            return await self._switch(dep)

    async def _switch(self, dep: Deployment) -> SwitchReport:
        old = self.dep
        report = SwitchReport(to=dep.profile, frm=old.profile if old else None)
        phase = _Phases(report)
        self.switching = dep.profile
        r = self.router
        started_new = False
        try:
            with phase("hold"):
                if r is not None:
                    r.hold(f"switching to profile {dep.profile}")
            with phase("drain"):
                await self._drain(report, dep.profile)
            saved: dict[int, str] = {}
            if old is not None and old.keep_slots:
                with phase("save_slots"):
                    saved = await self._save_slots(old)
            with phase("stop"):
                pids = await self._stop_current(f"switch to {dep.profile}")
            with phase("gpu_free"):
                left_pids = await gpumem.wait_released(pids, self.switch_timeouts.gpu_free)
                if left_pids:
                    report.notes.append(f"GPU memory of pids {left_pids} not released within "
                                        f"{self.switch_timeouts.gpu_free:.0f}s")
            report.restarted = [e.name for e in dep.plan.in_start_order()]
            with phase("start"):
                sup = self._launch(dep, fail_fast=True)
                started_new = True
                await self._ready(sup, dep.timeouts.load + dep.timeouts.peer
                                  + self.switch_timeouts.gate_extra)
            if saved:
                with phase("restore_slots"):
                    await self._restore_slots(old, dep, saved, report)
            with phase("release"):
                self.last_good = dep
                self.switching = None
                self._sync_gate()
            report.result = "ok"
        except (LayoutFailed, HydraError, OSError) as exc:
            report.failed_phase = phase.current
            report.error = str(exc)
            report.log_tail = getattr(exc, "tail", [])
            log.error("switch to %s failed in phase %s: %s", dep.profile, phase.current, exc)
            await self._rollback(old if old is not None else None, report, phase, started_new)
        except asyncio.CancelledError:
            # hydra is stopping mid-switch: whatever runs is stopped by the caller's shutdown.
            report.result = "failed"
            report.error = "hydra stopped during the switch"
            raise
        finally:
            self._finish(report, phase)
        return report

    async def apply(self, dep: Deployment) -> SwitchReport:
        """Run `dep` in place of the running layout, restarting only what changes (plandiff):
        nothing (a no-op), the head alone (its peers keep running), or everything (a switch).
        A different external address is refused."""
        if self.lock.locked():
            raise EngineBusy(f"a switch is already running on port {self.port} "
                             f"(to {self.switching}); try again when it is done")
        self.check_servable(dep)
        cur, sup = self.dep, self.sup
        if cur is None or sup is None:
            return await self.switch(dep)
        d = plandiff.diff(cur.plan, dep.plan)
        if d.change is plandiff.Change.REFUSED:
            raise HydraError(d.reason)
        if d.change is plandiff.Change.NONE and cur.policy == dep.policy \
                and cur.timeouts == dep.timeouts:
            rep = SwitchReport(to=dep.profile, frm=cur.profile, result="noop")
            rep.notes.append("nothing changes")
            return rep
        if d.change is not plandiff.Change.HEAD:
            rep = await self.switch(dep)
            rep.restarted = list(d.restart)
            return rep
        async with self.lock:
            return await self._restart_head(cur, dep, sup, d.restart)

    async def _restart_head(self, old: Deployment, dep: Deployment, sup: Supervisor,
                            names: tuple[str, ...]) -> SwitchReport:
        report = SwitchReport(to=dep.profile, frm=old.profile, restarted=list(names))
        phase = _Phases(report)
        self.switching = dep.profile
        r = self.router
        try:
            with phase("hold"):
                if r is not None:
                    r.hold(f"restarting the head of {dep.profile} with new settings")
            with phase("drain"):
                await self._drain(report, dep.profile)
            saved = await self._save_slots(old)
            with phase("restart_head"):
                sup.adopt_head(dep)
                self.dep = dep
                # fail fast: the first failed start of the new head ends the change (no
                # backoff), and the supervisor waits for the rollback below
                await sup.restart(names[0], fail_fast=True)
                await self._ready(sup, dep.timeouts.load)
            await self._restore_slots(old, dep, saved, report)
            self.last_good = dep
            report.result = "ok"
        except (LayoutFailed, HydraError, OSError, Fatal) as exc:
            report.failed_phase = phase.current
            report.error = str(exc)
            report.log_tail = getattr(exc, "tail", []) or self._tail_of(sup, names[0])
            log.error("restart of %s with new settings failed in phase %s: %s",
                      dep.profile, phase.current, exc)
            try:
                with phase("rollback"):
                    sup.adopt_head(old)
                    self.dep = old
                    await sup.restart(names[0], fail_fast=True)
                    await self._ready(sup, old.timeouts.load)
                    report.result = "rolled_back"
            except (LayoutFailed, HydraError, OSError, Fatal) as exc2:
                # the old head did not come back in place: the last good layout afresh
                log.error("the old head of %s did not come back in place (%s); starting "
                          "the last good layout again", old.profile, exc2)
                await self._rollback(old, report, phase, started_new=True)
        finally:
            self._finish(report, phase)
            self._sync_gate()
        return report

    @staticmethod
    def _tail_of(sup: Supervisor, name: str) -> list[str]:
        mp = next((p for p in sup.procs if p.name == name), None)
        return mp.log_tail() if mp is not None else []

    def _head_addr(self) -> tuple[str, int] | None:
        sup = self.sup
        if sup is None or sup.head is None or sup.head.state is not State.READY:
            return None
        spec = sup.head.spec
        return (client_host(spec.host), spec.port)

    async def _save_slots(self, dep: Deployment | None) -> dict[int, str]:
        """keep_slots: save every slot of the running head before it stops."""
        if dep is None or not dep.keep_slots:
            return {}
        addr = self._head_addr()
        if addr is None:
            return {}
        try:
            return await asyncio.to_thread(slots.save_all, addr, f"keep-{dep.profile}",
                                           SLOT_TIMEOUT)
        except (slots.SlotError, OSError) as exc:
            log.warning("keep_slots: could not save the slots of %s: %s", dep.profile, exc)
            return {}

    async def _restore_slots(self, old: Deployment | None, new: Deployment,
                             saved: dict[int, str], report: SwitchReport) -> None:
        """keep_slots: restore the saved slots into the new head when it runs the same model."""
        if not saved:
            return
        try:
            addr = self._head_addr()
            if old is None or addr is None or old.plan.model_path != new.plan.model_path \
                    or not new.keep_slots:
                report.notes.append("saved slots not restored: the new layout runs another "
                                    "model or does not keep slots")
                return
            res = await asyncio.to_thread(slots.restore_all, addr, saved, SLOT_TIMEOUT)
            ok = {k: v for k, v in res.items() if isinstance(v, int)}
            report.notes.append(f"keep_slots: restored {len(ok)} of {len(saved)} slots "
                                f"({sum(ok.values())} tokens)")
        except (slots.SlotError, OSError) as exc:
            report.notes.append(f"keep_slots: restore failed: {exc}")
        finally:
            for name in saved.values():
                with contextlib.suppress(OSError):
                    (self.state.root / "slots" / name).unlink()

    async def _drain(self, report: SwitchReport, target: str) -> None:
        r = self.router
        if r is None:
            return
        left = await asyncio.to_thread(r.wait_idle, self.switch_timeouts.drain)
        if left:
            # Those without a response byte are sent again to the new layout once it serves
            # (held meanwhile, as after a crash); only partial responses are cut.
            report.cut = r.cut_inflight(f"cut by the switch to {target} after "
                                        f"{self.switch_timeouts.drain:.0f}s of draining",
                                        requeue=True)
            resent = max(0, left - report.cut)
            report.notes.append(f"{left} requests still in flight after the "
                                f"{self.switch_timeouts.drain:.0f}s drain: {report.cut} cut "
                                f"(partly answered), {resent} without a response byte sent "
                                "again to the new layout")

    async def _rollback(self, old: Deployment | None, report: SwitchReport, phase: _Phases,
                        started_new: bool) -> None:
        with phase("rollback"):
            if started_new:
                await self._stop_current(f"switch to {report.to} failed")
            back = self.last_good or old
            if back is None:
                self.dep = None
                report.result = "failed"
                self.switching = None
                self._idle_message()
                if self.router is not None:
                    self.router.release()
                return
            try:
                sup = self._launch(back)
                await self._ready(sup, back.timeouts.load + back.timeouts.peer)
                report.result = "rolled_back"
            except LayoutFailed as exc:
                report.result = "failed"
                report.error = f"{report.error}; the rollback to {back.profile} failed too: {exc}"
            self.switching = None
            self._sync_gate()

    def _finish(self, report: SwitchReport, phase: _Phases) -> None:
        """A switch or head restart is over (whatever its result): record and announce it."""
        self.switching = None
        phase.done()
        self._switch_count += 1
        report.seq = self._switch_count
        self.switches.append(report)
        self._log_report(report)
        for fn in self.listeners:
            fn()

    def _log_report(self, rep: SwitchReport) -> None:
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in rep.phases.items())
        log.info("switch %s -> %s: %s in %.2fs (%s)%s", rep.frm, rep.to, rep.result,
                 rep.total_s, phases, f"; {rep.error}" if rep.error else "")

    # -- restart one process ------------------------------------------------------------------

    async def restart(self, name: str) -> dict[str, Any]:
        sup = self.sup
        if sup is None:
            raise HydraError("no profile is running on this hydra: nothing to restart")
        names = [p.name for p in sup.procs]
        if name not in names:
            raise HydraError(f"no engine '{name}' in profile {sup.plan.profile}; "
                             f"engines: {', '.join(names)}")
        if self.lock.locked():
            raise EngineBusy(f"a switch is running on port {self.port}; try again after it")
        async with self.lock:
            t0 = time.monotonic()
            dep = self.dep
            saved = await self._save_slots(dep)
            try:
                await sup.restart(name, fail_fast=True)
                await self._ready(sup, sup.timeouts.load + sup.timeouts.peer)
            except (LayoutFailed, Fatal) as exc:
                raise RestartFailed(await self._restart_failed(name, sup, dep, exc)) from exc
            rep = SwitchReport(to=sup.plan.profile, frm=sup.plan.profile)
            if dep is not None:
                await self._restore_slots(dep, dep, saved, rep)
            return {"engine": name, "profile": sup.plan.profile,
                    "seconds": round(time.monotonic() - t0, 3), "notes": rep.notes}

    async def _restart_failed(self, name: str, sup: Supervisor, dep: Deployment | None,
                              exc: Exception) -> str:
        """`hydra restart NAME` failed its first start: no backoff; the last good layout is
        started again from scratch (the switch's rollback). Returns the error to reply."""
        rep = SwitchReport(to=sup.plan.profile, frm=sup.plan.profile, error=str(exc),
                           failed_phase="restart")
        rep.log_tail = getattr(exc, "tail", []) or self._tail_of(sup, name)
        phase = _Phases(rep)
        self.switching = sup.plan.profile
        log.error("restart of %s failed: %s", name, exc)
        try:
            await self._rollback(dep, rep, phase, started_new=True)
        finally:
            self._finish(rep, phase)
        if rep.result == "rolled_back":
            return (f"restart of {name} failed: {exc}; the last good layout was started "
                    "again and serves")
        return f"restart of {name} failed: {rep.error}"

    async def shutdown(self, reason: str) -> None:
        """Stop the running layout. The Supervisor stays as the record of the last run (its
        FATAL reason, the processes' last states) for the final status.json."""
        if self.sup is not None:
            self.sup.request_stop(reason)
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    # -- status ---------------------------------------------------------------------------------

    def state_word(self) -> str:
        sup = self.sup
        if self.port_down():
            return "port down"  # whatever runs behind it, no client reaches it
        if self.switching:
            return "switching"
        if sup is None:
            return "idle"
        if sup.fatal:
            return "fatal"
        if sup.degraded:
            return "degraded"
        if all(p.state is State.READY for p in sup.procs):
            return "serving"  # a peer-only engine (mode: peer) has no head
        if not sup.first_ready.is_set():
            return "starting"
        return "recovering"

    def _process_rows(self, gpu: dict[int, int] | None) -> list[dict[str, Any]]:
        """The supervisor's rows plus memory: resident (host) and GPU (NVML) per process;
        `gpu` is NVML's per-pid map when the caller already has it (one NVML session for
        several engines), else it is read here."""
        sup = self.sup
        if sup is None:
            return []
        if gpu is None:
            gpu = gpumem.used_by_pid()
        rows = []
        for p in sup.procs:
            row = p.row()
            pid = row.get("pid")
            row["rss_bytes"] = None
            if pid:
                with contextlib.suppress(psutil.Error):
                    row["rss_bytes"] = psutil.Process(pid).memory_info().rss
            row["gpu_bytes"] = gpu.get(pid) if pid else None
            rows.append(row)
        return rows

    def _requests_last_min(self) -> int | None:
        """HTTP requests finished in about the last minute, from the router's counter sampled
        at each snapshot (status --watch asks every second; None until two samples exist)."""
        if self.router is None:
            return None
        now = time.monotonic()
        total = int((self.router.stats().get("http") or {}).get("requests", 0))
        if not self._samples or now - self._samples[-1][0] >= 1.0:
            self._samples.append((now, total))
        while self._samples and now - self._samples[0][0] > 60.0:
            self._samples.popleft()
        if not self._samples or now - self._samples[0][0] < 1.0:
            return None
        return total - self._samples[0][1]

    def _router_stats(self) -> dict[str, Any] | None:
        if self.router is None:
            return None
        st = self.router.stats()
        if self.watch is not None:
            st.update(self.watch.counts())
        return st

    def snapshot(self, gpu: dict[int, int] | None = None) -> dict[str, Any]:
        sup = self.sup
        dep = self.dep
        return {
            "name": f"port-{self.port}",  # stable across switches (metric labels)
            "profile": dep.profile if dep else None,
            "source": dep.plan.source if dep else None,
            "mode": dep.plan.mode if dep else None,
            "model": dep.model_label if dep else None,
            "host": self.host, "port": self.port, "url": self.url,
            "state": self.state_word(),
            "down": self.port_down(),
            "switching": self.switching,
            "fatal": sup.fatal if sup else None,
            "degraded": sup.degraded if sup else None,
            "processes": self._process_rows(gpu),
            "requests_last_min": self._requests_last_min(),
            "router": self._router_stats(),
            "switches": [s.to_json() for s in self.switches],
        }
