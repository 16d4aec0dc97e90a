"""The running hydra: one per state dir. Lock, signals, control socket, the Engine, exit codes.

`hydra up` builds a Daemon and runs it; everything a running hydra does is reached through it:
- the state-dir lock (a second hydra in the same state dir is refused and told who holds it);
- signals, whose handlers only enqueue: TERM/INT stop (a second INT stops at once), HUP reloads;
- the control API (control.py) on `STATE/control.sock`, served from memory;
- the Engine that owns the external port, and status.json as the crash record.

Exit codes (docs/supervision.md): 0 stopped on request; 1 the running layout went FATAL (its
reason is in status.json and hydra.log); 2 bad input before anything started.

Every external port is watched on the loop (portwatch.py): a router whose acceptor is not
running makes the port's state "port down" (status, STATUS=, metrics; `hydra status` exits 1)
and is stopped and started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hydra_supervisor import control, control_client, deployment, exits, metrics, notify, portwatch
from hydra_supervisor.config import (
    Profile,
    find_node_file,
    find_profile,
    known_profiles,
    load_node,
    load_profile,
)
from hydra_supervisor.dashboard import Dashboard, Publisher
from hydra_supervisor.deployment import Deployment
from hydra_supervisor.engine import Engine, EngineBusy, RestartFailed, SwitchTimeouts
from hydra_supervisor.engine_wire import EngineWire
from hydra_supervisor.errors import HydraError
from hydra_supervisor.fleet import Fleet
from hydra_supervisor.state import StateDir

log = logging.getLogger("hydra")

EXIT_OK = exits.OK
EXIT_FATAL = exits.FAILED
EXIT_BAD_INPUT = exits.BAD_INPUT
EXIT_NOT_RUNNING = exits.NOT_RUNNING  # for the client commands (status, switch...)
EXIT_PORT_DOWN = exits.PORT_DOWN  # `hydra status`: a port's router accepts no connections
EXIT_INTERRUPTED = exits.INTERRUPTED

Presenter = Callable[['Daemon'], Coroutine[Any, Any, None]]


def socket_path(state: StateDir) -> Path:
    return control_client.socket_path(state.root)


def slot_dir(state: StateDir) -> Path:
    """Where heads save KV slots (--slot-save-path): the wire protocol's STATE_* ops."""
    path = state.root / "slots"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Options:
    """What `hydra up` was asked for; a reload re-reads the same profile with the same options."""

    profile: str | None
    node_file: str | None = None
    profiles_dir: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8080
    switch_timeouts: SwitchTimeouts = field(default_factory=SwitchTimeouts)
    metrics_port: int | None = None  # Prometheus on 127.0.0.1:PORT (None or 0: off)
    profiles: list[str] = field(default_factory=list)  # several: served by model (fleet.py)


class Daemon:
    def __init__(self, state: StateDir, opts: Options, initial: Deployment | None,
                 fleets: list[Fleet] | None = None) -> None:
        """`fleets`: a node serving several profiles (each port a Fleet routed by model);
        otherwise the one Engine runs `initial` (or nothing: a model-less start)."""
        self.state = state
        self.opts = opts
        self.initial = initial
        self.fleets = fleets or []
        plan = initial.plan if initial else None
        host = plan.host if plan else opts.host
        port = plan.port if plan else opts.port
        use_router = plan is None or plan.router is not None
        self.notifier = notify.Notifier.from_env()
        # The dashboard (dashboard/) beside /metrics: it reads the snapshot published below.
        # Threads (metrics scrapes, the page) read snapshots taken on the loop, never the
        # loop's live objects: a scrape that walked an Engine while the loop appended a
        # switch report failed with "deque mutated during iteration".
        self.publisher = Publisher(self.snapshot)
        self.dashboard = (Dashboard(self.publisher,
                                    profiles=lambda: list(known_profiles(opts.profiles_dir)))
                          if opts.metrics_port else None)
        self.metrics = (metrics.MetricsServer("127.0.0.1", opts.metrics_port,
                                              snapshot=self._published,
                                              wrap=self.dashboard.wrap if self.dashboard
                                              else None)
                        if opts.metrics_port else None)
        router_kwargs = {"on_request": self._on_request} if self.metrics else {}
        for f in self.fleets:
            f.router_kwargs.update(router_kwargs)
            f.listeners.append(self._changed)
        self.engine = Engine(state, host, port, use_router=use_router and not self.fleets,
                             allow=tuple(plan.router.allow) if plan and plan.router
                             else ("127.0.0.0/8", "::1/128"),
                             profiles=lambda: list(known_profiles(opts.profiles_dir)),
                             switch_timeouts=opts.switch_timeouts,
                             router_kwargs=router_kwargs)
        self.stop_event = asyncio.Event()
        self.stop_reason = "stop requested"
        self.ended: str | None = None  # why the run ended, once it has (the crash record)
        self.started = time.time()
        self.ctl: control.ControlServer | None = None
        self.wire: EngineWire | None = None
        self._ints = 0
        # The last switches between a port's profiles (fleet.activate's reports, newest last):
        # the snapshot carries them for the dashboard (an Engine keeps its own).
        self.switch_log: list[dict[str, Any]] = []
        # Reloads: one runs at a time; those asked for meanwhile share one run after it
        # (it reads the files when it starts: the last edit wins).
        self._reload_last: asyncio.Task[dict[str, Any]] | None = None
        self._reload_next: asyncio.Task[dict[str, Any]] | None = None
        self.last_change_error: str | None = None  # a reload refused before it ran (STATUS=)
        self.engine.listeners.append(self._changed)

    # -- status ---------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        if self.fleets:
            return {"pid": os.getpid(), "started": self.started,
                    "state_dir": str(self.state.root),
                    "engines": [row for f in self.fleets for row in f.snapshot()],
                    "fleets": [{"port": f.port, "url": f.url, "default": f.default,
                                "profiles": list(f.members), "alive": f.alive(),
                                "down": f.down()} for f in self.fleets],
                    "switches": list(self.switch_log)}
        return {"pid": os.getpid(), "started": self.started, "state_dir": str(self.state.root),
                "engines": [self.engine.snapshot()]}

    @property
    def unkillable(self) -> list[str]:
        return [*self.engine.unkillable, *(u for f in self.fleets for u in f.unkillable)]

    def legacy_status(self, snap: dict[str, Any]) -> dict[str, Any]:
        """The single-engine view (`status` in `hydra status --json`, and status.json), from
        the snapshot just taken."""
        if self.fleets:
            return self._fleet_status(snap)
        e = snap["engines"][0]
        return {"pid": os.getpid(), "profile": e["profile"], "source": e["source"],
                "mode": e["mode"], "model": e["model"], "url": e["url"], "state": e["state"],
                "down": e["down"],
                "fatal": e["fatal"], "degraded": e["degraded"], "updated": time.time(),
                "stopped": self.ended,
                "unkillable": list(self.unkillable), "engines": e["processes"]}

    def _fleet_status(self, snap: dict[str, Any]) -> dict[str, Any]:
        """status.json of a node serving several profiles: every profile's processes."""
        rows = snap["engines"]
        states = {r["profile"]: r["state"] for r in rows}
        running = [n for n, st in states.items() if st == "running"]
        down = [d for f in snap["fleets"] if (d := f["down"])]
        return {"pid": os.getpid(), "profile": ",".join(states), "source": "-",
                "mode": "profiles", "model": None,
                "url": ", ".join(f.url for f in self.fleets),
                "state": "port down" if down else "serving" if running else "idle",
                "down": "; ".join(down) or None, "fatal": None, "degraded": None,
                "updated": time.time(), "stopped": self.ended, "profiles": states,
                "unkillable": list(self.unkillable),
                "engines": [p for r in rows for p in r["processes"]]}

    def _fleet_of(self, profile: str) -> Fleet:
        for f in self.fleets:
            if profile in f.members:
                return f
        served = ", ".join(n for f in self.fleets for n in f.members)
        raise HydraError(f"profile {profile} is not served by this hydra (it serves {served}); "
                         "the set of profiles is fixed at `hydra up -p A -p B ...`")

    def _published(self) -> dict[str, Any]:
        """A snapshot for another thread: taken on the loop (fresh within 0.5 s)."""
        snap, _ = self.publisher.get(max_age=0.5)
        if snap is None:
            raise RuntimeError("no status snapshot yet (hydra is starting)")
        return snap

    def _changed(self) -> None:
        snap = self.snapshot()  # one snapshot (processes, NVML) for both records
        self.publisher.put(snap)
        with contextlib.suppress(OSError):
            self.state.write_status(self.legacy_status(snap))
        self.notifier.status(self._status_line(snap))

    def _status_line(self, snap: dict[str, Any]) -> str:
        """systemd's STATUS=: the snapshot, and the last change that failed (until one works)."""
        text = notify.status_text(snap)
        why = self.last_change_error or self._change_failed()
        if why:
            text = f"{text}; last change failed: {why}"
        return text

    def _change_failed(self) -> str | None:
        """The error of an engine's last change (switch, reload, CONFIGURE, restart) when it
        failed; a later change that works clears it."""
        engines = [self.engine, *(m.engine for f in self.fleets for m in f.members.values())]
        for eng in engines:
            rep = eng.switches[-1] if eng.switches else None
            if rep is not None and rep.result in ("rolled_back", "failed"):
                return f"{rep.to}: {rep.error}"
        return None

    def _on_request(self, rec: dict[str, Any]) -> None:
        """The router's per-request record (a router thread): counted in the metrics."""
        if self.metrics is None:
            return
        # Labelled by what served it, as the router saw it (its port, its route), never by
        # a guess from the request's model.
        port = int(rec.get("port") or 0)
        if self.fleets:
            profile = rec.get("route") or ""  # "": answered by the router itself (404, …)
            self.metrics.observe_request(
                rec, f"port-{port}/{profile}" if profile else f"port-{port}", profile)
            return
        dep = self.engine.dep
        self.metrics.observe_request(rec, f"port-{port or self.engine.port}",
                                     dep.profile if dep else "")

    def _router_alive(self) -> bool:
        if self.fleets:
            return all(f.alive() for f in self.fleets)
        r = self.engine.router
        return r is None or r.alive()

    def _startup_budget(self) -> float:
        """Seconds the start-up loads may take: every initial layout's load timeout (they
        load one after another), plus a margin for the peers' HELLO and the health gate."""
        if self.fleets:
            deps = [f.members[n].dep for f in self.fleets for n in f.initial_names()
                    if n in f.members]
        else:
            deps = [self.initial] if self.initial is not None else []
        return sum(d.timeouts.load for d in deps) + 30.0 if deps else 0.0

    def _ready(self) -> bool:
        if self.fleets:
            return all(f.ready() and f.alive() for f in self.fleets)
        return self.engine.state_word() in ("serving", "idle", "degraded")

    def check_ports(self) -> bool:
        """One tick of the port watch (the loop's thread): a router that is not accepting
        connections is noticed, said (status.json, STATUS=) and restarted (portwatch.py).
        True when a port went down or came back."""
        changed = False
        for f in self.fleets:
            changed = f.check_port() or changed
        if not self.fleets:
            changed = self.engine.check_port() or changed
        if changed:
            self._changed()
        return changed

    async def _watch_ports(self) -> None:
        while not self.stop_event.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), portwatch.CHECK_S)
            if self.stop_event.is_set():
                return
            try:
                self.check_ports()
            except Exception:  # a bug here must not end the watch (nor hydra)
                log.exception("port watch failed; checking again in %.1fs", portwatch.CHECK_S)

    # -- control routes -------------------------------------------------------------------------

    def routes(self) -> dict[tuple[str, str], control.Handler]:
        return {("GET", "/status"): self._r_status, ("POST", "/switch"): self._r_switch,
                ("POST", "/restart"): self._r_restart, ("POST", "/reload"): self._r_reload,
                ("POST", "/down"): self._r_down}

    async def _r_status(self, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        snap = self.snapshot()
        return 200, {"running": True, "supervisor": self.state.running_supervisor(),
                     "status": self.legacy_status(snap), "daemon": snap}

    async def _guard(self, coro: Coroutine[Any, Any, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        try:
            return 200, await coro
        except EngineBusy as exc:
            return 409, {"error": str(exc)}
        except RestartFailed as exc:  # not bad input: it failed (exit 1), hydra serves on
            return 500, {"error": str(exc)}
        except HydraError as exc:
            return 400, {"error": str(exc)}

    async def _r_switch(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body.get("profile")
        if not isinstance(name, str) or not name:
            return 400, {"error": "switch needs a profile name"}
        return await self._guard(self.switch(name, body.get("profiles_dir")))

    async def _r_restart(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = str(body.get("engine", ""))
        if self.fleets:
            return await self._guard(self._restart_in_fleet(name))
        return await self._guard(self.engine.restart(name))

    async def _restart_in_fleet(self, name: str) -> dict[str, Any]:
        for f in self.fleets:
            for m in f.members.values():
                if m.engine.sup is not None and any(p.name == name for p in m.engine.sup.procs):
                    return await m.engine.restart(name)
        running = [p.name for f in self.fleets for m in f.members.values()
                   if m.engine.sup is not None for p in m.engine.sup.procs]
        raise HydraError(f"no running process '{name}'; running: {', '.join(running) or 'none'}")

    async def _r_reload(self, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return await self._guard(self.reload())

    async def _r_down(self, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.request_stop("hydra down")
        return 200, {"stopping": True, "pid": os.getpid()}

    # -- actions ------------------------------------------------------------------------------

    def _prepare(self, profile: str, profiles_dir: str | None,
                 name: str | None = None) -> Deployment:
        """Validate and plan on the engine's own address; ports of the running layout kept.
        `name`: the profile keeps this name whatever its file says now (a reload)."""
        eng = self.engine
        running = eng.dep.plan if eng.dep else None
        keep_name = {"profile": name} if name else {}
        return deployment.prepare(
            profile, node_file=self.opts.node_file,
            profiles_dir=profiles_dir or self.opts.profiles_dir,
            overrides={"host": eng.host, "port": eng.port, **keep_name}, keep=running,
            external=eng.port, slot_dir=slot_dir(self.state))

    async def switch(self, profile: str, profiles_dir: str | None = None) -> dict[str, Any]:
        if self.fleets:
            done = await self._fleet_of(profile).activate(profile)
            if done.get("result") != "noop":
                self.switch_log = [*self.switch_log[-19:], {**done, "at": time.time()}]
            return done
        if self.engine.lock.locked():
            raise EngineBusy(f"a switch is already running (to {self.engine.switching}); "
                             "try again when it is done")
        t0 = time.monotonic()
        # Planning reads files and probes ports: off the loop, so status stays live.
        dep = await asyncio.to_thread(self._prepare, profile, profiles_dir)
        plan_s = time.monotonic() - t0
        report = await self.engine.switch(dep)  # refuses at once what the port cannot serve
        report.phases = {"plan": plan_s, **report.phases}
        report.total_s += plan_s
        self.opts.profile = profile if report.result == "ok" else self.opts.profile
        return report.to_json()

    async def reload(self) -> dict[str, Any]:
        """Re-read the running profile and apply the difference as a switch (none: no-op).
        Asked for while one runs: it runs once after it, for every caller who asked
        meanwhile (they all get its reply)."""
        nxt = self._reload_next
        if nxt is not None and not nxt.done():
            return await asyncio.shield(nxt)  # coalesced: it has not read the files yet
        before = self._reload_last if self._reload_last is not None \
            and not self._reload_last.done() else None
        task = asyncio.ensure_future(self._reload_after(before))
        self._reload_last = task
        if before is not None:
            self._reload_next = task
            log.info("reload: one is running; this one runs after it")
        return await asyncio.shield(task)

    async def _reload_after(self, before: asyncio.Task[dict[str, Any]] | None
                            ) -> dict[str, Any]:
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        if self._reload_next is asyncio.current_task():
            self._reload_next = None  # reads the files from now on: later edits need a new run
        try:
            res = await self._reload_once()
        except HydraError as exc:
            self.last_change_error = f"reload: {exc}"
            self._changed()
            raise
        self.last_change_error = None  # planned: a failed start is in the engine's report
        self._changed()
        return res

    async def _reload_once(self) -> dict[str, Any]:
        if self.fleets:
            return await self._reload_fleets()
        eng = self.engine
        if eng.dep is None:
            return {"result": "noop", "reason": "no profile is loaded"}
        ref = eng.dep.plan.source
        name = eng.dep.profile
        new = await asyncio.to_thread(self._prepare, ref, None, name)  # the name stays
        skipped = await asyncio.to_thread(self._not_applied, ref, name, eng.host, eng.port)
        report = await eng.apply(new)
        if skipped:
            log.warning("reload of %s: not applied: %s", name, "; ".join(skipped))
        if report.result == "noop":
            log.info("reload: %s is unchanged; nothing to do", ref)
            return {"to": new.profile, "result": "noop", "not_applied": skipped,
                    "reason": "nothing it can apply changed" if skipped
                    else "profile unchanged", "notes": [f"not applied: {k}" for k in skipped]}
        out = report.to_json()
        out["not_applied"] = skipped
        out["notes"] = [*out.get("notes", []), *(f"not applied: {k}" for k in skipped)]
        return out

    def _not_applied(self, ref: str, name: str, host: str, port: int) -> list[str]:
        """Keys of the re-read profile a running hydra cannot apply: its name and its
        external address (host, port) stay as they are; each is named with what it says."""
        try:
            prof: Profile = load_profile(find_profile(ref, self.opts.profiles_dir),
                                         load_node(find_node_file(self.opts.node_file)),
                                         self.opts.overrides)
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

    async def _reload_fleets(self) -> dict[str, Any]:
        """Re-read every profile; a running one whose plan changed restarts what changed
        (plandiff), a stopped one uses the new plan at its next load."""
        done: dict[str, str] = {}
        errors: list[str] = []
        skipped: list[str] = []
        for f in self.fleets:
            for m in f.members.values():
                skip = await asyncio.to_thread(self._not_applied, m.dep.plan.source, m.name,
                                               f.host, f.port)
                skipped += [f"{m.name}: {k}" for k in skip]
                try:
                    new = await asyncio.to_thread(self._prepare_member, f, m)
                    if new is not None:
                        done[m.name] = await f.replace(m, new)
                except HydraError as exc:  # one profile's failure leaves the others' reload
                    done[m.name] = f"failed, rolled back: {exc}"
                    errors.append(f"{m.name}: {exc}")
        if skipped:
            log.warning("reload: not applied: %s", "; ".join(skipped))
        if not done:
            return {"result": "noop", "not_applied": skipped,
                    "reason": "nothing it can apply changed" if skipped
                    else "profiles unchanged"}
        log.info("reload: %s", "; ".join(f"{k}: {v}" for k, v in done.items()))
        return {"result": "rolled_back" if errors else "ok", "reloaded": done,
                "error": "; ".join(errors) or None, "not_applied": skipped}

    def _prepare_member(self, f: Fleet, m: Any) -> tuple[Any, Deployment] | None:
        dep = deployment.prepare(m.dep.plan.source, node_file=self.opts.node_file,
                                 profiles_dir=self.opts.profiles_dir,
                                 overrides={"host": f.host, "port": f.port,
                                            "profile": m.name},  # its name is fixed
                                 keep=m.dep.plan, external=f.port,
                                 slot_dir=slot_dir(self.state),
                                 reserved=f.pool.planned_ports(but=m))
        prof = dep.layout.profile if dep.layout is not None else m.profile
        return (prof, dep) if f.differs(m, prof, dep) else None

    def request_stop(self, reason: str) -> None:
        if not self.stop_event.is_set():
            self.stop_reason = reason
            log.info("stopping: %s", reason)
        self.stop_event.set()

    # -- signals ------------------------------------------------------------------------------

    def _on_int(self) -> None:
        self._ints += 1
        if self._ints >= 2:
            log.warning("second SIGINT: killing every child at once")
            if self.engine.sup is not None:
                self.engine.sup.kill_all_now()
            for f in self.fleets:
                for m in f.members.values():
                    if m.engine.sup is not None:
                        m.engine.sup.kill_all_now()
            self.request_stop("SIGINT twice: killed at once")
            return
        self.request_stop("SIGINT (Ctrl-C)")

    def _on_hup(self) -> None:
        log.info("SIGHUP: reloading the profile")

        async def go() -> None:
            self.notifier.reloading("reloading the profile")
            try:
                res = await self.reload()
                if res.get("result") in ("ok", "noop"):
                    log.info("reload: %s", res.get("result"))
                else:
                    log.error("reload failed (%s): %s", res.get("result"), res.get("error"))
            except HydraError as exc:
                log.error("reload failed: %s", exc)
            except Exception:  # a bug here must not end hydra
                log.exception("reload failed")
            finally:
                self.notifier.ready(self._status_line(self.snapshot()))

        asyncio.get_running_loop().create_task(go())

    # -- the main loop ------------------------------------------------------------------------

    async def run(self, on_start: Presenter | None = None) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self._on_int)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        self.engine.open()
        if self.initial is not None and self.engine.router is not None:
            self.initial = deployment.bound_to(self.initial, self.engine.port)
        for f in self.fleets:
            f.open()
        # The wire protocol speaks to one engine: with several profiles, the first port's
        # default profile (docs/routing.md).
        if self.fleets:
            f0 = self.fleets[0]
            self.wire = EngineWire(f0.members[f0.default].engine, loop, self.opts.node_file,
                                   apply=functools.partial(f0.apply_to, f0.default))
            f0.set_hydra_upstream(self.wire.start())
        else:
            self.wire = EngineWire(self.engine, loop, self.opts.node_file)
            if self.engine.router is not None:
                self.engine.hydra_upstream = self.wire.start()
                # reachable at once, also before (or without) a profile: INFO says what runs
                self.engine.router.set_upstreams(replace(self.engine.router.upstreams,
                                                         hydra=self.engine.hydra_upstream))
        self.ctl = control.ControlServer(socket_path(self.state), loop, self.routes())
        self.ctl.start()
        self.publisher.bind(loop)
        if self.dashboard is not None:
            self.dashboard.bind(loop, self.routes())  # actions: the control API's handlers
        if self.metrics is not None:
            self.metrics.start()
        # From the start: systemd's watchdog timer runs from the moment the process starts.
        watchdog = asyncio.create_task(
            notify.watchdog_loop(self.notifier, self._router_alive, self.stop_event))
        ports = asyncio.create_task(self._watch_ports())
        readiness: asyncio.Task[bool] | None = None
        presenter: asyncio.Task[None] | None = None
        try:
            budget = self._startup_budget()
            if budget > 0:  # under systemd: loads may outlast TimeoutStartSec
                self.notifier.extend_timeout(budget)
            if self.fleets:
                for f in self.fleets:
                    await f.start(f.initial_names())
            else:
                await self.engine.start(self.initial)
            self._changed()
            readiness = asyncio.create_task(notify.ready_when(
                self.notifier, self._ready, lambda: notify.status_text(self.snapshot()),
                self.stop_event))
            if on_start is not None:
                presenter = asyncio.create_task(on_start(self))
            code = await self._wait()
        finally:
            self.notifier.stopping(f"stopping: {self.stop_reason}")
            for task in (presenter, readiness, watchdog, ports):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (presenter, readiness, watchdog, ports)
                                   if t is not None), return_exceptions=True)
            if self.metrics is not None:
                self.metrics.stop()
            await self.engine.shutdown(self.stop_reason)
            await asyncio.gather(*(f.shutdown(self.stop_reason) for f in self.fleets))
            self.ended = self.stop_reason
            self._changed()
            self.ctl.stop()
            self.wire.stop()
            self.engine.close()
            for f in self.fleets:
                f.close()
            log.warning("stopped: %s", self.stop_reason)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        # Decided after the stop: a second Ctrl-C may arrive while the first one's stop runs.
        return EXIT_INTERRUPTED if self._ints > 1 else code

    async def _wait(self) -> int:
        """Until a stop is asked for, or the running layout goes FATAL (exit 1)."""
        if self.fleets:  # a profile that fails is marked failed; the others keep serving
            await self.stop_event.wait()
            return EXIT_OK
        while not self.stop_event.is_set():
            task = self.engine.task
            waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.stop_event.wait())]
            if task is not None:
                waits.append(asyncio.ensure_future(asyncio.shield(task)))
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for p in pending:
                p.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if self.stop_event.is_set():
                break
            sup = self.engine.sup
            if task is self.engine.task and not self.engine.lock.locked():
                if sup is not None and sup.fatal:
                    self.stop_reason = f"FATAL: {sup.fatal}"
                    return EXIT_FATAL
                if sup is not None and sup.stopping.is_set():
                    break
            await asyncio.sleep(0.05)  # a switch replaced the task: wait on the new one
        return EXIT_OK

