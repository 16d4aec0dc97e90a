"""Profiles and the node file: find, load, validate and layer them into frozen dataclasses.

Layering (later wins): built-in defaults < node file (`defaults:` block) < profile < command-line
overrides. Validation collects *every* problem, each with file:line and its YAML path, and an
unknown key lists the valid ones (with a did-you-mean). See docs/profiles.md for the schema.

This module finds and loads the files and layers them; the dataclasses are in profile.py, the
key tables and checks in schema.py.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from hydra_supervisor.config import infile
from hydra_supervisor.config.paths import repo_root

# The dataclasses and enums live in profile.py. Re-exported (`X as X`) because they are imported
# in many places, some still as `from hydra_supervisor.config.config import Profile`.
from hydra_supervisor.config.profile import DeviceDecl as DeviceDecl
from hydra_supervisor.config.profile import HealthPolicy as HealthPolicy
from hydra_supervisor.config.profile import Mode as Mode
from hydra_supervisor.config.profile import MoeSplit as MoeSplit
from hydra_supervisor.config.profile import Node as Node
from hydra_supervisor.config.profile import PeerLoss as PeerLoss
from hydra_supervisor.config.profile import Profile as Profile
from hydra_supervisor.config.profile import RestartPolicy as RestartPolicy
from hydra_supervisor.config.profile import TlsFiles as TlsFiles
from hydra_supervisor.config.profile import Transport as Transport
from hydra_supervisor.config.profile import WireReads as WireReads
from hydra_supervisor.config.profile import name_problem
from hydra_supervisor.config.schema import (
    DEVICE_SCHEMA,
    NODE_SCHEMA,
    PROFILE_SCHEMA,
    DeviceFields,
    HealthFields,
    NodeFields,
    Problems,
    ProfileFields,
    RestartFields,
    check_mapping,
    raise_problems,
)
from hydra_supervisor.config.yamlsrc import PathKey, Sourced, load_file
from hydra_supervisor.errors import ConfigError, HydraError

# Always defined (a node file may redefine them): the host CPU as a head device, and the host CPU
# behind a local ggml-rpc-server as a peer device (for demos and tests on CPU-only machines).
BUILTIN_DEVICES = {
    "cpu": DeviceDecl(name="cpu", cpu=True),
    "cpu-peer": DeviceDecl(name="cpu-peer", cpu=True),
}


# ---------------------------------------------------------------------------------------------
# Node file


def default_node() -> Node:
    """No node file: the CPU plus every local GPU the inventory finds (named gpu0, gpu1, ...)."""
    return Node(source="<built-in>", devices=dict(BUILTIN_DEVICES))


def find_node_file(explicit: str | None) -> Path | None:
    if explicit:
        return infile.check(Path(explicit), "node file")
    env = os.environ.get("HYDRA_NODE")
    if env:
        return infile.check(Path(env), "node file ($HYDRA_NODE)")
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
    checked_, problems = check_mapping(data, (), NODE_SCHEMA, "node file")
    checked = cast(NodeFields, checked_)
    devices: dict[str, DeviceDecl] = dict(BUILTIN_DEVICES)
    for name, spec in (checked.get("devices") or {}).items():
        p: PathKey = ("devices", name)
        bad = name_problem(str(name))
        if bad:
            problems.append((p, f"device {bad} (device names go into process and log file "
                                "names)"))
            continue
        if not isinstance(spec, dict):
            problems.append((p, "expected {cuda: N}, {cpu: true} or {endpoint: host:port}"))
            continue
        dev_, probs = check_mapping(spec, p, DEVICE_SCHEMA, f"device '{name}'")
        dev = cast(DeviceFields, dev_)
        kinds = [k for k in ("cuda", "cpu", "endpoint") if k in dev]
        if not probs and len(kinds) != 1:
            probs.append((p, "give exactly one of cuda, cpu, endpoint"))
        if "endpoint" in dev and ":" not in dev["endpoint"]:
            probs.append((p + ("endpoint",), f"expected host:port, got {dev['endpoint']!r}"))
        if "allow_build_mismatch" in dev and "endpoint" not in dev:
            probs.append((p + ("allow_build_mismatch",), "only for a remote peer (a device "
                          "with endpoint:); local devices always run this host's build"))
        probs += _spares_problems(dev, p)
        if "tls" in dev:
            if "endpoint" not in dev:
                probs.append((p + ("tls",), "only for a remote peer (a device with "
                              "endpoint:): hydra reaches that host's router over TLS"))
            else:
                dev["tls"], unreadable = tls_files(dev["tls"], Path(src.file).parent,
                                                   p + ("tls",))
                probs += unreadable
        problems += probs
        if not probs:
            devices[name] = DeviceDecl(name=name, **dev)
    raise_problems(src, problems)
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
        router_cpus=checked.get("router_cpus", Node.router_cpus),
    )


# ---------------------------------------------------------------------------------------------
# Profiles


def _spares_problems(dev: DeviceFields, p: PathKey) -> list[tuple[PathKey, str]]:
    """A remote device's `spares:` (alternate endpoints, plan/spares.py): host:port each, not
    the endpoint again, none twice, and only beside an `endpoint:`."""
    spares = dev.get("spares")
    if spares is None:
        return []
    at = p + ("spares",)
    if "endpoint" not in dev:
        return [(at, "only for a remote peer (a device with endpoint:): alternate "
                 "endpoints of the same peer role")]
    probs: list[tuple[PathKey, str]] = []
    seen = {dev["endpoint"]}
    for i, ep in enumerate(spares):
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            probs.append((at + (i,), f"expected host:port, got {ep!r}"))
        elif ep in seen:
            probs.append((at + (i,), f"{ep} is named twice (the endpoint or an earlier spare)"))
        seen.add(ep)
    return probs


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
        return infile.check(as_path, "profile file")
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


def _merge(base: Mapping[str, object], over: Mapping[str, object]) -> dict[str, object]:
    out = dict(base)
    for key, value in over.items():
        prev = out.get(key)
        if key in ("server_args", "env", "restart", "health") and isinstance(prev, dict):
            out[key] = {**prev, **cast("Mapping[str, object]", value)}
        else:
            out[key] = value
    return out


def load_profile(path: Path, node: Node, overrides: Mapping[str, object] | None = None
                 ) -> Profile:
    src = load_file(path)
    data = src.data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{src.where(())}: a profile is a mapping; got {type(data).__name__}")
    checked, problems = check_mapping(data, (), PROFILE_SCHEMA, "profile")
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
    if "profile" not in data and name_problem(path.stem):
        problems.append(((), f"this profile is named by its file name, and "
                         f"{name_problem(path.stem)}: rename the file, or give it "
                         "`profile: NAME`"))
    standby = data.get("standby")
    if isinstance(standby, str) and standby in (data.get("profile", path.stem), path.stem):
        problems.append((("standby",), "names this profile itself: give the profile of the "
                         "other layout of the same model (e.g. its SOLO), or remove standby"))
    if "tls" in data and data.get("mode") != Mode.PEER.value:
        problems.append((("tls",), "used only with mode: peer (the peer host's router then "
                         "takes TLS only); a head host names TLS on its remote device in the "
                         "node file: devices: {NAME: {endpoint: HOST:PORT, tls: {...}}}"))
    elif isinstance(checked.get("tls"), TlsFiles):
        checked["tls"], unreadable = tls_files(cast(TlsFiles, checked["tls"]),
                                               Path(src.file).parent, ("tls",))
        problems += unreadable
    if "standby" in data and data.get("mode") == Mode.PEER.value:
        problems.append((("standby",), "not with mode: peer (a peer serves no HTTP model to "
                         "switch); remove standby"))
    raise_problems(src, problems)
    merged = _merge(node.defaults, checked)
    merged = _merge(merged, dict(overrides or {}))
    _check_peer_trust(src, merged, data, overrides or {}, node)
    # The checked keys (schema.ProfileFields) and the overrides (port, host) as they were.
    name = cast(str, merged.pop("profile", path.stem))
    restart = cast(RestartFields, merged.pop("restart", {}))
    health = cast(HealthFields, merged.pop("health", {}))
    return Profile(
        name=name,
        source=str(path),
        restart=RestartPolicy(**restart),
        health=HealthPolicy(**health),
        **cast(ProfileFields, merged),
    )


def tls_files(files: TlsFiles, base: Path, p: PathKey) -> tuple[TlsFiles, Problems]:
    """``files`` with each path made absolute (a relative one is relative to the YAML file's
    directory, ``base``), and a problem for each that is not a readable file."""
    out: dict[str, str] = {}
    probs: Problems = []
    for key in ("ca", "cert", "key"):
        path = Path(os.path.expanduser(getattr(files, key)))
        path = path if path.is_absolute() else base / path
        out[key] = str(path)
        if not path.is_file():
            probs.append((p + (key,), f"no such file: {path} (make the CA and host "
                          "certificates with openssl: docs/multi-host.md \"Over a network "
                          "you do not trust\")"))
        elif not os.access(path, os.R_OK):
            probs.append((p + (key,), f"{path} is not readable by this user"))
    return TlsFiles(**out), probs


def is_loopback_host(host: str) -> bool:
    """True for a bind address that only this host can reach (127.0.0.0/8, ::1, localhost);
    "0.0.0.0", "::", "" (every interface) and other names are not."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _check_peer_trust(src: Sourced, merged: Mapping[str, object], data: Mapping[str, object],
                      overrides: Mapping[str, object], node: Node) -> None:
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

