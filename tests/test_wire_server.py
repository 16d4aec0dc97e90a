"""Every opcode over a real socket against a stub EngineControl and a fake slot API; fuzzed and
truncated frames never stop the server. (tests/test_wire_llama.py: the same on llama-server.)"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from hydra_supervisor.testing.routerhelp import recv_to_eof, wait_until
from hydra_supervisor.wire.server import WireServer
from tests import wire_client as wc
from tests.wire_fakes import FakeSlots, StubControl


@pytest.fixture
def server(control: StubControl) -> Iterator[WireServer]:
    s = WireServer(control=control, port=0)
    s.start()
    yield s
    s.stop()


def client(server: WireServer) -> wc.WireClient:
    return wc.WireClient("127.0.0.1", server.port, timeout=10)


def test_info_is_truthful(server: WireServer, control: StubControl) -> None:
    with client(server) as c:
        r = c.info()
        assert r.status == wc.OK and r.payload == b""
        assert r.meta["profile"] == "demo" and r.meta["model"] == "gemma3-270m"
        assert r.meta["ops"]["STATE_GET"] == "served"
        assert r.meta["ops"]["DECODE"] == "not_implemented"
        assert r.meta["state_chunk_size"] == 2 << 20
        control.is_busy = True  # INFO still answers, and says so
        assert c.info().meta["busy"] is True


def test_configure_tiers(server: WireServer, control: StubControl) -> None:
    with client(server) as c:
        r = c.configure({"temperature": 0.2, "top_k": "40"})
        assert r.status == wc.OK and r.meta["tier"] == "T1" and r.meta["success"] is True
        assert control.configured == [{"temperature": 0.2, "top_k": 40}]
        r = c.configure({"temperature": 0.2, "top_k": 40})  # same again: a no-op
        assert r.status == wc.OK and r.meta["noop"] is True and r.meta["tier"] is None
        assert len(control.configured) == 1
        r = c.configure({"n_ctx": 4096, "ngl": 99, "nonsense": 1})
        assert r.status == wc.OK and r.meta["tier"] == "T3"
        assert r.meta["params_applied"] == {"ctx_size": 4096, "n_gpu_layers": 99}
        assert r.meta["unknown_keys"] == ["nonsense"] and r.meta["restarted"] == ["head"]
        r = c.configure({"port": 9999, "temperature": 1.0})
        assert r.status == wc.ERROR and "port" in r.meta["error"]
        assert "restart hydra" in r.meta["error"] and r.meta["success"] is False
        assert len(control.configured) == 2  # T4 refused the whole payload
        r = c.configure({"port": 8080})  # the current value: fine
        assert r.status == wc.OK and r.meta["noop"] is True
        r = c.configure({"top_k": "lots"})
        assert r.status == wc.BAD_REQUEST and "top_k" in r.meta["invalid"]
        control.refuse = "the profile has no peer"
        r = c.configure({"model": "other"})
        assert r.status == wc.ERROR and r.meta["error"] == "the profile has no peer"
        r = c.request(wc.CONFIGURE, "0", b"{not json")
        assert r.status == wc.BAD_REQUEST and "JSON" in r.meta["error"]
        assert c.info().status == wc.OK  # the connection is still in step


def test_state_chunk_size_echoed_clamped(server: WireServer) -> None:
    with client(server) as c:
        r = c.configure({"state_chunk_size": 1})
        assert r.status == wc.OK and r.meta["state_chunk_size_applied"] == 64 << 10
        assert r.meta.get("noop") is True
        r = c.configure({"state_chunk_size": 1 << 40})
        assert r.meta["state_chunk_size_applied"] == 64 << 20
        assert c.info().meta["state_chunk_size"] == 64 << 20


def test_set_expert_mode(server: WireServer, control: StubControl) -> None:
    with client(server) as c:
        assert c.expert_mode("combined").meta == {"success": True, "mode": "combined"}
        assert c.request(wc.SET_EXPERT_MODE, "", b'{"mode":"solo"}').meta["mode"] == "solo"
        assert control.modes == ["combined", "solo"]
        r = c.expert_mode("turbo")
        assert r.status == wc.BAD_REQUEST and "solo" in r.meta["error"]
        control.refuse = "demo is not an MoE profile"
        r = c.expert_mode("combined")
        assert r.status == wc.ERROR and r.meta == {"success": False,
                                                   "error": "demo is not an MoE profile"}


@pytest.mark.parametrize("op", [wc.DECODE, wc.SWAP_QUANT, wc.PIPELINE_ATTACH, 0x01, 0x33, 0xFF])
def test_not_implemented_ops_drain_their_payload(server: WireServer, op: int) -> None:
    with client(server) as c:
        r = c.request(op, "0", os.urandom(100_000))
        assert r.status == wc.NOT_IMPLEMENTED and r.meta["success"] is False
        assert c.info().status == wc.OK


def test_busy_and_no_head(server: WireServer, control: StubControl) -> None:
    with client(server) as c:
        control.is_busy = True
        for op, payload in ((wc.CONFIGURE, b'{"top_k": 1}'), (wc.STATE_GET, b""),
                            (wc.STATE_PUT, b"x" * 10),
                            (wc.SET_EXPERT_MODE, b"solo"), (wc.PREFILL, b"{}")):
            assert c.request(op, "0", payload).status == wc.BUSY, op
        # an op hydra never serves says so even now (BUSY would ask for a retry that cannot
        # help: docs/protocol.md's status table)
        for op in (wc.DECODE, wc.SWAP_QUANT, wc.PIPELINE_ATTACH):
            assert c.request(op, "0", b"x" * 10).status == wc.NOT_IMPLEMENTED, op
        assert c.info().meta["busy"] is True  # INFO answers, and says so
        # what changes nothing is still answered: Hydra.Core's state_chunk_size greeting
        r = c.configure({"state_chunk_size": 1 << 20, "model": "gemma3-270m"})
        assert r.status == wc.OK and r.meta["state_chunk_size_applied"] == 1 << 20
        assert control.configured == []
        control.is_busy = False
        control.head = None
        r = c.request(wc.STATE_GET, "0")
        assert r.status == wc.ERROR and "no head" in r.meta["error"]
        r = c.request(wc.STATE_META, "x")
        assert r.status == wc.ERROR and "slot id" in r.meta["error"]


def test_state_get_put_meta_prefill(server: WireServer, fake_slots: FakeSlots,
                                    tmp_path: Path) -> None:
    state = os.urandom(300_000)
    fake_slots.states[1] = state
    with client(server) as c:
        c.configure({"state_chunk_size": 65536})
        r = c.request(wc.STATE_GET, "1")
        assert r.status == wc.OK and r.payload == state
        assert r.meta["state_size"] == len(state) and r.meta["n_past"] == len(state) // 16
        assert r.meta["model"] == "gemma3-270m"
        new = os.urandom(200_001)
        r = c.send_streaming(wc.STATE_PUT, "0", len(new),
                             iter([new[i:i + 7000] for i in range(0, len(new), 7000)]))
        assert r.status == wc.OK and r.meta["restored"] is True and r.meta["bytes"] == len(new)
        assert fake_slots.states[0] == new
        r = c.request(wc.STATE_META, "0")
        assert r.status == wc.OK and r.meta["n_past"] == len(new) // 16
        assert r.meta["is_processing"] is False
        assert c.request(wc.STATE_META, "7").status == wc.NOT_FOUND
        assert c.request(wc.STATE_GET, "7").status == wc.NOT_FOUND
        body = {"messages": [{"role": "user", "content": "hi"}], "model": "other"}
        r = c.request(wc.PREFILL, "1", json.dumps(body).encode())
        assert r.status == wc.OK and len(r.payload) == r.meta["state_size"] == 128 * 1024
        assert r.meta["tokens_processed"] == 42 and r.meta["model_fallback"] is True
        sent = fake_slots.requests[-2]
        assert sent[1] == "/v1/chat/completions" and sent[2]["id_slot"] == 1
        assert sent[2]["n_predict"] == 0 and sent[2]["cache_prompt"] is True
        r = c.request(wc.PREFILL, "1", b'{"neither": 1}')
        assert r.status == wc.BAD_REQUEST
        assert c.request(wc.STATE_PUT, "0", b"").status == wc.ERROR
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hydra-wire-")]


def test_handler_failure_costs_one_request(server: WireServer, control: StubControl) -> None:
    with client(server) as c:
        control.explode = True
        r = c.info()
        assert r.status == wc.ERROR and "engine state unavailable" in r.meta["error"]
        control.explode = False
        assert c.info().status == wc.OK


# -------------------------------------------------------------------------------- fuzzing


def _still_serving(server: WireServer) -> None:
    with client(server) as c:
        assert c.info().status == wc.OK
    assert server.alive()


def _send_and_close(port: int, data: bytes, half_close: bool = True,
                    read: bool = True) -> bytes:
    """Send; half-close (the server sees EOF) or not; read to the server's close, or just go."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        return recv_to_eof(s, timeout=10) if read else b""
    finally:
        s.close()


def test_truncation_at_every_byte(server: WireServer) -> None:
    whole = wc.frame(wc.CONFIGURE, "0", b'{"temperature": 0.5}', trace="trace-1")
    for cut in range(len(whole)):
        got = _send_and_close(server.port, whole[:cut])
        assert got == b"", cut  # a request cut short gets no reply: the client has gone
    got = _send_and_close(server.port, whole)
    assert got[0] == wc.OK
    wait_until(lambda: server.stats()["open"] == 0, what="connections closed")
    _still_serving(server)


@pytest.mark.parametrize("frame, words", [
    (b"GET / HTTP/1.1\r\n\r\n", "bad magic"),
    (struct.pack("<HBBHQH", 0x4859, wc.CONFIGURE, 0, 0, (1 << 64) - 1, 0), "payload_len"),
    (struct.pack("<HBBHQH", 0x4859, wc.STATE_PUT, 0, 1, 1 << 62, 0), "payload_len"),
    (struct.pack("<HBBHQH", 0x4859, wc.INFO, 0, 0xFFFF, 0, 0), "key_len"),
    (struct.pack("<HBBHQH", 0x4859, wc.INFO, 0, 0, 0, 0xFFFF), "trace_len"),
])
def test_hostile_headers_get_bad_request_and_close(server: WireServer, frame: bytes,
                                                   words: str) -> None:
    got = _send_and_close(server.port, frame, half_close=False)
    assert got[0] == wc.BAD_REQUEST
    meta_len = int.from_bytes(got[1:4], "little")
    assert words in json.loads(got[12:12 + meta_len])["error"]
    assert len(got) == 12 + meta_len  # then the server closed
    _still_serving(server)


def test_random_frames_never_stop_the_server(server: WireServer, control: StubControl) -> None:
    control.head = None  # no slot API: random STATE ops must fail cleanly too
    rng = random.Random(20261130)
    ops = [0x30, 0x31, 0x32, 0x40, 0x41, 0x42, 0x43, 0x44, 0x45, 0x46, 0x00, 0x0E, 0x7F, 0xFF]
    for i in range(300):
        kind = rng.random()
        if kind < 0.4:  # a well-formed header with random fields, maybe a short body
            key = str(rng.randint(0, 9)) if rng.random() < 0.7 else "x" * rng.randint(0, 40)
            payload = os.urandom(rng.randint(0, 64))
            data = wc.frame(rng.choice(ops), key, payload, "t" * rng.randint(0, 8),
                            flags=rng.getrandbits(8))
        elif kind < 0.7:  # the magic, then random header fields (huge lengths included)
            data = b"YH" + bytes([rng.choice(ops), rng.getrandbits(8)]) + os.urandom(12)
            data += os.urandom(rng.randint(0, 32))
        else:  # anything at all
            data = os.urandom(rng.randint(1, 64))
        if rng.random() < 0.8:
            _send_and_close(server.port, data)
        else:  # the client vanishes without a word
            _send_and_close(server.port, data, half_close=False, read=False)
        if i % 50 == 0:
            _still_serving(server)
    wait_until(lambda: server.stats()["open"] == 0, timeout=15, what="connections closed")
    _still_serving(server)
    assert control.configured == [] or all(isinstance(p, dict) for p in control.configured)


def test_connection_cap_answers_busy(control: StubControl) -> None:
    s = WireServer(control=control, port=0, max_conns=2)
    s.start()
    try:
        a, b = client(s), client(s)
        assert a.info().status == wc.OK and b.info().status == wc.OK
        with client(s) as c:
            status, meta, _ = c.read_head(deadline=__import__("time").monotonic() + 5)
            assert status == wc.BUSY and "too many" in meta["error"]
        a.close()
        wait_until(lambda: s.stats()["open"] == 1, what="a closed connection counted")
        with client(s) as c:
            assert c.info().status == wc.OK
        b.close()
    finally:
        s.stop()


def test_idle_connections_are_closed(control: StubControl) -> None:
    s = WireServer(control=control, port=0, idle_timeout=0.3, io_timeout=0.3)
    s.start()
    try:
        with client(s) as c:
            c.sock.sendall(wc.frame(wc.INFO)[:5])  # stalls mid-header
            assert recv_to_eof(c.sock, timeout=5) == b""
        with client(s) as c:
            assert c.info().status == wc.OK
            assert recv_to_eof(c.sock, timeout=5) == b""  # idle between requests: closed
        assert s.stats()["timeout_midframe"] == 1 and s.stats()["timeout_idle"] == 1
    finally:
        s.stop()


def test_through_the_router(server: WireServer, fake_slots: FakeSlots) -> None:
    """The router hands "YH" connections to the wire server (Upstreams.hydra = the server)."""
    from hydra_supervisor.router import Router, Upstreams

    router = Router("127.0.0.1", 0, Upstreams(hydra=server), name="wire")
    router.start()
    try:
        fake_slots.states[0] = os.urandom(1 << 20)
        with wc.WireClient("127.0.0.1", router.port, timeout=10) as c:
            assert c.info().meta["engine"] == "hydra"
            assert c.configure({"top_k": 7}).meta["tier"] == "T1"
            r = c.request(wc.STATE_GET, "0")
            assert r.status == wc.OK and r.payload == fake_slots.states[0]
        assert router.stats()["by_kind"]["hydra"] >= 1 and server.stats()["accepted"] >= 1
        got = _send_and_close(router.port, b"YH" + bytes([0x41, 0]) + b"\xff" * 12,
                              half_close=False)
        assert got[0] == wc.BAD_REQUEST
        _still_serving(server)
    finally:
        router.stop()


def test_concurrent_clients(server: WireServer, fake_slots: FakeSlots) -> None:
    import threading

    fake_slots.states[0] = os.urandom(700_000)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with client(server) as c:
                for _ in range(5):
                    if i % 2:
                        r = c.request(wc.STATE_GET, "0")
                        assert r.status == wc.OK and r.payload == fake_slots.states[0]
                    else:
                        assert c.info().status == wc.OK
                        assert c.configure({"top_k": i}).status == wc.OK
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    wait_until(lambda: server.stats()["open"] == 0, what="connections closed")
