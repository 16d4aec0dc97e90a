"""HTTP/1.x message heads as the router sees and writes them (sans-IO: bytes in, bytes out).

h11 parses every request and response; this module does the few things a transparent proxy
needs that h11, a strict endpoint library, does not:

- find where a request head ends, and refuse what llama-server refuses before h11 would
  quietly accept it (an obs-folded header line: h11 unfolds it, llama-server answers 400);
- accept what llama-server accepts and h11 refuses (an HTTP/1.1 request without ``Host``:
  llama-server answers it, h11 requires one), by lending h11 an empty ``Host`` that is not
  forwarded;
- write heads with the header names, order and reason phrase as the other side sent them
  (h11 lowercases the names it writes, and clients that compare header names as strings
  break: llama.cpp's own CORS and metrics tests do);
- refuse what would let a request be framed two ways (RFC 9112 6.1: Content-Length together
  with Transfer-Encoding; two different Content-Lengths), which h11 would frame by
  Transfer-Encoding and keep the connection for the next request: request smuggling behind a
  front proxy that frames by Content-Length.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

Header = tuple[bytes, bytes]

# Header names (lowercase) that are per leg: never forwarded, rewritten by each leg.
HOP_REQUEST = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade",
    b"transfer-encoding", b"content-length", b"expect",
})
INJECTED_HOST = b"host"  # the name of the Host line lent to h11 (lowercase: ours, not the client's)
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_FOLD = re.compile(rb"\n[ \t]")
_HOST_LINE = re.compile(rb"\nhost[ \t]*:", re.IGNORECASE)
_REQUEST_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ [^ \r\n]+ HTTP/(\d)\.(\d)\r?\n")


def head_end(buf: bytes | bytearray) -> int | None:
    """Offset just past the blank line that ends the head at the start of ``buf``, or None."""
    # Leading empty lines before a request line are allowed (RFC 9112 2.2); skip them.
    start = 0
    while buf.startswith(b"\r\n", start):
        start += 2
    m = _HEAD_END.search(buf, start)
    return m.end() if m else None


class HeadError(Exception):
    """A request head the router refuses: ``status`` and the client-facing message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def prepare_request_head(head: bytes) -> tuple[bytes, bool]:
    """(the head to give h11, whether a Host line was lent). Raises HeadError for what
    llama-server refuses and h11 would accept (obs-fold)."""
    body_start = head.lstrip(b"\r\n")
    if _FOLD.search(body_start):
        raise HeadError(400, "obsolete line folding in a header is not accepted")
    m = _REQUEST_LINE.match(body_start)
    if m is None or (m.group(1), m.group(2)) != (b"1", b"1") or _HOST_LINE.search(body_start):
        return head, False
    # HTTP/1.1 without Host: llama-server serves it; h11 needs one to parse the request.
    line_end = m.end()
    return body_start[:line_end] + INJECTED_HOST + b": \r\n" + body_start[line_end:], True


def framing_conflict(headers: Iterable[Header]) -> str | None:
    """Why a parsed request's framing is ambiguous, or None. ``headers`` lowercase names."""
    has_cl = has_te = False
    for name, _ in headers:
        if name == b"content-length":
            has_cl = True
        elif name == b"transfer-encoding":
            has_te = True
    if has_cl and has_te:
        return "both Content-Length and Transfer-Encoding"
    return None


def tokens(headers: Iterable[Header], name: bytes) -> set[bytes]:
    """The comma-separated tokens of header ``name`` (lowercase), lowercased."""
    out: set[bytes] = set()
    for k, v in headers:
        if k.lower() == name:
            out.update(t.strip().lower() for t in v.split(b","))
    return out


def request_head(method: bytes, target: bytes, version: bytes,
                 raw_headers: Sequence[Header], content_length: int | None) -> bytes:
    """A request head for the upstream: the client's line and header lines as it sent them
    (names in their case and order), less the per-leg ones; our own Content-Length."""
    parts = [method, b" ", target, b" HTTP/", version, b"\r\n"]
    for name, value in raw_headers:
        parts += (name, b": ", value, b"\r\n")
    if content_length is not None:
        parts.append(b"Content-Length: %d\r\n" % content_length)
    parts.append(b"\r\n")
    return b"".join(parts)


def response_head(version: bytes, status: int, reason: bytes, raw_headers: Sequence[Header],
                  close: bool) -> bytes:
    """A response head for the client: the upstream's status line and header lines as it
    sent them, except the per-leg ``Connection`` / ``Keep-Alive``: kept as they were while the
    client's connection stays open, ``Connection: close`` (in the same place) when it will not."""
    parts = [b"HTTP/", version, b" %d " % status, reason, b"\r\n"]
    said_close = False
    for name, value in raw_headers:
        low = name.lower()
        if low == b"connection":
            if close:
                value, said_close = b"close", True
            elif b"close" in {t.strip().lower() for t in value.split(b",")}:
                value = b"keep-alive"  # the upstream leg closes; the client's does not
        elif low == b"keep-alive" and close:
            continue
        elif low in (b"proxy-connection", b"upgrade"):
            continue
        parts += (name, b": ", value, b"\r\n")
    if close and not said_close:
        parts.append(b"Connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def informational_head(version: bytes, status: int, reason: bytes,
                       raw_headers: Sequence[Header]) -> bytes:
    parts = [b"HTTP/", version, b" %d " % status, reason, b"\r\n"]
    for name, value in raw_headers:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


def last_chunk(trailers: Sequence[Header] = ()) -> bytes:
    return b"0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in trailers) + b"\r\n"


_CHUNKED_END = re.compile(rb"(?:^|\n)0[ \t]*(?:;[^\r\n]*)?\r?\n(?:[^\r\n]+\r?\n)*\r?\n")


def empty_chunked_end(buf: bytes) -> int | None:
    """Offset past a complete empty chunked body (``0\\r\\n\\r\\n``, trailers allowed) at the
    start of ``buf``, or None while incomplete: what llama-server sends after a 204 that it
    marked chunked, which a client reading the chunked framing waits for."""
    m = _CHUNKED_END.match(buf)
    return m.end() if m else None
