"""What the router's HTTP leg writes and records itself: error responses, the SSE error event
that ends a cut stream, and one ``Record`` per request.

Responses the router writes itself take llama-server's shape (its error JSON, its header names),
so a client cannot tell them apart from llama-server's own; the acceptor and the byte relay use
``http_error_response`` for their 503s, the HTTP session (router/http.py) the rest.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import TypedDict

from hydra_supervisor.router.traffic import Tally

# A JSON value as the router is given it (a LocalReply's body, T1 request defaults): read-only
# containers, so that a `dict[str, str]` or a `list[str]` is one too.
JSONValue = None | bool | int | float | str | Sequence["JSONValue"] | Mapping[str, "JSONValue"]


# What llama-server (cpp-httplib) answers to a request it cannot parse, byte for byte (the
# pinned build, as tests/test_http_edges.py compares it): no body, the connection closed. A
# head it refuses gets the first; a body it cannot read (a bad chunk) the second: its
# middleware has added its CORS header by then.
LLAMA_BAD_REQUEST = (b"HTTP/1.1 400 Bad Request\r\nServer: llama.cpp\r\n"
                     b"Connection: close\r\nContent-Length: 0\r\n\r\n")
LLAMA_BAD_BODY = (b"HTTP/1.1 400 Bad Request\r\nServer: llama.cpp\r\n"
                  b"Access-Control-Allow-Origin: \r\nConnection: close\r\n"
                  b"Content-Length: 0\r\n\r\n")


def error_body(status: int, message: str, kind: str = "unavailable_error") -> bytes:
    return json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()


def http_error_response(status: int, message: str, retry_after: int | None = None) -> bytes:
    """A complete error response that closes the connection (the acceptor's and the byte
    relay's replies), with llama-server's error JSON."""
    extra = [(b"Retry-After", str(retry_after).encode())] if retry_after is not None else []
    return json_response(status, error_body(status, message),
                          [*extra, (b"Connection", b"close")])


def sse_error_event(message: str) -> bytes:
    """The event that ends a cut stream; the openai client raises APIError on an "error" key."""
    err = {"error": {"message": message, "type": "server_error", "code": 502}}
    return b"data: " + json.dumps(err).encode() + b"\n\n"


class RequestRecord(TypedDict):
    """One request as the router's ``on_request`` callback gets it (``Record.as_dict``)."""

    route: str | None
    port: int
    method: str
    path: str
    status: int
    duration_s: float
    bytes_in: int
    bytes_out: int
    model: str | None
    outcome: str


@dataclass
class Record:
    method: str
    path: str
    started: float
    status: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    model: str | None = None
    outcome: str = "ok"
    reason: str = ""
    route: str | None = None  # the route (profile) the router's table chose; None: no table
    port: int = 0  # the external port it came in on
    # How it ended for the request table (router/traffic.py ENDINGS); "" takes it from
    # `outcome`: ok, cut, else error.
    ended: str = ""
    tally: Tally | None = None  # its entry in the router's Traffic
    done: bool = False  # finished (counted once: Ledger.finish_request)

    def ending(self) -> str:
        if self.ended:
            return self.ended
        return self.outcome if self.outcome in ("ok", "cut") else "error"

    def as_dict(self, now: float) -> RequestRecord:
        return {
            "route": self.route,
            "port": self.port,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "duration_s": round(now - self.started, 6),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "model": self.model,
            "outcome": self.outcome,
        }


def json_response(status: int, body: bytes, extra: list[tuple[bytes, bytes]],
                   with_body: bool = True, origin: bytes = b"") -> bytes:
    """A response the router writes itself, in llama-server's shape (its error JSON, its
    header names in its order; ``origin``: the request's Origin, which llama-server's CORS
    middleware echoes)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    lines = [f"HTTP/1.1 {status} {phrase}\r\n".encode(),
             b"Server: llama.cpp\r\n",
             b"Access-Control-Allow-Origin: " + origin + b"\r\n",
             b"Content-Type: application/json; charset=utf-8\r\n",
             b"Content-Length: %d\r\n" % len(body)]
    lines += [k + b": " + v + b"\r\n" for k, v in extra]
    lines.append(b"\r\n")
    if with_body:
        lines.append(body)
    return b"".join(lines)

