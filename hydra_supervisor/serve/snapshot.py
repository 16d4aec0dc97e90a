"""The published status: one typed schema, built on the loop after each change.

The daemon builds one `Snapshot` on the event loop, straight from its live objects (each Port,
Lane and Standby makes its own part: `Port.status`, `Lane.status`), and publishes it as one
immutable value. Every reader — `hydra status`, status.json, metrics scrapes, systemd's
STATUS=, the dashboard, the wire server's INFO, the control API — reads these types, never
the loop's live objects and never loose dicts. `to_json()` gives the documented JSON
(docs/control.md, "The status schema", `"version": 1`); `from_json()` reads it back (the CLI
gets it over the control socket).

    Snapshot(version, taken)
      daemon: DaemonInfo(pid, started, state_dir, stopped, unkillable)
      ports: PortStatus(name, host, port, url, alive, down, default, router, switches)
        router: RouterCounters | None (router: false)
        lanes: LaneStatus(name, profile, role active|standby, state, mode, devices, ...)
          processes: ProcessStatus(name, role, pid, state, ...)
          switches: SwitchStatus(seq, to, from, result, phases, ...)
      switches: SwitchStatus (every lane's last 20, oldest first)
      requests: RequestStatus (the last 256 finished, oldest first, then those running)
"""

from __future__ import annotations

import dataclasses
import time
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Literal, TypedDict, TypeVar

from hydra_supervisor.jsontypes import JSONObject, JSONValue
from hydra_supervisor.router.traffic import RequestStatus as RequestStatus  # the schema's
from hydra_supervisor.serve import states
from hydra_supervisor.serve.reports import SwitchReport

VERSION = 1  # the schema's version: `version` in the JSON (docs/control.md)

Role = Literal["active", "standby"]
T = TypeVar("T")


def _counts() -> Mapping[str, int]:
    return MappingProxyType({})


def frozen_map(d: Mapping[str, T] | None) -> Mapping[str, T]:
    """A read-only copy (a frozen dataclass's mapping field)."""
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class RemoteLoad:
    """A head loading onto remote peers: how much of their weights it has sent (as the peer
    hosts' routers count it; None: unknown, e.g. a bare ggml-rpc-server peer)."""

    sent_bytes: int | None
    remote_bytes: int


@dataclass(frozen=True)
class ProcessStatus:
    """One process of a lane's layout (a llama-server head, an rpc-server peer)."""

    name: str  # PROFILE.ROLE: demo.head, demo.peer-cuda1
    role: str  # plan.Role: head, peer
    state: str  # managed.State: STOPPED, STARTING, READY, UNHEALTHY, STOPPING, BACKOFF, FATAL
    pid: int | None = None
    host: str = ""
    port: int = 0
    device: str = ""
    reason: str = ""
    restarts: int = 0
    started: float | None = None  # wall time of the current run
    last_exit: int | None = None  # negative: killed by that signal
    managed: bool = True
    log: str = ""
    warning: str | None = None
    first_failure_log: str | None = None
    log_tail: tuple[str, ...] = ()  # its log's last lines once it is FATAL
    rss_bytes: int | None = None  # host resident memory
    gpu_bytes: int | None = None  # GPU memory (NVML)
    remote_load: RemoteLoad | None = None
    # A remote peer (managed False): its device's endpoints when it names spares, the primary
    # first (host:port is the one it serves on: a spare when it is not the first), and whether
    # it is reached over TLS (its device's tls:)
    endpoints: tuple[str, ...] = ()
    tls: bool = False

    def to_json(self) -> JSONObject:
        return _obj(self)


@dataclass(frozen=True)
class SwitchStatus:
    """A finished change of a lane (switch, reload, CONFIGURE, restart, load): its report."""

    to: str
    result: str  # reports.Result: ok, rolled_back, failed, noop
    seq: int = 0  # 1, 2, … per lane (metrics count by it)
    frm: str | None = field(default=None, metadata={"json": "from"})
    phases: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    total_s: float = 0.0
    error: str | None = None
    failed_phase: str | None = None
    log_tail: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    cut: int = 0
    restarted: tuple[str, ...] = ()
    reason: str | None = None
    instant: bool | None = None
    not_instant: str | None = None
    at: float | None = None  # wall time it was recorded

    @classmethod
    def of(cls, r: SwitchReport) -> SwitchStatus:
        return cls(to=r.to, result=str(r.result), seq=r.seq, frm=r.frm,
                   phases=frozen_map({k: round(v, 3) for k, v in r.phases.items()}),
                   total_s=round(r.total_s, 3), error=r.error, failed_phase=r.failed_phase,
                   log_tail=tuple(r.log_tail), notes=tuple(r.notes), cut=r.cut,
                   restarted=tuple(r.restarted), reason=r.reason, instant=r.instant,
                   not_instant=r.not_instant, at=r.at)

    def to_json(self) -> JSONObject:
        return _obj(self)


@dataclass(frozen=True)
class LaneStatus:
    """A lane of a port: one profile's layout (its active lane, or the standby beside it)."""

    name: str  # metric label, stable across switches: port-N/PROFILE (port-N/standby)
    profile: str
    role: Role = "active"
    state: str = states.LaneState.STOPPED.value  # states.WORDS: published, refined
    phase: str = states.LaneState.STOPPED.value  # what the lane's own operations set
    mode: str | None = None  # solo, combine, peer (None: a standby not planned)
    model: str | None = None
    source: str | None = None  # the profile's file
    default: bool = False  # requests without a model go here
    aliases: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    # planned MiB per physical device
    needs_mib: Mapping[str, int] = field(default_factory=_counts)
    on_demand: bool = True
    ttl: float | None = None
    min_resident: float | None = None
    concurrency: int | None = None
    queue: int | None = None
    switching: str | None = None  # the profile a change runs to
    fatal: str | None = None
    degraded: str | None = None
    error: str | None = None  # why its last load failed
    why: str | None = None  # why it is not loaded (a standby: why it is not ready)
    loads: int = 0
    unloads: int = 0
    resident_s: float | None = None
    idle_s: float | None = None
    requests: int = 0
    requests_last_min: int | None = None
    held: int = 0  # its gate's: requests parked, sent upstream, waiting for a slot
    held_reason: str | None = None
    inflight: int = 0
    running: int | None = None  # with concurrency: requests upstream now
    waiting: int | None = None
    # Its traffic as its port's router counts it (router/traffic.py): held at the gate plus
    # waiting for a slot; generated tokens/s over the last 5 s, counted as SSE events stream;
    # totals since hydra started (this profile on this port); responses cut mid-way.
    queued: int = 0
    tokens_per_s: float = 0.0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cut: int = 0
    standby: str | None = None  # an active lane's standby profile (serve/standby.py)
    standby_of: str | None = None  # a standby lane's active profile
    warm_s: float | None = None  # a standby's warm-up request
    flips: int = 0  # a standby's flips so far
    processes: tuple[ProcessStatus, ...] = ()
    switches: tuple[SwitchStatus, ...] = ()  # its last changes, oldest first

    def to_json(self) -> JSONObject:
        return _obj(self)


@dataclass(frozen=True)
class RpcHolderStatus:
    """The head holding a lent rpc-server through this port's router (router/ledger.py
    RpcHolder): its address, its hydra's build when it announced one, how long it has held
    it, and the bytes each way."""

    addr: str = ""
    build: str | None = None
    held_s: float = 0.0
    bytes_up: int = 0  # head → rpc-server
    bytes_down: int = 0


@dataclass(frozen=True)
class FdStatus:
    nofile: int = 0  # the soft open-file limit in force
    budget: int = 0  # descriptors admission may use for relays
    relays: int = 0  # descriptors the admitted connections hold now


@dataclass(frozen=True)
class RouterCounters:
    """A port's router: what it counted since hydra started (router/core.py RouterStats),
    and hydra's restarts of it (serve/portwatch.py)."""

    alive: bool = True
    acceptor_error: str | None = None
    accepted: int = 0
    open: int = 0
    open_peak: int = 0
    pending: int = 0
    pooled: int = 0
    held: int = 0  # every route's gate
    inflight: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    bytes: int = 0
    # connections by protocol (http, rpc, hydra); HTTP requests, 1xx..5xx, cut, retried;
    # connections refused by reason; trouble survived, by kind
    by_kind: Mapping[str, int] = field(default_factory=_counts)
    http: Mapping[str, int] = field(default_factory=_counts)
    refused: Mapping[str, int] = field(default_factory=_counts)
    events: Mapping[str, int] = field(default_factory=_counts)
    fds: FdStatus | None = None
    rpc_holder: RpcHolderStatus | None = None  # a lent rpc-server's head, while one holds it
    recoveries: int = 0
    recovery_failures: int = 0
    cpus: str = ""  # the CPUs its threads run on (router_cpus), "0-3,6"; "": not pinned
    down_s: float | None = None

    # The router's flat refusal counters of older hydras, by the reason they are now.
    LEGACY: ClassVar[Mapping[str, str]] = {
        "refused": "queue_full", "rejected": "unrecognised", "denied": "not_allowed",
        "timeouts": "timeout", "upstream_errors": "upstream_error"}

    @classmethod
    def upgrade(cls, data: Mapping[str, object]) -> Mapping[str, object]:
        """An older router's counters in today's shape: `total` was `accepted`; refusals
        were flat counters."""
        out = dict(data)
        if "accepted" not in out and "total" in out:
            out["accepted"] = out.pop("total")
        refused = out.get("refused")
        flat = {} if isinstance(refused, Mapping) else {
            reason: n for key, reason in cls.LEGACY.items()
            if isinstance(n := out.get(key), int)}
        if flat:
            out["refused"] = flat
        return out


@dataclass(frozen=True)
class PortStatus:
    """An external address: its router's counters and its lanes (0..N, and a standby)."""

    name: str  # metric label, stable across switches: port-N
    host: str
    port: int
    url: str
    alive: bool = True
    down: str | None = None  # why it refuses every connection (its router is not accepting)
    default: str | None = None  # the lane requests without a model go to
    router: RouterCounters | None = None  # None: router: false (llama-server holds the port)
    lanes: tuple[LaneStatus, ...] = ()
    switches: tuple[SwitchStatus, ...] = ()  # changes that left it without a lane
    tls: bool = False  # its router takes TLS only (a peer profile's tls:)

    def word(self) -> str:
        """The port's own word, for a port with no lane: `port down` or `idle`."""
        return states.PORT_DOWN if self.down else states.IDLE

    def active(self) -> tuple[LaneStatus, ...]:
        """Its lanes that routing sees (the standby is not one)."""
        return tuple(x for x in self.lanes if x.role == "active")

    @property
    def profiles(self) -> tuple[str, ...]:
        return tuple(x.profile for x in self.active())

    def to_json(self) -> JSONObject:
        return _obj(self)


@dataclass(frozen=True)
class DaemonInfo:
    pid: int
    started: float  # wall time hydra started
    state_dir: str
    stopped: str | None = None  # why the run ended, once it has
    unkillable: tuple[str, ...] = ()  # children that survived SIGKILL


@dataclass(frozen=True)
class Snapshot:
    """The daemon's status, as one immutable value."""

    daemon: DaemonInfo
    ports: tuple[PortStatus, ...] = ()
    switches: tuple[SwitchStatus, ...] = ()  # every lane's last changes, oldest first
    # The last requests through the routers (finished, oldest first), then those running.
    requests: tuple[RequestStatus, ...] = ()
    version: int = VERSION
    taken: float = field(default_factory=time.time)

    def lanes(self) -> Iterator[tuple[PortStatus, LaneStatus]]:
        """Every lane with its port, standby lanes included."""
        for p in self.ports:
            for lane in p.lanes:
                yield p, lane

    def processes(self) -> Iterator[tuple[PortStatus, LaneStatus, ProcessStatus]]:
        for p, lane in self.lanes():
            for proc in lane.processes:
                yield p, lane, proc

    def down(self) -> list[str]:
        """Why each port that refuses every connection does (`hydra status` exits 1)."""
        return list(dict.fromkeys(d for p in self.ports if (d := p.down)))

    def to_json(self) -> JSONObject:
        return {"version": self.version, **_obj(self)}

    def summary(self) -> Summary:
        """The summary view (status.json, the crash record; `status` in `hydra status
        --json`): `profile` and `state` name every active lane, `engines` lists their
        processes; with one lane its mode, model and reasons are the lane's."""
        lanes = [x for p in self.ports for x in p.active()]
        words = {x.profile: x.state for x in lanes}
        down = self.down()
        one = lanes[0] if len(lanes) == 1 else None
        if one is not None:
            state = one.state
        elif not lanes:
            state = self.ports[0].word() if self.ports else states.IDLE
        else:
            serving = [n for n, st in words.items() if st in states.UP]
            state = states.PORT_DOWN if down else states.LaneState.SERVING.value if serving \
                else states.IDLE
        if self.daemon.stopped and state != states.LaneState.FAILED.value:
            state = states.LaneState.STOPPED.value  # hydra stopped: nothing serves, said so
        return Summary(
            pid=self.daemon.pid, profile=",".join(words) or None,
            source=one.source if one else None,
            mode=one.mode if one else ("profiles" if lanes else None),
            model=one.model if one else None,
            url=", ".join(p.url for p in self.ports), state=state,
            down="; ".join(down) or None,
            fatal=one.fatal if one else None, degraded=one.degraded if one else None,
            updated=self.taken, stopped=self.daemon.stopped, profiles=words,
            unkillable=list(self.daemon.unkillable),
            engines=[p.to_json() for x in lanes for p in x.processes])

    @classmethod
    def from_json(cls, data: object) -> Snapshot:
        """The documented JSON read back (`hydra status`); keys it lacks take their defaults."""
        return parse(cls, data)


class Summary(TypedDict):
    """The summary view of a Snapshot: status.json's keys (external tools read them)."""

    pid: int
    profile: str | None  # every active lane's profile, comma-separated
    source: str | None
    mode: str | None  # the one lane's; "profiles" with several
    model: str | None
    url: str
    state: str
    down: str | None
    fatal: str | None
    degraded: str | None
    updated: float
    stopped: str | None
    profiles: dict[str, str]  # profile -> state
    unkillable: list[str]
    engines: list[JSONObject]  # every active lane's processes (ProcessStatus JSON)


# -- JSON -------------------------------------------------------------------------------------

def _json(value: object) -> JSONValue:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _obj(value)
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_json(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"not JSON: {value!r}")


def _obj(value: object) -> JSONObject:
    """A dataclass of the schema as its JSON object (a fresh, plain copy)."""
    assert dataclasses.is_dataclass(value) and not isinstance(value, type)
    return {f.metadata.get("json", f.name): _json(getattr(value, f.name))
            for f in dataclasses.fields(value)}


def parse(cls: type[T], data: object) -> T:
    """One of the schema's dataclasses from its JSON (typed by its fields' annotations)."""
    return typing.cast(T, _parse(cls, data))


def _parse(tp: object, data: object) -> object:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        opts = typing.get_args(tp)
        if data is None and type(None) in opts:
            return None
        return _parse(next(o for o in opts if o is not type(None)), data)
    if origin is Literal:
        return data
    if origin is tuple:
        item = typing.get_args(tp)[0]
        return tuple(_parse(item, v) for v in (data if isinstance(data, list | tuple) else ()))
    if origin is Mapping:
        val = typing.get_args(tp)[1]
        return frozen_map({str(k): _parse(val, v) for k, v in data.items()}
                          if isinstance(data, Mapping) else {})
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        src: Mapping[str, object] = data if isinstance(data, Mapping) else {}
        upgrade = getattr(tp, "upgrade", None)
        if upgrade is not None:
            src = upgrade(src)
        hints = typing.get_type_hints(tp)
        kw: dict[str, object] = {}
        for f in dataclasses.fields(tp):
            key = f.metadata.get("json", f.name)
            if key in src:
                kw[f.name] = _parse(hints[f.name], src[key])
        return tp(**kw)
    if tp is float and isinstance(data, int) and not isinstance(data, bool):
        return float(data)
    return data
