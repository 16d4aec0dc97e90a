"""HTTP edges through hydra against llama-server on its own port (issue 30), by raw sockets.

`hydra up -p demo` runs (module-wide); every probe sends the same bytes to hydra's port and to
the head's own port (the llama-server hydra started) and compares what comes back: status
lines, header names (Connection and Keep-Alive are per leg and left out), framing (chunked,
sized, none), how many answers, and whether the connection closes after them. Where hydra is
stricter on purpose (docs/router.md, "Where the router is stricter"), the test asserts
hydra's documented answer instead.

Beside the framing families: pipelining with and without a half-close, HTTP/1.0 keep-alive,
a cancel at each phase of a streaming /completion (its slot idle in /slots within 1 s), an
early answer (a head started with --api-key: a 6 MiB POST without the key gets its 401), and
hydra's RSS under six concurrent 60 MiB uploads.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from hydra_supervisor.testing.front_door import Closed, Reader, connect, request, send_all
from hydra_supervisor.testing.harness import REPO, Up, make_env, wait_until

pytestmark = pytest.mark.slow

DEADLINE = 20.0
QUIET_S = 2.0  # "no answer": nothing within this long (both sides get the same wait)


@dataclass
class Ports:
    hydra: int
    head: int
    up: Up

    def both(self) -> list[tuple[str, int]]:
        return [("head", self.head), ("hydra", self.hydra)]


def _start(tmp: Path, *args: str) -> tuple[Up, int, int]:
    env = make_env(tmp)
    up = Up(env, [*args, "--port", "0"], tmp)
    up.wait_ready(180)
    from hydra_supervisor.testing.harness import snapshot
    port = next(p.port for p in snapshot(env).ports)
    return up, port, up.engine("head")["port"]


@pytest.fixture(scope="module")
def ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    tmp = tmp_path_factory.mktemp("edges")
    up, port, head_port = _start(tmp, "-p", "demo")
    try:
        yield Ports(port, head_port, up)
    finally:
        up.stop()
        up.kill_everything()


# --------------------------------------------------------------------------- probing


@dataclass(frozen=True)
class Answer:
    """What one connection got, in the terms the comparison uses."""

    statuses: tuple[bytes, ...]  # status lines, in order
    names: tuple[tuple[bytes, ...], ...]  # end-to-end header names of each
    framing: tuple[str, ...]  # chunked | sized | none, per answer
    end: str  # after the answers: closed | open | reset


def _framing(resp_head: list[tuple[bytes, bytes]]) -> str:
    for k, v in resp_head:
        if k.lower() == b"transfer-encoding" and b"chunked" in v.lower():
            return "chunked"
    for k, _ in resp_head:
        if k.lower() == b"content-length":
            return "sized"
    return "none"


def probe(port: int, data: bytes, *, answers: int = 1, shut_wr: bool = False,
          method: str = "GET", then: bytes | None = None) -> Answer:
    """Send ``data`` on a fresh connection (then half-close it if ``shut_wr``), read up to
    ``answers`` responses, send ``then`` (a next request on the same connection) and read its
    answer, then see whether the connection closes within QUIET_S."""
    sock = connect(port, DEADLINE)
    reader = Reader(sock)
    statuses: list[bytes] = []
    names: list[tuple[bytes, ...]] = []
    framing: list[str] = []
    with sock:
        ok = send_all(sock, data)
        if ok and shut_wr:
            sock.shutdown(socket.SHUT_WR)
        want = answers + (1 if then is not None else 0)
        while len(statuses) < want:
            if then is not None and len(statuses) == answers:
                if not send_all(sock, then):
                    break
            try:
                resp = reader.read_response(method, QUIET_S if not statuses else DEADLINE)
            except (Closed, TimeoutError, ConnectionResetError):
                break
            if resp is None:
                break
            statuses.append(resp.status_line)
            names.append(tuple(resp.end_to_end_names()))
            framing.append(_framing(resp.headers))
        try:
            end = "closed" if reader.closed_within(QUIET_S) else "open"
        except ConnectionResetError:
            end = "reset"
        except AssertionError:
            end = "more bytes"
        if reader.reset:
            end = "reset"
    return Answer(tuple(statuses), tuple(names), tuple(framing), end)


def same(ports: Ports, data: bytes, **kw: object) -> Answer:
    """Probe both ports with the same bytes; their answers must match. Returns hydra's."""
    head = probe(ports.head, data, **kw)  # type: ignore[arg-type]
    hydra = probe(ports.hydra, data, **kw)  # type: ignore[arg-type]
    assert hydra == head, f"\n head:  {head}\n hydra: {hydra}\n bytes: {data[:300]!r}"
    return hydra


def _tokenize(body: bytes = b'{"content": "hello world"}') -> bytes:
    return body


CHUNKED_BODY = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_tokenize()), _tokenize())


def _post(headers: list[tuple[str, str]], body: bytes, path: str = "/tokenize") -> bytes:
    return request("POST", path, body, headers=[("Content-Type", "application/json"),
                                                *headers])


# --------------------------------------------------------------------------- framing families

FRAMING: list[tuple[str, bytes]] = [
    ("two Host lines", b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
    ("Content-Length: 25, 25",
     _post([("Content-Length", "25, 25")], _tokenize()[:25])),
    ("two equal Content-Length lines",
     _post([("Content-Length", "26"), ("Content-Length", "26")], _tokenize())),
    ("two different Content-Length lines",
     _post([("Content-Length", "26"), ("Content-Length", "27")], _tokenize())),
    ("Content-Length: +26", _post([("Content-Length", "+26")], _tokenize())),
    ("Content-Length empty", _post([("Content-Length", "")], _tokenize())),
    ("Transfer-Encoding: chunked", _post([("Transfer-Encoding", "chunked")], CHUNKED_BODY)),
    ("Transfer-Encoding: gzip, chunked",
     _post([("Transfer-Encoding", "gzip, chunked")], CHUNKED_BODY)),
    ("Transfer-Encoding: chunked twice",
     _post([("Transfer-Encoding", "chunked"), ("Transfer-Encoding", "chunked")], CHUNKED_BODY)),
    ("Transfer-Encoding: identity", _post([("Transfer-Encoding", "identity")], b"")),
    ("Transfer-Encoding: chunked, gzip",
     _post([("Transfer-Encoding", "chunked, gzip")], CHUNKED_BODY)),
    ("unknown coding with Content-Length",
     _post([("Transfer-Encoding", "foo"), ("Content-Length", "26")], _tokenize())),
    ("chunked with Content-Length 26",
     _post([("Transfer-Encoding", "chunked"), ("Content-Length", "26")], CHUNKED_BODY)),
    ("obs-fold", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  folded\r\n\r\n"),
    ("bare-LF request line", b"GET /health HTTP/1.1\nHost: x\n\n"),
    ("leading CRLF", b"\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("two leading CRLF", b"\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("lowercase method", b"get /health HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("unknown method", b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("HTTP/2.0 version", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n"),
    ("three-word garbage line", b"hello there world\r\nHost: x\r\n\r\n"),
    ("98 extra header lines", request("GET", "/health", headers=[
        (f"X-H{i}", "1") for i in range(98)])),
    ("99 extra header lines", request("GET", "/health", headers=[
        (f"X-H{i}", "1") for i in range(99)])),
    ("100 extra header lines", request("GET", "/health", headers=[
        (f"X-H{i}", "1") for i in range(100)])),
    ("101 extra header lines", request("GET", "/health", headers=[
        (f"X-H{i}", "1") for i in range(101)])),
    ("a 9 KB header line", request("GET", "/health", headers=[("X-Big", "a" * 9000)])),
    ("a 40 KB request line", request("GET", "/health?x=" + "a" * 40000)),
    ("a header line without a colon", b"GET /health HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n"),
    ("a space before the colon", b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n"),
    ("a control byte in a value", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n"),
    ("chunked body with a bad size", _post([("Transfer-Encoding", "chunked")],
                                           b"zz\r\nabc\r\n0\r\n\r\n")),
    ("HTTP/1.0 without Host", b"GET /health HTTP/1.0\r\n\r\n"),
    ("HTTP/1.1 without Host", b"GET /health HTTP/1.1\r\n\r\n"),
]


@pytest.mark.parametrize(("label", "data"), FRAMING, ids=[c[0] for c in FRAMING])
def test_framing_as_llama_server(ports: Ports, label: str, data: bytes) -> None:
    same(ports, data, method="POST" if data.startswith(b"POST") else "GET")


def test_content_length_zero_with_chunked_is_refused(ports: Ports) -> None:
    """Stricter on purpose (docs/router.md): llama-server tolerates Content-Length: 0 beside
    Transfer-Encoding; behind a front proxy that frames by Content-Length that hides a request
    in the body. hydra answers llama-server's own 400 and closes."""
    data = _post([("Content-Length", "0"), ("Transfer-Encoding", "chunked")], CHUNKED_BODY)
    got = probe(ports.hydra, data, method="POST")
    assert [s.split(b" ")[1] for s in got.statuses] == [b"400"] and got.end == "closed", got


def test_a_200_kb_header_line(ports: Ports) -> None:
    """llama-server answers 400 and closes with most of the line unread (the close may then
    be a reset that eats the 400); hydra answers the same 400."""
    data = request("GET", "/health", headers=[("X-Big", "a" * 200_000)])
    head = probe(ports.head, data)
    hydra = probe(ports.hydra, data)
    assert head.statuses in ((), (b"HTTP/1.1 400 Bad Request",)), head
    assert hydra.statuses == (b"HTTP/1.1 400 Bad Request",) and hydra.end == "closed", hydra
    if head.statuses:
        assert hydra == head


def test_a_head_cut_by_the_close(ports: Ports) -> None:
    """Header lines ended by a bare LF are skipped by llama-server: the head never ends; a
    half-close then gets its 400."""
    same(ports, b"GET /health HTTP/1.1\r\nHost: x\n\n", shut_wr=True)


# --------------------------------------------------------------------------- connections


def test_http10_keep_alive_carries_a_second_request(ports: Ports) -> None:
    one = b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    got = same(ports, one, then=one)
    assert len(got.statuses) == 2, got


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("shut", [False, True], ids=["open", "half-closed"])
def test_pipelined(ports: Ports, n: int, shut: bool) -> None:
    reqs = [request("GET", "/health"), request("GET", "/v1/models"),
            _post([], _tokenize())][:n]
    got = same(ports, b"".join(reqs), answers=n, shut_wr=shut)
    assert len(got.statuses) == n and all(b" 200 " in s for s in got.statuses), got


def test_leading_crlf_before_a_second_request(ports: Ports) -> None:
    data = request("GET", "/health") + b"\r\n" + request("GET", "/health")
    got = same(ports, data, answers=2)
    assert len(got.statuses) == 2, got


def test_pipelined_half_closed_twenty_times(ports: Ports) -> None:
    """The issue's probe: two and three pipelined requests and a half-close, 20 runs each."""
    for n in (2, 3):
        data = b"".join([request("GET", "/health"), request("GET", "/v1/models"),
                         request("GET", "/health")][:n])
        for _ in range(20):
            got = probe(ports.hydra, data, answers=n, shut_wr=True)
            assert len(got.statuses) == n, got


# --------------------------------------------------------------------------- cancel


def _stream(n_predict: int = 2000) -> bytes:
    body = json.dumps({"prompt": "Tell me a long story about a dragon", "n_predict": n_predict,
                       "stream": True, "cache_prompt": False, "ignore_eos": True}).encode()
    return _post([], body, "/completion")


def _busy(head_port: int) -> bool:
    sock = connect(head_port, DEADLINE)
    with sock:
        assert send_all(sock, request("GET", "/slots"))
        resp = Reader(sock).read_response("GET", DEADLINE)
    assert resp is not None and resp.status == 200, resp
    return any(s.get("is_processing") for s in json.loads(resp.body))


def _events(reader: Reader, n: int) -> None:
    """Read the response head and ``n`` SSE events."""
    resp = reader.read_head(60.0)
    assert resp is not None and resp.status == 200, resp
    seen = 0
    deadline = time.monotonic() + 60.0
    while seen < n:
        while b"\n\n" not in reader.buf:
            assert reader._fill(deadline), "stream ended early"  # noqa: SLF001 - test reader
        i = reader.buf.index(b"\n\n")
        seen += reader.buf[:i].count(b"data: ")
        del reader.buf[:i + 2]


@pytest.mark.parametrize("phase", ["half-close before the first byte",
                                   "half-close after 5 events", "close after 5 events"])
@pytest.mark.parametrize("side", ["head", "hydra"])
def test_cancel_frees_the_slot_within_1s(ports: Ports, phase: str, side: str) -> None:
    wait_until(lambda: not _busy(ports.head) or None, DEADLINE, "slots idle before")
    port = ports.head if side == "head" else ports.hydra
    sock = connect(port, DEADLINE)
    reader = Reader(sock)
    try:
        assert send_all(sock, _stream())
        if phase.startswith("half-close before"):
            wait_until(lambda: _busy(ports.head) or None, 60, "the slot busy")
            sock.shutdown(socket.SHUT_WR)
        else:
            _events(reader, 5)
            assert _busy(ports.head)
            if phase.startswith("half-close"):
                sock.shutdown(socket.SHUT_WR)
            else:
                sock.close()
        t0 = time.monotonic()
        wait_until(lambda: not _busy(ports.head) or None, 1.0,
                   f"{side}: the slot idle within 1 s after the {phase}", interval=0.02)
        freed = time.monotonic() - t0
        print(f"{side} {phase}: slot idle after {freed:.3f} s")
    finally:
        sock.close()


def test_half_close_right_after_a_stream_ends_as_direct(ports: Ports) -> None:
    """The issue: hydra synthesized an SSE error event where llama-server gives a clean end."""
    endings = {}
    for name, port in ports.both():
        wait_until(lambda: not _busy(ports.head) or None, DEADLINE, "slots idle")
        sock = connect(port, DEADLINE)
        reader = Reader(sock)
        with sock:
            assert send_all(sock, _stream(64))
            sock.shutdown(socket.SHUT_WR)
            resp = reader.read_response("POST", 60.0, body=False)
            if resp is not None and resp.header("transfer-encoding"):
                reader.read_partial_chunked(resp, 60.0)
                endings[name] = (resp.status, resp.terminated, b'"error"' in resp.body)
            else:
                endings[name] = (resp.status if resp else 0, True, False)
    assert endings["hydra"] == endings["head"], endings


# --------------------------------------------------------------------------- early answers


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    tmp = tmp_path_factory.mktemp("keyed")
    prof = tmp / "keyed.yaml"
    prof.write_text((REPO / "profiles" / "demo.yaml").read_text()
                    .replace("profile: demo\n", "profile: keyed\n")
                    .replace("server_args:\n", "server_args:\n  api-key: K\n"))
    up, port, head_port = _start(tmp, "-p", str(prof))
    try:
        yield Ports(port, head_port, up)
    finally:
        up.stop()
        up.kill_everything()


def _upload(port: int, head: bytes, body_len: int, chunk: int = 1 << 20
            ) -> tuple[int | None, str]:
    """Send ``head`` and ``body_len`` bytes of body while reading the answer (a client that
    reads as it sends, as curl does). (status or None, how the send ended)."""
    sock = connect(port, 120.0)
    reader = Reader(sock)
    sent = ["ok"]

    def send() -> None:
        try:
            sock.sendall(head)
            left = body_len
            block = b"x" * chunk
            while left > 0:
                n = min(left, chunk)
                sock.sendall(block[:n])
                left -= n
        except OSError as e:
            sent[0] = type(e).__name__

    t = threading.Thread(target=send, daemon=True)
    t.start()
    with sock:
        try:
            resp = reader.read_response("POST", 120.0)
        except (Closed, ConnectionResetError, TimeoutError):
            resp = None
        t.join(120.0)
    return (resp.status if resp is not None else None), sent[0]


@pytest.mark.parametrize("mib", [1, 6])
def test_early_401_passes_through(keyed: Ports, mib: int) -> None:
    size = mib << 20
    head = (b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % size)
    direct, _ = _upload(keyed.head, head, size)
    got, how = _upload(keyed.hydra, head, size)
    assert direct == 401, f"premise: llama-server answered {direct}"
    assert got == 401, f"hydra answered {got} (send: {how})"


def test_early_404_passes_through(ports: Ports) -> None:
    """An unknown path with a 6 MiB body: whatever llama-server answers, hydra answers."""
    size = 6 << 20
    head = (b"POST /no-such-path HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
    direct, _ = _upload(ports.head, head, size)
    got, how = _upload(ports.hydra, head, size)
    assert got == direct, f"head {direct}, hydra {got} (send: {how})"


def test_large_chunked_body_streams_as_direct(ports: Ports) -> None:
    """A 3 MiB chunked body (over the 1 MiB the router keeps, so it streams, re-chunked):
    llama-server reads it all either way and answers the same."""
    body = b"".join(b"%x\r\n%s\r\n" % (1 << 16, b"y" * (1 << 16)) for _ in range(48))
    data = _post([("Transfer-Encoding", "chunked")], body + b"0\r\n\r\n")
    got = same(ports, data, method="POST")
    assert got.statuses and b" 200 " not in got.statuses[0], got  # not JSON: refused


# --------------------------------------------------------------------------- memory


def test_six_60_mib_uploads_keep_hydra_under_300_mib(ports: Ports) -> None:
    """Bodies stream: six concurrent 60 MiB uploads (not JSON: llama-server refuses them
    once read) and hydra's RSS, sampled all along, stays under 300 MiB."""
    size = 60 << 20
    head = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % size)
    proc = psutil.Process(ports.up.proc.pid)
    peak = [proc.memory_info().rss]
    before = peak[0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results: list[tuple[int | None, str]] = []
    uploads = [threading.Thread(target=lambda: results.append(_upload(ports.hydra, head, size)),
                                daemon=True) for _ in range(6)]
    for t in uploads:
        t.start()
    for t in uploads:
        t.join(300)
    stop.set()
    sampler.join(5)
    print(f"hydra RSS before {before / 2**20:.0f} MiB, peak {peak[0] / 2**20:.0f} MiB; "
          f"answers {results}")
    assert len(results) == 6 and all(s is not None for s, _ in results), results
    assert peak[0] < 300 * 2**20, f"hydra peak RSS {peak[0] / 2**20:.0f} MiB"
