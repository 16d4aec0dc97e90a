"""The control API: HTTP + JSON on a unix socket in the state dir (mode 0600); the client side
is control_client.py.

The server is the standard library's HTTP server on a unix stream socket, one thread per
request. Handlers never act themselves: they hand a coroutine to the daemon's event loop
(asyncio.run_coroutine_threadsafe) and wait for its answer, so processes are only ever spawned
from the loop's thread. Routes:

  GET  /status                    the live snapshot (also what `hydra status` shows)
  POST /switch   {"profile", ...} a switch; the reply is its report (phases, result, error)
  POST /restart  {"engine"}       a planned restart of one process
  POST /reload                    re-read the running profile, apply the difference
  POST /down                      stop hydra (the reply comes before the stop completes)

(Runtime reconfigure by tiers is the wire protocol's CONFIGURE: `hydra configure`, wire/.)
Errors are {"error": message} with 400 (bad input), 404 (no such route), 409 (busy), 500
(internal error; a restart that did not come back), 503 (hydra is stopping), 504 (the loop did
not answer in call_timeout); exits.of_reply maps them to exit statuses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import http.server
import json
import logging
import os
import socketserver
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from hydra_supervisor.runtime.control_client import NotRunning, call

__all__ = ["ControlServer", "NotRunning", "call"]

log = logging.getLogger("hydra")

MAX_BODY = 64 << 10  # bytes: the largest request body read (a switch's is ~100)

Handler = Callable[[dict[str, Any]], Coroutine[Any, Any, tuple[int, dict[str, Any]]]]


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    routes: dict[tuple[str, str], Handler]
    loop: asyncio.AbstractEventLoop
    call_timeout: float
    replied: Callable[[], None] | None


class _RequestHandler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        log.debug("control: " + format, *args)

    def address_string(self) -> str:
        return "unix"

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        handler = self.server.routes.get((method, path))
        if handler is None:
            self._reply(404, {"error": f"no such control route: {method} {path}"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._reply(400, {"error": "Content-Length is not a number"})
            return
        if not 0 <= length <= MAX_BODY:  # a request here is a few bytes: never read more
            self.close_connection = True
            self._reply(413, {"error": f"request body of {length} bytes: the control API "
                                       f"takes at most {MAX_BODY}"})
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}") if length else {}
        except ValueError:
            self._reply(400, {"error": "request body is not JSON"})
            return
        if not isinstance(body, dict):
            self._reply(400, {"error": "request body must be a JSON object"})
            return
        fut = asyncio.run_coroutine_threadsafe(handler(body), self.server.loop)
        try:
            code, reply = fut.result(self.server.call_timeout)
        except TimeoutError:
            fut.cancel()
            code, reply = 504, {"error": "hydra did not answer in time"}
        except concurrent.futures.CancelledError:
            # hydra is stopping (Ctrl-C, SIGTERM, hydra down) while this request ran
            code, reply = 503, {"error": "hydra is stopping; the request was not completed"}
        except Exception as exc:  # noqa: BLE001 - the handler's bug must not kill the thread
            log.exception("control %s %s failed", method, path)
            code, reply = 500, {"error": f"internal error: {type(exc).__name__}: {exc}"
                                         .rstrip(": ") + " (hydra.log has the traceback)"}
        try:
            self._reply(code, reply)
        finally:
            if self.server.replied is not None:  # the daemon publishes what it held back
                self.server.replied()

    def do_GET(self) -> None:  # noqa: N802 - stdlib's name
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802 - stdlib's name
        self._handle("POST")


class ControlServer:
    """Serves `routes` on a unix socket; handlers run on `loop`. `replied` is told (on the
    request's thread) after each reply has been written."""

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop,
                 routes: dict[tuple[str, str], Handler], call_timeout: float = 3600.0,
                 replied: Callable[[], None] | None = None) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a stale socket of a dead hydra (the state-dir lock says it is)
        old = os.umask(0o177)
        try:
            self._srv = _Server(str(path), _RequestHandler)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self._srv.routes = routes
        self._srv.loop = loop
        self._srv.call_timeout = call_timeout
        self._srv.replied = replied
        self._thread = threading.Thread(target=self._srv.serve_forever, name="control",
                                        kwargs={"poll_interval": 0.2}, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
