"""The control API's routes (`STATE/control.sock`, served by control.py; the dashboard's actions
use the same handlers) and the actions behind them: switch, restart, reload (one at a time,
those asked for meanwhile coalesced: `Reloads`) and what a reload cannot apply (`not_applied`).
Free functions of the Daemon: its `switch`, `restart`, `reload`, `routes` and `_check_servable`
call them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any

from hydra_supervisor.config.config import (
    Profile,
    find_node_file,
    find_profile,
    load_node,
    load_profile,
)
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import deployment
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.runtime import control
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import Busy, RestartFailed, Result

if TYPE_CHECKING:
    from hydra_supervisor.runtime.daemon import Daemon

log = logging.getLogger("hydra")


# -- control routes -----------------------------------------------------------------------------

def routes(d: Daemon) -> dict[tuple[str, str], control.Handler]:
    return {("GET", "/status"): partial(_r_status, d),
            ("POST", "/switch"): partial(_r_switch, d),
            ("POST", "/restart"): partial(_r_restart, d),
            ("POST", "/reload"): partial(_r_reload, d),
            ("POST", "/down"): partial(_r_down, d)}


async def _r_status(d: Daemon, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    snap = d.snapshot()
    return 200, {"running": True, "supervisor": d.state.running_supervisor(),
                 "status": d.legacy_status(snap), "daemon": snap}


async def _guard(coro: Coroutine[Any, Any, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    try:
        return 200, await coro
    except Busy as exc:
        return 409, {"error": str(exc)}
    except RestartFailed as exc:  # not bad input: it failed (exit 1), hydra serves on
        return 500, {"error": str(exc)}
    except HydraError as exc:
        return 400, {"error": str(exc)}


async def _r_switch(d: Daemon, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    name = body.get("profile")
    if not isinstance(name, str) or not name:
        return 400, {"error": "switch needs a profile name"}
    return await _guard(d.switch(name, body.get("profiles_dir")))


async def _r_restart(d: Daemon, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return await _guard(d.restart(str(body.get("engine", ""))))


async def restart(d: Daemon, name: str) -> dict[str, Any]:
    """`hydra restart NAME`: the lane running that process restarts it; the reply is its
    report, with the process, its profile and the seconds until it was ready again."""
    lanes = d.lanes()
    lane = next((lane for lane in lanes if name in lane.process_names()), None)
    if lane is None and len(lanes) == 1:
        lane = lanes[0]  # it names its processes in its error (or says it is not running)
    if lane is None:
        running = [n for lane in lanes for n in lane.process_names()]
        if not running:
            raise HydraError("no profile is running on this hydra: nothing to restart")
        raise HydraError(f"no running process '{name}'; running: {', '.join(running)}")
    report = await lane.restart(name)
    return {**report.to_json(), "engine": name, "profile": report.to,
            "seconds": round(report.total_s, 3)}


async def _r_reload(d: Daemon, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return await _guard(d.reload())


async def _r_down(d: Daemon, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    d.request_stop("hydra down")
    return 200, {"stopping": True, "pid": os.getpid()}


# -- actions ------------------------------------------------------------------------------------

def prepare(d: Daemon, profile: str, profiles_dir: str | None,
            name: str | None = None) -> Deployment:
    """Validate and plan on the single port's own address; ports of the running layout
    kept. `name`: the profile keeps this name whatever its file says now (a reload)."""
    port = d.single
    assert port is not None
    lane = port.only()
    running = lane.running_plan if lane is not None else None
    keep_name = {"profile": name} if name else {}
    return deployment.prepare(
        profile, node_file=d.opts.node_file,
        profiles_dir=profiles_dir or d.opts.profiles_dir,
        overrides={"host": port.host, "port": port.port, **keep_name}, keep=running,
        external=port.port, slot_dir=d.state.slots())


async def switch(d: Daemon, profile: str, profiles_dir: str | None = None) -> dict[str, Any]:
    port = d.single
    if port is None:
        report = await d.node.activate(lane_named(d, profile))
        done = report.to_json()
        if report.result != Result.NOOP:
            d.switch_log = [*d.switch_log[-19:], {**done, "at": time.time()}]
        return done
    if port.standby is not None and port.standby.ready_for(profile):
        report = await port.standby.flip()  # instant: nothing to plan, nothing restarts
        d.opts.profile = report.to
        return report.to_json()
    lane = port.only()
    if lane is not None and lane.busy:
        raise Busy(f"a switch is already running (to {lane.switching}); "
                   "try again when it is done")
    t0 = time.monotonic()
    # Planning reads files and probes ports: off the loop, so status stays live.
    dep = await asyncio.to_thread(prepare, d, profile, profiles_dir)
    plan_s = time.monotonic() - t0
    check_servable(port, dep)
    report = await port.switch_to(dep)
    report.phases = {"plan": plan_s, **report.phases}
    report.total_s += plan_s
    d.opts.profile = profile if report.result == Result.OK else d.opts.profile
    return report.to_json()


def check_servable(port: Port, dep: Deployment) -> None:
    """Refuse, before anything stops, a layout this port cannot run: a `router: false`
    profile (its llama-server would bind the port the router holds), or a profile with a
    router on a port whose llama-server binds it itself."""
    if port.use_router and dep.plan.router is None:
        raise HydraError(
            f"profile {dep.profile} has `router: false` (llama-server binds the external "
            f"port itself), but this hydra's router holds port {port.port}: it cannot be "
            "switched to, reloaded into or served beside other profiles; remove "
            f"`router: false`, or stop hydra and start it with `hydra up -p {dep.profile}`")
    if not port.use_router and dep.plan.router is not None:
        raise HydraError("this hydra was started with `router: false` (llama-server binds "
                         "the external port itself); switching to a profile with a router "
                         "needs a restart of hydra")


class Reloads:
    """Reloads: one runs at a time; those asked for meanwhile share one run after it (it reads
    the files when it starts: the last edit wins). `run`: one reload (`run_reload`)."""

    def __init__(self, run: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self._run = run
        self._last: asyncio.Task[dict[str, Any]] | None = None
        self._next: asyncio.Task[dict[str, Any]] | None = None

    async def ask(self) -> dict[str, Any]:
        """Re-read the running profile and apply the difference as a switch (none: no-op).
        Asked for while one runs: it runs once after it, for every caller who asked
        meanwhile (they all get its reply)."""
        nxt = self._next
        if nxt is not None and not nxt.done():
            return await asyncio.shield(nxt)  # coalesced: it has not read the files yet
        before = self._last if self._last is not None \
            and not self._last.done() else None
        task = asyncio.ensure_future(self._after(before))
        self._last = task
        if before is not None:
            self._next = task
            log.info("reload: one is running; this one runs after it")
        return await asyncio.shield(task)

    async def _after(self, before: asyncio.Task[dict[str, Any]] | None) -> dict[str, Any]:
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        if self._next is asyncio.current_task():
            self._next = None  # reads the files from now on: later edits need a new run
        return await self._run()


async def run_reload(d: Daemon) -> dict[str, Any]:
    """One reload (`d._reload_once`), and what it leaves on the status line."""
    try:
        res = await d._reload_once()
    except HydraError as exc:
        d.last_change_error = f"reload: {exc}"
        d._changed()
        raise
    d.last_change_error = None  # planned: a failed start is in the lane's report
    d._changed()
    return res


async def reload_once(d: Daemon) -> dict[str, Any]:
    port = d.single
    if port is None:
        return await reload_lanes(d)
    lane = port.only()
    if lane is None or not lane.running:
        return {"result": "noop", "reason": "no profile is loaded"}
    ref = lane.dep.plan.source
    name = lane.name
    new = await asyncio.to_thread(prepare, d, ref, None, name)  # the name stays
    skipped = await asyncio.to_thread(not_applied, d, ref, name, port.host, port.port)
    check_servable(port, new)
    report = await lane.apply(new)
    if skipped:
        log.warning("reload of %s: not applied: %s", name, "; ".join(skipped))
    if report.result == Result.NOOP:
        log.info("reload: %s is unchanged; nothing to do", ref)
        return {"to": new.profile, "result": "noop", "not_applied": skipped,
                "reason": "nothing it can apply changed" if skipped
                else "profile unchanged", "notes": [f"not applied: {k}" for k in skipped]}
    out = report.to_json()
    out["not_applied"] = skipped
    out["notes"] = [*out.get("notes", []), *(f"not applied: {k}" for k in skipped)]
    return out


def not_applied(d: Daemon, ref: str, name: str, host: str, port: int) -> list[str]:
    """Keys of the re-read profile a running hydra cannot apply: its name and its
    external address (host, port) stay as they are; each is named with what it says."""
    try:
        prof: Profile = load_profile(find_profile(ref, d.opts.profiles_dir),
                                     load_node(find_node_file(d.opts.node_file)),
                                     d.opts.overrides)
    except HydraError:
        return []  # the plan above read it; a race with an edit is not worth a failure
    out = []
    if prof.name != name:
        out.append(f"profile: the file now names it {prof.name!r}; it keeps running as "
                   f"{name!r} (a running profile's name is fixed: restart hydra or "
                   f"`hydra switch {ref}` to take the new name)")
    if prof.port not in (0, port):
        out.append(f"port: the file says {prof.port}; hydra keeps serving on {port} (a "
                   "running hydra's external address never changes: restart hydra to "
                   "move it)")
    if prof.host != host:
        out.append(f"host: the file says {prof.host}; hydra keeps {host} (restart hydra "
                   "to move it)")
    return out


async def reload_lanes(d: Daemon) -> dict[str, Any]:
    """Re-read every profile of the ports that route by model; a serving lane whose plan
    changed restarts what changed (plandiff), a stopped one uses the new plan at its next
    load."""
    done: dict[str, str] = {}
    errors: list[str] = []
    skipped: list[str] = []
    for p in d.by_model:
        for lane in list(p.lanes.values()):
            skip = await asyncio.to_thread(not_applied, d, lane.dep.plan.source,
                                           lane.name, p.host, p.port)
            skipped += [f"{lane.name}: {k}" for k in skip]
            try:
                new = await asyncio.to_thread(prepare_lane, d, p, lane)
                if new is not None:
                    done[lane.name] = await p.replace(lane, new)
            except HydraError as exc:  # one profile's failure leaves the others' reload
                done[lane.name] = f"failed, rolled back: {exc}"
                errors.append(f"{lane.name}: {exc}")
    if skipped:
        log.warning("reload: not applied: %s", "; ".join(skipped))
    if not done:
        return {"result": "noop", "not_applied": skipped,
                "reason": "nothing it can apply changed" if skipped
                else "profiles unchanged"}
    log.info("reload: %s", "; ".join(f"{k}: {v}" for k, v in done.items()))
    return {"result": "rolled_back" if errors else "ok", "reloaded": done,
            "error": "; ".join(errors) or None, "not_applied": skipped}


def prepare_lane(d: Daemon, p: Port, lane: Lane) -> tuple[Profile, Deployment] | None:
    dep = deployment.prepare(lane.dep.plan.source, node_file=d.opts.node_file,
                             profiles_dir=d.opts.profiles_dir,
                             overrides={"host": p.host, "port": p.port,
                                        "profile": lane.name},  # its name is fixed
                             keep=lane.dep.plan, external=p.port,
                             slot_dir=d.state.slots(),
                             reserved=d.node.planned_ports(but=lane))
    prof = dep.layout.profile if dep.layout is not None else lane.profile
    if prof is None:
        return None
    return (prof, dep) if p.differs(lane, prof, dep) else None


def lane_named(d: Daemon, profile: str) -> Lane:
    for p in d.by_model:
        if profile in p.lanes:
            return p.lanes[profile]
    served = ", ".join(lane.name for lane in d.lanes())
    raise HydraError(f"profile {profile} is not served by this hydra (it serves {served}); "
                     "the set of profiles is fixed at `hydra up -p A -p B ...`")

