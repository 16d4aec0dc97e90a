"""Readiness and liveness probes, async and bounded: llama-server /health and /slots, ggml-RPC
HELLO, and a 1-token completion; and what hydra sees without asking a process anything: the
router's requests in flight and how long the head has owed them a byte, and whether a remote
peer's endpoint still completes a TCP connect.

/health is 503 while llama-server loads and 200 when it serves. The probe speaks minimal HTTP/1.0
over asyncio streams so it never blocks the supervisor's loop. The HELLO probe runs the blocking
client from rpcproto in a thread, under the same deadline.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Protocol

from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.proc import rpcproto

if TYPE_CHECKING:
    from hydra_supervisor.router.gate import Gate


def _self_connected(writer: asyncio.StreamWriter) -> bool:
    """A connect to a down local port that landed on itself (see ports.py): not an answer."""
    return bool(writer.get_extra_info("sockname") == writer.get_extra_info("peername"))


async def _get(host: str, port: int, path: str, timeout: float, whole: bool) -> bytes | None:
    """GET path over HTTP/1.0: the status line only, or (`whole`) the whole response; None
    when nothing answers in time (or a connect landed on itself)."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                if _self_connected(writer):
                    return None
                writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
                await writer.drain()
                return await (reader.read() if whole else reader.readline())
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return None


def _status(line: bytes) -> int | None:
    parts = line.split(b"\r\n", 1)[0].split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


async def http_status(host: str, port: int, path: str = "/health", timeout: float = 2.0
                      ) -> int | None:
    """The HTTP status code of GET path, or None when nothing answers in time."""
    line = await _get(host, port, path, timeout, whole=False)
    return None if line is None else _status(line)


async def slots_busy(host: str, port: int, timeout: float = 2.0) -> bool | None:
    """Is any slot of the head processing a request (`GET /slots`, is_processing)? None when
    it does not answer in time: /slots waits in the same HTTP worker pool as /health."""
    raw = await _get(host, port, "/slots", timeout, whole=True)
    if raw is None:
        return None
    head, _, body = raw.partition(b"\r\n\r\n")
    if _status(head) != 200:
        return None
    try:
        slots = json.loads(body)
    except ValueError:
        return None
    return isinstance(slots, list) and any(
        isinstance(s, dict) and s.get("is_processing") for s in slots)


async def hello(host: str, port: int, timeout: float = 3.0, tls: TlsFiles | None = None
                ) -> rpcproto.Version | None:
    """The peer's protocol version, or None when nothing answers. HelloError on garbage
    (rpcproto.TlsFailed: over ``tls``, TLS itself failed)."""
    try:
        return await asyncio.wait_for(
            asyncio.to_thread(rpcproto.probe, host, port, timeout, tls), timeout + 1.0)
    except (OSError, TimeoutError):
        return None


class Gated(Protocol):
    """What carries a head's HTTP traffic: its lane's route (router/routes.py), with its gate."""

    @property
    def gate(self) -> Gate: ...


def flights(traffic: Gated | None) -> tuple[int, float | None] | None:
    """The head's HTTP requests as its route sees them: how many are in flight and how long the
    head has owed them a byte — the oldest request still waiting for one, new requests going up
    meanwhile or not (the kernel's clocks, router/gate.py `owed_for`; None while none has its
    upstream socket yet). None: no router to ask (router: false)."""
    if traffic is None:
        return None
    gate = traffic.gate
    n = gate.inflight()
    return (n, gate.owed_for() if n else None)


async def tcp_connect(host: str, port: int, timeout: float) -> str | None:
    """None when host:port completes a TCP handshake within `timeout`; else why not (refused,
    unreachable, timed out: the host or the process is gone). Nothing is sent: a
    ggml-rpc-server busy with its head leaves the connection in its backlog (the kernel
    completes the handshake for it, frozen or not) and later reads only an EOF — a HELLO there
    would hang. Callers keep such probes rare: its backlog holds two."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except TimeoutError:
        return f"TCP connect timed out after {timeout:g}s"
    except OSError as exc:
        return f"TCP connect failed: {exc.strerror or exc}"
    writer.close()
    return None


async def completion_probe(host: str, port: int, timeout: float) -> tuple[bool, str]:
    """One 1-token completion: catches a head whose /health is fine but cannot generate."""
    body = b'{"prompt":"ping","n_predict":1,"cache_prompt":false}'
    req = (f"POST /completion HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                if _self_connected(writer):
                    return False, "nothing listens"
                writer.write(req)
                await writer.drain()
                status = await reader.readline()
                await reader.read()  # the body; the probe only needs to see it complete
            finally:
                writer.close()
    except TimeoutError:
        return False, f"no answer within {timeout:.0f}s"
    except OSError as exc:
        return False, str(exc)
    parts = status.split()
    code = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0
    return (code == 200, f"HTTP {code}")
