"""router/head.py: sans-IO heads, golden-tested (bytes in, bytes out)."""

from __future__ import annotations

import pytest

from hydra_supervisor.router import head


def test_head_end_finds_the_blank_line_and_skips_leading_empty_lines() -> None:
    assert head.head_end(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nBODY") == 27
    assert head.head_end(b"\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n") == 31
    assert head.head_end(b"GET / HTTP/1.1\r\nHost: x\r\n") is None
    assert head.head_end(b"GET / HTTP/1.1\nHost: x\n\n") == 24  # bare LF, as h11 accepts


def test_obs_fold_is_refused_as_llama_server_refuses_it() -> None:
    with pytest.raises(head.HeadError) as e:
        head.prepare_request_head(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  folded\r\n\r\n")
    assert e.value.status == 400
    with pytest.raises(head.HeadError):
        head.prepare_request_head(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n\tfolded\r\n\r\n")


def test_missing_host_is_lent_for_h11_only_on_http11() -> None:
    given, lent = head.prepare_request_head(b"GET /health HTTP/1.1\r\nAccept: */*\r\n\r\n")
    assert lent and given == b"GET /health HTTP/1.1\r\nhost: \r\nAccept: */*\r\n\r\n"
    raw = b"GET /health HTTP/1.0\r\n\r\n"
    assert head.prepare_request_head(raw) == (raw, False)
    raw = b"GET /health HTTP/1.1\r\nHOST: a\r\n\r\n"
    assert head.prepare_request_head(raw) == (raw, False)


def test_framing_conflict_both_length_and_chunked() -> None:
    assert head.framing_conflict([(b"content-length", b"5"), (b"transfer-encoding", b"chunked")])
    assert head.framing_conflict([(b"content-length", b"5")]) is None
    assert head.framing_conflict([(b"transfer-encoding", b"chunked")]) is None


def test_request_head_keeps_names_and_order_and_sets_our_length() -> None:
    out = head.request_head(b"POST", b"/v1/chat/completions?x=1", b"1.1",
                            [(b"Host", b"a:1"), (b"X-Trace", b"Z"),
                             (b"Authorization", b"Bearer k")], 12)
    assert out == (b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a:1\r\nX-Trace: Z\r\n"
                   b"Authorization: Bearer k\r\nContent-Length: 12\r\n\r\n")
    assert head.request_head(b"GET", b"/", b"1.0", [], None) == b"GET / HTTP/1.0\r\n\r\n"


LLAMA = [(b"Server", b"llama.cpp"), (b"Access-Control-Allow-Origin", b""),
         (b"Content-Type", b"application/json; charset=utf-8"), (b"Content-Length", b"15"),
         (b"Keep-Alive", b"timeout=5, max=100")]


def test_response_head_as_sent_while_the_client_stays() -> None:
    out = head.response_head(b"1.1", 200, b"OK", LLAMA, close=False)
    assert out == (b"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nAccess-Control-Allow-Origin: \r\n"
                   b"Content-Type: application/json; charset=utf-8\r\nContent-Length: 15\r\n"
                   b"Keep-Alive: timeout=5, max=100\r\n\r\n")


def test_response_head_says_close_when_the_client_leg_closes() -> None:
    out = head.response_head(b"1.1", 200, b"OK", LLAMA, close=True)
    assert out.endswith(b"Content-Length: 15\r\nConnection: close\r\n\r\n")
    assert b"Keep-Alive" not in out
    # An upstream `Connection: close` (its leg) becomes keep-alive where the client's stays.
    out = head.response_head(b"1.1", 204, b"No Content", [(b"Connection", b"close")], close=False)
    assert out == b"HTTP/1.1 204 No Content\r\nConnection: keep-alive\r\n\r\n"
    out = head.response_head(b"1.1", 204, b"No Content", [(b"Connection", b"close")], close=True)
    assert out == b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"


def test_chunks_and_trailers() -> None:
    assert head.chunk(b"data: x\n\n") == b"9\r\ndata: x\n\n\r\n"
    assert head.chunk(b"") == b""
    assert head.last_chunk() == b"0\r\n\r\n"
    assert head.last_chunk([(b"X-Sum", b"1")]) == b"0\r\nX-Sum: 1\r\n\r\n"


def test_empty_chunked_end() -> None:
    assert head.empty_chunked_end(b"0\r\n\r\n") == 5
    assert head.empty_chunked_end(b"0\r\n\r\nHTTP/1.1") == 5
    assert head.empty_chunked_end(b"0\r\nX-A: 1\r\n\r\n") == 13
    assert head.empty_chunked_end(b"0\r\n") is None
    assert head.empty_chunked_end(b"") is None


def test_tokens() -> None:
    assert head.tokens([(b"connection", b"Keep-Alive, Upgrade")], b"connection") == {
        b"keep-alive", b"upgrade"}
