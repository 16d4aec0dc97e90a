"""What the operator's files amount to: the frozen dataclasses of a profile (Profile, its
RestartPolicy and HealthPolicy) and of the node file (Node, DeviceDecl), and their enums.

config.py finds and loads the files into these, schema.py checks them on the way; see
docs/profiles.md for the keys.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

# A profile's or a device's name becomes part of file names in the state dir (logs/NAME.log,
# pids/NAME.json) and of process names: letters, digits, '.', '_' and '-', 1 to 64 of them, not
# starting with '.' or '-' (no '..', no hidden file, no option look-alike).
NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter, digit or '_'"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a profile or a device, or None."""
    if _NAME.fullmatch(name):
        return None
    shown = repr(name) if len(name) <= 80 else f"{name[:40]!r}... ({len(name):,} characters)"
    return f"{shown} is not a valid name: {NAME_RULE}"


@dataclass(frozen=True)
class TlsFiles:
    """TLS between hydra hosts (docs/multi-host.md "Over a network you do not trust"): the CA
    that signed every hydra host's certificate, and this host's certificate and key (PEM).
    Each side requires the other's certificate, signed by ``ca``; host names are not checked
    (the CA is private to the hydra hosts: whatever it signed is one of them)."""

    ca: str
    cert: str
    key: str


class Mode(Enum):
    SOLO = "solo"
    COMBINE = "combine"
    PEER = "peer"  # no head: serve the `head` device over ggml-RPC to another host's head


class Transport(Enum):
    """How a COMBINE head reaches its other devices. AUTO (the default) is LOCAL when every
    device is a GPU of this host, else RPC; the plan says which one and why."""

    AUTO = "auto"
    RPC = "rpc"
    LOCAL = "local"


class MoeSplit(Enum):
    """How an MoE COMBINE spreads over its devices: whole layers (as a dense split), or only the
    routed-expert tensors on the peer (-ot '<experts regex>=CUDA1' / RPC0[..]); AUTO picks the
    measured-faster one for the transport."""

    AUTO = "auto"
    LAYERS = "layers"
    EXPERTS = "experts"


class PeerLoss(Enum):
    RESTART = "restart"
    DEGRADE = "degrade"
    FAIL = "fail"


class WireReads(Enum):
    """Who may send the Hydra wire protocol's reads (INFO, STATE_GET, STATE_META): any source
    the allow list lets in, or only an authenticated client (docs/protocol.md "Trust model")."""

    ALLOW_LIST = "allow_list"
    OWNER = "owner"


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    max_failures: int = 5
    window: float = 300.0
    stable_after: float = 60.0


@dataclass(frozen=True)
class HealthPolicy:
    interval: float = 2.0  # /health poll of a READY head
    hang_timeout: float = 30.0  # /health silent this long → the head is killed and restarted
    # a request in flight owed a byte by the head and no CPU progress this long → stalled
    # (default: hang_timeout); see docs/supervision.md "the stall rule"
    stall_timeout: float | None = None
    probe: bool = False  # also send a 1-token completion every probe_interval
    probe_interval: float = 30.0
    probe_timeout: float = 60.0


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    model: str = ""  # not used by mode: peer
    mode: Mode = Mode.SOLO
    head: str = "cpu"
    peers: tuple[str, ...] = ()
    # llama.cpp device order (peers first, head last); ints = layer counts, decimals = proportions;
    # or a mapping device name -> count/proportion.
    split: tuple[int | float, ...] | Mapping[str, int | float] | None = None
    transport: Transport = Transport.AUTO
    moe_split: MoeSplit = MoeSplit.AUTO
    n_cpu_moe: int | None = None
    server_args: Mapping[str, object] = field(default_factory=dict)  # scalars (a list: repeated)
    env: Mapping[str, str] = field(default_factory=dict)
    on_peer_loss: PeerLoss = PeerLoss.RESTART
    host: str = "127.0.0.1"
    port: int = 8080
    load_timeout: float | None = None
    stop_grace: float = 10.0  # SIGTERM → SIGKILL, per process (all stop in parallel)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    health: HealthPolicy = field(default_factory=HealthPolicy)
    router: bool = True  # the external port is hydra's first-byte router; false: llama-server's
    rpc_allow: tuple[str, ...] = ("127.0.0.0/8", "::1/128")  # who may speak ggml-RPC through it
    wire_reads: WireReads = WireReads.ALLOW_LIST  # who may send wire reads (changes: the owner)
    # mode: peer: the router takes TLS only (mutual, these files): ggml-RPC and Hydra frames
    # inside it; a plain connection is refused. None: plain TCP (a private network).
    tls: TlsFiles | None = None
    description: str = ""
    # `hydra bench` thresholds (decode_tps, prefill_tps: at least; ttft_ms: at most).
    expect: Mapping[str, float] = field(default_factory=dict)
    # Save every KV slot before the head stops (switch, reload, planned restart) and restore
    # them into the next head of the same model (the head gets --swa-full for that).
    keep_slots: bool = False
    # Several profiles behind one port (docs/routing.md): the OpenAI `model` names that pick this
    # profile besides its own name; whether a request loads it when it is stopped; unload after
    # `ttl` s without requests (None: never); stay at least `min_resident` s after an on-demand
    # load before another profile may evict it; at most `concurrency` requests upstream at once
    # (None: no limit), `queue` more waiting, and a 429 past that.
    aliases: tuple[str, ...] = ()
    on_demand: bool = True
    ttl: float | None = None
    min_resident: float = 30.0
    concurrency: int | None = None
    queue: int = 32
    # mode: peer -- models (aliases or paths, resolved like `model:`) whose weights this host
    # writes into its ggml-rpc-server's -c cache before starting it, so a head with the same
    # GGUF sends only hashes (rpccache.py).
    prefill: tuple[str, ...] = ()
    # The other layout of the same model this profile switches with (a profile name, e.g. the
    # SOLO of a COMBINE): kept loaded beside it when the node has room, so a switch to it
    # re-points the port at once (serve/standby.py, docs/profiles.md).
    standby: str | None = None


@dataclass(frozen=True)
class DeviceDecl:
    """A device named in the node file: a local GPU (cuda index), the CPU, or a remote peer."""

    name: str
    cuda: int | None = None
    cpu: bool = False
    endpoint: str | None = None
    memory_mib: int | None = None  # override the inventory; a remote peer's: at most this
    # A remote peer whose llama.cpp build differs from this host's is refused (buildid.py)
    # unless this is set: for operators who know the two builds are compatible.
    allow_build_mismatch: bool = False
    # Alternates for a remote peer (host:port each, tried in order when `endpoint` fails HELLO,
    # identity or the memory fit: plan/spares.py); memory_mib and allow_build_mismatch apply
    # to each of them as to `endpoint`.
    spares: tuple[str, ...] = ()
    # A remote peer whose router takes TLS only: hydra reaches it over TLS with these files
    # (its own probes directly, the head's llama-server through a local tunnel).
    tls: TlsFiles | None = None


@dataclass(frozen=True)
class Node:
    source: str
    devices: Mapping[str, DeviceDecl]
    binaries: Mapping[str, str] = field(default_factory=dict)
    models: Mapping[str, str] = field(default_factory=dict)
    model_dirs: tuple[str, ...] = ()
    rpc_ports: tuple[int, int] = (30052, 30151)
    internal_ports: tuple[int, int] = (30200, 30299)
    defaults: Mapping[str, object] = field(default_factory=dict)
    profiles: tuple[str, ...] = ()  # what `hydra up` serves when no -p is given
    default_profile: str | None = None  # for requests without `model` (else the first listed)
    state_group: str | None = None  # the state dir readable by this group (filemodes.py)
    log_max_mib: float = 10.0  # a child log rotates past this size...
    log_keep: int = 3  # ...keeping this many older files (logfiles.py)
    router_cpus: str | tuple[int, ...] = "auto"  # where router threads run (router/affinity.py)
