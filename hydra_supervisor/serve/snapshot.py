"""The published status: frozen, typed objects built on the loop after each change.

The daemon builds one `Snapshot` on the event loop (from the ports' rows) and publishes it as
one immutable value. Every reader on another thread — metrics scrapes, the dashboard, the wire
server's INFO, the control API — reads that value; `to_json()` gives each reader a fresh plain
copy in the shape `hydra status --json` documents (docs/control.md), so no reader can change
what another sees, and none walks the loop's live objects.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


def freeze(value: Any) -> Any:
    """A deep, read-only copy of JSON-like data (dicts become read-only mappings, lists
    tuples)."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A plain, mutable JSON copy of frozen data."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


_PROCESS_KEYS = ("name", "role", "pid", "host", "port", "device", "state", "reason",
                 "restarts", "started", "last_exit", "managed", "log", "warning",
                 "first_failure_log", "log_tail", "rss_bytes", "gpu_bytes")


@dataclass(frozen=True)
class ProcessStatus:
    name: str
    role: str
    pid: int | None
    host: str
    port: int
    device: str
    state: str  # managed.State
    reason: str
    restarts: int
    started: float | None  # wall time of the current run
    last_exit: int | None
    managed: bool
    log: str
    warning: str | None
    first_failure_log: str | None
    log_tail: tuple[str, ...]
    rss_bytes: int | None
    gpu_bytes: int | None
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> ProcessStatus:
        known: dict[str, Any] = {k: row.get(k) for k in _PROCESS_KEYS}
        known["log_tail"] = tuple(row.get("log_tail") or ())
        known["restarts"] = int(row.get("restarts") or 0)
        known["managed"] = bool(row.get("managed", True))
        known["reason"] = str(row.get("reason") or "")
        extra = {k: v for k, v in row.items() if k not in _PROCESS_KEYS}
        return cls(**known, extra=freeze(extra))

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _PROCESS_KEYS}
        out["log_tail"] = list(self.log_tail)
        out.update(thaw(self.extra))
        return out


_LANE_KEYS = ("name", "profile", "source", "mode", "model", "host", "port", "url", "state",
              "down", "switching", "fatal", "degraded", "requests_last_min")


@dataclass(frozen=True)
class LaneStatus:
    """One row of `engines`: a lane, or a port with no lane (profile None, state idle)."""

    name: str  # metric label: port-N (a port's one lane) or port-N/PROFILE
    profile: str | None
    source: str | None
    mode: str | None
    model: str | None
    host: str
    port: int
    url: str
    state: str  # serve/states.py: a LaneState word, or "idle" / "port down"
    down: str | None
    switching: str | None
    fatal: str | None
    degraded: str | None
    requests_last_min: int | None
    processes: tuple[ProcessStatus, ...]
    # The port's router counters, on its first row only, for `hydra status` and older readers
    # (a port's one lane: held/inflight are its gate's). They are the port's, not the lane's:
    # metrics read them from the port (`ports` in JSON, PortStatus.router).
    router: Mapping[str, Any] | None
    switches: tuple[Mapping[str, Any], ...]
    lane: Mapping[str, Any] | None  # routing facts of a lane among several ("fleet" in JSON)
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> LaneStatus:
        known: dict[str, Any] = {k: row.get(k) for k in _LANE_KEYS}
        rest = {k: v for k, v in row.items()
                if k not in _LANE_KEYS and k not in ("processes", "router", "switches", "fleet")}
        return cls(**known,
                   processes=tuple(ProcessStatus.of(p) for p in row.get("processes") or ()),
                   router=freeze(row["router"]) if row.get("router") is not None else None,
                   switches=tuple(freeze(s) for s in row.get("switches") or ()),
                   lane=freeze(row["fleet"]) if row.get("fleet") is not None else None,
                   extra=freeze(rest))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _LANE_KEYS}
        out["processes"] = [p.to_json() for p in self.processes]
        out["router"] = thaw(self.router) if self.router is not None else None
        out["switches"] = [thaw(s) for s in self.switches]
        if self.lane is not None:
            out["fleet"] = thaw(self.lane)
        out.update(thaw(self.extra))
        return out


@dataclass(frozen=True)
class PortStatus:
    """An external port: in `ports` (JSON) with its router's counters, and in `fleets` (the
    older name) without them."""

    port: int
    url: str
    default: str | None
    profiles: tuple[str, ...]
    alive: bool
    down: str | None
    name: str = ""  # metric label: port-N, stable across switches
    router: Mapping[str, Any] | None = None  # Router.stats() (None: router: false)

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> PortStatus:
        return cls(port=int(row["port"]), url=str(row["url"]), default=row.get("default"),
                   profiles=tuple(row.get("profiles") or ()), alive=bool(row.get("alive")),
                   down=row.get("down"), name=str(row.get("name") or f"port-{row['port']}"),
                   router=freeze(row["router"]) if row.get("router") is not None else None)

    def to_json(self) -> dict[str, Any]:
        """The port in `fleets`."""
        return {"port": self.port, "url": self.url, "default": self.default,
                "profiles": list(self.profiles), "alive": self.alive, "down": self.down}

    def port_json(self) -> dict[str, Any]:
        """The port in `ports`: its name and router counters too."""
        return {"name": self.name, **self.to_json(),
                "router": thaw(self.router) if self.router is not None else None}


@dataclass(frozen=True)
class Snapshot:
    """The daemon's status, as one immutable value."""

    pid: int
    started: float  # wall time hydra started
    state_dir: str
    rows: tuple[LaneStatus, ...]
    ports: tuple[PortStatus, ...] = ()  # every port, with its router's counters
    switches: tuple[Mapping[str, Any], ...] = ()  # every lane's last changes, oldest first
    taken: float = field(default_factory=time.time)

    @classmethod
    def build(cls, *, pid: int, started: float, state_dir: str,
              rows: Iterable[Mapping[str, Any]], switches: Iterable[Mapping[str, Any]] = (),
              ports: Iterable[Mapping[str, Any]] = ()) -> Snapshot:
        return cls(pid=pid, started=started, state_dir=state_dir,
                   rows=tuple(LaneStatus.of(r) for r in rows),
                   ports=tuple(PortStatus.of(p) for p in ports),
                   switches=tuple(freeze(s) for s in switches))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pid": self.pid, "started": self.started,
                               "state_dir": self.state_dir,
                               "engines": [r.to_json() for r in self.rows]}
        out["ports"] = [p.port_json() for p in self.ports]
        out["fleets"] = [p.to_json() for p in self.ports]
        out["switches"] = [thaw(s) for s in self.switches]
        return out
