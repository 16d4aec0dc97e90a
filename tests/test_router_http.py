"""The request-aware HTTP leg against a stand-in llama-server (testing/sse_upstream.py): the
openai client on keep-alive connections, hold/release, unavailable, retry, cut streams,
in-flight accounting, T1 defaults and per-request records."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.router import defaults as request_defaults
from hydra_supervisor.router.routes import Addr, Route
from hydra_supervisor.testing.routerhelp import (
    HOST,
    connect,
    free_port,
    one_route,
    recv_to_eof,
    wait_until,
)
from hydra_supervisor.testing.sse_upstream import StandIn

RouterFactory = Callable[..., tuple[Router, Route]]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def upstream() -> Iterator[StandIn]:
    s = StandIn()
    yield s
    s.close()


@pytest.fixture
def make_router() -> Iterator[RouterFactory]:
    routers: list[Router] = []

    def make(http: Addr, **kw: Any) -> tuple[Router, Route]:
        """A started router whose every HTTP request goes to its one route (the lane), whose
        upstream is `http`."""
        r = Router(HOST, 0, Upstreams(), **kw)
        lane = one_route(r, http)
        r.start()
        routers.append(r)
        return r, lane

    yield make
    for r in routers:
        r.stop()


def client(r: Router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{HOST}:{r.port}/v1", api_key="x", timeout=20,
                         max_retries=0)


def chat(c: openai.OpenAI, tokens: int = 3, **extra: Any) -> str:
    reply = c.chat.completions.create(model="standin", messages=MESSAGES,
                                      max_tokens=tokens, extra_body=extra or None)
    return reply.choices[0].message.content or ""


def stream(c: openai.OpenAI, tokens: int = 3, **extra: Any) -> str:
    s = c.chat.completions.create(model="standin", messages=MESSAGES,
                                  max_tokens=tokens, stream=True, extra_body=extra or None)
    return "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)


def nth_record(records: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The n-th record (1-based), waiting for it: a record is written after the reply is sent."""
    wait_until(lambda: len(records) >= n, what=f"{n} request records")
    return records[n - 1]


def raw_exchange(port: int, request: bytes, timeout: float = 10) -> tuple[bytes, dict[str, str],
                                                                           bytes]:
    """Send one request with Connection: close; (status line, headers lower-cased, body)."""
    with connect(port) as c:
        c.sendall(request)
        reply = recv_to_eof(c, timeout=timeout)
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return lines[0], headers, body


def post(path: str, obj: Any, close: bool = True) -> bytes:
    body = json.dumps(obj).encode()
    conn = b"Connection: close\r\n" if close else b""
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), conn, len(body), body))


# --------------------------------------------------------------------------- the openai client


def test_openai_client_keepalive_stream_and_not(make_router: RouterFactory,
                                                upstream: StandIn) -> None:
    records: list[dict[str, Any]] = []
    r, lane = make_router(upstream.addr, on_request=records.append)
    c = client(r)
    for _ in range(3):
        assert chat(c, tokens=2) == "t0 t1"
    assert c.models.list().data[0].id == "standin"
    assert r.stats()["accepted"] == 1, "the client's pooled connection carried every request"
    for _ in range(3):
        # openai >= 1.x closes a stream's response at [DONE] without reading the terminal
        # chunk, so its connection is not reused (the same directly against llama-server).
        assert stream(c, tokens=4) == "t0 t1 t2 t3 "
    st = r.stats()
    assert st["accepted"] <= 4
    assert st["refused"] == {}
    wait_until(lambda: lane.gate.inflight() == 0, what="the last request's flight ended")
    rec = nth_record(records, 7)
    assert rec["method"] == "POST" and rec["path"] == "/v1/chat/completions"
    assert rec["status"] == 200 and rec["outcome"] == "ok" and rec["model"] == "standin"
    assert rec["bytes_in"] > 0 and rec["bytes_out"] > 0 and rec["duration_s"] >= 0
    assert records[3]["path"] == "/v1/models" and records[3]["model"] is None
    st = r.stats()
    assert st["http"]["requests"] == 7 and st["http"]["2xx"] == 7


def test_idle_keepalive_client_timed_out_and_slot_freed(make_router: RouterFactory,
                                                        upstream: StandIn) -> None:
    r, _ = make_router(upstream.addr, idle_timeout=0.3)
    with connect(r.port) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = time.monotonic()
        reply = recv_to_eof(c, timeout=5)  # the answer, then the idle close
        assert reply.startswith(b"HTTP/1.1 200 ") and b'{"status": "ok"}' in reply
        assert 0.25 < time.monotonic() - t0 < 3
    wait_until(lambda: r.stats()["open"] == 0, what="slot freed")
    assert r.stats()["events"]["idle_timeout"] == 1


# --------------------------------------------------------------------------- hold / release


def test_hold_parks_requests_until_release(make_router: RouterFactory,
                                           upstream: StandIn) -> None:
    r, lane = make_router(upstream.addr)
    c = client(r)
    assert chat(c) == "t0 t1 t2"
    lane.hold("head restarting")
    results: list[str] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results.append(stream(c) if i % 2 else chat(c))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    wait_until(lambda: r.stats()["held"] == 6, what="6 requests parked")
    time.sleep(0.2)
    assert upstream.requests == 1, "parked requests must not reach the upstream"
    assert lane.gate.inflight() == 0
    lane.release()
    for t in threads:
        t.join(10)
    assert not errors and sorted(results) == ["t0 t1 t2"] * 3 + ["t0 t1 t2 "] * 3
    assert r.stats()["held"] == 0 and upstream.requests == 7


def test_hold_timeout_503_with_retry_after(make_router: RouterFactory,
                                           upstream: StandIn) -> None:
    records: list[dict[str, Any]] = []
    r, lane = make_router(upstream.addr, hold_timeout=0.3, on_request=records.append)
    lane.hold("loading model")
    t0 = time.monotonic()
    status, headers, body = raw_exchange(r.port, post("/v1/chat/completions", {"x": 1}))
    assert 0.25 < time.monotonic() - t0 < 5
    assert status.startswith(b"HTTP/1.1 503 ")
    assert headers["retry-after"].isdigit() and headers["content-type"].startswith(
        "application/json")
    err = json.loads(body)["error"]
    assert err["code"] == 503 and err["type"] == "unavailable_error"
    assert "loading model" in err["message"]
    rec = nth_record(records, 1)
    assert rec["outcome"] == "held_timeout" and rec["status"] == 503
    assert r.stats()["refused"] == {"held_timeout": 1} and upstream.requests == 0
    # The openai client surfaces it as an APIStatusError with the message.
    with pytest.raises(openai.APIStatusError, match="loading model") as exc:
        chat(client(r))
    assert exc.value.status_code == 503


def test_max_held_refuses_beyond(make_router: RouterFactory, upstream: StandIn) -> None:
    r, lane = make_router(upstream.addr, max_held=2)
    lane.hold("switching")
    parked = [connect(r.port) for _ in range(2)]
    for c in parked:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    wait_until(lambda: r.stats()["held"] == 2, what="2 parked")
    status, headers, body = raw_exchange(r.port, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                                         b"Connection: close\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 503 ") and "retry-after" in headers
    assert "switching" in json.loads(body)["error"]["message"]
    lane.release()
    for c in parked:
        c.settimeout(10)
        assert c.recv(65536).startswith(b"HTTP/1.1 200 ")
        c.close()


def test_set_unavailable_immediate_503_even_for_a_large_upload(
    make_router: RouterFactory, upstream: StandIn
) -> None:
    r, lane = make_router(upstream.addr)
    msg = "no profile is loaded: run `hydra switch NAME` (profiles: a, b)"
    lane.set_unavailable(msg, retry_after=7)
    status, headers, body = raw_exchange(r.port, post("/v1/chat/completions", {"a": 1}))
    assert status.startswith(b"HTTP/1.1 503 ") and headers["retry-after"] == "7"
    assert msg in json.loads(body)["error"]["message"]
    # 8 MiB upload: the client finishes sending and reads the 503, not a broken pipe.
    big = b"x" * (8 << 20)
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(big))
    with connect(r.port) as c:
        c.sendall(req + big)
        c.settimeout(10)
        head = c.recv(65536)
    assert head.startswith(b"HTTP/1.1 503 ") and msg.encode() in head
    # A parked request gets the 503 when the lane becomes unavailable, not at its timeout.
    lane.set_unavailable(None)
    lane.hold("switching")
    with connect(r.port) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: r.stats()["held"] == 1, what="parked")
        lane.set_unavailable("switch failed: model file missing")
        c.settimeout(5)
        assert b"switch failed" in c.recv(65536)
    lane.set_unavailable(None)
    lane.release()
    assert chat(client(r)) == "t0 t1 t2"
    assert upstream.requests == 1


# --------------------------------------------------------------------------- failures


def test_upstream_down_before_response_retried_after_release(make_router: RouterFactory) -> None:
    port = free_port()
    r, lane = make_router((HOST, port), retry_wait=0.5)
    result: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            result.append(chat(client(r)))
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=one)
    t.start()
    # The engine sees its head die and holds; the request waits for the next release.
    wait_until(lambda: r.stats()["http"]["retried"] == 1, what="first attempt refused")
    lane.hold("head restarting")
    wait_until(lambda: r.stats()["held"] == 1, what="request parked for its retry")
    time.sleep(0.3)
    revived = StandIn(port=port)
    try:
        lane.release()
        t.join(10)
        assert not errors and result == ["t0 t1 t2"]
        assert revived.requests == 1
    finally:
        revived.close()


def test_upstream_that_dies_before_answering_gets_the_request_once_more(
        make_router: RouterFactory) -> None:
    """A head that dies with the request (its listener goes with it, and the engine holds the
    lane): the request is sent again once the engine releases it, and answered."""
    records: list[dict[str, Any]] = []
    dying = socket.socket()
    dying.bind(("127.0.0.1", 0))
    dying.listen(8)
    port = dying.getsockname()[1]
    r, lane = make_router(("127.0.0.1", port), retry_wait=0.05, on_request=records.append)

    def die() -> None:
        conn, _ = dying.accept()
        conn.recv(65536)
        lane.hold("head restarting")  # what the engine does when it sees its head exit
        dying.close()
        # A reset, not a FIN: no TIME_WAIT left on the port the replacement binds.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    t = threading.Thread(target=die, daemon=True)
    t.start()
    replacement: list[StandIn] = []
    try:
        done: list[str] = []
        caller = threading.Thread(target=lambda: done.append(chat(client(r))), daemon=True)
        caller.start()
        wait_until(lambda: r.stats()["http"]["retried"] == 1 and lane.gate.held() == 1,
                   what="the request retried and parked while held")
        replacement.append(StandIn(port))
        lane.release()
        caller.join(30)
        assert done == ["t0 t1 t2"]
        assert nth_record(records, 1)["outcome"] == "ok"
    finally:
        for s in replacement:
            s.close()
        t.join(5)


def test_upstream_down_twice_answers_503_saying_why(make_router: RouterFactory) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    records: list[dict[str, Any]] = []
    r, _ = make_router(("127.0.0.1", port), retry_wait=0.05, on_request=records.append)
    with pytest.raises(openai.APIStatusError, match="refused") as exc:
        chat(client(r).with_options(max_retries=0))
    assert exc.value.status_code == 503
    assert r.stats()["http"]["retried"] == 1
    rec = nth_record(records, 1)
    assert rec["outcome"] == "error" and rec["status"] == 503


def test_upstream_closing_on_purpose_is_passed_on_not_retried(make_router: RouterFactory,
                                                              upstream: StandIn) -> None:
    """llama-server closes a connection without a word on purpose (a 70,000-byte URL, say)
    while it keeps serving: the client's connection is closed as llama-server's would be, and
    the request is not sent again (it would get the same) nor answered 503."""
    records: list[dict[str, Any]] = []
    r, _ = make_router(upstream.addr, retry_wait=0.05, on_request=records.append)
    upstream.drop(1)
    with socket.create_connection(("127.0.0.1", r.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536) == b""
    assert upstream.requests == 1 and r.stats()["http"]["retried"] == 0
    assert nth_record(records, 1)["outcome"] == "error"
    assert chat(client(r)) == "t0 t1 t2"  # and the next request is served


def test_stream_cut_midway_openai_client_raises(make_router: RouterFactory,
                                                upstream: StandIn) -> None:
    records: list[dict[str, Any]] = []
    r, _ = make_router(upstream.addr, on_request=records.append)
    c = client(r)
    got: list[str] = []
    with pytest.raises(openai.APIError, match="upstream closed mid-response"):
        s = c.chat.completions.create(model="standin", messages=MESSAGES,
                                      max_tokens=10, stream=True,
                                      extra_body={"x_die_after": 3})
        for ch in s:
            got.append(ch.choices[0].delta.content or "")
    assert got == ["t0 ", "t1 ", "t2 "]  # what came before the cut was delivered
    assert nth_record(records, 1)["outcome"] == "cut" and r.stats()["http"]["cut"] == 1
    assert stream(c) == "t0 t1 t2 "  # and the router serves the next one


def test_inflight_wait_idle_and_cut(make_router: RouterFactory, upstream: StandIn) -> None:
    r, lane = make_router(upstream.addr)
    assert lane.gate.inflight() == 0 and lane.wait_idle(0.01) == 0
    errors: list[BaseException] = []
    done: list[str] = []

    def one() -> None:
        try:
            done.append(stream(client(r), tokens=200, x_delay=0.05))
        except BaseException as e:  # expected: the cut
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: lane.gate.inflight() == 3, what="3 in flight")
    t0 = time.monotonic()
    assert lane.wait_idle(0.2) == 3
    assert 0.15 < time.monotonic() - t0 < 2
    assert lane.cut_inflight("switching to moe35b") == 3
    for t in threads:
        t.join(10)
    assert not done and len(errors) == 3
    assert all(isinstance(e, openai.APIError) and "switching to moe35b" in str(e) for e in errors)
    assert lane.wait_idle(5) == 0 and r.stats()["http"]["cut"] == 3
    # Draining: wait_idle returns 0 once a short stream finishes by itself.
    t = threading.Thread(target=lambda: done.append(stream(client(r), tokens=10, x_delay=0.05)))
    t.start()
    wait_until(lambda: lane.gate.inflight() == 1, what="1 in flight")
    assert lane.wait_idle(10) == 0
    t.join(10)
    assert done == ["".join(f"t{i} " for i in range(10))]


def test_client_gone_while_waiting_aborts_upstream(make_router: RouterFactory,
                                                   upstream: StandIn) -> None:
    r, lane = make_router(upstream.addr)
    with connect(r.port) as c:
        c.sendall(post("/v1/chat/completions", {"x_hang": True}, close=False))
        wait_until(lambda: lane.gate.inflight() == 1, what="in flight")
    # The client left: the router closes the upstream leg, so llama-server would stop work.
    wait_until(lambda: lane.gate.inflight() == 0, what="abandoned request ended")


def test_bad_request_400(make_router: RouterFactory, upstream: StandIn) -> None:
    r, _ = make_router(upstream.addr)
    status, _, body = raw_exchange(r.port, b"GET /health HTTP/1.1\r\nContent-Length: x\r\n\r\n")
    # llama-server's own answer to a request it cannot parse: a bare 400 (issue 30).
    assert status.startswith(b"HTTP/1.1 400 ") and body == b""
    assert r.stats()["refused"] == {"bad_request": 1} and upstream.requests == 0


# --------------------------------------------------------------------------- T1 defaults


def test_request_defaults_merged(make_router: RouterFactory, upstream: StandIn) -> None:
    r, _ = make_router(upstream.addr)
    r.set_request_defaults({"temperature": 0.2, "n_predict": 4})
    c = client(r)
    c.chat.completions.create(model="standin", messages=MESSAGES)
    c.chat.completions.create(model="standin", messages=MESSAGES,
                              max_tokens=2, temperature=0.9)
    raw_exchange(r.port, post("/completion", {"prompt": "x"}))
    raw_exchange(r.port, post("/v1/embeddings", {"input": "x"}))
    b = upstream.bodies
    assert b[0]["temperature"] == 0.2 and b[0]["max_tokens"] == 4 and "n_predict" not in b[0]
    assert b[1]["temperature"] == 0.9 and b[1]["max_tokens"] == 2 and "n_predict" not in b[1]
    assert b[2]["temperature"] == 0.2 and b[2]["n_predict"] == 4
    assert b[3] == {"input": "x"}
    r.set_request_defaults({})
    chat(c)
    assert "temperature" not in upstream.bodies[-1]


def test_defaults_merge_is_pure() -> None:
    merge = request_defaults.merge
    d = {"temperature": 0.2, "n_predict": 64}
    assert merge("/v1/embeddings", b'{"input": 1}', d) == (None, None)
    assert merge("/completion", b"not json", d) == (None, None)
    assert merge("/completion", b"[1]", d) == (None, None)
    body, model = merge("/v1/chat/completions", b'{"model": "m", "max_completion_tokens": 5}', d)
    assert model == "m" and json.loads(body or b"") == {
        "model": "m", "max_completion_tokens": 5, "temperature": 0.2}
    assert merge("/completion", b'{"n_predict": 1, "temperature": 1}', d) == (None, None)
    assert merge("/completions", b'{"model": "q"}', {}) == (None, "q")
    assert request_defaults.path_of(b"/v1/completions?x=1") == "/v1/completions"


# --------------------------------------------------------------------------- lifecycle


def test_a_moved_route_upstream_moves_new_requests(
        make_router: RouterFactory, upstream: StandIn) -> None:
    r, lane = make_router(upstream.addr)
    c = client(r)
    chat(c)
    other = StandIn()
    try:
        lane.http = other.addr
        chat(c)  # same client connection, next request goes to the new upstream
        assert upstream.requests == 1 and other.requests == 1
    finally:
        other.close()


def test_restart_after_stop(upstream: StandIn) -> None:
    r = Router(HOST, 0, Upstreams())
    one_route(r, upstream.addr)
    assert not r.alive()
    r.start()
    try:
        port = r.port
        assert r.alive() and chat(client(r)) == "t0 t1 t2"
        r.stop()
        assert not r.alive()
        with pytest.raises(OSError):
            socket.create_connection((HOST, port), timeout=1).close()
        r.start()
        assert r.alive() and r.port == port
        assert chat(client(r)) == "t0 t1 t2"
        wait_until(lambda: r.stats()["http"]["requests"] == 2, what="both requests counted")
    finally:
        r.stop()


def test_framing_variants(make_router: RouterFactory, upstream: StandIn) -> None:
    """A chunked request body, HEAD, HTTP/1.0 without Host, pipelined requests."""
    r, _ = make_router(upstream.addr)
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode()
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               b"Connection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    status, _, reply = raw_exchange(r.port, chunked)
    assert status.startswith(b"HTTP/1.1 200 ") and b"t0 t1" in reply
    assert upstream.bodies[-1]["max_tokens"] == 2
    status, headers, reply = raw_exchange(
        r.port, b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 ") and reply == b""
    status, _, reply = raw_exchange(r.port, b"GET /health HTTP/1.0\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200 ") and b'"ok"' in reply
    with connect(r.port) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 2
                  + b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        replies = recv_to_eof(c)
    assert replies.count(b"HTTP/1.1 200 ") == 3 and replies.endswith(b"}]}")


def test_idle_keepalive_closed_to_admit_a_waiting_client(make_router: RouterFactory,
                                                        upstream: StandIn) -> None:
    r, _ = make_router(upstream.addr, max_active=1)
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(r.port) as a:
        a.sendall(get)
        a.settimeout(5)
        first = b""
        while not first.endswith(b'{"status": "ok"}'):
            first += a.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")  # A now idles on keep-alive
        status, _, _ = raw_exchange(r.port, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                                    b"Connection: close\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 200 ")  # B was admitted in A's place
        assert recv_to_eof(a, timeout=5) == b""  # A was closed between requests, as allowed
    assert r.stats()["events"]["idle_closed_for_room"] == 1


def test_stop_answers_parked_requests(upstream: StandIn) -> None:
    r = Router(HOST, 0, Upstreams())
    lane = one_route(r, upstream.addr)
    r.start()
    try:
        lane.hold("switching")
        with connect(r.port) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            wait_until(lambda: r.stats()["held"] == 1, what="parked")
            t0 = time.monotonic()
            r.stop()
            assert time.monotonic() - t0 < 3
            reply = recv_to_eof(c, timeout=5)
            assert reply == b"" or reply.startswith(b"HTTP/1.1 503 ")
        assert upstream.requests == 0
    finally:
        r.stop()


def test_slow_request_head_times_out(make_router: RouterFactory, upstream: StandIn) -> None:
    r, _ = make_router(upstream.addr, request_timeout=0.5)
    with connect(r.port) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea")  # 2nd never finishes
        t0 = time.monotonic()
        reply = recv_to_eof(c, timeout=5)
        assert reply.startswith(b"HTTP/1.1 200 ") and 0.4 < time.monotonic() - t0 < 4
    wait_until(lambda: r.stats()["refused"] == {"request_timeout": 1}, what="counted")


def test_a_head_that_dies_twice_with_the_request_says_why_in_words(
        make_router: RouterFactory) -> None:
    """Two back-to-back deaths, each with the request in hand (its listener gone with it; the
    engine holds the lane after the first, as it does when it sees its head exit): the
    client's 503 says what happened in words, never a Python tuple."""
    port = free_port()
    r, lane = make_router((HOST, port), retry_wait=0.05)

    def head(hold: bool, up: threading.Event) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((HOST, port))
        ls.listen(8)
        ls.settimeout(10)
        up.set()
        conn, _ = ls.accept()
        conn.recv(65536)
        if hold:
            lane.hold("head restarting")
        ls.close()  # the process dies: its listener first, then its connection
        conn.close()

    replies: list[str] = []

    def ask() -> None:
        with connect(r.port) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            replies.append(recv_to_eof(s).decode(errors="replace"))

    first, second = threading.Event(), threading.Event()
    t1 = threading.Thread(target=head, args=(True, first), daemon=True)
    t1.start()
    assert first.wait(10)
    caller = threading.Thread(target=ask, daemon=True)
    caller.start()
    wait_until(lambda: r.stats()["http"]["retried"] == 1 and lane.gate.held() == 1,
               what="the request retried and parked while held")
    t2 = threading.Thread(target=head, args=(False, second), daemon=True)
    t2.start()
    assert second.wait(10)
    lane.release()
    caller.join(30)
    t1.join(10)
    t2.join(10)
    (reply,) = replies
    assert reply.startswith("HTTP/1.1 503"), reply
    body = reply.split("\r\n\r\n", 1)[1]
    assert "closed before answering" in body and "('" not in body and ", True)" not in body, body
