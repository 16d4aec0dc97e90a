"""What a running hydra changes on request: `hydra switch`, `hydra restart`, `hydra reload`
(one at a time, those asked for meanwhile coalesced: `Reloads`), and what a reload cannot apply
(`not_applied`). The Daemon owns an `Actions` and routes the control API's calls to it; the
dashboard's buttons use the same handlers.

One way for every port, whatever how many lanes it has:
- switch NAME: a lane of this hydra (or a port's loaded standby) by that name or file: no-op
  when it serves, a flip when it is the standby, else Port.switch (Node.activate: the lanes
  sharing its devices stop, it loads, a failure brings them back). A profile no lane serves:
  the port it is for (the only port, or the one whose address the profile names) re-points
  its default lane to it (Lane.switch: hold, drain, stop, start, gate, release, rollback).
- reload: every lane re-reads its profile (its name and address fixed): a serving lane
  restarts what changed (plandiff), a stopped one takes the new plan for its next load.
- restart NAME: the lane running that process (`demo.head`, or `head` when one lane has it;
  with a standby pair, the serving layout's, said in the reply): hold, drain, restart, release.
- load NAME: a lane of this hydra loads beside what serves, stopping only what does not fit
  (Port.load → Node.load: as a load on request); the port's standby profile loads beside its
  active lane (Port.load_standby).
- unload NAME / all: a lane drains (bounded), what is left is cut, it stops (Port.unload); it
  stays routable: the next request for it loads it again (on_demand: false ones wait for
  `hydra load`). A standby goes with its active lane.
Every reply carries `message` (runtime/messages.py). Planning runs in a thread (it reads files
and probes ports), handed plain values only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from hydra_supervisor.plan.plan import Address, Plan
from hydra_supervisor.runtime.messages import with_message
from hydra_supervisor.serve.events import Event, Kind, Sink
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import Busy, Result, SwitchReport, UnloadReport

log = logging.getLogger("hydra")
Reply = dict[str, Any]


@dataclass(frozen=True)
class Planning:
    """The plain values a re-plan needs (never the Daemon or a Lane)."""

    node_file: str | None
    profiles_dir: str | None
    overrides: tuple[tuple[str, Any], ...]
    slot_dir: Path


def plan_on(p: Planning, ref: str, *, external: Address, keep: Plan | None,
            name: str | None = None, profiles_dir: str | None = None,
            reserved: frozenset[int] = frozenset()) -> Deployment:
    """Validate and plan `ref` for a port's own address (`external`, a value: no process is
    given its port), the running plan's ports kept. `name`: the profile keeps this name
    whatever its file says now (a reload)."""
    keep_name = {"profile": name} if name else {}
    return deployment.prepare(
        ref, node_file=p.node_file, profiles_dir=profiles_dir or p.profiles_dir,
        overrides={**dict(p.overrides), **keep_name}, keep=keep, external=external,
        slot_dir=p.slot_dir, reserved=reserved)


def not_applied(p: Planning, ref: str, name: str, host: str, port: int) -> list[str]:
    """Keys of the re-read profile a running hydra cannot apply: its name and its
    external address (host, port) stay as they are; each is named with what it says."""
    try:
        prof: Profile = load_profile(find_profile(ref, p.profiles_dir),
                                     load_node(find_node_file(p.node_file)),
                                     dict(p.overrides))
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


class Actions:
    """switch, restart, reload over a hydra's ports; `changed` publishes after each."""

    def __init__(self, ports: list[Port], node: Node, planning: Planning,
                 changed: Callable[[], None], emit: Sink | None = None) -> None:
        """`emit`: where a reload's lifecycle event goes (serve/events.py)."""
        self.ports = ports
        self.node = node
        self.planning = planning
        self.changed = changed
        self.emit: Sink = emit or (lambda _: None)
        self.last_change_error: str | None = None  # a reload refused before it ran (STATUS=)
        # Reloads: one runs at a time; those asked for meanwhile share one run after it.
        self.reloads = Reloads(self.run_reload)
        self.reload_once: Callable[[], Awaitable[Reply]] = self._reload_once

    def lanes(self) -> list[Lane]:
        return [lane for p in self.ports for lane in p.every_lane()]

    # -- switch ---------------------------------------------------------------------------------

    async def switch(self, ref: str, profiles_dir: str | None = None) -> Reply:
        return with_message("switch", await self._switch(ref, profiles_dir))

    async def _switch(self, ref: str, profiles_dir: str | None = None) -> Reply:
        for p in self.ports:
            lane = p.names(ref)
            if lane is not None:
                report = await p.switch(lane)
                return report.to_json()
        port = self._port_for(ref)
        lane = port.default_lane()
        if lane is not None and lane.busy:
            raise Busy(f"a switch is already running (to {lane.switching}); "
                       "try again when it is done")
        keep = lane.running_plan if lane is not None else None
        t0 = time.monotonic()
        # Planning reads files and probes ports: off the loop, so status stays live.
        dep = await asyncio.to_thread(
            plan_on, self.planning, ref, external=port.address, keep=keep,
            profiles_dir=profiles_dir, reserved=self.node.planned_ports(but=lane))
        plan_s = time.monotonic() - t0
        check_servable(port, dep)
        served = next((x for x in self.lanes() if x.name == dep.profile), None)
        if served is not None:  # the file names a profile a lane runs under that name
            report = await next(p for p in self.ports if served in p.every_lane()).switch(
                served)
            return report.to_json()
        report = await port.switch_in(dep)
        report.phases = {"plan": plan_s, **report.phases}
        report.total_s += plan_s
        return report.to_json()

    def _port_for(self, ref: str) -> Port:
        """The port a profile no lane serves goes to: the only port, else the one whose
        address the profile names."""
        if len(self.ports) == 1:
            return self.ports[0]
        served = ", ".join(x.name for x in self.lanes())
        raise HydraError(f"profile {ref} is not served by this hydra (it serves {served}); "
                         "with several ports the set of profiles is fixed at "
                         "`hydra up -p A -p B ...`")

    # -- load and unload ----------------------------------------------------------------------

    def _named(self, ref: str) -> tuple[Port, Lane] | None:
        for p in self.ports:
            lane = p.names(ref)
            if lane is not None:
                return p, lane
        return None

    def choices(self) -> list[str]:
        """The profiles `hydra load` and `hydra unload` take: every lane, and the standby
        profile of a port's lane."""
        names = [x.name for x in self.lanes()]
        for p in self.ports:
            want = p.standby.wanted() if p.standby is not None else None
            if want is not None and want not in names:
                names.append(want)
        return names

    def _unknown(self, ref: str, verb: str) -> HydraError:
        known = ", ".join(self.choices()) or "none"
        return HydraError(
            f"no profile '{ref}' in this hydra (its profiles: {known})",
            hint=f"`hydra {verb}` takes one of those; `hydra switch {ref}` re-points the "
                 "port to a profile it does not serve" if verb == "load" else
            f"`hydra {verb}` takes one of those (`hydra status` shows what is loaded)")

    async def load(self, ref: str) -> Reply:
        """`hydra load NAME`: load it beside what serves, stopping only what does not fit
        (least recently used first, drained, never cut); a no-op when it serves."""
        found = self._named(ref)
        if found is None:
            port = next((p for p in self.ports if p.standby is not None
                         and p.standby.lane is None and p.standby.wanted() == ref), None)
            if port is None:
                raise self._unknown(ref, "load")
            report = await port.load_standby()
        else:
            port, lane = found
            report = await port.load(lane)
        self.changed()
        return with_message("load", report.to_json())

    async def unload(self, ref: str | None) -> Reply:
        """`hydra unload NAME` (None: every loaded profile): drained (bounded), then cut, then
        stopped; each stays routable (loaded again by its next request)."""
        if ref is None:
            targets = [(p, x) for p in self.ports for x in p.lanes.values()]
        else:
            found = self._named(ref)
            if found is None:
                if any(p.standby is not None and p.standby.wanted() == ref
                       for p in self.ports):
                    rep = UnloadReport(not_loaded={ref: "stopped: a standby not loaded now"})
                    return with_message("unload", rep.to_json())
                raise self._unknown(ref, "unload")
            targets = [found]
        out = UnloadReport()
        results = await asyncio.gather(*(p.unload(x, "hydra unload") for p, x in targets),
                                       return_exceptions=True)
        errors = []
        for res in results:
            if isinstance(res, UnloadReport):
                out.merge(res)
            elif isinstance(res, HydraError):
                errors.append(res)
            elif isinstance(res, BaseException):
                raise res
        self.changed()
        if errors and (ref is not None or not out.stopped):
            raise errors[0]
        out.notes += [f"not stopped: {e}" for e in errors]
        return with_message("unload", out.to_json())

    # -- restart --------------------------------------------------------------------------------

    async def restart(self, name: str) -> Reply:
        """`hydra restart NAME`: the lane running that process restarts it (held, drained,
        restarted, released: Lane.restart); the reply is its report, with the process, its
        profile and the seconds until it was ready again. A role alone (`head`) names the one
        running process of that role; where a port's active layout and its standby both have
        one, the active (serving) layout's, and the reply says so (`notes`)."""
        lanes = self.lanes()
        running = [n for x in lanes for n in x.process_names()]
        full = name
        chose: str | None = None
        if name not in running:
            short = [n for n in running if n.split(".", 1)[-1] == name]
            active = [n for x in lanes if not x.standby for n in x.process_names()
                      if n in short]
            if len(short) > 1 and len(active) == 1:
                full = active[0]
                others = [n for n in short if n != full]
                chose = (f"'{name}' is the serving layout's {full}; the standby's "
                         f"{', '.join(others)} was not touched (name it to restart it)")
            elif len(short) == 1:
                full = short[0]
            elif len(short) > 1:
                raise HydraError(f"'{name}' is ambiguous: {', '.join(short)}; name one")
        lane = next((x for x in lanes if full in x.process_names()), None)
        if lane is None and len(lanes) == 1:
            lane = lanes[0]  # it names its processes in its error (or says it is not running)
        if lane is None:
            if not running:
                raise HydraError("no profile is running on this hydra: nothing to restart")
            raise HydraError(f"no running process '{name}'; running: {', '.join(running)}")
        report = await lane.restart(full)
        if chose is not None:
            report.notes.insert(0, chose)
        return with_message("restart", {**report.to_json(), "engine": full,
                                        "profile": report.to,
                                        "seconds": round(report.total_s, 3)})

    # -- reload ---------------------------------------------------------------------------------

    async def reload(self) -> Reply:
        """Re-read every lane's profile and apply the difference (none: no-op). Asked for
        while one runs: it runs once after it, for every caller who asked meanwhile."""
        return with_message("reload", await self.reloads.ask())

    async def run_reload(self) -> Reply:
        """One reload, and what it leaves on the status line."""
        try:
            res = await self.reload_once()
        except HydraError as exc:
            self.last_change_error = f"reload: {exc}"
            self.changed()
            self.emit(Event(Kind.RELOAD_FAILED, "reload", str(exc)))
            raise
        self.last_change_error = None  # planned: a failed start is in the lane's report
        self.changed()
        done = res.get("reloaded") or {}
        what = "; ".join(f"{k}: {v}" for k, v in done.items()) if isinstance(done, dict) \
            else ""
        if res.get("result") in (Result.OK.value, Result.NOOP.value):
            self.emit(Event(Kind.RELOADED, "reload", what or str(res.get("reason") or "")))
        else:
            how = str(res.get("result")).replace("_", " ")  # "rolled back", "failed"
            self.emit(Event(Kind.RELOAD_FAILED, "reload", f"{how}: {res.get('error') or what}"))
        return res

    async def _reload_once(self) -> Reply:
        """Every lane of every port re-reads its profile: a serving lane whose plan changed
        restarts what changed (plandiff), a stopped one uses the new plan at its next load."""
        done: dict[str, str] = {}
        reports: list[SwitchReport] = []
        errors: list[str] = []
        skipped: list[str] = []
        for p in self.ports:
            for lane in list(p.lanes.values()):
                skip = await asyncio.to_thread(not_applied, self.planning,
                                               lane.dep.plan.source, lane.name, p.host, p.port)
                skipped += [f"{k} [profile {lane.name}]" for k in skip]
                try:
                    new = await asyncio.to_thread(
                        self._replan, lane.dep.plan.source, lane.name, p.address,
                        lane.dep.plan, self.node.planned_ports(but=lane))
                    check_servable(p, new)
                    prof = new.layout.profile if new.layout is not None else lane.profile
                    if prof is not None and p.differs(lane, prof, new):
                        did, rep = await p.replace(lane, (prof, new))
                        done[lane.name] = did
                        if rep is not None:
                            reports.append(rep)
                            if rep.result not in (Result.OK, Result.NOOP):
                                errors.append(rep.error or str(rep.result))
                except HydraError as exc:  # one profile's failure leaves the others' reload
                    done[lane.name] = f"failed, nothing changed: {exc}"
                    errors.append(f"{lane.name}: {exc}")
        if skipped:
            log.warning("reload: not applied: %s", "; ".join(skipped))
        notes = [f"not applied: {k}" for k in skipped]
        if not done:
            names = ", ".join(x.name for x in self.lanes() if not x.standby)
            log.info("reload: %s is unchanged; nothing to do", names or "no profile")
            return {"result": Result.NOOP.value, "reloaded": {}, "reports": [],
                    "not_applied": skipped, "notes": notes,
                    "reason": "nothing it can apply changed" if skipped
                    else "profiles unchanged"}
        log.info("reload: %s", "; ".join(f"{k}: {v}" for k, v in done.items()))
        phases: dict[str, float] = {}
        for r in reports:
            for k, v in r.phases.items():
                phases[k] = round(phases.get(k, 0.0) + v, 3)
        failed = any(r.result == Result.FAILED for r in reports)
        result = Result.FAILED if failed else Result.ROLLED_BACK if errors else Result.OK
        return {"result": result.value, "reloaded": done,
                "reports": [r.to_json() for r in reports],
                "error": "; ".join(errors) or None, "not_applied": skipped,
                "notes": [*(n for r in reports for n in r.notes), *notes],
                "phases": phases, "cut": sum(r.cut for r in reports),
                "total_s": round(sum(r.total_s for r in reports), 3),
                "log_tail": [t for r in reports if r.result not in (Result.OK, Result.NOOP)
                             for t in r.log_tail]}

    def _replan(self, ref: str, name: str, external: Address, keep: Plan,
                reserved: frozenset[int]) -> Deployment:
        return plan_on(self.planning, ref, external=external, keep=keep, name=name,
                       reserved=reserved)


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
