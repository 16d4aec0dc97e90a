"""Raw HTTP/1.1 on a socket for the front-door tests (tests/test_front_door_*.py): send bytes as
they are, read responses as the server wrote them (header names in their case and order, the
chunked framing kept), and tell an answer from a close; and bursts of simultaneous new
connections (also used by bench/router.py part b2). Every read has a deadline.

h11 is not used as the client parser on purpose: it lower-cases header names and re-frames
bodies, and these tests compare exactly those bytes between llama-server and the router.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

HOST = "127.0.0.1"
DEADLINE = 10.0
MAX_HEAD = 256 * 1024
ANSWER_S = 20.0  # one request's deadline in a burst, with hundreds of others in the way


@dataclass
class RawResponse:
    """One response as read off the wire."""

    head: bytes  # status line and header lines, without the blank line that ends them
    status: int
    status_line: bytes
    headers: list[tuple[bytes, bytes]]  # (name as sent, value), in order
    body: bytes = b""  # the payload (de-chunked)
    raw_body: bytes = b""  # the bytes after the head, as sent (chunk framing included)
    chunked: bool = False
    terminated: bool = True  # a chunked body ended with its last-chunk; a sized one complete
    trailers: list[bytes] = field(default_factory=list)

    @property
    def names(self) -> list[bytes]:
        return [k for k, _ in self.headers]

    def header(self, name: str) -> bytes | None:
        """The first value of ``name`` (case-insensitive), or None."""
        want = name.lower().encode()
        for k, v in self.headers:
            if k.lower() == want:
                return v
        return None

    def says_close(self) -> bool:
        conn = self.header("connection")
        return conn is not None and b"close" in conn.lower()

    def end_to_end_names(self) -> list[bytes]:
        """Header names less the per-leg hop-by-hop ones (Connection, Keep-Alive)."""
        return [k for k in self.names if k.lower() not in (b"connection", b"keep-alive")]


class Closed(Exception):
    """The server closed (or reset) the connection before a whole response arrived."""

    def __init__(self, what: str, got: bytes) -> None:
        super().__init__(f"{what} ({len(got)} bytes read: {got[:200]!r})")
        self.got = got


class Reader:
    """Responses from one connection, in order; bytes beyond a response stay buffered."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.eof = False
        self.reset = False

    def _fill(self, deadline: float) -> bool:
        """Read more into buf; False at EOF or reset. TimeoutError at the deadline."""
        if self.eof:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no bytes before the deadline ({len(self.buf)} buffered: "
                               f"{bytes(self.buf[:200])!r})")
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            raise TimeoutError(f"no bytes before the deadline ({len(self.buf)} buffered: "
                               f"{bytes(self.buf[:200])!r})") from None
        except (ConnectionResetError, BrokenPipeError):
            self.eof = self.reset = True
            return False
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def _take_line(self, deadline: float, what: str) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return line
            if not self._fill(deadline):
                raise Closed(f"closed inside {what}", bytes(self.buf))

    def _take(self, n: int, deadline: float, what: str) -> bytes:
        while len(self.buf) < n:
            if not self._fill(deadline):
                raise Closed(f"closed inside {what}", bytes(self.buf))
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def take_exactly(self, n: int, timeout: float = DEADLINE) -> bytes:
        """The next n bytes as they are (Closed on EOF, TimeoutError on the deadline)."""
        return self._take(n, time.monotonic() + timeout, f"{n} raw bytes")

    def read_head(self, timeout: float = DEADLINE) -> RawResponse | None:
        """The next response head; None when the server closed before sending a byte of it."""
        deadline = time.monotonic() + timeout
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i >= 0:
                break
            if len(self.buf) > MAX_HEAD:
                raise AssertionError(f"response head over {MAX_HEAD} bytes")
            if not self._fill(deadline):
                if not self.buf:
                    return None
                raise Closed("closed inside a response head", bytes(self.buf))
        head = bytes(self.buf[:i])
        del self.buf[: i + 4]
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise AssertionError(f"not an HTTP status line: {lines[0]!r}")
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            assert sep, f"malformed header line {line!r}"
            headers.append((name, value.strip()))
        return RawResponse(head=head, status=int(parts[1]), status_line=lines[0],
                           headers=headers)

    def read_response(self, method: str = "GET", timeout: float = DEADLINE,
                      body: bool = True) -> RawResponse | None:
        """The next whole response (interim 1xx responses are returned on their own, as they
        come); None when the server closed before sending a byte of it. ``body=False`` reads
        only the head (for a response whose framing the caller checks itself)."""
        deadline = time.monotonic() + timeout
        resp = self.read_head(timeout)
        if resp is None or not body:
            return resp
        if resp.status < 200 or resp.status in (204, 304) or method == "HEAD":
            return resp
        te = resp.header("transfer-encoding")
        cl = resp.header("content-length")
        raw = bytearray()
        if te is not None and b"chunked" in te.lower():
            resp.chunked = True
            data = bytearray()
            while True:
                line = self._take_line(deadline, "a chunk size line")
                raw += line + b"\r\n"
                size = int(line.split(b";", 1)[0].strip() or b"x", 16)
                if size == 0:
                    while True:  # trailers, then the blank line
                        t = self._take_line(deadline, "the chunked trailer")
                        raw += t + b"\r\n"
                        if not t:
                            break
                        resp.trailers.append(t)
                    break
                chunk = self._take(size + 2, deadline, "a chunk")
                raw += chunk
                data += chunk[:-2]
            resp.body, resp.raw_body = bytes(data), bytes(raw)
        elif cl is not None:
            resp.body = resp.raw_body = self._take(int(cl), deadline, "a sized body")
        else:  # close-delimited
            while self._fill(deadline):
                pass
            resp.body = resp.raw_body = bytes(self.buf)
            self.buf.clear()
        return resp

    def read_partial_chunked(self, resp: RawResponse, timeout: float = DEADLINE) -> RawResponse:
        """For a chunked response: read chunks until the last-chunk, or until the server closes
        (then ``terminated`` is False and ``body`` has what came)."""
        deadline = time.monotonic() + timeout
        data = bytearray()
        raw = bytearray()
        resp.chunked = True
        try:
            while True:
                line = self._take_line(deadline, "a chunk size line")
                raw += line + b"\r\n"
                size = int(line.split(b";", 1)[0].strip() or b"x", 16)
                if size == 0:
                    while True:
                        t = self._take_line(deadline, "the chunked trailer")
                        raw += t + b"\r\n"
                        if not t:
                            break
                    resp.terminated = True
                    break
                chunk = self._take(size + 2, deadline, "a chunk")
                raw += chunk
                data += chunk[:-2]
        except Closed as e:
            raw += e.got
            resp.terminated = False
        resp.body, resp.raw_body = bytes(data), bytes(raw)
        return resp

    def closed_within(self, timeout: float) -> bool:
        """True when the server closes (EOF or reset) within ``timeout`` without sending more;
        False when the connection is still open then. Unexpected bytes fail the test."""
        deadline = time.monotonic() + timeout
        try:
            while self._fill(deadline):
                pass
        except TimeoutError:
            assert not self.buf, f"unexpected bytes after the response: {bytes(self.buf)!r}"
            return False
        assert not self.buf, f"unexpected bytes before the close: {bytes(self.buf)!r}"
        return True


def connect(port: int, timeout: float = DEADLINE) -> socket.socket:
    s = socket.create_connection((HOST, port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def send_all(sock: socket.socket, data: bytes, timeout: float = DEADLINE) -> bool:
    """sendall with a deadline; False when the server closed or reset the connection first."""
    sock.settimeout(timeout)
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def request(method: str, path: str, body: bytes | None = None, *, version: str = "1.1",
            host: str | None = HOST, headers: list[tuple[str, str]] | None = None,
            close: bool = False) -> bytes:
    """One request's bytes. ``host=None``: no Host header. A body gets a Content-Length
    unless ``headers`` frames it already."""
    lines = [f"{method} {path} HTTP/{version}"]
    if host is not None:
        lines.append(f"Host: {host}")
    extra = list(headers or [])
    framed = any(k.lower() in ("content-length", "transfer-encoding") for k, _ in extra)
    if body is not None and not framed:
        extra.append(("Content-Length", str(len(body))))
    if close:
        extra.append(("Connection", "close"))
    lines += [f"{k}: {v}" for k, v in extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def exchange(port: int, data: bytes, *, method: str = "GET", responses: int = 1,
             shut_wr: bool = False, timeout: float = DEADLINE,
             ) -> tuple[list[RawResponse], Reader, socket.socket]:
    """Send ``data`` on a new connection and read up to ``responses`` responses (fewer if the
    server closes first). The caller closes the socket (it stays open for a next request)."""
    sock = connect(port, timeout)
    out: list[RawResponse] = []
    reader = Reader(sock)
    try:
        if send_all(sock, data, timeout) and shut_wr:
            sock.shutdown(socket.SHUT_WR)
        finals = 0
        while finals < responses:
            try:
                resp = reader.read_response(method, timeout)
            except Closed:
                resp = None
            if resp is None:
                break
            out.append(resp)
            if resp.status >= 200:  # an interim 1xx: its final response follows
                finals += 1
    except BaseException:
        sock.close()
        raise
    return out, reader, sock


def outcome(port: int, data: bytes, method: str = "GET", timeout: float = DEADLINE) -> str:
    """What a server does with one request on a fresh connection, in one word for comparing:
    the status code, or ``closed`` (no response before the close or reset)."""
    resps, _reader, sock = exchange(port, data, method=method, timeout=timeout)
    sock.close()
    return str(resps[0].status) if resps else "closed"


# --------------------------------------------------------------------------- bursts


def ask(port: int, data: bytes, method: str = "GET", timeout: float = ANSWER_S) -> str:
    """One request on a new connection, summed up in one word: ``200``, ``503+retry-after``,
    another status, or how it failed (``reset``, ``closed``, ``timeout``, ``connect: ...``)."""
    try:
        sock = connect(port, timeout)
    except OSError as e:
        return f"connect: {type(e).__name__}"
    with sock:
        reader = Reader(sock)
        try:
            sock.sendall(data)
            resp = reader.read_response(method, timeout)
        except TimeoutError:
            return "timeout"
        except (ConnectionResetError, BrokenPipeError):
            return "reset"
        except Closed:
            return "closed mid-response"
        if resp is None:
            return "reset" if reader.reset else "closed"
        if resp.status == 503:
            return "503+retry-after" if resp.header("retry-after") is not None else "503"
        return str(resp.status)


def answered(word: str) -> bool:
    return word in ("200", "503+retry-after")


def burst(port: int, n: int, make: Callable[[int], tuple[bytes, str]],
          timeout: float = ANSWER_S) -> collections.Counter[str]:
    """``n`` threads open a connection each at the same moment (a barrier), send their request
    and read the answer. Counts the answers (see ask)."""
    barrier = threading.Barrier(n)
    words: list[str] = ["not run"] * n

    def one(i: int) -> None:
        data, method = make(i)
        try:
            barrier.wait(30.0)
        except threading.BrokenBarrierError:
            words[i] = "barrier broken"
            return
        words[i] = ask(port, data, method, timeout)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30.0 + timeout + 10.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "burst threads did not finish in time"
    return collections.Counter(words)
