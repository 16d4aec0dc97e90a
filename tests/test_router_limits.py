"""The router within process limits and against silent clients: 1,000 concurrent streams under
``ulimit -n 1024`` (as root and as an unprivileged user), silent connections that must not
starve prompt ones, idle timeouts (HTTP yes, ggml-RPC no), a failing thread start, small pipes,
rate-limited rejection logs."""

from __future__ import annotations

import json
import logging
import os
import pwd
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests

from hydra_supervisor.router import Router, Upstreams, limits, raise_nofile
from hydra_supervisor.router.conn import Conn
from hydra_supervisor.router.routes import one_route_table
from hydra_supervisor.testing.routerhelp import (
    HOST,
    ROUTER_CHILD,
    EchoServer,
    child,
    connect,
    drive_streams,
    one_route,
    readline,
    recv_exact,
    recv_to_eof,
    stream_request,
    wait_until,
)
from hydra_supervisor.testing.routerhelp import raise_nofile as raise_test_nofile
from hydra_supervisor.testing.sse_upstream import StandIn

ROOT = Path(__file__).resolve().parent.parent
RPC_HELLO = bytes([0x0E]) + (0).to_bytes(8, "little")
TEST_USER = "hydra-test"


@pytest.fixture
def upstream() -> Iterator[StandIn]:
    s = StandIn()
    yield s
    s.close()


def test_raise_nofile_lifts_soft_to_hard() -> None:
    code = ("import resource; from hydra_supervisor.router import raise_nofile; "
            "s, h = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, h)); print(*raise_nofile(), h)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, timeout=30).stdout.split()
    soft, hard, was_hard = map(int, out)
    assert soft == hard == was_hard
    assert raise_nofile()[0] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --------------------------------------------------------------------------- 1,000 streams


def _unprivileged_python() -> tuple[list[str], dict[str, str]] | str:
    """(argv prefix, env) to run Python as TEST_USER, creating the user; or why we cannot."""
    if os.geteuid() != 0:
        return "not root: cannot switch to another user"
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            return "useradd not found"
        made = subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/bin/false",
                               TEST_USER], capture_output=True, text=True, timeout=30)
        if made.returncode != 0:
            return f"useradd failed: {made.stderr.strip()}"
    # The venv's interpreter may live under /root (not traversable by others): use the system
    # interpreter of the same version with the venv's packages on the path.
    site = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{site / 'site-packages'}"}
    for exe in (sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
        try:
            r = subprocess.run([exe, "-c", "import h11, psutil, hydra_supervisor.router"],
                               user=TEST_USER, group=TEST_USER, extra_groups=[], env=env,
                               cwd="/", capture_output=True, timeout=30)
        except OSError:
            continue  # not executable for that user
        if r.returncode == 0:
            return [exe], env
    return f"no Python interpreter that {TEST_USER} may run with this project's packages"


@contextmanager
def _run_child_router(
    soft: int, hard: int, upstream_port: int, as_user: bool
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    popen: dict[str, Any] = {"cwd": ROOT}
    argv = [sys.executable]
    if as_user:
        how = _unprivileged_python()
        if isinstance(how, str):
            pytest.skip(how)
        argv, env = how
        popen.update(user=TEST_USER, group=TEST_USER, extra_groups=[], env=env, cwd="/")
    with child([*argv, "-c", ROUTER_CHILD, str(soft), str(hard), str(upstream_port)],
               **popen) as proc:
        yield proc, json.loads(readline(proc, timeout=30))


def _child_stats(proc: subprocess.Popen[str], answered: int) -> dict[str, Any]:
    """The child router's stats once ``answered`` requests are counted (a request is counted
    just after its last byte is sent, so right after the clients finish it may lag)."""
    assert proc.stdin is not None
    deadline = time.monotonic() + 10
    while True:
        proc.stdin.write("stats\n")
        proc.stdin.flush()
        st = dict(json.loads(readline(proc, timeout=10)))
        if st["http"]["requests"] >= answered or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


@pytest.fixture(scope="module")
def upstream_child() -> Iterator[int]:
    """The stand-in upstream in its own process (1,000 handler threads stay out of ours)."""
    raise_test_nofile(16384)
    with child([sys.executable, "-m", "hydra_supervisor.testing.sse_upstream"], cwd=ROOT) as proc:
        yield int(readline(proc, timeout=30))


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "unprivileged"])
def test_thousand_streams_under_ulimit_1024(upstream_child: int, as_user: bool) -> None:
    """Soft limit 1024, hard limit as the system has it: the router lifts its soft limit and
    carries 1,000 concurrent SSE streams (each open ~8 s, so all overlap)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"hard RLIMIT_NOFILE {hard} is below what 1,000 relays need")
    n = 1000
    with _run_child_router(1024, int(hard), upstream_child, as_user) as (proc, hello):
        assert hello["nofile"][0] == hello["nofile"][1] > 1024
        res = drive_streams(hello["port"], n, stream_request(tokens=16, delay=0.5), timeout=120)
        assert res["done"] == n, res["failed"][:5]
        st = _child_stats(proc, n)
        assert st["open_peak"] >= 0.9 * n, st
        assert st["refused"] == {} and st["http"]["2xx"] == n, st
        assert st["events"].get("emfile_wait", 0) == 0


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "unprivileged"])
def test_thousand_streams_hard_limit_1024_all_served(upstream_child: int, as_user: bool) -> None:
    """Hard limit 1024 too: admission is sized from it, so the streams beyond it wait their
    turn (queue, then the kernel backlog) and every one is served; none dies of EMFILE."""
    n = 1000
    with _run_child_router(1024, 1024, upstream_child, as_user) as (proc, hello):
        assert hello["nofile"] == [1024, 1024]
        res = drive_streams(hello["port"], n, stream_request(tokens=4, delay=0.1), timeout=120)
        assert res["done"] == n, res["failed"][:5]
        st = _child_stats(proc, n)
        assert st["open_peak"] * 2 <= st["fds"]["budget"] + 2, st
        assert st["refused"] == {} and st["http"]["2xx"] == n, st


# --------------------------------------------------------------------------- silent clients


def test_silent_connections_do_not_starve_prompt_clients(upstream: StandIn) -> None:
    """200 silent connections from one address (what a NAT or a load balancer in front looks
    like): nobody is evicted (the queue has room for them), prompt clients are served."""
    r = Router(HOST, 0, Upstreams())
    one_route(r, upstream.addr)
    r.start()
    silent: list[socket.socket] = []
    try:
        silent = [connect(r.port) for _ in range(200)]
        wait_until(lambda: r.stats()["accepted"] == 200, what="200 accepted")
        session = requests.Session()
        for i in range(20):
            reply = requests.get(f"http://{HOST}:{r.port}/health", timeout=5)  # new connection
            assert reply.status_code == 200, i
            assert session.get(f"http://{HOST}:{r.port}/health", timeout=5).status_code == 200
        wait_until(lambda: r.stats()["http"]["2xx"] == 40, what="40 counted")
        st = r.stats()
        assert st["refused"] == {}, st["refused"]
        assert st["pending"] == 200
        silent[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the oldest speaks
        assert silent[0].recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        for s in silent:
            s.close()
        r.stop()


def test_full_silent_queue_evicts_only_the_long_silent_with_a_503(upstream: StandIn) -> None:
    """A full silent queue evicts only connections silent past `evict_after`, oldest of the
    address with the most first; the evicted get a 503 with Retry-After, not a reset, and new
    connections wait in the kernel's backlog meanwhile rather than being refused."""
    r = Router(HOST, 0, Upstreams(), max_pending=64, evict_after=0.5)
    one_route(r, upstream.addr)
    r.start()
    socks: list[socket.socket] = []

    def from_addr(ip: str) -> socket.socket:
        s = socket.socket()
        s.bind((ip, 0))
        s.settimeout(10)
        s.connect((HOST, r.port))
        socks.append(s)
        return s

    try:
        slow = from_addr("127.0.0.3")  # connects, says nothing yet
        flood = [from_addr(ip) for _ in range(40) for ip in ("127.0.0.2", "127.0.0.4")]
        wait_until(lambda: r.stats()["accepted"] == 64, what="the queue full")
        # 17 more are in the kernel's backlog, none refused while the silent ones are young.
        assert r.stats()["refused"] == {}
        # Once silent long enough, the oldest of the largest sources make room: a 503.
        reply = recv_to_eof(flood[0], timeout=10)
        assert reply.startswith(b"HTTP/1.1 503 ") and b"Retry-After:" in reply
        wait_until(lambda: r.stats()["accepted"] == 81, what="the backlog accepted")
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert slow.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert r.stats()["refused"]["silent_evicted"] >= 17
    finally:
        for s in socks:
            s.close()
        r.stop()


def test_rpc_relay_not_idle_timed_http_keepalive_is() -> None:
    echo = EchoServer(tag=b"rpc:")
    r = Router(HOST, 0, Upstreams(rpc=echo.addr), idle_timeout=0.2)
    r.start()
    try:
        with connect(r.port) as c:
            c.sendall(RPC_HELLO)
            assert recv_exact(c, 4 + len(RPC_HELLO)) == b"rpc:" + RPC_HELLO
            admitted: list[Conn] = []
            r.ledger.each_active(admitted.append)
            [conn] = admitted
            assert conn.client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            time.sleep(1.0)  # 5x the HTTP idle timeout: a head's quiet link stays up
            c.sendall(b"ping")
            assert recv_exact(c, 4) == b"ping"
    finally:
        r.stop()
        echo.close()


def test_http_client_socket_has_nodelay_and_keepalive(upstream: StandIn) -> None:
    """Set once on the listener and inherited by every accepted socket (no setsockopt per
    connection on the way to its first byte): an HTTP client's socket has both."""
    r = Router(HOST, 0, Upstreams(rpc=None, hydra=None))
    route = r.new_route("p")
    route.http = upstream.addr
    r.table = one_route_table(route)
    r.start()
    try:
        with connect(r.port) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.recv(65536).startswith(b"HTTP/1.1 200 ")
            admitted: list[Conn] = []
            r.ledger.each_active(admitted.append)
            [conn] = admitted
            sock = conn.client
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            # router/conn.py: an HTTP client is probed after 60 s idle
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 60
    finally:
        r.stop()


# --------------------------------------------------------------------------- own faults


class _NoStart(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_failed_thread_start_503_and_recovery(upstream: StandIn) -> None:
    fail = {"left": 2}

    def factory(**kw: Any) -> threading.Thread:
        if not kw.get("name", "").endswith(("-accept", "-pump")) and fail["left"] > 0:
            fail["left"] -= 1
            return _NoStart(**kw)
        return threading.Thread(**kw)

    r = Router(HOST, 0, Upstreams(), thread_factory=factory)
    one_route(r, upstream.addr)
    r.start()
    try:
        for _ in range(2):
            reply = requests.get(f"http://{HOST}:{r.port}/health", timeout=5)
            assert reply.status_code == 503 and "Retry-After" in reply.headers
            assert "out of threads" in reply.json()["error"]["message"]
        assert r.alive()
        assert requests.get(f"http://{HOST}:{r.port}/health", timeout=5).status_code == 200
        st = r.stats()
        assert st["refused"] == {"thread_start": 2} and st["fds"]["relays"] <= 2
    finally:
        r.stop()


def test_acceptor_start_failure_leaves_router_restartable(upstream: StandIn) -> None:
    calls = {"n": 0}

    def factory(**kw: Any) -> threading.Thread:
        calls["n"] += 1
        return _NoStart(**kw) if calls["n"] == 1 else threading.Thread(**kw)

    r = Router(HOST, 0, Upstreams(), thread_factory=factory)
    one_route(r, upstream.addr)
    with pytest.raises(RuntimeError):
        r.start()
    assert not r.alive()
    r.start()
    try:
        assert r.alive()
        assert requests.get(f"http://{HOST}:{r.port}/health", timeout=5).status_code == 200
    finally:
        r.stop()


@pytest.mark.parametrize("fault", ["small_pipe", "no_pipe"])
def test_splice_pipe_trouble_falls_back_to_copy(
    monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    echo = EchoServer(tag=b"rpc:")
    if fault == "small_pipe":  # an unprivileged user past pipe-user-pages-soft
        monkeypatch.setattr(limits, "pipe_capacity", lambda w, want: 4096)
    else:
        def no_pipe() -> tuple[int, int]:
            raise OSError(24, "Too many open files")

        monkeypatch.setattr("hydra_supervisor.router.relay.os.pipe", no_pipe)
    r = Router(HOST, 0, Upstreams(rpc=echo.addr))
    r.start()
    try:
        with connect(r.port) as c:
            data = RPC_HELLO + os.urandom(1 << 20)
            c.sendall(data)
            assert recv_exact(c, 4 + len(data)) == b"rpc:" + data
        events = r.stats()["events"]
        assert events == {"pipe_small" if fault == "small_pipe" else "pipe_unavailable": 2}
    finally:
        r.stop()
        echo.close()


def test_rejections_logged_at_most_once_per_interval(
    upstream: StandIn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hydra.router")
    r = Router(HOST, 0, Upstreams())
    one_route(r, upstream.addr)
    r.start()
    try:
        for _ in range(5):
            with connect(r.port) as c:
                c.sendall(b"\x16\x03\x01")  # TLS to a plain-HTTP port
                recv_to_eof(c, timeout=3)
        wait_until(lambda: r.stats()["refused"].get("rejected") == 5, what="5 rejected")
        lines = [m for m in caplog.messages if "refused: rejected" in m]
        assert len(lines) == 1 and "160301" in lines[0]
    finally:
        r.stop()
