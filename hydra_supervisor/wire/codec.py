"""Hydra wire codec (sans-IO): frame encoders and incremental request/response parsers.

The frames are the ones the existing Hydra.Core client speaks (docs/protocol.md):

    request  = <u16 magic 0x4859><u8 op><u8 flags><u16 key_len><u64 payload_len><u16 trace_len>
               key (UTF-8) · trace id (UTF-8) · payload           (16-byte header, little-endian)
    response = <u8 status><u24 meta_len><u64 payload_len> · meta JSON · payload   (12 bytes)

The parsers take bytes as they arrive and return events; they never touch a socket and never
buffer a payload: payload bytes come out as `PayloadChunk` events of whatever size was fed in.
Every length is checked against a cap *at the header*, before a byte of the body is read, so a
hostile or corrupted header can never make the reader wait for (or allocate) gigabytes. After a
`FrameError` the stream can no longer be trusted (the next header would be read from the middle
of something else), so the parser stops: the caller replies BAD_REQUEST and closes.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from hydra_supervisor.jsontypes import JSONObject, JSONValue

MAGIC = 0x4859  # on the wire: b"YH"
REQUEST_HEADER = struct.Struct("<HBBHQH")  # magic, op, flags, key_len, payload_len, trace_len
RESPONSE_HEADER_SIZE = 12
MAX_META = 0xFFFFFF  # the u24 field's ceiling


class Op(enum.IntEnum):
    STATE_GET = 0x30
    STATE_PUT = 0x31
    STATE_META = 0x32
    CONFIGURE = 0x40
    INFO = 0x41
    PREFILL = 0x42
    DECODE = 0x43
    SET_EXPERT_MODE = 0x44
    SWAP_QUANT = 0x45
    PIPELINE_ATTACH = 0x46


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    ERROR = 2
    PARTIAL = 3
    BUSY = 4
    BAD_REQUEST = 5
    NOT_IMPLEMENTED = 6


def op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"0x{op:02X}"


# ------------------------------------------------------------------------------------ encoders


def request_header(
    op: int, key: str = "", payload_len: int = 0, trace: str = "", flags: int = 0
) -> bytes:
    """Header + key + trace of a request whose payload the caller streams after it."""
    k, t = key.encode(), trace.encode()
    if len(k) > 0xFFFF or len(t) > 0xFFFF:
        raise ValueError("key and trace id are at most 65535 bytes")
    if not 0 <= payload_len < 1 << 64:
        raise ValueError(f"payload length out of range: {payload_len}")
    return REQUEST_HEADER.pack(MAGIC, op, flags, len(k), payload_len, len(t)) + k + t


def encode_request(
    op: int, key: str = "", payload: bytes = b"", trace: str = "", flags: int = 0
) -> bytes:
    return request_header(op, key, len(payload), trace, flags) + payload


def response_header(status: int, meta: Mapping[str, object] | None, payload_len: int = 0
                    ) -> bytes:
    """Header + meta JSON of a response whose payload the caller streams after it."""
    m = json.dumps(dict(meta), separators=(",", ":"), default=str).encode() if meta else b""
    if len(m) > MAX_META:
        raise ValueError(f"meta JSON is {len(m)} bytes; the u24 field holds at most {MAX_META}")
    if not 0 <= payload_len < 1 << 64:
        raise ValueError(f"payload length out of range: {payload_len}")
    return (
        bytes([status])
        + len(m).to_bytes(3, "little")
        + payload_len.to_bytes(8, "little")
        + m
    )


def encode_response(
    status: int, meta: Mapping[str, object] | None = None, payload: bytes = b""
) -> bytes:
    return response_header(status, meta, len(payload)) + payload


# ------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class RequestHead:
    op: int
    flags: int
    key: str
    trace: str
    payload_len: int


@dataclass(frozen=True)
class ResponseHead:
    status: int
    meta: JSONObject
    payload_len: int


@dataclass(frozen=True)
class PayloadChunk:
    data: bytes


@dataclass(frozen=True)
class FrameEnd:
    """The frame's payload is complete; the next bytes start a new frame."""


@dataclass(frozen=True)
class FrameError:
    """The stream is unusable from here on: reply `status` (when replying makes sense) and close."""

    status: int
    message: str


Event = RequestHead | ResponseHead | PayloadChunk | FrameEnd | FrameError


@dataclass(frozen=True)
class Limits:
    """Caps checked at the header. `op_payload` overrides `payload` per opcode (STATE_PUT carries
    gigabytes of KV; CONFIGURE a few hundred bytes of JSON)."""

    key: int = 256
    trace: int = 1024
    payload: int = 1 << 20
    op_payload: Mapping[int, int] = field(default_factory=dict)
    meta: int = 1 << 20  # responses only

    def payload_cap(self, op: int) -> int:
        return self.op_payload.get(op, self.payload)


# ------------------------------------------------------------------------------------ parsers


class _Parser:
    """Shared machinery: a small header buffer, then a counted pass-through of the payload."""

    header_size = 0

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._buf = bytearray()  # header (+ key/trace or meta): bounded by the caps
        self._need = self.header_size  # bytes the current head section needs
        self._in_head = True
        self._remaining = 0  # payload bytes still to come
        self._failed = False
        self._pending_head: tuple[int, ...] | None = None  # the header's numbers

    @property
    def failed(self) -> bool:
        return self._failed

    @property
    def idle(self) -> bool:
        """True between frames (nothing of a frame received yet)."""
        return self._in_head and not self._buf and self._pending_head is None and not self._failed

    def feed(self, data: bytes) -> list[Event]:
        out: list[Event] = []
        view = memoryview(data)
        while view and not self._failed:
            if self._in_head:
                take = min(self._need - len(self._buf), len(view))
                self._buf += view[:take]
                view = view[take:]
                if len(self._buf) == self._need:
                    self._head_step(out)
            else:
                take = min(self._remaining, len(view))
                # the common case (a whole recv() inside the payload) passes the bytes through
                whole = take == len(data) and len(view) == len(data)
                out.append(PayloadChunk(data if whole else bytes(view[:take])))
                view = view[take:]
                self._remaining -= take
                if self._remaining == 0:
                    self._end(out)
        return out

    def eof(self) -> list[Event]:
        """The peer closed. Mid-frame that is an error; between frames it is just the end."""
        if self._failed or self.idle:
            return []
        self._failed = True
        where = "header" if self._in_head else "payload"
        return [FrameError(Status.BAD_REQUEST, f"connection closed in the middle of a frame "
                                               f"({where})")]

    def _fail(self, out: list[Event], status: int, message: str) -> None:
        self._failed = True
        out.append(FrameError(status, message))

    def _end(self, out: list[Event]) -> None:
        out.append(FrameEnd())
        self._in_head = True
        self._buf.clear()
        self._need = self.header_size
        self._pending_head = None

    def _start_payload(self, out: list[Event], head: Event, payload_len: int) -> None:
        out.append(head)
        self._buf.clear()
        if payload_len == 0:
            self._end(out)
        else:
            self._in_head = False
            self._remaining = payload_len

    def _head_step(self, out: list[Event]) -> None:
        raise NotImplementedError


class RequestParser(_Parser):
    """Server side: a client's bytes in; RequestHead, PayloadChunk, FrameEnd, FrameError out."""

    header_size = REQUEST_HEADER.size

    def _head_step(self, out: list[Event]) -> None:
        if self._pending_head is None:
            magic, op, flags, key_len, payload_len, trace_len = REQUEST_HEADER.unpack(self._buf)
            if magic != MAGIC:
                return self._fail(out, Status.BAD_REQUEST,
                                  f"bad magic 0x{magic:04X} (want 0x{MAGIC:04X}, b'YH')")
            if key_len > self.limits.key:
                return self._fail(out, Status.BAD_REQUEST,
                                  f"key_len {key_len} exceeds the cap of {self.limits.key}")
            if trace_len > self.limits.trace:
                return self._fail(out, Status.BAD_REQUEST,
                                  f"trace_len {trace_len} exceeds the cap of {self.limits.trace}")
            cap = self.limits.payload_cap(op)
            if payload_len > cap:
                return self._fail(out, Status.BAD_REQUEST,
                                  f"payload_len {payload_len} exceeds the cap of {cap} for "
                                  f"{op_name(op)}")
            self._pending_head = (op, flags, key_len, payload_len, trace_len)
            self._buf.clear()
            self._need = key_len + trace_len
            if self._need:
                return None
        op, flags, key_len, payload_len, trace_len = self._pending_head
        try:
            key = bytes(self._buf[:key_len]).decode()
            trace = bytes(self._buf[key_len:]).decode()
        except UnicodeDecodeError:
            return self._fail(out, Status.BAD_REQUEST, "key or trace id is not UTF-8")
        self._start_payload(out, RequestHead(op, flags, key, trace, payload_len), payload_len)
        return None


class ResponseParser(_Parser):
    """Client side: bytes from a server in, ResponseHead / PayloadChunk / FrameEnd / FrameError
    out. A status byte outside 0..6 is passed through (the caller decides); meta must be JSON."""

    header_size = RESPONSE_HEADER_SIZE

    def _head_step(self, out: list[Event]) -> None:
        if self._pending_head is None:
            status = self._buf[0]
            meta_len = int.from_bytes(self._buf[1:4], "little")
            payload_len = int.from_bytes(self._buf[4:12], "little")
            if meta_len > self.limits.meta:
                return self._fail(out, Status.BAD_REQUEST,
                                  f"meta_len {meta_len} exceeds the cap of {self.limits.meta}")
            if payload_len > self.limits.payload:
                return self._fail(out, Status.BAD_REQUEST,
                                  f"payload_len {payload_len} exceeds the cap of "
                                  f"{self.limits.payload}")
            self._pending_head = (status, payload_len)
            self._buf.clear()
            self._need = meta_len
            if meta_len:
                return None
        status, payload_len = self._pending_head
        meta: JSONObject = {}
        if self._buf:
            try:
                parsed: JSONValue = json.loads(bytes(self._buf))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                return self._fail(out, Status.BAD_REQUEST, f"meta is not JSON: {e}")
            meta = parsed if isinstance(parsed, dict) else {"value": parsed}
        self._start_payload(out, ResponseHead(status, meta, payload_len), payload_len)
        return None
