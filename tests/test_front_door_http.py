"""The front door (issue 19): what an HTTP client sees through the router compared with what it
sees from llama-server directly, byte for byte where it matters.

One real llama-server (Gemma 3 270M, CPU build, ``--metrics``) is shared by the module, with a
Router in front of it constructed with the defaults ``hydra up`` gives it. Each case sends the
same raw bytes over a raw socket to llama-server and to the router and compares the answers:
status lines, header names (case and order; Connection/Keep-Alive are per leg and may differ),
bodies, and whether and when the connection closes. A few cases need a response llama-server
cannot be made to send (a 204 framed like llama-server's own proxy frames it, a stream cut
mid-way): they use a tiny raw-socket upstream instead.

Where the router is meant to be stricter than llama-server (request smuggling) the test says so.
Observed llama-server behaviour, pinned build (recorded when these tests were written):
  - no Host header on HTTP/1.1: 200; HTTP/1.0 without Host: 200, then the connection closes;
  - obs-folded header line: 400;
  - Content-Length and Transfer-Encoding both, or two different Content-Lengths: 400, close;
  - a URL of 9,000 characters: 200; of 40,000 or 70,000: closed without an answer;
  - Expect: 100-continue: "HTTP/1.1 100 Continue" at once, then the answer;
  - a body with a UTF-8 BOM, and JSON nested 5,000 deep: 200 (both parsed);
  - keep-alive answers carry Keep-Alive and no Connection header; no endpoint answers 204
    (OPTIONS answers 200 with an empty body; /slots?action=erase 501 without --slot-save-path).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.testing.front_door import (
    RawResponse,
    Reader,
    connect,
    exchange,
    outcome,
    request,
    send_all,
)
from hydra_supervisor.testing.routerhelp import (
    HOST,
    FuncServer,
    free_port,
    gemma_path,
    llama_bins,
    llama_extra_args,
    llama_process,
    one_route,
    wait_health,
    wait_until,
)

pytestmark = pytest.mark.slow

DEADLINE = 20.0  # one answer, on a busy 2-core machine; a completion of 4 tokens included


@dataclass
class Door:
    """llama-server (``direct``) and the router in front of it (``routed``): two ports."""

    direct: int
    routed: int
    router: Router

    def both(self) -> list[tuple[str, int]]:
        return [("direct", self.direct), ("router", self.routed)]


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    bins, model = llama_bins(), gemma_path()
    port = free_port()
    argv = [
        str(bins / "llama-server"), "-m", model, "--host", HOST, "--port", str(port),
        "-c", "1024", "-t", "1", "-np", "2", "--chat-template", "gemma", "--no-jinja",
        "-n", "16", "--metrics", *llama_extra_args(),
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("front-door") / "llama-server.log"
    with llama_process(argv, log) as proc:
        wait_health(port, proc, log)
        router = Router(HOST, 0, Upstreams(), name="front-door")
        one_route(router, (HOST, port))
        router.start()
        try:
            yield Door(port, router.port, router)
        finally:
            router.stop()


def _one(port: int, data: bytes, method: str = "GET") -> RawResponse:
    resps, _reader, sock = exchange(port, data, method=method, timeout=DEADLINE)
    sock.close()
    assert resps, f"no response from port {port} to {data[:80]!r}"
    return resps[-1]


def _completion(n_predict: int = 4, stream: bool = False) -> bytes:
    return json.dumps({"prompt": "Hello", "n_predict": n_predict, "temperature": 0,
                       "cache_prompt": False, "stream": stream}).encode()


# --------------------------------------------------------------------------- headers


HEADER_CASES: list[tuple[str, bytes, str]] = [
    ("GET /health", request("GET", "/health"), "GET"),
    ("HEAD /health", request("HEAD", "/health"), "HEAD"),
    ("GET /health, Origin (CORS)",
     request("GET", "/health", headers=[("Origin", "http://example.test")]), "GET"),
    ("GET /metrics", request("GET", "/metrics"), "GET"),
    ("GET /v1/models", request("GET", "/v1/models"), "GET"),
    ("GET /no-such-path (404)", request("GET", "/no-such-path"), "GET"),
    ("POST /tokenize", request("POST", "/tokenize", b'{"content": "hello world"}',
                               headers=[("Content-Type", "application/json")]), "POST"),
    ("OPTIONS preflight",
     request("OPTIONS", "/v1/chat/completions",
             headers=[("Origin", "http://example.test"),
                      ("Access-Control-Request-Method", "POST"),
                      ("Access-Control-Request-Headers", "content-type, authorization")]),
     "OPTIONS"),
    ("POST /completion, streamed",
     request("POST", "/completion", _completion(2, stream=True),
             headers=[("Content-Type", "application/json")]), "POST"),
]


@pytest.mark.parametrize(("label", "data", "method"), HEADER_CASES,
                         ids=[c[0] for c in HEADER_CASES])
def test_response_heads_identical(door: Door, label: str, data: bytes, method: str) -> None:
    """Status line identical; header names identical in case and order, Connection and
    Keep-Alive (per leg, hop-by-hop) excepted. A client (or a proxy in front of hydra) that
    matches header names case-sensitively, or a test that compares raw heads, must not be able
    to tell the router from llama-server."""
    want = _one(door.direct, data, method)
    got = _one(door.routed, data, method)
    assert got.status_line == want.status_line, label
    assert got.end_to_end_names() == want.end_to_end_names(), (
        f"{label}: header names differ\n direct: {want.names}\n router: {got.names}")
    if b"Origin" in data:
        assert want.header("access-control-allow-origin") is not None  # the premise
    if b"/metrics" in data:
        assert b"Process-Start-Time-Unix" in want.names  # the premise (--metrics)


def test_head_health(door: Door) -> None:
    """HEAD /health: same status, no body, and the connection carries a next request."""
    for name, port in door.both():
        resps, reader, sock = exchange(port, request("HEAD", "/health"), method="HEAD",
                                       timeout=DEADLINE)
        with sock:
            assert resps and resps[0].status == 200, name
            assert not reader.buf, f"{name}: bytes after a HEAD response: {bytes(reader.buf)!r}"
            assert send_all(sock, request("GET", "/health")), name
            nxt = reader.read_response("GET", DEADLINE)
            assert nxt is not None and nxt.status == 200, name
            assert json.loads(nxt.body) == {"status": "ok"}, name


def test_http10_without_host(door: Door) -> None:
    """HTTP/1.0 GET /health without Host: answered as llama-server answers it, and the
    connection closed the way llama-server closes it."""
    seen: dict[str, tuple[int, bytes, bool]] = {}
    for name, port in door.both():
        resps, reader, sock = exchange(port, request("GET", "/health", version="1.0",
                                                     host=None), timeout=DEADLINE)
        with sock:
            assert resps, f"{name}: no answer"
            seen[name] = (resps[0].status, resps[0].body, reader.closed_within(DEADLINE))
    assert seen["router"][0] == seen["direct"][0]
    assert json.loads(seen["router"][1]) == json.loads(seen["direct"][1])
    assert seen["router"][2] == seen["direct"][2], f"closed after the answer: {seen}"


def test_http11_without_host(door: Door) -> None:
    """HTTP/1.1 without Host (RFC 9112 says a server SHOULD answer 400; llama-server answers
    200, and a client that worked against llama-server must keep working through hydra)."""
    data = request("GET", "/health", host=None)
    want = _one(door.direct, data)
    assert want.status == 200  # the premise
    got = _one(door.routed, data)
    assert got.status == want.status, got.head


def test_obs_fold_rejected_like_direct(door: Door) -> None:
    """An obs-folded header line (a line that starts with a space continues the previous one):
    llama-server answers 400; the router must not unfold it and forward it."""
    data = (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Folded: first\r\n  second\r\n"
            b"Connection: close\r\n\r\n")
    want = _one(door.direct, data)
    assert want.status == 400  # the premise
    got = _one(door.routed, data)
    assert got.status // 100 == want.status // 100, got.head


def test_half_close_after_request_still_answered(door: Door) -> None:
    """A complete request, then shutdown(SHUT_WR) (what `nc -N`, some load balancers' health
    checks and HTTP/1.0-style clients do): llama-server answers it; so must the router, with
    the whole body. Half-close is not a cancel: the client can still read."""
    data = request("POST", "/completion", _completion(4),
                   headers=[("Content-Type", "application/json")])
    rounds = 5
    answered: dict[str, int] = {"direct": 0, "router": 0}
    statuses: dict[str, set[int]] = {"direct": set(), "router": set()}
    for _ in range(rounds):
        for name, port in door.both():
            resps, _reader, sock = exchange(port, data, method="POST", shut_wr=True,
                                            timeout=DEADLINE)
            sock.close()
            if resps:
                statuses[name].add(resps[0].status)
                body = json.loads(resps[0].body)
                if resps[0].status == 200 and isinstance(body.get("content"), str):
                    answered[name] += 1
    assert answered["direct"] == rounds, f"premise: llama-server answered {answered}"
    assert answered["router"] == rounds, f"answered of {rounds}: {answered}, {statuses}"
    assert statuses["router"] == statuses["direct"]


def test_pipelined_requests_answered_in_order(door: Door) -> None:
    data = request("GET", "/health") + request("GET", "/v1/models")
    for name, port in door.both():
        resps, _reader, sock = exchange(port, data, responses=2, timeout=DEADLINE)
        sock.close()
        assert [r.status for r in resps] == [200, 200], name
        assert json.loads(resps[0].body) == {"status": "ok"}, name
        assert "data" in json.loads(resps[1].body), name


def _smuggle_cl_te() -> bytes:
    # The chunked body is a valid /tokenize request, so a router that picks the chunked
    # framing and forwards it gets a 200 from llama-server, which this test tells apart.
    payload = b'{"content": "hi"}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    return request("POST", "/tokenize", chunked, headers=[
        ("Content-Type", "application/json"), ("Content-Length", "4"),
        ("Transfer-Encoding", "chunked")])


def test_smuggling_cl_and_te_refused(door: Door) -> None:
    """Content-Length and Transfer-Encoding: chunked together (RFC 9112 6.3: a server MAY
    reject it, and must close after answering; a proxy that picks one framing while the server
    behind picks the other is how requests are smuggled). The pinned llama-server answers 400
    and closes; the router must answer 400 and close whatever llama-server does (intentionally
    at least as strict: it must never forward such a request with framing of its choosing)."""
    data = _smuggle_cl_te()
    direct = outcome(door.direct, data, "POST", DEADLINE)  # recorded for the failure message
    resps, reader, sock = exchange(door.routed, data, method="POST", timeout=DEADLINE)
    with sock:
        assert resps, f"router: no answer (llama-server: {direct})"
        assert resps[0].status == 400, f"router {resps[0].status}, llama-server {direct}"
        assert reader.closed_within(DEADLINE), "router kept the connection open after a CL+TE"


def test_conflicting_content_lengths_400(door: Door) -> None:
    data = request("POST", "/tokenize", b'{"content": "hi"}', headers=[
        ("Content-Type", "application/json"), ("Content-Length", "17"),
        ("Content-Length", "18")])
    direct = outcome(door.direct, data, "POST", DEADLINE)
    got = outcome(door.routed, data, "POST", DEADLINE)
    assert got == "400", f"router {got}, llama-server {direct}"


def test_oversized_declared_body_413_before_upload() -> None:
    """Content-Length over max_body: 413 with Connection: close as soon as the head is in, not
    after the client has uploaded (or the router read) the body. No upstream needed."""
    up = FuncServer(lambda c: None)
    router = Router(HOST, 0, Upstreams(), name="small-body", max_body=1 << 20)
    one_route(router, up.addr)
    router.start()
    try:
        head = request("POST", "/completion", None, headers=[
            ("Content-Type", "application/json"), ("Content-Length", str((2 << 20) + 1))])
        try:
            resps, reader, sock = exchange(router.port, head, method="POST", timeout=5.0)
        except TimeoutError:
            pytest.fail("no answer to the head within 5 s: the router waits for the body")
        with sock:
            assert resps, "closed without an answer"
            assert resps[0].status == 413, resps[0].head
            assert resps[0].says_close(), resps[0].head
            assert reader.closed_within(5.0)
        assert up.accepted == 0
    finally:
        router.stop()
        up.close()


def test_expect_100_continue(door: Door) -> None:
    """Expect: 100-continue with a small body: the interim 100 (if llama-server sends one),
    then the same final answer."""
    body = b'{"content": "hello world"}'
    head = request("POST", "/tokenize", None, headers=[
        ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
        ("Expect", "100-continue")])
    seen: dict[str, tuple[list[int], object]] = {}
    for name, port in door.both():
        sock = connect(port)
        reader = Reader(sock)
        with sock:
            assert send_all(sock, head)
            statuses: list[int] = []
            try:
                first = reader.read_response("POST", 2.0)  # curl waits 1 s for the 100
            except TimeoutError:
                first = None
            if first is not None:
                statuses.append(first.status)
            final = first
            if first is None or first.status == 100:
                assert send_all(sock, body)
                final = reader.read_response("POST", DEADLINE)
                assert final is not None, f"{name}: closed after the body"
                statuses.append(final.status)
            assert final is not None
            seen[name] = (statuses, json.loads(final.body))
    assert seen["router"] == seen["direct"]


def _request_head(c: socket.socket) -> bytes | None:
    """One request head from a raw upstream socket (these fakes get no bodies)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = c.recv(65536)
        if not chunk:
            return None
        buf += chunk
    return buf


def _fake(answer: Callable[[bytes], bytes | None]) -> FuncServer:
    """A raw upstream that answers each request head with ``answer(head)`` on a keep-alive
    connection; None: close the connection."""
    def handler(c: socket.socket) -> None:
        while (head := _request_head(c)) is not None:
            out = answer(head)
            if out is None:
                return
            c.sendall(out)
    return FuncServer(handler)


HEALTH = b'{"status":"ok"}'
HEALTH_REPLY = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(HEALTH), HEALTH))
# Exactly what llama-server's own proxy (router mode) sends for an upstream's 204.
NO_CONTENT_CHUNKED = b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"


def test_204_chunked_terminator_passes_and_connection_reusable() -> None:
    """A 204 framed with Transfer-Encoding: chunked and a last-chunk, as llama-server's proxy
    writes it: the client gets the terminator bytes too (a client that trusts the framing
    waits for them), does not hang, and the connection carries a second request."""
    up = _fake(lambda head: NO_CONTENT_CHUNKED if head.startswith(b"DELETE ") else HEALTH_REPLY)
    router = Router(HOST, 0, Upstreams(), name="no-content")
    one_route(router, up.addr)
    router.start()
    try:
        sock = connect(router.port)
        reader = Reader(sock)
        with sock:
            assert send_all(sock, request("DELETE", "/thing"))
            resp = reader.read_response("DELETE", DEADLINE, body=False)
            assert resp is not None and resp.status == 204, resp
            te = resp.header("transfer-encoding")
            if te is not None and b"chunked" in te.lower():
                try:
                    tail = reader.take_exactly(5, 5.0)
                except TimeoutError:
                    pytest.fail(f"the head says chunked but no last-chunk followed within 5 s "
                                f"(a client that trusts the framing hangs): {resp.head!r}")
                assert tail == b"0\r\n\r\n"
            assert send_all(sock, request("GET", "/health"))
            nxt = reader.read_response("GET", DEADLINE)
            assert nxt is not None and nxt.status == 200 and nxt.body == HEALTH
    finally:
        router.stop()
        up.close()


@pytest.mark.parametrize("length", [9000, 40000, 70000])
def test_long_url_same_as_direct(door: Door, length: int) -> None:
    """Long URLs. The pinned llama-server answers a 9,000-character one and closes without a
    word on one of 40,000 or 70,000 (its request-line limit lies between 32,000 and 40,000).
    The router answers as llama-server does (same status, or both close), and never with a
    503 + Retry-After: that invites a client to retry a request that can never succeed (the
    router's own retry of a request llama-server closed on must not turn into one)."""
    path = "/health?x=" + "a" * (length - len("/health?x="))
    data = request("GET", path)
    want = outcome(door.direct, data, timeout=DEADLINE)
    resps, _reader, sock = exchange(door.routed, data, timeout=DEADLINE)
    sock.close()
    got = str(resps[0].status) if resps else "closed"
    if resps:
        assert not (resps[0].status == 503 and resps[0].header("retry-after") is not None), (
            f"router answered a retryable 503 to a {length}-char URL: {resps[0].head!r}")
    assert got == want, f"{length}-char URL: llama-server {want}, router {got}"


def test_odd_json_bodies_forwarded(door: Door) -> None:
    """With a single lane (one route, no routing by model) the body is forwarded as is,
    whatever the router makes of it: a UTF-8 BOM before JSON that names a model, and JSON
    nested 5,000 deep (Python's json gives up on it with RecursionError). Same status as
    llama-server."""
    bom = b"\xef\xbb\xbf" + json.dumps({"model": "gemma", "prompt": "Hi", "n_predict": 1,
                                         "cache_prompt": False}).encode()
    deep = (b'{"prompt": "Hi", "n_predict": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    for label, body in (("BOM", bom), ("nested 5000", deep)):
        data = request("POST", "/completion", body,
                       headers=[("Content-Type", "application/json")])
        want = _one(door.direct, data, "POST")
        got = _one(door.routed, data, "POST")
        assert got.status == want.status, (
            f"{label}: llama-server {want.status} {want.body[:200]!r}, "
            f"router {got.status} {got.body[:200]!r}")


SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
SSE_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'


def test_stream_cut_midway_ends_cleanly() -> None:
    """An upstream that dies after one SSE event: the client gets an SSE error event and a
    properly terminated chunked body; then either the connection carries the next request,
    or the response said Connection: close. Never a silent close the client only discovers
    when its next request on the connection fails."""
    def handler(c: socket.socket) -> None:
        while (head := _request_head(c)) is not None:
            if head.startswith(b"POST "):
                c.sendall(SSE_HEAD + b"%x\r\n%s\r\n" % (len(SSE_EVENT), SSE_EVENT))
                return  # the upstream dies mid-stream
            c.sendall(HEALTH_REPLY)

    up = FuncServer(handler)
    router = Router(HOST, 0, Upstreams(), name="cut")
    one_route(router, up.addr)
    router.start()
    try:
        sock = connect(router.port)
        reader = Reader(sock)
        with sock:
            assert send_all(sock, request("POST", "/v1/chat/completions", b"{}",
                                          headers=[("Content-Type", "application/json")]))
            resp = reader.read_response("POST", DEADLINE, body=False)
            assert resp is not None and resp.status == 200, resp
            reader.read_partial_chunked(resp, DEADLINE)
            assert resp.terminated, f"chunked body not terminated: {resp.raw_body!r}"
            events = [e for e in resp.body.split(b"\n\n") if e]
            assert events[0] == SSE_EVENT.rstrip(b"\n")
            assert any(b'"error"' in e for e in events[1:]), resp.body
            if resp.says_close():
                assert reader.closed_within(DEADLINE)
            else:
                assert send_all(sock, request("GET", "/health")), "closed under the client"
                nxt = reader.read_response("GET", DEADLINE)
                assert nxt is not None, (
                    "the router closed the connection after a cut stream whose response did "
                    "not say Connection: close: the client's next request fails")
                assert nxt.status == 200
    finally:
        router.stop()
        up.close()


def test_router_survived(door: Door) -> None:
    """After everything above: the shared router is alive and its acceptor never failed."""
    assert door.router.alive()
    got = _one(door.routed, request("GET", "/health"))
    assert got.status == 200
    wait_until(lambda: door.router.stats()["inflight"] == 0, timeout=DEADLINE,
               what="no request in flight")
