"""The body pump's framing (router/pump.py ``BodyFraming``): pure, fed bytes as they come.
Golden cases, every split point of a stream, and the broken framings an upstream could send.
The pump's I/O (half-close passed on, a slow client, a cut) is exercised through the router by
tests/test_router_http.py and tests/test_http_edges.py."""

from __future__ import annotations

import socket
import threading

import pytest

from hydra_supervisor.router.pump import (
    CLIENT_GONE,
    OK,
    STOPPED,
    UPSTREAM_CLOSED,
    BodyFraming,
    BodyJob,
    BodyPump,
    FramingError,
    take,
)

SSE = (b"18\r\ndata: {\"content\":\"hi\"}\n\n\r\n"
       b"e\r\ndata: [DONE]\n\n\r\n"
       b"0\r\n\r\n")


def feed_all(f: BodyFraming, pieces: list[bytes]) -> tuple[bytes, list[bytes]]:
    out, payload = b"", []
    for p in pieces:
        out += f.feed(p, payload)
    return out, payload


def test_chunked_whole_is_forwarded_as_sent() -> None:
    f = BodyFraming("chunked")
    out, payload = feed_all(f, [SSE])
    assert out == SSE
    assert payload == [b'data: {"content":"hi"}\n\n', b"data: [DONE]\n\n"]
    assert f.done and not f.extra


@pytest.mark.parametrize("cut", range(1, len(SSE)))
def test_chunked_split_anywhere_gives_the_same_payload_and_valid_chunks(cut: int) -> None:
    f = BodyFraming("chunked")
    out, payload = feed_all(f, [SSE[:cut], SSE[cut:]])
    assert b"".join(payload) == b'data: {"content":"hi"}\n\ndata: [DONE]\n\n'
    assert f.done
    # what the client got parses to the same body (a piece split mid-chunk is re-framed)
    g = BodyFraming("chunked")
    again, payload2 = feed_all(g, [out])
    assert g.done and b"".join(payload2) == b"".join(payload) and again == out


@pytest.mark.parametrize("read", [
    b"18\r\ndata: {\"content\":\"hi\"}\n\n\r\n",  # one whole event: forwarded as it came
    b"18\r\ndata: {\"content\":\"hi\"}\n\nxx",  # whole length, no CRLF after it
    b"018\r\ndata: {\"content\":\"hi\"}\n\n\r\n",  # a size line written otherwise
    b"18;x=1\r\ndata: {\"content\":\"hi\"}\n\n\r\n",  # an extension
    b"18\ndata: {\"content\":\"hi\"}\n\n\r\n",  # bare LF after the size
    b"18\r\ndata: {\"content\":\"hi\"}\n\n\r\ne\r\n",  # more after the chunk
])
def test_one_read_one_chunk_matches_the_byte_by_byte_reading(read: bytes) -> None:
    """A read holding exactly one whole chunk (its size line as hydra writes it) is taken
    whole and goes out as it came (the per-event path); anything else is left to ``feed``.
    Either way the payload is what feeding the same bytes one at a time gives."""
    fast, slow = BodyFraming("chunked"), BodyFraming("chunked")
    piece = fast.whole_chunk(read)
    canonical = read.startswith(b"18\r\n") and read.endswith(b"\n\n\r\n")
    assert (piece is not None) == canonical
    try:
        ref_out, ref_payload = feed_all(slow, [bytes([b]) for b in read])
    except FramingError:
        assert piece is None
        with pytest.raises(FramingError):
            take(BodyFraming("chunked"), read, None)
        return
    out = take(BodyFraming("chunked"), read, None)
    if piece is not None:
        assert piece == b"".join(ref_payload) and out == read
        assert (fast.state, fast.left, fast.crlf) == (slow.state, slow.left, slow.crlf)
    g = BodyFraming("chunked")
    assert b"".join(feed_all(g, [out])[1]) == b"".join(
        feed_all(BodyFraming("chunked"), [ref_out])[1])


def test_chunked_byte_by_byte() -> None:
    f = BodyFraming("chunked")
    _out, payload = feed_all(f, [bytes([b]) for b in SSE])
    assert b"".join(payload) == b'data: {"content":"hi"}\n\ndata: [DONE]\n\n' and f.done


def test_chunk_extensions_dropped_trailers_kept() -> None:
    f = BodyFraming("chunked")
    out, payload = feed_all(f, [b"3;name=v\r\nabc\r\n0\r\nX-T: 1\r\n\r\n"])
    assert payload == [b"abc"]
    assert out == b"3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n"
    assert f.done


def test_bytes_after_the_end_mark_the_connection_unusable() -> None:
    f = BodyFraming("chunked")
    feed_all(f, [b"0\r\n\r\nHTTP/1.1 200 OK\r\n"])
    assert f.done and f.extra


@pytest.mark.parametrize("bad", [b"zz\r\n", b"0x1\r\n", b"\r\n", b"1_0\r\n", b"-1\r\n",
                                 b"1\r\nab\r\n", b"1\r\naXY"])
def test_broken_chunked_framing_raises(bad: bytes) -> None:
    with pytest.raises(FramingError):
        feed_all(BodyFraming("chunked"), [bad])


def test_overlong_size_line_raises() -> None:
    with pytest.raises(FramingError):
        feed_all(BodyFraming("chunked"), [b"1" * 5000])


def test_length_exact_short_and_extra() -> None:
    f = BodyFraming("length", 5)
    assert feed_all(f, [b"ab", b"cde"]) == (b"abcde", [b"ab", b"cde"]) and f.done
    assert not f.extra
    g = BodyFraming("length", 3)
    assert feed_all(g, [b"abcdef"]) == (b"abc", [b"abc"]) and g.done and g.extra
    assert BodyFraming("length", 0).done


def test_eof_body_never_ends_by_itself() -> None:
    f = BodyFraming("eof")
    assert feed_all(f, [b"abc", b"def"]) == (b"abcdef", [b"abc", b"def"])
    assert not f.done


# -- the pump itself, on socket pairs (fault modes a real llama-server will not show on demand)


def _job(pump_up: socket.socket, client: socket.socket, kind: str = "chunked",
         timeout: float | None = 5.0) -> BodyJob:
    return BodyJob(pump_up, client, BodyFraming(kind), None, watch=True, send_timeout=timeout)


def _run(pump: BodyPump, job: BodyJob) -> threading.Thread:
    job.up.setblocking(False)
    job.client.setblocking(False)
    t = threading.Thread(target=pump.run, args=(job,), daemon=True)
    t.start()
    return t


@pytest.fixture
def pump() -> BodyPump:
    p = BodyPump("test")
    p.start()
    yield p
    p.stop()


def test_pump_moves_a_body_and_ends_at_its_last_chunk(pump: BodyPump) -> None:
    up_r, up_w = socket.socketpair()
    cl_r, cl_w = socket.socketpair()
    job = _job(up_r, cl_w)
    t = _run(pump, job)
    up_w.sendall(SSE)
    assert job.done.wait(5)
    t.join(5)
    assert job.result == OK and job.sent == len(SSE)
    cl_r.settimeout(5)
    got = b""
    while len(got) < len(SSE):
        got += cl_r.recv(65536)
    assert got == SSE


def test_pump_upstream_closing_mid_body_is_reported(pump: BodyPump) -> None:
    up_r, up_w = socket.socketpair()
    _cl_r, cl_w = socket.socketpair()
    job = _job(up_r, cl_w)
    _run(pump, job)
    up_w.sendall(SSE[:20])
    up_w.close()
    assert job.done.wait(5)
    assert job.result == UPSTREAM_CLOSED


def test_pump_passes_a_client_half_close_upstream(pump: BodyPump) -> None:
    up_r, up_w = socket.socketpair()
    cl_r, cl_w = socket.socketpair()
    job = _job(up_r, cl_w)
    _run(pump, job)
    up_w.sendall(SSE[:10])
    cl_r.shutdown(socket.SHUT_WR)  # the client shut its side
    up_w.settimeout(5)
    assert up_w.recv(10) == b""  # the upstream sees the half-close at once
    up_w.sendall(SSE[10:])
    assert job.done.wait(5)
    assert job.result == OK and job.client_shut


def test_pump_a_client_that_stops_reading_times_out(pump: BodyPump) -> None:
    up_r, up_w = socket.socketpair()
    _cl_r, cl_w = socket.socketpair()
    cl_w.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    job = _job(up_r, cl_w, kind="eof", timeout=0.3)
    _run(pump, job)
    up_w.setblocking(False)
    for _ in range(200):  # until the client's buffers are full
        try:
            up_w.send(b"x" * 65536)
        except BlockingIOError:
            break
    assert job.done.wait(10)
    assert job.result == CLIENT_GONE and "timed out" in job.why


def test_pump_stop_ends_every_body(pump: BodyPump) -> None:
    up_r, _up_w = socket.socketpair()
    _cl_r, cl_w = socket.socketpair()
    job = _job(up_r, cl_w)
    t = _run(pump, job)
    pump.stop()
    assert job.done.wait(5)
    t.join(5)
    assert job.result == STOPPED
    late = _job(*socket.socketpair())
    pump.run(late)  # after stop: ends at once
    assert late.result == STOPPED


class _NoStart(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_without_its_thread_the_pump_moves_a_body_on_the_callers() -> None:
    p = BodyPump("test", thread_factory=_NoStart)
    p.start()  # logs, does not raise
    up_r, up_w = socket.socketpair()
    cl_r, cl_w = socket.socketpair()
    job = _job(up_r, cl_w)
    up_w.sendall(SSE)
    up_r.setblocking(False)
    cl_w.setblocking(False)
    p.run(job)
    assert job.result == OK and job.sent == len(SSE)
    cl_r.settimeout(5)
    assert cl_r.recv(65536) == SSE
