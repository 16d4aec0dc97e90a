"""Routing by model on one router port (router/routes.py): a table picks a Route per request,
each route with its own gate (hold, release, unavailable), HTTP upstream and optional Limiter;
the table may answer a request itself (LocalReply). Stand-in upstreams: testing/sse_upstream.py,
and a small upstream that answers only when told (the Limiter cases)."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.router import upstream as router_upstream
from hydra_supervisor.router.routes import FnTable, Limiter, LocalReply, Route
from hydra_supervisor.testing.routerhelp import (
    DEADLINE,
    HOST,
    FuncServer,
    connect,
    read_request,
    recv_to_eof,
    wait_until,
)
from hydra_supervisor.testing.sse_upstream import StandIn

MODELS = {"object": "list", "data": [{"id": "a", "object": "model"},
                                     {"id": "b", "object": "model"}]}


# --------------------------------------------------------------------------- helpers


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(port: int, method: str, path: str, obj: Any = None, raw: bytes | None = None,
            conn: http.client.HTTPConnection | None = None) -> Reply:
    """One request (a JSON body from ``obj``, or ``raw`` bytes), answered within DEADLINE.
    On ``conn`` when given (keep-alive), else on a connection of its own."""
    c = conn or http.client.HTTPConnection(HOST, port, timeout=DEADLINE)
    try:
        body = raw if raw is not None else (json.dumps(obj).encode() if obj is not None
                                            else None)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        c.request(method, path, body=body, headers=headers)
        resp = c.getresponse()
        data = resp.read()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
    finally:
        if conn is None:
            c.close()


def chat(port: int, model: str | None, **extra: Any) -> Reply:
    obj: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                           **extra}
    if model is not None:
        obj["model"] = model
    return request(port, "POST", "/v1/chat/completions", obj)


class Background:
    """Run ``fn`` on a thread; ``result()`` joins it with a deadline and returns or raises."""

    def __init__(self, fn: Any, *args: Any, **kw: Any) -> None:
        self._out: list[Any] = []
        self._err: list[BaseException] = []
        self._t = threading.Thread(target=self._run, args=(fn, args, kw), daemon=True)
        self._t.start()

    def _run(self, fn: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        try:
            self._out.append(fn(*args, **kw))
        except BaseException as e:  # handed to the test by result()
            self._err.append(e)

    def done(self) -> bool:
        return not self._t.is_alive()

    def result(self, timeout: float = DEADLINE) -> Any:
        self._t.join(timeout)
        if self._t.is_alive():
            raise TimeoutError(f"no answer within {timeout}s")
        if self._err:
            raise self._err[0]
        return self._out[0]


class Blocking:
    """An HTTP upstream that reads each request and answers it only once ``go`` is set
    (bounded by DEADLINE), with Connection: close."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self._lock = threading.Lock()
        self.arrived = 0
        self.server = FuncServer(self._handle)

    @property
    def addr(self) -> tuple[str, int]:
        return self.server.addr

    def _handle(self, c: socket.socket) -> None:
        if read_request(c) is None:
            return
        with self._lock:
            self.arrived += 1
        assert self.go.wait(DEADLINE), "the test never let the upstream answer"
        body = b'{"done": true}'
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def close(self) -> None:
        self.go.set()
        self.server.close()


@dataclass
class Rig:
    """A router with Upstreams() (no byte upstreams) and routes a, b on upstreams a, b."""

    r: Router
    a: Route
    b: Route
    up_a: StandIn
    up_b: StandIn
    routes: dict[str, Route]
    calls: list[tuple[str | None, str, str]] = field(default_factory=list)

    def table(self, model: str | None, method: str, path: str) -> Route | LocalReply:
        self.calls.append((model, method, path))
        if method in ("GET", "HEAD") and path == "/v1/models":
            return LocalReply(200, MODELS)
        if model is None:
            return self.a
        route = self.routes.get(model)
        if route is None:
            return LocalReply(404, {"error": {
                "code": 404, "type": "not_found_error",
                "message": f"model '{model}' is not served here"}}, counter="unknown_model")
        return route


@pytest.fixture
def rig() -> Iterator[Rig]:
    up_a, up_b = StandIn(), StandIn()
    r = Router(HOST, 0, Upstreams(), hold_timeout=60.0)
    try:
        r.start()
        a, b = r.new_route("a"), r.new_route("b")
        a.http, b.http = up_a.addr, up_b.addr
        rig = Rig(r, a, b, up_a, up_b, {"a": a, "b": b})
        r.table = FnTable(rig.table)
        yield rig
    finally:
        r.stop()
        up_a.close()
        up_b.close()


@pytest.fixture
def blocking() -> Iterator[Blocking]:
    b = Blocking()
    yield b
    b.close()


# --------------------------------------------------------------------------- routing


def test_requests_go_to_their_models_route(rig: Rig) -> None:
    port = rig.r.port
    assert chat(port, "a").status == 200
    assert chat(port, "b").status == 200
    assert rig.up_a.requests == 1 and rig.up_b.requests == 1
    assert rig.up_a.bodies[-1]["model"] == "a" and rig.up_b.bodies[-1]["model"] == "b"
    # Not only completions: any POST with a JSON object body is routed by its model.
    emb = request(port, "POST", "/v1/embeddings", {"model": "b", "input": "x"})
    assert emb.status == 200 and rig.up_b.requests == 2 and rig.up_a.requests == 1
    assert rig.up_b.bodies[-1] == {"model": "b", "input": "x"}
    # No body, no model: the table's default (a).
    health = request(port, "GET", "/health")
    assert health.status == 200 and health.json() == {"status": "ok"}
    assert rig.up_a.requests == 2 and rig.up_b.requests == 2
    # A POST without a model, or whose body is not JSON, also has no model.
    assert chat(port, None).status == 200
    assert request(port, "POST", "/completion", raw=b"not json").status == 200
    assert rig.up_a.requests == 4 and rig.up_b.requests == 2
    assert rig.calls == [
        ("a", "POST", "/v1/chat/completions"),
        ("b", "POST", "/v1/chat/completions"),
        ("b", "POST", "/v1/embeddings"),
        (None, "GET", "/health"),
        (None, "POST", "/v1/chat/completions"),
        (None, "POST", "/completion"),
    ]
    assert rig.a.requests == 4 and rig.b.requests == 2
    assert rig.r.stats()["refused"] == {}


def test_one_keepalive_connection_switches_routes_per_request(rig: Rig) -> None:
    c = http.client.HTTPConnection(HOST, rig.r.port, timeout=DEADLINE)
    try:
        for model in ("a", "b", "a", "b"):
            obj: dict[str, Any] = {"model": model, "messages": [], "max_tokens": 1}
            assert request(rig.r.port, "POST", "/v1/chat/completions", obj, conn=c).status == 200
    finally:
        c.close()
    assert rig.up_a.requests == 2 and rig.up_b.requests == 2
    assert rig.r.stats()["accepted"] == 1


def test_local_replies(rig: Rig) -> None:
    port = rig.r.port
    c = http.client.HTTPConnection(HOST, port, timeout=DEADLINE)
    try:
        unknown = request(port, "POST", "/v1/chat/completions",
                          {"model": "nope", "messages": []}, conn=c)
        assert unknown.status == 404
        assert unknown.headers["content-type"].startswith("application/json")
        assert unknown.json() == {"error": {"code": 404, "type": "not_found_error",
                                            "message": "model 'nope' is not served here"}}
        # The connection stays usable after a local reply.
        models = request(port, "GET", "/v1/models", conn=c)
        assert models.status == 200 and models.json() == MODELS
    finally:
        c.close()
    assert rig.up_a.requests == 0 and rig.up_b.requests == 0
    wait_until(lambda: rig.r.stats()["http"]["requests"] == 2, what="both requests recorded")
    st = rig.r.stats()
    assert st["refused"] == {"unknown_model": 1}  # the 200 is not counted as refused
    assert st["http"]["4xx"] == 1 and st["http"]["2xx"] == 1
    assert rig.a.requests == 0 and rig.b.requests == 0


def test_head_answered_by_the_router_has_no_body(rig: Rig) -> None:
    """A HEAD the router answers itself (a local reply, a refusal) gets the status and headers
    without a body, and the connection stays usable."""
    rig.a.gate.set_unavailable("loading a")
    c = http.client.HTTPConnection(HOST, rig.r.port, timeout=DEADLINE)
    try:
        models = request(rig.r.port, "HEAD", "/v1/models", conn=c)
        assert models.status == 200 and models.body == b""
        assert int(models.headers["content-length"]) == len(json.dumps(MODELS))
        refused = request(rig.r.port, "HEAD", "/health", conn=c)
        assert refused.status == 503 and refused.body == b""
        assert refused.headers["retry-after"].isdigit()
        assert request(rig.r.port, "GET", "/v1/models", conn=c).json() == MODELS
    finally:
        c.close()
    assert rig.r.stats()["accepted"] == 1 and rig.r.stats()["refused"] == {"unavailable": 1}


def test_local_reply_after_an_unknown_models_embeddings(rig: Rig) -> None:
    reply = request(rig.r.port, "POST", "/v1/embeddings", {"model": "zzz", "input": "x"})
    assert reply.status == 404 and "zzz" in reply.json()["error"]["message"]
    assert rig.r.stats()["refused"] == {"unknown_model": 1}
    assert rig.up_a.requests == 0 and rig.up_b.requests == 0


# --------------------------------------------------------------------------- per-route gates


def test_hold_one_route_the_other_serves(rig: Rig) -> None:
    rig.a.gate.hold("loading a")
    parked = Background(chat, rig.r.port, "a")
    wait_until(lambda: rig.a.gate.held() == 1, what="the request for a parked")
    assert chat(rig.r.port, "b").status == 200  # b is not held
    assert rig.up_b.requests == 1
    assert not parked.done() and rig.up_a.requests == 0, "a parked request reached upstream"
    assert rig.a.stats()["held"] == 1 and rig.a.stats()["held_reason"] == "loading a"
    # the router has no gate of its own: its count is its routes' (a's one)
    assert rig.b.gate.held() == 0 and rig.r.stats()["held"] == 1
    rig.a.gate.release()
    reply = parked.result()
    assert reply.status == 200 and rig.up_a.requests == 1
    assert rig.a.gate.held() == 0


def test_a_lane_drives_its_route_only(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """What a lane does to its route (RouteView is gone: a lane drives its Route directly):
    hold/release/its upstream apply to its route alone; `where` names the port in logs."""
    caplog.set_level(logging.INFO, logger="hydra.router")
    rig.b.where = f"port {rig.r.port}"  # what a Port sets on the routes it makes
    assert rig.b.label == f"port {rig.r.port} / b" and rig.b.http == rig.up_b.addr
    rig.b.hold("switching b")
    assert f"router port {rig.r.port} / b: holding new requests (switching b)" in caplog.text
    parked = Background(chat, rig.r.port, "b")
    wait_until(lambda: rig.b.gate.held() == 1, what="the request for b parked")
    assert chat(rig.r.port, "a").status == 200
    other = StandIn()
    try:
        rig.b.http = other.addr  # b's new head
        assert rig.b.http == other.addr and rig.a.http == rig.up_a.addr
        rig.b.release()
        assert parked.result().status == 200
        assert other.requests == 1 and rig.up_b.requests == 0 and rig.up_a.requests == 1
        wait_until(lambda: rig.b.gate.inflight() == 0, what="b's flight ended")
        assert rig.b.stats()["requests"] == 1
        assert rig.b.wait_idle(0.01) == 0 and rig.b.cut_inflight("nothing to cut") == 0
    finally:
        other.close()


def test_unavailable_route_503_only_there(rig: Rig) -> None:
    rig.b.gate.set_unavailable("profile b failed to load", retry_after=7)
    reply = chat(rig.r.port, "b")
    assert reply.status == 503 and reply.headers["retry-after"] == "7"
    err = reply.json()["error"]
    assert err["type"] == "unavailable_error" and "profile b failed to load" in err["message"]
    assert chat(rig.r.port, "a").status == 200
    assert rig.up_b.requests == 0 and rig.up_a.requests == 1
    assert rig.r.stats()["refused"] == {"unavailable": 1}
    # A request parked on a held route gets the 503 as soon as the route becomes unavailable.
    rig.b.gate.set_unavailable(None)
    rig.b.gate.hold("loading b")
    parked = Background(chat, rig.r.port, "b")
    wait_until(lambda: rig.b.gate.held() == 1, what="parked")
    rig.b.gate.set_unavailable("load failed: out of memory")
    reply = parked.result()
    assert reply.status == 503 and "out of memory" in reply.json()["error"]["message"]
    rig.b.gate.set_unavailable(None)
    rig.b.gate.release()
    assert chat(rig.r.port, "b").status == 200 and rig.up_b.requests == 1


def test_route_without_upstream_503(rig: Rig) -> None:
    rig.b.http = None
    reply = chat(rig.r.port, "b")
    assert reply.status == 503 and "no http upstream" in reply.json()["error"]["message"]
    assert rig.r.stats()["refused"] == {"upstream_down": 1}
    assert chat(rig.r.port, "a").status == 200


# --------------------------------------------------------------------------- limiter


def test_limiter_runs_queues_and_refuses(rig: Rig, blocking: Blocking) -> None:
    slow = rig.r.new_route("slow", limit=1, queue=1)
    slow.http = blocking.addr
    rig.routes["slow"] = slow
    lim = slow.limiter
    assert lim is not None and lim.counts() == (0, 0)
    first = Background(chat, rig.r.port, "slow")
    wait_until(lambda: blocking.arrived == 1 and lim.counts() == (1, 0), what="first running")
    second = Background(chat, rig.r.port, "slow")
    wait_until(lambda: lim.counts() == (1, 1), what="second queued")
    third = chat(rig.r.port, "slow")
    assert third.status == 429 and third.headers["retry-after"] == "1"
    err = third.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == 429
    assert "busy" in err["message"] and "slow" in err["message"]
    assert rig.r.stats()["refused"] == {"queue_full": 1}
    # The limit is the route's own: the other routes still serve.
    assert chat(rig.r.port, "a").status == 200
    assert slow.stats()["running"] == 1 and slow.stats()["waiting"] == 1
    assert blocking.arrived == 1 and not second.done(), "the queued request went upstream"
    blocking.go.set()
    assert first.result().status == 200
    assert second.result().status == 200
    assert blocking.arrived == 2
    wait_until(lambda: lim.counts() == (0, 0), what="both slots released")
    assert rig.r.stats()["refused"] == {"queue_full": 1}
    assert not blocking.server.errors


def test_limiter_queue_timeout_429(blocking: Blocking) -> None:
    r = Router(HOST, 0, Upstreams(), hold_timeout=0.3)  # also the limiter's queue timeout
    r.start()
    try:
        slow = r.new_route("slow", limit=1, queue=4)
        slow.http = blocking.addr
        r.table = FnTable(lambda model, method, path: slow)
        first = Background(chat, r.port, "slow")
        wait_until(lambda: blocking.arrived == 1, what="first running")
        late = chat(r.port, "slow")  # waits its 0.3 s for the slot, then 429
        assert late.status == 429 and late.json()["error"]["type"] == "rate_limit_error"
        assert "waited" in late.json()["error"]["message"]
        assert r.stats()["refused"] == {"queue_timeout": 1}
        assert slow.limiter is not None and slow.limiter.counts() == (1, 0)
        blocking.go.set()
        assert first.result().status == 200
    finally:
        r.stop()


def test_limiter_alone() -> None:
    with pytest.raises(ValueError):
        Limiter("x", 0, 1)
    with pytest.raises(ValueError):
        Limiter("x", 1, -1)
    lim = Limiter("p", limit=2, queue=1)
    assert lim.acquire(0.01) is None and lim.acquire(0.01) is None
    assert lim.counts() == (2, 0)
    # Both slots taken: one request waits (queue=1), the next is refused at once.
    waiter = Background(lim.acquire, DEADLINE)
    wait_until(lambda: lim.counts() == (2, 1), what="one waiting")
    full = lim.acquire(DEADLINE)  # refused at once, not after DEADLINE
    assert full is not None and full.status == 429 and full.counter == "queue_full"
    assert full.retry_after == 1 and "p is busy" in full.message
    lim.release()
    assert waiter.result() is None  # the waiter got the freed slot
    assert lim.counts() == (2, 0)
    # A wait that runs out: 429, counted as queue_timeout.
    late = lim.acquire(0.05)
    assert late is not None and late.status == 429 and late.counter == "queue_timeout"
    assert late.outcome == "held_timeout" and lim.counts() == (2, 0)
    lim.release()
    lim.release()
    assert lim.counts() == (0, 0)
    # queue=0: no waiting at all.
    strict = Limiter("s", limit=1, queue=0)
    assert strict.acquire(1.0) is None
    refused = strict.acquire(DEADLINE)
    assert refused is not None and refused.counter == "queue_full"
    strict.release()
    assert strict.acquire(0.01) is None


def test_limiter_waiters_all_served_in_turn() -> None:
    lim = Limiter("p", limit=1, queue=3)
    assert lim.acquire(0.01) is None
    waiters = [Background(lim.acquire, DEADLINE) for _ in range(3)]
    wait_until(lambda: lim.counts() == (1, 3), what="three waiting")

    def served_are(n: int) -> Callable[[], bool]:
        return lambda: sum(w.done() for w in waiters) == n

    for served in range(1, 4):
        lim.release()
        wait_until(served_are(served), what=f"{served} served")
        assert lim.counts() == (1, 3 - served)
    assert all(w.result() is None for w in waiters)
    lim.release()
    assert lim.counts() == (0, 0)


# --------------------------------------------------------------------------- stop


def test_stop_wakes_requests_parked_in_routes(blocking: Blocking) -> None:
    up = StandIn()
    r = Router(HOST, 0, Upstreams(), hold_timeout=60.0)  # far past every deadline below
    try:
        r.start()
        plain = r.new_route("plain")
        lim = r.new_route("limited", limit=1, queue=1)
        plain.http, lim.http = up.addr, blocking.addr
        r.table = FnTable(lambda model, method, path: lim if model == "limited" else plain)
        plain.gate.hold("loading")
        lim.gate.hold("loading")
        socks = []
        for model in ("plain", "limited", "limited"):
            body = json.dumps({"model": model, "messages": []}).encode()
            s = connect(r.port)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(s)
        assert lim.limiter is not None
        # One parked in plain's gate; in limited's: one parked in the gate (holding the only
        # slot), one queued in the limiter behind it.
        wait_until(lambda: plain.gate.held() == 1 and lim.gate.held() == 1
                   and lim.limiter is not None and lim.limiter.counts() == (1, 1),
                   what="three requests parked")
        r.stop()
        for s in socks:
            reply = recv_to_eof(s)  # EOF or a 503, well before hold_timeout
            assert reply == b"" or reply.startswith(b"HTTP/1.1 503 "), reply[:200]
            s.close()
        wait_until(lambda: plain.gate.held() == 0 and lim.gate.held() == 0
                   and lim.limiter is not None and lim.limiter.counts() == (0, 0),
                   what="every parked request woken")
        assert up.requests == 0 and blocking.arrived == 0
        # A stopped router started again serves its routes again.
        plain.gate.release()
        r.start()
        assert chat(r.port, "plain").status == 200 and up.requests == 1
    finally:
        r.stop()
        up.close()


def test_stop_cuts_a_routes_inflight_request(rig: Rig, blocking: Blocking) -> None:
    rig.b.http = blocking.addr
    with connect(rig.r.port) as s:
        body = json.dumps({"model": "b", "messages": []}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: rig.b.gate.inflight() == 1, what="in flight on b")
        rig.r.stop()
        reply = recv_to_eof(s)  # not waiting for the upstream, which never answers
        assert reply == b"" or reply.startswith(b"HTTP/1.1 5"), reply[:200]
    wait_until(lambda: rig.b.gate.inflight() == 0, what="b's flight ended")


# --------------------------------------------------------------------------- upstream pool


def test_pool_keeps_every_routes_upstream(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pooled connections retire after _POOL_AGE_S; long enough here for a slow machine.
    monkeypatch.setattr(router_upstream, "_POOL_AGE_S", 60.0)
    assert chat(rig.r.port, "a").status == 200 and chat(rig.r.port, "b").status == 200
    wait_until(lambda: rig.r.pool.idle() == 2, what="both upstream connections pooled")
    rig.r.acceptor.tick(time.monotonic())  # the periodic reap: the routes' upstreams are kept
    assert rig.r.pool.idle() == 2 and rig.r.stats()["pooled"] == 2
    assert chat(rig.r.port, "a").status == 200 and chat(rig.r.port, "b").status == 200
    wait_until(lambda: rig.r.pool.idle() == 2, what="connections back in the pool")
    # A route that moved away from its upstream: that upstream's idle connection is closed.
    rig.b.http = None
    rig.r.acceptor.tick(time.monotonic())
    assert rig.r.pool.idle() == 1


def test_the_router_count_is_its_profiles_and_its_own_answers(rig: Rig) -> None:
    """The router's finished requests are those routed to its profiles (each route's count
    in its Traffic, counted at the same moment) plus those it answered itself; the request
    table holds each, with the tokens the stand-in generated."""
    port = rig.r.port
    assert chat(port, "a", stream=True, max_tokens=5).status == 200
    assert chat(port, "b", max_tokens=3).status == 200
    assert chat(port, "nope").status == 404
    assert request(port, "GET", "/v1/models").status == 200
    tr = rig.r.traffic
    wait_until(lambda: rig.r.stats()["http"]["requests"] == 4
               and all(r.ended != "running" for r in tr.requests()), what="4 requests ended")
    a, b = tr.lane(port, "a"), tr.lane(port, "b")
    assert a.requests == 1 and b.requests == 1  # 4 = 2 to profiles + 2 the router's own
    assert a.generated_tokens == 5 and b.generated_tokens == 3  # streamed / usage
    # The table lists finished requests as they finished: a session records its end after
    # the client has its answer, so the next request may finish first. By arrival:
    rows = sorted(tr.requests(), key=lambda r: r.id)
    assert [(r.profile, r.status, r.ended, r.stream) for r in rows] == [
        ("a", 200, "ok", True), ("b", 200, "ok", False), (None, 404, "refused", False),
        (None, 200, "ok", False)]
    assert rows[0].generated_tokens == 5 and rows[0].ttft_s is not None
    assert a.inflight == a.queued == 0
