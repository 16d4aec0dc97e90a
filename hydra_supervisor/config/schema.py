"""The profile and node file schema: a key table per section, the type checks behind it, and
the problems they find, each reported with file:line and its YAML path (an unknown key lists the
valid ones, with a did-you-mean). Every problem is collected before one ConfigError is raised.
"""

from __future__ import annotations

import difflib
import grp
import ipaddress
import os
from collections.abc import Callable, Mapping
from enum import Enum
from typing import TypedDict

from hydra_supervisor.config.profile import (
    Mode,
    MoeSplit,
    PeerLoss,
    TlsFiles,
    Transport,
    WireReads,
    name_problem,
)
from hydra_supervisor.config.yamlsrc import PathKey, Sourced
from hydra_supervisor.errors import ConfigError
from hydra_supervisor.router import affinity

# ---------------------------------------------------------------------------------------------
# A tiny declarative validator: each key maps to a checker that returns (value, problems).

Problems = list[tuple[PathKey, str]]
Checked = tuple[object, Problems]  # the checked value (None when there are problems), problems
Checker = Callable[[object, PathKey], Checked]


def _type(kind: type | tuple[type, ...], label: str) -> Checker:
    def check(v: object, p: PathKey) -> Checked:
        if isinstance(v, bool) and kind is not bool and bool not in (
            kind if isinstance(kind, tuple) else (kind,)
        ):
            return None, [(p, f"expected {label}, got {v!r}")]
        if not isinstance(v, kind):
            return None, [(p, f"expected {label}, got {v!r}")]
        return v, []

    return check


def _name(v: object, p: PathKey) -> Checked:
    """A profile's name: it is used in file names (logs/NAME.log), so bounded (profile.py)."""
    if not isinstance(v, str):
        return None, [(p, f"expected a name, got {v!r}")]
    why = name_problem(v)
    return (None, [(p, why)]) if why else (v, [])


def _enum(enum: type[Enum]) -> Checker:
    choices = [e.value for e in enum]

    def check(v: object, p: PathKey) -> Checked:
        try:
            return enum(v), []
        except ValueError:
            return None, [(p, f"must be one of {', '.join(choices)}; got {v!r}")]

    return check


def _port(v: object, p: PathKey) -> Checked:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
        return None, [(p, f"expected a port number 0-65535, got {v!r}")]
    return v, []


def _positive(v: object, p: PathKey) -> Checked:
    if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
        return None, [(p, f"expected a positive number, got {v!r}")]
    return float(v), []


def _seconds(v: object, p: PathKey) -> Checked:
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        return None, [(p, f"expected a number of seconds (0 or more), got {v!r}")]
    return float(v), []


def _count(v: object, p: PathKey) -> Checked:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return None, [(p, f"expected a whole number of at least 1, got {v!r}")]
    return v, []


def _whole(v: object, p: PathKey) -> Checked:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return None, [(p, f"expected a whole number (0 or more), got {v!r}")]
    return v, []


def _str_list(v: object, p: PathKey) -> Checked:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        return None, [(p, f"expected a list of names, got {v!r}")]
    return tuple(v), []


def _cidrs(v: object, p: PathKey) -> Checked:
    val, probs = _str_list(v, p)
    if probs or not isinstance(val, tuple):
        return val, probs
    bad = []
    for i, cidr in enumerate(val):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            bad.append((p + (i,), f"not an address or CIDR: {cidr!r}"))
    return val, bad


TLS_KEYS = ("ca", "cert", "key")
TLS_LABEL = "{ca: PATH, cert: PATH, key: PATH} (PEM files: the hydra hosts' CA, this host's " \
    "certificate and its key)"


def _tls(v: object, p: PathKey) -> Checked:
    """A ``tls:`` section: the three PEM paths as given (config.py resolves and checks them)."""
    if not isinstance(v, dict):
        return None, [(p, f"expected {TLS_LABEL}, got {v!r}")]
    probs: Problems = [(p + (k,), f"unknown key '{k}'; valid keys: {', '.join(TLS_KEYS)}")
                       for k in v if k not in TLS_KEYS]
    for k in TLS_KEYS:
        if k not in v:
            probs.append((p, f"missing '{k}': expected {TLS_LABEL}"))
        elif not isinstance(v[k], str) or not v[k]:
            probs.append((p + (k,), f"expected a path, got {v[k]!r}"))
    if probs:
        return None, probs
    return TlsFiles(ca=v["ca"], cert=v["cert"], key=v["key"]), []


def _split(v: object, p: PathKey) -> Checked:
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


def _scalar_map(v: object, p: PathKey) -> Checked:
    if not isinstance(v, dict):
        return None, [(p, f"expected a mapping, got {v!r}")]
    bad = [(p + (k,), f"expected a scalar, got {x!r}") for k, x in v.items()
           if isinstance(x, dict | list)]
    return dict(v), bad


def _str_map(v: object, p: PathKey) -> Checked:
    val, probs = _scalar_map(v, p)
    if probs or not isinstance(val, dict):  # (None with problems)
        return val, probs
    return {k: "" if x is None else str(x) if not isinstance(x, bool) else ("1" if x else "0")
            for k, x in val.items()}, []


def _group(v: object, p: PathKey) -> Checked:
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


def _log_mib(v: object, p: PathKey) -> Checked:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0625 <= v <= 1 << 20:
        return None, [(p, f"expected MiB between 0.0625 and 1048576, got {v!r}")]
    return float(v), []


def _log_keep(v: object, p: PathKey) -> Checked:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 100:
        return None, [(p, f"expected a whole number from 1 to 100, got {v!r}")]
    return v, []


def _cpus(v: object, p: PathKey) -> Checked:
    """``auto``, ``all`` or a list of CPU numbers this process may run on (router/affinity.py)."""
    allowed = frozenset(os.sched_getaffinity(0))
    valid = f"auto, all or a list of CPU numbers from those this process may run on " \
            f"({affinity.span(allowed)})"
    if v in (affinity.AUTO, affinity.ALL):
        return v, []
    if isinstance(v, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in v):
        try:  # none, or one this process may not run on: ValueError
            return tuple(sorted(affinity.choose(v, allowed, "") or ())), []
        except ValueError:
            pass
    return None, [(p, f"must be {valid}; got {v!r}")]


LOGS_SCHEMA: dict[str, Checker] = {
    "max_mib": _log_mib,
    "keep": _log_keep,
}


def _range(v: object, p: PathKey) -> Checked:
    if (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)
            and 0 < v[0] <= v[1] <= 65535):
        return (v[0], v[1]), []
    return None, [(p, f"expected [first, last] port numbers, got {v!r}")]


def _section(schema: Mapping[str, Checker], label: str) -> Checker:
    def check(v: object, p: PathKey) -> Checked:
        if not isinstance(v, dict):
            return None, [(p, f"expected a mapping for {label}, got {v!r}")]
        return check_mapping(v, p, schema, label)

    return check


def check_mapping(
    data: Mapping[str, object], path: PathKey, schema: Mapping[str, Checker], label: str
) -> tuple[dict[str, object], Problems]:
    out: dict[str, object] = {}
    problems: Problems = []
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
    "profile": _name,
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
    "tls": _tls,
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
    "spares": _str_list,
    "tls": _tls,
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
    "router_cpus": _cpus,
}


# ---------------------------------------------------------------------------------------------
# What check_mapping returns for each table, as types (the checkers above guarantee them): the
# loader (config.py) casts a checked mapping to its shape before it builds the dataclasses.


class LogsFields(TypedDict, total=False):
    max_mib: float
    keep: int


class DeviceFields(TypedDict, total=False):
    cuda: int
    cpu: bool
    endpoint: str
    memory_mib: int
    allow_build_mismatch: bool
    spares: tuple[str, ...]
    tls: TlsFiles


class NodeFields(TypedDict, total=False):
    devices: dict[str, object]  # each checked on its own against DEVICE_SCHEMA
    binaries: dict[str, str]
    models: dict[str, str]
    model_dirs: tuple[str, ...]
    rpc_ports: tuple[int, int]
    internal_ports: tuple[int, int]
    defaults: dict[str, object]
    profiles: tuple[str, ...]
    default_profile: str
    state_group: str
    logs: LogsFields
    router_cpus: str | tuple[int, ...]


class RestartFields(TypedDict, total=False):
    backoff_initial: float
    backoff_max: float
    max_failures: int
    window: float
    stable_after: float


class HealthFields(TypedDict, total=False):
    interval: float
    hang_timeout: float
    stall_timeout: float
    probe: bool
    probe_interval: float
    probe_timeout: float


class ProfileFields(TypedDict, total=False):
    """A checked profile less `profile` (its name), `restart` and `health` (their own
    dataclasses): the keyword arguments of config.Profile."""

    description: str
    model: str
    mode: Mode
    head: str
    peers: tuple[str, ...]
    split: tuple[int | float, ...] | dict[str, int | float]
    transport: Transport
    moe_split: MoeSplit
    n_cpu_moe: int
    server_args: dict[str, object]
    env: dict[str, str]
    on_peer_loss: PeerLoss
    host: str
    port: int
    load_timeout: float
    stop_grace: float
    router: bool
    rpc_allow: tuple[str, ...]
    tls: TlsFiles
    wire_reads: WireReads
    expect: dict[str, float]
    keep_slots: bool
    aliases: tuple[str, ...]
    on_demand: bool
    ttl: float
    min_resident: float
    concurrency: int
    queue: int
    prefill: tuple[str, ...]
    standby: str


def raise_problems(src: Sourced, problems: Problems) -> None:
    if not problems:
        return
    lines = [f"{src.where(p)}: {'.'.join(str(x) for x in p) or '<top>'}: {msg}"
             for p, msg in problems]
    head = f"{len(problems)} problem(s) in {src.file}:" if len(problems) > 1 else ""
    raise ConfigError("\n".join(([head] if head else []) + lines))

