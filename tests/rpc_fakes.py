"""The server side of ggml-RPC HELLO, for tests' fake peers (hydra itself is only ever the
client: hydra_supervisor/proc/rpcproto.py decodes what this encodes)."""

from __future__ import annotations

import struct

from hydra_supervisor.proc.rpcproto import CAPS_SIZE, Version


def encode_hello_response(v: Version) -> bytes:
    """What a ggml-rpc-server answers to HELLO: u64 LE size, major, minor, patch, padding, and
    CAPS_SIZE capability bytes (zeros)."""
    return struct.pack("<QBBBB", 4 + CAPS_SIZE, v.major, v.minor, v.patch, 0) + bytes(CAPS_SIZE)
