"""The running hydra: one per state dir. Lock, signals, control socket, its ports, exit codes.

`hydra up` builds a Daemon and runs it; everything a running hydra does is reached through it:
- the state-dir lock (a second hydra in the same state dir is refused and told who holds it);
- signals, whose handlers only enqueue: TERM/INT stop (a second INT stops at once), HUP reloads;
- the control API (control.py) on `STATE/control.sock`, served from memory;
- the ports (serve/port.py: each external address with its lanes) and the node (serve/node.py:
  the devices' room), and status.json as the crash record.

Exit codes (docs/supervision.md): 0 stopped on request; 1 the running layout went FATAL (its
reason is in status.json and hydra.log); 2 bad input before anything started.

Every external port is watched on the loop (portwatch.py): a router whose acceptor is not
running makes the port's state "port down" (status, STATUS=, metrics; `hydra status` exits 1)
and is stopped and started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra_supervisor.config.config import (
    Profile,
    find_node_file,
    find_profile,
    known_profiles,
    load_node,
    load_profile,
)
from hydra_supervisor.dashboard import Dashboard, Publisher
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import deployment
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.proc import gpumem
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.runtime import control, control_client, exits, metrics, notify
from hydra_supervisor.serve import portwatch
from hydra_supervisor.serve.engine_wire import EngineWire
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import Busy, RestartFailed, SwitchTimeouts
from hydra_supervisor.serve.snapshot import Snapshot
from hydra_supervisor.serve.standby import Standby
from hydra_supervisor.serve.states import LaneState

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
    def __init__(self, state: StateDir, opts: Options, ports: list[Port], node: Node) -> None:
        """`ports`: every external address this hydra serves (setup.build makes them): one
        port with one lane for one profile, with none for `--no-profile`, with a lane per
        profile routed by model for several."""
        self.state = state
        self.opts = opts
        self.ports = ports
        self.node = node
        self.notifier = notify.Notifier.from_env()
        # The dashboard (dashboard/) beside /metrics: it reads the snapshot published below.
        # Threads (metrics scrapes, the page) read snapshots taken on the loop, never the
        # loop's live objects: a scrape that walked a lane while the loop appended a switch
        # report failed with "deque mutated during iteration".
        self.publisher = Publisher(self.take, view=lambda s: s.to_json())
        self.dashboard = (Dashboard(self.publisher,
                                    profiles=lambda: list(known_profiles(opts.profiles_dir)))
                          if opts.metrics_port else None)
        self.metrics = (metrics.MetricsServer("127.0.0.1", opts.metrics_port,
                                              snapshot=self._published,
                                              wrap=self.dashboard.wrap if self.dashboard
                                              else None)
                        if opts.metrics_port else None)
        for p in self.ports:
            if self.metrics:
                p.router_kwargs["on_request"] = self._on_request
            p.listeners.append(self._changed)
            if not p.by_model:  # a profile's `standby:` layout (serve/standby.py)
                p.standby = Standby(p, node_file=opts.node_file, profiles_dir=opts.profiles_dir,
                                    overrides=opts.overrides, slot_dir=slot_dir(state))
        self.stop_event = asyncio.Event()
        self.stop_reason = "stop requested"
        self.ended: str | None = None  # why the run ended, once it has (the crash record)
        self.started = time.time()
        self.ctl: control.ControlServer | None = None
        self.wire: EngineWire | None = None
        self._ints = 0
        # The last switches between the profiles of a port that routes by model (the node's
        # activate reports, newest last): the snapshot carries them for the dashboard.
        self.switch_log: list[dict[str, Any]] = []
        # Reloads: one runs at a time; those asked for meanwhile share one run after it
        # (it reads the files when it starts: the last edit wins).
        self._reload_last: asyncio.Task[dict[str, Any]] | None = None
        self._reload_next: asyncio.Task[dict[str, Any]] | None = None
        self.last_change_error: str | None = None  # a reload refused before it ran (STATUS=)

    # -- what it serves ---------------------------------------------------------------------------

    @property
    def by_model(self) -> list[Port]:
        """The ports that serve several profiles, routed by model."""
        return [p for p in self.ports if p.by_model]

    @property
    def single(self) -> Port | None:
        """The port of a hydra started with one profile (or none), else None."""
        return self.ports[0] if self.ports and not self.ports[0].by_model else None

    def lanes(self) -> list[Lane]:
        """Every lane, standby layouts included (restart, kill, status)."""
        return [lane for p in self.ports
                for lane in [*p.lanes.values(), *([p.standby.lane] if p.standby is not None
                                                  and p.standby.lane is not None else [])]]

    # -- status ---------------------------------------------------------------------------------

    def take(self) -> Snapshot:
        """The status as one frozen, typed value (serve/snapshot.py), built here on the loop."""
        running = any(lane.sup is not None for lane in self.lanes())
        gpu = gpumem.used_by_pid() if running else {}  # one NVML session for every lane
        return Snapshot.build(
            pid=os.getpid(), started=self.started, state_dir=str(self.state.root),
            rows=[row for p in self.ports for row in p.snapshot(gpu)],
            by_model=[p.port_row() for p in self.by_model],
            switches=self.switch_log if self.by_model else ())

    def snapshot(self) -> dict[str, Any]:
        """A fresh snapshot as plain JSON (the loop's thread)."""
        return self.take().to_json()

    @property
    def unkillable(self) -> list[str]:
        return [u for p in self.ports for u in p.unkillable]

    def legacy_status(self, snap: dict[str, Any]) -> dict[str, Any]:
        """The one-row view (`status` in `hydra status --json`, and status.json), from the
        snapshot just taken."""
        if self.by_model:
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
        words = {r["profile"]: r["state"] for r in rows}
        serving = [n for n, st in words.items() if st in ("serving", "degraded", "recovering")]
        down = [d for f in snap["fleets"] if (d := f["down"])]
        return {"pid": os.getpid(), "profile": ",".join(words), "source": "-",
                "mode": "profiles", "model": None,
                "url": ", ".join(p.url for p in self.by_model),
                "state": "port down" if down else "serving" if serving else "idle",
                "down": "; ".join(down) or None, "fatal": None, "degraded": None,
                "updated": time.time(), "stopped": self.ended, "profiles": words,
                "unkillable": list(self.unkillable),
                "engines": [p for r in rows for p in r["processes"]]}

    def _lane_named(self, profile: str) -> Lane:
        for p in self.by_model:
            if profile in p.lanes:
                return p.lanes[profile]
        served = ", ".join(lane.name for lane in self.lanes())
        raise HydraError(f"profile {profile} is not served by this hydra (it serves {served}); "
                         "the set of profiles is fixed at `hydra up -p A -p B ...`")

    def _published(self) -> dict[str, Any]:
        """A snapshot for another thread: taken on the loop (fresh within 0.5 s)."""
        snap, _ = self.publisher.get(max_age=0.5)
        if snap is None:
            raise RuntimeError("no status snapshot yet (hydra is starting)")
        return snap

    def _changed(self) -> None:
        taken = self.take()  # one snapshot (processes, NVML) for every record
        self.publisher.put(taken)
        snap = taken.to_json()
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
        """The error of a lane's last change (switch, reload, CONFIGURE, restart) when it
        failed; a later change that works clears it."""
        records = [*(lane.switches for lane in self.lanes()),
                   *(p.reports for p in self.ports if not p.lanes)]
        for done in records:
            rep = done[-1] if done else None
            if rep is not None and rep.result in ("rolled_back", "failed"):
                return f"{rep.to}: {rep.error}"
        return None

    def _on_request(self, rec: dict[str, Any]) -> None:
        """The router's per-request record (a router thread): counted in the metrics,
        labelled by what served it as the router saw it (its port, its route)."""
        if self.metrics is None:
            return
        port = int(rec.get("port") or 0)
        route = str(rec.get("route") or "")  # "": answered by the router itself (404, …)
        if route == "none":
            route = ""
        by_model = any(p.port == port and p.by_model for p in self.ports)
        label = f"port-{port}/{route}" if by_model and route else f"port-{port}"
        self.metrics.observe_request(rec, label, route)

    def _router_alive(self) -> bool:
        return all(p.alive() for p in self.ports)

    def _startup_budget(self) -> float:
        """Seconds the start-up loads may take: every initial layout's load timeout (they
        load one after another), plus a margin for the peers' HELLO and the health gate."""
        deps = [p.lanes[n].dep for p in self.ports
                for n in (p.initial_names() if p.by_model else list(p.lanes))]
        return sum(d.timeouts.load for d in deps) + 30.0 if deps else 0.0

    def _ready(self) -> bool:
        for p in self.ports:
            if not (p.ready() and p.alive()):
                return False
            lane = p.only()
            if lane is not None and lane.state_now() not in (LaneState.SERVING,
                                                             LaneState.DEGRADED):
                return False
        return True

    def check_ports(self) -> bool:
        """One tick of the port watch (the loop's thread): a router that is not accepting
        connections is noticed, said (status.json, STATUS=) and restarted (portwatch.py).
        True when a port went down or came back."""
        changed = False
        for p in self.ports:
            changed = p.check_port() or changed
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
        except Busy as exc:
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
        return await self._guard(self.restart(str(body.get("engine", ""))))

    async def restart(self, name: str) -> dict[str, Any]:
        """`hydra restart NAME`: the lane running that process restarts it."""
        for lane in self.lanes():
            if lane.sup is not None and any(p.name == name for p in lane.sup.procs):
                return await lane.restart(name)
        single = self.single
        if single is not None and single.only() is not None:
            return await single.lanes[next(iter(single.lanes))].restart(name)  # names them
        if single is not None:
            raise HydraError("no profile is running on this hydra: nothing to restart")
        running = [p.name for lane in self.lanes() if lane.sup is not None
                   for p in lane.sup.procs]
        raise HydraError(f"no running process '{name}'; running: {', '.join(running) or 'none'}")

    async def _r_reload(self, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return await self._guard(self.reload())

    async def _r_down(self, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.request_stop("hydra down")
        return 200, {"stopping": True, "pid": os.getpid()}

    # -- actions ------------------------------------------------------------------------------

    def _prepare(self, profile: str, profiles_dir: str | None,
                 name: str | None = None) -> Deployment:
        """Validate and plan on the single port's own address; ports of the running layout
        kept. `name`: the profile keeps this name whatever its file says now (a reload)."""
        port = self.single
        assert port is not None
        lane = port.only()
        running = lane.dep.plan if lane is not None and lane.sup is not None else None
        keep_name = {"profile": name} if name else {}
        return deployment.prepare(
            profile, node_file=self.opts.node_file,
            profiles_dir=profiles_dir or self.opts.profiles_dir,
            overrides={"host": port.host, "port": port.port, **keep_name}, keep=running,
            external=port.port, slot_dir=slot_dir(self.state))

    async def switch(self, profile: str, profiles_dir: str | None = None) -> dict[str, Any]:
        port = self.single
        if port is None:
            report = await self.node.activate(self._lane_named(profile))
            done = report.to_json()
            if report.result != "noop":
                self.switch_log = [*self.switch_log[-19:], {**done, "at": time.time()}]
            return done
        if port.standby is not None and port.standby.ready_for(profile):
            report = await port.standby.flip()  # instant: nothing to plan, nothing restarts
            self.opts.profile = report.to
            return report.to_json()
        lane = port.only()
        if lane is not None and lane.lock.locked():
            raise Busy(f"a switch is already running (to {lane.switching}); "
                       "try again when it is done")
        t0 = time.monotonic()
        # Planning reads files and probes ports: off the loop, so status stays live.
        dep = await asyncio.to_thread(self._prepare, profile, profiles_dir)
        plan_s = time.monotonic() - t0
        self._check_servable(port, dep)
        report = await port.switch_to(dep)
        report.phases = {"plan": plan_s, **report.phases}
        report.total_s += plan_s
        self.opts.profile = profile if report.result == "ok" else self.opts.profile
        return report.to_json()

    @staticmethod
    def _check_servable(port: Port, dep: Deployment) -> None:
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
        self.last_change_error = None  # planned: a failed start is in the lane's report
        self._changed()
        return res

    async def _reload_once(self) -> dict[str, Any]:
        port = self.single
        if port is None:
            return await self._reload_lanes()
        lane = port.only()
        if lane is None or lane.sup is None:
            return {"result": "noop", "reason": "no profile is loaded"}
        ref = lane.dep.plan.source
        name = lane.name
        new = await asyncio.to_thread(self._prepare, ref, None, name)  # the name stays
        skipped = await asyncio.to_thread(self._not_applied, ref, name, port.host, port.port)
        self._check_servable(port, new)
        report = await lane.apply(new)
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

    async def _reload_lanes(self) -> dict[str, Any]:
        """Re-read every profile of the ports that route by model; a serving lane whose plan
        changed restarts what changed (plandiff), a stopped one uses the new plan at its next
        load."""
        done: dict[str, str] = {}
        errors: list[str] = []
        skipped: list[str] = []
        for p in self.by_model:
            for lane in list(p.lanes.values()):
                skip = await asyncio.to_thread(self._not_applied, lane.dep.plan.source,
                                               lane.name, p.host, p.port)
                skipped += [f"{lane.name}: {k}" for k in skip]
                try:
                    new = await asyncio.to_thread(self._prepare_lane, p, lane)
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

    def _prepare_lane(self, p: Port, lane: Lane) -> tuple[Profile, Deployment] | None:
        dep = deployment.prepare(lane.dep.plan.source, node_file=self.opts.node_file,
                                 profiles_dir=self.opts.profiles_dir,
                                 overrides={"host": p.host, "port": p.port,
                                            "profile": lane.name},  # its name is fixed
                                 keep=lane.dep.plan, external=p.port,
                                 slot_dir=slot_dir(self.state),
                                 reserved=self.node.planned_ports(but=lane))
        prof = dep.layout.profile if dep.layout is not None else lane.profile
        if prof is None:
            return None
        return (prof, dep) if p.differs(lane, prof, dep) else None

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
            for lane in self.lanes():
                if lane.sup is not None:
                    lane.sup.kill_all_now()
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
        for p in self.ports:
            p.open()
        # The wire protocol addresses a lane: the first port's default lane (docs/routing.md);
        # reachable at once, also before (or without) a profile: INFO says what runs.
        self.wire = EngineWire(self.ports[0], loop, self.opts.node_file,
                               published=self._published)
        self.ports[0].set_hydra_upstream(self.wire.start())
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
            for p in self.ports:
                await p.start()
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
            await asyncio.gather(*(p.shutdown(self.stop_reason) for p in self.ports))
            self.ended = self.stop_reason
            self._changed()
            self.ctl.stop()
            self.wire.stop()
            for p in self.ports:
                p.close()
            log.warning("stopped: %s", self.stop_reason)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        # Decided after the stop: a second Ctrl-C may arrive while the first one's stop runs.
        return EXIT_INTERRUPTED if self._ints > 1 else code

    async def _wait(self) -> int:
        """Until a stop is asked for, or the layout of a port's one lane goes FATAL (exit 1);
        among several profiles a failed one is marked failed and the others keep serving."""
        while not self.stop_event.is_set():
            lane = self.single.only() if self.single is not None else None
            task = lane.task if lane is not None else None
            waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.stop_event.wait())]
            if task is not None:
                waits.append(asyncio.ensure_future(asyncio.shield(task)))
            # (re-checked every second: a switch may give a port its first lane)
            done, pending = await asyncio.wait(waits, timeout=1.0,
                                               return_when=asyncio.FIRST_COMPLETED)
            for p in pending:
                p.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if self.stop_event.is_set():
                break
            if lane is None or task is None or not task.done():
                continue
            sup = lane.sup
            if task is lane.task and not lane.lock.locked() and lane.exit_on_fatal:
                if sup is not None and sup.fatal:
                    self.stop_reason = f"FATAL: {sup.fatal}"
                    return EXIT_FATAL
                if sup is not None and sup.stopping.is_set():
                    break
            await asyncio.sleep(0.05)  # a switch replaced the task: wait on the new one
        return EXIT_OK
