"""Live load, counted by hydra itself: what each lane serves now, what it generated, and the
last requests, from what the router's HTTP sessions see (``Traffic``).

The router's session threads report into one ``Traffic`` (thread-safe, one lock, a few
microseconds per event): a request's arrival (``begin``, a ``Tally`` for it), its lane once
routed, its dispatch upstream, its response head, each piece of its body as it is forwarded,
and its end. Nothing is decided from it off the loop: the loop reads immutable values
(``lane`` readings, ``requests``, ``history``) when it builds the status snapshot, the metrics
and the dashboard read those.

Counting generated tokens as they stream: llama-server streams one SSE event per token, so
each event forwarded counts one token at once (a byte scan for the blank line that ends an
event; no JSON is parsed per event). The stream's first event of a chat completion (the
assistant role, no content), its finish event, its usage event and ``[DONE]`` are not tokens;
when the stream ends, llama-server's own ``timings`` (``predicted_n``) or ``usage`` in its
last events (a small tail of the stream is kept, never the whole stream) correct the count to
the exact figure, and give the prompt and cached tokens and the prefill and decode speeds.
A reply that is not streamed tells its tokens only at its end (its JSON body, read when it is
at most 1 MiB): they are spread back over its decode window (``predicted_ms`` before the end,
else from dispatch to the end) in the per-second history, so the chart shows the rate at which
they were made, not a spike at the end. A reading of ``tokens_per_s`` taken during such a
reply does not see its tokens yet (nobody can); one taken after it does.

Per lane (keyed by port and profile, the lane's metric name ``port-N/PROFILE``): requests
in flight (sent upstream) and queued (routed, not yet upstream: held at the gate or waiting for
a concurrency slot), generated tokens over the last 5 s, totals since hydra started, and one
bucket per second for the last 15 minutes (``history``). The last ``keep`` finished requests
are kept in a ring, with the ones in progress beside it (``requests``).
"""

from __future__ import annotations

import collections
import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

Clock = Callable[[], float]

KEEP = 256  # finished requests kept (the status shows them all)
HISTORY_S = 900  # one-second buckets kept per lane: 15 minutes
WINDOW_S = 5.0  # tokens_per_s is over this many seconds
BODY_MAX = 1 << 20  # a JSON reply over this is not read for its usage
TAIL_MAX = 8192  # the last bytes of an SSE stream kept for its final timings/usage event

ENDINGS = ("running", "ok", "cut", "refused", "client_gone", "error")


@dataclass(frozen=True)
class RequestStatus:
    """One request through a router, as the status publishes it (serve/snapshot.py
    ``Snapshot.requests``). Nothing of the prompt or the reply is kept."""

    id: int
    at: float  # wall time it arrived
    port: int
    profile: str | None  # the lane it was routed to (None: the router answered it itself)
    model: str | None  # as the client asked
    client: str  # ip:port
    method: str
    path: str
    status: int = 0  # 0 while running, or when no response was sent
    stream: bool = False  # an SSE response
    ttft_s: float | None = None  # arrival to the first SSE event (streamed), the head (not)
    prompt_tokens: int | None = None  # the whole prompt, cached part included
    cached_tokens: int | None = None
    generated_tokens: int | None = None
    prefill_tps: float | None = None  # llama-server's own figures
    decode_tps: float | None = None
    duration_s: float = 0.0  # so far, while running
    ended: str = "running"  # running, ok, cut, refused, client_gone, error


@dataclass(frozen=True)
class LaneTraffic:
    """One lane's traffic at one instant (``Traffic.lane``)."""

    inflight: int = 0  # sent upstream, response not finished
    queued: int = 0  # routed to it, not yet upstream
    tokens_per_s: float = 0.0  # generated, over the last WINDOW_S seconds
    generated_tokens: int = 0  # totals since hydra started
    prompt_tokens: int = 0
    requests: int = 0  # routed to it and finished
    requests_last_min: int = 0
    cut: int = 0  # responses cut mid-way


class LaneSeries(TypedDict):
    tokens_per_s: list[float]
    inflight: list[int]
    queued: list[int]
    requests: list[int]  # requests finished in that second


class History(TypedDict):
    """``Traffic.history()``: GET /api/history's body (docs/control.md)."""

    step_s: float
    end: float  # wall time of the end of the last step
    series: dict[str, LaneSeries]  # by lane name, port-N/PROFILE; oldest first


class _Lane:
    """One lane's counters and its per-second buckets (a ring of ``HISTORY_S``), written under
    the Traffic's lock."""

    __slots__ = ("name", "sec", "inflight", "queued", "generated", "prompt", "requests",
                 "cut", "b_tokens", "b_inflight", "b_queued", "b_requests")

    def __init__(self, name: str, sec: int) -> None:
        self.name = name
        self.sec = sec  # the second the newest bucket is for
        self.inflight = 0
        self.queued = 0
        self.generated = 0
        self.prompt = 0
        self.requests = 0
        self.cut = 0
        self.b_tokens = [0.0] * HISTORY_S
        self.b_inflight = [0] * HISTORY_S
        self.b_queued = [0] * HISTORY_S
        self.b_requests = [0] * HISTORY_S

    def roll(self, sec: int) -> int:
        """Make ``sec`` the newest bucket (the seconds between hold the levels of then, no
        tokens); its index."""
        if sec > self.sec:
            first = max(self.sec + 1, sec - HISTORY_S + 1)
            for s in range(first, sec + 1):
                i = s % HISTORY_S
                self.b_tokens[i] = 0.0
                self.b_requests[i] = 0
                self.b_inflight[i] = self.inflight
                self.b_queued[i] = self.queued
            self.sec = sec
        return sec % HISTORY_S

    def levels(self, i: int) -> None:
        if self.inflight > self.b_inflight[i]:
            self.b_inflight[i] = self.inflight
        if self.queued > self.b_queued[i]:
            self.b_queued[i] = self.queued

    def add_tokens(self, n: float, t0: float, t1: float) -> None:
        """``n`` tokens (negative: a correction) spread evenly over the seconds of [t0, t1],
        within the buckets kept; a bucket never goes below 0."""
        lo = max(t0, float(self.sec - HISTORY_S + 1))
        hi = min(t1, float(self.sec + 1))
        if hi - lo < 1e-6:
            i = min(int(t1), self.sec) % HISTORY_S
            self.b_tokens[i] = max(0.0, self.b_tokens[i] + n)
            return
        rate = n / (t1 - t0) if t1 > t0 else n
        s = int(lo)
        while s < hi:
            part = min(hi, s + 1.0) - max(lo, float(s))
            i = s % HISTORY_S
            self.b_tokens[i] = max(0.0, self.b_tokens[i] + rate * part)
            s += 1


class Tally:
    """One request as its session thread reports it. Only that thread calls it; what others
    read of it (``status``) is written under the Traffic's lock."""

    __slots__ = ("traffic", "id", "at", "t0", "port", "client", "method", "path", "profile",
                 "model", "lane", "state", "status", "stream", "t_up", "t_first", "events",
                 "skip", "nl", "tail", "body", "body_n", "ended", "final")

    def __init__(self, traffic: Traffic, rid: int, at: float, t0: float, port: int,
                 client: str, method: str, path: str) -> None:
        self.traffic = traffic
        self.id = rid
        self.at = at
        self.t0 = t0
        self.port = port
        self.client = client
        self.method = method
        self.path = path
        self.profile: str | None = None
        self.model: str | None = None
        self.lane: _Lane | None = None
        self.state = ""  # "", "queued", "upstream"
        self.status = 0
        self.stream = False
        self.t_up: float | None = None
        self.t_first: float | None = None
        self.events = 0  # SSE events counted as tokens
        self.skip = 0  # SSE events seen that are not tokens (the chat role event)
        self.nl = False  # the last SSE bytes ended in one newline (an event may end next)
        self.tail = bytearray()
        self.body: list[bytes] | None = []
        self.body_n = 0
        self.ended = ""
        self.final: RequestStatus | None = None

    # -- reports from the session thread ------------------------------------------------------

    def routed(self, profile: str, model: str | None) -> None:
        self.traffic.routed(self, profile, model)

    def upstream(self) -> None:
        """Sent upstream (again, after a retry: nothing changes)."""
        if self.state != "upstream":
            self.traffic.upstream(self)

    def head(self, status: int, sse: bool) -> None:
        """The response head: its status, whether it is an SSE stream."""
        self.status = status
        self.stream = sse
        if not sse and self.t_first is None:
            self.t_first = self.traffic.clock()

    def data(self, chunk: bytes) -> None:
        """A piece of the response body as it is forwarded."""
        if self.stream:
            self._sse(chunk)
        elif self.body is not None:
            self.body_n += len(chunk)
            if self.body_n > BODY_MAX:
                self.body = None
            else:
                self.body.append(chunk)

    def _sse(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self.nl and chunk[0] == 0x0A:  # "...\n" | "\n...": an event ended between them
            n = 1 + chunk.count(b"\n\n", 1)
            self.nl = len(chunk) > 1 and chunk.endswith(b"\n") and not chunk.endswith(b"\n\n")
        else:
            n = chunk.count(b"\n\n")
            self.nl = chunk.endswith(b"\n") and not chunk.endswith(b"\n\n")
        tail = self.tail
        tail += chunk
        if len(tail) > 2 * TAIL_MAX:
            del tail[:-TAIL_MAX]
        if not n:
            return
        if self.t_first is None and self.events == 0 and self.skip == 0:
            # a chat stream's first event names the role and has no content: not a token
            if b'"content":null' in chunk[:chunk.find(b"\n\n") + 1]:
                self.skip = 1
                n -= 1
        self.traffic.tokens(self, n)

    def end(self, status: int, ended: str) -> None:
        """The request is over (``ended``: ok, cut, refused, client_gone, error). Once."""
        if self.ended:
            return
        self.ended = ended
        if status:
            self.status = status
        self.traffic.end(self)

    # -- the reading --------------------------------------------------------------------------

    def status_at(self, now: float) -> RequestStatus:
        if self.final is not None:
            return self.final
        return RequestStatus(
            id=self.id, at=self.at, port=self.port, profile=self.profile, model=self.model,
            client=self.client, method=self.method, path=self.path, status=self.status,
            stream=self.stream, ttft_s=_r(self.t_first - self.t0)
            if self.t_first is not None else None,
            generated_tokens=self.events if self.stream else None,
            duration_s=round(now - self.t0, 3), ended="running")


class Traffic:
    """Every router's requests of one hydra (the daemon makes one and gives it to each port's
    router; a router made without one makes its own). Thread-safe: one lock, held for a few
    microseconds per report. ``clock``: monotonic seconds; ``wall``: epoch seconds, for the
    times a reader shows."""

    def __init__(self, *, clock: Clock = time.monotonic, wall: Clock = time.time,
                 keep: int = KEEP) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.clock = clock
        self.wall = wall
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._lanes: dict[tuple[int, str], _Lane] = {}
        self._running: dict[int, Tally] = {}
        self._done: collections.deque[RequestStatus] = collections.deque(maxlen=keep)

    # -- from the router's session threads ----------------------------------------------------

    def begin(self, port: int, method: str, path: str, client: str) -> Tally:
        """A request arrived (its head was read)."""
        t = Tally(self, next(self._ids), self.wall(), self.clock(), port, client, method,
                  path.split("?", 1)[0])
        with self._lock:
            self._running[t.id] = t
        return t

    def routed(self, t: Tally, profile: str, model: str | None) -> None:
        with self._lock:
            lane = self._lane(t.port, profile)
            t.profile, t.model, t.lane = profile, model, lane
            if t.state == "":
                t.state = "queued"
                lane.queued += 1
                lane.levels(lane.roll(int(self.clock())))

    def upstream(self, t: Tally) -> None:
        now = self.clock()
        with self._lock:
            t.t_up = now
            lane = t.lane
            if lane is not None and t.state != "upstream":
                if t.state == "queued":
                    lane.queued -= 1
                lane.inflight += 1
                lane.levels(lane.roll(int(now)))
            t.state = "upstream"

    def tokens(self, t: Tally, n: int) -> None:
        now = self.clock()
        with self._lock:
            if t.t_first is None:
                t.t_first = now
            t.events += n
            lane = t.lane
            if lane is not None:
                i = lane.roll(int(now))
                lane.b_tokens[i] += n
                lane.generated += n

    def end(self, t: Tally) -> None:
        now = self.clock()
        usage = _usage(t)
        gen = usage.generated
        if t.stream and gen is None:
            gen = max(0, t.events - _not_tokens(bytes(t.tail)))
        counted = t.events if t.stream else 0
        ttft = _r(t.t_first - t.t0) if t.t_first is not None and t.status else None
        final = RequestStatus(
            id=t.id, at=t.at, port=t.port, profile=t.profile, model=t.model, client=t.client,
            method=t.method, path=t.path, status=t.status, stream=t.stream, ttft_s=ttft,
            prompt_tokens=usage.prompt, cached_tokens=usage.cached, generated_tokens=gen,
            prefill_tps=usage.prefill_tps, decode_tps=usage.decode_tps,
            duration_s=round(now - t.t0, 3), ended=t.ended)
        with self._lock:
            t.final = final
            self._running.pop(t.id, None)
            self._done.append(final)
            lane = t.lane
            if lane is None:
                return
            i = lane.roll(int(now))
            if t.state == "queued":
                lane.queued -= 1
            elif t.state == "upstream":
                lane.inflight -= 1
            t.state = "done"
            lane.requests += 1
            lane.b_requests[i] += 1
            if t.ended == "cut":
                lane.cut += 1
            if usage.prompt:
                lane.prompt += usage.prompt
            diff = (gen or 0) - counted
            if diff:
                lane.generated += diff
                # the tokens not seen as they streamed, over the window they were made in
                if usage.decode_s is not None:
                    start = now - usage.decode_s
                elif t.stream and t.t_first is not None:
                    start = t.t_first
                else:
                    start = t.t_up if t.t_up is not None else t.t0
                lane.add_tokens(float(diff), start, now)

    # -- readings (any thread; the loop builds the snapshot from them) ------------------------

    def lane(self, port: int, profile: str) -> LaneTraffic:
        """One lane's traffic now (zeros for a lane that has seen no request)."""
        now = self.clock()
        with self._lock:
            lane = self._lanes.get((port, profile))
            if lane is None:
                return LaneTraffic()
            lane.roll(int(now))
            frac = now - int(now)
            n = int(WINDOW_S)
            tokens = sum(lane.b_tokens[(lane.sec - k) % HISTORY_S] for k in range(n + 1))
            last_min = sum(lane.b_requests[(lane.sec - k) % HISTORY_S] for k in range(60))
            return LaneTraffic(
                inflight=lane.inflight, queued=lane.queued,
                tokens_per_s=round(tokens / (WINDOW_S + frac), 2),
                generated_tokens=lane.generated, prompt_tokens=lane.prompt,
                requests=lane.requests, requests_last_min=last_min, cut=lane.cut)

    def requests(self) -> tuple[RequestStatus, ...]:
        """The last finished requests, oldest first, then those in progress."""
        now = self.clock()
        with self._lock:
            done = tuple(self._done)
            running = [t.status_at(now) for t in self._running.values()]
        return done + tuple(sorted(running, key=lambda r: r.id))

    def history(self) -> History:
        """Every lane's last 15 minutes, one point per whole second, oldest first (the
        second in progress is not in it yet)."""
        now = self.clock()
        sec = int(now)
        end = self.wall() - (now - sec)
        series: dict[str, LaneSeries] = {}
        with self._lock:
            for lane in self._lanes.values():
                lane.roll(sec)
                idx = [(s % HISTORY_S) for s in range(sec - HISTORY_S + 1, sec)]
                series[lane.name] = LaneSeries(
                    tokens_per_s=[round(lane.b_tokens[i], 2) for i in idx],
                    inflight=[lane.b_inflight[i] for i in idx],
                    queued=[lane.b_queued[i] for i in idx],
                    requests=[lane.b_requests[i] for i in idx])
        return History(step_s=1.0, end=round(end, 3), series=series)

    def _lane(self, port: int, profile: str) -> _Lane:
        lane = self._lanes.get((port, profile))
        if lane is None:
            lane = self._lanes[(port, profile)] = _Lane(f"port-{port}/{profile}",
                                                        int(self.clock()))
        return lane


@dataclass(frozen=True)
class _Usage:
    prompt: int | None = None
    cached: int | None = None
    generated: int | None = None
    prefill_tps: float | None = None
    decode_tps: float | None = None
    decode_s: float | None = None  # how long the decode took (predicted_ms)


def _usage(t: Tally) -> _Usage:
    """llama-server's own figures for the request: ``timings`` (and ``usage``) of its last SSE
    events, or of its JSON body."""
    obj: object = None
    if t.stream:
        obj = _last_usage_event(bytes(t.tail))
    elif t.body and t.body_n and t.status < 300:
        try:
            obj = json.loads(b"".join(t.body))
        except ValueError:
            obj = None
    if not isinstance(obj, dict):
        return _Usage()
    timings, usage = obj.get("timings"), obj.get("usage")
    if isinstance(timings, dict):
        prompt_n, cache_n = _int(timings.get("prompt_n")), _int(timings.get("cache_n"))
        predicted_ms = _num(timings.get("predicted_ms"))
        return _Usage(
            prompt=(prompt_n or 0) + (cache_n or 0) if prompt_n is not None else None,
            cached=cache_n, generated=_int(timings.get("predicted_n")),
            prefill_tps=_r(_num(timings.get("prompt_per_second")), 1),
            decode_tps=_r(_num(timings.get("predicted_per_second")), 1),
            decode_s=predicted_ms / 1000.0 if predicted_ms is not None else None)
    if isinstance(usage, dict):  # an OpenAI-shaped upstream without llama-server's timings
        details = usage.get("prompt_tokens_details")
        return _Usage(prompt=_int(usage.get("prompt_tokens")),
                      cached=_int(details.get("cached_tokens"))
                      if isinstance(details, dict) else None,
                      generated=_int(usage.get("completion_tokens")))
    return _Usage()


def _events(tail: bytes) -> list[bytes]:
    """The whole SSE events in the tail of a stream (the first may be cut), their data."""
    return [e.strip() for e in tail.split(b"\n\n") if e.strip()]


def _last_usage_event(tail: bytes) -> object:
    for ev in reversed(_events(tail)):
        if b'"timings"' in ev or b'"usage"' in ev:
            data = ev.removeprefix(b"data:").strip()
            try:
                return json.loads(data)
            except ValueError:
                return None
    return None


def _not_tokens(tail: bytes) -> int:
    """How many of the stream's last events are not tokens ([DONE], the finish event with an
    empty delta, the usage event), when llama-server's timings did not say the exact count."""
    n = 0
    for ev in reversed(_events(tail)):
        if (ev.endswith(b"[DONE]") or b'"delta":{}' in ev or b'"delta": {}' in ev
                or b'"choices":[]' in ev or b'"stop":true' in ev):
            n += 1
        else:
            break
    return n


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _r(v: float | None, nd: int = 3) -> float | None:
    return round(v, nd) if v is not None else None
