"""Who may drive the wire protocol: the peer's uid on this host, or the owner's token.

Loopback is every user on the host, so the router's allow list (`rpc_allow`) cannot tell hydra's
owner from anyone else. The wire server therefore authenticates each connection before it lets a
frame change anything (docs/protocol.md "Trust model"):

- **The peer's uid.** For a TCP peer on this host, the kernel lists the client's own socket in
  `/proc/net/tcp` (or `tcp6`) with the uid that owns it; `peer_uid()` finds the entry whose local
  address is the client's address:port and whose remote address is hydra's, and reads its uid
  column. TCP has no SO_PEERCRED; this is what `ss -tne` shows. An entry without a socket inode
  (an orphan after close, TIME_WAIT: the kernel reports those as uid 0) is not trusted. A unix
  socket peer is read with SO_PEERCRED.
- **The token.** A random secret in `STATE/wire.token` (mode 0600, created at start, kept across
  restarts while it stays private to the owner). A client that can read it presents it in the
  request's trace-id field: `hydra-token:<hex>` optionally followed by a space and the real
  trace id. The trace field is free text to Hydra.Core (for log correlation), so this breaks no
  client; a connection that presented it once is authenticated until it closes.

Authenticated = uid equal to hydra's (or root's, which can read the token anyway), or the token.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
import struct
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from hydra_supervisor.proc import filemodes

log = logging.getLogger("hydra.wire")

TOKEN_FILE = filemodes.TOKEN_FILE  # "wire.token"
TOKEN_PREFIX = "hydra-token:"
TOKEN_BYTES = 32  # 64 hex digits

# Read policies for INFO, STATE_GET and STATE_META (the profile's `wire_reads`).
READS_ALLOW_LIST = "allow_list"  # any source the router let in (its allow list)
READS_OWNER = "owner"  # only an authenticated client, as for the ops that change things
READ_POLICIES = (READS_ALLOW_LIST, READS_OWNER)

_IP = ipaddress.IPv4Address | ipaddress.IPv6Address


# --------------------------------------------------------------------------- the uid lookup


def _norm(ip: _IP) -> _IP:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _endpoint(addr: object) -> tuple[_IP, int] | None:
    """(address, port) of a socket address tuple, v4-mapped IPv6 judged as IPv4."""
    a = cast("tuple[object, object]", addr)  # anything else: the TypeError below
    try:
        return _norm(ipaddress.ip_address(str(a[0]).split("%", 1)[0])), int(cast(int, a[1]))
    except (ValueError, IndexError, TypeError):
        return None


def _parse_hex_endpoint(text: str) -> tuple[_IP, int]:
    """`0100007F:1F90` (IPv4) or 32 hex digits + port (IPv6), as /proc/net/tcp* print them:
    the address as 32-bit words in the kernel's byte order, the port in hex."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if sys.byteorder == "little":  # each 32-bit word was printed as a native integer
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip: _IP = (ipaddress.IPv4Address(raw) if len(raw) == 4 else ipaddress.IPv6Address(raw))
    return _norm(ip), int(port, 16)


def peer_uid(peer: object, local: object, proc_net: Path = Path("/proc/net")) -> int | None:
    """The uid owning the TCP socket at the other end of one of our connections, or None when
    it is not a socket of this host (network namespace) or cannot be told.

    `peer` is the client's address (what accept/getpeername gave us), `local` ours
    (getsockname). The client's socket is the entry whose local address is `peer` and whose
    remote address is `local`."""
    want_local, want_remote = _endpoint(peer), _endpoint(local)
    if want_local is None or want_remote is None:
        return None
    port_hex = f":{want_local[1]:04X}"  # a cheap filter before parsing: the client's port
    for name in ("tcp", "tcp6"):
        try:
            text = (proc_net / name).read_text()
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) < 10 or not cols[1].endswith(port_hex):
                continue
            try:
                if (_parse_hex_endpoint(cols[1]) != want_local
                        or _parse_hex_endpoint(cols[2]) != want_remote):
                    continue
                uid, inode = int(cols[7]), int(cols[9])
            except ValueError:
                continue
            if inode == 0:  # orphaned (closed) or TIME_WAIT: the uid column reads 0 there
                return None
            return uid
    return None


def socket_peer_uid(sock: socket.socket, peer: object = None) -> int | None:
    """The uid of whoever is at the other end of `sock` (a unix socket: SO_PEERCRED; TCP: the
    /proc/net/tcp lookup), or None."""
    try:
        if sock.family == socket.AF_UNIX:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            return int(struct.unpack("3i", creds)[1])
        return peer_uid(peer if peer is not None else sock.getpeername(), sock.getsockname())
    except OSError:
        return None


# --------------------------------------------------------------------------------- the token


def ensure_token(state_dir: Path) -> tuple[Path, str]:
    """The token file in `state_dir` (mode 0600, ours, whatever `state_group` opens: it drives
    hydra), read when it is one, else created once with its final mode (a new file renamed into
    place): a file that is not a private regular file of ours, or not a token, is replaced by a
    fresh one. The same token across restarts while the file stays so."""
    path = state_dir / TOKEN_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
                    and stat.S_IMODE(st.st_mode) & 0o077 == 0):
                token = f.read(4 * TOKEN_BYTES).decode(errors="replace").strip()
                if is_token(token):
                    return path, token
        log.warning("wire: %s is not a private token file of this user; writing a new one",
                    path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # a link (ELOOP), unreadable: replaced below
        log.warning("wire: %s cannot be read (%s); writing a new one", path,
                    exc.strerror or exc)
    token = secrets.token_hex(TOKEN_BYTES)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return path, token


def is_token(text: str) -> bool:
    """`text` is a token as ensure_token writes it (64 lowercase hex digits)."""
    return len(text) == 2 * TOKEN_BYTES and all(c in "0123456789abcdef" for c in text)


def split_trace(trace: str) -> tuple[str | None, str]:
    """(token or None, the trace id proper) from a request's trace field."""
    if not trace.startswith(TOKEN_PREFIX):
        return None, trace
    token, _, rest = trace[len(TOKEN_PREFIX):].partition(" ")
    return token, rest


def with_token(token: str | None, trace: str = "") -> str:
    """The trace field a client sends to present `token`."""
    if not token:
        return trace
    return f"{TOKEN_PREFIX}{token}" + (f" {trace}" if trace else "")


# ---------------------------------------------------------------------------------- the policy


@dataclass
class Identity:
    """What the wire server knows about one connection's client."""

    peer: object = None  # the socket address accept() gave (a (host, port) tuple for TCP)
    local: object = None
    sock: socket.socket | None = None
    uid: int | None = None
    uid_known: bool = False  # looked up (lazily: only a gated frame needs it)
    token_ok: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def lookup_uid(self) -> int | None:
        with self.lock:
            if not self.uid_known:
                if self.sock is not None:
                    self.uid = socket_peer_uid(self.sock, self.peer)
                self.uid_known = True
            return self.uid

    def describe(self) -> str:
        where = self.peer if not isinstance(self.peer, tuple) else (
            f"{self.peer[0]}:{self.peer[1]}" if len(self.peer) >= 2 else str(self.peer))
        uid = f"uid {self.uid}" if self.uid is not None else "uid unknown"
        return f"{where or 'a unix socket'} ({uid})"


class Trust:
    """The wire server's authentication policy: owner uid(s), the token, the read policy;
    counts refusals and logs the first of each reason."""

    def __init__(self, *, token: str | None = None, owner_uids: tuple[int, ...] | None = None,
                 reads: str = READS_ALLOW_LIST) -> None:
        self.token = token
        euid = os.geteuid()
        self.owner_uids = owner_uids if owner_uids is not None else tuple({euid, 0})
        self.reads = reads
        self._lock = threading.Lock()
        self.refused: Counter[str] = Counter()

    def present(self, ident: Identity, trace: str) -> None:
        """Note a token presented in a frame's trace field (constant-time compare)."""
        given, _ = split_trace(trace)
        if given is None or ident.token_ok or not self.token:
            return
        if hmac.compare_digest(given.encode(), self.token.encode()):
            ident.token_ok = True
        else:
            self.refuse("bad_token", f"{ident.describe()} presented a wrong token")

    def authenticated(self, ident: Identity) -> bool:
        if ident.token_ok:
            return True
        uid = ident.lookup_uid()
        return uid is not None and uid in self.owner_uids

    def reads_need_auth(self, policy: str | None = None) -> bool:
        return (policy or self.reads) == READS_OWNER

    def refuse(self, reason: str, detail: str) -> None:
        with self._lock:
            self.refused[reason] += 1
            first = self.refused[reason] == 1
        if first:
            log.warning("wire: refused (%s): %s; further refusals for this reason are "
                        "counted in the wire server's stats, not logged", reason, detail)

    def why(self, ident: Identity, what: str) -> str:
        return (f"{what} needs an authenticated client: connect as hydra's own user "
                f"(uid {os.geteuid()}) from this host, or present the token from "
                f"STATE/{TOKEN_FILE} in the trace field ({TOKEN_PREFIX}<token>); this client "
                f"is {ident.describe()}")
