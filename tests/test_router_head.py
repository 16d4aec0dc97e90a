"""router/head.py: sans-IO heads, golden-tested (bytes in, bytes out)."""

from __future__ import annotations

import pytest

from hydra_supervisor.router import head


def test_head_end_as_llama_server_reads_it() -> None:
    assert head.head_end(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nBODY") == 27
    # One empty line before the request line is skipped (a second one is the request line).
    assert head.head_end(b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n") == 29
    assert head.head_end(b"\r\n\r\nGET / HTTP/1.1\r\n\r\n") == 4  # refused at once
    assert head.head_end(b"GET / HTTP/1.1\r\nHost: x\r\n") is None
    # Lines end at CRLF only: a bare-LF head has not ended (llama-server waits too).
    assert head.head_end(b"GET / HTTP/1.1\nHost: x\n\n") is None
    assert head.head_end(b"GET / HTTP/1.1\r\nHost: x\n\n") is None
    # An invalid request line ends the head as soon as it is complete.
    assert head.head_end(b"get / HTTP/1.1\r\n") == 16


def test_head_limits() -> None:
    with pytest.raises(head.HeadError) as e:
        head.head_end(b"GET /" + b"a" * head.MAX_LINE)
    assert e.value.status == 0  # llama-server closes without a word
    with pytest.raises(head.HeadError) as e:
        head.head_end(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * head.MAX_HEADER_LINE)
    assert e.value.status == 400
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(head.MAX_HEADERS + 1))
    with pytest.raises(head.HeadError):
        head.head_end(b"GET / HTTP/1.1\r\n" + many + b"\r\n")
    ok = b"".join(b"X-%d: 1\r\n" % i for i in range(head.MAX_HEADERS))
    assert head.head_end(b"GET / HTTP/1.1\r\n" + ok + b"\r\n") is not None


def _refused(raw: bytes) -> int:
    with pytest.raises(head.HeadError) as e:
        head.parse_request(raw)
    return e.value.status


def test_parse_refuses_what_llama_server_refuses() -> None:
    assert _refused(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  folded\r\n\r\n") == 400
    assert _refused(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n\tfolded\r\n\r\n") == 400
    assert _refused(b"get / HTTP/1.1\r\n\r\n") == 400
    assert _refused(b"FOO / HTTP/1.1\r\n\r\n") == 400
    assert _refused(b"GET / HTTP/2.0\r\n\r\n") == 400
    assert _refused(b"GET / HTTP/1.1\n\n") == 400
    assert _refused(b"GET / HTTP/1.1\r\nHost: x\n\r\n\r\n") == 400  # LF in a value
    assert _refused(b"\r\n\r\nGET / HTTP/1.1\r\n\r\n") == 400
    assert _refused(b"POST / HTTP/1.1\r\nContent-Length: 25, 25\r\n\r\n") == 400
    assert _refused(b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n") == 400
    assert _refused(b"POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n") == 400
    assert _refused(b"POST / HTTP/1.1\r\nTransfer-Encoding: identity\r\n\r\n") == 400
    assert _refused(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n") == 400
    # Stricter than llama-server on purpose (it tolerates Content-Length: 0 here).
    assert _refused(b"POST / HTTP/1.1\r\nContent-Length: 0\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n") == 400
    assert _refused(b"POST / HTTP/1.1\r\nContent-Length: 4\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n") == 400


def test_parse_accepts_what_llama_server_accepts() -> None:
    r = head.parse_request(b"\r\nPOST /x HTTP/1.1\r\nHost: a\r\nhost: b\r\n"
                           b"Transfer-Encoding: gzip, chunked\r\n\r\n")
    assert r.method == b"POST" and r.target == b"/x" and r.version == b"1.1"
    assert r.headers == ((b"Host", b"a"), (b"host", b"b"),
                         (b"Transfer-Encoding", b"gzip, chunked"))
    assert r.chunked and r.length is None and r.keep_alive
    r = head.parse_request(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n")
    assert r.chunked
    r = head.parse_request(b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n"
                           b"X-Spaces:  v  \r\n\r\n")
    assert r.length == 5 and (b"X-Spaces", b"v") in r.headers
    r = head.parse_request(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert r.keep_alive and r.version == b"1.0"
    assert not head.parse_request(b"GET / HTTP/1.0\r\n\r\n").keep_alive
    assert not head.parse_request(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n").keep_alive
    r = head.parse_request(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\n"
                           b"Content-Length: 3\r\n\r\n")
    assert r.expect_continue
    assert r.h11_head() == (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                            b"Expect: 100-continue\r\n\r\n")


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
