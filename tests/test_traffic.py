"""router/traffic.py with a clock the test moves: per-second buckets, the 5 s rate, the ring of
requests, SSE events counted across chunk boundaries, llama-server's timings, and the tokens of
a reply that was not streamed spread over its decode window."""

from __future__ import annotations

import json

import pytest

from hydra_supervisor.router.traffic import HISTORY_S, Traffic
from hydra_supervisor.serve.snapshot import DaemonInfo, RequestStatus, Snapshot


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.t + 1_700_000_000.0


def meter(keep: int = 256) -> tuple[Traffic, Clock]:
    clock = Clock()
    return Traffic(clock=clock, wall=clock.wall, keep=keep), clock


def token(text: str) -> bytes:
    return b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":' + \
        json.dumps(text).encode() + b'}}],"object":"chat.completion.chunk"}\n\n'


ROLE = (b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
        b'"content":null}}],"object":"chat.completion.chunk"}\n\n')
TIMINGS = {"cache_n": 5, "prompt_n": 7, "prompt_ms": 50.0, "prompt_per_second": 140.0,
           "predicted_n": 4, "predicted_ms": 2000.0, "predicted_per_second": 2.0}
FINAL = (b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],'
         b'"object":"chat.completion.chunk","timings":' + json.dumps(TIMINGS).encode()
         + b'}\n\n')
DONE = b"data: [DONE]\n\n"


def stream(tr: Traffic, clock: Clock, chunks: list[bytes], step: float = 0.5,
           profile: str = "demo") -> None:
    t = tr.begin(8080, "POST", "/v1/chat/completions?x=1", "127.0.0.1:5000")
    t.routed(profile, profile)
    t.upstream()
    clock.t += 0.2
    t.head(200, True)
    for c in chunks:
        t.data(c)
        clock.t += step
    t.end(200, "ok")


def test_a_stream_counts_its_tokens_as_they_come_and_ends_exact() -> None:
    tr, clock = meter()
    t = tr.begin(8080, "POST", "/v1/chat/completions", "127.0.0.1:5000")
    t.routed("demo", "demo")
    assert tr.lane(8080, "demo").queued == 1 and tr.lane(8080, "demo").inflight == 0
    t.upstream()
    t.upstream()  # a retry: still one in flight
    assert tr.lane(8080, "demo").inflight == 1 and tr.lane(8080, "demo").queued == 0
    clock.t += 0.25
    t.head(200, True)
    t.data(ROLE)
    assert tr.lane(8080, "demo").generated_tokens == 0  # the role event is no token
    for word in ("a", "b", "c", "d"):
        t.data(token(word))
        clock.t += 0.5
    live = tr.lane(8080, "demo")
    assert live.generated_tokens == 4 and live.tokens_per_s > 0 and live.inflight == 1
    (running,) = tr.requests()
    assert running.ended == "running" and running.generated_tokens == 4
    assert running.ttft_s == 0.25 and running.duration_s == 2.25
    t.data(FINAL + DONE)
    t.end(200, "ok")
    (req,) = tr.requests()
    assert req.ended == "ok" and req.status == 200 and req.stream
    assert req.generated_tokens == 4  # llama-server's predicted_n
    assert req.prompt_tokens == 12 and req.cached_tokens == 5  # prompt_n + cache_n
    assert req.prefill_tps == 140.0 and req.decode_tps == 2.0
    assert req.path == "/v1/chat/completions" and req.client == "127.0.0.1:5000"
    assert req.profile == "demo" and req.model == "demo" and req.port == 8080
    assert req.at == pytest.approx(1000.0 + 1_700_000_000.0)
    lane = tr.lane(8080, "demo")
    assert lane.inflight == 0 and lane.generated_tokens == 4 and lane.prompt_tokens == 12
    assert lane.requests == 1 and lane.requests_last_min == 1


def test_sse_events_split_across_chunks_are_counted_once() -> None:
    tr, clock = meter()
    raw = b"".join(token(w) for w in "abcdefgh")
    # every split point of the stream, two-byte pieces and one-byte pieces
    for size in (1, 2, 3, 7, 64, len(raw)):
        t = tr.begin(8080, "POST", "/completion", "c")
        t.routed("demo", None)
        t.upstream()
        t.head(200, True)
        for i in range(0, len(raw), size):
            t.data(raw[i:i + size])
        assert t.events == 8, size
        t.end(200, "ok")
    # without timings, the count stands; [DONE] and the finish event are not tokens
    t = tr.begin(8080, "POST", "/v1/chat/completions", "c")
    t.routed("demo", None)
    t.upstream()
    t.head(200, True)
    for piece in (ROLE, token("x")[:10], token("x")[10:], token("y"),
                  b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}]}\n',
                  b"\n", DONE):
        t.data(piece)
    t.end(200, "ok")
    assert tr.requests()[-1].generated_tokens == 2


def test_the_rate_is_over_the_last_five_seconds_and_history_keeps_each_second() -> None:
    tr, clock = meter()
    clock.t = 1000.0
    stream(tr, clock, [token("t")] * 20, step=0.5)  # 2 tokens/s for 10 s
    # No timings in this stream: the count is what streamed.
    assert tr.requests()[-1].generated_tokens == 20
    assert tr.lane(8080, "demo").tokens_per_s == pytest.approx(2.0, abs=0.45)
    clock.t += 6.0
    assert tr.lane(8080, "demo").tokens_per_s == 0.0
    hist = tr.history()
    assert hist["step_s"] == 1.0
    assert hist["end"] == pytest.approx(int(clock.t) + 1_700_000_000.0)
    s = hist["series"]["port-8080/demo"]
    assert len(s["tokens_per_s"]) == HISTORY_S - 1
    assert sum(s["tokens_per_s"]) == pytest.approx(20)
    assert max(s["tokens_per_s"]) <= 2.0 and max(s["inflight"]) == 1
    assert sum(s["requests"]) == 1 and s["inflight"][-1] == 0
    # 15 minutes later it has gone
    clock.t += HISTORY_S + 1
    assert sum(tr.history()["series"]["port-8080/demo"]["tokens_per_s"]) == 0


def test_a_reply_not_streamed_spreads_its_tokens_over_its_decode_window() -> None:
    tr, clock = meter()
    clock.t = 2000.0
    t = tr.begin(8080, "POST", "/v1/chat/completions", "c")
    t.routed("demo", None)
    t.upstream()
    clock.t += 10.0
    body = {"choices": [], "usage": {"completion_tokens": 40, "prompt_tokens": 9},
            "timings": {**TIMINGS, "predicted_n": 40, "predicted_ms": 8000.0}}
    t.head(200, False)
    data = json.dumps(body).encode()
    t.data(data[:30])
    t.data(data[30:])
    t.end(200, "ok")
    req = tr.requests()[-1]
    assert req.generated_tokens == 40 and not req.stream and req.ttft_s == 10.0
    series = tr.history()["series"]["port-8080/demo"]["tokens_per_s"]
    clock.t += 1.0
    series = tr.history()["series"]["port-8080/demo"]["tokens_per_s"]
    spread = [x for x in series if x]
    assert sum(series) == pytest.approx(40) and len(spread) == 8
    assert max(spread) == pytest.approx(5.0)  # 40 tokens over 8 s: no spike
    assert tr.lane(8080, "demo").generated_tokens == 40


def test_a_body_over_the_bound_is_not_read() -> None:
    tr, clock = meter()
    t = tr.begin(8080, "POST", "/v1/embeddings", "c")
    t.routed("demo", None)
    t.upstream()
    t.head(200, False)
    t.data(b'{"usage": {"prompt_tokens": 3}, "pad": "' + b"x" * (1 << 20) + b'"}')
    t.end(200, "ok")
    assert tr.requests()[-1].prompt_tokens is None


def test_the_ring_keeps_the_last_and_shows_the_running() -> None:
    tr, clock = meter(keep=3)
    for i in range(5):
        t = tr.begin(8080, "GET", f"/health?{i}", "c")
        t.end(200 if i % 2 == 0 else 503, "ok" if i % 2 == 0 else "refused")
    cut = tr.begin(8080, "POST", "/completion", "c")
    cut.routed("demo", None)
    cut.upstream()
    cut.head(200, True)
    cut.data(token("a"))
    running = tr.begin(8080, "POST", "/completion", "c")
    cut.end(0, "cut")
    cut.end(200, "ok")  # only once
    reqs = tr.requests()
    assert [r.id for r in reqs] == [4, 5, 6, 7] and reqs[-1].id == running.id
    assert [r.ended for r in reqs] == ["refused", "ok", "cut", "running"]
    assert reqs[2].status == 200 and reqs[2].generated_tokens == 1
    assert tr.lane(8080, "demo").cut == 1 and tr.lane(8080, "demo").requests == 1
    assert tr.lane(8080, "other") == tr.lane(9999, "demo")  # zeros


def test_requests_read_back_from_the_snapshot_json() -> None:
    tr, clock = meter()
    stream(tr, clock, [ROLE, token("a"), FINAL, DONE])
    tr.begin(8080, "GET", "/slots", "[::1]:4000")
    snap = Snapshot(daemon=DaemonInfo(pid=1, started=0.0, state_dir="/x"),
                    requests=tr.requests())
    back = Snapshot.from_json(json.loads(json.dumps(snap.to_json())))
    assert back.requests == snap.requests and len(back.requests) == 2
    assert isinstance(back.requests[0], RequestStatus)
    assert back.requests[0].decode_tps == 2.0 and back.requests[1].ended == "running"
    assert "requests" not in snap.summary()
