"""One client connection and where it goes: the upstream addresses, the allow list's view of a
source address, the per-connection state the acceptor and relay threads share, and the queue of
connections that have not spoken yet ("silent"), from which the oldest is evicted first, with
the acceptor's three queues (``Queues``: silent, waiting for a relay slot, lingering).

No threads and no I/O policy here; router/acceptor.py and router/relay.py own those.
"""

from __future__ import annotations

import collections
import ipaddress
import selectors
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from hydra_supervisor.router.classify import Kind

Addr = tuple[str, int]
# A socket address as accept() and getsockname() give it: (host, port) for IPv4, (host, port,
# flowinfo, scope_id) for IPv6, a path (or "") for a Unix socket (tests hand the router those).
SockAddr = tuple[str, int] | tuple[str, int, int, int] | str
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# TCP keepalive on client sockets: a peer host that vanished (power, network) is found in
# about IDLE + INTVL * CNT = 2 minutes, without timing out a live but quiet ggml-RPC link.
_KEEPIDLE_S, _KEEPINTVL_S, _KEEPCNT = 60, 10, 6
# A ggml-RPC client is held tighter: its rpc-server serves one client at a time, so a head host
# that vanished without a FIN or RST (power lost, cable pulled) would keep every later head in
# its backlog. Keepalive probes are answered by the head's kernel, however long its process is
# quiet, so only a host that is gone fails them: dropped after IDLE + INTVL * CNT = 11 s idle,
# or 15 s after data it sent went unacknowledged (TCP_USER_TIMEOUT).
_RPC_KEEPIDLE_S, _RPC_KEEPINTVL_S, _RPC_KEEPCNT, _RPC_USER_TIMEOUT_MS = 5, 2, 3, 15000


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@runtime_checkable
class Handoff(Protocol):
    """An in-process server the router hands accepted connections to (hydra's wire server):
    no port of its own to reach, and it sees the client's own address to authenticate it."""

    def adopt(self, sock: socket.socket, peer: SockAddr, prefix: bytes) -> None:
        """Take ownership of ``sock`` (blocking, already read: ``prefix``); return at once."""
        ...


@dataclass(frozen=True)
class Upstreams:
    """Where the byte-relayed protocols go (ggml-RPC, Hydra); HTTP goes where the router's
    route table says (router/routes.py). ``None`` means "not available now": the client is
    closed. All targets are local by design: llama-server and ggml-rpc-server bind to
    127.0.0.1 only, and the router is the sole way in from outside. ``hydra`` may also be a
    ``Handoff`` (hydra's wire server): the socket itself is handed over, nothing is relayed."""

    rpc: Addr | None = None
    hydra: Addr | Handoff | None = None

    def __post_init__(self) -> None:
        for name in ("rpc", "hydra"):
            addr = getattr(self, name)
            if isinstance(addr, tuple) and not is_loopback(addr[0]):
                raise ValueError(
                    f"router upstream {name}={addr[0]}:{addr[1]} is not a loopback address; "
                    "internal llama-server / ggml-rpc-server / control ports bind to 127.0.0.1"
                )

    def for_kind(self, kind: Kind) -> Addr | None:
        if kind is Kind.RPC:
            return self.rpc
        if kind is Kind.HYDRA:
            return self.hydra if isinstance(self.hydra, tuple) else None
        return None

    @property
    def hydra_handoff(self) -> Handoff | None:
        return None if self.hydra is None or isinstance(self.hydra, tuple) else self.hydra


def parse_allow(allow: Sequence[str]) -> tuple[Network, ...]:
    if isinstance(allow, str):
        raise TypeError("allow must be a sequence of CIDR strings, not one string")
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in allow)


def _loop_net(version: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network("127.0.0.0/8" if version == 4 else "::1/128")


def allow_mismatch(bind_host: str, allow: Sequence[str]) -> str | None:
    """Why no client can ever match the allow list on a port bound to ``bind_host``, or None.

    Sources a listener can see: a wildcard IPv4 bind (0.0.0.0) sees IPv4 clients only; "::" or
    "" (dual stack) sees both families (IPv4 judged as IPv4); a loopback bind sees loopback
    sources only; a specific address sees its own family, and local clients come from that
    address itself, never from loopback."""
    try:
        nets = parse_allow(allow)
    except (TypeError, ValueError):
        return None  # the config check reports a bad CIDR
    if not nets:
        return "rpc_allow is empty: ggml-RPC and the Hydra wire protocol are refused to all"
    host = (bind_host or "").split("%", 1)[0]
    if host in ("", "::"):
        return None
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None  # a host name: resolved at bind time; nothing to judge here
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    same = [n for n in nets if n.version == ip.version]
    listed = ", ".join(str(n) for n in nets)
    if not same:
        return (f"the port binds {bind_host} (IPv{ip.version} clients only) but rpc_allow "
                f"({listed}) lists no IPv{ip.version} network")
    loop = _loop_net(ip.version)
    if ip.is_loopback:
        if not any(n.overlaps(loop) for n in same):
            return (f"the port binds {bind_host} (loopback clients only) but rpc_allow "
                    f"({listed}) lists no loopback network")
    elif not ip.is_unspecified and all(n.subnet_of(loop) for n in same):  # type: ignore[arg-type]
        return (f"the port binds {bind_host}, which local clients reach from {bind_host} "
                f"itself and others from their own address, never from loopback, but "
                f"rpc_allow ({listed}) lists only loopback")
    return None


def source_ip(peer: SockAddr) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except (ValueError, IndexError, TypeError):
        return None
    # A dual-stack listener reports IPv4 clients as ::ffff:a.b.c.d; judge them as IPv4.
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def fmt_addr(peer: SockAddr) -> str:
    try:
        host, port = peer[0], peer[1]
    except (IndexError, TypeError):
        return str(peer)
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def set_nodelay(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # not TCP (tests may hand us a socketpair); nothing to tune


def set_keepalive(sock: socket.socket, rpc: bool = False) -> None:
    """TCP keepalive on a client socket; `rpc`: the tighter bound of a ggml-RPC client."""
    idle, intvl, cnt = ((_RPC_KEEPIDLE_S, _RPC_KEEPINTVL_S, _RPC_KEEPCNT) if rpc
                        else (_KEEPIDLE_S, _KEEPINTVL_S, _KEEPCNT))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, intvl)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, cnt)
        if rpc and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, _RPC_USER_TIMEOUT_MS)
    except OSError:
        pass


class Conn:
    """One client connection from accept to close. Mutated by the acceptor until admitted,
    then by its relay threads; ``abort`` may come from any thread (stop, idle reaper)."""

    __slots__ = (
        "id",
        "client",
        "peer",
        "src",
        "accepted",
        "deadline",
        "prefix",
        "kind",
        "target",
        "upstream",
        "up",
        "down",
        "last",
        "reason",
        "halves",
        "cost",
        "session",
        "idle_since",
        "tls",
    )

    def __init__(self, cid: int, client: socket.socket, peer: SockAddr, now: float):
        self.id = cid
        self.client = client
        self.peer = peer
        ip = source_ip(peer)
        self.src = str(ip) if ip is not None else str(peer)
        self.accepted = now
        self.deadline = now
        self.prefix = b""
        self.kind: Kind | None = None
        self.target: Addr | None = None
        self.upstream: socket.socket | None = None
        self.up = 0  # bytes client → upstream
        self.down = 0  # bytes upstream → client
        self.last = now
        self.reason = ""
        self.halves = 2  # relay directions still running; the last one to end closes
        self.cost = 0  # descriptors reserved for it at admission
        self.session = False  # an HTTP session (times its own idleness), not a byte relay
        self.idle_since: float | None = None  # session between requests, waiting for the next
        # A TLS port (router/tls.py): "handshake" while the client's handshake runs on the
        # acceptor, "up" once done (``client`` is then the ssl.SSLSocket); None: plain TCP.
        self.tls: str | None = None

    def note(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason

    def shutdown_all(self) -> None:
        # shutdown (not close) wakes threads blocked in recv/splice on these sockets without
        # freeing the fd under them; the relay thread closes once both directions are done.
        # The plain socket's shutdown also for a TLS socket: its own would drop the TLS state
        # under the thread that is using it (ssl.SSLSocket.shutdown), where the syscall only
        # makes that thread read EOF.
        for s in (self.client, self.upstream):
            if s is None:
                continue
            try:
                socket.socket.shutdown(s, socket.SHUT_RDWR)
            except OSError:
                pass


class Pending:
    """Accepted connections that have not sent their first bytes yet ("silent"), in accept
    order overall and per source address, so the oldest silent one can be evicted."""

    def __init__(self) -> None:
        self.all: dict[int, Conn] = {}
        self.by_src: dict[str, collections.deque[Conn]] = {}

    def __len__(self) -> int:
        return len(self.all)

    def add(self, conn: Conn) -> None:
        self.all[conn.id] = conn
        self.by_src.setdefault(conn.src, collections.deque()).append(conn)

    def remove(self, conn: Conn) -> None:
        """Forget ``conn``; a connection already gone (evicted, timed out) is a no-op."""
        if self.all.pop(conn.id, None) is None:
            return
        q = self.by_src[conn.src]
        q.remove(conn)
        if not q:
            del self.by_src[conn.src]

    def first(self) -> Conn | None:
        return next(iter(self.all.values()), None)

    def from_source(self, src: str) -> int:
        q = self.by_src.get(src)
        return len(q) if q else 0

    def oldest_of(self, src: str) -> Conn:
        return self.by_src[src][0]

    def oldest_of_largest(self) -> Conn:
        """The oldest silent connection of the source with the most of them: a flood from one
        address evicts its own connections, not a prompt client's from elsewhere."""
        q = max(self.by_src.values(), key=len)
        return q[0]


def watch(sel: selectors.BaseSelector, conn: Conn) -> None:
    """Select on ``conn``'s client socket for reading, unless it is already (a TLS handshake
    in progress registers its own socket)."""
    try:
        sel.get_key(conn.client)
    except KeyError:
        sel.register(conn.client, selectors.EVENT_READ, conn)


def unwatch(sel: selectors.BaseSelector, conn: Conn) -> None:
    """Stop selecting on ``conn`` (already gone from the selector, or closed: nothing to do)."""
    try:
        sel.unregister(conn.client)
    except (KeyError, ValueError, OSError):
        pass


class Queues:
    """What the acceptor holds between its runs: silent connections (``pending``), classified
    ones waiting for a relay slot (``waiting``), refused ones lingering until the client's
    EOF (``lingering``), and ggml-RPC ones held back while another holds the rpc-server
    (``held_back``); each in deadline order because each has one fixed timeout."""

    def __init__(self) -> None:
        self.pending = Pending()
        self.waiting: collections.deque[Conn] = collections.deque()
        self.lingering: collections.deque[Conn] = collections.deque()
        self.linger_ids: set[int] = set()
        # ggml-RPC connections that came while another holds the rpc-server (acceptor.py)
        self.held_back: collections.deque[Conn] = collections.deque()

    def forget(self, conn: Conn) -> None:
        self.pending.remove(conn)
        if conn.id in self.linger_ids:
            self.linger_ids.discard(conn.id)
            try:
                self.lingering.remove(conn)
            except ValueError:
                pass

    def everyone(self) -> list[Conn]:
        return [*self.pending.all.values(), *self.waiting, *self.lingering, *self.held_back]

    def reregister(self, sel: selectors.BaseSelector) -> list[Conn]:
        """Register the silent and lingering connections with a new selector; returns (and
        forgets) those whose socket cannot be registered any more."""
        lost = []
        for conn in [*self.pending.all.values(), *self.lingering]:
            try:
                sel.register(conn.client, selectors.EVENT_READ, conn)
            except (KeyError, ValueError, OSError):
                self.forget(conn)
                lost.append(conn)
        return lost
