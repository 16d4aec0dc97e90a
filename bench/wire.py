"""Benchmark the Hydra wire server: INFO round trip, T1 CONFIGURE latency, STATE_GET/PUT
throughput for a ~4K-token slot against reading the slot file straight from disk.

The WireServer runs in a child process (`bench/wire.py _serve …`) so the load generator's
Python never competes with it for a GIL. Its EngineControl is a stub that answers at once (the
numbers are the wire server's own cost); the state part drives a real llama-server (Gemma 3
270M, CPU build, `--swa-full --slot-save-path`), prefilled with ~4K tokens.

Parts:
  info       INFO round trips on one persistent connection: p50/p99 (and on a new connection each)
  configure  T1 CONFIGURE (temperature changes every call) and a no-op repeat: p50/p99
  state      STATE_GET / STATE_PUT MB/s vs the slot file read from disk (page cache) and vs
             llama-server's own save+read / write+restore (the floor of any file-based path)

Usage:
  .venv/bin/python bench/wire.py                  # all parts
  .venv/bin/python bench/wire.py --parts info,configure --n 5000
  .venv/bin/python bench/wire.py --parts state --tokens 4096 --rounds 5
info/configure run direct to the wire server and through a Router's "YH" route (both in the
child); --port measures an existing endpoint instead (an engine's external port).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hydra_supervisor.plan.ports import free_port  # noqa: E402
from hydra_supervisor.testing.routerhelp import (  # noqa: E402
    gemma_path,
    llama_bins,
    llama_process,
    wait_health,
)
from hydra_supervisor.wire import client, codec  # noqa: E402
from hydra_supervisor.wire.codec import Op, Status  # noqa: E402

HOST = "127.0.0.1"


# ------------------------------------------------------------------------- the served child


class BenchControl:
    def __init__(self, head_port: int, slot_dir: Path) -> None:
        self.head = (HOST, head_port) if head_port else None
        self.dir = slot_dir
        self.settings: dict[str, Any] = {"model": "gemma3-270m"}

    def info(self) -> dict[str, Any]:
        return {"profile": "bench", "mode": "solo", "model": "gemma3-270m",
                "settings": self.settings}

    def configure(self, params: dict[str, Any]) -> dict[str, Any]:
        self.settings = {**self.settings, **params}
        return {"restarted": []}

    def set_expert_mode(self, mode: str) -> dict[str, Any]:
        return {"mode": mode}

    def head_http(self) -> tuple[str, int] | None:
        return self.head

    def busy(self) -> bool:
        return False

    def slot_dir(self) -> Path:
        return self.dir


def child_serve(head_port: int, slot_dir: str) -> None:
    """Print "WIRE_PORT ROUTER_PORT": the wire server (with a loopback listener of its own for
    the "direct" rows; hydra has none), and a Router handing "YH" connections to it (as an
    engine runs them: one process)."""
    from hydra_supervisor.router import Router, Upstreams
    from hydra_supervisor.wire.server import WireServer

    server = WireServer(control=BenchControl(head_port, Path(slot_dir)), port=0)
    server.start()
    router = Router(HOST, 0, Upstreams(hydra=server), name="bench")
    router.start()
    print(server.port, router.port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    router.stop()
    server.stop()


@contextmanager
def wire_child(head_port: int = 0, slot_dir: str = "/tmp") -> Iterator[tuple[int, int]]:
    proc = subprocess.Popen([sys.executable, __file__, "_serve", str(head_port), slot_dir],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip():
            raise RuntimeError("the wire server child did not start")
        wire, routed = line.split()
        yield int(wire), int(routed)
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# ----------------------------------------------------------------------------------- helpers


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]


def lat_line(label: str, xs: list[float]) -> str:
    us = [x * 1e6 for x in xs]
    return (f"{label:<40} n={len(us):<6} p50 {pct(us, 50):8.1f} us   p99 {pct(us, 99):8.1f} us"
            f"   mean {statistics.fmean(us):8.1f} us")


def rt(sock: socket.socket, op: int, key: str = "", payload: bytes = b"") -> tuple[int, dict]:
    head, body = client.request_stream(sock, op, key, payload, timeout=60)
    for _ in body:
        pass
    return head.status, head.meta


# ------------------------------------------------------------------------------------- parts


def part_info(port: int, n: int, via: str) -> None:
    with client.connect(HOST, port, 10) as s:
        for _ in range(200):
            rt(s, Op.INFO)
        xs = []
        for _ in range(n):
            t = time.perf_counter()
            status, _ = rt(s, Op.INFO)
            xs.append(time.perf_counter() - t)
            assert status == Status.OK
    print(lat_line(f"INFO {via}, persistent connection", xs))
    ys = []
    for _ in range(max(50, n // 10)):
        t = time.perf_counter()
        with client.connect(HOST, port, 10) as s:
            rt(s, Op.INFO)
        ys.append(time.perf_counter() - t)
    print(lat_line(f"INFO {via}, new connection each", ys))


def part_configure(port: int, n: int, via: str) -> None:
    with client.connect(HOST, port, 10) as s:
        xs, noop = [], []
        for i in range(n):
            body = json.dumps({"temperature": round(0.1 + (i % 50) / 100, 2), "top_k": 40})
            t = time.perf_counter()
            status, meta = rt(s, Op.CONFIGURE, "0", body.encode())
            xs.append(time.perf_counter() - t)
            assert status == Status.OK and meta.get("tier") in ("T1", None), meta
            t = time.perf_counter()
            status, meta = rt(s, Op.CONFIGURE, "0", body.encode())
            noop.append(time.perf_counter() - t)
            assert meta.get("noop") is True
    print(lat_line(f"CONFIGURE T1 {via} (a change)", xs))
    print(lat_line(f"CONFIGURE {via} repeat (no-op)", noop))


@contextmanager
def llama_head(slot_dir: Path, ctx: int, log: Path) -> Iterator[int]:
    bins, model = llama_bins(), gemma_path()
    port = free_port()
    argv = [str(bins / "llama-server"), "-m", model, "--host", HOST, "--port", str(port),
            "-c", str(ctx), "-t", "2", "-np", "1", "--swa-full", "--slot-save-path",
            str(slot_dir)]
    with llama_process(argv, log) as proc:
        wait_health(port, proc, log)
        yield port


def mbps(nbytes: int, secs: float) -> float:
    return nbytes / secs / 1e6


def part_state(tokens: int, rounds: int, chunks: list[int]) -> None:
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hydra-wire-bench-")))
        slot_dir = tmp / "slots"
        slot_dir.mkdir()
        head = stack.enter_context(llama_head(slot_dir, tokens + 512, tmp / "llama.log"))
        prompt = "The quick brown fox jumps over the lazy dog. " * (tokens // 10)
        t = time.perf_counter()
        r = requests.post(f"http://{HOST}:{head}/completion", timeout=1200, json={
            "prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True})
        r.raise_for_status()
        print(f"prefilled {r.json()['timings']['prompt_n']} tokens in "
              f"{time.perf_counter() - t:.1f}s")
        port, _ = stack.enter_context(wire_child(head, str(slot_dir)))

        # baseline 1: llama-server's save + reading its file (what any file-based path costs)
        base_save, base_read = [], []
        size = 0
        for i in range(rounds):
            t = time.perf_counter()
            requests.post(f"http://{HOST}:{head}/slots/0?action=save", timeout=300,
                          json={"filename": f"base-{i}.bin"}).raise_for_status()
            t1 = time.perf_counter()
            data = (slot_dir / f"base-{i}.bin").read_bytes()
            t2 = time.perf_counter()
            (slot_dir / f"base-{i}.bin").unlink()  # as the wire server does: no writeback
            size = len(data)
            base_save.append(t2 - t)
            base_read.append(t2 - t1)
        print(f"slot state: {size / 1e6:.1f} MB")
        disk = mbps(size, statistics.median(base_read))
        save_read = mbps(size, statistics.median(base_save))
        print(f"{'read the slot file from disk':<44} {disk:9.0f} MB/s   (page cache)")
        print(f"{'llama-server save + read the file':<44} {save_read:9.0f} MB/s")

        state = b""
        with client.connect(HOST, port, 60) as s:
            for chunk in chunks:
                rt(s, Op.CONFIGURE, "0", json.dumps({"state_chunk_size": chunk}).encode())
                xs = []
                for _ in range(rounds):
                    t = time.perf_counter()
                    head_, body = client.request_stream(s, Op.STATE_GET, "0", timeout=300)
                    got = 0
                    parts = []
                    for p in body:
                        got += len(p)
                        parts.append(p)
                    xs.append(time.perf_counter() - t)
                    assert head_.status == Status.OK and got == size, head_.meta
                    state = b"".join(parts)
                v = mbps(size, statistics.median(xs))
                print(f"{'STATE_GET, chunk ' + str(chunk >> 10) + ' KiB':<44} {v:9.0f} MB/s   "
                      f"x{v / disk:.2f} of disk read, x{v / save_read:.2f} of save+read")

            # baseline 2: write the file + llama-server's restore
            bw = []
            for i in range(rounds):
                t = time.perf_counter()
                (slot_dir / f"put-{i}.bin").write_bytes(state)
                requests.post(f"http://{HOST}:{head}/slots/0?action=restore", timeout=300,
                              json={"filename": f"put-{i}.bin"}).raise_for_status()
                (slot_dir / f"put-{i}.bin").unlink()
                bw.append(time.perf_counter() - t)
            write_restore = mbps(size, statistics.median(bw))
            print(f"{'write the file + llama-server restore':<44} {write_restore:9.0f} MB/s")
            ys = []
            for _ in range(rounds):
                t = time.perf_counter()
                head_, body = client.request_stream(s, Op.STATE_PUT, "0", state, timeout=300)
                for _ in body:
                    pass
                ys.append(time.perf_counter() - t)
                assert head_.status == Status.OK, head_.meta
            v = mbps(size, statistics.median(ys))
            print(f"{'STATE_PUT':<44} {v:9.0f} MB/s   x{v / disk:.2f} of disk read, "
                  f"x{v / write_restore:.2f} of write+restore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="info,configure,state")
    ap.add_argument("--n", type=int, default=3000, help="round trips per latency part")
    ap.add_argument("--port", type=int, default=0,
                    help="an existing wire endpoint (e.g. an engine's router) for info/configure")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", default="65536,2097152,67108864")
    args = ap.parse_args()
    parts = args.parts.split(",")
    print(f"bench/wire.py  parts={args.parts}  cpus={os.cpu_count()}  "
          f"codec header={codec.REQUEST_HEADER.size}+{codec.RESPONSE_HEADER_SIZE} bytes")
    with ExitStack() as stack:
        targets = [("given", args.port)]
        if args.port == 0 and ({"info", "configure"} & set(parts)):
            wire, routed = stack.enter_context(wire_child())
            targets = [("direct", wire), ("via router", routed)]
        for via, port in targets:
            if "info" in parts:
                part_info(port, args.n, via)
            if "configure" in parts:
                part_configure(port, args.n // 3, via)
    if "state" in parts:
        part_state(args.tokens, args.rounds, [int(c) for c in args.chunks.split(",")])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        child_serve(int(sys.argv[2]), sys.argv[3])
    else:
        main()
