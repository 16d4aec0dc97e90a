"""Profiles and the node file: find, load, validate and layer them into frozen dataclasses.

Layering (later wins): built-in defaults < node file (`defaults:` block) < profile < command-line
overrides. Validation collects *every* problem, each with file:line and its YAML path, and an
unknown key lists the valid ones (with a did-you-mean). See docs/profiles.md for the schema.
"""

from __future__ import annotations

import difflib
import grp
import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from hydra_supervisor.config.paths import repo_root
from hydra_supervisor.config.yamlsrc import PathKey, Sourced, load_file
from hydra_supervisor.errors import ConfigError, HydraError


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
    # requests in flight without a byte and no CPU progress this long → stalled (default:
    # hang_timeout); see docs/supervision.md "the stall rule"
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
    server_args: Mapping[str, Any] = field(default_factory=dict)
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
    memory_mib: int | None = None  # override the inventory (remote peers must say it)
    # A remote peer whose llama.cpp build differs from this host's is refused (buildid.py)
    # unless this is set: for operators who know the two builds are compatible.
    allow_build_mismatch: bool = False


@dataclass(frozen=True)
class Node:
    source: str
    devices: Mapping[str, DeviceDecl]
    binaries: Mapping[str, str] = field(default_factory=dict)
    models: Mapping[str, str] = field(default_factory=dict)
    model_dirs: tuple[str, ...] = ()
    rpc_ports: tuple[int, int] = (30052, 30151)
    internal_ports: tuple[int, int] = (30200, 30299)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    profiles: tuple[str, ...] = ()  # what `hydra up` serves when no -p is given
    default_profile: str | None = None  # for requests without `model` (else the first listed)
    state_group: str | None = None  # the state dir readable by this group (filemodes.py)
    log_max_mib: float = 10.0  # a child log rotates past this size...
    log_keep: int = 3  # ...keeping this many older files (logfiles.py)


# ---------------------------------------------------------------------------------------------
# A tiny declarative validator: each key maps to a checker that returns (value, problems).

Checker = Callable[[Any, PathKey], tuple[Any, list[tuple[PathKey, str]]]]


def _type(kind: type | tuple[type, ...], label: str) -> Checker:
    def check(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
        if isinstance(v, bool) and kind is not bool and bool not in (
            kind if isinstance(kind, tuple) else (kind,)
        ):
            return None, [(p, f"expected {label}, got {v!r}")]
        if not isinstance(v, kind):
            return None, [(p, f"expected {label}, got {v!r}")]
        return v, []

    return check


def _enum(enum: type[Enum]) -> Checker:
    choices = [e.value for e in enum]

    def check(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
        try:
            return enum(v), []
        except ValueError:
            return None, [(p, f"must be one of {', '.join(choices)}; got {v!r}")]

    return check


def _port(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
        return None, [(p, f"expected a port number 0-65535, got {v!r}")]
    return v, []


def _positive(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
        return None, [(p, f"expected a positive number, got {v!r}")]
    return float(v), []


def _seconds(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        return None, [(p, f"expected a number of seconds (0 or more), got {v!r}")]
    return float(v), []


def _count(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return None, [(p, f"expected a whole number of at least 1, got {v!r}")]
    return v, []


def _whole(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return None, [(p, f"expected a whole number (0 or more), got {v!r}")]
    return v, []


def _str_list(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        return None, [(p, f"expected a list of names, got {v!r}")]
    return tuple(v), []


def _cidrs(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    val, probs = _str_list(v, p)
    if probs:
        return val, probs
    bad = []
    for i, cidr in enumerate(val):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            bad.append((p + (i,), f"not an address or CIDR: {cidr!r}"))
    return val, bad


def _split(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if isinstance(v, dict):
        if not v or not all(isinstance(x, int | float) and not isinstance(x, bool) and x >= 0
                            for x in v.values()):
            return None, [(p, f"expected device: layers entries, got {v!r}")]
        if sum(v.values()) <= 0:
            return None, [(p, "split must not be all zeros")]
        return dict(v), []
    if isinstance(v, str):
        parts = v.replace("/", ",").split(",")
        try:
            v = [float(x) if "." in x else int(x) for x in parts]
        except ValueError:
            return None, [(p, f"expected numbers like [21, 44] or '21/44', got {v!r}")]
    if not isinstance(v, list) or not v or not all(
        isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in v
    ):
        return None, [(p, f"expected a list of non-negative numbers, got {v!r}")]
    if sum(v) <= 0:
        return None, [(p, "split must not be all zeros")]
    return tuple(v), []


def _scalar_map(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if not isinstance(v, dict):
        return None, [(p, f"expected a mapping, got {v!r}")]
    bad = [(p + (k,), f"expected a scalar, got {x!r}") for k, x in v.items()
           if isinstance(x, dict | list)]
    return dict(v), bad


def _str_map(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    val, probs = _scalar_map(v, p)
    if probs or val is None:
        return val, probs
    return {k: "" if x is None else str(x) if not isinstance(x, bool) else ("1" if x else "0")
            for k, x in val.items()}, []


def _group(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    """A group this user belongs to (by name or gid): the state dir is opened to it."""
    if isinstance(v, bool) or not isinstance(v, str | int):
        return None, [(p, f"expected a group name, got {v!r}")]
    try:
        g = grp.getgrgid(v) if isinstance(v, int) else grp.getgrnam(v)
    except (KeyError, OverflowError):
        return None, [(p, f"no group {v!r} on this host")]
    if g.gr_gid != os.getgid() and g.gr_gid not in os.getgroups():
        return None, [(p, f"this user is not in group {g.gr_name!r}: hydra could not give "
                          "its files to it")]
    return g.gr_name, []


def _log_mib(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0625 <= v <= 1 << 20:
        return None, [(p, f"expected MiB between 0.0625 and 1048576, got {v!r}")]
    return float(v), []


def _log_keep(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 100:
        return None, [(p, f"expected a whole number from 1 to 100, got {v!r}")]
    return v, []


LOGS_SCHEMA: dict[str, Checker] = {
    "max_mib": _log_mib,
    "keep": _log_keep,
}


def _range(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
    if (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)
            and 0 < v[0] <= v[1] <= 65535):
        return (v[0], v[1]), []
    return None, [(p, f"expected [first, last] port numbers, got {v!r}")]


def _section(schema: Mapping[str, Checker], label: str) -> Checker:
    def check(v: Any, p: PathKey) -> tuple[Any, list[tuple[PathKey, str]]]:
        if not isinstance(v, dict):
            return None, [(p, f"expected a mapping for {label}, got {v!r}")]
        return _check_mapping(v, p, schema, label)

    return check


def _check_mapping(
    data: dict[str, Any], path: PathKey, schema: Mapping[str, Checker], label: str
) -> tuple[dict[str, Any], list[tuple[PathKey, str]]]:
    out: dict[str, Any] = {}
    problems: list[tuple[PathKey, str]] = []
    for key, value in data.items():
        checker = schema.get(key)
        if checker is None:
            close = difflib.get_close_matches(key, list(schema), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append((path + (key,), f"unknown key '{key}' in {label}{hint}; "
                             f"valid keys: {', '.join(sorted(schema))}"))
            continue
        val, probs = checker(value, path + (key,))
        problems += probs
        if not probs:
            out[key] = val
    return out, problems


RESTART_SCHEMA: dict[str, Checker] = {
    "backoff_initial": _positive,
    "backoff_max": _positive,
    "max_failures": _type(int, "an integer"),
    "window": _positive,
    "stable_after": _positive,
}

HEALTH_SCHEMA: dict[str, Checker] = {
    "interval": _positive,
    "hang_timeout": _positive,
    "stall_timeout": _positive,
    "probe": _type(bool, "true or false"),
    "probe_interval": _positive,
    "probe_timeout": _positive,
}

EXPECT_SCHEMA: dict[str, Checker] = {
    "decode_tps": _positive,
    "prefill_tps": _positive,
    "ttft_ms": _positive,
}

PROFILE_SCHEMA: dict[str, Checker] = {
    "profile": _type(str, "a name"),
    "description": _type(str, "text"),
    "model": _type(str, "a model alias or a .gguf path"),
    "mode": _enum(Mode),
    "head": _type(str, "a device name"),
    "peers": _str_list,
    "split": _split,
    "transport": _enum(Transport),
    "moe_split": _enum(MoeSplit),
    "n_cpu_moe": _type(int, "an integer"),
    "server_args": _scalar_map,
    "env": _str_map,
    "on_peer_loss": _enum(PeerLoss),
    "host": _type(str, "a bind address"),
    "port": _port,
    "load_timeout": _positive,
    "stop_grace": _positive,
    "restart": _section(RESTART_SCHEMA, "restart"),
    "health": _section(HEALTH_SCHEMA, "health"),
    "router": _type(bool, "true or false"),
    "rpc_allow": _cidrs,
    "wire_reads": _enum(WireReads),
    "expect": _section(EXPECT_SCHEMA, "expect"),
    "keep_slots": _type(bool, "true or false"),
    "aliases": _str_list,
    "on_demand": _type(bool, "true or false"),
    "ttl": _seconds,
    "min_resident": _seconds,
    "concurrency": _count,
    "queue": _whole,
    "prefill": _str_list,
    "standby": _type(str, "a profile name (the other layout of the same model)"),
}

DEVICE_SCHEMA: dict[str, Checker] = {
    "cuda": _type(int, "a CUDA device index"),
    "cpu": _type(bool, "true"),
    "endpoint": _type(str, "host:port"),
    "memory_mib": _type(int, "MiB"),
    "allow_build_mismatch": _type(bool, "true or false"),
}

NODE_DEFAULTS_SCHEMA: dict[str, Checker] = {
    "server_args": _scalar_map,
    "env": _str_map,
    "host": _type(str, "a bind address"),
    "load_timeout": _positive,
    "stop_grace": _positive,
    "on_peer_loss": _enum(PeerLoss),
    "restart": _section(RESTART_SCHEMA, "restart"),
    "health": _section(HEALTH_SCHEMA, "health"),
    "on_demand": _type(bool, "true or false"),
    "ttl": _seconds,
    "min_resident": _seconds,
    "concurrency": _count,
    "queue": _whole,
}

# Always defined (a node file may redefine them): the host CPU as a head device, and the host CPU
# behind a local ggml-rpc-server as a peer device (for demos and tests on CPU-only machines).
BUILTIN_DEVICES = {
    "cpu": DeviceDecl(name="cpu", cpu=True),
    "cpu-peer": DeviceDecl(name="cpu-peer", cpu=True),
}

BINARY_NAMES = ("llama-server", "ggml-rpc-server", "llama-bench")

NODE_SCHEMA: dict[str, Checker] = {
    "devices": _type(dict, "a mapping of device name to {cuda: N} / {cpu: true} / {endpoint: h:p}"),
    "binaries": _section({b: _type(str, "a path") for b in (*BINARY_NAMES, "bin_dir")}, "binaries"),
    "models": _str_map,
    "model_dirs": _str_list,
    "rpc_ports": _range,
    "internal_ports": _range,
    "defaults": _section(NODE_DEFAULTS_SCHEMA, "defaults"),
    "profiles": _str_list,
    "default_profile": _type(str, "a profile name"),
    "state_group": _group,
    "logs": _section(LOGS_SCHEMA, "logs"),
}


def _raise(src: Sourced, problems: list[tuple[PathKey, str]]) -> None:
    if not problems:
        return
    lines = [f"{src.where(p)}: {'.'.join(str(x) for x in p) or '<top>'}: {msg}"
             for p, msg in problems]
    head = f"{len(problems)} problem(s) in {src.file}:" if len(problems) > 1 else ""
    raise ConfigError("\n".join(([head] if head else []) + lines))


# ---------------------------------------------------------------------------------------------
# Node file


def default_node() -> Node:
    """No node file: the CPU plus every local GPU the inventory finds (named gpu0, gpu1, ...)."""
    return Node(source="<built-in>", devices=dict(BUILTIN_DEVICES))


def find_node_file(explicit: str | None) -> Path | None:
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise HydraError(f"node file {path} does not exist")
        return path
    env = os.environ.get("HYDRA_NODE")
    if env:
        path = Path(env)
        if not path.is_file():
            raise HydraError(f"node file {path} (from $HYDRA_NODE) does not exist")
        return path
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    home = config / "hydra" / "node.yaml"
    return home if home.is_file() else None


def load_node(path: Path | None) -> Node:
    if path is None:
        return default_node()
    src = load_file(path)
    data = src.data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{src.where(())}: a node file is a mapping; got {type(data).__name__}")
    checked, problems = _check_mapping(data, (), NODE_SCHEMA, "node file")
    devices: dict[str, DeviceDecl] = dict(BUILTIN_DEVICES)
    for name, spec in (checked.get("devices") or {}).items():
        p: PathKey = ("devices", name)
        if not isinstance(spec, dict):
            problems.append((p, "expected {cuda: N}, {cpu: true} or {endpoint: host:port}"))
            continue
        dev, probs = _check_mapping(spec, p, DEVICE_SCHEMA, f"device '{name}'")
        kinds = [k for k in ("cuda", "cpu", "endpoint") if k in dev]
        if not probs and len(kinds) != 1:
            probs.append((p, "give exactly one of cuda, cpu, endpoint"))
        if "endpoint" in dev and ":" not in dev["endpoint"]:
            probs.append((p + ("endpoint",), f"expected host:port, got {dev['endpoint']!r}"))
        if "allow_build_mismatch" in dev and "endpoint" not in dev:
            probs.append((p + ("allow_build_mismatch",), "only for a remote peer (a device "
                          "with endpoint:); local devices always run this host's build"))
        problems += probs
        if not probs:
            devices[name] = DeviceDecl(name=name, **dev)
    _raise(src, problems)
    binaries = dict(checked.get("binaries") or {})
    return Node(
        source=str(path),
        devices=devices,
        binaries=binaries,
        models=checked.get("models", {}),
        model_dirs=checked.get("model_dirs", ()),
        rpc_ports=checked.get("rpc_ports", Node.rpc_ports),
        internal_ports=checked.get("internal_ports", Node.internal_ports),
        defaults=checked.get("defaults", {}),
        profiles=checked.get("profiles", ()),
        default_profile=checked.get("default_profile"),
        state_group=checked.get("state_group"),
        log_max_mib=(checked.get("logs") or {}).get("max_mib", Node.log_max_mib),
        log_keep=(checked.get("logs") or {}).get("keep", Node.log_keep),
    )


# ---------------------------------------------------------------------------------------------
# Profiles


def profile_dirs(extra: str | None = None) -> list[Path]:
    """Where profiles are looked up, first match wins."""
    dirs: list[Path] = []
    if extra:
        dirs.append(Path(extra))
    for part in filter(None, os.environ.get("HYDRA_PROFILE_PATH", "").split(os.pathsep)):
        dirs.append(Path(part))
    dirs.append(Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
                / "hydra" / "profiles")
    dirs.append(repo_root() / "profiles")
    return dirs


def known_profiles(extra: str | None = None) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in profile_dirs(extra):
        if d.is_dir():
            for f in sorted(d.glob("*.yaml")):
                found.setdefault(f.stem, f)
    return found


def find_profile(name_or_path: str, extra: str | None = None) -> Path:
    as_path = Path(name_or_path)
    if as_path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if as_path.is_file():
            return as_path
        raise HydraError(f"profile file {as_path} does not exist")
    known = known_profiles(extra)
    if name_or_path in known:
        return known[name_or_path]
    close = difflib.get_close_matches(name_or_path, list(known), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    searched = ", ".join(str(d) for d in profile_dirs(extra))
    raise HydraError(
        f"unknown profile '{name_or_path}'.{hint} Known profiles: "
        f"{', '.join(sorted(known)) or '(none)'}",
        hint=f"profiles are read from {searched}",
    )


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if key in ("server_args", "env", "restart", "health") and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def load_profile(path: Path, node: Node, overrides: Mapping[str, Any] | None = None) -> Profile:
    src = load_file(path)
    data = src.data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{src.where(())}: a profile is a mapping; got {type(data).__name__}")
    checked, problems = _check_mapping(data, (), PROFILE_SCHEMA, "profile")
    if "model" not in data and data.get("mode") != "peer":
        problems.append(((), "missing required key 'model' (an alias such as gemma3-270m, "
                         "or a path to a .gguf file)"))
    if "split" in data and data.get("mode", Mode.SOLO.value) == Mode.SOLO.value:
        # Refused, not ignored: a SOLO profile runs everything on its head; a split there is a
        # leftover of a COMBINE profile or a missing `mode: combine`.
        problems.append((("split",), "used only with mode: combine, and this profile is "
                         "mode: solo (every layer on its head): remove split, or set "
                         "mode: combine with peers"))
    if "prefill" in data and data.get("mode") != Mode.PEER.value:
        # Only a peer host runs a ggml-rpc-server whose cache it fills; a head sends weights.
        problems.append((("prefill",), "used only with mode: peer (it fills this host's "
                         "ggml-rpc-server cache so a head elsewhere need not send the weights); "
                         "remove it, or put it in the peer host's profile"))
    standby = data.get("standby")
    if isinstance(standby, str) and standby in (data.get("profile", path.stem), path.stem):
        problems.append((("standby",), "names this profile itself: give the profile of the "
                         "other layout of the same model (e.g. its SOLO), or remove standby"))
    if "standby" in data and data.get("mode") == Mode.PEER.value:
        problems.append((("standby",), "not with mode: peer (a peer serves no HTTP model to "
                         "switch); remove standby"))
    _raise(src, problems)
    merged = _merge(node.defaults, checked)
    merged = _merge(merged, dict(overrides or {}))
    _check_peer_trust(src, merged, data, overrides or {}, node)
    name = merged.pop("profile", path.stem)
    restart = merged.pop("restart", {})
    health = merged.pop("health", {})
    return Profile(
        name=name,
        source=str(path),
        restart=RestartPolicy(**restart),
        health=HealthPolicy(**health),
        **merged,
    )


def is_loopback_host(host: str) -> bool:
    """True for a bind address that only this host can reach (127.0.0.0/8, ::1, localhost);
    "0.0.0.0", "::", "" (every interface) and other names are not."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _check_peer_trust(src: Sourced, merged: Mapping[str, Any], data: Mapping[str, Any],
                      overrides: Mapping[str, Any], node: Node) -> None:
    """A `mode: peer` profile lends a device over ggml-RPC, which has no authentication: bound
    beyond loopback it must say who may use it (an explicit `rpc_allow`), never fall back to a
    default (docs/multi-host.md "Trust")."""
    if merged.get("mode") is not Mode.PEER:
        return
    host = str(merged.get("host", Profile.host))
    if is_loopback_host(host) or "rpc_allow" in data or "rpc_allow" in overrides:
        return
    if "host" in overrides:
        origin = "--host on the command line"
    elif "host" in data:
        origin = "its host: key"
    else:
        origin = f"the node file's defaults ({node.source})"
    where = src.where(("host",) if "host" in data else ("mode",))
    raise ConfigError(
        f"{where}: mode: peer lends a device over ggml-RPC, which has no authentication, and "
        f"this profile binds {host!r} ({origin}), beyond loopback, without an rpc_allow: "
        f"add the networks of the head hosts that may use it to {src.file}, e.g. "
        f"`rpc_allow: [127.0.0.0/8, 192.168.122.0/24]` (only those sources get ggml-RPC and "
        f"Hydra frames through the router; see docs/multi-host.md), or bind 127.0.0.1 and "
        f"reach it through a tunnel")


def with_overrides(profile: Profile, **changes: Any) -> Profile:
    return replace(profile, **{k: v for k, v in changes.items() if v is not None})
