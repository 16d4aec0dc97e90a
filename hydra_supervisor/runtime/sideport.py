"""A bounded HTTP server for a WSGI app on a loopback side port (the metrics and the dashboard:
runtime/metrics.py). Whoever connects to it, and however many, it costs hydra a bounded number
of descriptors, threads and bytes.

One thread runs an asyncio loop that accepts, reads each request's head (h11, at most
`max_head` bytes) within `head_timeout` and its body (at most `max_body` bytes, else 413 without
reading it) within `body_timeout`, and only then hands the complete request to one of `workers`
threads, which runs the WSGI app with the standard library's wsgiref handler (so the app sees
the environ wsgiref's simple server gave it, and the response is wsgiref's: HTTP/1.0, one
request per connection). The loop writes the response within `write_timeout` and closes.

At most `max_conns` connections are open. A connection past that takes the place of the oldest
one still silent (no complete head) for `evict_after` seconds; when none is, it is answered
503 (at most `max_lingering` such replies linger a second for the client to read them; past
that the connection is reset). asyncio accepts up to `backlog` connections in one go before
it hands them over, and each of them may evict one whose socket asyncio closes on the loop's
next turn, so the side port holds at most max_conns + max_lingering + 2 × backlog + 1
descriptors (64 + 16 + 128 + 1 by default), and an idle socket costs a descriptor until its
head deadline or its eviction, and no thread.
Out of descriptors (EMFILE) the accept loop waits a second and tries again (asyncio's own
back-off), and says so in hydra's log at most once a minute.

Counts (`stats()`): open, open_peak, served, refused (cap), evicted, timed_out, too_large,
bad_request, accept_failed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import logging
import queue
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from types import TracebackType
from wsgiref import simple_server
from wsgiref.handlers import SimpleHandler
from wsgiref.types import WSGIApplication, WSGIEnvironment

import h11

log = logging.getLogger("hydra.metrics")

LINGER_S = 1.0  # after a reply: how long the client's last bytes are read before closing


@dataclass(frozen=True)
class Limits:
    """What one side port may cost (docs/dashboard.md, "Limits")."""

    max_conns: int = 64  # connections open at once (descriptors)
    workers: int = 4  # threads running the app (a dashboard action holds one while it runs)
    head_timeout: float = 10.0  # from accept to a complete request head
    body_timeout: float = 10.0  # from the head to the end of the body
    write_timeout: float = 30.0  # to hand the response to a client that reads
    max_head: int = 16 * 1024  # request line and headers
    max_body: int = 64 * 1024  # the dashboard's actions send a few bytes of JSON
    evict_after: float = 1.0  # a silent connection this old gives its place to a new one
    backlog: int = 64  # also how many asyncio accepts in one go
    max_lingering: int = 16  # refused connections told 503 for up to LINGER_S


def _reply(code: int, reason: str, text: str, *extra: tuple[str, str]) -> bytes:
    body = (text + "\n").encode()
    head = [f"HTTP/1.0 {code} {reason}", "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(body)}", "Connection: close",
            *(f"{k}: {v}" for k, v in extra)]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


BUSY = _reply(503, "Service Unavailable", "hydra's metrics port is busy: too many connections "
              "are open; try again", ("Retry-After", "1"))


class _Handler(SimpleHandler):
    """wsgiref's handler, as its simple server runs it (same headers, same error page); its
    tracebacks go to hydra's log."""

    server_software = simple_server.software_version
    http_version = "1.0"

    def log_exception(self, exc_info: tuple[type[BaseException], BaseException, TracebackType]
                      | tuple[None, None, None]) -> None:
        env: WSGIEnvironment = getattr(self, "environ", {})
        log.error("side port: the app failed on %s %s", env.get("REQUEST_METHOD"),
                  env.get("PATH_INFO"), exc_info=exc_info)


@dataclass
class _Conn:
    task: asyncio.Task[None]
    since: float
    silent: bool = True  # no complete head yet: may be evicted


@dataclass(frozen=True)
class _Job:
    """A complete request for a worker; the answer goes to `fut` on `loop`."""

    environ: WSGIEnvironment
    body: bytes
    fut: asyncio.Future[bytes]
    loop: asyncio.AbstractEventLoop


class SidePort:
    """Serves `app` on `host:port` (see the module's doc). `start()` binds (OSError when it
    cannot) and starts the loop thread; `stop()` is bounded."""

    def __init__(self, host: str, port: int, app: WSGIApplication, *, limits: Limits | None = None,
                 name: str = "hydra-metrics") -> None:
        self.host = host
        self.limits = limits or Limits()
        self._req_port = port
        self._app = app
        self._name = name
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: collections.OrderedDict[int, _Conn] = collections.OrderedDict()
        self._ids = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        # every key from the start: stats() copies it from other threads while the loop counts
        self._counts: collections.Counter[str] = collections.Counter(dict.fromkeys(
            ("served", "refused", "evicted", "timed_out", "too_large", "bad_request",
             "accept_failed"), 0))
        self._peak = 0
        self._accept_logged = -1e9
        self._lingering = 0  # refused connections still being told so
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self._req_port), family=family,
                                    backlog=self.limits.backlog, reuse_port=False)
        sock.setblocking(False)
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        loop = self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(loop, sock, started),
                                        name=self._name, daemon=True)
        self._thread.start()
        for i in range(self.limits.workers):
            w = threading.Thread(target=self._work, name=f"{self._name}-worker-{i}", daemon=True)
            w.start()
            self._workers.append(w)
        started.wait(5.0)

    def stop(self, timeout: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(self._close)
        thread.join(timeout)
        for _ in self._workers:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for w in self._workers:
            w.join(max(0.0, deadline - time.monotonic()))
        self._workers = []
        self._loop = self._thread = None

    def stats(self) -> dict[str, int]:
        """Counts since start (a plain copy; read from any thread)."""
        return {"open": len(self._conns), "open_peak": self._peak, **self._counts}

    # -- the loop's thread ----------------------------------------------------------------------

    def _run(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
             started: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(self._loop_error)
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._accepted, sock=sock, limit=self.limits.max_head,
                                     backlog=self.limits.backlog))
            started.set()
            loop.run_forever()
        finally:
            started.set()
            for t in asyncio.all_tasks(loop):
                t.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop),
                                                       return_exceptions=True))
            loop.close()

    def _loop_error(self, loop: asyncio.AbstractEventLoop,
                    context: dict[str, object]) -> None:
        """asyncio's own reports: out of descriptors on accept (it waits 1 s and tries again:
        counted, and logged at most once a minute), anything else logged as it says."""
        exc = context.get("exception")
        if context.get("message") == "socket.accept() out of system resource":
            self._counts["accept_failed"] += 1
            now = time.monotonic()
            if now - self._accept_logged >= 60.0:
                self._accept_logged = now
                log.warning("metrics port %d: cannot accept connections (%s); trying again "
                            "every second (%d failed accept() calls so far)", self.port,
                            getattr(exc, "strerror", None) or exc, self._counts["accept_failed"])
            return
        log.error("metrics port %d: %s", self.port, context.get("message"),
                  exc_info=exc if isinstance(exc, BaseException) else None)

    def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns.values()):
            c.task.cancel()
        asyncio.get_running_loop().stop()

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A new connection (the loop's thread): its place, or 503 at once."""
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        if len(self._conns) >= self.limits.max_conns and not self._evict(now):
            self._counts["refused"] += 1
            if self._lingering < self.limits.max_lingering:  # 503 said and heard, bounded too
                self._lingering += 1
                loop.create_task(self._refuse(reader, writer))
            else:
                writer.transport.abort()
            return
        self._ids += 1
        cid = self._ids
        task = loop.create_task(self._serve(cid, reader, writer))
        self._conns[cid] = _Conn(task, now)
        self._peak = max(self._peak, len(self._conns))

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._write(writer, BUSY, LINGER_S)
            await self._linger(reader)
        except (TimeoutError, OSError):
            pass
        finally:
            self._lingering -= 1
            writer.transport.abort()

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, data: bytes, timeout: float) -> None:
        """Send `data` and the end of the stream within `timeout` (TimeoutError)."""
        writer.transport.set_write_buffer_limits(high=0)  # drain() = all of it sent
        async with asyncio.timeout(timeout):
            writer.write(data)
            if writer.can_write_eof():
                writer.write_eof()
            await writer.drain()

    @staticmethod
    async def _linger(reader: asyncio.StreamReader) -> None:
        """Read what the client still sends until it closes (at most LINGER_S): closing with
        unread bytes would reset the connection, and the client could lose the reply."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_S):
                while await reader.read(65536):
                    pass

    def _evict(self, now: float) -> bool:
        """Close the oldest connection still silent after `evict_after` (True), if one is."""
        for cid, c in self._conns.items():
            if c.silent and now - c.since >= self.limits.evict_after:
                self._counts["evicted"] += 1
                c.task.cancel()
                del self._conns[cid]
                return True
            if now - c.since < self.limits.evict_after:
                return False  # ordered by age: the rest are younger
        return False

    async def _serve(self, cid: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        try:
            got = await self._request(cid, reader, writer)
            if got is not None:
                data, answered = got
                await self._write(writer, data, self.limits.write_timeout)
                if answered:
                    self._counts["served"] += 1
                await self._linger(reader)
        except TimeoutError:
            self._counts["timed_out"] += 1
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            self._conns.pop(cid, None)
            writer.transport.abort()  # all sent, or a silent or stuck client

    async def _request(self, cid: int, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> tuple[bytes, bool] | None:
        """The response for one request, and whether the app gave it (False: the side port
        refused the request itself); None: the client closed before asking anything."""
        lim = self.limits
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=lim.max_head)
        try:
            async with asyncio.timeout(lim.head_timeout):
                req = await self._next(conn, reader)
            if not isinstance(req, h11.Request):
                return None
            c = self._conns.get(cid)
            if c is not None:
                c.silent = False
            length = _content_length(req)
            if length is not None and length > lim.max_body:
                self._counts["too_large"] += 1
                return _reply(413, "Content Too Large",
                              f"request body over {lim.max_body} bytes"), False
            body = bytearray()
            async with asyncio.timeout(lim.body_timeout):
                while True:
                    ev = await self._next(conn, reader)
                    if isinstance(ev, h11.Data):
                        body += ev.data
                        if len(body) > lim.max_body:
                            self._counts["too_large"] += 1
                            return _reply(413, "Content Too Large",
                                          f"request body over {lim.max_body} bytes"), False
                    elif isinstance(ev, h11.EndOfMessage):
                        break
                    else:
                        return None  # closed mid-body
        except h11.RemoteProtocolError as exc:
            self._counts["bad_request"] += 1
            code = exc.error_status_hint
            return _reply(code, "Bad Request" if code == 400 else "Error", str(exc)), False
        environ = self._environ(req, writer)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._jobs.put(_Job(environ, bytes(body), fut, asyncio.get_running_loop()))
        return await fut, True

    @staticmethod
    async def _next(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
        while True:
            ev = conn.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            conn.receive_data(await reader.read(8192))

    def _environ(self, req: h11.Request, writer: asyncio.StreamWriter) -> WSGIEnvironment:
        """The CGI part of the environ, as wsgiref's WSGIRequestHandler.get_environ makes it
        (its handler adds os.environ and the wsgi.* keys)."""
        peer = writer.get_extra_info("peername")
        local = writer.get_extra_info("sockname")
        target = req.target.decode("latin-1")
        path, _, query = target.partition("?")
        env: WSGIEnvironment = {
            "SERVER_NAME": self.host, "GATEWAY_INTERFACE": "CGI/1.1",
            "SERVER_PORT": str(self.port), "REMOTE_HOST": "", "CONTENT_LENGTH": "",
            "SCRIPT_NAME": "", "SERVER_PROTOCOL": f"HTTP/{req.http_version.decode()}",
            "SERVER_SOFTWARE": simple_server.WSGIRequestHandler.server_version,
            "REQUEST_METHOD": req.method.decode("latin-1"),
            "PATH_INFO": urllib.parse.unquote(path, "iso-8859-1"), "QUERY_STRING": query,
            "REMOTE_ADDR": peer[0] if peer else "", "CONTENT_TYPE": "text/plain",
            # both ends of the connection: the dashboard asks the kernel which user is the peer
            "hydra.peer": peer, "hydra.local": local,
        }
        for raw_name, raw_value in req.headers:
            name = raw_name.decode("latin-1")
            value = raw_value.decode("latin-1").strip()
            if name == "content-type":
                env["CONTENT_TYPE"] = value
                continue
            if name == "content-length":
                env["CONTENT_LENGTH"] = value
                continue
            key = "HTTP_" + name.replace("-", "_").upper()
            env[key] = f"{env[key]},{value}" if key in env else value
        return env

    # -- the workers ----------------------------------------------------------------------------

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            environ, fut, loop = job.environ, job.fut, job.loop
            try:
                data = self._call(environ, job.body)
            except Exception as exc:  # noqa: BLE001 - the worker lives on
                log.exception("side port: %s %s failed", environ.get("REQUEST_METHOD"),
                              environ.get("PATH_INFO"))
                data = _reply(500, "Internal Server Error", f"internal error: {exc}")
            with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                loop.call_soon_threadsafe(_settle, fut, data)

    def _call(self, environ: WSGIEnvironment, body: bytes) -> bytes:
        out = io.BytesIO()
        handler = _Handler(io.BytesIO(body), out, io.StringIO(), environ,
                           multithread=True, multiprocess=False)
        handler.run(self._app)
        return out.getvalue()


def _settle(fut: asyncio.Future[bytes], data: bytes) -> None:
    if not fut.done():
        fut.set_result(data)


def _content_length(req: h11.Request) -> int | None:
    for name, value in req.headers:
        if name == b"content-length":
            return int(value)  # h11 checked it is digits
    return None
