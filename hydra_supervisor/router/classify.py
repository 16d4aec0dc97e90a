"""Classify a new connection by its first bytes (sans-IO: bytes in, a decision out).

One external port per engine carries three protocols. This module owns the decision, and only
the decision: it never touches a socket, so it is tested exhaustively on byte literals.

- ggml-RPC: the client speaks first with ``RPC_CMD_HELLO`` (``0x0E``); one byte decides.
- Hydra control: every request starts with the u16 magic 0x4859 written little-endian, so the
  wire carries ``0x59 0x48`` ("YH"). Opcodes (0x30–0x46) are byte 2, never byte 0: a first
  byte of 0x44 is an HTTP ``DELETE``, not a Hydra op.
- HTTP/1.x: a request line starts with a method token and a space (after at most two empty
  lines). Every token, not only the methods llama-server knows: it answers an unknown or
  lowercase method with 400, and so must the port (the router's HTTP leg answers it as
  llama-server does). The space is required, so a binary or line protocol
  (``SSH-2.0-...\\r\\n``, TLS) is not taken for HTTP. ``PRI `` (HTTP/2 prior knowledge) is
  rejected: llama-server speaks HTTP/1.1 only.

Anything else is rejected. A prefix that could still become one of the above asks for more.
"""

from __future__ import annotations

import enum
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hydra_supervisor.wire import codec

RPC_HELLO = 0x0E
HYDRA_MAGIC = b"\x59\x48"  # u16 0x4859, little-endian: "YH"

# HTTP/1.1 methods (RFC 9110 plus PATCH). llama-server answers only a few of them, but routing
# the rest lets it say 404/405 itself rather than us closing on a valid HTTP client.
HTTP_METHODS: tuple[bytes, ...] = (
    b"GET ",
    b"HEAD ",
    b"POST ",
    b"PUT ",
    b"DELETE ",
    b"CONNECT ",
    b"OPTIONS ",
    b"TRACE ",
    b"PATCH ",
)

_TCHAR = frozenset(b"!#$%&'*+-.^_`|~0123456789"
                   b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
MAX_LEADING = 4  # empty lines (CRLF CRLF) before a request line that still classify as HTTP
MAX_METHOD = 16  # the longest method token taken for HTTP

# The longest prefix classify() ever needs; a caller never has to buffer more than this.
MAX_PREFIX = MAX_LEADING + MAX_METHOD + 1


class Kind(enum.Enum):
    RPC = "rpc"
    HYDRA = "hydra"
    HTTP = "http"
    NEED_MORE = "need_more"
    REJECT = "reject"


def classify(prefix: bytes) -> Kind:
    """Decide what a connection speaks from the bytes received so far.

    Pure and total: any ``bytes`` (including empty) gives a Kind. ``NEED_MORE`` is returned
    only while ``prefix`` is a strict prefix of some accepted opening, so a caller that reads
    ``MAX_PREFIX`` bytes always gets a final answer.
    """
    if not prefix:
        return Kind.NEED_MORE
    first = prefix[0]
    if first == RPC_HELLO:
        return Kind.RPC
    if first == HYDRA_MAGIC[0]:
        if len(prefix) < len(HYDRA_MAGIC):
            return Kind.NEED_MORE
        return Kind.HYDRA if prefix[1] == HYDRA_MAGIC[1] else Kind.REJECT
    lead = 0
    while lead < len(prefix) and prefix[lead] in b"\r\n":
        lead += 1
    if lead > MAX_LEADING or not b"\r\n\r\n".startswith(prefix[:lead]) or (
            lead % 2 and lead < len(prefix)):
        return Kind.REJECT
    n = 0
    for c in prefix[lead:lead + MAX_METHOD + 1]:
        if c == 0x20:
            if n == 0 or prefix[lead:lead + n] == b"PRI":
                return Kind.REJECT
            return Kind.HTTP
        if c not in _TCHAR:
            return Kind.REJECT
        n += 1
    return Kind.NEED_MORE if n <= MAX_METHOD else Kind.REJECT


# What a head's hydra may say about itself in a Hydra INFO request's payload (JSON
# {"head": {"build": "b11434-…"}}, docs/protocol.md): read from the bytes the router already
# has, so the peer can name a head's build while that head holds its rpc-server.
_MAX_ANNOUNCE = 4096


def announced_build(prefix: bytes) -> str | None:
    """The build a Hydra INFO request in ``prefix`` announces, or None (another op, no or
    malformed payload, or not all of it read yet). Pure; never raises."""
    # Imported here: the wire package pulls its server in, and the CLI imports this module
    # (through the status types) without needing any of it (tests/test_cli_imports.py).
    from hydra_supervisor.wire import codec

    parser = codec.RequestParser(codec.Limits(payload=_MAX_ANNOUNCE))
    head: codec.RequestHead | None = None
    body = b""
    for ev in parser.feed(prefix[:_MAX_ANNOUNCE + 1024]):
        if isinstance(ev, codec.RequestHead):
            head = ev
            if ev.op != codec.Op.INFO or not ev.payload_len:
                return None
        elif isinstance(ev, codec.PayloadChunk):
            body += ev.data
        elif isinstance(ev, codec.FrameEnd):
            break
        else:
            return None
    if head is None or len(body) != head.payload_len:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    who = data.get("head") if isinstance(data, dict) else None
    build = who.get("build") if isinstance(who, dict) else None
    return build if isinstance(build, str) and build else None
