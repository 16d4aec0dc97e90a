"""The body pump: one thread per router that moves every response body still streaming.

Why: an HTTP session thread that relays a stream itself pays, per SSE event, a poll, a recv
and a send, each releasing and taking the GIL again, against every other session thread doing
the same: with 32 streams that was ~17 futex calls and ~100 us of CPU per event (bench/router.py
part h), three times the byte relay. Here a session writes the response head and the bytes that
came with it itself (the first byte is not delayed by a hand-off), then hands the rest to the
pump and blocks on one event until the body has ended. The pump waits on all its bodies with
one epoll, and per event does a recv, a framing step (``BodyFraming``, pure) and a
non-blocking send, with nobody to contend with for the GIL. A body of known length (a whole
JSON answer, usually a read or two) moves on the session's own thread the same way
(``here``): handing it over would put two thread switches on its way for nothing.

What the pump watches for, as the session did:
- the body's end in the upstream's framing (chunked, Content-Length, or the close);
- the upstream closing or failing first (a crash, or the gate cutting the flight: its socket
  is shut, router/gate.py), reported as ``upstream_closed``;
- the client shutting its side (EPOLLRDHUP with nothing left to read): passed on at once as a
  half-close of the upstream connection, so llama-server stops generating and frees its slot;
  unread bytes (a pipelined next request) stop the watch, as in the session;
- the client failing (EPOLLERR/HUP, a send error) or not reading for ``send_timeout``
  seconds: ``client_gone``;
- a client slower than the upstream: the upstream is not read while the client's unsent bytes
  wait (at most one read's worth held per body).

Chunked bodies are forwarded as whole chunks (each payload piece with its own chunk header,
the trailer section as sent): what the client has is always at a chunk boundary, so a
stream cut mid-way can still be ended with an error event and the last chunk.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from hydra_supervisor.router import head
from hydra_supervisor.router.traffic import Tally

log = logging.getLogger("hydra.router")

RECV = 65536  # bytes per read, both legs
_MAX_LINE = 4096  # a chunk-size line (llama-server's are a few hex digits)
_MAX_TRAILER = 64 * 1024
_HEX = frozenset(b"0123456789abcdefABCDEF")

# BodyFraming states (chunked)
_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)
# Ready descriptors taken per wait (the rest come with the next one; the default would make
# CPython allocate room for 1,023 on every wait).
_MAX_EVENTS = 256


class FramingError(Exception):
    """The upstream's body framing is broken (a bad chunk size, a missing CRLF)."""


class BodyFraming:
    """Where a response body ends, in the framing its head gave: ``chunked``, ``length``
    (Content-Length ``length``) or ``eof`` (the body ends with the connection). Fed the bytes
    as they come; pure, no I/O."""

    __slots__ = ("kind", "left", "state", "line", "trailer", "crlf", "done", "extra")

    def __init__(self, kind: str, length: int = 0) -> None:
        if kind not in ("chunked", "length", "eof"):
            raise ValueError(f"unknown body framing {kind!r}")
        self.kind = kind
        self.left = length
        self.state = _SIZE
        self.line = b""  # a chunk-size or trailer line not complete yet
        self.trailer = bytearray()
        self.crlf = 0  # bytes of the CRLF after a chunk's data seen so far
        self.done = kind == "length" and length == 0
        self.extra = False  # bytes came after the body's end (the connection is not reusable)

    def feed(self, data: bytes, payload: list[bytes]) -> bytes:
        """What of ``data`` goes to the client (a chunked body re-framed as whole chunks);
        the body's payload pieces are appended to ``payload``. Raises FramingError."""
        if self.done:
            self.extra = self.extra or bool(data)
            return b""
        if self.kind == "eof":
            if data:
                payload.append(data)
            return data
        if self.kind == "length":
            if len(data) <= self.left:
                self.left -= len(data)
                self.done = self.left == 0
                if data:
                    payload.append(data)
                return data
            piece = data[:self.left]
            self.left = 0
            self.done = True
            self.extra = True
            payload.append(piece)
            return piece
        return self._chunked(data, payload)

    def whole_chunk(self, data: bytes) -> bytes | None:
        """When ``data`` is exactly one whole chunk of a chunked body at a chunk's start, its
        size line as head.chunk writes it: that chunk's payload (``data`` goes to the client
        as it came: re-framing it would give the same bytes). Else None: ``feed`` it. The
        per-event path: llama-server writes each SSE event as one chunk."""
        if self.state != _SIZE or self.line or self.kind != "chunked":
            return None
        i = data.find(b"\n")
        if not 1 < i <= 17 or data[i - 1] != 0x0D or not data.endswith(b"\r\n"):
            return None
        try:
            size = int(data[:i - 1], 16)
        except ValueError:
            return None
        if size <= 0 or len(data) != i + 3 + size or data[:i + 1] != b"%x\r\n" % size:
            return None  # the last chunk, more than one chunk, or a size line written otherwise
        return data[i + 1:i + 1 + size]

    def _chunked(self, data: bytes, payload: list[bytes]) -> bytes:
        out: list[bytes] = []
        pos, n = 0, len(data)
        while pos < n:
            state = self.state
            if state == _DATA:
                take = min(self.left, n - pos)
                piece = data[pos:pos + take]
                pos += take
                self.left -= take
                payload.append(piece)
                out.append(head.chunk(piece))
                if not self.left:
                    self.state = _DATA_END
            elif state == _SIZE or state == _TRAILER:
                i = data.find(b"\n", pos)
                if i < 0:
                    self.line += data[pos:]
                    if len(self.line) > _MAX_LINE:
                        raise FramingError("chunk-size line too long")
                    break
                line = self.line + data[pos:i + 1] if self.line else data[pos:i + 1]
                self.line = b""
                pos = i + 1
                if state == _SIZE:
                    size = _chunk_size(line)
                    if size:
                        self.left = size
                        self.state = _DATA
                    else:
                        self.state = _TRAILER
                elif line in (b"\r\n", b"\n"):
                    out.append(b"0\r\n" + bytes(self.trailer) + b"\r\n")
                    self.state = _DONE
                    self.done = True
                    if pos < n:
                        self.extra = True
                    break
                else:
                    self.trailer += line
                    if len(self.trailer) > _MAX_TRAILER:
                        raise FramingError("trailer section too long")
            elif state == _DATA_END:
                want = b"\r\n"[self.crlf]
                if data[pos] != want:
                    raise FramingError("chunk data not followed by CRLF")
                pos += 1
                self.crlf += 1
                if self.crlf == 2:
                    self.crlf = 0
                    self.state = _SIZE
            else:  # pragma: no cover - _DONE returns above
                break
        return out[0] if len(out) == 1 else b"".join(out)


def take(framing: BodyFraming, data: bytes, tally: Tally | None) -> bytes:
    """What of ``data`` goes to the client, its payload counted (tokens as they stream)."""
    piece = framing.whole_chunk(data)
    if piece is not None:
        if tally is not None:
            tally.data(piece)
        return data
    payload: list[bytes] = []
    out = framing.feed(data, payload)
    if tally is not None:
        for piece in payload:
            tally.data(piece)
    return out


def _chunk_size(line: bytes) -> int:
    s = line.rstrip(b"\r\n").split(b";", 1)[0].strip(b" \t")
    if not s or len(s) > 16 or not _HEX.issuperset(s):
        raise FramingError(f"bad chunk size {line[:40]!r}")
    return int(s, 16)


# BodyJob results
RUNNING, OK, UPSTREAM_CLOSED, CLIENT_GONE, STOPPED = "", "ok", "upstream_closed", "client_gone", \
    "stopped"


class BodyJob:
    """One response body for the pump. The session fills it, hands it over and waits; the
    pump alone touches it (and both sockets) until ``done`` is set."""

    __slots__ = ("up", "client", "framing", "tally", "watch", "send_timeout", "on_sent",
                 "pending", "blocked_since", "result", "why", "client_shut", "sent", "done")

    def __init__(self, up: socket.socket, client: socket.socket, framing: BodyFraming,
                 tally: Tally | None, *, watch: bool, send_timeout: float | None,
                 on_sent: Callable[[int], None] | None = None) -> None:
        self.up = up
        self.client = client
        self.framing = framing
        self.tally = tally
        self.watch = watch  # pass the client's half-close on to the upstream
        self.send_timeout = send_timeout  # a client that reads nothing this long is gone
        self.on_sent = on_sent  # bytes written to the client (the connection's counters)
        self.pending = b""  # written by nobody yet: the client was not ready
        self.blocked_since = 0.0
        self.result = RUNNING
        self.why = ""
        self.client_shut = False  # the client shut its side; the upstream was told
        self.sent = 0
        self.done = threading.Event()


_IN = select.EPOLLIN
_OUT = select.EPOLLOUT
_RDHUP = select.EPOLLRDHUP
_GONE = select.EPOLLERR | select.EPOLLHUP


class BodyPump:
    """The router's one body-moving thread (module docstring). ``run`` is called by session
    threads; ``start`` and ``stop`` by the router."""

    def __init__(self, name: str, thread_factory: Callable[..., threading.Thread] =
                 threading.Thread, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._thread_factory = thread_factory
        self._clock = clock
        self._lock = threading.Lock()
        self._new: collections.deque[BodyJob] = collections.deque()
        self._thread: threading.Thread | None = None
        self._wake_fd: int | None = None
        self._stopping = False

    def start(self) -> None:
        with self._lock:
            self._stopping = False
            self._ensure_running()

    def _ensure_running(self) -> bool:  # under the lock
        """Whether the pump's thread runs (started now if not: a thread that could not be
        started, or died of a bug, is tried again at the next body)."""
        if self._thread is not None and self._thread.is_alive():
            return True
        if self._wake_fd is None:
            self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        thread = self._thread_factory(target=self._loop, args=(self._wake_fd,),
                                      name=f"router-{self.name}-pump", daemon=True)
        try:
            thread.start()
        except RuntimeError as e:  # out of threads: each body moves on its session's thread
            log.warning("router %s: body pump thread not started (%s); bodies move on their "
                        "sessions' threads meanwhile", self.name, e)
            self._thread = None
            return False
        self._thread = thread
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Every body still moving ends with ``stopped``; the thread exits."""
        with self._lock:
            self._stopping = True
            thread = self._thread
            self._wake()
        if thread is not None:
            thread.join(timeout)

    def run(self, job: BodyJob, here: bool = False) -> None:
        """Move ``job``'s body; returns once it ended (``job.result``). ``here``: on the
        calling thread, not the pump's (a body that comes in one or two reads: handing it
        over and waking for its end would cost two thread switches on its way)."""
        with self._lock:
            if self._stopping:
                job.result, job.why = STOPPED, "router stopped"
                return
            pumping = not here and self._ensure_running()
            if pumping:
                self._new.append(job)
                self._wake()
        if pumping:
            job.done.wait()
        else:
            self._run_here(job)

    def _run_here(self, job: BodyJob) -> None:
        """Move one body on the calling thread (asked for, or no pump thread: out of
        threads)."""
        moving = _Moving(self._clock)
        try:
            moving.add(job)
            while not job.result:
                moving.turn()
        finally:
            moving.end_all("router stopped")
            moving.ep.close()

    def _wake(self) -> None:  # under the lock
        if self._wake_fd is not None:
            os.eventfd_write(self._wake_fd, 1)

    # ------------------------------------------------------------------ the pump's thread

    def _loop(self, wake_fd: int) -> None:
        moving = _Moving(self._clock)
        try:
            moving.ep.register(wake_fd, _IN)
            while True:
                if wake_fd in moving.turn():
                    try:
                        os.eventfd_read(wake_fd)
                    except BlockingIOError:
                        pass
                    if self._take_new(moving):
                        return
        except Exception:
            log.exception("router %s: the body pump failed; its bodies end", self.name)
            moving.end_all("body pump failed")
        finally:
            moving.ep.close()

    def _take_new(self, moving: _Moving) -> bool:
        """Take the jobs handed over; True when the pump is to stop (every job ended)."""
        with self._lock:
            new = list(self._new)
            self._new.clear()
            stopping = self._stopping
        for job in new:
            if stopping:
                moving.finish(job, STOPPED, "router stopped")
            else:
                moving.add(job)
        if stopping:
            moving.end_all("router stopped")
        return stopping


class _Moving:
    """The bodies the pump's thread moves now, and what it does per event. Only that thread
    uses it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.ep = select.epoll()
        self.jobs: dict[int, tuple[BodyJob, bool]] = {}  # fd -> (job, is the upstream side)
        self.blocked: set[BodyJob] = set()  # unsent bytes wait for the client

    def add(self, job: BodyJob) -> None:
        ufd, cfd = job.up.fileno(), job.client.fileno()
        self.jobs[ufd] = (job, True)
        self.jobs[cfd] = (job, False)
        self.ep.register(ufd, _IN)
        self.ep.register(cfd, _RDHUP if job.watch else 0)

    def turn(self) -> list[int]:
        """One wait and what it brought: each body's events handled and the clients' send
        deadlines checked. Returns the other descriptors that were ready (the pump's wake-up;
        a body's that ended earlier in the same wait)."""
        timeout = self.next_deadline() if self.blocked else -1
        other = []
        for fd, ev in self.ep.poll(timeout, _MAX_EVENTS):
            entry = self.jobs.get(fd)
            if entry is None:
                other.append(fd)
                continue
            job, upstream = entry
            if upstream:
                self.from_upstream(job)
            else:
                self.at_client(job, ev)
        if timeout >= 0:
            self.expire()
        return other

    def end_all(self, why: str) -> None:
        for job in {id(j): j for j, _ in self.jobs.values()}.values():
            self.finish(job, STOPPED, why)

    def finish(self, job: BodyJob, result: str, why: str = "") -> None:
        if job.result:
            return
        for s in (job.up, job.client):
            fd = s.fileno()
            if fd >= 0 and self.jobs.pop(fd, None) is not None:
                try:
                    self.ep.unregister(fd)
                except OSError:
                    pass
        self.blocked.discard(job)
        job.result, job.why = result, why
        job.done.set()

    def from_upstream(self, job: BodyJob) -> None:
        try:
            data = job.up.recv(RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.finish(job, UPSTREAM_CLOSED, f"upstream error: {e.strerror or e}")
            return
        if not data:
            if job.framing.kind == "eof":
                job.framing.done = True
                self.finish(job, OK)
            else:
                self.finish(job, UPSTREAM_CLOSED, "upstream closed mid-response")
            return
        try:
            out = take(job.framing, data, job.tally)
        except FramingError as e:
            self.finish(job, UPSTREAM_CLOSED, f"upstream framing: {e}")
            return
        if out:
            self.send(job, out)
        if job.framing.done and not job.pending:
            self.finish(job, OK)

    def send(self, job: BodyJob, data: bytes) -> None:
        try:
            n = job.client.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self.finish(job, CLIENT_GONE, f"client error: {e.strerror or e}")
            return
        job.sent += n
        if job.on_sent is not None and n:
            job.on_sent(n)
        if n < len(data):
            # The client is not reading as fast as the upstream writes: the upstream is not
            # read until what it sent is taken.
            job.pending = data[n:]
            job.blocked_since = self.clock()
            self.blocked.add(job)
            self.ep.modify(job.up.fileno(), 0)
            self.ep.modify(job.client.fileno(), _OUT | (_RDHUP if job.watch else 0))

    def at_client(self, job: BodyJob, ev: int) -> None:
        if ev & _GONE:
            self.finish(job, CLIENT_GONE, "client closed")
            return
        if ev & _RDHUP and job.watch:
            job.watch = False
            try:
                peek = job.client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                peek = b"?"
            except OSError as e:
                self.finish(job, CLIENT_GONE, f"client error: {e.strerror or e}")
                return
            if not peek:  # shut, nothing unread: as llama-server's own client would look
                job.client_shut = True
                try:
                    job.up.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            # else a pipelined next request: read after this response, as in the session
            self.ep.modify(job.client.fileno(), _OUT if job.pending else 0)
        if ev & _OUT and job.pending:
            data, job.pending = job.pending, b""
            self.blocked.discard(job)
            self.ep.modify(job.client.fileno(), _RDHUP if job.watch else 0)
            self.ep.modify(job.up.fileno(), _IN)
            self.send(job, data)
            if job.framing.done and not job.pending:
                self.finish(job, OK)

    def next_deadline(self) -> float:
        """Seconds to the first client send timeout among blocked bodies (-1: none)."""
        first: float | None = None
        for job in self.blocked:
            if job.send_timeout is not None:
                t = job.blocked_since + job.send_timeout
                first = t if first is None or t < first else first
        if first is None:
            return -1
        return max(0.0, first - self.clock()) + 0.001

    def expire(self) -> None:
        now = self.clock()
        for job in list(self.blocked):
            if job.send_timeout is not None and now - job.blocked_since >= job.send_timeout:
                self.finish(job, CLIENT_GONE, "client error: timed out")
