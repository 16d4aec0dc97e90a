"""The running hydra: one per state dir. Lock, signals, control socket, its ports, exit codes.

`hydra up` builds a Daemon and runs it; everything a running hydra does is reached through it:
- the state-dir lock (a second hydra in the same state dir is refused and told who holds it);
- signals, whose handlers only enqueue: TERM/INT stop (a second INT stops at once), HUP reloads;
- the control API (control.py) on `STATE/control.sock`, served from memory;
- the ports (serve/port.py: each external address with its lanes) and the node (serve/node.py:
  the devices' room), and status.json as the crash record.

Exit codes (docs/supervision.md): 0 stopped on request (SIGTERM, SIGINT, `hydra down`); 1
anything else that ended it: the running layout went FATAL, or hydra itself failed (its
reason is in status.json and hydra.log: `fail`); 2 bad input before anything started.

Every external port is watched on the loop (portwatch.py): a router whose acceptor is not
running makes the port's state "port down" (status, STATUS=, metrics; `hydra status` exits 1)
and is stopped and started again.

This module is the Daemon: its run loop, signals, port watch and control routes; the actions
behind them (switch, restart, reload) are an `Actions` (daemon_actions.py) it owns, and what
it says about itself (status.json, STATUS=) plain functions of daemon_status.py.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra_supervisor.config.config import known_profiles
from hydra_supervisor.dashboard import Dashboard, Publisher
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import devices
from hydra_supervisor.proc import gpumem
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.router.traffic import Traffic
from hydra_supervisor.runtime import (
    control,
    control_client,
    daemon_actions,
    daemon_status,
    exits,
    metrics,
    notify,
)
from hydra_supervisor.runtime.messages import message_of
from hydra_supervisor.serve import portwatch
from hydra_supervisor.serve.engine_wire import EngineWire
from hydra_supervisor.serve.events import SAID, Event, Sink
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import Busy, RestartFailed, SwitchTimeouts
from hydra_supervisor.serve.snapshot import DaemonInfo, Snapshot
from hydra_supervisor.serve.states import ANSWERING

log = logging.getLogger("hydra")

EXIT_OK = exits.OK
EXIT_FATAL = exits.FAILED
EXIT_BAD_INPUT = exits.BAD_INPUT
EXIT_NOT_RUNNING = exits.NOT_RUNNING  # for the client commands (status, switch...)
EXIT_PORT_DOWN = exits.PORT_DOWN  # `hydra status`: a port's router accepts no connections
EXIT_INTERRUPTED = exits.INTERRUPTED
# seconds a change made by a control action waits for the action's reply to be written
# before it is published anyway (a long load publishes its progress this late at most)
REPLY_GRACE = 0.1

Presenter = Callable[['Daemon'], Coroutine[Any, Any, None]]


def socket_path(state: StateDir) -> Path:
    return control_client.socket_path(state.root)


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
    profiles: list[str] = field(default_factory=list)  # every profile served at start


class Daemon:
    def __init__(self, state: StateDir, opts: Options, ports: list[Port], node: Node) -> None:
        """`ports`: every external address this hydra serves, each with its lanes
        (serve/setup.py builds them)."""
        self.state = state
        self.opts = opts
        self.ports = ports
        self.node = node
        self.notifier = notify.Notifier.from_env()
        # Live load and the last requests of every port (router/traffic.py): each port's
        # router reports into it; the snapshot and the dashboard's history read it.
        self.traffic = Traffic()
        # The dashboard (dashboard/) beside /metrics: it reads the snapshot published below.
        # Threads (metrics scrapes, the page) read snapshots taken on the loop, never the
        # loop's live objects: a scrape that walked a lane while the loop appended a switch
        # report failed with "deque mutated during iteration".
        self.publisher = Publisher(self.take)
        # One NVML initialisation for the daemon's life: a snapshot reads per-process GPU
        # memory through it (an init + shutdown per snapshot cost 9-10 ms on the loop).
        self.nvml = devices.Nvml()
        # A control action (switch, load, ...) answers first and publishes after: a change
        # while one runs publishes once a reply is written (`_replied`) or, at the latest,
        # REPLY_GRACE after it (the dashboard's actions, a long load's progress).
        self._acting = 0
        self._due = False
        self.loop: asyncio.AbstractEventLoop | None = None  # run()'s, for `_replied`
        self.dashboard = (Dashboard(self.publisher,
                                    profiles=lambda: list(known_profiles(opts.profiles_dir)),
                                    history=self.traffic.history)
                          if opts.metrics_port else None)
        self.metrics = (metrics.MetricsServer("127.0.0.1", opts.metrics_port,
                                              snapshot=self._published,
                                              wrap=self.dashboard.wrap if self.dashboard
                                              else None)
                        if opts.metrics_port else None)
        for p in self.ports:
            p.router_kwargs["traffic"] = self.traffic
            if self.metrics:
                p.router_kwargs["on_request"] = self._on_request
            p.listeners.append(self._changed)
            p.sinks.append(self.emit)
        self.stop_event = asyncio.Event()
        self.stop_reason = "stop requested"
        self.ended: str | None = None  # why the run ended, once it has (the crash record)
        self.started = time.time()
        self.ctl: control.ControlServer | None = None
        self.wires: list[EngineWire] = []  # one per port with a router
        self._ints = 0
        self.fatal: str | None = None  # why a lane under `exit_on_fatal` ended hydra
        # who hears the lifecycle events (serve/events.py): `hydra up` prints them
        self.sinks: list[Sink] = []
        self.actions = daemon_actions.Actions(
            ports, node, daemon_actions.Planning(
                node_file=opts.node_file, profiles_dir=opts.profiles_dir,
                overrides=tuple(opts.overrides.items()), slot_dir=state.slots()),
            changed=self._changed, emit=self.emit)

    # -- what it serves ---------------------------------------------------------------------------

    def lanes(self) -> list[Lane]:
        """Every lane, standby layouts included (restart, kill, status)."""
        return self.actions.lanes()

    # -- status ---------------------------------------------------------------------------------

    def take(self) -> Snapshot:
        """The status as one frozen, typed value (serve/snapshot.py), built here on the loop
        from the ports, their lanes and their processes."""
        running = any(lane.running for lane in self.lanes())
        gpu = gpumem.used_by_pid(self.nvml) if running else {}  # one reading, every lane
        ports = tuple(p.status(gpu) for p in self.ports)
        switches = sorted((s for p in ports for lane in p.lanes for s in lane.switches),
                          key=lambda s: s.at or 0.0)[-20:]
        return Snapshot(daemon=DaemonInfo(pid=os.getpid(), started=self.started,
                                          state_dir=str(self.state.root), stopped=self.ended,
                                          unkillable=tuple(self.unkillable)),
                        ports=ports, switches=tuple(switches),
                        requests=self.traffic.requests())

    @property
    def unkillable(self) -> list[str]:
        return [u for p in self.ports for u in p.unkillable]

    def _published(self) -> Snapshot:
        """A snapshot for another thread: taken on the loop (fresh within 0.5 s)."""
        snap, _ = self.publisher.get(max_age=0.5)
        if snap is None:
            raise RuntimeError("no status snapshot yet (hydra is starting)")
        return snap

    def _changed(self) -> None:
        """A status change (the loop): published now, or, while a control action runs,
        once its reply is out (readers meanwhile get a fresh snapshot: Publisher.expire)."""
        if self._acting and self.loop is not None:
            # every change expires the last snapshot (a reader may have taken a fresh one
            # since the first change of this action: it is stale again now)
            self.publisher.expire()
            if not self._due:
                self._due = True
                self.loop.call_later(REPLY_GRACE, self._flush)
            return
        self._due = False
        self._publish_now()

    def _flush(self) -> None:
        """Publish the change held back for a reply (the loop)."""
        if self._due:
            self._due = False
            self._publish_now()

    def _replied(self) -> None:
        """A control reply was written (its request's thread): publish what it held back."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closing meanwhile
                loop.call_soon_threadsafe(self._flush)

    def _publish_now(self) -> None:
        taken = self.take()  # one snapshot (processes, NVML) for every record
        self.publisher.put(taken)
        with contextlib.suppress(OSError):
            self.state.write_status(taken.summary())
        self.notifier.status(self._status_line(taken))
        if self.fatal is None:
            for p in self.ports:
                why = p.fatal()
                if why is not None:
                    self.fatal = why
                    self.request_stop(f"FATAL: {why}")

    def emit(self, event: Event) -> None:
        """A lifecycle event of a port's lane, its standby or a reload (the loop)."""
        for fn in self.sinks:
            try:
                fn(event)
            except Exception:  # printing it must never break what it tells
                log.exception("event sink failed on %s", event)

    def _status_line(self, snap: Snapshot) -> str:
        """systemd's STATUS=: the snapshot, and the last change that failed (until one works;
        daemon_status.py)."""
        return daemon_status.status_line(snap, self.actions.last_change_error)

    def _on_request(self, rec: dict[str, Any]) -> None:
        """The router's per-request record (a router thread): counted in the metrics,
        labelled by what served it as the router saw it (its port, its route)."""
        if self.metrics is None:
            return
        port = int(rec.get("port") or 0)
        route = str(rec.get("route") or "")  # "": answered by the router itself (404, …)
        if route == "none":
            route = ""
        label = f"port-{port}/{route}" if route else f"port-{port}"
        self.metrics.observe_request(rec, label, route)

    def _router_alive(self) -> bool:
        return all(p.alive() for p in self.ports)

    def _startup_budget(self) -> float:
        """Seconds the start-up loads may take: every initial layout's load timeout (they
        load one after another), plus a margin for the peers' HELLO and the health gate."""
        deps = [p.lanes[n].dep for p in self.ports for n in p.initial_names()]
        return sum(d.timeouts.load for d in deps) + 30.0 if deps else 0.0

    def _ready(self) -> bool:
        """READY=1 for systemd: every port's start-up loads are over and its router accepts;
        a hydra that serves one profile waits until that profile answers."""
        for p in self.ports:
            if not (p.ready() and p.alive()):
                return False
            lane = p.default_lane()
            if p.exit_on_fatal and lane is not None and p.state_of(lane) not in ANSWERING:
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

    # -- control routes (the actions: daemon_actions.py) --------------------------------------

    def control_server(self, loop: asyncio.AbstractEventLoop) -> control.ControlServer:
        """The control API on `STATE/control.sock` (not started): its replies go out before
        the snapshot of what they changed (`_replied`)."""
        self.loop = loop
        return control.ControlServer(socket_path(self.state), loop, self.routes(),
                                     replied=self._replied)

    def routes(self) -> dict[tuple[str, str], control.Handler]:
        """The control API's routes (`STATE/control.sock`; the dashboard's actions too)."""
        return {("GET", "/status"): self._r_status,
                ("POST", "/switch"): self._r_switch,
                ("POST", "/restart"): self._r_restart,
                ("POST", "/reload"): self._r_reload,
                ("POST", "/load"): self._r_load,
                ("POST", "/unload"): self._r_unload,
                ("POST", "/down"): self._r_down}

    async def _r_status(self, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        snap = self.take()
        return 200, {"running": True, "supervisor": self.state.running_supervisor(),
                     "status": dict(snap.summary()), "daemon": snap.to_json()}

    async def _guard(self, coro: Coroutine[Any, Any, dict[str, Any]]
                     ) -> tuple[int, dict[str, Any]]:
        """An action's reply; the status changes it made are published after the reply
        (`_changed`): a flip's answer does not wait for a snapshot."""
        self._acting += 1
        try:
            return 200, await coro
        except Busy as exc:
            return 409, {"error": str(exc), "message": message_of(exc)}
        except RestartFailed as exc:  # not bad input: it failed (exit 1), hydra serves on
            return 500, {"error": str(exc), "message": message_of(exc)}
        except HydraError as exc:
            return 400, {"error": str(exc), "message": message_of(exc)}
        finally:
            self._acting -= 1

    async def _r_switch(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body.get("profile")
        if not isinstance(name, str) or not name:
            return 400, {"error": "switch needs a profile name"}
        return await self._guard(self.switch(name, body.get("profiles_dir")))

    async def _r_restart(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return await self._guard(self.restart(str(body.get("engine", ""))))

    async def _r_reload(self, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return await self._guard(self.reload())

    async def _r_load(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body.get("profile")
        if not isinstance(name, str) or not name:
            return 400, {"error": "load needs a profile name ({\"profile\": NAME})"}
        return await self._guard(self.actions.load(name))

    async def _r_unload(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body.get("profile")
        every = body.get("all") is True
        if every == (isinstance(name, str) and bool(name)):
            return 400, {"error": "unload needs a profile name or all: "
                                  "{\"profile\": NAME} or {\"all\": true}"}
        return await self._guard(self.actions.unload(None if every else str(name)))

    async def _r_down(self, _: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.request_stop("hydra down")
        return 200, {"stopping": True, "pid": os.getpid()}

    async def restart(self, name: str) -> dict[str, Any]:
        """`hydra restart NAME`: the lane running that process restarts it."""
        return await self.actions.restart(name)

    async def switch(self, profile: str, profiles_dir: str | None = None) -> dict[str, Any]:
        res = await self.actions.switch(profile, profiles_dir)
        if res.get("result") == "ok":
            self.opts.profile = str(res.get("to") or self.opts.profile)
        return res

    async def reload(self) -> dict[str, Any]:
        """Re-read the running profiles and apply the difference (none: no-op)."""
        return await self.actions.reload()

    def fail(self, why: str, exc: BaseException | None = None) -> None:
        """Stop because something failed that nobody asked to stop: said with its cause in
        hydra.log and status.json, and `hydra up` exits 1 (EXIT_FATAL), so that systemd's
        Restart=on-failure brings it back. Never a plain stop (exit 0)."""
        if self.fatal is None:
            self.fatal = why
        log.error("FATAL: %s", why, exc_info=exc)
        self.request_stop(f"FATAL: {why}")

    def _task_ended(self, what: str, task: asyncio.Task[object]) -> None:
        """One of the daemon's own tasks ended: only a stop may end them; a failure ends
        hydra with its cause (exit 1)."""
        if task.cancelled() or self.stop_event.is_set():
            return
        exc = task.exception()
        if exc is not None:
            self.fail(f"{what} failed ({type(exc).__name__}: {exc})", exc)

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
                    log.error("reload failed (%s): %s", res.get("result"), res.get("error"),
                              extra=SAID)
            except HydraError as exc:
                log.error("reload failed: %s", exc, extra=SAID)
            except Exception:  # a bug here must not end hydra
                log.exception("reload failed")
            finally:
                self.notifier.ready(self._status_line(self.take()))

        asyncio.get_running_loop().create_task(go())

    # -- the main loop ------------------------------------------------------------------------

    async def run(self, on_start: Presenter | None = None) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self._on_int)
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        for p in self.ports:
            p.open()
        # The wire protocol addresses a lane: each port's wire server its port's default lane
        # (docs/routing.md); reachable at once, also before (or without) a profile: INFO says
        # what runs. A port without a router has no wire server (llama-server holds it).
        for p in self.ports:
            if p.router is not None:
                wire = EngineWire(p, loop, self.opts.node_file, published=self._published)
                self.wires.append(wire)
                p.set_hydra_upstream(wire.start())
        self.ctl = self.control_server(loop)
        self.ctl.start()
        self.publisher.bind(loop)
        if self.dashboard is not None:
            self.dashboard.bind(loop, self.routes())  # actions: the control API's handlers
        if self.metrics is not None:
            try:
                self.metrics.start()
            except OSError as exc:  # taken since `hydra up` checked it (cli/up.py)
                raise HydraError(f"port {self.opts.metrics_port} on 127.0.0.1 (--metrics-port) "
                                 f"cannot be bound: {exc.strerror or exc}",
                                 hint="pick another port: --metrics-port N") from None
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
                self.notifier, self._ready, lambda: notify.status_text(self.take()),
                self.stop_event))
            if on_start is not None:
                presenter = asyncio.create_task(on_start(self))
            for own, what in ((watchdog, "the systemd watchdog"), (ports, "the port watch"),
                              (readiness, "the readiness report")):
                own.add_done_callback(functools.partial(self._task_ended, what))
            code = await self._wait()
        except HydraError as exc:  # bad input found while starting: said, and exit 2
            self.request_stop(f"error: {exc.message}")
            raise
        except Exception as exc:  # a failure nobody asked for: its cause, and exit 1
            self.fail(f"internal error ({type(exc).__name__}: {exc})", exc)
            code = EXIT_FATAL
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
            try:
                self._publish_now()  # the last status.json, whatever was held back: why it ended
            except Exception:  # out of descriptors, say: the stop goes on
                log.exception("could not write the last status")
            self._due = False
            self.nvml.close()
            self.ctl.stop()
            for wire in self.wires:
                wire.stop()
            for p in self.ports:
                p.close()
            log.warning("stopped: %s", self.stop_reason)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        # Decided after the stop: a second Ctrl-C may arrive while the first one's stop runs.
        return EXIT_INTERRUPTED if self._ints > 1 else code

    async def _wait(self) -> int:
        """Until a stop is asked for: `hydra down`, a signal, or a lane under the
        `exit_on_fatal` policy that failed (exit 1; `_changed` notices it on the loop)."""
        await self.stop_event.wait()
        return EXIT_FATAL if self.fatal is not None else EXIT_OK
