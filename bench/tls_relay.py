#!/usr/bin/env python3
"""What TLS between hydra hosts costs the relay itself, on loopback (issue 32 item 7): the path
a head's ggml-RPC takes with and without `tls:`, minus the network and llama.cpp.

    plain  client -> peer router (plain port, splice relay) -> upstream
    TLS    client -> head's TlsTunnel (127.0.0.1) -> TLS -> peer router (TLS-only port,
           one-thread TLS pump) -> upstream

Two figures for each, interleaved rounds, medians:
- round trip of a 64-byte message answered with 64 bytes (a ggml-RPC command per token is
  small; decode pays this per call), microseconds;
- bulk throughput client -> upstream (a cold load's weights), MB/s, against the 125 MB/s a
  1 Gbit link carries.

    .venv/bin/python bench/tls_relay.py [--rounds 5] [--mib 256] [--pings 2000]

Everything runs on this machine's cores (client, router threads, tunnel threads, upstream):
on a 2-core machine shared with other work the absolute numbers are pessimistic; the ratio is
the point.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra_supervisor.router import Router, Upstreams, tls  # noqa: E402
from hydra_supervisor.router.tunnel import TlsTunnel  # noqa: E402
from hydra_supervisor.testing.tlscerts import make_certs  # noqa: E402

HOST = "127.0.0.1"
MSG = 64


class Upstream:
    """Answers each 64-byte message with 64 bytes (ping mode) or swallows bytes and acks the
    total on EOF-less marker (bulk mode: the client sends N bytes, the upstream replies b"k"
    once it has read them all)."""

    def __init__(self) -> None:
        self.sock = socket.create_server((HOST, 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def addr(self) -> tuple[str, int]:
        return (HOST, int(self.sock.getsockname()[1]))

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    @staticmethod
    def _serve(c: socket.socket) -> None:
        with c:
            head = _recv_exact(c, 9)  # b"\x0e" + u64 bulk size (0: ping mode)
            size = int.from_bytes(head[1:], "little")
            if size:
                left = size
                buf = bytearray(1 << 20)
                while left:
                    n = c.recv_into(buf, min(left, len(buf)))
                    if not n:
                        return
                    left -= n
                c.sendall(b"k")
                return
            while True:
                try:
                    msg = _recv_exact(c, MSG)
                except EOFError:
                    return
                c.sendall(msg)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def ping(port: int, count: int) -> float:
    """Median round trip in microseconds."""
    with socket.create_connection((HOST, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"\x0e" + (0).to_bytes(8, "little"))
        msg = b"p" * MSG
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            s.sendall(msg)
            _recv_exact(s, MSG)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def bulk(port: int, mib: int) -> float:
    """MB/s client -> upstream."""
    size = mib << 20
    chunk = b"\0" * (1 << 20)
    with socket.create_connection((HOST, port)) as s:
        t0 = time.perf_counter()
        s.sendall(b"\x0e" + size.to_bytes(8, "little"))
        for _ in range(mib):
            s.sendall(chunk)
        _recv_exact(s, 1)
        took = time.perf_counter() - t0
    return size / took / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--pings", type=int, default=2000)
    a = ap.parse_args()
    up = Upstream()
    with tempfile.TemporaryDirectory(prefix="hydra-tls-bench-") as t:
        certs = make_certs(Path(t), ["peer", "head"])
        plain = Router(HOST, 0, Upstreams(rpc=up.addr), allow=["127.0.0.0/8"])
        secure = Router(HOST, 0, Upstreams(rpc=up.addr), allow=["127.0.0.0/8"],
                        tls_context=tls.server_context(certs["peer"]))
        plain.start()
        secure.start()
        tunnel = TlsTunnel(f"{HOST}:{secure.port}", certs["head"])
        tport = int(tunnel.start().rpartition(":")[2])
        res: dict[str, dict[str, list[float]]] = {
            k: {"rtt": [], "bulk": []} for k in ("plain", "tls")}
        try:
            for i in range(a.rounds):
                order = [("plain", plain.port), ("tls", tport)]
                for name, port in (order if i % 2 == 0 else order[::-1]):
                    res[name]["rtt"].append(ping(port, a.pings))
                    res[name]["bulk"].append(bulk(port, a.mib))
        finally:
            tunnel.stop()
            plain.stop()
            secure.stop()
    med = statistics.median
    print(f"bench/tls_relay.py: loopback, {a.rounds} rounds interleaved (medians), "
          f"{a.pings} pings of {MSG} B per round, {a.mib} MiB bulk per round")
    print(f"{'':<40}{'plain':>10}{'TLS':>10}{'TLS/plain':>11}   runs plain | TLS")
    for label, key, fmt in (("round trip, 64 B each way (us)", "rtt", ".0f"),
                            ("bulk client -> upstream (MB/s)", "bulk", ".0f")):
        p, s = med(res["plain"][key]), med(res["tls"][key])
        runs = (", ".join(f"{v:{fmt}}" for v in res["plain"][key]) + " | "
                + ", ".join(f"{v:{fmt}}" for v in res["tls"][key]))
        print(f"{label:<40}{p:>10{fmt}}{s:>10{fmt}}{s / p:>11.2f}   {runs}")
    print(f"  (1 Gbit carries 125 MB/s: TLS bulk here is {med(res['tls']['bulk']) / 125:.1f}x "
          "that)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
