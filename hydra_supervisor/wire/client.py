"""A minimal blocking Hydra wire client over the codec, for hydra's own CLI and benches.

One request per call on a fresh or given connection, every read under a deadline, response
lengths capped by the codec (meta 1 MiB, payload `max_payload`). Payloads come back whole;
callers that stream big states use `request_stream`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

from hydra_supervisor.jsontypes import JSONObject
from hydra_supervisor.wire import codec
from hydra_supervisor.wire.codec import (
    FrameEnd,
    FrameError,
    Limits,
    PayloadChunk,
    ResponseHead,
    ResponseParser,
)


class WireError(Exception):
    pass


class NotListening(WireError):
    """The connection was refused: nothing listens on the port."""


def connect(host: str, port: int, timeout: float) -> socket.socket:
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError as e:
        raise NotListening(f"cannot connect to {host}:{port}: {e}") from None
    except OSError as e:
        raise WireError(f"cannot connect to {host}:{port}: {e}") from None
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def request_stream(
    sock: socket.socket, op: int, key: str = "", payload: bytes = b"", *,
    timeout: float = 60.0, max_payload: int = 8 << 30, trace: str = "",
) -> tuple[ResponseHead, Iterator[bytes]]:
    """Send one request; return the response head and an iterator over its payload pieces
    (which must be consumed before the next request on this socket)."""
    deadline = time.monotonic() + timeout
    sock.sendall(codec.encode_request(op, key, payload, trace))
    parser = ResponseParser(Limits(payload=max_payload))
    pending: list[codec.Event] = []

    def events() -> Iterator[codec.Event]:
        while True:
            while pending:
                yield pending.pop(0)
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireError(f"no complete reply within {timeout:.0f}s")
            sock.settimeout(left)
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                raise WireError(f"no complete reply within {timeout:.0f}s") from None
            pending.extend(parser.feed(data) if data else parser.eof())
            if not data and not pending:
                raise WireError("the server closed the connection")

    it = events()
    head: ResponseHead | None = None
    for ev in it:
        if isinstance(ev, FrameError):
            raise WireError(ev.message)
        if isinstance(ev, ResponseHead):
            head = ev
            break
    assert head is not None  # events() only ends by raising

    def body() -> Iterator[bytes]:
        for ev in it:
            if isinstance(ev, PayloadChunk):
                yield ev.data
            elif isinstance(ev, FrameEnd):
                return
            elif isinstance(ev, FrameError):
                raise WireError(ev.message)

    return head, body()


def request(
    host: str, port: int, op: int, key: str = "", payload: bytes = b"", *,
    timeout: float = 60.0, trace: str = "",
) -> tuple[int, JSONObject, bytes]:
    """(status, meta, payload) of one request on a fresh connection."""
    with connect(host, port, timeout) as s:
        head, body = request_stream(s, op, key, payload, timeout=timeout, trace=trace)
        return head.status, head.meta, b"".join(body)
