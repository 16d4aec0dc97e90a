"""A Hydra wire client written from the spec in docs/protocol.md, for the tests.

Deliberately independent of hydra_supervisor.wire (it imports nothing from it): if the server's
codec and this client disagree about a byte, the tests fail instead of agreeing with themselves.

    request  header, 16 bytes LE: u16 magic 0x4859, u8 op, u8 flags, u16 key_len,
                                   u64 payload_len, u16 trace_len; then key, trace id, payload
    response header, 12 bytes:     u8 status, u24 meta_len, u64 payload_len; meta JSON, payload
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from hydra_supervisor.jsontypes import JSONObject, JSONValue

MAGIC = 0x4859
REQ = struct.Struct("<HBBHQH")

STATE_GET, STATE_PUT, STATE_META = 0x30, 0x31, 0x32
CONFIGURE, INFO, PREFILL, DECODE = 0x40, 0x41, 0x42, 0x43
SET_EXPERT_MODE, SWAP_QUANT, PIPELINE_ATTACH = 0x44, 0x45, 0x46

OK, NOT_FOUND, ERROR, PARTIAL, BUSY, BAD_REQUEST, NOT_IMPLEMENTED = range(7)


def frame(op: int, key: str = "", payload: bytes = b"", trace: str = "", flags: int = 0) -> bytes:
    k, t = key.encode(), trace.encode()
    return REQ.pack(MAGIC, op, flags, len(k), len(payload), len(t)) + k + t + payload


@dataclass
class Response:
    status: int
    meta: JSONObject
    payload: bytes


class WireClient:
    """One persistent connection; one request at a time (the protocol has no pipelining)."""

    def __init__(self, host: str, port: int, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> WireClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, n: int, deadline: float) -> bytes:
        out = bytearray()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"read {len(out)} of {n} bytes before the deadline")
            self.sock.settimeout(left)
            chunk = self.sock.recv(min(n - len(out), 1 << 20))
            if not chunk:
                raise EOFError(f"EOF after {len(out)} of {n} bytes")
            out += chunk
        return bytes(out)

    def read_head(self, deadline: float) -> tuple[int, JSONObject, int]:
        head = self._read(12, deadline)
        status = head[0]
        meta_len = int.from_bytes(head[1:4], "little")
        payload_len = int.from_bytes(head[4:12], "little")
        meta: JSONObject = json.loads(self._read(meta_len, deadline)) if meta_len else {}
        return status, meta, payload_len

    def request(self, op: int, key: str = "", payload: bytes = b"", trace: str = "",
                timeout: float | None = None) -> Response:
        deadline = time.monotonic() + (timeout or self.timeout)
        self.sock.sendall(frame(op, key, payload, trace))
        status, meta, n = self.read_head(deadline)
        return Response(status, meta, self._read(n, deadline))

    def request_stream(self, op: int, key: str = "", payload: bytes = b"",
                       timeout: float | None = None,
                       ) -> tuple[int, JSONObject, int, Iterator[bytes]]:
        """Send; return (status, meta, payload_len, iterator over payload pieces as read)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        self.sock.sendall(frame(op, key, payload))
        status, meta, n = self.read_head(deadline)

        def pieces() -> Iterator[bytes]:
            left = n
            while left:
                part = self._read(min(left, 1 << 20), deadline)
                left -= len(part)
                yield part

        return status, meta, n, pieces()

    def send_streaming(self, op: int, key: str, payload_len: int, pieces: Iterator[bytes],
                       timeout: float | None = None) -> Response:
        """A request whose payload is sent piece by piece (STATE_PUT of a big state)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        k = key.encode()
        self.sock.sendall(REQ.pack(MAGIC, op, 0, len(k), payload_len, 0) + k)
        for p in pieces:
            self.sock.sendall(p)
        status, meta, n = self.read_head(deadline)
        return Response(status, meta, self._read(n, deadline))

    # conveniences
    def info(self) -> Response:
        return self.request(INFO)

    def configure(self, params: Mapping[str, JSONValue], key: str = "0") -> Response:
        return self.request(CONFIGURE, key, json.dumps(params).encode())

    def expert_mode(self, mode: str) -> Response:
        return self.request(SET_EXPERT_MODE, "0", mode.encode())
