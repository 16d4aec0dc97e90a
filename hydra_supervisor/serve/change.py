"""A lane's changes: switch, apply, restart of one process, and their rollback.

Each runs under the lane's lock (one change at a time) and is answered by one SwitchReport
(reports.py) or, for `hydra restart`, a plain result:

  switch(lane, dep)    hold, drain, stop, wait for the GPU memory, start the new layout, gate,
                       release; on failure the last good layout comes back
  apply(lane, dep)     a changed plan: nothing, the head alone, or everything (plandiff)
  restart(lane, name)  a planned restart of one process (a peer restarts its pair)

Drain is bounded (what is still in flight after it is cut, or sent again to the new layout when
no response byte went out); keep_slots (keepslots.py) saves the head's slots before it stops.
The Lane (lane.py) owns what these change (its route's gate, its Deployment, its Supervisor)
and answers its callers with them (`Lane.switch`, `Lane.apply`, `Lane.restart`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import plandiff
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.proc import gpumem
from hydra_supervisor.proc.managed import Fatal
from hydra_supervisor.serve import keepslots
from hydra_supervisor.serve.reports import (
    Busy,
    LayoutFailed,
    Phases,
    RestartFailed,
    Result,
    SwitchReport,
)
from hydra_supervisor.serve.runner import Runner
from hydra_supervisor.serve.states import LaneState

if TYPE_CHECKING:
    from hydra_supervisor.serve.lane import Lane

log = logging.getLogger("hydra")


def _check_free(lane: Lane) -> None:
    if lane.lock.locked():
        raise Busy(f"a switch is already running on port {lane.port.port} "
                   f"(to {lane.switching}); try again when it is done")


async def switch(lane: Lane, dep: Deployment) -> SwitchReport:
    """Replace the running layout with `dep` (a port with one lane: any profile)."""
    _check_free(lane)
    async with lane.lock:
        return await _switch(lane, lane.own(dep))


async def _switch(lane: Lane, dep: Deployment) -> SwitchReport:
    old = lane.dep if lane.sup is not None else None
    report = SwitchReport(to=dep.profile, frm=old.profile if old else None)
    phase = Phases(report)
    lane.switching = dep.profile
    lane._to(LaneState.SWITCHING)
    r = lane.route
    started_new = False
    try:
        with phase("hold"):
            r.hold(f"switching to profile {dep.profile}")
        with phase("drain"):
            await _drain(lane, report, dep.profile)
        saved: dict[int, str] = {}
        if old is not None and old.keep_slots:
            with phase("save_slots"):
                saved = await keepslots.save(lane, old)
        with phase("stop"):
            pids = await lane._stop_current(f"switch to {dep.profile}")
        with phase("gpu_free"):
            left_pids = await gpumem.wait_released(pids, lane.switch_timeouts.gpu_free)
            if left_pids:
                report.notes.append(f"GPU memory of pids {left_pids} not released within "
                                    f"{lane.switch_timeouts.gpu_free:.0f}s")
        report.restarted = [e.name for e in dep.plan.in_start_order()]
        with phase("start"):
            lane._adopt(dep)
            sup = lane._launch(dep, fail_fast=True)
            started_new = True
            await lane._ready(sup, dep.timeouts.load + dep.timeouts.peer
                              + lane.switch_timeouts.gate_extra)
        if saved:
            with phase("restore_slots"):
                await keepslots.restore(lane, old, dep, saved, report)
        with phase("release"):
            lane.last_good = dep
            lane.switching = None
            lane._to(LaneState.SERVING)
            lane.loaded_at = lane.clock()
            lane.sync_gate()
        report.result = Result.OK
    except (LayoutFailed, HydraError, OSError) as exc:
        report.failed_phase = phase.current
        report.error = str(exc)
        report.log_tail = getattr(exc, "tail", [])
        log.error("switch to %s failed in phase %s: %s", dep.profile, phase.current, exc)
        await _rollback(lane, old, report, phase, started_new)
    except asyncio.CancelledError:
        # hydra is stopping mid-switch: whatever runs is stopped by the caller's shutdown.
        report.result = Result.FAILED
        report.error = "hydra stopped during the switch"
        raise
    finally:
        _finish(lane, report, phase)
    return report


async def apply(lane: Lane, dep: Deployment) -> SwitchReport:
    """Run `dep` in place of the running layout, restarting only what changes (plandiff):
    nothing (a no-op), the head alone (its peers keep running), or everything (a switch).
    A different external address is refused."""
    _check_free(lane)
    dep = lane.own(dep)
    cur, sup = lane.dep, lane.sup
    if sup is None:
        return await lane.switch(dep)
    d = plandiff.diff(cur.plan, dep.plan)
    if d.change is plandiff.Change.REFUSED:
        raise HydraError(d.reason)
    if d.change is plandiff.Change.NONE and cur.policy == dep.policy \
            and cur.timeouts == dep.timeouts:
        rep = SwitchReport(to=dep.profile, frm=cur.profile, result=Result.NOOP)
        rep.notes.append("nothing changes")
        return rep
    if d.change is not plandiff.Change.HEAD:
        rep = await lane.switch(dep)
        rep.restarted = list(d.restart)
        return rep
    async with lane.lock:
        return await _restart_head(lane, cur, dep, sup, d.restart)


async def _restart_head(lane: Lane, old: Deployment, dep: Deployment, sup: Runner,
                        names: tuple[str, ...]) -> SwitchReport:
    report = SwitchReport(to=dep.profile, frm=old.profile, restarted=list(names))
    phase = Phases(report)
    lane.switching = dep.profile
    lane._to(LaneState.SWITCHING)
    r = lane.route
    try:
        with phase("hold"):
            r.hold(f"restarting the head of {dep.profile} with new settings")
        with phase("drain"):
            await _drain(lane, report, dep.profile)
        saved = await keepslots.save(lane, old)
        with phase("restart_head"):
            sup.adopt_head(dep)
            lane._adopt(dep)
            # fail fast: the first failed start of the new head ends the change (no
            # backoff), and the supervisor waits for the rollback below
            await sup.restart(names[0], fail_fast=True)
            await lane._ready(sup, dep.timeouts.load)
        await keepslots.restore(lane, old, dep, saved, report)
        lane.last_good = dep
        report.result = Result.OK
    except (LayoutFailed, HydraError, OSError, Fatal) as exc:
        report.failed_phase = phase.current
        report.error = str(exc)
        report.log_tail = getattr(exc, "tail", []) or _tail_of(sup, names[0])
        log.error("restart of %s with new settings failed in phase %s: %s",
                  dep.profile, phase.current, exc)
        try:
            with phase("rollback"):
                sup.adopt_head(old)
                lane._adopt(old)
                await sup.restart(names[0], fail_fast=True)
                await lane._ready(sup, old.timeouts.load)
                report.result = Result.ROLLED_BACK
        except (LayoutFailed, HydraError, OSError, Fatal) as exc2:
            # the old head did not come back in place: the last good layout afresh
            log.error("the old head of %s did not come back in place (%s); starting "
                      "the last good layout again", old.profile, exc2)
            await _rollback(lane, old, report, phase, started_new=True)
    finally:
        if lane.phase is LaneState.SWITCHING:
            lane._to(LaneState.SERVING)
        _finish(lane, report, phase)
        lane.sync_gate()
    return report


def _tail_of(sup: Runner, name: str) -> list[str]:
    mp = next((p for p in sup.procs if p.name == name), None)
    return mp.log_tail() if mp is not None else []


async def _drain(lane: Lane, report: SwitchReport, target: str) -> None:
    r = lane.route
    left = await asyncio.to_thread(r.wait_idle, lane.switch_timeouts.drain)
    if left:
        # Those without a response byte are sent again to the new layout once it serves
        # (held meanwhile, as after a crash); only partial responses are cut.
        report.cut = r.cut_inflight(f"cut by the switch to {target} after "
                                    f"{lane.switch_timeouts.drain:.0f}s of draining",
                                    requeue=True)
        resent = max(0, left - report.cut)
        report.notes.append(f"{left} requests still in flight after the "
                            f"{lane.switch_timeouts.drain:.0f}s drain: {report.cut} cut "
                            f"(partly answered), {resent} without a response byte sent "
                            "again to the new layout")


async def _rollback(lane: Lane, old: Deployment | None, report: SwitchReport, phase: Phases,
                    started_new: bool) -> None:
    with phase("rollback"):
        if started_new:
            await lane._stop_current(f"switch to {report.to} failed")
        back = lane.last_good or old
        if back is None:
            report.result = Result.FAILED
            lane.switching = None
            lane.error = report.error
            lane.failed_at = lane.clock()
            lane._to(LaneState.FAILED)
            lane.route.set_unavailable(f"profile {report.to} failed: {report.error}",
                                       retry_after=30)
            lane.route.release()
            return
        try:
            lane._adopt(back)
            sup = lane._launch(back)
            await lane._ready(sup, back.timeouts.load + back.timeouts.peer)
            report.result = Result.ROLLED_BACK
        except LayoutFailed as exc:
            report.result = Result.FAILED
            report.error = f"{report.error}; the rollback to {back.profile} failed too: {exc}"
        lane.switching = None
        if lane.phase is LaneState.SWITCHING:
            lane._to(LaneState.SERVING)
        lane.sync_gate()


def _finish(lane: Lane, report: SwitchReport, phase: Phases) -> None:
    """A change is over (whatever its result): record and announce it."""
    lane.switching = None
    if lane.phase is LaneState.SWITCHING:
        lane._to(LaneState.SERVING if lane.sup is not None else LaneState.FAILED)
    phase.done()
    lane.record(report)


# -- restart one process -------------------------------------------------------------------

async def restart(lane: Lane, name: str) -> SwitchReport:
    """`hydra restart NAME`: the report says what restarted (`restarted`), how long until
    it was ready again (`total_s`) and what keep_slots restored (`notes`); a restart that
    fails raises RestartFailed after the rollback (its message says what serves now)."""
    sup = lane.sup
    if sup is None:
        raise HydraError(f"profile {lane.name} is not running: nothing to restart")
    names = [p.name for p in sup.procs]
    if name not in names:
        raise HydraError(f"no engine '{name}' in profile {sup.plan.profile}; "
                         f"engines: {', '.join(names)}")
    if lane.lock.locked():
        raise Busy(f"a switch is running on port {lane.port.port}; try again after it")
    async with lane.lock:
        t0 = time.monotonic()
        dep = lane.dep
        saved = await keepslots.save(lane, dep)
        try:
            await sup.restart(name, fail_fast=True)
            await lane._ready(sup, sup.timeouts.load + sup.timeouts.peer)
        except (LayoutFailed, Fatal) as exc:
            raise RestartFailed(await _restart_failed(lane, name, sup, dep, exc)) from exc
        rep = SwitchReport(to=sup.plan.profile, frm=sup.plan.profile, result=Result.OK,
                           restarted=[name])
        await keepslots.restore(lane, dep, dep, saved, rep)
        rep.total_s = time.monotonic() - t0
        return rep


async def _restart_failed(lane: Lane, name: str, sup: Runner, dep: Deployment,
                          exc: Exception) -> str:
    """`hydra restart NAME` failed its first start: no backoff; the last good layout is
    started again from scratch (the switch's rollback). Returns the error to reply."""
    rep = SwitchReport(to=sup.plan.profile, frm=sup.plan.profile, error=str(exc),
                       failed_phase="restart")
    rep.log_tail = getattr(exc, "tail", []) or _tail_of(sup, name)
    phase = Phases(rep)
    lane.switching = sup.plan.profile
    lane._to(LaneState.SWITCHING)
    log.error("restart of %s failed: %s", name, exc)
    try:
        await _rollback(lane, dep, rep, phase, started_new=True)
    finally:
        _finish(lane, rep, phase)
    if rep.result == Result.ROLLED_BACK:
        return (f"restart of {name} failed: {exc}; the last good layout was started "
                "again and serves")
    return f"restart of {name} failed: {rep.error}"
