"""Classify a new connection by its first bytes (sans-IO: bytes in, a decision out).

One external port per engine carries three protocols. This module owns the decision, and only
the decision: it never touches a socket, so it is tested exhaustively on byte literals.

- ggml-RPC: the client speaks first with ``RPC_CMD_HELLO`` (``0x0E``); one byte decides.
- Hydra control: every request starts with the u16 magic 0x4859 written little-endian, so the
  wire carries ``0x59 0x48`` ("YH"). Opcodes (0x30–0x46) are byte 2, never byte 0: a first
  byte of 0x44 is an HTTP ``DELETE``, not a Hydra op.
- HTTP/1.x: a request line starts with a method token and a space. We require the space so that
  ``GETX`` or a bare ``GET`` followed by garbage is not routed to llama-server.

Anything else is rejected. A prefix that could still become one of the above asks for more.
"""

from __future__ import annotations

import enum

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

# The longest prefix classify() ever needs; a caller never has to buffer more than this.
MAX_PREFIX = max(len(m) for m in HTTP_METHODS)


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
    could_be_http = False
    for method in HTTP_METHODS:
        if prefix.startswith(method):
            return Kind.HTTP
        if method.startswith(prefix):
            could_be_http = True
    return Kind.NEED_MORE if could_be_http else Kind.REJECT
