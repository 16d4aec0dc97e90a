"""What the request-aware leg's parsing costs per request, on the CPU alone (no sockets):
router/head.py's own parse of a streaming chat request's head, h11's parse of it (the session's
server side, head and body), the request as it goes upstream (`Outgoing`), and h11's parse of
llama-server's SSE response head (the response parser's set-up included). Issue 30, item 3:
what replacing h11 could buy at most. Then, per streamed event, the body pump's framing of one
SSE event and its token count.

  .venv/bin/python bench/router_parse.py            # microseconds per call, best of 5
"""

from __future__ import annotations

import sys
import timeit
from collections.abc import Callable
from pathlib import Path

import h11

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hydra_supervisor.router import head  # noqa: E402
from hydra_supervisor.router.pump import BodyFraming, take  # noqa: E402
from hydra_supervisor.router.traffic import Traffic  # noqa: E402
from hydra_supervisor.router.upstream import Outgoing  # noqa: E402
from hydra_supervisor.testing.routerhelp import stream_request  # noqa: E402
from hydra_supervisor.testing.sse_upstream import chunk_event  # noqa: E402

# llama-server's head for a streamed chat completion (the pinned build, as seen on the wire)
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\nContent-Type: "
            b"text/event-stream\r\nServer: llama.cpp\r\nTransfer-Encoding: chunked\r\n"
            b"Access-Control-Allow-Origin: \r\n\r\n")


def per_call_us(fn: Callable[[], object], n: int = 5000) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def main() -> int:
    req = stream_request(tokens=16)
    end = head.head_end(bytearray(req))
    assert end is not None
    raw, body = req[:end], req[end:]
    parsed = head.parse_request(raw)
    fwd = Outgoing(parsed, body)

    def h11_request() -> None:
        h = h11.Connection(h11.SERVER, max_incomplete_event_size=65536)
        h.receive_data(parsed.h11_head() + body)
        for _ in range(3):  # Request, Data, EndOfMessage
            h.next_event()

    def h11_response() -> None:
        up = fwd.parser()
        up.receive_data(SSE_HEAD)
        up.next_event()

    rows = [
        ("router/head.py: head_end + parse_request", lambda: head.parse_request(
            raw) if head.head_end(bytearray(req)) else None),
        ("h11: the request (head and body)", h11_request),
        ("Outgoing: the request as it goes up", lambda: Outgoing(parsed, body)),
        ("h11: the response head (parser set-up included)", h11_response),
    ]
    total_h11 = 0.0
    for name, fn in rows:
        us = per_call_us(fn)
        if name.startswith("h11"):
            total_h11 += us
        print(f"{name:52s} {us:7.1f} us")
    print(f"{'h11 per request, both heads':52s} {total_h11:7.1f} us")
    # Per streamed event, after the head: the body pump's framing of one whole chunk (one SSE
    # event, as llama-server writes it) and the token count of the request table.
    event = chunk_event(1, "hello")
    wire = head.chunk(event)
    traffic = Traffic()
    tally = traffic.begin(1, "POST", "/v1/chat/completions", "127.0.0.1")
    tally.routed("p", None)
    tally.upstream()
    tally.head(200, True)
    framing = BodyFraming("chunked")
    per_event = [
        ("per event: pump.take's framing (one whole chunk)", lambda: take(framing, wire, None)),
        ("per event: Tally.data (the token count)", lambda: tally.data(event)),
    ]
    for name, fn in per_event:
        print(f"{name:52s} {per_call_us(fn, 50000):7.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
