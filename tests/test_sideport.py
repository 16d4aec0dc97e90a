"""The metrics/dashboard side port is bounded (runtime/sideport.py): idle connections cost no
thread and at most `max_conns` descriptors, a silent one gives its place to a new one, a slow
head and a stuck body end at their deadlines, a huge Content-Length is refused unread, past the
cap a connection is answered 503, and out of descriptors the accept loop waits, logs and serves
again once they are back. Real sockets against a real SidePort (the WSGI app is a small one);
the metrics and dashboard apps on it: tests/test_metrics.py, tests/test_dashboard_unit.py."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from hydra_supervisor.runtime.sideport import Limits, SidePort
from hydra_supervisor.testing.harness import wait_until


def app(environ: dict[str, Any], start: Any) -> list[bytes]:
    length = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(length) if length else b""
    data = f"{environ['REQUEST_METHOD']} {environ['PATH_INFO']} {len(body)}".encode()
    start("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(data)))])
    return [data]


def serve(**limits: Any) -> SidePort:
    sp = SidePort("127.0.0.1", 0, app, limits=Limits(**limits))
    sp.start()
    return sp


@pytest.fixture
def side() -> Iterator[list[SidePort]]:
    made: list[SidePort] = []
    yield made
    for sp in made:
        sp.stop()


def ask(port: int, raw: bytes, timeout: float = 10.0) -> bytes:
    """Send `raw`, read the reply to its end."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def get(port: int, path: str = "/x") -> bytes:
    return ask(port, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())


def idle(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        out.append(s)
    return out


def test_idle_connections_cost_no_thread_and_at_most_the_cap(side: list[SidePort]) -> None:
    threads0 = threading.active_count()
    sp = serve(max_conns=16, workers=2, head_timeout=30, evict_after=0.2)
    side.append(sp)
    assert threading.active_count() == threads0 + 3  # the loop and two workers, no more
    me = psutil.Process()
    fds0 = me.num_fds()
    socks = idle(sp.port, 300)
    try:
        wait_until(lambda: sp.stats().get("evicted", 0) + sp.stats().get("refused", 0)
                   >= 300 - 16, 10, "the side port to take or evict every connection")
        st = sp.stats()
        assert st["open"] <= 16 and st["open_peak"] <= 16, st
        assert threading.active_count() == threads0 + 3
        # the test's own 300 client sockets, and on the server's side at most the cap open,
        # the refused ones lingering (told 503 for up to a second), and the listener
        assert me.num_fds() <= fds0 + 300 + 16 + sp.limits.max_lingering + 1
        # a request still gets through: once the silent ones are evict_after old, it takes
        # the place of the oldest (before that it may be told 503)
        reply = wait_until(lambda: _try_get(sp.port, "/page"), 10, "a request served")
        assert reply.endswith(b"GET /page 0"), reply
    finally:
        for s in socks:
            s.close()
    assert threading.active_count() == threads0 + 3


def test_past_the_cap_a_connection_is_answered_busy(side: list[SidePort]) -> None:
    sp = serve(max_conns=4, head_timeout=30, evict_after=60)
    side.append(sp)
    socks = idle(sp.port, 4)
    try:
        wait_until(lambda: sp.stats()["open"] == 4, 10, "four open connections")
        reply = get(sp.port)
        assert reply.startswith(b"HTTP/1.0 503 "), reply
        assert b"Retry-After: 1" in reply and b"too many connections" in reply
        assert sp.stats()["refused"] == 1
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: sp.stats()["open"] == 0, 10, "the connections to close")
    assert get(sp.port).endswith(b"GET /x 0")


def test_a_slow_head_ends_at_its_deadline(side: list[SidePort]) -> None:
    sp = serve(head_timeout=0.5)
    side.append(sp)
    with socket.create_connection(("127.0.0.1", sp.port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        assert s.recv(100) == b""  # closed by the server
        took = time.monotonic() - t0
    assert 0.4 <= took < 5, took
    assert sp.stats()["timed_out"] == 1
    # a body that never comes
    sp2 = serve(body_timeout=0.5)
    side.append(sp2)
    with socket.create_connection(("127.0.0.1", sp2.port), timeout=10) as s:
        s.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        assert s.recv(100) == b""
    assert sp2.stats()["timed_out"] == 1


def test_a_huge_body_is_refused_unread(side: list[SidePort]) -> None:
    sp = serve(max_body=1024)
    side.append(sp)
    rss0 = psutil.Process().memory_info().rss
    reply = ask(sp.port, b"POST /api/switch HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 100000000000\r\n\r\n{")
    assert reply.startswith(b"HTTP/1.0 413 "), reply
    chunked = b"".join(b"400\r\n" + b"a" * 1024 + b"\r\n" for _ in range(4)) + b"0\r\n\r\n"
    reply = ask(sp.port, b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                + chunked)
    assert reply.startswith(b"HTTP/1.0 413 "), reply
    assert sp.stats()["too_large"] == 2
    assert psutil.Process().memory_info().rss - rss0 < 50 << 20
    # within the bound it is read and handed to the app
    assert ask(sp.port, b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
               ).endswith(b"POST /a 5")
    # a head too long or malformed: 4xx, not a worker
    assert ask(sp.port, b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 4")
    assert ask(sp.port, b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.0 400 ")


SERVER = """
import resource, sys, time, logging
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
from hydra_supervisor.runtime.sideport import Limits, SidePort
def app(environ, start):
    start("200 OK", [("Content-Length", "2")]); return [b"ok"]
sp = SidePort("127.0.0.1", 0, app, limits=Limits(max_conns=1000, head_timeout=60))
sp.start()
import os
n = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print("port", sp.port, flush=True)
sys.stdin.readline()
print("stats", sp.stats(), flush=True)
"""


def test_out_of_descriptors_the_accept_loop_waits_logs_and_serves_again() -> None:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SERVER)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline().split()[1])
        socks = idle(port, 80)  # twice what it may open: the kernel queues the rest
        try:
            with pytest.raises(OSError):  # refused or timed out: no descriptor to take it
                with socket.create_connection(("127.0.0.1", port), timeout=1.5) as s:
                    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                    if not s.recv(10):
                        raise OSError("closed")
        finally:
            for s in socks:
                s.close()
        # the silent ones are closed by their clients: the server frees them and accepts again
        reply = wait_until(lambda: _try_get(port), 30, "the side port to serve again")
        assert reply.endswith(b"ok")
        proc.stdin.write("\n")
        proc.stdin.flush()
        out = proc.stdout.read()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "cannot accept connections" in out, out
    assert re.search(r"'accept_failed': [1-9]", out), out


def _try_get(port: int, path: str = "/") -> bytes | None:
    """The reply when it is a 200, else None."""
    try:
        reply = ask(port, f"GET {path} HTTP/1.0\r\n\r\n".encode(), timeout=2)
    except OSError:
        return None
    return reply if reply.startswith(b"HTTP/1.0 200 ") else None
