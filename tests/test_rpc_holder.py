"""A lent rpc-server has one holder (issue 32, item 1): the peer host's router lets one ggml-RPC
connection through to it, refuses every other one itself (closed, never connected to the
rpc-server, so its accept queue never fills with heads that would wait there), names the
holder (address, the build its hydra announced in INFO) and lets the next head in once the
holder's connection ends: closed, reset, or its process killed.

The router is real (127.0.0.1:0); the rpc-server is a stand-in that counts its connections
(EchoServer: the count is what these tests check), and so is the INFO answerer of the
fast head-side test. tests/test_peer_hold.py runs the same with real binaries."""

from __future__ import annotations

import io
import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from rich.console import Console

from hydra_supervisor.cli import doctor, status_view
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import layout
from hydra_supervisor.proc import rpcproto
from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.router.acceptor import RPC_HOLD_GRACE_S
from hydra_supervisor.router.classify import announced_build
from hydra_supervisor.serve.snapshot import LaneStatus, RouterCounters, parse
from hydra_supervisor.testing.routerhelp import (
    DEADLINE,
    HOST,
    EchoServer,
    FuncServer,
    connect,
    one_route,
    recv_exact,
    recv_to_eof,
    wait_until,
)
from hydra_supervisor.tools import buildid
from hydra_supervisor.wire import codec
from tests.rpc_fakes import encode_hello_response
from tests.test_peer_identity import HERE, PROTO, _node, _plan

RPC_HELLO = bytes([0x0E]) + (0).to_bytes(8, "little")


@pytest.fixture
def rpc() -> Iterator[EchoServer]:
    srv = EchoServer(tag=b"rpc:")
    yield srv
    srv.close()


@pytest.fixture
def router(rpc: EchoServer) -> Iterator[Router]:
    r = Router(HOST, 0, Upstreams(rpc=rpc.addr), name="peer")
    one_route(r, None)
    r.start()
    yield r
    r.stop()


def _hold(port: int) -> socket.socket:
    """A head's ggml-RPC connection, through and answered (held)."""
    s = connect(port)
    s.sendall(RPC_HELLO)
    assert recv_exact(s, 4 + len(RPC_HELLO)) == b"rpc:" + RPC_HELLO
    return s


def _refused(port: int) -> float:
    """A second head's HELLO: closed by the router without a byte; how long it took."""
    t0 = time.monotonic()
    s = connect(port)
    try:
        s.sendall(RPC_HELLO)
        assert recv_to_eof(s) == b""
    finally:
        s.close()
    return time.monotonic() - t0


def test_a_second_head_is_refused_four_times_and_the_holder_keeps_serving(
        router: Router, rpc: EchoServer) -> None:
    held = _hold(router.port)
    took = [_refused(router.port) for _ in range(4)]
    assert rpc.accepted == 1, "a refused head reached the rpc-server"
    assert all(t < RPC_HOLD_GRACE_S + 2.0 for t in took), took
    c = router.counters()
    assert c["refused"].get("rpc_held") == 4
    holder = c["rpc_holder"]
    assert holder is not None and holder["addr"] == "{}:{}".format(*held.getsockname()[:2])
    assert holder["build"] is None  # it announced none (a plain llama-server, say)
    held.sendall(b"graph")  # the holder was never disturbed
    assert recv_exact(held, 5) == b"graph"
    assert router.counters()["rpc_holder"]["bytes_up"] >= len(RPC_HELLO) + 5  # type: ignore[index]
    held.close()


@pytest.mark.parametrize("how", ["close", "reset", "kill -9"])
def test_the_peer_is_free_again_once_the_holder_is_gone(router: Router, rpc: EchoServer,
                                                        how: str) -> None:
    if how == "kill -9":  # a head process that died without closing anything itself
        child = subprocess.Popen([sys.executable, "-c", (
            "import socket, sys, time\n"
            f"s = socket.create_connection(('{HOST}', {router.port}))\n"
            f"s.sendall({RPC_HELLO!r})\n"
            "assert s.recv(4)\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline() == "held\n"
            assert _refused(router.port) >= 0
            child.kill()
        finally:
            child.wait(DEADLINE)
    else:
        held = _hold(router.port)
        assert _refused(router.port) >= 0
        if how == "reset":
            held.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        held.close()
    wait_until(lambda: router.counters()["rpc_holder"] is None, DEADLINE, "holder released")
    nxt = _hold(router.port)  # the next head is served
    assert rpc.accepted == 2
    nxt.close()


def test_a_head_reconnecting_at_once_is_let_through(router: Router, rpc: EchoServer) -> None:
    """A head's llama-server closes one connection and opens the next at once (device query,
    then load): the router may see the new one before the old one's end; it waits for it."""
    for _ in range(20):
        s = _hold(router.port)
        s.close()
    assert rpc.accepted == 20
    assert router.counters()["refused"].get("rpc_held", 0) == 0


def test_the_holder_is_named_with_the_build_its_hydra_announced(router: Router) -> None:
    info = FuncServer(lambda c: c.sendall(codec.encode_response(codec.Status.OK, {})))
    try:
        router.set_upstreams(Upstreams(rpc=router.upstreams.rpc, hydra=info.addr))
        s = connect(router.port)
        s.sendall(codec.encode_request(codec.Op.INFO, payload=json.dumps(
            {"head": {"build": HERE.fingerprint}}).encode()))
        recv_to_eof(s)
        s.close()
        held = _hold(router.port)
        holder = router.counters()["rpc_holder"]
        assert holder is not None and holder["build"] == HERE.fingerprint
        held.close()
    finally:
        info.close()


def test_announced_build_reads_only_a_whole_info_request() -> None:
    req = codec.encode_request(codec.Op.INFO, payload=b'{"head": {"build": "b1-abc"}}')
    assert announced_build(req) == "b1-abc"
    assert announced_build(req[:-1]) is None  # not all read yet
    assert announced_build(codec.encode_request(codec.Op.INFO)) is None
    assert announced_build(codec.encode_request(codec.Op.INFO, payload=b"{nope")) is None
    assert announced_build(codec.encode_request(codec.Op.CONFIGURE,
                                                payload=b'{"head": {"build": "x"}}')) is None
    assert announced_build(RPC_HELLO) is None


def _rpc_server(c: socket.socket) -> None:
    """A ggml-rpc-server stand-in: answers HELLO, then echoes until EOF."""
    recv_exact(c, 9 + rpcproto.CAPS_SIZE)
    c.sendall(encode_hello_response(PROTO))
    while data := c.recv(65536):
        c.sendall(data)


def _info_stand_in(router: Router) -> FuncServer:
    """The peer's wire server as far as INFO goes: this host's identity, nothing lent, and the
    router's holder (what the real one answers)."""
    def answer(c: socket.socket) -> None:
        _, _, _, klen, plen, tlen = struct.unpack("<HBBHQH", recv_exact(c, 16))
        recv_exact(c, klen + plen + tlen)
        c.sendall(codec.encode_response(codec.Status.OK, {
            "identity": HERE.to_json(), "lent": [],
            "rpc_holder": dict(router.counters()["rpc_holder"] or {}) or None}))

    return FuncServer(answer)


def test_hydra_up_on_a_second_head_names_the_holder(router: Router,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The head side: INFO (the peer's wire server, here a stand-in that says what the real
    one does: the router's holder) names the holder; `hydra up` is refused with that line
    before any HELLO reaches the peer."""
    monkeypatch.setattr(buildid, "local_identity", lambda configured=None: HERE)
    info, rpc = _info_stand_in(router), FuncServer(_rpc_server)
    try:
        router.set_upstreams(Upstreams(rpc=rpc.addr, hydra=info.addr))
        endpoint = f"{HOST}:{router.port}"
        layout.check_remote_peers(_plan(endpoint), timeout=DEADLINE, node=_node(endpoint))
        held = connect(router.port)  # the first head (announced HERE's build just above)
        held.sendall(rpcproto.HELLO_REQUEST)
        assert rpcproto.decode_hello_response(
            recv_exact(held, rpcproto.HELLO_RESPONSE_SIZE)) == PROTO
        for _ in range(4):
            with pytest.raises(HydraError) as exc:
                layout.check_remote_peers(_plan(endpoint), timeout=DEADLINE,
                                          node=_node(endpoint))
            msg = exc.value.message
            assert msg.startswith(f"remote peer p100 at {endpoint} is busy: its rpc-server is "
                                  f"held by {HOST}:{held.getsockname()[1]} "
                                  f"(build {HERE.fingerprint}) for "), msg
        assert rpc.accepted == 2  # the first head's check and its hold; no refused HELLO
        held.sendall(b"x")
        assert recv_exact(held, 1) == b"x"
        held.close()
    finally:
        info.close()
        rpc.close()


def _hello_held(port: int) -> socket.socket:
    """A head's ggml-RPC connection past its HELLO, answered by a ggml-RPC stand-in
    (`_rpc_server`): it holds the rpc-server until closed."""
    held = connect(port)
    held.sendall(rpcproto.HELLO_REQUEST)
    recv_exact(held, rpcproto.HELLO_RESPONSE_SIZE)
    return held


def test_doctor_names_the_holder_without_a_hello(router: Router) -> None:
    """`hydra doctor --peers`: INFO names the holder, so no HELLO is sent (it would be
    refused); the report is the `hydra up` line."""
    info, rpc = _info_stand_in(router), FuncServer(_rpc_server)
    try:
        router.set_upstreams(Upstreams(rpc=rpc.addr, hydra=info.addr))
        endpoint = f"{HOST}:{router.port}"
        held = _hello_held(router.port)
        rep = doctor.probe_peer("p100", endpoint, timeout=DEADLINE)
        assert rep.error is not None and rep.error.startswith(
            f"remote peer p100 at {endpoint} is busy: its rpc-server is held by "
            f"{HOST}:{held.getsockname()[1]} for "), rep.error  # no build announced
        assert rpc.accepted == 1 and router.counters()["refused"].get("rpc_held", 0) == 0
        held.close()
    finally:
        info.close()
        rpc.close()


def test_status_names_the_holder() -> None:
    """`hydra status` on the peer host: under the router line, who holds the lent device."""
    r = parse(RouterCounters, {"rpc_holder": {
        "addr": "10.0.0.1:55258", "build": HERE.fingerprint, "held_s": 75.2,
        "bytes_up": 38253869, "bytes_down": 1 << 20}, "refused": {"rpc_held": 4}})
    lane = LaneStatus(name="port-8090/demo-peer", profile="demo-peer", state="serving")
    out = Console(file=io.StringIO(), width=200, color_system=None)
    t0 = time.time()
    for part in status_view.lane_renderables(lane, "http://127.0.0.1:8090", router=r):
        out.print(part)
    t1 = time.time()
    text = out.file.getvalue()  # type: ignore[attr-defined]
    # since: this host's clock less held_s (read between t0 and t1)
    since = {time.strftime("%H:%M:%S", time.localtime(t - 75.2)) for t in (t0, t1)}
    assert any(
        f"lent to 10.0.0.1:55258 (build {HERE.fingerprint}) for 1m15s (since {s}); 36.5 MiB "
        "sent to the rpc-server, 1.0 MiB back; 4 other heads' connections refused since start "
        "(one head at a time)" in text for s in since), text
    r = parse(RouterCounters, {"rpc_holder": None})
    out = Console(file=io.StringIO(), width=200, color_system=None)
    for part in status_view.lane_renderables(lane, "http://127.0.0.1:8090", router=r):
        out.print(part)
    assert "lent to" not in out.file.getvalue()  # type: ignore[attr-defined]


def test_status_of_a_lending_port_counts_no_http() -> None:
    """A port that lends a device (ggml-rpc://) serves no HTTP: its router line says its
    connections, not HTTP requests that are always 0."""
    r = parse(RouterCounters, {"open": 1, "accepted": 7, "rpc_holder": {
        "addr": "10.0.0.1:55258", "build": "", "held_s": 5.0, "bytes_up": 0,
        "bytes_down": 0}})
    lane = LaneStatus(name="port-8090/demo-peer", profile="demo-peer", state="serving")
    out = Console(file=io.StringIO(), width=200, color_system=None)
    for part in status_view.lane_renderables(lane, "ggml-rpc://0.0.0.0:8090 (TLS only)",
                                             router=r):
        out.print(part)
    text = out.file.getvalue()  # type: ignore[attr-defined]
    assert "router: 1 open, 7 accepted (ggml-RPC and Hydra frames: a port that lends serves " \
        "no HTTP)" in text, text
    assert "HTTP requests" not in text and "lent to 10.0.0.1:55258" in text, text


def test_a_head_that_takes_the_peer_between_info_and_hello_is_named(
        router: Router, monkeypatch: pytest.MonkeyPatch) -> None:
    """INFO said free, then another head took it: the HELLO is closed by the router, and
    `hydra up` asks INFO again and names that head instead of "closed during HELLO"."""
    monkeypatch.setattr(buildid, "local_identity", lambda configured=None: HERE)
    asked: list[int] = []

    def answer(c: socket.socket) -> None:
        _, _, _, klen, plen, tlen = struct.unpack("<HBBHQH", recv_exact(c, 16))
        recv_exact(c, klen + plen + tlen)
        asked.append(1)
        holder = dict(router.counters()["rpc_holder"] or {}) or None
        c.sendall(codec.encode_response(codec.Status.OK, {
            "identity": HERE.to_json(), "lent": [],
            "rpc_holder": holder if len(asked) > 1 else None}))  # the first INFO: before it

    info, rpc = FuncServer(answer), FuncServer(_rpc_server)
    try:
        router.set_upstreams(Upstreams(rpc=rpc.addr, hydra=info.addr))
        endpoint = f"{HOST}:{router.port}"
        held = _hello_held(router.port)
        with pytest.raises(HydraError) as exc:
            layout.check_remote_peers(_plan(endpoint), timeout=DEADLINE, node=_node(endpoint))
        assert f"is busy: its rpc-server is held by {HOST}:{held.getsockname()[1]}" in \
            exc.value.message, exc.value.message
        assert len(asked) == 2 and router.counters()["refused"].get("rpc_held") == 1
        assert rpc.accepted == 1
        held.close()
    finally:
        info.close()
        rpc.close()
