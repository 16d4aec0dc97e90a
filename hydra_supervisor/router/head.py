"""HTTP/1.x message heads as the router sees and writes them (sans-IO: bytes in, bytes out).

Request heads are parsed here, not by h11: the router must read a head exactly as
llama-server's HTTP library (cpp-httplib, vendored in the pinned llama.cpp) reads it, or the
two could disagree on what a request is and where its body ends. So this module
- finds where a request head ends and parses it with httplib's rules: lines end at CRLF
  only (a bare LF is a byte of the line), one empty line before the request line skipped, a
  method from its set (case-sensitive), the limits on line length and header count,
  Content-Length as one decimal (two different ones refused), Transfer-Encoding whose final
  coding is chunked;
  whatever it refuses, the router refuses as it does (a 400, or a silent close);
- refuses, stricter than llama-server on purpose, Content-Length together with
  Transfer-Encoding even when the length is 0 (llama-server tolerates 0): behind a front
  proxy that frames by Content-Length that is the classic request-smuggling desync;
- gives h11 (which reads bodies: chunked decoding) a canonical head with the framing alone;
- writes heads with the header names, order and reason phrase as the other side sent them
  (h11 lowercases the names it writes, and clients that compare header names as strings
  break: llama.cpp's own CORS and metrics tests do).
Responses are parsed by h11 (llama-server writes well-formed ones).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Header = tuple[bytes, bytes]

# Header names (lowercase) that are per leg: never forwarded, rewritten by each leg.
HOP_REQUEST = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade",
    b"transfer-encoding", b"content-length", b"expect",
})

# What llama-server's HTTP library (cpp-httplib 0.59, the pinned build; vendor/cpp-httplib)
# accepts in a request head. Beyond these it answers 400 (or, for an over-long request
# line, closes without a word), and so does the router: its own parse must frame every
# request exactly as llama-server would, or the two could disagree on where a body ends.
METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS",
                     b"TRACE", b"PATCH", b"PRI"})  # case-sensitive, as httplib compares them
MAX_LINE = 32768  # CPPHTTPLIB_MAX_LINE_LENGTH: a longer request line is closed on
MAX_HEADER_LINE = 8192  # CPPHTTPLIB_HEADER_MAX_LENGTH, the CRLF included: 400 beyond
MAX_HEADERS = 100  # CPPHTTPLIB_HEADER_MAX_COUNT: 400 beyond
_TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789"
                   b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_SP_HT = b" \t"
_DIGITS = frozenset(b"0123456789")


class HeadError(Exception):
    """A request head the router refuses: ``status`` and why. Status 0: llama-server closes
    such a connection without a word, and so does the router."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def head_end(buf: bytes | bytearray) -> int | None:
    """Offset just past the head at the start of ``buf`` (None: not complete yet), read as
    llama-server reads it: lines end at CRLF only (a bare LF is a byte of the line, which a
    request line or a header value then refuses); one empty line before the request line is
    skipped; an invalid request line ends the head at once (it is refused before any header
    is read); the head ends at the first empty line. Raises HeadError as soon as a line is
    past llama-server's limits, so a head held here stays under about 850 KB."""
    pos = 2 if buf.startswith(b"\r\n") else 0
    end = buf.find(b"\r\n", pos)
    if end < 0 or end + 2 - pos > MAX_LINE:
        if len(buf) - pos > MAX_LINE:
            raise HeadError(0, f"request line over {MAX_LINE} bytes")
        return None
    if _request_line(bytes(buf[pos:end + 2])) is None:
        return end + 2  # refused as it stands (llama-server answers before any header)
    pos = end + 2
    count = 0
    while True:
        end = buf.find(b"\r\n", pos)
        if end < 0:
            if len(buf) - pos > MAX_HEADER_LINE:
                raise HeadError(400, f"header line over {MAX_HEADER_LINE} bytes")
            return None
        size = end + 2 - pos
        pos = end + 2
        if size == 2:
            return pos
        if size > MAX_HEADER_LINE:
            raise HeadError(400, f"header line over {MAX_HEADER_LINE} bytes")
        count += 1
        if count > MAX_HEADERS:
            raise HeadError(400, f"over {MAX_HEADERS} header lines")


@dataclass(frozen=True)
class RequestHead:
    """A request head as the router parsed it (``parse_request``)."""

    method: bytes
    target: bytes
    version: bytes  # b"1.1" or b"1.0"
    headers: tuple[Header, ...]  # as sent: names in their case, in order; values trimmed
    length: int | None  # Content-Length
    chunked: bool  # framed by Transfer-Encoding (its final coding is chunked)
    keep_alive: bool  # the client's connection may carry another request
    expect_continue: bool

    def h11_head(self) -> bytes:
        """The head h11 is given to read the body: the framing only (h11 reads the body; the
        head is ours, because h11 refuses heads llama-server serves: two Host lines, a
        coding list ending in chunked)."""
        # Always 1.1: h11 ends every 1.0 connection after one request, keep-alive or not
        # (whether the client's connection carries another is decided from `keep_alive`).
        parts = [self.method, b" / HTTP/1.1\r\nHost: x\r\n"]
        if self.chunked:
            parts.append(b"Transfer-Encoding: chunked\r\n")
        elif self.length is not None:
            parts.append(b"Content-Length: %d\r\n" % self.length)
        if self.expect_continue:
            parts.append(b"Expect: 100-continue\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)


def _field_value_ok(v: bytes) -> bool:
    # RFC 9110 field-content as httplib checks it: visible or obs-text bytes, inner SP/HT.
    for i, c in enumerate(v):
        if c in (0x20, 0x09):
            if i == 0 or i == len(v) - 1:
                return False
        elif c < 0x21 or c == 0x7F:
            return False
    return True


def _request_line(line: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(method, target, version) of a request line (its LF included), or None where
    llama-server refuses it: not ended by CRLF, not three words, a method outside its set,
    a version other than 1.0 and 1.1, a target with control bytes."""
    if not line.endswith(b"\r\n"):
        return None
    parts = [p for p in (x.strip(_SP_HT) for x in line[:-2].split(b" ")) if p]
    if len(parts) != 3:
        return None
    method, target, version = parts
    if method not in METHODS or version not in (b"HTTP/1.1", b"HTTP/1.0"):
        return None
    if any(c < 0x21 or c == 0x7F for c in target):
        return None
    return method, target, version


def parse_request(raw: bytes) -> RequestHead:
    """The head that ``head_end`` delimited, checked as llama-server checks it. Raises
    HeadError(400) where llama-server answers 400, and where the router is stricter on
    purpose (docs/router.md: Content-Length together with Transfer-Encoding)."""
    text = raw[2:] if raw.startswith(b"\r\n") else raw
    lines = text.split(b"\r\n")
    parts = _request_line(lines[0] + b"\r\n") if len(lines) > 1 else None
    if parts is None:
        raise HeadError(400, "malformed request line")
    method, target, version = parts
    headers: list[Header] = []
    for ln in lines[1:]:
        if not ln:
            break
        ln = ln.rstrip(_SP_HT)
        name, sep, value = ln.partition(b":")
        if not sep or not name or not all(c in _TCHAR for c in name):
            raise HeadError(400, "malformed header line")
        value = value.lstrip(_SP_HT)
        if not _field_value_ok(value):
            raise HeadError(400, "malformed header value")
        headers.append((name, value))
    lengths = [v for k, v in headers if k.lower() == b"content-length"]
    codings = [v for k, v in headers if k.lower() == b"transfer-encoding"]
    length: int | None = None
    if lengths:
        if any(v != lengths[0] for v in lengths):
            raise HeadError(400, "different Content-Length values")
        if not lengths[0] or not all(c in _DIGITS for c in lengths[0]) or len(lengths[0]) > 19:
            raise HeadError(400, "malformed Content-Length")
        length = int(lengths[0])
    chunked = False
    if codings:
        if lengths:  # llama-server tolerates Content-Length: 0 here; the router does not
            raise HeadError(400, "both Content-Length and Transfer-Encoding")
        last = b""
        for v in codings:
            last = b""
            for tok in v.split(b","):
                tok = tok.strip(_SP_HT)
                if tok:
                    last = tok
        if last.lower() != b"chunked":
            raise HeadError(400, "Transfer-Encoding whose final coding is not chunked")
        chunked = True
    conn = tokens(headers, b"connection")
    keep = b"keep-alive" in conn if version == b"HTTP/1.0" else b"close" not in conn
    expect = version == b"HTTP/1.1" and b"100-continue" in tokens(headers, b"expect")
    return RequestHead(method, target, version[5:], tuple(headers), length, chunked, keep,
                       expect)


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
