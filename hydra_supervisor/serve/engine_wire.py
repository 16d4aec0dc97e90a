"""A port's wire lane as the wire server sees it (wire.control.EngineControl), and its life.

The wire protocol addresses a lane: each port with a router has its own wire server, and it
addresses that port's default lane (the one profile of a port that serves one). The wire server
runs on its own threads; everything here that changes the lane hands a coroutine to the
daemon's event loop and waits for it (asyncio.run_coroutine_threadsafe), so
processes are still only spawned from the loop's thread. What is read on every request never
waits on the switch lock and reads only published values: INFO the published snapshot (states,
processes) and `WireView` (the lane's frozen Deployment and Profile, rebuilt on the loop after
each change); `busy` and `head_http` one value each (the lane's lock flag, its route's
upstream address).

CONFIGURE by tier (wire.tiers has the one table of keys):
- T1 settings become request-body defaults in the router (no process restarts);
- T2/T3 settings make a new profile (tier_diff.apply_to_profile), planned on the engine's own
  address with its ports kept, and applied by the lane's apply: the head alone restarts when only
  its flags change, otherwise the whole layout, peers before head;
- T4 keys, and keys that name files, are refused by the wire server before they reach us; a
  `model` must be an alias the node file (or hydra) knows, never a path.
The wire server has no port: `start()` returns it as the router's hand-off for "YH"
connections, and it authenticates each client (wire/trust.py) with the token in the state dir
and the profile's `wire_reads` policy.
SET_EXPERT_MODE switches between the running profile's COMBINE layout and the same profile as
SOLO on the head's device (the layout it was started with is remembered to come back).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra_supervisor.config import config, models
from hydra_supervisor.config.config import Mode, Profile
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import deployment
from hydra_supervisor.plan.plan import Plan
from hydra_supervisor.serve import states
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import Result, SwitchReport
from hydra_supervisor.serve.snapshot import LaneStatus, Snapshot
from hydra_supervisor.tools import binaries, buildid
from hydra_supervisor.wire import tier_diff, tiers, trust
from hydra_supervisor.wire.control import ConfigureRefused
from hydra_supervisor.wire.server import WireServer

CALL_TIMEOUT = 3600.0


@dataclass(frozen=True)
class WireView:
    """What the wire server's threads read of the port's wire lane: one immutable value,
    rebuilt on the loop after every change of the port's lanes (Port.listeners). Its
    Deployment and Profile are frozen too; the state words come from the published
    snapshot."""

    lane: str | None = None
    dep: deployment.Deployment | None = None
    profile: Profile | None = None
    standby_mode: str | None = None  # the port's standby layout's mode (serve/standby.py)
    state: str = states.IDLE  # the lane's state word when it was built (before a snapshot)
    busy: bool = False  # a change holds the lane (its lock) when the view was built
    head: tuple[str, int] | None = None  # where its READY head answers HTTP


class EngineWire:
    """EngineControl over a port's wire lane; `node_file` is the node the daemon plans with."""

    def __init__(self, port: Port, loop: asyncio.AbstractEventLoop,
                 node_file: str | None,
                 published: Callable[[], Snapshot] | None = None) -> None:
        """`published`: the daemon's snapshot as published on the loop (INFO reads that on
        the wire server's threads, never the lanes' live objects)."""
        self.port = port
        self.published = published
        self.loop = loop
        self.node_file = node_file
        self.defaults: dict[str, Any] = {}  # T1 request defaults in force
        self.combine_profile: Profile | None = None  # to come back from SET_EXPERT_MODE solo
        self._build: dict[str, str] | None = None
        self.server: WireServer | None = None
        self.token_path: Path | None = None
        self.view = WireView()
        self.refresh()  # made on the loop (Daemon.run); rebuilt there after every change
        port.listeners.append(self.refresh)

    def refresh(self) -> None:
        """(The loop's thread.) Publish the wire lane as the wire server's threads see it."""
        lane = self.port.default_lane()
        dep = lane.dep if lane is not None else None
        lay = dep.layout if dep is not None else None
        sb = self.port.standby.lane if self.port.standby is not None else None
        self.view = WireView(lane=lane.name if lane is not None else None, dep=dep,
                             profile=lay.profile if lay is not None else None,
                             standby_mode=str(sb.dep.plan.mode) if sb is not None else None,
                             state=lane.state_now().value if lane is not None else states.IDLE,
                             busy=lane.busy if lane is not None else False,
                             head=lane.head_addr() if lane is not None else None)

    # -- life ---------------------------------------------------------------------------------

    def start(self) -> WireServer:
        """Start the wire server and return it: the router hands "YH" connections to it
        (Upstreams.hydra); it has no port of its own."""
        path, token = trust.ensure_token(self.port.state.root)
        self.token_path = path
        self.server = WireServer(control=self, trust=trust.Trust(token=token),
                                 reads=self.wire_reads)
        self.server.start()
        return self.server

    def wire_reads(self) -> str:
        """The read policy in force (the running profile's `wire_reads`)."""
        prof = self._profile()
        value = getattr(prof, "wire_reads", None) if prof is not None else None
        return str(getattr(value, "value", value) or trust.READS_ALLOW_LIST)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    # -- what is read on every request ----------------------------------------------------------

    def _profile(self) -> Profile | None:
        return self.view.profile

    def build(self) -> dict[str, str]:
        if self._build is None:
            info: dict[str, str] = {}
            with contextlib.suppress(HydraError, OSError):
                found = binaries.find("llama-server")
                line = binaries.version_line(found.path)
                info = {"llama_server": str(found.path), "version": line}
                # "version: 0.6.0-dev (build 11434, commit sdist-…)" (buildid.py parses it)
                with contextlib.suppress(ValueError):
                    ident = buildid.parse_version(line)
                    info["build"] = str(ident.build_number)
                    info["commit"] = ident.commit
            self._build = info
        return self._build

    def info(self) -> dict[str, Any]:
        view = self.view  # one read: every field below describes the same layout
        lane, state = self._status(view)
        dep = view.dep
        prof = view.profile
        plan = dep.plan if dep is not None else None
        return {
            "profile": lane.profile if lane else None, "mode": lane.mode if lane else None,
            "model": lane.model if lane else None,
            "model_path": plan.model_path if plan else None,
            "model_kind": plan.model_kind if plan else None,
            "transport": plan.transport if plan else None,
            "state": state,
            "expert_mode": ("combined" if plan and plan.mode == "combine" else "solo")
            if plan else None,
            "peers": [{"name": e.name, "endpoint": e.endpoint, "device": e.device,
                       "managed": e.managed} for e in (plan.peers if plan else ())],
            "split": [{"device": p.device, "what": p.what, "layers": p.layers,
                       "weight_bytes": p.weight_bytes, "need_bytes": p.need_bytes}
                      for p in (plan.placements if plan else ())],
            "processes": [{"name": p.name, "role": p.role, "pid": p.pid, "state": p.state,
                           "reason": p.reason, "restarts": p.restarts, "device": p.device,
                           "port": p.port} for p in (lane.processes if lane else ())],
            "build": self.build(),
            # this host's build identity; on a mode: peer host the free memory it lends
            **buildid.info_section(getattr(dep, "layout", None)),
            # the head holding the rpc-server this port lends, if one does (docs/protocol.md)
            "rpc_holder": self._rpc_holder(),
            # the wire server's `capabilities` (a list of words, as the fork's clients parse
            # it) and `ops` (served / not_implemented per op) say the rest
            "expert_modes": self._expert_modes(),
            "settings": tier_diff.current_settings(prof, self.defaults) if prof else {},
            "request_defaults": dict(self.defaults),
        }

    def _rpc_holder(self) -> dict[str, object] | None:
        """Who holds the rpc-server behind this port's router, from the published snapshot
        (at most half a second old): address, build if announced, seconds held, bytes."""
        if self.published is None:
            return None
        with contextlib.suppress(RuntimeError):  # none yet: hydra is starting
            port = next((p for p in self.published().ports if p.port == self.port.port), None)
            held = port.router.rpc_holder if port is not None and port.router else None
            if held is not None:
                return {"addr": held.addr, "build": held.build, "held_s": held.held_s,
                        "bytes_up": held.bytes_up, "bytes_down": held.bytes_down}
        return None

    def _status(self, view: WireView) -> tuple[LaneStatus | None, str]:
        """The wire lane's published status (None: the port has no lane) and its state word
        (the port's, `idle` or `port down`, without a lane), from the published snapshot;
        before the first one, what the view says."""
        if self.published is not None:
            with contextlib.suppress(RuntimeError):  # none yet: hydra is starting
                port = next((p for p in self.published().ports if p.port == self.port.port),
                            None)
                if port is not None:
                    lanes = port.active()
                    lane = next((x for x in lanes if x.profile == view.lane),
                                lanes[0] if lanes else None)
                    return lane, lane.state if lane is not None else port.word()
        if view.lane is None:
            return None, view.state
        return LaneStatus(name=view.lane, profile=view.lane, state=view.state), view.state

    def _expert_modes(self) -> list[str]:
        prof = self._profile()
        if prof is None:
            return []
        if prof.mode is Mode.COMBINE or self.combine_profile is not None or \
                self.view.standby_mode == "combine":
            return ["solo", "combined"]
        return ["solo"]

    def busy(self) -> bool:
        return self.view.busy

    def head_http(self) -> tuple[str, int] | None:
        return self.view.head

    def slot_dir(self) -> Path:
        return self.port.state.slots()

    # -- what changes the lane ------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_TIMEOUT)

    def configure(self, params: dict[str, Any]) -> dict[str, Any]:
        """CONFIGURE (a wire thread): decided and done on the loop; this thread waits."""
        out: dict[str, Any] = self._call(self._configure(params))
        return out

    async def _configure(self, params: dict[str, Any]) -> dict[str, Any]:
        t1 = {k: v for k, v in params.items()
              if (spec := tiers.lookup(k)) is not None and spec.tier is tiers.Tier.T1}
        rest = {k: v for k, v in params.items() if k not in t1}
        if "model" in rest:
            self._check_model(str(rest["model"]))
        meta: dict[str, Any] = {"restarted": []}
        if t1:
            self.defaults = {**self.defaults, **t1}  # replaced, never changed: INFO reads it
            self.port.set_request_defaults(tier_diff.request_defaults(self.defaults))
            meta["request_defaults"] = tier_diff.request_defaults(self.defaults)
        if rest:
            prof = self._profile()
            if prof is None:
                raise ConfigureRefused("no profile is loaded on this port: nothing to "
                                       "reconfigure (hydra switch NAME first)")
            new = tier_diff.apply_to_profile(prof, rest)
            rep = await self._apply(new)
            meta["restarted"] = rep.restarted if rep.result != Result.NOOP else []
            meta["result"] = rep.result
            meta["phases"] = {k: round(v, 3) for k, v in rep.phases.items()}
            if rep.result not in (Result.OK, Result.NOOP):
                back = "rolled back" if rep.result == Result.ROLLED_BACK else ""
                raise ConfigureRefused(f"the new settings failed to start "
                                       f"({rep.failed_phase}: {rep.error}); {back}")
        return meta

    def _check_model(self, ref: str) -> None:
        """A model over the wire is an alias the node file or hydra knows, never a path (the
        wire server refuses paths; a bare name would otherwise be looked up in the working
        directory too)."""
        try:
            node = config.load_node(config.find_node_file(self.node_file))
        except HydraError as exc:
            raise ConfigureRefused(f"model {ref!r}: the node file cannot be read: {exc}") from exc
        known = {*models.BUILTIN_ALIASES, *models.SYNTH_SHAPES, *node.models}
        if ref not in known:
            raise ConfigureRefused(
                f"model {ref!r} is not an alias of the node file ({node.source}); over the wire "
                f"a model is named by alias: {', '.join(sorted(known)) or 'none defined'}")

    async def _apply(self, prof: Profile) -> SwitchReport:
        """(The loop.) Plan `prof` (in a thread, from plain values) and apply it to the wire
        lane: CONFIGURE's T2/T3 keys, SET_EXPERT_MODE without a standby."""
        port = self.port

        def prepare(running: Plan | None) -> deployment.Deployment:
            # planned for the address the port holds (the value, taken on the loop)
            return deployment.prepare(prof.name, node_file=self.node_file,
                                      keep=running, external=address, profile=prof,
                                      slot_dir=self.slot_dir())

        address = port.address

        lane = port.default_lane()
        running = lane.running_plan if lane is not None else None
        try:
            dep = await asyncio.to_thread(prepare, running)
        except HydraError as exc:
            raise ConfigureRefused(str(exc)) from exc
        try:
            if lane is None:
                return await port.switch_in(dep)
            return await port.apply_to(lane.name, dep)
        except HydraError as exc:
            raise ConfigureRefused(str(exc)) from exc

    def set_expert_mode(self, mode: str) -> dict[str, Any]:
        """SET_EXPERT_MODE (a wire thread): decided and done on the loop; this thread
        waits."""
        out: dict[str, Any] = self._call(self._set_expert_mode(mode))
        return out

    async def _set_expert_mode(self, mode: str) -> dict[str, Any]:
        prof = self._profile()
        if prof is None:
            raise ConfigureRefused("no profile is loaded on this port")
        want_solo = mode == "solo"
        if want_solo == (prof.mode is Mode.SOLO):
            return {"mode": mode, "changed": False}
        sb = self.port.standby
        if sb is not None and sb.for_mode(mode) is not None:  # its standby: a flip (instant)
            try:
                flip = await self.port.flip()
            except HydraError as exc:  # busy: a change runs on either layout
                raise ConfigureRefused(str(exc)) from exc
            return {"mode": mode, "changed": True, "instant": True, "restarted": [],
                    "profile": flip.to,
                    "phases": {k: round(v, 6) for k, v in flip.phases.items()}}
        why = sb.not_instant() if sb is not None else None
        if want_solo:
            if prof.mode is not Mode.COMBINE:
                raise ConfigureRefused(f"profile {prof.name} has no COMBINE layout")
            self.combine_profile = prof
            new = replace(prof, mode=Mode.SOLO, peers=(), split=None)
        else:
            if self.combine_profile is None:
                raise ConfigureRefused(f"profile {prof.name} is SOLO and has no COMBINE layout "
                                       "to return to (start hydra with its COMBINE profile)")
            new = self.combine_profile
        rep = await self._apply(new)
        self.refresh()
        now = self._profile()
        in_effect = "solo" if now is not None and now.mode is Mode.SOLO else "combined"
        if rep.result not in (Result.OK, Result.NOOP):
            raise ConfigureRefused(f"switching to {mode} failed ({rep.failed_phase}: "
                                   f"{rep.error}); mode in effect: {in_effect}")
        return {"mode": in_effect, "changed": True, "restarted": rep.restarted,
                "phases": {k: round(v, 3) for k, v in rep.phases.items()},
                **({"instant": False, "not_instant": why} if why else {})}
