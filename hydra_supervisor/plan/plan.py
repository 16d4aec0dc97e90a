"""The Plan: what the resolver decides and the supervisor runs. Plain frozen data, JSON-able.

One EngineSpec per process (or per remote peer hydra only connects to), with everything needed
to start it: program, argv, environment, bind address and port, role and start order.

A Plan never carries the external address: that is the Port's (serve/port.py), known to
planning only as a value (`Address`) no process may be given. The one exception is a
`router: false` plan, whose head binds that address itself (its EngineSpec says so).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from enum import Enum, StrEnum
from typing import TypedDict, cast

from hydra_supervisor.config.profile import TlsFiles


class Role(Enum):
    HEAD = "head"
    PEER = "peer"


# What a plan is; string enums, so a plan's JSON and its comparisons read as the words.
class PlanMode(StrEnum):
    SOLO = "solo"
    COMBINE = "combine"
    PEER = "peer"  # no head: a device lent over ggml-RPC


class PlanTransport(StrEnum):
    RPC = "rpc"  # per-device processes joined by ggml-RPC (the only one across hosts)
    LOCAL = "local"  # one llama-server over the profile's GPUs of this host
    NONE = "none"  # SOLO: one process, no device to reach


class ModelKind(StrEnum):
    DENSE = "dense"
    MOE = "moe"
    NONE = "-"  # a peer-only plan runs no model itself


@dataclass(frozen=True)
class EngineSpec:
    name: str
    role: Role
    program: str  # "llama-server" | "ggml-rpc-server"; resolved to a path at start time
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    host: str
    port: int
    device: str
    start_order: int
    managed: bool = True  # False: a remote peer on another host; hydra only probes it
    # A remote peer reached over TLS (its device's tls:): hydra's probes speak TLS to it, and
    # the head's --rpc goes through a local tunnel (router/tunnel.py) started with the head.
    tls: TlsFiles | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def argv(self, binary: str) -> list[str]:
        """The command line it runs as, with `binary` the path `program` was found at (the
        supervisor spawns this; `hydra plan` prints it)."""
        return [binary, *self.args]

    def with_port(self, port: int) -> EngineSpec:
        """A managed peer moved to another port (its `-p` argument follows)."""
        args = list(self.args)
        if "-p" in args:
            args[args.index("-p") + 1] = str(port)
        return replace(self, port=port, args=tuple(args))

    def repointed(self, old: str, new: str) -> EngineSpec:
        """A head whose peer moved: rewrite `host:port` in --rpc and in -ot's RPC0[...]."""
        return replace(self, args=tuple(a.replace(old, new) for a in self.args))


@dataclass(frozen=True)
class Placement:
    """What one device holds: whole layers (dense) or expert tensors (MoE), with byte counts."""

    device: str
    layers: int
    weight_bytes: int
    kv_bytes: int
    overhead_bytes: int
    free_bytes: int  # 0 = unknown
    what: str = "layers"

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.overhead_bytes


@dataclass(frozen=True)
class Address:
    """An external address (host, port): the Port's. Planning takes it as a value: no process
    is given its port, and a `router: false` head binds it. Port 0: any free port (the Port
    learns which when its router binds)."""

    host: str
    port: int


@dataclass(frozen=True)
class RouterSpec:
    """What the router on the external port relays to: HTTP to the head, ggml-RPC
    (allow-listed) to the engine's local peer. Where it listens is the Port's address."""

    http: tuple[str, int] | None
    rpc: tuple[str, int] | None
    allow: tuple[str, ...]
    tls: TlsFiles | None = None  # mode: peer with tls: the port takes TLS only


class PlanMeta(TypedDict, total=False):
    """What a plan says beside its processes (in `hydra plan --json` too)."""

    ctx: int
    block_count: int
    transport_requested: str  # COMBINE: the profile's transport (auto, rpc, local)
    moe_split: str  # COMBINE of an MoE model: how it is split
    prefill: tuple[str, ...]  # mode: peer: the GGUFs its ggml-rpc-server cache gets first


@dataclass(frozen=True)
class Plan:
    profile: str
    source: str
    model_path: str
    model_kind: ModelKind
    mode: PlanMode
    transport: PlanTransport
    engines: tuple[EngineSpec, ...]
    placements: tuple[Placement, ...] = ()
    notes: tuple[str, ...] = ()
    meta: PlanMeta = field(default_factory=lambda: PlanMeta())
    router: RouterSpec | None = None  # None: `router: false`, the head binds the external address

    @property
    def head(self) -> EngineSpec:
        return next(e for e in self.engines if e.role is Role.HEAD)

    @property
    def peers(self) -> tuple[EngineSpec, ...]:
        return tuple(e for e in self.engines if e.role is Role.PEER)

    @property
    def binds_external(self) -> Address | None:
        """The external address a process of this plan binds itself: a `router: false`
        head's; None behind a router (the Port binds it)."""
        if self.router is not None:
            return None
        head = self.head
        return Address(head.host, head.port)

    def in_start_order(self) -> list[EngineSpec]:
        return sorted(self.engines, key=lambda e: e.start_order)

    def to_json(self) -> dict[str, object]:
        def enc(obj: object) -> object:
            if isinstance(obj, Enum):
                return obj.value
            if isinstance(obj, dict):
                return {k: enc(v) for k, v in obj.items()}
            if isinstance(obj, list | tuple):
                return [enc(v) for v in obj]
            return obj

        data = cast("dict[str, object]", enc(asdict(self)))
        engines = cast("list[dict[str, object]]", data["engines"])
        for eng, spec in zip(engines, self.engines, strict=True):
            eng["env"] = spec.env_dict()
            eng["endpoint"] = spec.endpoint
        return data
